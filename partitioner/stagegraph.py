"""Stage graphs: the part of the captured graph one pipeline stage computes.

Given the names of the nodes a stage computes (its compute nodes plus the
parameters, buffers and constants they read, duplicated into every stage that
needs them), :func:`build_stage` copies them into a new ``fx.GraphModule``
that holds only that stage's parameters, under their original names.

Its signature is data, :class:`StageSignature`:
``forward(*model_inputs, *received) -> (*sent, *model_outputs)``.  Values a
stage reads from another stage that are fixed Python values (``x.size(1)``)
are baked in as literals rather than sent.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> c = capture(m, (torch.randn(2, 4),))
    >>> sig = StageSignature(model_inputs=("input_1",), received=(), sent=("_0",), outputs=())
    >>> gm = build_stage(c, ("_0",), sig, statics={})  # node _0 is module 0 (symbolic_trace)
    >>> sorted(n for n, _ in gm.named_parameters())
    ['0.bias', '0.weight']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import fx

from partitioner.errors import PlanMismatchError
from partitioner.graph.capture import CapturedModel
from partitioner.graph.ir import KIND_KEY
from partitioner.plan import StagePlan

__all__ = ["StageSignature", "build_stage", "closure", "closures", "stage_signature"]


@dataclasses.dataclass(frozen=True)
class StageSignature:
    """Names of a stage module's inputs and outputs, in call order."""

    model_inputs: tuple[str, ...]  # placeholders of the whole model this stage reads
    received: tuple[str, ...]  # producer names of tensors received from earlier stages
    sent: tuple[str, ...]  # producer names of tensors this stage sends
    outputs: tuple[str, ...]  # the model's outputs (last stage only)


def stage_signature(stage: StagePlan, *, model_outputs: tuple[str, ...], last: bool) -> StageSignature:
    """The call signature the planner and the runtime both derive from a stage's plan."""
    return StageSignature(
        model_inputs=stage.model_inputs,
        received=tuple(dict.fromkeys(b.producer for b in stage.inputs)),
        sent=tuple(dict.fromkeys(b.producer for b in stage.outputs)),
        outputs=model_outputs if last else (),
    )


def closure(gm: fx.GraphModule, compute: set[str]) -> list[str]:
    """``compute`` plus every parameter, buffer and constant node they need, in graph order."""
    return closures(gm, [compute])[0]


def closures(gm: fx.GraphModule, computes: Sequence[set[str]]) -> list[list[str]]:
    """:func:`closure` of each set of ``computes`` (the graph indexed once for all: a plan's every stage)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    position = {name: i for i, name in enumerate(nodes)}
    out = []
    for compute in computes:
        keep = set(compute)
        stack = [nodes[name] for name in compute]
        while stack:
            node = stack.pop()
            for arg in node.all_input_nodes:
                if arg.name not in keep and arg.meta.get(KIND_KEY) in ("parameter", "buffer", "constant"):
                    keep.add(arg.name)
                    stack.append(arg)
        out.append(sorted(keep, key=position.__getitem__))
    return out


def build_stage(
    captured: CapturedModel,
    node_names: tuple[str, ...] | list[str],
    signature: StageSignature,
    *,
    statics: dict[str, Any],
) -> fx.GraphModule:
    """A GraphModule computing ``node_names``; see the module docstring."""
    source = captured.graph_module
    nodes = {n.name: n for n in source.graph.nodes}
    missing = [n for n in (*node_names, *signature.received, *signature.model_inputs) if n not in nodes]
    if missing:
        raise PlanMismatchError(
            f"The plan names graph nodes the captured model does not have ({', '.join(missing[:5])}). "
            "The model changed since the plan was made: plan it again with `autopartition model.py`."
        )
    graph = fx.Graph()
    env: dict[str, Any] = {}
    for name in signature.model_inputs:
        env[name] = graph.placeholder(name)
    for name in signature.received:
        env[name] = graph.placeholder(f"recv_{name}")
    wanted = set(node_names)
    for node in source.graph.nodes:
        if node.name not in wanted:
            continue

        def lookup(arg: fx.Node, node: fx.Node = node) -> Any:
            if arg.name in env:
                return env[arg.name]
            if arg.name in statics:
                return statics[arg.name]
            raise PlanMismatchError(
                f"Stage node {node.format_node()} reads {arg.name!r}, which the plan neither computes "
                "in this stage nor sends to it. The plan does not match this model: plan it again."
            )

        env[node.name] = graph.node_copy(node, lookup)
    results = tuple(env[name] for name in (*signature.sent, *signature.outputs))
    graph.output(results)
    graph.lint()
    return fx.GraphModule(source, graph, class_name="Stage")
