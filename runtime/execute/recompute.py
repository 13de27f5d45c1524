"""Activation recomputation at run time: a stage whose plan says ``recompute == "full"`` checkpoints each block,
one whose plan says ``"selective"`` its first ``recompute_layers`` blocks wholly and the next
``recompute_ops_layers`` blocks' cheap ops only.

A stage module (an ``fx.GraphModule``) is cut into *blocks*: runs of
consecutive compute nodes of one layer (:func:`partitioner.graph.ir.layer_of` of
the node's module: ``layers.3``, ``model.layers.3``, ``lm_head``), with
root-level glue (a residual add, ``x.view``) joining the block before it (or
the first block, when it leads).  :class:`Recomputed` runs each block in one of
three ways (:data:`RUN_KINDS`):

* ``"whole"``: under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``:
  the block keeps only its inputs after the forward and computes its
  activations again during the backward, which is what the planner charges a
  recomputing stage (its blocks' inputs per micro-batch, plus one block's
  activations during each backward).  ``recompute == "full"``: every block.
* ``"ops"`` (per-op selective checkpointing, torchtitan's
  ``--activation_checkpoint.mode selective --selective_ac_option op``): under
  the same checkpoint with ``torch.utils.checkpoint.create_selective_checkpoint_contexts``,
  whose policy saves the outputs of the ops in :data:`SAVED_OPS` (matrix
  multiplications and attention) and recomputes every other op: the block
  keeps its inputs plus its matmul and attention outputs per micro-batch, and
  its backward re-runs only its cheap ops (norms, activations, dropout, adds).
* ``"keep"``: runs plainly and keeps every activation.

With ``layers=N, ops_layers=K`` (selective recomputation, the plan's
``recompute_layers`` and ``recompute_ops_layers``; Megatron-LM's
``--recompute-method block --recompute-num-layers N`` for the first part) the
first N blocks run whole, the next K ops, the others keep, which the planner
charges as the kept blocks' activations, the first N blocks' inputs and the
next K blocks' inputs and saved op outputs.

Numbers do not change: the backward re-runs the same ops on the same inputs
(an ops block takes its saved outputs where the forward's ops would run
again), and checkpoint restores the random-number state (CPU and the inputs'
devices) and the autocast state of the forward for the recomputation, so
dropout masks and autocast dtypes are the same as the first time.  Two limits of
torch's per-op checkpointing: a region may be backpropagated through once (our
engine's split backward runs a recomputing stage's backward whole; under
``engine="torch"`` a split-backward schedule backpropagates twice, so
:mod:`runtime.pipeline` runs those blocks ``"whole"`` there), and an op may not write
in place into a saved output: an ``"ops"`` block whose graph writes anything in
place (``nn.ReLU(inplace=True)``, ``x += y``) runs ``"whole"`` instead
(:func:`stage_run_kinds`).  Either way: less memory than planned, never other numbers.

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
    >>> Recomputed(gm, layers=1, ops_layers=1).kinds  # then one block's cheap ops only
    ('whole', 'ops', 'keep')
    >>> Recomputed(gm, layers=0, ops_layers=3).kinds  # per-op checkpointing everywhere
    ('ops', 'ops', 'ops')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from partitioner.errors import InternalError, PlanMismatchError
from partitioner.graph.ir import layer_runs
from partitioner.graph.meetings import inputs_written_in_place, writes_in_place, written_state
from runtime.execute.stack import StageStack

__all__ = [
    "RUN_KINDS",
    "SAVED_OPS",
    "Recomputed",
    "RunKind",
    "apply_recompute",
    "block_nodes",
    "block_run",
    "recomputed_layers",
    "run_block",
    "run_kinds",
    "stage_run_kinds",
    "written_inputs",
]

_CALLS = ("call_function", "call_method", "call_module")
_OWNER = "stage"  # the attribute through which a block reads the stage module's state

RunKind = Literal["whole", "ops", "keep"]
RUN_KINDS: tuple[RunKind, ...] = ("whole", "ops", "keep")  # how a block runs (module docstring)


def _aten_ops(names: Sequence[str]) -> frozenset[torch._ops.OpOverload]:
    """The ``default`` overloads of the aten ops ``names`` this torch has (a missing one: never dispatched to)."""
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


# The ops whose outputs an "ops" block saves; every other op it recomputes.  torchtitan's per-op policy
# (torchtitan/distributed/activation_checkpoint.py, selective_ac_option "op") saves matmul and attention outputs
# and recomputes the rest; its older versions also recomputed every second mm, which we do not: the planner
# charges every matmul's and attention's output as kept.  What the captured ops dispatch to (torch 2.13): a linear
# with bias to addmm (a 3-d input through a view), without bias to mm, a batched matmul to bmm (baddbmm in some
# attention code), float8 linears to _scaled_mm; scaled_dot_product_attention to the flash, memory-efficient or
# cuDNN kernel on CUDA and to _scaled_dot_product_flash_attention_for_cpu on CPU (its math fallback decomposes
# into bmm, saved, and softmax, recomputed).  An attention kernel's extra outputs (logsumexp, RNG state) are
# saved with it: its backward reads them.
SAVED_OPS: frozenset[torch._ops.OpOverload] = _aten_ops((
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",  # convolution: the planner counts its FLOPs too
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
))


def _save_matmuls(ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The per-op policy of an "ops" block: keep what :data:`SAVED_OPS` make, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _ops_contexts() -> tuple[Any, Any]:
    """Fresh forward and recomputation contexts for one checkpointed call (they hold that call's saved outputs)."""
    return create_selective_checkpoint_contexts(_save_matmuls)


def run_block(block: Callable[..., Any], values: Sequence[Any], kind: RunKind,
              state: Sequence[torch.Tensor] = (), written: Sequence[int] = ()) -> Any:
    """``block(*values)``, recomputed in the backward as ``kind`` says (plainly without gradients).

    ``state``: tensors the block writes in place (a BatchNorm's running statistics,
    :func:`partitioner.graph.meetings.written_state`); a recomputation runs on their values as the
    forward saw them and leaves them as it found them, so they are written once.
    ``written``: positions of ``values`` the block writes in place (:func:`written_inputs`);
    a recomputed block writes into copies, so the inputs checkpoint keeps stay as they were.

    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> w = torch.randn(3, 3)
    >>> y = run_block(lambda a: torch.tanh(a @ w), [x], "ops")  # the mm output kept, tanh recomputed
    >>> torch.equal(y, torch.tanh(x @ w))
    True
    >>> count = torch.zeros(())
    >>> def counted(a):
    ...     count.add_(1)
    ...     return a * count
    >>> run_block(counted, [x], "whole", state=[count]).sum().backward()
    >>> count.item()  # once, though the backward ran the block again
    1.0
    """
    if kind == "keep" or not torch.is_grad_enabled():
        return block(*values)
    if written:
        block = functools.partial(_on_copies, block, frozenset(written))
    if kind == "whole":
        if state:
            return checkpoint(block, *values, use_reentrant=False,
                              context_fn=_under_forward_modes(lambda: _preserving(state)))
        return checkpoint(block, *values, use_reentrant=False, context_fn=_under_forward_modes(_no_contexts))
    if kind == "ops":
        return checkpoint(block, *values, use_reentrant=False, context_fn=_under_forward_modes(_ops_contexts))
    raise InternalError(f"unknown recomputation kind {kind!r}, expected one of {', '.join(RUN_KINDS)}")


def _no_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _under_forward_modes(contexts: Callable[[], tuple[Any, Any]]) -> Callable[[], tuple[Any, Any]]:
    """Checkpoint's ``context_fn``: ``contexts``, and the recomputation under the torch function modes its
    forward ran under (as checkpoint does for the device context).

    A mode is not active inside the autograd engine when the backward was itself called through it
    (``Tensor.backward`` is a torch function: the mode steps aside while it runs), so a recomputation would
    otherwise run without the mode its forward had: ``verify``'s dropout at p=0 (runtime/verify.py) ran
    real dropout when recomputed and saved one more tensor than the forward did.
    """

    def made() -> tuple[Any, Any]:
        forward, recompute = contexts()
        modes = [m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext)]
        return (forward, _replaying(modes, recompute)) if modes else (forward, recompute)

    return made


@contextlib.contextmanager
def _replaying(modes: Sequence[Any], recompute: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        active = {id(m) for m in _get_current_function_mode_stack()}
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        stack.enter_context(recompute)
        yield


def written_inputs(run: fx.GraphModule, inputs: Sequence[str]) -> tuple[int, ...]:
    """Positions of the values ``run`` reads (named ``inputs``) that it writes in place (``ReLU(inplace=True)``).

    A recomputed run works on copies of those: checkpoint keeps its inputs for the
    recomputation, and autograd refuses one that changed since.
    """
    written = inputs_written_in_place(run)
    return tuple(i for i, name in enumerate(inputs) if name in written)


def _on_copies(block: Callable[..., Any], written: frozenset[int], *values: Any) -> Any:
    return block(*(v.clone() if i in written else v for i, v in enumerate(values)))


def _preserving(state: Sequence[torch.Tensor]) -> tuple[Any, Any]:
    """Checkpoint contexts keeping ``state`` as the forward saw it for the recomputation (taken now, at the
    forward), and as it is at recomputation time afterwards."""
    seen = [t.detach().clone() for t in state]

    @contextlib.contextmanager
    def recomputing() -> Iterator[None]:
        now = [t.detach().clone() for t in state]
        with torch.no_grad():
            for t, value in zip(state, seen, strict=True):
                t.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, value in zip(state, now, strict=True):
                    t.copy_(value)

    return contextlib.nullcontext(), recomputing()


def block_nodes(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """The compute nodes of ``gm`` in blocks, graph order: runs of one layer, root glue joining the run before it
    (:func:`partitioner.graph.ir.layer_runs`, the rule the planner prices)."""
    return layer_runs(gm.graph.nodes)


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One block as its own graph module: reads ``inputs`` (stage node names), returns ``outputs``."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    state: tuple[str, ...] = ()  # buffers of the stage it writes (partitioner.graph.meetings.written_state)


class Recomputed(nn.Module):
    """``stage`` run block by block, each block recomputed as planned while gradients are on.

    Calls and returns exactly as ``stage`` does.  Without gradients (evaluation)
    the blocks simply run.  ``blocks``: node names per block (default
    :func:`block_nodes`), in graph order, covering every compute node.
    ``layers``: checkpoint only the first ``layers`` blocks wholly (selective; None:
    every block); ``ops_layers``: the next ``ops_layers`` blocks under per-op
    checkpointing (only with ``layers`` given, which may then be 0).  Counts the
    stage does not have are a plan made for another model.  ``kinds``: how each
    block runs (:func:`stage_run_kinds`); ``recomputed`` and ``ops_recomputed``
    count the ``"whole"`` and ``"ops"`` ones.
    """

    def __init__(self, stage: fx.GraphModule, *, blocks: Sequence[Sequence[str]] | None = None,
                 layers: int | None = None, ops_layers: int = 0) -> None:
        super().__init__()
        self.stage = stage
        groups = [tuple(b) for b in (blocks if blocks is not None else block_nodes(stage))]
        # A plain list: the blocks are not submodules, so parameters are not listed twice.
        self._segments: list[_Segment] = _segments(stage, groups)
        self.layers, self.ops_layers = layers, ops_layers  # as planned (ZeRO-3's LayeredStage reads them)
        self.kinds = stage_run_kinds(stage, groups, layers=layers, ops_layers=ops_layers)
        self._written = [written_inputs(seg.module, seg.inputs) for seg in self._segments]
        self.recomputed = self.kinds.count("whole")
        self.ops_recomputed = self.kinds.count("ops")
        graph = stage.graph
        self._inputs = tuple(n.name for n in graph.nodes if n.op == "placeholder")
        output = next(n for n in graph.nodes if n.op == "output")
        self._template = output.args[0]  # the stage's result structure; its nodes are looked up by name

    @property
    def blocks(self) -> int:
        return len(self._segments)

    def forward(self, *args: Any) -> Any:
        env: dict[str, Any] = dict(zip(self._inputs, args, strict=True))
        for seg, kind, written in zip(self._segments, self.kinds, self._written, strict=True):
            state = [self.stage.get_buffer(name) for name in seg.state]
            outputs = run_block(seg.module, [env[name] for name in seg.inputs], kind, state, written)
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


def run_kinds(blocks: int, *, layers: int | None = None, ops_layers: int = 0) -> tuple[RunKind, ...]:
    """How each of a stage's ``blocks`` runs: the first ``layers`` whole (None: all), the next ``ops_layers`` ops.

    The counts are checked against ``blocks`` (:class:`PlanMismatchError` for a plan
    that does not fit the stage).

    >>> run_kinds(4), run_kinds(4, layers=1), run_kinds(4, layers=1, ops_layers=2)
    (('whole', 'whole', 'whole', 'whole'), ('whole', 'keep', 'keep', 'keep'), ('whole', 'ops', 'ops', 'keep'))
    """
    whole: tuple[RunKind, ...] = ("whole",)
    if layers is None:
        if ops_layers:
            raise InternalError(f"ops_layers={ops_layers} with every layer recomputed wholly (layers=None)")
        return whole * blocks
    if not ops_layers:
        layers = recomputed_layers(blocks, layers)
    elif layers < 0 or ops_layers < 0 or layers + ops_layers > blocks:
        raise PlanMismatchError(
            f"The plan recomputes {layers} layers wholly and the cheap ops of {ops_layers} more of a stage that "
            f"has {blocks} (recompute_layers and recompute_ops_layers, selective recomputation); the plan was made "
            "for another model or edited by hand: plan the model again with `autopartition model.py`."
        )
    ops: tuple[RunKind, ...] = ("ops",)
    keep: tuple[RunKind, ...] = ("keep",)
    return whole * layers + ops * ops_layers + keep * (blocks - layers - ops_layers)


def stage_run_kinds(stage: fx.GraphModule, blocks: Sequence[Sequence[str]], *, layers: int | None = None,
                    ops_layers: int = 0) -> tuple[RunKind, ...]:
    """:func:`run_kinds` for ``blocks`` (node names) of ``stage``, an ``"ops"`` block that writes in place ``"whole"``.

    torch's per-op checkpointing refuses, in the backward, an op output it saved
    that a later op wrote in place; a block that writes anything in place
    (conservative: the write may not touch a saved output), or writes state such as a
    BatchNorm's running statistics (restored around a whole recomputation only), recomputes wholly.
    """
    kinds = run_kinds(len(blocks), layers=layers, ops_layers=ops_layers)
    nodes = {n.name: n for n in stage.graph.nodes}
    written = [any(writes_in_place(stage, nodes[name]) for name in block)
               or bool(written_state(stage, [nodes[name] for name in block])) for block in blocks]
    return tuple("whole" if kind == "ops" and w else kind for kind, w in zip(kinds, written, strict=True))


def _segments(stage: fx.GraphModule, blocks: list[tuple[str, ...]]) -> list[_Segment]:
    order = [n.name for n in stage.graph.nodes if n.op in _CALLS]
    flat = [name for block in blocks for name in block]
    if flat != order:
        raise InternalError(
            f"Recomputation blocks must cover the stage's {len(order)} compute nodes once each, in graph "
            f"order; got {len(flat)} names."
        )
    segments = []
    nodes = {n.name: n for n in stage.graph.nodes}
    for i, block in enumerate(blocks):
        module, inputs, outputs = block_run(stage, blocks, i)
        state = tuple(written_state(stage, [nodes[name] for name in block]))
        segments.append(_Segment(module, inputs, outputs, state))
    return segments


def block_run(stage: fx.GraphModule, blocks: list[tuple[str, ...]], index: int
              ) -> tuple[fx.GraphModule, tuple[str, ...], tuple[str, ...]]:
    """Block ``index`` of ``blocks`` (node names of ``stage``) as a module, with the values it reads and returns.

    It reads the values other blocks (or the stage's inputs) make, and returns those of its
    own that later blocks or the stage's output read.  Used for recomputation here and for
    ZeRO-3's layer units (:mod:`runtime.parallel.shard`).
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


def apply_recompute(stack: StageStack, *, backward_twice: bool = False) -> StageStack:
    """The stack's step for recomputation: each stage planned ``full`` or ``selective`` runs as :class:`Recomputed`.

    ``backward_twice``: the engine backpropagates through a stage in two calls (torch's
    split backward: input gradients, then weight gradients), which torch's per-op
    checkpointing refuses: the layers planned to recompute their cheap ops recompute
    wholly instead (the same numbers, less memory than planned, more time).
    """
    runnables: list[nn.Module] = []
    for local in stack.stages:
        module: nn.Module = local.module
        if local.plan.recompute == "full":
            module = Recomputed(local.module)
        elif local.plan.recompute == "selective":  # the first layers wholly, the next ones' cheap ops (0 of either)
            layers, ops_layers = local.plan.recompute_layers, local.plan.recompute_ops_layers
            if backward_twice:
                layers, ops_layers = layers + ops_layers, 0
            module = Recomputed(local.module, layers=layers, ops_layers=ops_layers)
        runnables.append(module)
    return stack.replace(runnables=tuple(runnables))
