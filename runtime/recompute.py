"""Activation recomputation at run time: a stage whose plan says ``recompute == "full"`` checkpoints each block,
one whose plan says ``"selective"`` its first ``recompute_layers`` blocks.

A stage module (an ``fx.GraphModule``) is cut into *blocks*: runs of
consecutive compute nodes of one layer (:func:`partitioner.graph.ir.layer_of` of
the node's module: ``layers.3``, ``model.layers.3``, ``lm_head``), with
root-level glue (a residual add, ``x.view``) joining the block before it (or
the first block, when it leads).  :class:`Recomputed` runs each block under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: a block keeps only
its inputs after the forward and computes its activations again during the
backward, which is what the planner charges a recomputing stage (its blocks'
inputs per micro-batch, plus one block's activations during each backward).
With ``layers=N`` (selective recomputation, the plan's ``recompute_layers``;
Megatron-LM's ``--recompute-method block --recompute-num-layers N``) only the
first N blocks run under checkpoint and the others keep their activations,
which the planner charges as their activations plus the first N blocks' inputs.

Numbers do not change: the backward re-runs the same ops on the same inputs,
and checkpoint restores the random-number state (CPU and the inputs' devices)
and the autocast state of the forward for the recomputation, so dropout masks
and autocast dtypes are the same as the first time.

The blocks share the stage's parameters (they read them through the stage
module at every call), so the optimizer, DDP and state dicts see the stage
module's parameters only, under their original names.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> gm = capture(m, (torch.randn(3, 4),)).graph_module
    >>> block_nodes(gm)
    [('_0',), ('_1',), ('_2',)]
    >>> run = Recomputed(gm)
    >>> x = torch.randn(3, 4)
    >>> torch.equal(run(x)[0], gm(x)[0])  # a captured graph returns its flat outputs
    True
    >>> Recomputed(gm, layers=2).recomputed  # the first two blocks only
    2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from partitioner.errors import InternalError, PlanMismatchError
from partitioner.graph.ir import layer_of, module_path

__all__ = ["Recomputed", "block_nodes", "block_run", "recomputed_layers"]

_CALLS = ("call_function", "call_method", "call_module")
_OWNER = "stage"  # the attribute through which a block reads the stage module's state


def block_nodes(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """The compute nodes of ``gm`` in blocks, graph order: runs of one layer, root glue joining the run before it."""
    nodes = [n for n in gm.graph.nodes if n.op in _CALLS]
    keys = [layer_of(module_path(n)) for n in nodes]
    current = next((k for k in keys if k), "")
    runs: list[tuple[str, list[str]]] = []
    for node, key in zip(nodes, keys):
        current = key or current
        if not runs or runs[-1][0] != current:
            runs.append((current, []))
        runs[-1][1].append(node.name)
    return [tuple(names) for _, names in runs]


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One block as its own graph module: reads ``inputs`` (stage node names), returns ``outputs``."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class Recomputed(nn.Module):
    """``stage`` run block by block, each block under non-reentrant checkpoint while gradients are on.

    Calls and returns exactly as ``stage`` does.  Without gradients (evaluation)
    the blocks simply run.  ``blocks``: node names per block (default
    :func:`block_nodes`), in graph order, covering every compute node.
    ``layers``: checkpoint only the first ``layers`` blocks (selective; None: every
    block); more than the stage has is a plan made for another model.
    """

    def __init__(self, stage: fx.GraphModule, *, blocks: Sequence[Sequence[str]] | None = None,
                 layers: int | None = None) -> None:
        super().__init__()
        self.stage = stage
        groups = [tuple(b) for b in (blocks if blocks is not None else block_nodes(stage))]
        # A plain list: the blocks are not submodules, so parameters are not listed twice.
        self._segments: list[_Segment] = _segments(stage, groups)
        self.recomputed = recomputed_layers(len(groups), layers)
        graph = stage.graph
        self._inputs = tuple(n.name for n in graph.nodes if n.op == "placeholder")
        output = next(n for n in graph.nodes if n.op == "output")
        self._template = output.args[0]  # the stage's result structure; its nodes are looked up by name

    @property
    def blocks(self) -> int:
        return len(self._segments)

    def forward(self, *args: Any) -> Any:
        env: dict[str, Any] = dict(zip(self._inputs, args, strict=True))
        grad = torch.is_grad_enabled()
        for i, seg in enumerate(self._segments):
            inputs = [env[name] for name in seg.inputs]
            again = grad and i < self.recomputed
            outputs = checkpoint(seg.module, *inputs, use_reentrant=False) if again else seg.module(*inputs)
            env.update(zip(seg.outputs, outputs, strict=True))
        return fx.node.map_aggregate(self._template, lambda v: env[v.name] if isinstance(v, fx.Node) else v)


def recomputed_layers(blocks: int, layers: int | None) -> int:
    """How many of a stage's ``blocks`` (its first ones) recompute: ``layers`` (None: all), checked.

    >>> recomputed_layers(5, None), recomputed_layers(5, 2)
    (5, 2)
    """
    if layers is None:
        return blocks
    if not 0 < layers <= blocks:
        raise PlanMismatchError(
            f"The plan recomputes {layers} layers of a stage that has {blocks} (recompute_layers, selective "
            "recomputation); the plan was made for another model or edited by hand: plan the model again "
            "with `autopartition model.py`."
        )
    return layers


def _segments(stage: fx.GraphModule, blocks: list[tuple[str, ...]]) -> list[_Segment]:
    order = [n.name for n in stage.graph.nodes if n.op in _CALLS]
    flat = [name for block in blocks for name in block]
    if flat != order:
        raise InternalError(
            f"Recomputation blocks must cover the stage's {len(order)} compute nodes once each, in graph "
            f"order; got {len(flat)} names."
        )
    segments = []
    for i in range(len(blocks)):
        module, inputs, outputs = block_run(stage, blocks, i)
        segments.append(_Segment(module, inputs, outputs))
    return segments


def block_run(stage: fx.GraphModule, blocks: list[tuple[str, ...]], index: int
              ) -> tuple[fx.GraphModule, tuple[str, ...], tuple[str, ...]]:
    """Block ``index`` of ``blocks`` (node names of ``stage``) as a module, with the values it reads and returns.

    It reads the values other blocks (or the stage's inputs) make, and returns those of its
    own that later blocks or the stage's output read.  Used for recomputation here and for
    ZeRO-3's layer units (:mod:`runtime.shard`).
    """
    nodes = {n.name: n for n in stage.graph.nodes}
    block_of = {name: i for i, block in enumerate(blocks) for name in block}
    members = [nodes[name] for name in blocks[index]]
    inputs: dict[str, None] = {}
    for node in members:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr" and block_of.get(arg.name) != index:
                inputs[arg.name] = None
    outputs = tuple(
        node.name for node in members
        if any(user.op == "output" or block_of.get(user.name) != index for user in node.users)
    )
    return _block_module(stage, members, tuple(inputs), outputs), tuple(inputs), outputs


def _block_module(
    stage: fx.GraphModule, members: list[fx.Node], inputs: tuple[str, ...], outputs: tuple[str, ...]
) -> fx.GraphModule:
    """A graph module computing ``members``; it reads parameters, buffers and submodules through ``self.stage``."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {name: graph.placeholder(name) for name in inputs}

    def lookup(arg: fx.Node) -> fx.Node:
        if arg.name not in env:
            if arg.op != "get_attr":
                raise InternalError(f"block node reads {arg.name}, which is neither an input nor state")
            env[arg.name] = graph.get_attr(f"{_OWNER}.{arg.target}")
        return env[arg.name]

    for node in members:
        copied = graph.node_copy(node, lookup)
        if node.op == "call_module":
            copied.target = f"{_OWNER}.{node.target}"
        env[node.name] = copied
    graph.output(tuple(env[name] for name in outputs))
    holder = nn.Module()
    holder.add_module(_OWNER, stage)
    block = fx.GraphModule(holder, graph, class_name="Block")
    # GraphModule copies the attributes it reads into fresh containers; point it at the stage itself
    # instead, so that later `.to()`, buffer replacement or state loading is seen by every block.
    block.add_module(_OWNER, stage)
    return block
