"""The numbers the solver sees: blocks in a topological order, their costs and edges.

A :class:`PartitionProblem` is plain data (no torch); :mod:`partitioner.solve.ilp`
turns it into a :class:`Partition`.  Costs are per micro-batch, per replica.

Two per-stage choices change what a stage costs, both fixed by the stage's
index and blocks alone (so the closed form, the DPs, the ILP and the brute
force agree):

* **Links** (multi-node topology): ranks are laid out stage-major, ``rank = s x
  replicas + r`` on node ``rank // gpus_per_node``.  Stage s pays every transfer
  it receives at ``transfer_slow_s`` iff stage s-1's messages to it cross nodes
  (:func:`~partitioner.cost.comm.p2p_crosses_nodes`; an edge that skips stages is
  charged at the receiving stage's inbound link, a documented approximation), and
  its all-reduce (its blocks, the shared parameters it holds, the fixed latency
  term) at the slow variants iff its replicas span nodes
  (:func:`~partitioner.cost.comm.allreduce_crosses_nodes`).
* **Recomputation** (Korthikanti et al., "Reducing Activation Recomputation in
  Large Transformer Models", MLSys 2023, full recomputation): a recomputed stage
  keeps only its blocks' inputs per micro-batch in flight (``recompute_bytes``:
  what each layer reads from outside itself, charged once to the layer's first
  block) plus one layer's activations live again during its backward (the
  largest ``recompute_peak_bytes``, else ``activation_bytes``), and spends
  ``recompute_s`` more (one more forward).
  :func:`choose_recompute` applies the rule: keep if that fits, else recompute if
  that fits.  Keeping is never slower and the step time only grows with a
  stage's time, so the rule is optimal for any split.
* **Selective (layer) recomputation** (Megatron-LM's ``--recompute-method block
  --recompute-num-layers N``: the first N layers of a pipeline stage recompute,
  the rest keep their activations; torchtitan's per-layer activation
  checkpointing): where ``layer_start`` marks the blocks that begin a layer, a
  stage may recompute only its first blocks up to such a block.  It keeps the
  recomputed blocks' inputs and the other blocks' activations per micro-batch in
  flight, plus the largest recomputed layer's activations during its backward,
  and spends only the recomputed blocks' ``recompute_s``.  The per-stage choice
  is then ``False`` (keep), ``True`` (every block) or ``k``, an ``int`` (the
  stage's first k blocks, in block order, ``0 < k <`` its blocks).  The rule
  ("auto"): keep if that fits, else the fewest leading blocks (whole layers) that
  fit, else every block if that fits.  More recomputed blocks never cost less
  time, so the rule stays optimal stage by stage.
* **Schedules with several stages per pipeline rank** (``interleaved-1f1b``,
  ``zbv``; :mod:`partitioner.orders`): the problem is solved for
  ``P x v`` stages and ``stage_rank`` says which of the P pipeline ranks holds
  each (:func:`~partitioner.orders.stage_ranks`).  Links follow the
  ranks, not the stage indices; a boundary between two stages of one rank is
  handed over in memory and costs nothing.  Memory (see :func:`in_flight` and
  :func:`rank_memory`): each stage holds the most micro-batches its own row
  of the schedule ever keeps between its F and the action that frees them
  (B, or W under a split backward), counted on the schedule's order itself;
  the solver's memory limit for such a problem is first the per-GPU budget
  shared among the rank's chunks (:func:`chunk_memory_limit`), a conservative
  cap: a rank's peak is at most the sum of its stages' peaks.
  :func:`rank_memory` gives the exact per-rank peak by walking each rank's
  order; ``rank_memory_limit`` holds the GPU's limit it must meet, so that a
  larger per-stage cap can be tried where the share leaves no split
  (:mod:`partitioner.search.layouts`).
* **Split backward** (``zb-h1``, ``zbv``): ``weight_s[v]`` is the part of
  ``time_s[v]`` spent on weight gradients (W).  Such schedules never
  recompute here: W needs a block's activations after its B, so a recomputed
  block would keep its re-made activations from B to W, which the solver does
  not model (:func:`choose_recompute`).

Closed forms (:func:`step_time`), with ``t_s`` a stage's time per micro-batch,
``T_r`` the sum over the stages of rank r, ``w_s`` a stage's W seconds and P
pipeline ranks: GPipe and 1F1B ``sum t + (M-1) max t``; interleaved 1F1B
``M max T + (P-1)/(P v) sum t`` (the bubble is ``(P-1)/v`` of a rank's time
per micro-batch: Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2); ZB-H1
``M max t + (sum u - max u)`` with ``u_s = t_s - 2 min(w_s, b_s)`` (1F1B's fill and
drain shrink from ``(P-1)(F+B)`` to ``(P-1)(F+B-2W)``: Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024, section 3.1; a W fills a bubble only as far
as its stage's input-gradient B ``b_s`` does, so the first stage, all W, fills
none); ZB-V ``M max T + (P-1)/(2P)
sum max(t_s - 2 w_s, t_s / 3)``: a bubble of ``P - 1`` chunk forwards when F =
B = W, the case the V is built for (same paper, section 6), growing towards
a chunk's whole time as W vanishes; the first four are exact for equal stages
against :mod:`partitioner.schedule.simulate`, the ZB-V one within about a chunk's time
per rank of it (its bubble depends on which of F, B, W is longest).  Each
adds the slowest rank's all-reduce.

Example::

    >>> p = PartitionProblem(time_s=(1.0, 2.0), static_bytes=(0.0, 0.0),
    ...     activation_bytes=(0.0, 0.0), allreduce_s=(0.0, 0.0),
    ...     transfer_s=(0.5, 0.0), edges=((0, 1),))
    >>> step_time(p, (0, 1), microbatches=4)
    (11.0, (1.0, 2.5))
    >>> slow = dataclasses.replace(p, transfer_slow_s=(1.5, 0.0), gpus_per_node=1)  # one GPU per node
    >>> step_time(slow, (0, 1), microbatches=4)
    (15.0, (1.0, 3.5))
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from partitioner.cost.comm import allreduce_crosses_nodes, p2p_crosses_nodes
from partitioner.defaults import DEFAULT_SCHEDULE, ScheduleKind, schedule_chunks, splits_backward
from partitioner.errors import ScheduleError
from partitioner.orders import rank_orders, stage_ranks

__all__ = [
    "MEMORY_TOLERANCE",
    "RECOMPUTE_MODES",
    "Partition",
    "PartitionProblem",
    "RankPeaks",
    "RecomputeMode",
    "ScheduleKind",
    "StageRecompute",
    "allreduce_latencies",
    "can_recompute",
    "cheap_blocks",
    "check_assignment",
    "choose_recompute",
    "chunk_memory_limit",
    "in_flight",
    "rank_memory",
    "recompute_peak",
    "recomputed_blocks",
    "relative_gap",
    "split_backward",
    "stage_costs",
    "stage_links",
    "stage_memory",
    "stage_rank_of",
    "step_time",
    "within_limit",
]

RecomputeMode = Literal["auto", "none", "full"]
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = typing.get_args(RecomputeMode)
# One stage's recomputation: False (keep), True (every block) or an int k (its first k blocks: selective).
StageRecompute = bool | int

# Relative slack on the memory limit: sums taken in another order (prefix sums in the DP,
# the ILP's scaled rows) may differ from stage_memory's in the last bits.
MEMORY_TOLERANCE = 1e-12


@dataclasses.dataclass(frozen=True)
class PartitionProblem:
    """Blocks ``0..N-1`` in a topological order and what each costs.

    * ``time_s[v]``: forward + backward seconds of block v per micro-batch.
    * ``static_bytes[v]``: memory held for the whole step (parameters, gradients,
      optimizer state) for parameters only block v reads.
    * ``activation_bytes[v]``: memory kept for backward per micro-batch in flight.
    * ``allreduce_s[v]``: seconds to all-reduce block v's gradients across replicas.
    * ``transfer_s[u]``: seconds to send block u's output to another stage and its
      gradient back, charged once per receiving stage.
    * ``edges``: ``(u, v)`` with ``u < v``: block v reads block u's output.
      The last block produces the model's output and always sits in the last stage.
    * ``shared``: parameters read by several blocks (tied weights): ``(static_bytes,
      allreduce_s, readers)``; held once by each stage with a reader.

    Topology (all optional; without ``gpus_per_node`` every link is intra-node):
    ``transfer_slow_s[u]``, ``allreduce_slow_s[v]``, ``shared_slow_allreduce_s[k]``
    (parallel to ``shared``) and ``allreduce_latency_slow_s`` are the same costs over
    the inter-node link (None: as fast as intra-node); ``replicas`` ranks per stage,
    ``gpus_per_node`` GPUs per node.

    Recomputation (optional): ``recompute_bytes[v]`` kept per micro-batch when v is
    recomputed (its inputs from other blocks), ``recompute_s[v]`` the extra seconds
    (v's forward); None: no block can be recomputed.  ``recompute``: "none" (never),
    "full" (every stage) or "auto" (per stage, only where keeping does not fit).
    ``layer_start[v]``: block v begins a layer (the unit the runtime checkpoints), so a
    stage may recompute its blocks before v and keep the rest (selective
    recomputation, "auto" only); None: a stage recomputes all its blocks or none.

    Schedules (optional): ``weight_s[v]`` the weight-gradient (W) part of
    ``time_s[v]`` (None: none can be split off); ``split_s[v]`` the host seconds
    a split backward adds to block v (its W calls; see :func:`split_backward`);
    ``action_s`` the host seconds the runtime adds to every compute action (F, B
    and, split, W) of every stage (a calibration's, :mod:`partitioner.cost.calibration`);
    ``stage_rank[s]`` the pipeline
    rank of stage s when the problem is solved for a schedule with several stages
    per rank (None: stage s on rank s; see :func:`stage_rank_of`);
    ``rank_memory_limit`` the GPU's own limit, which every rank's exact peak
    (:func:`rank_memory`) must meet where ``memory_limit`` caps each stage at a
    share of it (None: ``memory_limit`` is the GPU's).

    Per-op selective recomputation (optional, chosen only after a split is solved:
    :mod:`partitioner.solve.headroom`): ``op_kept_bytes[v]`` kept per micro-batch
    when block v recomputes only its cheap ops (its inputs plus the outputs of its
    matrix multiplications and attention), ``op_recompute_s[v]`` the seconds that
    takes; the functions below take the per-stage count of such blocks as ``ops``
    (after the stage's wholly recomputed blocks).
    """

    time_s: tuple[float, ...]
    static_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    transfer_s: tuple[float, ...]
    edges: tuple[tuple[int, int], ...]
    shared: tuple[tuple[float, float, tuple[int, ...]], ...] = ()
    memory_limit: float | None = None
    allreduce_latency_s: float = 0.0  # fixed cost of a stage's first all-reduce bucket (replicas > 1)
    transfer_slow_s: tuple[float, ...] | None = None
    allreduce_slow_s: tuple[float, ...] | None = None
    shared_slow_allreduce_s: tuple[float, ...] | None = None
    allreduce_latency_slow_s: float | None = None
    replicas: int = 1
    gpus_per_node: int | None = None
    recompute_bytes: tuple[float, ...] | None = None
    recompute_s: tuple[float, ...] | None = None
    # Live again while a recomputed block's backward runs: its whole layer's activations (None: its own).
    recompute_peak_bytes: tuple[float, ...] | None = None
    recompute: RecomputeMode = "none"
    layer_start: tuple[bool, ...] | None = None
    weight_s: tuple[float, ...] | None = None
    split_s: tuple[float, ...] | None = None
    split_forward: float = 0.0  # the share of split_s spent in F
    split_weight: float = 0.0  # and in W (the rest in B)
    message_host_s: float = 0.0  # a rank's own seconds per message it sends or receives (the simulator's)
    action_s: float = 0.0  # a rank's own seconds per compute action (F, B, W), beyond its blocks' time
    stage_rank: tuple[int, ...] | None = None
    rank_memory_limit: float | None = None
    # Per-op selective recomputation (optional): kept per micro-batch when block v recomputes only its cheap ops
    # (its inputs and its matmul and attention outputs), and the seconds that recomputation takes.
    op_kept_bytes: tuple[float, ...] | None = None
    op_recompute_s: tuple[float, ...] | None = None

    @property
    def size(self) -> int:
        return len(self.time_s)

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank: 1 unless ``stage_rank`` places several on one rank."""
        if not self.stage_rank:
            return 1
        return len(self.stage_rank) // (max(self.stage_rank) + 1)

    def __post_init__(self) -> None:
        n = len(self.time_s)
        for field in (
            "static_bytes", "activation_bytes", "allreduce_s", "transfer_s",
            "transfer_slow_s", "allreduce_slow_s", "recompute_bytes", "recompute_s", "recompute_peak_bytes", "layer_start", "weight_s",
            "split_s", "op_kept_bytes", "op_recompute_s",
        ):
            value = getattr(self, field)
            if value is not None and len(value) != n:
                raise ValueError(f"{field} has {len(value)} entries, expected {n}")
        for u, v in self.edges:
            if not 0 <= u < v < n:
                raise ValueError(f"edge {(u, v)} is not forward in the block order of {n} blocks")
        if self.shared_slow_allreduce_s is not None and len(self.shared_slow_allreduce_s) != len(self.shared):
            raise ValueError(
                f"shared_slow_allreduce_s has {len(self.shared_slow_allreduce_s)} entries, "
                f"expected {len(self.shared)} (one per shared parameter)"
            )
        if (self.recompute_bytes is None) != (self.recompute_s is None):
            raise ValueError("recompute_bytes and recompute_s go together: give both or neither")
        if (self.op_kept_bytes is None) != (self.op_recompute_s is None):
            raise ValueError("op_kept_bytes and op_recompute_s go together: give both or neither")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute is {self.recompute!r}, expected one of {RECOMPUTE_MODES}")
        if self.replicas < 1:
            raise ValueError(f"replicas is {self.replicas}, expected at least 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node is {self.gpus_per_node}, expected at least 1 (or None)")
        if self.stage_rank is not None:
            ranks = max(self.stage_rank, default=-1) + 1
            if not self.stage_rank or any(
                r < 0 or self.stage_rank.count(r) != len(self.stage_rank) // ranks for r in range(ranks)
            ) or len(self.stage_rank) % ranks:
                raise ValueError(
                    f"stage_rank {list(self.stage_rank)} should place the same number of stages on "
                    f"every rank 0 .. {ranks - 1}"
                )


@dataclasses.dataclass(frozen=True)
class Partition:
    """The solver's answer: a stage for every block, whether each stage recomputes, and how good it is."""

    stage_of: tuple[int, ...]
    stages: int
    objective: float  # predicted step seconds (closed form)
    lower_bound: float
    status: Literal["optimal", "feasible"]
    solver: str
    wall_s: float
    # Per stage (empty: not recorded, read as the problem's rule): False, True or a block count (StageRecompute).
    recompute: tuple[StageRecompute, ...] = ()
    # Per stage (empty: none): how many blocks after the recomputed ones recompute only their cheap ops.
    recompute_ops: tuple[int, ...] = ()

    @property
    def gap(self) -> float:
        return relative_gap(self.objective, self.lower_bound)


def relative_gap(objective: float, lower_bound: float) -> float:
    """How far ``objective`` may be above the optimum, as a share of it: ``1 - bound / objective``, at least 0.

    The one definition behind :attr:`Partition.gap`, the saved plan's solver gap and the reports.

    >>> round(relative_gap(10.0, 9.0), 6), relative_gap(10.0, 11.0), relative_gap(0.0, 0.0)
    (0.1, 0.0, 0.0)
    """
    return 0.0 if objective <= 0 else max(0.0, 1 - lower_bound / objective)


def in_flight(
    stage: int, stages: int, microbatches: int, schedule: ScheduleKind, *, chunks: int | None = None
) -> int:
    """Micro-batches whose activations a stage holds at its peak.

    GPipe holds every micro-batch, 1F1B ``min(M, stages - stage)``.  The other
    schedules are counted on their own order (:func:`partitioner.orders.rank_orders`):
    the most micro-batches stage ``stage`` has run F for and not yet freed (by
    its B, or by its W when the backward is split).  ``chunks``: stages per
    pipeline rank (``stages = ranks x chunks``); None takes the schedule's own
    count (:func:`~partitioner.defaults.schedule_chunks`), except for
    ``interleaved-1f1b``, whose chunks the stage count does not fix: then the
    largest count over every chunk count that fits (a safe bound for a caller
    that does not know the chunks).

    >>> [in_flight(s, 4, 8, "1f1b") for s in range(4)]
    [4, 3, 2, 1]
    >>> [in_flight(s, 8, 8, "interleaved-1f1b", chunks=2) for s in range(8)]  # 4 ranks x 2 chunks
    [8, 8, 7, 5, 4, 4, 3, 1]
    >>> [in_flight(s, 4, 8, "zbv") for s in range(4)]  # 2 ranks: stages 0, 3 on rank 0
    [4, 3, 2, 1]
    """
    if schedule == "1f1b":
        return min(microbatches, stages - stage)
    if schedule == "gpipe":
        return microbatches
    if chunks is None and schedule == "interleaved-1f1b":
        counts = [_peaks(schedule, stages // v, microbatches, v)[stage] for v in range(2, stages + 1)
                  if stages % v == 0 and stages // v >= 1 and microbatches % (stages // v) == 0]
        return max(counts, default=microbatches)
    v = schedule_chunks(schedule, chunks)
    if stages % v:
        raise ValueError(f"{stages} stages do not split into {v} per pipeline rank")
    return _peaks(schedule, stages // v, microbatches, v)[stage]


@functools.lru_cache(maxsize=512)
def _orders(schedule: str, ranks: int, microbatches: int, chunks: int) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Each rank's compute order (stage, F|B|W, micro-batch), cached: planning asks for the same few often."""
    return tuple(tuple(row) for row in rank_orders(schedule, ranks=ranks, microbatches=microbatches, chunks=chunks))


@functools.lru_cache(maxsize=512)
def _walks(schedule: str, ranks: int, microbatches: int, chunks: int) -> tuple[tuple[np.ndarray, ...], ...]:
    """Per rank, its order as arrays (:class:`RankPeaks`): each action's stage, +1 for an F, -1 for the
    action that frees its activations (B, or W with a split backward), else 0; where the Fs are; where the Bs are."""
    frees = "W" if splits_backward(schedule) else "B"
    out = []
    for row in _orders(schedule, ranks, microbatches, chunks):
        kinds = [kind for _, kind, _ in row]
        stage = np.array([s for s, _, _ in row], dtype=np.int64)
        sign = np.array([1.0 if k == "F" else -1.0 if k == frees else 0.0 for k in kinds])
        forward = np.array([k == "F" for k in kinds], dtype=bool)
        backward = np.flatnonzero(np.array([k == "B" for k in kinds], dtype=bool))
        out.append((stage, sign, forward, backward))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _peaks(schedule: str, ranks: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches held between F and the action that frees them."""
    frees = "W" if splits_backward(schedule) else "B"
    held = [0] * (ranks * chunks)
    peak = [0] * (ranks * chunks)
    for row in _orders(schedule, ranks, microbatches, chunks):
        for s, kind, _ in row:
            if kind == "F":
                held[s] += 1
                peak[s] = max(peak[s], held[s])
            elif kind == frees:
                held[s] -= 1
    return tuple(peak)


def stage_rank_of(problem: PartitionProblem, stages: int) -> tuple[int, ...]:
    """The pipeline rank of every stage: the problem's ``stage_rank``, else stage s on rank s.

    >>> p = PartitionProblem(time_s=(1.0,), static_bytes=(0.0,), activation_bytes=(0.0,),
    ...     allreduce_s=(0.0,), transfer_s=(0.0,), edges=())
    >>> stage_rank_of(p, 3), stage_rank_of(dataclasses.replace(p, stage_rank=(0, 1, 1, 0)), 4)
    ((0, 1, 2), (0, 1, 1, 0))
    """
    if problem.stage_rank is None:
        return tuple(range(stages))
    if len(problem.stage_rank) != stages:
        raise ValueError(f"the problem places {len(problem.stage_rank)} stages (stage_rank), not {stages}")
    return problem.stage_rank


def chunk_memory_limit(limit: float | None, chunks: int) -> float | None:
    """The solver's per-stage memory cap when every pipeline rank holds ``chunks`` stages: the GPU's share.

    Conservative: with every stage of a rank under ``limit / chunks``, the rank
    is under ``limit`` whatever moment each stage peaks at.

    >>> chunk_memory_limit(80.0, 2), chunk_memory_limit(None, 4)
    (40.0, None)
    """
    return None if limit is None else limit / chunks


def within_limit(nbytes: float, limit: float | None) -> bool:
    """``nbytes`` fits under ``limit`` (None: no limit), up to :data:`MEMORY_TOLERANCE`.

    >>> within_limit(100.0, 100.0), within_limit(101.0, 100.0), within_limit(1e30, None)
    (True, False, True)
    """
    return limit is None or nbytes <= limit * (1 + MEMORY_TOLERANCE)


def recompute_peak(problem: PartitionProblem) -> tuple[float, ...]:
    """Per block, the activations live again while it is recomputed: its layer's (``recompute_peak_bytes``), else its own."""
    return problem.recompute_peak_bytes or problem.activation_bytes


def can_recompute(problem: PartitionProblem) -> bool:
    """True when some stage may recompute: recomputation costs are given and the mode is not "none"."""
    return problem.recompute != "none" and problem.recompute_bytes is not None


# ------------------------------------------------------------------ links


def stage_links(problem: PartitionProblem, stages: int) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Per stage: (does its inbound link cross nodes, does its all-reduce cross nodes).

    Stage 0 receives nothing, so its inbound entry is False.  Without
    ``gpus_per_node`` (one node) both are all False.

    >>> p = PartitionProblem(time_s=(1.0,), static_bytes=(0.0,), activation_bytes=(0.0,),
    ...     allreduce_s=(0.0,), transfer_s=(0.0,), edges=(), replicas=2, gpus_per_node=4)
    >>> stage_links(p, 4)  # ranks 0-1 | 2-3 on node 0, 4-5 | 6-7 on node 1
    ((False, False, True, False), (False, False, False, False))
    >>> stage_links(dataclasses.replace(p, replicas=3), 3)  # ranks 0-2 | 3-5 | 6-8
    ((False, True, True), (False, True, True))
    """
    dp, per_node = problem.replicas, problem.gpus_per_node
    rank = stage_rank_of(problem, stages)
    if per_node is None:
        return (False,) * stages, (False,) * stages
    return _links(rank, dp, per_node)


@functools.lru_cache(maxsize=1024)
def _links(rank: tuple[int, ...], dp: int, per_node: int) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """:func:`stage_links` of stages on pipeline ranks ``rank`` (cached: the solvers ask for the same few often)."""
    stages = len(rank)
    inbound = tuple(
        s > 0 and rank[s - 1] != rank[s] and p2p_crosses_nodes(rank[s - 1], rank[s], dp=dp, gpus_per_node=per_node)
        for s in range(stages)
    )
    allreduce = tuple(allreduce_crosses_nodes(rank[s], dp=dp, gpus_per_node=per_node) for s in range(stages))
    return inbound, allreduce


def allreduce_latencies(problem: PartitionProblem, stages: int) -> tuple[float, ...]:
    """The fixed all-reduce latency term of each stage: the slow one where its all-reduce crosses nodes."""
    _, slow = stage_links(problem, stages)
    fast = problem.allreduce_latency_s
    over = fast if problem.allreduce_latency_slow_s is None else problem.allreduce_latency_slow_s
    return tuple(over if crosses else fast for crosses in slow)


def _transfer_prices(problem: PartitionProblem, slow: bool) -> tuple[float, ...]:
    return problem.transfer_slow_s if slow and problem.transfer_slow_s is not None else problem.transfer_s


def _allreduce_prices(problem: PartitionProblem, slow: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-block and per-shared-parameter all-reduce seconds on the slow or the fast link."""
    blocks = problem.allreduce_slow_s if slow and problem.allreduce_slow_s is not None else problem.allreduce_s
    shared = tuple(s[1] for s in problem.shared)
    if slow and problem.shared_slow_allreduce_s is not None:
        shared = problem.shared_slow_allreduce_s
    return blocks, shared


# ------------------------------------------------------------------ recomputation


@dataclasses.dataclass(frozen=True)
class _Parts:
    """What a stage's memory and time are made of, per stage."""

    static: list[float]
    activation: list[float]  # kept per micro-batch when not recomputing
    kept: list[float]  # kept per micro-batch when recomputing (block inputs)
    peak: list[float]  # one block's activations, live again during its backward
    extra: list[float]  # recomputation seconds
    blocks: list[list[int]]  # each stage's blocks, in block order


# The last split's parts: a split is priced by several functions in a row (its recomputation, then its
# memory per stage and per rank: refinement's fits), each of which needs them.  Tuples only (immutable).
_LAST_PARTS: list[tuple[PartitionProblem, Sequence[int], int, _Parts]] = []


def _parts(problem: PartitionProblem, stage_of: Sequence[int], stages: int) -> _Parts:
    if _LAST_PARTS and _LAST_PARTS[0][0] is problem and _LAST_PARTS[0][1] is stage_of and _LAST_PARTS[0][2] == stages:
        return _LAST_PARTS[0][3]
    parts = _split_parts(problem, stage_of, stages)
    if isinstance(stage_of, tuple):
        _LAST_PARTS[:] = [(problem, stage_of, stages, parts)]
    return parts


def _split_parts(problem: PartitionProblem, stage_of: Sequence[int], stages: int) -> _Parts:
    static, activation, kept, peak = [0.0] * stages, [0.0] * stages, [0.0] * stages, [0.0] * stages
    extra: list[float] = [0.0] * stages
    blocks: list[list[int]] = [[] for _ in range(stages)]
    static_bytes, activation_bytes, live = problem.static_bytes, problem.activation_bytes, recompute_peak(problem)
    inputs, redo = problem.recompute_bytes, problem.recompute_s
    for v, s in enumerate(stage_of):
        blocks[s].append(v)
        static[s] += static_bytes[v]
        activation[s] += activation_bytes[v]
        peak[s] = max(peak[s], live[v])
        if inputs is not None and redo is not None:
            kept[s] += inputs[v]
            extra[s] += redo[v]
    for nbytes, _, readers in problem.shared:
        for s in {stage_of[r] for r in readers}:
            static[s] += nbytes
    return _Parts(static=static, activation=activation, kept=kept, peak=peak, extra=extra, blocks=blocks)


def _block_forward(problem: PartitionProblem) -> tuple[float, ...]:
    """Each block's forward seconds: its recomputation where known, else a third of its time."""
    return problem.recompute_s or tuple(t / 3 for t in problem.time_s)


def _stage_forward(problem: PartitionProblem, stage_of: Sequence[int], stages: int) -> list[float]:
    forward = [0.0] * stages
    for v, f in enumerate(_block_forward(problem)):
        forward[stage_of[v]] += f
    return forward


def split_backward(
    problem: PartitionProblem, stage_of: Sequence[int], stages: int, *, forward_s: Sequence[float] | None = None
) -> SplitTimes:
    """Per stage, under a split backward (``zb-h1``, ``zbv``): W seconds, what the split adds, and its F part.

    A stage that receives tensors from another stage computes their gradients in
    B and its blocks' ``weight_s`` in W, and pays each block's ``split_s`` (the
    split's own cost: the stage's time grows by as much), ``split_forward`` of it
    in F (the forward reports every op where weights meet activations),
    ``split_weight`` in W (one weight gradient at a time; a layer norm's
    normalised input made again) and the rest in B (it keeps what W needs).
    A stage that receives nothing (the first)
    has no input gradient to compute: its whole backward is W, run as one call,
    so it adds nothing.  Every stage's W is one more action: ``action_s`` more, in
    W and in what the split adds.  ``forward_s`` (per block) separates the
    backward from ``time_s``; default: the recomputation seconds where known,
    else a third of the block's time (as :class:`partitioner.schedule.refine.StepModel`).

        >>> p = PartitionProblem(time_s=(3.0, 3.0), static_bytes=(0.0,) * 2, activation_bytes=(0.0,) * 2,
        ...     allreduce_s=(0.0,) * 2, transfer_s=(0.0,) * 2, edges=((0, 1),), weight_s=(1.0, 1.0),
        ...     split_s=(0.5, 0.5), split_forward=0.5, split_weight=0.25)
        >>> split_backward(p, (0, 1), 2)   # stage 0: its whole backward (3 - 1); stage 1: W, the split's cost
        SplitTimes(weight=[2.0, 1.125], added=[0.0, 0.5], forward_added=[0.0, 0.25])
    """
    weight, added, forward_added = [0.0] * stages, [0.0] * stages, [0.0] * stages
    if problem.weight_s is None:
        return SplitTimes(weight, added, forward_added)
    forward = forward_s or _block_forward(problem)
    receives = {stage_of[v] for u, v in problem.edges if stage_of[u] != stage_of[v]}
    for v, s in enumerate(stage_of):
        if s in receives:
            cost = problem.split_s[v] if problem.split_s is not None else 0.0
            weight[s] += problem.weight_s[v] + problem.split_weight * cost
            added[s] += cost
            forward_added[s] += problem.split_forward * cost
        else:
            weight[s] += problem.time_s[v] - forward[v]
    a = problem.action_s
    return SplitTimes([w + a for w in weight], [x + a for x in added], forward_added)


class SplitTimes(NamedTuple):
    """Per stage: W seconds (the split's W part included); seconds the split adds to the stage (W's action included); the part of them in F."""

    weight: list[float]
    added: list[float]
    forward_added: list[float]


def _count(choice: StageRecompute, blocks: int) -> int:
    """How many of a stage's ``blocks`` (its first ones) recompute under ``choice`` (:data:`StageRecompute`)."""
    if choice is True:
        return blocks
    if choice is False:
        return 0
    return max(0, min(int(choice), blocks))


def _activations(problem: PartitionProblem, parts: _Parts, s: int, count: int, ops: int = 0) -> tuple[float, float]:
    """(bytes kept per micro-batch in flight, bytes live again during a backward) of stage s
    when its first ``count`` blocks recompute and the next ``ops`` recompute only their cheap ops."""
    blocks = parts.blocks[s]
    ops = max(0, min(ops, len(blocks) - max(count, 0)))
    if ops == 0:
        if count <= 0:
            return parts.activation[s], 0.0
        if count >= len(blocks):
            return parts.kept[s], parts.peak[s]
    live = recompute_peak(problem)
    count = max(count, 0)
    redo, cheap, keep = blocks[:count], blocks[count:count + ops], blocks[count + ops:]
    kept = sum(problem.activation_bytes[v] for v in keep)
    if redo:
        assert problem.recompute_bytes is not None
        kept += sum(problem.recompute_bytes[v] for v in redo)
    if cheap:
        assert problem.op_kept_bytes is not None
        kept += sum(problem.op_kept_bytes[v] for v in cheap)
    # An ops block's layer is remade too before its backward (all but its kept outputs): counted whole.
    return kept, max(live[v] for v in (*redo, *cheap))


def _memory(problem: PartitionProblem, parts: _Parts, s: int, flight: int, count: int, ops: int = 0) -> float:
    kept, during = _activations(problem, parts, s, count, ops)
    return parts.static[s] + flight * kept + during


def _fewest_layers(problem: PartitionProblem, parts: _Parts, s: int, flight: int, limit: float) -> int | None:
    """The fewest leading blocks of stage s, ending where a layer starts, whose recomputation fits ``limit``.

    None if no such prefix (between none and all of the stage's blocks) fits.  One pass: each
    candidate's memory is the last one's with the blocks in between swapped to recomputed.
    """
    assert problem.layer_start is not None and problem.recompute_bytes is not None
    blocks, live = parts.blocks[s], recompute_peak(problem)
    kept, during = parts.activation[s], 0.0
    for i, v in enumerate(blocks):
        if i and problem.layer_start[v] and within_limit(parts.static[s] + flight * kept + during, limit):
            return i
        kept += problem.recompute_bytes[v] - problem.activation_bytes[v]
        during = max(during, live[v])
    return None


def recomputed_blocks(stage_of: Sequence[int], stages: int, recompute: Sequence[StageRecompute]) -> list[bool]:
    """Per block: does it recompute under the per-stage choice ``recompute`` (its stage's first blocks do)?

    >>> recomputed_blocks((0, 0, 0, 1, 1), 2, (2, True))
    [True, True, False, True, True]
    """
    counts, position = _within_stages(stage_of, stages, recompute)
    return [position[v] < counts[s] for v, s in enumerate(stage_of)]


def cheap_blocks(
    stage_of: Sequence[int], stages: int, recompute: Sequence[StageRecompute], ops: Sequence[int] | None,
) -> list[bool]:
    """Per block: does it recompute only its cheap ops (one of the ``ops[s]`` blocks after its stage's recomputed ones)?

    >>> cheap_blocks((0, 0, 0, 1, 1), 2, (1, False), (2, 1))
    [False, True, True, True, False]
    """
    if not ops:
        return [False] * len(stage_of)
    counts, position = _within_stages(stage_of, stages, recompute)
    return [counts[s] <= position[v] < counts[s] + ops[s] for v, s in enumerate(stage_of)]


def _within_stages(
    stage_of: Sequence[int], stages: int, recompute: Sequence[StageRecompute]
) -> tuple[list[int], list[int]]:
    """(per stage: how many of its first blocks recompute, per block: its position within its stage)."""
    sizes = [0] * stages
    position = []
    for s in stage_of:
        position.append(sizes[s])
        sizes[s] += 1
    return [_count(r, n) for r, n in zip(recompute, sizes, strict=True)], position


def _ops_of(ops: Sequence[int] | None, stages: int) -> tuple[int, ...]:
    if not ops:
        return (0,) * stages
    if len(ops) != stages:
        raise ValueError(f"ops has {len(ops)} entries, expected one per stage ({stages})")
    return tuple(int(k) for k in ops)


def _flights(problem: PartitionProblem, stages: int, microbatches: int, schedule: ScheduleKind) -> tuple[int, ...]:
    """Each stage's micro-batches in flight (:func:`in_flight`), with the problem's chunks where it places stages."""
    return _stage_flights(stages, microbatches, schedule, problem.chunks if problem.stage_rank is not None else None)


@functools.lru_cache(maxsize=1024)
def _stage_flights(stages: int, microbatches: int, schedule: ScheduleKind, chunks: int | None) -> tuple[int, ...]:
    return tuple(in_flight(s, stages, microbatches, schedule, chunks=chunks) for s in range(stages))


def choose_recompute(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    microbatches: int,
    schedule: ScheduleKind,
) -> tuple[StageRecompute, ...]:
    """Which stages recompute, by the problem's mode: "none" never, "full" always, "auto" per stage.

    "auto": keep the activations if the stage fits the memory limit, else (with
    ``layer_start``) recompute the fewest leading layers that fit (an ``int``: that
    many blocks), else recompute every block if that fits (True), else keep (the
    split does not fit either way).  Without recomputation costs
    (``recompute_bytes`` None) no stage recomputes.

    Two blocks of 10 activation bytes (2 when recomputed), limit 25, 1F1B with
    2 stages and 4 micro-batches: stage 0 holds 2 in flight (20 bytes, fits),
    one block alone with 3 in flight would not::

        >>> p = PartitionProblem(time_s=(1.0,) * 3, static_bytes=(0.0,) * 3,
        ...     activation_bytes=(10.0,) * 3, allreduce_s=(0.0,) * 3, transfer_s=(0.0,) * 3,
        ...     edges=((0, 1), (1, 2)), memory_limit=25.0, recompute_bytes=(2.0,) * 3,
        ...     recompute_s=(0.5,) * 3, recompute="auto")
        >>> choose_recompute(p, (0, 1, 1), 2, microbatches=4, schedule="1f1b")
        (False, False)
        >>> choose_recompute(p, (0, 0, 1), 2, microbatches=4, schedule="1f1b")  # stage 0: 2 x 20 > 25
        (True, False)

    Selective: three blocks, each a layer, in one stage with 2 in flight: keeping holds
    60 bytes, recomputing the first layer 2 x (2 + 20) + 10 = 54, the first two 2 x (4 + 10) + 10 = 38::

        >>> q = dataclasses.replace(p, layer_start=(True,) * 3, memory_limit=40.0)
        >>> choose_recompute(q, (0, 0, 0), 1, microbatches=2, schedule="gpipe")
        (2,)

    Schedules that split the backward (``zb-h1``, ``zbv``) never recompute: a
    block's W needs its activations after its B (see the module docstring).
    """
    if not can_recompute(problem) or splits_backward(schedule):
        return (False,) * stages
    if problem.recompute == "full":
        return (True,) * stages
    if problem.memory_limit is None:
        return (False,) * stages
    parts = _parts(problem, stage_of, stages)
    flights = _flights(problem, stages, microbatches, schedule)
    limit = problem.memory_limit
    chosen: list[StageRecompute] = []
    for s in range(stages):
        flight, blocks = flights[s], len(parts.blocks[s])
        if within_limit(_memory(problem, parts, s, flight, 0), limit):
            chosen.append(False)
            continue
        fewest = _fewest_layers(problem, parts, s, flight, limit) if problem.layer_start is not None else None
        chosen.append(fewest if fewest is not None else within_limit(_memory(problem, parts, s, flight, blocks), limit))
    return tuple(chosen)


def _resolve(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    recompute: Sequence[StageRecompute] | None,
    microbatches: int | None,
    schedule: ScheduleKind,
) -> tuple[StageRecompute, ...]:
    """An explicit per-stage choice as given (checked), or the problem's rule (:func:`choose_recompute`)."""
    if recompute:  # None or () : not given
        if len(recompute) != stages:
            raise ValueError(f"recompute has {len(recompute)} entries, expected one per stage ({stages})")
        if any(recompute) and problem.recompute_bytes is None:
            raise ValueError("a stage recomputes but the problem has no recompute_bytes")
        return tuple(r if isinstance(r, (bool, int)) else bool(r) for r in recompute)  # numpy bools as bools
    decides_by_memory = problem.recompute == "auto" and problem.memory_limit is not None
    if microbatches is None and decides_by_memory and can_recompute(problem):
        raise ValueError('recompute="auto" decides by memory: give microbatches or the per-stage choice')
    return choose_recompute(problem, stage_of, stages, microbatches=microbatches or 1, schedule=schedule)


# ------------------------------------------------------------------ costs


def stage_costs(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    recompute: Sequence[StageRecompute] | None = None,
    microbatches: int | None = None,
    schedule: ScheduleKind = DEFAULT_SCHEDULE,
    ops: Sequence[int] | None = None,
) -> tuple[list[float], list[float]]:
    """Per-stage time (compute + recomputation + a split backward's host cost + the runtime's host
    time per action + transfers in) and all-reduce seconds (latency excluded).

    Transfers and all-reduces are priced on the link each stage's traffic crosses
    (:func:`stage_links`).  ``recompute``: the per-stage choice; None applies the
    problem's rule (:func:`choose_recompute`, which needs ``microbatches`` and
    ``schedule`` in "auto" mode with a memory limit); ``ops``: per stage, the blocks
    after those that recompute only their cheap ops (``op_recompute_s``).
    """
    chosen = _resolve(problem, stage_of, stages, recompute, microbatches, schedule)
    cheap = cheap_blocks(stage_of, stages, chosen, _ops_of(ops, stages)) if ops and any(ops) else None
    inbound, outbound = stage_links(problem, stages)
    allreduce = [0.0] * stages
    block_allreduce = [_allreduce_prices(problem, slow)[0] for slow in (False, True)]
    times = [2 * problem.action_s] * stages  # F and B (a split backward's W: split_backward)
    redo = recomputed_blocks(stage_of, stages, chosen) if any(chosen) else None
    for v, s in enumerate(stage_of):
        times[s] += problem.time_s[v]
        allreduce[s] += block_allreduce[outbound[s]][v]
        if redo is not None and redo[v]:
            assert problem.recompute_s is not None
            times[s] += problem.recompute_s[v]
        elif cheap is not None and cheap[v]:
            assert problem.op_recompute_s is not None
            times[s] += problem.op_recompute_s[v]
    if splits_backward(schedule):
        for s, added in enumerate(split_backward(problem, stage_of, stages).added):
            times[s] += added
    received: set[tuple[int, int]] = set()
    transfer = [_transfer_prices(problem, slow) for slow in (False, True)]
    rank = stage_rank_of(problem, stages)
    for u, v in problem.edges:
        # Two stages of one rank hand their boundary over in memory: no transfer.
        if rank[stage_of[u]] != rank[stage_of[v]] and (u, stage_of[v]) not in received:
            received.add((u, stage_of[v]))
            times[stage_of[v]] += transfer[inbound[stage_of[v]]][u]
    shared_allreduce = [_allreduce_prices(problem, slow)[1] for slow in (False, True)]
    for k, (_, _, readers) in enumerate(problem.shared):
        for s in {stage_of[r] for r in readers}:
            allreduce[s] += shared_allreduce[outbound[s]][k]
    return times, allreduce


def stage_memory(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    microbatches: int,
    schedule: ScheduleKind,
    recompute: Sequence[StageRecompute] | None = None,
    ops: Sequence[int] | None = None,
) -> list[float]:
    """Peak bytes per stage: static state plus activations of the micro-batches in flight.

    A recomputing stage keeps its recomputed blocks' inputs (and its other blocks'
    activations) per micro-batch in flight plus the largest recomputed layer's
    activations (live again during that layer's backward).
    ``recompute``: the per-stage choice; None applies :func:`choose_recompute`;
    ``ops``: per stage, the blocks after those that recompute only their cheap ops.
    """
    chosen = _resolve(problem, stage_of, stages, recompute, microbatches, schedule)
    parts = _parts(problem, stage_of, stages)
    flights = _flights(problem, stages, microbatches, schedule)
    cheap = _ops_of(ops, stages)
    return [_memory(problem, parts, s, flights[s], _count(chosen[s], len(parts.blocks[s])), cheap[s])
            for s in range(stages)]


def rank_memory(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    microbatches: int,
    schedule: ScheduleKind,
    recompute: Sequence[StageRecompute] | None = None,
    ops: Sequence[int] | None = None,
) -> list[float]:
    """Peak bytes per pipeline rank: every stage it holds, walked through the rank's own order.

    Static bytes of the rank's stages (each stage's own, as the simulator counts
    them) plus the activations held at the worst moment of its order: an F adds
    its stage's bytes per micro-batch, the B (or, with a split backward, the W)
    that frees them removes them, and a recomputing stage's largest block is
    live again during each B.  With one stage per rank it equals
    :func:`stage_memory`; with several it is what the rank needs, at most the
    sum of its stages' :func:`stage_memory`.  Ranks follow the problem's
    ``stage_rank`` (stage s on rank s without it).

    >>> p = PartitionProblem(time_s=(1.0,) * 4, static_bytes=(1.0,) * 4, activation_bytes=(10.0,) * 4,
    ...     allreduce_s=(0.0,) * 4, transfer_s=(0.0,) * 4, edges=((0, 1), (1, 2), (2, 3)),
    ...     stage_rank=(0, 1, 0, 1))
    >>> stage_memory(p, (0, 1, 2, 3), 4, microbatches=4, schedule="interleaved-1f1b")
    [41.0, 31.0, 21.0, 11.0]
    >>> rank_memory(p, (0, 1, 2, 3), 4, microbatches=4, schedule="interleaved-1f1b")  # not 41 + 21, 31 + 11
    [52.0, 32.0]
    """
    chosen = _resolve(problem, stage_of, stages, recompute, microbatches, schedule)
    cheap = _ops_of(ops, stages)
    peaks = RankPeaks(problem, stage_of, stages, microbatches=microbatches, schedule=schedule)
    return [peaks.rank(r, chosen, cheap) for r in range(peaks.ranks)]


class RankPeaks:
    """:func:`rank_memory` of one split, one rank at a time, for per-stage choices given as they change.

    What does not change with the choices (the stages' parts, each rank's order) is made once, and a
    rank's peak reads only its own stages: the headroom search (:mod:`partitioner.solve.headroom`)
    prices thousands of choices of one split, each changing one rank.
    """

    def __init__(self, problem: PartitionProblem, stage_of: Sequence[int], stages: int, *, microbatches: int,
                 schedule: ScheduleKind) -> None:
        self.problem, self.stages = problem, stages
        self.parts = _parts(problem, stage_of, stages)
        self._walks: tuple[tuple[np.ndarray, ...], ...] | None = None  # None: one stage per rank, no order to walk
        if schedule in ("gpipe", "1f1b") and problem.stage_rank is None:
            # One stage per rank: its peak is stage_memory's (the order need not be built).
            self.ranks = stages
            self._flights = [in_flight(s, stages, microbatches, schedule) for s in range(stages)]
            return
        rank = _schedule_layout(problem, stages, schedule)
        self.ranks = max(rank) + 1
        self._mine = [[s for s in range(stages) if rank[s] == r] for r in range(self.ranks)]
        self._static = [sum(self.parts.static[s] for s in range(stages) if rank[s] == r) for r in range(self.ranks)]
        self._walks = _walks(schedule, self.ranks, microbatches, stages // self.ranks)

    def rank(self, r: int, recompute: Sequence[StageRecompute], ops: Sequence[int] | None = None) -> float:
        """Peak bytes of pipeline rank ``r`` under the per-stage choices (every stage's, as checked by
        :func:`rank_memory`; only rank ``r``'s are read)."""
        parts, problem = self.parts, self.problem
        if self._walks is None:
            cheap = int(ops[r]) if ops else 0
            return _memory(problem, parts, r, self._flights[r], _count(recompute[r], len(parts.blocks[r])), cheap)
        per_microbatch = np.zeros(self.stages)
        during = np.zeros(self.stages)
        for s in self._mine[r]:
            per_microbatch[s], during[s] = _activations(problem, parts, s, _count(recompute[s], len(parts.blocks[s])),
                                                        int(ops[s]) if ops else 0)
        # The rank's order walked: an F adds its stage's bytes, the action that frees them takes them off
        # (the running sum, in order: np.cumsum adds one after the other); the peak is at an F, or during a B
        # (its stage's recomputed layer live again, before the B frees anything).
        stage, sign, forward, backward = self._walks[r]
        held = np.cumsum(per_microbatch[stage] * sign)
        before = np.concatenate(([0.0], held[:-1]))[backward]
        most = max(0.0, float(held[forward].max(initial=0.0)),
                   float((before + during[stage[backward]]).max(initial=0.0)))
        return self._static[r] + most


def step_time(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    *,
    microbatches: int,
    schedule: ScheduleKind = DEFAULT_SCHEDULE,
    recompute: Sequence[StageRecompute] | None = None,
    ops: Sequence[int] | None = None,
) -> tuple[float, tuple[float, ...]]:
    """Closed-form step time of ``schedule`` and the stage times.

    GPipe and 1F1B: ``sum t + (M-1) max t + max (all-reduce + latency)``, the
    GPipe fill-and-drain bound (Huang et al., "GPipe", NeurIPS 2019): every
    micro-batch passes every stage once, and the slowest stage paces the other M-1;
    each stage's gradient all-reduce (DDP, Li et al., VLDB 2020) runs after its
    last backward.  The other schedules' forms are in the module docstring; for
    them the slowest *rank* paces (the sum over the stages it holds) and a rank
    all-reduces each of its stages in turn.  ``recompute``: the per-stage choice;
    None applies the rule of :func:`choose_recompute`; ``ops``: per stage, the blocks
    after those that recompute only their cheap ops.

    Equal stages of 1 s with W = 1/3 s, 4 ranks, 8 micro-batches::

        >>> p = PartitionProblem(time_s=(1.0,) * 8, static_bytes=(0.0,) * 8, activation_bytes=(0.0,) * 8,
        ...     allreduce_s=(0.0,) * 8, transfer_s=(0.0,) * 8, edges=tuple((v, v + 1) for v in range(7)),
        ...     weight_s=(1 / 3,) * 8)
        >>> step_time(p, (0, 0, 1, 1, 2, 2, 3, 3), microbatches=8, schedule="1f1b")[0]  # (8 + 3) x 2
        22.0
        >>> # 16 + 3 x 2/3 (stage 0, receiving nothing, is all W: it fills no bubble)
        >>> round(step_time(p, (0, 0, 1, 1, 2, 2, 3, 3), microbatches=8, schedule="zb-h1")[0], 6)
        18.0
        >>> v2 = dataclasses.replace(p, stage_rank=(0, 1, 2, 3, 0, 1, 2, 3))
        >>> step_time(v2, tuple(range(8)), microbatches=8, schedule="interleaved-1f1b")[0]  # 16 + 3 x 1
        19.0
        >>> zbv = dataclasses.replace(p, stage_rank=(0, 1, 2, 3, 3, 2, 1, 0))
        >>> step_time(zbv, tuple(range(8)), microbatches=8, schedule="zbv")[0]  # 16 + 3 x 1/3
        17.0
    """
    stages = max(stage_of) + 1
    times, allreduce = stage_costs(
        problem, stage_of, stages, recompute=recompute, microbatches=microbatches, schedule=schedule, ops=ops
    )
    latency = allreduce_latencies(problem, stages)
    if schedule in ("gpipe", "1f1b"):
        total = sum(times) + (microbatches - 1) * max(times)
        if all(x == latency[0] for x in latency):  # one latency for every stage (one node): max a + latency
            total = total + max(allreduce) + latency[0]
        else:
            total = total + max(a + x for a, x in zip(allreduce, latency, strict=True))
        return total, tuple(times)
    rank = _schedule_layout(problem, stages, schedule)
    ranks = max(rank) + 1
    per_rank, reduce = [0.0] * ranks, [0.0] * ranks
    for s in range(stages):
        per_rank[rank[s]] += times[s]
        reduce[rank[s]] += allreduce[s] + latency[s]
    weight, _, forward_added = split_backward(problem, stage_of, stages)
    M = microbatches
    if schedule == "zb-h1":
        forward = [f + problem.action_s + x for f, x in zip(_stage_forward(problem, stage_of, stages), forward_added,
                                                             strict=True)]
        useful = [t - 2 * min(w, t - f - w) for t, w, f in zip(times, weight, forward, strict=True)]
        total = M * max(times) + max(0.0, sum(useful) - max(useful))
    elif schedule == "zbv":
        total = M * max(per_rank) + (ranks - 1) / stages * sum(
            max(t - 2 * w, t / 3) for t, w in zip(times, weight, strict=True))
    else:  # interleaved-1f1b
        total = M * max(per_rank) + (ranks - 1) / stages * sum(times)
    return total + max(reduce), tuple(times)


def _schedule_layout(problem: PartitionProblem, stages: int, schedule: ScheduleKind) -> tuple[int, ...]:
    """The problem's placement of its stages, checked against where ``schedule`` puts them."""
    rank = stage_rank_of(problem, stages)
    ranks = max(rank) + 1
    try:
        expected = stage_ranks(schedule, ranks=ranks, chunks=stages // ranks)
    except ScheduleError as exc:
        raise ValueError(
            f"{schedule} holds several stages per pipeline rank: give the problem their ranks "
            f"(stage_rank = partitioner.orders.stage_ranks({schedule!r}, ranks=P, chunks=v)); {exc}"
        ) from None
    if expected != rank:
        raise ValueError(f"stage_rank {list(rank)} is not where {schedule} puts {stages} stages on {ranks} ranks")
    return rank


def check_assignment(problem: PartitionProblem, stage_of: Sequence[int], stages: int) -> str | None:
    """Why an assignment is invalid (precedence, empty stage), or None."""
    if len(stage_of) != problem.size:
        return f"{len(stage_of)} stages given for {problem.size} blocks"
    if sorted(set(stage_of)) != list(range(stages)):
        return f"stages used {sorted(set(stage_of))}, expected every one of 0..{stages - 1}"
    for u, v in problem.edges:
        if stage_of[u] > stage_of[v]:
            return f"edge {u}->{v} goes back from stage {stage_of[u]} to {stage_of[v]}"
    if stage_of[-1] != stages - 1:
        return f"the last block (the model's output) is in stage {stage_of[-1]}, not the last stage"
    return None
