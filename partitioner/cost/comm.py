"""The communication cost model, in one place: messages, ring all-reduce, DDP buckets.

The solver's closed form (:mod:`partitioner.solve.formulate`) and the simulator
(:mod:`partitioner.schedule.simulate`) must price communication alike, or the plan the
solver prefers is not the one the simulation confirms.  Pure numbers (a link's
bandwidth in bytes/s and latency in seconds per message); no torch.

* A point-to-point message follows the alpha-beta (Hockney) model,
  ``latency + bytes / bandwidth`` (R. Hockney, "The communication challenge
  for MPP", Parallel Computing 20(3), 1994).
* A ring all-reduce over ``D`` ranks is a reduce-scatter then an all-gather,
  ``2 (D-1)`` steps each moving ``bytes / D``: ``2 (D-1)/D x bytes / bandwidth
  + 2 (D-1) x latency`` per message (Thakur, Rabenseifner and Gropp,
  "Optimization of Collective Communication Operations in MPICH", IJHPCA
  19(1), 2005, section 4; Patarasuk and Yuan, "Bandwidth optimal all-reduce
  algorithms", JPDC 69(2), 2009).
* DDP all-reduces gradients in buckets of ``bucket_cap_mb`` MiB, one ring
  all-reduce (one latency term) per bucket (``torch.nn.parallel.
  DistributedDataParallel``'s ``bucket_cap_mb``, default 25 MiB; Li et al.,
  "PyTorch Distributed", VLDB 2020, section 3.2.3).
* Sharded replicas (ZeRO, Rajbhandari et al., SC 2020, section 7; FSDP2):
  a ring reduce-scatter and a ring all-gather each take ``D-1`` steps of
  ``bytes / D`` (half a ring all-reduce each, the same references):
  ``(D-1)/D x bytes / bandwidth + (D-1) x latency``.  Per step, a stage group
  sharded ``optimizer`` (ZeRO-1: torch's ``ZeroRedundancyOptimizer``, runtime/parallel/shard.py)
  all-reduces its gradients as DDP does and broadcasts its updated weights (as
  held: an all-gather's bytes) after the optimizer step; one sharded ``full``
  all-gathers its weights (as held: bf16-mixed is autocast, not an FSDP2
  precision policy) and reduce-scatters its
  gradients once per step (kept gathered across micro-batches).  A ``full``
  group with ``reshard_after_forward`` (ZeRO-3: Rajbhandari et al. 2020, section
  7.2.2, ``3 x`` DDP's volume per gradient accumulation step, here per
  micro-batch; Zhao et al., "PyTorch FSDP", VLDB 2023, section 3.3) all-gathers
  each layer's weights before its forward and again before its backward and
  reduce-scatters its gradients after its backward, every micro-batch
  (:func:`zero3_microbatch_seconds`); HSDP adds an all-reduce of the shard's
  gradients across the nodes after each reduce-scatter.
  Overlap (:mod:`partitioner.schedule.simulate`): DDP's bucketed all-reduce
  overlaps the last backward (Li et al. 2020, section 3.2.3); the once-per-step
  sharded collectives of a pipeline stage do not: torch's pipelining calls FSDP's
  post-backward reduce-scatter only after the stage's last backward
  (``torch/distributed/pipelining/stage.py``), and the all-gather after the
  optimizer step (``optimizer``) or before the first forward (``full``) has no
  compute beside it, so each is charged whole, once per step.  ZeRO-3's
  per-micro-batch collectives run on their own streams while the layers
  compute, FSDP2 issuing each layer's all-gather one layer ahead (implicit
  forward prefetch, ``backward_prefetch``): per pass, what the collectives take
  beyond that pass's compute is exposed, ``max(0, comm - compute)``, plus the
  first unit's all-gather, which nothing before it hides (Zhao et al. 2023,
  section 3.3.1; the backward's all-gathers and reduce-scatters share the link).
* Topology: ranks are laid out stage-major, ``rank = stage x dp + replica``,
  and node ``rank // gpus_per_node``.  A message that crosses nodes is priced on
  the inter-node :class:`Link` (InfiniBand, one port per GPU: a point-to-point
  message leaves through its own GPU's port), one that stays inside a node on
  the intra-node one (NVLink).  A ring collective that crosses nodes
  (:func:`ring_link`) runs at the inter-node latency per step, and at the
  bandwidth of the ports of its members on one node: NCCL lays one ring per
  channel through a node's members over NVLink and leaves the node through a
  different member's port per channel, so a group with ``k`` members on every
  node moves its inter-node bytes through ``k`` ports at once (bus bandwidth
  ``k x`` one port's, capped by NVLink).  NVIDIA's NCCL developers measure
  192 GB/s all-reduce bus bandwidth on DGX A100 nodes over 8 x 25 GB/s HDR ports
  (github.com/NVIDIA/nccl issue 812), and an all-to-all, which cannot use the
  rings, one port's (nccl-tests issue 267).  A group with one member per node
  (tensor parallelism filling the node) runs at one port's pace.
* What a step must move through each link, whatever overlaps, is
  :mod:`partitioner.cost.bounds`'s: every predicted step is at least that over
  the link's bandwidth.

Example: 1 GB over 4 ranks at 100 GB/s and 10 µs, in 3 buckets::

    >>> round(ring_allreduce_seconds(1e9, 4, bandwidth=100e9, latency=10e-6, messages=3), 6)
    0.01518
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from partitioner.layout import Layout
from partitioner.units import MIB

if TYPE_CHECKING:
    from partitioner.cost.devices import DeviceSpec

__all__ = [
    "Link",
    "allreduce_crosses_nodes",
    "bucket_count",
    "bucket_share",
    "link",
    "members_per_node",
    "message_seconds",
    "node_of",
    "p2p_crosses_nodes",
    "ring_allreduce_seconds",
    "ring_latency_seconds",
    "ring_link",
    "ring_shard_seconds",
    "shard_step_seconds",
    "zero3_microbatch_seconds",
]


def message_seconds(nbytes: float, *, bandwidth: float, latency: float) -> float:
    """One point-to-point message, alpha-beta model: ``latency + bytes / bandwidth`` (0 for no bytes).

    >>> message_seconds(1e6, bandwidth=1e9, latency=1e-5)
    0.00101
    """
    return 0.0 if nbytes <= 0 else latency + nbytes / bandwidth


def ring_allreduce_seconds(
    nbytes: float, replicas: int, *, bandwidth: float, latency: float, messages: float = 1
) -> float:
    """Ring all-reduce of ``nbytes`` across ``replicas`` ranks, sent as ``messages`` buckets.

    ``messages`` may be fractional: the closed form charges each parameter its
    share of a bucket's latency (:func:`bucket_share`).

    >>> ring_allreduce_seconds(1e9, 2, bandwidth=1e9, latency=1e-3)  # 1 s of bytes, 2 latencies
    1.002
    >>> ring_allreduce_seconds(1e9, 1, bandwidth=1e9, latency=1e-3)  # nothing to reduce
    0.0
    """
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps / replicas * nbytes / bandwidth + messages * steps * latency


def ring_shard_seconds(
    nbytes: float, replicas: int, *, bandwidth: float, latency: float, messages: float = 1
) -> float:
    """Ring reduce-scatter (or all-gather) of ``nbytes`` whole across ``replicas`` ranks: ``D-1`` steps of ``bytes/D``.

    Half a ring all-reduce (which is one of each).  ``messages`` 0 leaves the
    latency out (the solver charges it once per stage).

    >>> ring_shard_seconds(1e9, 2, bandwidth=1e9, latency=1e-3), ring_shard_seconds(1e9, 1, bandwidth=1e9, latency=1)
    (0.501, 0.0)
    """
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = replicas - 1
    return steps / replicas * nbytes / bandwidth + messages * steps * latency


def ring_latency_seconds(replicas: int, *, latency: float) -> float:
    """The latency part of one ring all-reduce message, ``2 (D-1) x latency``.

    >>> ring_latency_seconds(4, latency=0.5), ring_latency_seconds(1, latency=0.5)
    (3.0, 0.0)
    """
    return 2 * (replicas - 1) * latency if replicas > 1 else 0.0


def bucket_count(parameter_bytes: float, *, bucket_cap_mb: float) -> int:
    """DDP buckets for ``parameter_bytes`` of gradients at ``bucket_cap_mb`` MiB each (at least one).

    >>> bucket_count(60 * 2**20, bucket_cap_mb=25.0)
    3
    """
    if bucket_cap_mb <= 0 or parameter_bytes <= 0:
        return 1
    return max(1, math.ceil(parameter_bytes / (bucket_cap_mb * MIB)))


def bucket_share(nbytes: float, *, bucket_cap_mb: float) -> float:
    """The fraction of DDP buckets ``nbytes`` of gradients fill: :func:`bucket_count` before rounding up.

    Additive over parameters, so the solver can charge bucket latency block by
    block; a stage's first bucket is charged once on top (``ring_latency_seconds``).
    A cap of 0 or less means one bucket for everything: no share beyond the first.

    >>> bucket_share(50 * 2**20, bucket_cap_mb=25.0), bucket_share(50 * 2**20, bucket_cap_mb=0)
    (2.0, 0.0)
    """
    if bucket_cap_mb <= 0:
        return 0.0
    return nbytes / (bucket_cap_mb * MIB)


# ------------------------------------------------------------------ links and topology


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` bytes/s each way, ``latency`` seconds per message.

    >>> fast = Link(100e9, 10e-6)
    >>> fast.message_seconds(1e6), fast.allreduce_seconds(1e9, 8, messages=0), fast.latency_seconds(2)
    (2e-05, 0.0175, 2e-05)
    """

    bandwidth: float
    latency: float

    def message_seconds(self, nbytes: float) -> float:
        """One point-to-point message over this link (:func:`message_seconds`)."""
        return message_seconds(nbytes, bandwidth=self.bandwidth, latency=self.latency)

    def allreduce_seconds(self, nbytes: float, replicas: int, *, messages: float = 1) -> float:
        """A ring all-reduce whose slowest hop is this link (:func:`ring_allreduce_seconds`)."""
        return ring_allreduce_seconds(
            nbytes, replicas, bandwidth=self.bandwidth, latency=self.latency, messages=messages
        )

    def shard_seconds(self, nbytes: float, replicas: int, *, messages: float = 1) -> float:
        """A ring reduce-scatter or all-gather on this link (:func:`ring_shard_seconds`)."""
        return ring_shard_seconds(nbytes, replicas, bandwidth=self.bandwidth, latency=self.latency,
                                  messages=messages)

    def latency_seconds(self, replicas: int) -> float:
        """The latency part of one ring all-reduce message on this link (:func:`ring_latency_seconds`)."""
        return ring_latency_seconds(replicas, latency=self.latency)


def link(spec: DeviceSpec, *, inter_node: bool = False) -> Link:
    """The intra-node link of ``spec``, or with ``inter_node`` the link between its nodes.

    A spec without inter-node numbers has one kind of link everywhere.

    >>> from partitioner.cost.devices import DEVICES
    >>> link(DEVICES["h100"]), link(DEVICES["h100"], inter_node=True)
    (Link(bandwidth=450000000000.0, latency=1e-05), Link(bandwidth=50000000000.0, latency=1.5e-05))
    >>> link(DEVICES["cpu"], inter_node=True) == link(DEVICES["cpu"])
    True
    """
    if not inter_node:
        return Link(spec.link_bandwidth, spec.link_latency)
    bandwidth = spec.inter_node_bandwidth if spec.inter_node_bandwidth is not None else spec.link_bandwidth
    latency = spec.inter_node_latency if spec.inter_node_latency is not None else spec.link_latency
    return Link(bandwidth, latency)


def node_of(rank: int, gpus_per_node: int | None) -> int:
    """The node holding global ``rank``: ``rank // gpus_per_node`` (``None``: everything on node 0).

    >>> node_of(7, 8), node_of(8, 8), node_of(100, None)
    (0, 1, 0)
    """
    return 0 if gpus_per_node is None else rank // gpus_per_node


def members_per_node(size: int, gpus_per_node: int | None) -> int:
    """The fewest members a group of ``size`` consecutive ranks, aligned at a multiple of ``size``, has on a node.

    Stage groups (``dp`` consecutive replicas from ``stage x dp``) are such
    groups; a group that straddles nodes unevenly has at least ``gcd(size,
    gpus_per_node)`` members on each node it touches.  ``None``: one node, all of them.

    >>> members_per_node(16, 8), members_per_node(4, 8), members_per_node(12, 8), members_per_node(3, 8)
    (8, 4, 4, 1)
    >>> members_per_node(64, None)
    64
    """
    if gpus_per_node is None or size <= 0:
        return max(size, 1)
    return math.gcd(size, gpus_per_node) if size % gpus_per_node and gpus_per_node % size else min(size,
                                                                                                    gpus_per_node)


def ring_link(spec: DeviceSpec, *, crosses: bool, members_per_node: int = 1) -> Link:
    """The link a ring collective runs on: NVLink inside a node; across nodes, every member's port on a node.

    ``members_per_node``: the group's fewest members on one node (:func:`members_per_node`);
    the group's inter-node bytes leave and enter each node through that many
    ports at once (module docstring), never faster than NVLink carries them.

    >>> from partitioner.cost.devices import DEVICES
    >>> ring_link(DEVICES["a100"], crosses=True, members_per_node=8)
    Link(bandwidth=200000000000.0, latency=1.5e-05)
    >>> ring_link(DEVICES["h100"], crosses=True, members_per_node=1), ring_link(DEVICES["h100"], crosses=False)
    (Link(bandwidth=50000000000.0, latency=1.5e-05), Link(bandwidth=450000000000.0, latency=1e-05))
    """
    intra = link(spec)
    if not crosses:
        return intra
    inter = link(spec, inter_node=True)
    return Link(min(intra.bandwidth, max(1, members_per_node) * inter.bandwidth), inter.latency)


def p2p_crosses_nodes(a: int, b: int, *, dp: int, gpus_per_node: int | None) -> bool:
    """Does stage ``a``'s message to stage ``b`` leave a node for some replica?

    Replica ``r`` of stage ``s`` is rank ``s x dp + r``; every replica sends to
    its own counterpart, so the stages' messages cross if any pair does.

    Example: dp = 4, 8 GPUs per node: stages 0 and 1 (ranks 0-3 and 4-7) share
    node 0, stage 2 (ranks 8-11) is on node 1::

        >>> p2p_crosses_nodes(0, 1, dp=4, gpus_per_node=8), p2p_crosses_nodes(1, 2, dp=4, gpus_per_node=8)
        (False, True)
        >>> p2p_crosses_nodes(1, 2, dp=4, gpus_per_node=None)  # one node
        False
    """
    layout = Layout(pp=max(a, b) + 1, dp=dp)
    ours, theirs = (layout.line("dp", at=layout.rank(pp=s)) for s in (a, b))
    return any(node_of(x, gpus_per_node) != node_of(y, gpus_per_node) for x, y in zip(ours, theirs))


def allreduce_crosses_nodes(s: int, *, dp: int, gpus_per_node: int | None) -> bool:
    """Does stage ``s``'s gradient all-reduce (ranks ``s x dp .. s x dp + dp - 1``) span nodes?

    >>> allreduce_crosses_nodes(3, dp=4, gpus_per_node=8), allreduce_crosses_nodes(0, dp=16, gpus_per_node=8)
    (False, True)
    >>> allreduce_crosses_nodes(2, dp=3, gpus_per_node=8)  # ranks 6, 7 | 8
    True
    """
    layout = Layout(pp=s + 1, dp=dp)
    replicas = layout.line("dp", at=layout.rank(pp=s))
    return node_of(replicas[0], gpus_per_node) != node_of(replicas[-1], gpus_per_node)


# ------------------------------------------------------------------ sharded replicas


def shard_step_seconds(
    shard: str, replicas: int, on: Link, *, gradient_bytes: float, weight_bytes: float, gathered_bytes: float,
    reshard_after_forward: bool = False, messages: float = 0,
) -> float:
    """The collectives a stage group sharded as ``shard`` runs once per step, latency ``messages`` times each.

    ``optimizer``: all-reduce of the gradients (ZeRO-1 keeps them whole; charged
    whole here, though DDP may hide part of it behind the last backward) + the
    all-gather of the updated weights as held (``weight_bytes``); ``full``:
    reduce-scatter of the gradients + (kept gathered) one all-gather of the weights
    (``gathered_bytes``); with ``reshard_after_forward`` (ZeRO-3) nothing: its
    collectives are per micro-batch (:func:`zero3_microbatch_seconds`).  ``none``
    (DDP's all-reduce) is priced by :meth:`Link.allreduce_seconds` with its buckets.

    1 GB of fp32 gradients over 4 replicas at 1 GB/s, bf16 weights gathered::

        >>> on = Link(1e9, 0.0)
        >>> shard_step_seconds("optimizer", 4, on, gradient_bytes=1e9, weight_bytes=1e9, gathered_bytes=5e8)
        2.25
        >>> shard_step_seconds("full", 4, on, gradient_bytes=1e9, weight_bytes=1e9, gathered_bytes=5e8)
        1.125
        >>> on.allreduce_seconds(1e9, 4)  # DDP: a reduce-scatter and an all-gather of the gradients
        1.5
    """
    if shard == "none":
        raise ValueError("shard none is DDP's all-reduce: Link.allreduce_seconds")
    scatter = on.shard_seconds(gradient_bytes, replicas, messages=messages)
    if shard == "optimizer":  # the all-reduce is a reduce-scatter and an all-gather of the gradients
        return 2 * scatter + on.shard_seconds(weight_bytes, replicas, messages=messages)
    if shard == "full":
        if reshard_after_forward:
            return 0.0
        return scatter + on.shard_seconds(gathered_bytes, replicas, messages=messages)
    raise ValueError(f"shard is {shard!r}, expected none, optimizer or full")


def zero3_microbatch_seconds(
    replicas: int, on: Link, *, weight_bytes: float, gradient_bytes: float, forward_s: float, backward_s: float,
    across_s: float = 0.0, messages: float = 1,
) -> tuple[float, float]:
    """(forward, backward) seconds a ZeRO-3 layer's collectives add to one micro-batch, beyond its compute.

    Forward: the all-gather of its weights, behind the forward's compute;
    backward: the all-gather again and the reduce-scatter of its gradients
    (``across_s``: HSDP's all-reduce of the shard across nodes), behind the
    backward's compute (module docstring: ``max(0, comm - compute)`` per pass).
    The first unit's all-gather, exposed whole, is the caller's (once per pass).

    >>> zero3_microbatch_seconds(2, Link(1e9, 0.0), weight_bytes=2e9, gradient_bytes=2e9, forward_s=0.5,
    ...                          backward_s=1.0)
    (0.5, 1.0)
    """
    gather = on.shard_seconds(weight_bytes, replicas, messages=messages)
    scatter = on.shard_seconds(gradient_bytes, replicas, messages=messages)
    return max(0.0, gather - forward_s), max(0.0, gather + scatter + across_s - backward_s)
