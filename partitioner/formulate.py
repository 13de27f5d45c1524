"""Formulate: turn a costed graph and one pp x dp candidate into a PartitionProblem.

Costs were profiled for one micro-batch of ``batch / microbatches`` samples;
with ``dp`` replicas each replica sees ``1/dp`` of that, and compute time and
activation bytes are scaled linearly (an approximation that overstates small
per-op overheads' share at large dp).  Communication follows the alpha-beta
model: a boundary tensor costs ``latency + bytes / link_bandwidth`` forward and
the same for its gradient backward; a replica group all-reduces gradients with
a ring, ``2 (D-1)/D * bytes / bandwidth + 2 (D-1) * latency`` (Patarasuk and
Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009).

Static memory per parameter byte is ``1 + 1 + optimizer_states`` (weights,
gradients, Adam's two moments by default).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from partitioner.capture import KIND_KEY, CapturedModel, node_parameters
from partitioner.cost import NodeCost
from partitioner.devices import DeviceSpec
from partitioner.problem import PartitionProblem
from partitioner.values import VALUE_KEY, ValueInfo

__all__ = ["GraphCosts", "allreduce_seconds", "formulate", "transfer_seconds"]


@dataclasses.dataclass(frozen=True)
class GraphCosts:
    """Per-node numbers the formulation needs, independent of pp x dp."""

    blocks: tuple[tuple[str, ...], ...]
    node_time_s: dict[str, float]  # forward + backward, one micro-batch at dp = 1
    node_forward_s: dict[str, float]
    node_saved_bytes: dict[str, int]
    node_output_bytes: dict[str, int]
    parameter_bytes: dict[str, int]  # canonical parameter name -> bytes
    block_parameters: tuple[tuple[str, ...], ...]  # canonical names read by each block
    edges: tuple[tuple[int, int], ...]  # block edges u -> v, u < v
    block_sends: tuple[int, ...]  # bytes each block sends to one other stage
    loss_s: tuple[float, float] = (0.0, 0.0)  # loss forward, backward: the last block's stage computes it


def transfer_seconds(nbytes: float, spec: DeviceSpec) -> float:
    """One point-to-point message."""
    return 0.0 if nbytes <= 0 else spec.link_latency + nbytes / spec.link_bandwidth


def allreduce_seconds(nbytes: float, replicas: int, spec: DeviceSpec, *, messages: int = 1) -> float:
    """Ring all-reduce of ``nbytes`` across ``replicas`` ranks, sent as ``messages`` buckets."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps / replicas * nbytes / spec.link_bandwidth + messages * steps * spec.link_latency


def graph_costs(
    captured: CapturedModel,
    blocks: list[tuple[str, ...]],
    costs: dict[str, NodeCost],
    times: dict[str, tuple[float, float]],
    *,
    loss_s: tuple[float, float] = (0.0, 0.0),
) -> GraphCosts:
    """Aggregate node costs per block; ``times`` gives (forward, backward) seconds per node."""
    gm = captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    block_of = {name: b for b, members in enumerate(blocks) for name in members}
    param_bytes: dict[str, int] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        param_bytes[captured.parameter_names[name]] = param.numel() * param.element_size()
    edges: set[tuple[int, int]] = set()
    sends = [0] * len(blocks)
    block_params: list[set[str]] = [set() for _ in blocks]
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
    return GraphCosts(
        blocks=tuple(blocks),
        node_time_s={k: f + b for k, (f, b) in times.items()},
        node_forward_s={k: f for k, (f, _) in times.items()},
        node_saved_bytes={k: c.saved_bytes for k, c in costs.items()},
        node_output_bytes={name: _nbytes(nodes[name]) for name in block_of},
        parameter_bytes=param_bytes,
        block_parameters=tuple(tuple(sorted(p)) for p in block_params),
        edges=tuple(sorted(edges)),
        block_sends=tuple(sends),
        loss_s=loss_s,
    )


def _nbytes(node: fx.Node) -> int:
    info = node.meta.get(VALUE_KEY)
    return info.nbytes if isinstance(info, ValueInfo) else 0


def formulate(
    graph: GraphCosts,
    *,
    dp: int,
    spec: DeviceSpec,
    memory_limit: float | None,
    optimizer_states: int = 2,
    bucket_cap_mb: float = 25.0,
) -> PartitionProblem:
    """The solver's problem for ``dp`` replicas per stage (any number of stages)."""
    scale = 1.0 / dp
    readers: dict[str, list[int]] = {}
    for b, params in enumerate(graph.block_parameters):
        for p in params:
            readers.setdefault(p, []).append(b)
    per_byte = 2 + optimizer_states
    static = [0.0] * len(graph.blocks)
    allreduce = [0.0] * len(graph.blocks)
    shared: list[tuple[float, float, tuple[int, ...]]] = []
    for p, blocks in readers.items():
        nbytes = graph.parameter_bytes[p]
        # Latency is paid per DDP bucket: each byte carries its share, the first bucket is fixed.
        seconds = allreduce_seconds(nbytes, dp, spec, messages=0) + _latency_share(nbytes, dp, spec, bucket_cap_mb)
        if len(blocks) == 1:
            static[blocks[0]] += per_byte * nbytes
            allreduce[blocks[0]] += seconds
        else:
            shared.append((per_byte * nbytes, seconds, tuple(blocks)))
    last = len(graph.blocks) - 1
    return PartitionProblem(
        time_s=tuple(
            scale * (sum(graph.node_time_s[n] for n in members) + (sum(graph.loss_s) if b == last else 0.0))
            for b, members in enumerate(graph.blocks)
        ),
        static_bytes=tuple(static),
        activation_bytes=tuple(
            scale * sum(graph.node_saved_bytes.get(n, 0) for n in members) for members in graph.blocks
        ),
        allreduce_s=tuple(allreduce),
        transfer_s=tuple(2 * transfer_seconds(scale * b, spec) for b in graph.block_sends),
        edges=graph.edges,
        shared=tuple(shared),
        memory_limit=memory_limit,
        allreduce_latency_s=2 * (dp - 1) * spec.link_latency,
    )


def _latency_share(nbytes: float, dp: int, spec: DeviceSpec, bucket_cap_mb: float) -> float:
    return nbytes / (bucket_cap_mb * 1024**2) * 2 * (dp - 1) * spec.link_latency


def is_compute(node: fx.Node) -> bool:
    return node.meta.get(KIND_KEY) == "compute"
