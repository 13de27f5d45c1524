"""Formulate: turn a costed graph and one pp x dp candidate into a PartitionProblem.

Costs were profiled for one micro-batch of ``batch / microbatches`` samples;
with ``dp`` replicas each replica sees ``1/dp`` of that, and compute time and
activation bytes are scaled linearly (an approximation that overstates small
per-op overheads' share at large dp).  Communication is priced by
:mod:`partitioner.cost.comm`, as the simulator prices it: a boundary tensor
costs one alpha-beta message forward and the same for its gradient backward; a
replica group all-reduces gradients with a ring in DDP buckets, each parameter
carrying its share of the buckets' latency and each stage its first bucket.
Every communication cost comes twice, on the intra-node link (``transfer_s``,
``allreduce_s``) and on the inter-node one (``transfer_slow_s``,
``allreduce_slow_s``): the solver charges a stage the one its ranks actually
use (:func:`partitioner.cost.comm.p2p_crosses_nodes`,
:func:`~partitioner.cost.comm.allreduce_crosses_nodes`).

Precision (:mod:`partitioner.cost.precision`) is applied here to costs taken in the
model's own dtype: static memory is ``elements x`` the precision's bytes per
parameter element (weights, gradients, optimizer states), the all-reduce moves
gradients at the precision's size, and float32 activations, boundary tensors and
recomputation inputs count half under bf16.  Times are priced for the precision
before they get here (:func:`node_times`).

Recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", MLSys 2023, full recomputation): a recomputed block keeps
only its inputs from other blocks and the graph (``recompute_bytes``) and runs
its forward again during backward (``recompute_s``).  ``layer_start`` marks the
blocks that begin one of the runtime's layer runs (:attr:`GraphCosts.layer_runs`),
where a stage that recomputes only its first layers (selective recomputation,
Megatron-LM's ``--recompute-method block``) may start keeping its activations.

Split backward (``zb-h1``, ``zbv``): a node that reads parameters spends part
of its backward on their gradients (W) and the rest on its input's (B).
Measured costs time both (:attr:`~partitioner.cost.nodecost.NodeCost.weight_backward_s`);
otherwise the share is half: for a matrix product ``y = x w`` the two are
``dx = dy w^T`` and ``dw = x^T dy``, the same FLOPs; Qi et al., "Zero Bubble
Pipeline Parallelism" (ICLR 2024, section 2) take ``T_B = T_W`` for a
transformer layer on that ground.  A parameter-free node (activation, softmax,
residual add, the loss) has no W: its whole backward is B.  ``weight_s`` is that
share per block (:func:`weight_seconds`); ``split_s`` is the time the split
adds per block: per parameter-reading node, ``split_overhead_s`` of host time and
``split_share`` of the node's own time (:mod:`partitioner.cost.splitcost`).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from partitioner.cost.comm import (
    Link,
    bucket_share,
    link,
    members_per_node,
    ring_link,
    shard_step_seconds,
    zero3_microbatch_seconds,
)
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.experts import DEFAULT_IMBALANCE, expert_layer_seconds
from partitioner.cost.nodecost import NodeCost, predicted_times
from partitioner.cost.precision import (
    DEFAULT_FP8_RECIPE,
    FP8_DTYPE,
    FP8_SAVED_ITEMSIZE,
    activation_scale,
    check_precision,
    compute_dtype,
    fp8_cast_bytes,
    fp8_gather_saving,
    fp8_peak,
    gathered_bytes,
    gradient_bytes,
    shard_degree,
    shard_state_bytes,
    state_bytes,
    weight_bytes,
    zero3_transient_bytes,
)
from partitioner.defaults import DEFAULT_BUCKET_CAP_MB
from partitioner.graph.ir import (
    KIND_KEY,
    VALUE_KEY,
    ValueInfo,
    layer_of,
    layer_runs,
    node_parameters,
)
from partitioner.solve.problem import PartitionProblem

if TYPE_CHECKING:  # types only: this module imports without torch
    from torch import fx

    from partitioner.graph.capture import CapturedModel

__all__ = [
    "FULL_MODES",
    "HSDP",
    "HSDP_ZERO3",
    "SEARCH_SHARD_MODES",
    "WEIGHT_SHARE",
    "ZERO3",
    "ZERO3_UNITS",
    "ExpertBlock",
    "GraphCosts",
    "Zero3Costs",
    "allreduce_seconds",
    "at_precision",
    "expert_seconds",
    "formulate",
    "graph_costs",
    "layer_runs",
    "mode_parts",
    "node_times",
    "reshards",
    "transfer_seconds",
    "weight_seconds",
    "zero3_costs",
]

WEIGHT_SHARE = 0.5  # of a parameter-reading node's backward: its weight gradient (see the module docstring)

# The planner's names for its ways of sharding "full" (a plan's StagePlan.shard stays "full", with
# reshard_after_forward and shard_span): ZeRO-3 (reshard_after_forward) over every replica, and both kept gathered
# and ZeRO-3 sharded over one node's replicas, the nodes replicating (HSDP; shard_span "node").
ZERO3 = "zero3"
HSDP = "hsdp"
HSDP_ZERO3 = "hsdp-zero3"
ZERO3_UNITS = ("layer", "module")  # one ZeRO-3 gather: FSDP2's layer (prefetched), DeepSpeed's module (in its hook)
FULL_MODES = ("full", ZERO3, HSDP, HSDP_ZERO3)
SEARCH_SHARD_MODES = ("none", "optimizer", *FULL_MODES)


class ExpertBlock(typing.NamedTuple):
    """One experts layer as the solver prices it: the block reading its output carries its all-to-alls."""

    block: int
    tokens: float  # tokens routed per micro-batch at dp = 1 (the layer's N)
    top_k: int
    hidden: int
    nodes: tuple[str, ...]  # its compute nodes: their time is the busiest member's under expert parallelism


def mode_parts(mode: str) -> tuple[str, bool, str]:
    """A search shard mode as the plan records it: (``StagePlan.shard``, ``reshard_after_forward``, ``shard_span``).

    >>> mode_parts("zero3"), mode_parts("hsdp"), mode_parts("optimizer")
    (('full', True, 'world'), ('full', False, 'node'), ('optimizer', False, 'world'))
    """
    if mode not in SEARCH_SHARD_MODES:
        raise ValueError(f"shard is {mode!r}, expected one of {', '.join(SEARCH_SHARD_MODES)}")
    if mode in FULL_MODES:
        return "full", mode in (ZERO3, HSDP_ZERO3), "node" if mode in (HSDP, HSDP_ZERO3) else "world"
    return mode, False, "world"


def reshards(mode: str) -> bool:
    """Is ``mode`` ZeRO-3 (per-layer units gathered and freed every micro-batch), over the world or a node?"""
    return mode in (ZERO3, HSDP_ZERO3)

@dataclasses.dataclass(frozen=True)
class GraphCosts:
    """Per-node numbers the formulation needs, independent of pp x dp and of the precision.

    Bytes are in the model's own dtype; times are (forward, backward) seconds as
    :func:`node_times` priced them.  The fields after ``loss_s`` are optional so
    hand-made costs keep working: without ``parameter_elements`` a parameter is
    taken as float32 (4 bytes per element), without ``node_dtype`` every value
    as float32, without ``block_senders`` a block sends ``block_sends`` bytes,
    and without ``block_inputs`` no block can be recomputed.
    """

    blocks: tuple[tuple[str, ...], ...]
    node_time_s: dict[str, float]  # forward + backward, one micro-batch at dp = 1
    node_forward_s: dict[str, float]
    node_saved_bytes: dict[str, int]
    node_output_bytes: dict[str, int]  # block nodes, and the graph inputs blocks read
    parameter_bytes: dict[str, int]  # canonical parameter name -> bytes
    block_parameters: tuple[tuple[str, ...], ...]  # canonical names read by each block
    edges: tuple[tuple[int, int], ...]  # block edges u -> v, u < v
    block_sends: tuple[int, ...]  # bytes each block sends to one other stage
    loss_s: tuple[float, float] = (0.0, 0.0)  # loss forward, backward: the last block's stage computes it
    parameter_elements: dict[str, int] = dataclasses.field(default_factory=dict)  # canonical name -> numel
    node_dtype: dict[str, str] = dataclasses.field(default_factory=dict)  # dtype of each value above
    block_senders: tuple[tuple[str, ...], ...] = ()  # each block's nodes read by other blocks (or the output)
    block_inputs: tuple[tuple[str, ...], ...] = ()  # values each block keeps when recomputed: its layer's inputs
    layer_runs: tuple[tuple[str, ...], ...] = ()  # compute nodes per layer run, as the runtime recomputes them
    node_flops: dict[str, float] = dataclasses.field(default_factory=dict)  # forward + backward FLOPs
    node_saved_float32_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # of node_saved_bytes
    node_weight_s: dict[str, float] = dataclasses.field(default_factory=dict)  # W share of the backward (nodes with one)
    node_writes_in_place: frozenset[str] = frozenset()  # nodes writing an input in place (no per-op recomputation)
    fp8_nodes: frozenset[str] = frozenset()  # linear matmuls --precision fp8 runs in FP8 (NodeCost.fp8_matmul)
    # Canonical names of the weights a fully sharded stage gathers as FP8 casts, 1 byte per element
    # (tensorwise fp8 plans without tensor parallelism: runtime/parallel/fp8_gather.py, graph.fp8.fp8_only_weights)
    fp8_gathered: frozenset[str] = frozenset()
    split_overhead_s: float = 0.0  # host seconds a split backward adds per parameter-reading node
    split_share: float = 0.0  # and this share of the node's forward + backward seconds
    split_forward: float = 0.0  # the part of the split's cost spent in F
    split_weight: float = 0.0  # and in W (the rest in B)
    action_s: float = 0.0  # host seconds the runtime adds per compute action (a calibration's; partitioner.cost.calibration)
    # Mixture of experts (graph/experts.py): the experts' canonical parameter names, and per experts layer
    # (the block reading its output, tokens per micro-batch at dp = 1, top-k, hidden, its nodes).
    expert_parameters: frozenset[str] = frozenset()
    expert_layers: tuple[ExpertBlock, ...] = ()
    # Sums over a tuple of names (a block, a layer run, a block's inputs), kept by the tuple's identity: every
    # (dp, M) problem formulated from these costs asks for the same ones (not copied by dataclasses.replace).
    _sums: dict[tuple[Any, ...], tuple[Any, Any]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)

    def _kept(self, kind: str, names: Iterable[str], precision: str,
              total: Callable[[Iterable[str], str], float]) -> float:
        """``total(names, precision)``, kept for a tuple of names (held with the sum, so its id stays its own)."""
        if not isinstance(names, tuple):
            return total(names, precision)
        sums = self.__dict__.setdefault("_sums", {})  # (set by __init__; not when unpickled)
        key = (kind, id(names), precision)
        found = sums.get(key)
        if found is None or found[0] is not names:
            found = sums[key] = (names, total(names, precision))
        return found[1]

    def saved_bytes(self, names: Iterable[str], precision: str = "fp32") -> float:
        """Activation bytes ``names`` save for backward at ``precision`` (one micro-batch, dp = 1).

        The float32 tensors among them scale (:func:`~partitioner.cost.precision.activation_scale`);
        integer indices and masks do not.  A node whose float32 part is not known
        is taken by its output's dtype.
        """
        return self._kept("saved", names, precision, self._saved_bytes)

    def _saved_bytes(self, names: Iterable[str], precision: str) -> float:
        half = 1.0 - activation_scale(precision, "float32")
        # fp8: an FP8 matmul saves its input as its FP8 cast, FP8_SAVED_ITEMSIZE bytes of every float32 4
        fp8 = self.fp8_nodes if precision == "fp8" else frozenset()
        quarter = 1.0 - FP8_SAVED_ITEMSIZE / 4
        total = 0.0
        for n in names:
            saved = self.node_saved_bytes.get(n, 0)
            float32 = self.node_saved_float32_bytes.get(n)
            if float32 is None:
                float32 = saved if self.node_dtype.get(n, "float32") == "float32" else 0
            total += saved - (quarter if n in fp8 else half) * float32
        return total

    def value_bytes(self, names: Iterable[str], precision: str = "fp32") -> float:
        """Bytes of the values ``names`` produce at ``precision`` (one micro-batch, dp = 1)."""
        return self._kept("value", names, precision, self._value_bytes)

    def _value_bytes(self, names: Iterable[str], precision: str) -> float:
        return sum(
            self.node_output_bytes.get(n, 0) * activation_scale(precision, self.node_dtype.get(n, "float32"))
            for n in names
        )

    def sent_bytes(self, block: int, precision: str = "fp32") -> float:
        """Bytes ``block`` sends to one other stage per micro-batch at ``precision`` (dp = 1)."""
        if not self.block_senders:
            return self.block_sends[block] * activation_scale(precision, "float32")
        return self.value_bytes(self.block_senders[block], precision)

    def flops(self, names: Iterable[str] | None = None) -> float:
        """Forward + backward FLOPs of ``names`` (every block's nodes by default), one micro-batch at dp = 1.

        Model FLOPs for MFU: recomputation is not counted, the loss neither.
        """
        members = (n for block in self.blocks for n in block) if names is None else names
        return sum(self.node_flops.get(n, 0.0) for n in members)


def transfer_seconds(nbytes: float, spec: DeviceSpec, *, inter_node: bool = False) -> float:
    """One point-to-point message over ``spec``'s link (:func:`partitioner.cost.comm.message_seconds`)."""
    return link(spec, inter_node=inter_node).message_seconds(nbytes)


def allreduce_seconds(
    nbytes: float, replicas: int, spec: DeviceSpec, *, messages: float = 1, inter_node: bool = False
) -> float:
    """Ring all-reduce over ``spec``'s link (:func:`partitioner.cost.comm.ring_allreduce_seconds`)."""
    return link(spec, inter_node=inter_node).allreduce_seconds(nbytes, replicas, messages=messages)


def at_precision(cost: NodeCost, precision: str) -> NodeCost:
    """``cost`` (taken in the model's dtype) as the node would run at ``precision``, for pricing its time.

    A float32 node under a bf16 mode runs in bfloat16 (the roofline uses that
    peak) and moves half the bytes; weights are taken at half too (autocast
    reads each fp32 weight once per forward to cast it and caches the copy).
    Its float32 saved tensors halve; integer ones (indices, masks) do not.
    Other nodes are unchanged.  Only for times: :func:`graph_costs` takes the
    costs as they were profiled and the formulation scales memory itself.

    >>> c = NodeCost(0.0, 0.0, 2e12, 4e12, 100, 1000, "float32", weight_bytes=400)
    >>> b = at_precision(c, "bf16-mixed")
    >>> b.dtype, b.io_bytes, b.saved_bytes, b.weight_bytes, b.forward_flops
    ('bfloat16', 500, 50, 200, 2000000000000.0)
    >>> at_precision(c, "fp32") is c, at_precision(dataclasses.replace(c, dtype="int64"), "bf16").dtype
    (True, 'int64')

    Under ``fp8`` a linear layer's matmul (``fp8_matmul``) runs at the FP8 peak
    (dtype ``float8_e4m3fn``), reading bf16 values as bf16-mixed does (its FP8
    casts are priced apart, :func:`node_times`) and saving its input in FP8::

        >>> f = at_precision(dataclasses.replace(c, fp8_matmul=True), "fp8")
        >>> f.dtype, f.io_bytes, f.saved_bytes
        ('float8_e4m3fn', 500, 25)
    """
    scale = activation_scale(precision, cost.dtype)
    if scale == 1.0:
        return cost
    float32 = cost.saved_bytes if cost.saved_float32_bytes is None else cost.saved_float32_bytes
    fp8 = cost.fp8_matmul and precision == "fp8"
    saved_scale = FP8_SAVED_ITEMSIZE / 4 if fp8 else scale
    return dataclasses.replace(
        cost,
        dtype=FP8_DTYPE if fp8 else compute_dtype(precision),
        io_bytes=round(cost.io_bytes * scale),
        saved_bytes=round(cost.saved_bytes - (1 - saved_scale) * float32),
        weight_bytes=round(cost.weight_bytes * scale),
        saved_float32_bytes=round(float32 * saved_scale),
    )


def node_times(
    costs: dict[str, NodeCost], spec: DeviceSpec, *, precision: str = "fp32", measure: bool = False,
    fp8_recipe: str = DEFAULT_FP8_RECIPE,
) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of every node at ``precision``: what :func:`graph_costs` takes.

    Predicted (``measure=False``): the roofline of :func:`partitioner.cost.nodecost.predicted_times`
    on :func:`at_precision`'s cost, so bf16 modes use the bf16 peak and half the
    bytes.  Measured: the times as profiled, in the model's own dtype whatever
    the precision (measuring bf16 would mean profiling under autocast); the
    precision then changes memory and communication only.

    >>> from partitioner.cost.devices import DEVICES
    >>> c = {"mm": NodeCost(0.0, 0.0, 989e9, 1978e9, 0, 0, "float32")}
    >>> [round(f * 1e3, 3) for f in node_times(c, DEVICES["h100"], precision="bf16-mixed")["mm"]]
    [1.356, 2.708]

    ``fp8``: a linear layer's matmul (``fp8_matmul``) at the FP8 peak of
    ``fp8_recipe`` (:func:`~partitioner.cost.precision.fp8_peak`), with the
    device's matmul efficiency (fitted to bf16 runs: no FP8 run calibrates it),
    plus its casts, memory-bound (:func:`~partitioner.cost.precision.fp8_cast_bytes`;
    two cast kernels forward, one backward)::

        >>> c["mm"] = dataclasses.replace(c["mm"], fp8_matmul=True, io_bytes=8_000_000, weight_bytes=4_000_000)
        >>> [round(f * 1e3, 3) for f in node_times(c, DEVICES["h100"], precision="fp8")["mm"]]
        [0.945, 1.868]
    """
    check_precision(precision)
    if measure:
        return {name: (c.forward_s, c.backward_s) for name, c in costs.items()}
    fast = spec
    if precision == "fp8":
        peak = fp8_peak(spec.peak_flops, fp8_recipe)
        if peak is not None:
            fast = dataclasses.replace(spec, peak_flops={**spec.peak_flops, FP8_DTYPE: peak})
    times: dict[str, tuple[float, float]] = {}
    for name, c in costs.items():
        cost = at_precision(c, precision)
        if cost.dtype != FP8_DTYPE or fast is spec:
            times[name] = predicted_times(cost, spec)
            continue
        forward, backward = predicted_times(cost, fast)
        bandwidth = spec.memory_bandwidth * spec.efficiency_of("memory")
        item = 2  # the casts read bf16 values: at_precision's bytes are bf16's
        cast_f, cast_b = fp8_cast_bytes((cost.io_bytes - cost.weight_bytes) / item, cost.weight_bytes / item)
        times[name] = (forward + cast_f / bandwidth + 2 * spec.kernel_overhead,
                       backward + cast_b / bandwidth + spec.kernel_overhead if backward else 0.0)
    return times


def graph_costs(
    captured: CapturedModel,
    blocks: list[tuple[str, ...]],
    costs: dict[str, NodeCost],
    times: dict[str, tuple[float, float]],
    *,
    loss_s: tuple[float, float] = (0.0, 0.0),
    split_overhead_s: float = 0.0,
    split_share: float = 0.0,
    split_forward: float = 0.0,
    split_weight: float = 0.0,
    action_s: float = 0.0,
) -> GraphCosts:
    """Aggregate node costs per block; ``times`` gives (forward, backward) seconds per node (:func:`node_times`).

    ``costs`` are as profiled, in the model's own dtype.
    """
    gm = captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    block_of = {name: b for b, members in enumerate(blocks) for name in members}
    param_bytes: dict[str, int] = {}
    param_elements: dict[str, int] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        param_bytes[captured.parameter_names[name]] = param.nbytes
        param_elements[captured.parameter_names[name]] = param.numel()
    edges: set[tuple[int, int]] = set()
    sends = [0] * len(blocks)
    senders: list[list[str]] = [[] for _ in blocks]
    inputs: list[dict[str, None]] = [{} for _ in blocks]  # insertion-ordered sets
    block_params: list[set[str]] = [set() for _ in blocks]
    runs = _layer_runs(gm)
    run_of = {name: r for r, run in enumerate(runs) for name in run}
    kept_once: set[tuple[int, str]] = set()
    for b, members in enumerate(blocks):
        for name in members:
            node = nodes[name]
            block_params[b].update(captured.parameter_names[p] for p in node_parameters(gm, node))
            readers = {block_of[u.name] for u in node.users if u.name in block_of} - {b}
            if any(u.op == "output" for u in node.users) and b != len(blocks) - 1:
                readers.add(len(blocks) - 1)
            edges.update((b, r) for r in readers)
            if readers:
                sends[b] += _nbytes(node)
                senders[b].append(name)
            # A recomputed layer keeps what it reads from outside itself, once, however many of the
            # solver's blocks (about three per transformer layer) split it (runtime/execute/recompute.py).
            run = run_of.get(name, -1 - b)
            for arg in node.all_input_nodes:
                outside = arg.meta.get(KIND_KEY) == "input" or (
                    block_of.get(arg.name, b) != b and run_of.get(arg.name) != run)
                if outside and (run, arg.name) not in kept_once:
                    kept_once.add((run, arg.name))
                    inputs[b][arg.name] = None
    graph_inputs = {name for block in inputs for name in block if name not in block_of}
    values = [*block_of, *sorted(graph_inputs)]
    return GraphCosts(
        blocks=tuple(blocks),
        node_time_s={k: f + b for k, (f, b) in times.items()},
        node_forward_s={k: f for k, (f, _) in times.items()},
        node_saved_bytes={k: c.saved_bytes for k, c in costs.items()},
        node_output_bytes={name: _nbytes(nodes[name]) for name in values},
        parameter_bytes=param_bytes,
        block_parameters=tuple(tuple(sorted(p)) for p in block_params),
        edges=tuple(sorted(edges)),
        block_sends=tuple(sends),
        loss_s=loss_s,
        parameter_elements=param_elements,
        node_dtype={name: _dtype(nodes[name], costs.get(name)) for name in values},
        block_senders=tuple(tuple(names) for names in senders),
        block_inputs=tuple(tuple(names) for names in inputs),
        layer_runs=tuple(runs),
        node_flops={k: c.forward_flops + c.backward_flops for k, c in costs.items()},
        node_saved_float32_bytes={
            k: c.saved_float32_bytes for k, c in costs.items() if c.saved_float32_bytes is not None
        },
        node_weight_s={
            name: weight_seconds(times[name][1], reads_parameters=True, cost=costs.get(name))
            for members in blocks for name in members
            if name in times and node_parameters(gm, nodes[name])
        },
        split_overhead_s=split_overhead_s,
        split_share=split_share,
        node_writes_in_place=frozenset(k for k, c in costs.items() if c.writes_in_place),
        fp8_nodes=frozenset(k for k, c in costs.items() if c.fp8_matmul),
        split_forward=split_forward,
        split_weight=split_weight,
        action_s=action_s,
        expert_parameters=frozenset(p for layer in captured.experts for p in layer.parameters),
        expert_layers=tuple(
            ExpertBlock(block_of[layer.output], float(layer.tokens_per_batch), layer.top_k, layer.hidden,
                        tuple(n for n in layer.nodes if n in block_of))
            for layer in captured.experts if layer.output in block_of),
    )


def weight_seconds(backward_s: float, *, reads_parameters: bool, cost: NodeCost | None = None) -> float:
    """The weight-gradient (W) part of a node's backward: none without parameters; else the measured
    share (``cost.weight_backward_s`` of ``cost.backward_s``), or half when not measured.

    >>> weight_seconds(2e-3, reads_parameters=True), weight_seconds(2e-3, reads_parameters=False)
    (0.001, 0.0)
    >>> c = NodeCost(1e-3, 3e-3, 0.0, 0.0, 0, 0, "float32", weight_backward_s=1e-3)
    >>> round(weight_seconds(6e-3, reads_parameters=True, cost=c), 6)   # a third, measured
    0.002
    """
    if not reads_parameters:
        return 0.0
    if cost is not None and cost.weight_backward_s > 0 and cost.backward_s > 0:
        return min(1.0, cost.weight_backward_s / cost.backward_s) * backward_s
    return WEIGHT_SHARE * backward_s


def _nbytes(node: fx.Node) -> int:
    info = node.meta.get(VALUE_KEY)
    return info.nbytes if isinstance(info, ValueInfo) else 0


def _dtype(node: fx.Node, cost: NodeCost | None) -> str:
    """The dtype of a node's value (its first tensor's for a node returning several)."""
    info = node.meta.get(VALUE_KEY)
    if isinstance(info, ValueInfo) and info.kind == "tensor":
        return info.dtype
    return cost.dtype if cost is not None else ""


def formulate(
    graph: GraphCosts,
    *,
    dp: int,
    spec: DeviceSpec,
    memory_limit: float | None,
    precision: str = "fp32",
    optimizer_states: int = 2,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    gpus_per_node: int | None = None,
    recompute: str = "none",
    shard: str = "none",
    zero3_unit: str = "layer",
    ep: int = 1,
    expert_imbalance: float = DEFAULT_IMBALANCE,
) -> PartitionProblem:
    """The solver's problem for ``dp`` replicas per stage (any number of stages).

    ``graph``'s times must have been priced for ``precision`` (:func:`node_times`);
    bytes are scaled to it here.  ``gpus_per_node`` (``None``: one node) and
    ``recompute`` ("none", "full" or "auto") are carried to the solver, which
    picks the intra- or inter-node prices and the recomputation per stage.
    ``shard``: how every stage group's replicas hold their state ("none": DDP;
    "optimizer"; "full", kept gathered across micro-batches): static bytes per
    :func:`~partitioner.cost.precision.shard_state_bytes` (plus, "full", the
    gathered weights and unsharded gradients, :func:`~partitioner.cost.precision.gathered_bytes`),
    and ``allreduce_s`` the mode's collectives per step
    (:func:`~partitioner.cost.comm.shard_step_seconds`: no buckets, the latency
    in the stage's fixed term, as a ring all-reduce's ``2 (D-1)``).
    ``shard`` :data:`ZERO3` (a plan's "full" with ``reshard_after_forward``):
    everything sharded, no per-step collective; each block's time carries what its
    layer's per-micro-batch all-gathers and reduce-scatter add beyond its compute,
    ``action_s`` a stage's first unit's all-gather per forward and backward, and
    ``memory_limit`` loses the gathered units (:func:`zero3_costs`).  :data:`HSDP`
    and :data:`HSDP_ZERO3`: the same sharded over one node's replicas
    (``gpus_per_node`` of them, where the group spans whole nodes), the shards'
    gradients all-reduced across the nodes (:func:`mode_parts`).  A group's
    collectives that cross nodes run on :func:`~partitioner.cost.comm.ring_link`.
    ``ep`` > 1 (expert parallelism, :mod:`partitioner.cost.experts`): the experts'
    state is divided by ``ep`` and its gradients reduced over ``dp / ep`` replicas
    (sharded, in the mode's way, over those); each experts layer's block carries its
    four all-to-alls and ``expert_imbalance`` times its experts' compute.
    """
    check_precision(precision)
    if ep < 1 or dp % ep:
        raise ValueError(f"ep {ep} must divide dp {dp}")
    base, reshard, span = mode_parts(shard)
    sharded = base != "none" and dp > 1
    zero3 = reshard and dp > 1
    shards = shard_degree(base, dp, gpus_per_node, span=span)
    scale = 1.0 / dp
    intra, inter = link(spec), link(spec, inter_node=True)
    # A stage group's collectives inside a node run on NVLink; across nodes on the ports of its members on a
    # node (cost/comm.py); HSDP's across nodes are an all-reduce per shard, each with one member per node.
    ring = ring_link(spec, crosses=True, members_per_node=members_per_node(dp, gpus_per_node))
    hsdp = sharded and base == "full" and shards < dp
    readers: dict[str, list[int]] = {}
    for b, params in enumerate(graph.block_parameters):
        for p in params:
            readers.setdefault(p, []).append(b)
    n = len(graph.blocks)
    static, allreduce, allreduce_slow = [0.0] * n, [0.0] * n, [0.0] * n
    shared: list[tuple[float, float, tuple[int, ...]]] = []
    shared_slow: list[float] = []
    experts = graph.expert_parameters if ep > 1 else frozenset()
    # The expert-data-parallel group: dp / ep replicas, ep apart, so ep times fewer of them on a node.
    edp = dp // ep
    edp_ring = ring_link(spec, crosses=True, members_per_node=max(1, members_per_node(dp, gpus_per_node) // ep))
    for p, blocks in readers.items():
        nbytes: float = graph.parameter_bytes[p]
        elements: float = graph.parameter_elements.get(p, nbytes / 4)
        if p in experts:
            # This member's E / ep experts, whole whatever the stage's shard mode (the runtime shards only the
            # dense parameters: runtime/parallel/experts.py), all-reduced over the expert-data-parallel group.
            nbytes, elements = nbytes / ep, elements / ep
            held = state_bytes(precision, optimizer_states, elements=elements, model_bytes=nbytes)
            grads = gradient_bytes(precision, elements=elements, model_bytes=nbytes)
            fast, slow = (_allreduce(grads, edp, on, bucket_cap_mb) for on in (intra, edp_ring))
        else:
            held, fast, slow = _dense_state(
                precision, optimizer_states, elements=elements, nbytes=nbytes, dp=dp, base=base, zero3=zero3,
                sharded=sharded, shards=shards, hsdp=hsdp, links=(intra, inter, ring), bucket_cap_mb=bucket_cap_mb,
                fp8_gathered=precision == "fp8" and p in graph.fp8_gathered)
        if len(blocks) == 1:
            static[blocks[0]] += held
            allreduce[blocks[0]] += fast
            allreduce_slow[blocks[0]] += slow
        else:
            shared.append((held, fast, tuple(blocks)))
            shared_slow.append(slow)
    sums = _block_sums(graph, precision=precision)  # per block, before the replicas' share (scale)
    sent = [scale * x for x in sums.sent]
    recomputable = bool(graph.block_inputs)  # else: costs made by hand, without block inputs
    optional: dict[str, Any] = {
        "transfer_slow_s": tuple(2 * inter.message_seconds(b) for b in sent),
        "allreduce_slow_s": tuple(allreduce_slow),
        "shared_slow_allreduce_s": tuple(shared_slow),
        "allreduce_latency_slow_s": ring.latency_seconds(dp),
        "replicas": dp,
        "gpus_per_node": gpus_per_node,
        "recompute_bytes": tuple(scale * x for x in sums.inputs) if recomputable else None,
        "recompute_s": tuple(scale * x for x in sums.forward) if recomputable else None,
        "recompute_peak_bytes": _layer_peaks(graph, scale, precision) if recomputable and graph.layer_runs else None,
        **(_cheap_recompute(graph, scale, precision) if recomputable and graph.node_flops else {}),
        "layer_start": sums.layer_start if recomputable and graph.layer_runs else None,
        "recompute": recompute,
        "message_host_s": spec.message_host_s,
        "weight_s": tuple(scale * x for x in sums.weight) if graph.node_weight_s else None,
        # Host time per call: the same whatever the replicas' share of the micro-batch (no scale);
        # the part that grows with the op scales with it.
        "split_s": tuple(
            sum(graph.split_overhead_s + graph.split_share * scale * graph.node_time_s[m]
                for m in members if m in graph.node_weight_s) for members in graph.blocks
        ) if graph.split_overhead_s or graph.split_share else None,
        "split_forward": graph.split_forward,
        "split_weight": graph.split_weight,
        "action_s": graph.action_s,
    }
    times = [scale * x for x in sums.time]
    if ep > 1:
        added = expert_seconds(graph, dp=dp, ep=ep, imbalance=expert_imbalance, precision=precision, spec=spec,
                               gpus_per_node=gpus_per_node)
        times = [t + f + b for t, f, b in zip(times, *added, strict=True)]
    if zero3:
        z = zero3_costs(graph, dp=dp, spec=spec, precision=precision, gpus_per_node=gpus_per_node, span=span,
                        unit=zero3_unit, ep=ep)
        times = [t + f + b for t, f, b in zip(times, z.forward_s, z.backward_s, strict=True)]
        optional["action_s"] = graph.action_s + z.first_gather_s  # every F and B waits for its first unit
        if memory_limit is not None:
            memory_limit -= z.transient_bytes  # the gathered units, on every rank whatever its split
    return PartitionProblem(
        time_s=tuple(times),
        static_bytes=tuple(static),
        activation_bytes=tuple(scale * x for x in sums.saved),
        allreduce_s=tuple(allreduce),
        transfer_s=tuple(2 * intra.message_seconds(b) for b in sent),  # activation forward, gradient back
        edges=graph.edges,
        shared=tuple(shared),
        memory_limit=memory_limit,
        allreduce_latency_s=intra.latency_seconds(dp),
        # Until the solver's problem has every topology and recomputation field, pass those it has.
        **{k: v for k, v in optional.items() if k in _PROBLEM_FIELDS},
    )


_PROBLEM_FIELDS = frozenset(f.name for f in dataclasses.fields(PartitionProblem))


def _dense_state(precision: str, optimizer_states: int, *, elements: float, nbytes: float, dp: int, base: str,
                 zero3: bool, sharded: bool, shards: int, hsdp: bool, links: tuple[Link, Link, Link],
                 bucket_cap_mb: float, fp8_gathered: bool = False) -> tuple[float, float, float]:
    """(bytes held, collective seconds inside a node, across nodes) of one parameter under the stage's mode
    (``fp8_gathered``: a ``full`` stage gathers it as its FP8 cast, 1 byte per element)."""
    intra, inter, ring = links
    held = state_bytes(precision, optimizer_states, elements=elements, model_bytes=nbytes)
    grads = gradient_bytes(precision, elements=elements, model_bytes=nbytes)
    if zero3:  # everything sharded; its collectives are per micro-batch (zero3_costs)
        return shard_state_bytes(precision, optimizer_states, "full", shards, elements=elements,
                                 model_bytes=nbytes), 0.0, 0.0
    if not sharded:
        fast, slow = (_allreduce(grads, dp, on, bucket_cap_mb) for on in (intra, ring))
        return held, fast, slow
    held = shard_state_bytes(precision, optimizer_states, base, shards, elements=elements, model_bytes=nbytes)
    if base == "full":  # kept gathered: its FP8 weights held as their 1-byte casts
        held += gathered_bytes(precision, elements=elements, model_bytes=nbytes) - fp8_gather_saving(
            precision, elements if fp8_gathered else 0.0)
    once = functools.partial(
        shard_step_seconds, base, gradient_bytes=grads,
        weight_bytes=weight_bytes(precision, elements=elements, model_bytes=nbytes),
        gathered_bytes=weight_bytes(precision, elements=elements, model_bytes=nbytes, compute=True)
        - fp8_gather_saving(precision, elements if fp8_gathered else 0.0))
    # HSDP: gathered and reduce-scattered inside the node, the shard's gradients all-reduced across nodes.
    slow = once(shards, intra) + inter.allreduce_seconds(grads / shards, dp // shards) if hsdp else once(dp, ring)
    return held, once(dp, intra), slow


def expert_seconds(graph: GraphCosts, *, dp: int, ep: int, imbalance: float, precision: str, spec: DeviceSpec,
                   gpus_per_node: int | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per block, the (forward, backward) seconds expert parallelism adds per micro-batch on one GPU.

    Each experts layer's block carries its all-to-alls (:func:`~partitioner.cost.experts.expert_layer_seconds`)
    and its busiest member's extra compute, ``imbalance - 1`` times its experts' own.  Nothing for ``ep`` 1.
    """
    forward, backward = [0.0] * len(graph.blocks), [0.0] * len(graph.blocks)
    if ep <= 1:
        return tuple(forward), tuple(backward)
    element = 4 * activation_scale(precision, "float32")  # the routed rows travel in the compute dtype
    local = members_per_node(ep, gpus_per_node)  # ep consecutive replicas, aligned at multiples of ep
    scale = 1.0 / dp
    for layer in graph.expert_layers:
        sent_f, sent_b = expert_layer_seconds(
            layer.tokens * scale, top_k=layer.top_k, hidden=layer.hidden, element_bytes=element, ep=ep,
            members_per_node=local, intra=link(spec), inter=link(spec, inter_node=True))
        own_f = sum(graph.node_forward_s.get(n, 0.0) for n in layer.nodes)
        own = sum(graph.node_time_s.get(n, 0.0) for n in layer.nodes)
        forward[layer.block] += sent_f + (imbalance - 1.0) * scale * own_f
        backward[layer.block] += sent_b + (imbalance - 1.0) * scale * (own - own_f)
    return tuple(forward), tuple(backward)


def _allreduce(gradient_bytes: float, replicas: int, on: Link, bucket_cap_mb: float) -> float:
    """All-reduce seconds of one parameter's gradients, with its share of the DDP buckets' latency."""
    return on.allreduce_seconds(
        gradient_bytes, replicas, messages=bucket_share(gradient_bytes, bucket_cap_mb=bucket_cap_mb)
    )


@dataclasses.dataclass(frozen=True)
class Zero3Costs:
    """What ZeRO-3 (shard "full" with ``reshard_after_forward``) adds, per block and per stage.

    ``forward_s`` / ``backward_s``: per block and micro-batch, the seconds its
    layer's collectives take beyond the block's own compute
    (:func:`~partitioner.cost.comm.zero3_microbatch_seconds`); ``first_gather_s``:
    the all-gather of a stage's first unit in a pass, exposed once per forward and
    per backward (priced as the largest repeated layer's: a stage starts and ends
    with layers, only the first and last stages with the embedding or the head); ``transient_bytes``: at the end of
    the largest unit's backward, its gathered weights and gradients, the next unit's prefetched weights and the
    previous unit's reduce-scatter input (:func:`~partitioner.cost.precision.zero3_transient_bytes`).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    first_gather_s: float
    transient_bytes: float


_Costs = typing.TypeVar("_Costs")


def _kept_per_graph(function: Callable[..., _Costs]) -> Callable[..., _Costs]:
    """``function(graph, **keywords)`` (a pure function of the costs and its keywords), kept with ``graph``: the
    search asks again for what it priced for every (dp, M, mode) trial.  Keywords that do not hash (a
    :class:`~partitioner.cost.devices.DeviceSpec`) are told apart by identity and held with the answer."""

    @functools.wraps(function)
    def kept(graph: GraphCosts, **keywords: Any) -> _Costs:
        held, key = [], []
        for name, value in sorted(keywords.items()):
            try:
                hash(value)
                key.append((name, value))
            except TypeError:
                key.append((name, id(value)))
                held.append(value)
        sums = graph.__dict__.setdefault("_sums", {})
        found = sums.get((function.__name__, *key))
        if found is None or any(a is not b for a, b in zip(found[0], held, strict=True)):
            found = sums[(function.__name__, *key)] = (tuple(held), function(graph, **keywords))
        return found[1]

    return kept


@_kept_per_graph
def zero3_costs(
    graph: GraphCosts, *, dp: int, spec: DeviceSpec, precision: str, gpus_per_node: int | None,
    span: str = "world", unit: str = "layer", ep: int = 1,
) -> Zero3Costs:
    """ZeRO-3's exposed collectives and transient memory for ``graph`` on ``dp`` replicas (see :class:`Zero3Costs`).

    The runtime's units are layers (runtime/parallel/shard.py groups a stage's nodes by
    their layer, ``partitioner.graph.ir.layer_of``); a parameter's layer is its
    name's prefix up to the first list index (``model.layers.3``), or the name's
    module (``lm_head``).  Sharded over every replica (``span`` "world") a group
    that crosses nodes gathers and reduce-scatters on
    :func:`~partitioner.cost.comm.ring_link` (its members' ports on a node); over
    one node's replicas ("node", HSDP, where the group spans whole nodes) on
    NVLink, each shard's gradients then all-reduced across the nodes on one port.
    Each unit's collectives pay a ring's latency once (``(D - 1)`` steps: at thousands
    of replicas, tens of milliseconds each), on the block where the unit starts:
    ``unit`` "layer" is FSDP2's (one unit per layer, as runtime/parallel/shard.py and
    torchtitan wrap), each prefetched behind the compute before it; "module", one per
    parameter-owning module, fetched in that module's own hook before its compute, is
    how DeepSpeed's ZeRO-3 fetched parameters (for pricing published runs): none hides.
    """
    if unit not in ZERO3_UNITS:
        raise ValueError(f"unit is {unit!r}, expected one of {', '.join(ZERO3_UNITS)}")
    if ep > 1 and graph.expert_parameters:  # the experts stay whole on their members: FSDP2 gathers none of them
        graph = dataclasses.replace(
            graph, parameter_bytes={k: v for k, v in graph.parameter_bytes.items() if k not in graph.expert_parameters},
            block_parameters=tuple(tuple(p for p in ps if p not in graph.expert_parameters)
                                   for ps in graph.block_parameters))
    shards = shard_degree("full", dp, gpus_per_node, span=span)
    crosses = gpus_per_node is not None and (dp > gpus_per_node or gpus_per_node % dp != 0)
    hsdp = shards < dp
    on = ring_link(spec, crosses=crosses and not hsdp, members_per_node=members_per_node(dp, gpus_per_node))
    inter = link(spec, inter_node=True)
    fp8 = graph.fp8_gathered if precision == "fp8" else frozenset()
    units: dict[str, tuple[float, float]] = {}  # unit (layer or module) -> (elements, model bytes)
    unit_fp8: dict[str, float] = {}  # unit -> its elements gathered as FP8 casts
    for name, nbytes in graph.parameter_bytes.items():
        elements = graph.parameter_elements.get(name, nbytes / 4)
        owner = name.rpartition(".")[0]
        key = layer_of(owner) if unit == "layer" else owner
        e, b = units.get(key, (0.0, 0.0))
        units[key] = (e + elements, b + nbytes)
        if name in fp8:
            unit_fp8[key] = unit_fp8.get(key, 0.0) + elements
    largest_key = max(units, key=lambda k: units[k][1], default="")
    largest = units.get(largest_key, (0.0, 0.0))
    # A stage's first unit in a pass is one of its layers' (the embedding or the LM head only at the ends).
    layers = [eb for name, eb in units.items() if any(part.isdigit() for part in name.split("."))]
    first_unit = max(layers, key=lambda eb: eb[1], default=largest)
    forward, backward = [], []
    scale = 1.0 / dp
    started: set[str] = set()
    for b, members in enumerate(graph.blocks):
        owners = {p.rpartition(".")[0] for p in graph.block_parameters[b]}
        keys = {layer_of(o) if unit == "layer" else o for o in owners} - started
        started |= keys
        elements = sum(graph.parameter_elements.get(p, graph.parameter_bytes[p] / 4) for p in graph.block_parameters[b])
        nbytes = sum(graph.parameter_bytes[p] for p in graph.block_parameters[b])
        if not nbytes:
            forward.append(0.0)
            backward.append(0.0)
            continue
        w = weight_bytes(precision, elements=elements, model_bytes=nbytes, compute=True) - fp8_gather_saving(
            precision, sum(graph.parameter_elements.get(p, 0) for p in graph.block_parameters[b] if p in fp8))
        g = gradient_bytes(precision, elements=elements, model_bytes=nbytes)
        across = inter.allreduce_seconds(g / shards, dp // shards) if hsdp else 0.0
        f = scale * sum(graph.node_forward_s[m] for m in members)
        total = scale * sum(graph.node_time_s[m] for m in members)
        # DeepSpeed's module hooks fetched synchronously (no compute beside them): nothing hides them.
        hidden = unit == "layer"
        fe, be = zero3_microbatch_seconds(shards, on, weight_bytes=w, gradient_bytes=g,
                                          forward_s=f if hidden else 0.0, backward_s=total - f if hidden else 0.0,
                                          across_s=across, messages=len(keys))
        forward.append(fe)
        backward.append(be)
    e, nb = first_unit
    first_fp8 = next((unit_fp8.get(k, 0.0) for k, eb in units.items() if eb is first_unit), 0.0)
    first = on.shard_seconds(weight_bytes(precision, elements=e, model_bytes=nb, compute=True)
                             - fp8_gather_saving(precision, first_fp8), shards) if nb else 0.0
    e, nb = largest
    # Its transient holds two units' gathered weights (this one's and the next one's, taken as its size):
    # their FP8 weights at 1 byte per element.
    transient = zero3_transient_bytes(precision, elements=e, model_bytes=nb) - 2 * fp8_gather_saving(
        precision, unit_fp8.get(largest_key, 0.0))
    return Zero3Costs(tuple(forward), tuple(backward), first, transient if nb else 0.0)


def _layer_runs(gm: Any) -> list[tuple[str, ...]]:
    """The graph's compute nodes in layer runs, as ``runtime.execute.recompute.block_nodes`` groups a stage."""
    return layer_runs(gm.graph.nodes)


@dataclasses.dataclass(frozen=True)
class _BlockSums:
    """Per block, what :func:`formulate` scales by the replicas' share (``1 / dp``): the same for every dp."""

    sent: tuple[float, ...]  # bytes sent to one other stage
    inputs: tuple[float, ...]  # bytes kept when recomputed (its layer's inputs)
    forward: tuple[float, ...]  # forward seconds (a recomputation's)
    weight: tuple[float, ...]  # W seconds
    time: tuple[float, ...]  # forward + backward seconds (the loss's on the last block)
    saved: tuple[float, ...]  # activation bytes
    layer_start: tuple[bool, ...]
    run_saved: tuple[float, ...]  # activation bytes of each layer run
    op_kept: tuple[float, ...]  # bytes kept when recomputing only the cheap ops (_cheap_recompute)
    op_again: tuple[float, ...]  # and the seconds that takes


@_kept_per_graph
def _block_sums(graph: GraphCosts, *, precision: str) -> _BlockSums:
    """:class:`_BlockSums` of ``graph`` at ``precision`` (kept with it: every (dp, M) problem asks)."""
    last = len(graph.blocks) - 1
    recomputable = bool(graph.block_inputs)
    op_kept: list[float] = []
    op_again: list[float] = []
    if recomputable and graph.node_flops:
        run_of = {name: r for r, run in enumerate(graph.layer_runs) for name in run}
        writing = {run_of.get(name, -1) for name in graph.node_writes_in_place}
        for b, members in enumerate(graph.blocks):
            if any(run_of.get(m, -2) in writing or m in graph.node_writes_in_place for m in members):
                op_kept.append(graph.value_bytes(graph.block_inputs[b], precision))
                op_again.append(sum(graph.node_forward_s[m] for m in members))
                continue
            heavy = [m for m in members if graph.node_flops.get(m, 0.0) > 0]
            light = [m for m in members if graph.node_flops.get(m, 0.0) <= 0]
            op_kept.append(graph.value_bytes(graph.block_inputs[b], precision) + graph.value_bytes(heavy, precision))
            op_again.append(sum(graph.node_forward_s[m] for m in light))
    return _BlockSums(
        sent=tuple(graph.sent_bytes(b, precision) for b in range(len(graph.blocks))),
        inputs=tuple(graph.value_bytes(graph.block_inputs[b], precision)
                     for b in range(len(graph.blocks))) if recomputable else (),
        forward=tuple(sum(graph.node_forward_s[m] for m in members) for members in graph.blocks),
        weight=tuple(sum(graph.node_weight_s.get(m, 0.0) for m in members) for members in graph.blocks),
        time=tuple(sum(graph.node_time_s[m] for m in members) + (sum(graph.loss_s) if b == last else 0.0)
                   for b, members in enumerate(graph.blocks)),
        saved=tuple(graph.saved_bytes(members, precision) for members in graph.blocks),
        layer_start=_layer_starts(graph) if graph.layer_runs else (),
        run_saved=tuple(graph.saved_bytes(run, precision) for run in graph.layer_runs),
        op_kept=tuple(op_kept),
        op_again=tuple(op_again),
    )


def _cheap_recompute(graph: GraphCosts, scale: float, precision: str) -> dict[str, tuple[float, ...]]:
    """``op_kept_bytes`` and ``op_recompute_s`` per block: per-op selective recomputation.

    A block that recomputes only its cheap ops keeps its inputs (as a recomputed
    block does) and the outputs of the ops that carry FLOPs (matrix
    multiplications and attention: the nodes ``torch.utils.flop_counter`` counts,
    as runtime/execute/recompute.py's policy saves them), and spends the forward seconds
    of its other nodes again: per-op selective activation checkpointing as in
    torchtitan (``torchtitan/distributed/activation_checkpoint.py``, whose saved
    list is the matmuls and attention; it also recomputes every second matmul,
    which this does not).  A layer run writing anything in place cannot (torch refuses an op
    writing into an output the policy saved, so runtime/execute/recompute.py recomputes it wholly): its
    blocks are priced as recomputing wholly.
    """
    sums = _block_sums(graph, precision=precision)  # the sums below, before the replicas' share
    return {"op_kept_bytes": tuple(scale * x for x in sums.op_kept),
            "op_recompute_s": tuple(scale * x for x in sums.op_again)}


def _layer_starts(graph: GraphCosts) -> tuple[bool, ...]:
    """Per block: does it begin a layer run (its first node in another run than the block before's last)?

    A stage's runtime layers (``runtime.execute.recompute.block_nodes``) then split where these blocks
    start, so recomputing a stage's blocks before one of them recomputes whole runtime layers.
    """
    run_of = {name: r for r, run in enumerate(graph.layer_runs) for name in run}
    return tuple(b > 0 and run_of.get(members[0], -1) != run_of.get(graph.blocks[b - 1][-1], -2)
                 for b, members in enumerate(graph.blocks))


def _layer_peaks(graph: GraphCosts, scale: float, precision: str) -> tuple[float, ...]:
    """Per block: the activations of the largest layer run it belongs to, live again while it recomputes.

    The runtime recomputes a whole layer before its backward, so a recomputing stage holds one
    layer's activations at a time, not one of the solver's smaller blocks'.
    """
    sums = _block_sums(graph, precision=precision)
    run_bytes = [scale * x for x in sums.run_saved]
    own = [scale * x for x in sums.saved]
    return tuple(max([own[b], *(run_bytes[r] for r in runs)]) for b, runs in enumerate(_block_runs(graph)))


@_kept_per_graph
def _block_runs(graph: GraphCosts) -> tuple[tuple[int, ...], ...]:
    """Per block, the layer run of each of its nodes that has one, in the block's order (kept with the graph)."""
    run_of = {name: r for r, run in enumerate(graph.layer_runs) for name in run}
    return tuple(tuple(run_of[m] for m in members if m in run_of) for members in graph.blocks)
