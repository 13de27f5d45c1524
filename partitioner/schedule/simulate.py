"""Simulate: replay a plan's schedule in time, action by action.

A discrete-event simulation of the very :class:`~partitioner.orders.Schedule`
the runtime executes.  Each pipeline rank runs its row of actions in order
(a rank may hold several stages: ``stage_rank``):

* ``F`` takes the stage's forward seconds per micro-batch.  ``B`` takes its
  backward seconds, or, when the schedule splits the backward (it has ``W``
  actions), ``backward_s - weight_s``: the input gradient; ``W`` then takes
  ``weight_s``, the weight gradient;
* ``SF`` / ``SB`` are non-blocking sends: the sender spends only
  ``message_host_s`` per message on them (0 on GPUs; CPU ranks copy and wake
  gloo's threads themselves); the data reaches each peer after its transfer time.  A directed link between two
  ranks carries one message at a time, in the order the sender posted them, so
  a slow link queues (the alpha-beta model per message,
  :func:`partitioner.cost.comm.message_seconds`, as the solver prices it).  Two
  stages on one rank hand their boundary over in memory, for free;
* ``RF`` / ``RB`` wait until the matching data of every peer has arrived, then
  take ``message_host_s`` per message; their event spans both.

Data parallelism: a stage's gradients are all-reduced in ``buckets`` equal
buckets (by default DDP's, :func:`partitioner.cost.comm.bucket_count`) that
overlap the stage's last backward (DDP syncs only then; with a split backward,
its last ``W``, which makes the weight gradients), assuming gradients become
ready uniformly during it: bucket k of n may start once k/n of that backward
has run, buckets run one after another, and the stage's step ends when its
last bucket is done (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, section 3.2.3).  The stages
of one rank share its link: a later stage's buckets queue behind an earlier
one's.  The step time is the latest rank's end.

Memory, per rank, follows the saved activations: a forward adds one
micro-batch's activations of its stage when it starts; its backward frees
them when it ends, or, with a split backward, its ``W`` does (kept simple:
the part of the activations B no longer needs is counted until W).  The peak
is the static bytes of every stage the rank holds plus the activations in
flight.  A stage that recomputes keeps only its blocks' inputs per
micro-batch and holds one block's re-made activations while each ``B`` runs
(``backward_bytes``).

Topology (:func:`simulate` of a plan): replica ``r`` of pipeline rank ``p`` is
global rank ``p x dp + r`` and node ``rank // gpus_per_node``; a message
between two stages is priced on the inter-node link when any replica's pair of
ranks is on two nodes (:func:`partitioner.cost.comm.p2p_crosses_nodes`:
replicas run in lockstep, so the slowest pair sets the pace), else on the
intra-node link.

Example (GPipe, 2 stages, 2 micro-batches, forward 1 s, backward 2 s: the
closed form ``(M + P - 1)(f + b)`` gives 9 s)::

    >>> from partitioner.orders import stage_ranks
    >>> from partitioner.schedule.lower import compute_order, lower
    >>> sched = lower(compute_order("gpipe", ranks=2, microbatches=2),
    ...               sends_to=((1,), ()), receives_from=((), (0,)))
    >>> sim = simulate_schedule(sched, forward_s=[1.0, 1.0], backward_s=[2.0, 2.0])
    >>> sim.step_s, round(sim.bubble_fraction, 3), sim.peak_in_flight
    (9.0, 0.333, (2, 2))
    >>> from partitioner.plan import example_plan
    >>> simulate(example_plan()).events[0]
    TimelineEvent(track=0, label='F0', action='0F0', microbatch=0, kind='F', start_s=0.0, end_s=0.001)

ZB-V on 2 ranks (4 stages, each F = B = W = 1 s): every rank is busy from
its first action to the end; only rank 1 starts 1 s late::

    >>> where = stage_ranks("zbv", ranks=2, chunks=2)
    >>> chain = {"sends_to": ((1,), (2,), (3,), ()), "receives_from": ((), (0,), (1,), (2,))}
    >>> sched = lower(compute_order("zbv", ranks=2, microbatches=4, chunks=2), stage_rank=where, **chain)
    >>> sim = simulate_schedule(sched, forward_s=[1.0] * 4, backward_s=[2.0] * 4, weight_s=[1.0] * 4,
    ...                         stage_rank=where, **chain)
    >>> sim.step_s, sim.busy_s
    (25.0, (24.0, 24.0))
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Sequence

from partitioner.cost.comm import Link, bucket_count, message_seconds, p2p_crosses_nodes
from partitioner.cost.precision import (
    activation_scale,
    fp8_gather_saving,
    gathered_bytes,
    shard_state_bytes,
    state_bytes,
)
from partitioner.errors import ScheduleError
from partitioner.orders import Action, Schedule
from partitioner.plan import Plan, StagePlan
from partitioner.schedule.bounds import rank_link_seconds
from partitioner.schedule.timeline import ALLREDUCE_KIND, COMPUTE_KINDS, TimelineEvent

JITTER_SAMPLES = 31  # jittered runs of a step (simulate_schedule's jitter): the median one is returned

__all__ = [
    "JITTER_SAMPLES",
    "Simulation",
    "TransferSpec",
    "allreduce_buckets",
    "boundary_seconds",
    "bucket_count",
    "chain_topology",
    "message_seconds",
    "plan_links",
    "simulate",
    "simulate_schedule",
    "stage_static_bytes",
    "transfer_matrix",
]

# Seconds to move one micro-batch's boundary tensors from stage src to dst: one
# number for every link, a matrix ``[src][dst]``, or a function ``(src, dst)``.
TransferSpec = float | Sequence[Sequence[float]] | Callable[[int, int], float]


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The simulated step: every action's timing, and what follows from it (per pipeline rank)."""

    events: tuple[TimelineEvent, ...]  # per rank in execution order, then all-reduce buckets; track = rank
    step_s: float
    rank_end_s: tuple[float, ...]  # when each rank's last action / bucket finished
    busy_s: tuple[float, ...]  # forward + backward (+ weight-gradient) seconds per rank
    peak_in_flight: tuple[int, ...]  # most stage micro-batches with saved activations, per rank
    peak_memory_bytes: tuple[float, ...]  # per rank: its stages' static bytes + activations at the peak
    memory: tuple[tuple[tuple[float, float], ...], ...]  # per rank: (time, bytes) at every change

    @property
    def ranks(self) -> int:
        return len(self.busy_s)

    @property
    def stages(self) -> int:
        """The rows of the per-rank tuples: the pipeline ranks (the stages when each rank holds one)."""
        return self.ranks

    @property
    def busy_fraction(self) -> tuple[float, ...]:
        """Share of the step each rank spends computing."""
        return tuple(b / self.step_s if self.step_s > 0 else 0.0 for b in self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        """``1 - total compute / (ranks x step)``: the idle share of the pipeline."""
        if self.step_s <= 0:
            return 0.0
        return max(0.0, 1 - sum(self.busy_s) / (self.ranks * self.step_s))


# ------------------------------------------------------------------ maths


def allreduce_buckets(
    backward_start: float, backward_end: float, *, allreduce_s: float, buckets: int, after: float = -math.inf
) -> list[tuple[float, float]]:
    """(start, end) of each bucket: bucket k of n is ready at k/n of the backward; buckets run in turn.

    ``after``: the link is busy until then (an earlier stage's buckets on the same rank).

    >>> allreduce_buckets(0.0, 4.0, allreduce_s=2.0, buckets=2)
    [(2.0, 3.0), (4.0, 5.0)]
    >>> allreduce_buckets(0.0, 4.0, allreduce_s=2.0, buckets=1)  # fully exposed
    [(4.0, 6.0)]
    >>> allreduce_buckets(0.0, 4.0, allreduce_s=2.0, buckets=2, after=3.5)  # queued behind another stage's
    [(3.5, 4.5), (4.5, 5.5)]
    """
    if allreduce_s <= 0:
        return []
    n = max(1, buckets)
    length = backward_end - backward_start
    each = allreduce_s / n
    spans = []
    free = after
    for k in range(1, n + 1):
        start = max(backward_start + length * k / n, free)
        free = start + each
        spans.append((start, free))
    return spans


def chain_topology(schedule: Schedule) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(sends_to, receives_from) of a plain chain over every stage the schedule names: s feeds s + 1."""
    stages = 1 + max((a.stage for row in schedule.actions for a in row), default=-1)
    sends_to = tuple((s + 1,) if s + 1 < stages else () for s in range(stages))
    receives_from = tuple((s - 1,) if s > 0 else () for s in range(stages))
    return sends_to, receives_from


def transfer_matrix(transfer_s: TransferSpec, stages: int) -> list[list[float]]:
    """``[src][dst]`` seconds from any :data:`TransferSpec`."""
    if callable(transfer_s):
        fn = transfer_s
        return [[float(fn(i, j)) for j in range(stages)] for i in range(stages)]
    if isinstance(transfer_s, (int, float)):
        return [[float(transfer_s)] * stages for _ in range(stages)]
    rows = [[float(x) for x in row] for row in transfer_s]
    if len(rows) != stages or any(len(r) != stages for r in rows):
        raise ValueError(f"transfer_s should be a {stages} x {stages} matrix")
    return rows


# ------------------------------------------------------------------ simulation


def simulate_schedule(
    schedule: Schedule,
    *,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    weight_s: Sequence[float] | None = None,
    stage_rank: Sequence[int] | None = None,
    sends_to: Sequence[Sequence[int]] | None = None,
    receives_from: Sequence[Sequence[int]] | None = None,
    transfer_s: TransferSpec = 0.0,
    allreduce_s: Sequence[float] | None = None,
    buckets: int | Sequence[int] = 1,
    static_bytes: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    backward_bytes: Sequence[float] | None = None,
    message_host_s: float = 0.0,
    jitter: float = 0.0,
    samples: int = JITTER_SAMPLES,
    timeline: bool = True,
) -> Simulation:
    """Run ``schedule`` in simulated time; raise :class:`ScheduleError` if it deadlocks.

    Every sequence is per stage.  ``forward_s`` / ``backward_s``: seconds per
    micro-batch; ``weight_s``: the weight-gradient share of ``backward_s``
    (used where the schedule has ``W`` actions).  ``stage_rank``: the pipeline
    rank of each stage (default: stage s on rank s, one row each).  ``sends_to``
    / ``receives_from``: the stage graph (default: a chain over every stage).
    ``transfer_s``: seconds to move stage src's activations to dst for one
    micro-batch; the gradients going back cost the same.  ``allreduce_s``: each
    stage's gradient all-reduce per step, split into ``buckets`` (one count, or
    one per stage; 1 = no overlap with the backward).  ``static_bytes`` and
    ``activation_bytes`` (per micro-batch in flight) drive the memory timeline;
    ``backward_bytes`` are held on top while each backward runs (a recomputing
    stage's re-made activations).  ``message_host_s``: the rank's own seconds per
    message it sends (after posting) or receives (after the data arrives).
    ``jitter``: the spread of each compute action's duration on the machine (the
    standard deviation of log(duration / its median)); above 0, the step is run
    ``samples`` times (seeds 0, 1, ...: the same result every call) with every
    F, B and W drawn at random about its given (median) seconds, and the run
    with the median step is returned: waiting on a late peer costs a tightly coupled schedule (1F1B)
    more than one whose W actions can fill the gap (zero bubble).  ``timeline=False``: no events and
    no memory timeline (``events`` and ``memory`` empty), the same step, busy seconds and peaks (what a
    prediction reads, at a fraction of the cost for a long schedule).
    """
    where = tuple(range(schedule.ranks)) if stage_rank is None else tuple(stage_rank)
    stages = len(where)
    if any(not 0 <= r < schedule.ranks for r in where):
        raise ScheduleError(f"stage_rank {list(where)} names ranks outside the schedule's 0 .. {schedule.ranks - 1}.")
    forward = _per_stage(forward_s, stages, "forward_s")
    backward = _per_stage(backward_s, stages, "backward_s")
    weight = _per_stage(weight_s if weight_s is not None else [0.0] * stages, stages, "weight_s")
    for s in range(stages):
        if not 0.0 <= weight[s] <= backward[s]:
            raise ValueError(f"weight_s[{s}] = {weight[s]} should be between 0 and backward_s[{s}] = {backward[s]}")
    reduce = _per_stage(allreduce_s if allreduce_s is not None else [0.0] * stages, stages, "allreduce_s")
    static = _per_stage(static_bytes if static_bytes is not None else [0.0] * stages, stages, "static_bytes")
    activation = _per_stage(
        activation_bytes if activation_bytes is not None else [0.0] * stages, stages, "activation_bytes"
    )
    during_backward = _per_stage(
        backward_bytes if backward_bytes is not None else [0.0] * stages, stages, "backward_bytes"
    )
    counts = [buckets] * stages if isinstance(buckets, int) else [int(b) for b in buckets]
    if len(counts) != stages:
        raise ValueError(f"buckets has {len(counts)} entries for {stages} stages")
    if sends_to is None or receives_from is None:
        default_sends, default_receives = chain_topology(schedule)
        sends_to = default_sends if sends_to is None else sends_to
        receives_from = default_receives if receives_from is None else receives_from
    seconds = transfer_matrix(transfer_s, stages)

    costs = _Costs(forward, backward, weight, static, activation, during_backward)
    if not jitter > 0:
        return _simulate_once(_Run(schedule, where, costs, sends_to, receives_from, seconds,
                                   message_host_s=message_host_s, timeline=timeline), reduce, counts)
    runs = [_simulate_once(_Run(schedule, where, costs, sends_to, receives_from, seconds,
                                message_host_s=message_host_s, draw=_lognormal(jitter, seed=seed),
                                timeline=timeline), reduce, counts)
            for seed in range(max(1, samples))]
    middle = statistics.median_low([r.step_s for r in runs])
    return next(r for r in runs if r.step_s == middle)


def _simulate_once(run: _Run, reduce: list[float], counts: list[int]) -> Simulation:
    """Execute ``run`` and add each stage's all-reduce buckets (``reduce`` seconds in ``counts`` buckets)."""
    run.execute()
    schedule, where = run.schedule, run.where
    stages = len(where)

    events: list[TimelineEvent] = [e for row in run.events for e in row]
    ends = list(run.clock)
    last = [run.last_backward[s] or (run.clock[where[s]], run.clock[where[s]]) for s in range(stages)]
    link_free = [-math.inf] * schedule.ranks
    spans: dict[int, list[tuple[float, float]]] = {}
    for s in sorted(range(stages), key=lambda s: (last[s][1], s)):  # a rank's stages queue on its link
        r = where[s]
        spans[s] = allreduce_buckets(*last[s], allreduce_s=reduce[s], buckets=counts[s], after=link_free[r])
        link_free[r] = max([link_free[r]] + [end for _, end in spans[s]])
    for s in range(stages):
        for k, (start, end) in enumerate(spans[s]):
            if run.timeline:
                events.append(TimelineEvent(where[s], f"AR{k}", f"{s}AR{k}", -1, ALLREDUCE_KIND, start, end))
            ends[where[s]] = max(ends[where[s]], end)
    return Simulation(
        events=tuple(events),
        step_s=max(ends, default=0.0),
        rank_end_s=tuple(ends),
        busy_s=tuple(
            sum(e.duration_s for e in row if e.kind in COMPUTE_KINDS) for row in run.events
        ) if run.timeline else tuple(run.busy),
        peak_in_flight=tuple(run.peak_in_flight),
        peak_memory_bytes=tuple(max(b for _, b in points) for points in run.memory) if run.timeline
        else tuple(run.peak_memory),
        memory=tuple(tuple(points) for points in run.memory) if run.timeline else (),
    )


def simulate(plan: Plan, *, buckets: int | Sequence[int] | None = None, timeline: bool = True) -> Simulation:
    """Simulate one step of ``plan`` from its saved numbers alone.

    Stage times and all-reduce seconds are the plan's predictions (the planner
    prices each stage's all-reduce on the link its replica group uses; a split
    backward's W takes ``weight_s``); stages sit on their pipeline ranks
    (``StagePlan.rank``); transfers follow the plan's boundary tensors, one
    message each on the link their ranks share (:func:`boundary_seconds`);
    static memory is :func:`stage_static_bytes`, summed per rank; a
    recomputing stage holds its largest block's activations during each
    backward; buckets default to DDP's ``bucket_cap_mb`` split of each stage's
    parameters, and to one for a sharded stage group (its collectives run whole
    after its last backward, :mod:`partitioner.cost.comm`).  ``timeline=False``: without the events
    and the memory timeline (:func:`simulate_schedule`).
    """
    stages = plan.stages
    if buckets is None:
        # A sharded group reduce-scatters once after its last backward (torch's pipelining runs FSDP's
        # post-backward then) and all-gathers with no compute beside it: one exposed piece (cost/comm.py).
        buckets = [1 if _sharded(plan, st.shard) else
                   bucket_count(st.predicted.parameter_bytes, bucket_cap_mb=plan.bucket_cap_mb) for st in stages]
    sim = simulate_schedule(
        plan.schedule_data(),
        forward_s=[st.predicted.forward_s for st in stages],
        backward_s=[st.predicted.backward_s for st in stages],
        weight_s=[st.predicted.weight_s for st in stages],
        stage_rank=[st.rank for st in stages],
        sends_to=plan.sends_to(),
        receives_from=plan.receives_from(),
        transfer_s=boundary_seconds(plan),
        allreduce_s=[st.predicted.allreduce_s for st in stages],
        buckets=buckets,
        static_bytes=stage_static_bytes(plan),
        activation_bytes=[st.predicted.activation_bytes for st in stages],
        backward_bytes=[float(getattr(st.predicted, "recompute_peak_bytes", 0.0)) for st in stages],
        message_host_s=plan.cost_model.message_host_s,
        jitter=plan.cost_model.action_jitter,
        timeline=timeline,
    )
    # No rank finishes before its links have moved the step's bytes (schedule/bounds.py): the schedule above
    # queues each pair of ranks' messages and each rank's collectives on their own, not on one shared port.
    floors = rank_link_seconds(plan)
    if not floors or max(floors) <= sim.step_s:
        return sim
    ends = tuple(max(end, floor) for end, floor in zip(sim.rank_end_s, floors, strict=True))
    return dataclasses.replace(sim, rank_end_s=ends, step_s=max(ends))


def plan_links(plan: Plan) -> tuple[Link, Link]:
    """(intra-node, inter-node) links of the plan's cost model; one kind of link if it records no inter-node one.

    >>> from partitioner.plan import example_plan
    >>> plan_links(example_plan())
    (Link(bandwidth=1000000000.0, latency=6e-05), Link(bandwidth=1000000000.0, latency=6e-05))
    """
    cm = plan.cost_model
    intra = Link(cm.link_bandwidth, cm.link_latency)
    bandwidth = getattr(cm, "inter_node_bandwidth", None)
    latency = getattr(cm, "inter_node_latency", None)
    inter = Link(intra.bandwidth if bandwidth is None else bandwidth, intra.latency if latency is None else latency)
    return intra, inter


def boundary_seconds(plan: Plan) -> list[list[float]]:
    """``[src][dst]`` seconds to send one micro-batch's boundary tensors from stage src to dst.

    One alpha-beta message per tensor, at the plan's precision (float32 tensors
    travel as bf16 under the bf16 modes), on the inter-node link when the two
    stages' ranks sit on different nodes (``plan.gpus_per_node``; a plan without
    it is one node); 0 between two stages of one pipeline rank.

    >>> from partitioner.plan import example_plan
    >>> [[round(x * 1e9) for x in row] for row in boundary_seconds(example_plan())]  # ns: 60 µs + 32 B at 1 GB/s
    [[0, 60032], [0, 0]]
    """
    intra, inter = plan_links(plan)
    # Stage ranks are tensor-parallel groups (plan.tp): tp GPUs each, inside a node.
    gpus_per_node: int | None = getattr(plan, "group_gpus_per_node", getattr(plan, "gpus_per_node", None))
    precision: str = getattr(plan, "precision", "fp32")
    tp: int = getattr(plan, "tp", 1)  # sequence parallel: each GPU of a group sends 1/tp of a boundary
    rank = [st.rank for st in plan.stages]
    seconds = [[0.0] * len(plan.stages) for _ in plan.stages]
    for st in plan.stages:
        for b in st.outputs:
            if rank[b.source] == rank[b.target]:
                continue  # handed over in memory
            crosses = p2p_crosses_nodes(rank[b.source], rank[b.target], dp=plan.dp, gpus_per_node=gpus_per_node)
            on = inter if crosses else intra
            seconds[b.source][b.target] += on.message_seconds(b.nbytes * activation_scale(precision, b.dtype) / tp)
    return seconds


def stage_static_bytes(plan: Plan) -> list[float]:
    """Bytes each stage holds for the whole step: its parameters, gradients and optimizer states.

    At the plan's precision (:func:`partitioner.cost.precision.state_bytes`); a
    stage's parameter elements are its parameter bytes over the model's bytes
    per element.  A sharded stage group (``StagePlan.shard``, over ``plan.dp``
    replicas) holds :func:`~partitioner.cost.precision.shard_state_bytes`, and a
    fully sharded one its gathered weights and unsharded gradients on top
    (:func:`~partitioner.cost.precision.gathered_bytes`), or under ZeRO-3
    (``reshard_after_forward``) its gathered units as the plan predicted them
    (``StagePrediction.gathered_bytes``: :func:`~partitioner.cost.precision.zero3_transient_bytes` of the
    largest unit, on the first stage of each rank).

    >>> from partitioner.plan import example_plan
    >>> stage_static_bytes(example_plan())  # 64 bytes of fp32 weights, Adam: x 4
    [256.0, 256.0]
    """
    m = plan.model
    per_element = m.parameter_bytes / m.parameters if m.parameters else 4.0
    ep = getattr(plan, "ep", 1)
    out = []
    for st in plan.stages:
        experts = getattr(st.predicted, "expert_parameter_bytes", 0.0) if ep > 1 else 0.0
        # The experts: 1 / ep of them per GPU.
        held = _held(plan, st, st.predicted.parameter_bytes - experts, per_element, plan.shard_degree(st))
        if experts:  # whole on their member whatever the stage's mode (runtime/parallel/experts.py)
            precision: str = getattr(plan, "precision", "fp32")
            held += float(state_bytes(precision, plan.cost_model.optimizer_states, elements=experts / ep / per_element,
                                      model_bytes=experts / ep))
        if st.shard == "full" and st.reshard_after_forward and _sharded(plan, st.shard):
            held += getattr(st.predicted, "gathered_bytes", 0.0)
        out.append(float(held))
    return out


def _held(plan: Plan, st: StagePlan, nbytes: float, per_element: float, shards: int) -> float:
    """What one GPU of ``st``'s group holds of ``nbytes`` of its parameters, over ``shards`` shards."""
    precision: str = getattr(plan, "precision", "fp32")
    states = plan.cost_model.optimizer_states
    elements = nbytes / per_element
    if not _sharded(plan, st.shard):
        return float(state_bytes(precision, states, elements=elements, model_bytes=nbytes))
    held = shard_state_bytes(precision, states, st.shard, shards, elements=elements, model_bytes=nbytes)
    if st.shard == "full" and not st.reshard_after_forward:  # ZeRO-3: its units, StagePrediction.gathered_bytes
        held += gathered_bytes(precision, elements=elements, model_bytes=nbytes) - fp8_gather_saving(
            precision, getattr(st.predicted, "fp8_gathered_elements", 0.0))  # its FP8 weights held at 1 byte
    return float(held)


def _sharded(plan: Plan, shard: str) -> bool:
    """Does a stage group shard its state (a mode other than "none", over more than one replica)?"""
    return shard != "none" and plan.dp > 1


# ------------------------------------------------------------------ internals


def _per_stage(values: Sequence[float], stages: int, name: str) -> list[float]:
    if len(values) != stages:
        raise ValueError(f"{name} has {len(values)} entries for {stages} stages")
    return [float(v) for v in values]


def _lognormal(sigma: float, *, seed: int) -> Callable[[], float]:
    """Factors exp(sigma x N(0, 1)): median 1, so the given seconds stay each action's median."""
    rng = random.Random(seed)
    return lambda: math.exp(rng.gauss(0.0, sigma))


@dataclasses.dataclass(frozen=True)
class _Costs:
    """Per stage: seconds of F, B (whole), W (share of B), and bytes: static, per micro-batch, during B."""

    forward: list[float]
    backward: list[float]
    weight: list[float]
    static: list[float]
    activation: list[float]
    during_backward: list[float]


class _Run:
    """Mutable state of one simulation: a clock and a cursor per rank, messages in flight."""

    def __init__(
        self,
        schedule: Schedule,
        where: tuple[int, ...],
        costs: _Costs,
        sends_to: Sequence[Sequence[int]],
        receives_from: Sequence[Sequence[int]],
        seconds: list[list[float]],
        *,
        message_host_s: float = 0.0,
        draw: Callable[[], float] | None = None,
        timeline: bool = True,
    ) -> None:
        stages, ranks = len(where), schedule.ranks
        self.host = message_host_s
        self.timeline = timeline  # False: no events or memory points, only their sums and peaks
        self.draw = draw  # a factor per compute action (jitter), or None: every action as given
        if len(sends_to) != stages or len(receives_from) != stages:
            raise ScheduleError(f"The schedule has {stages} stages but the topology has {len(sends_to)}.")
        self.schedule, self.rows = schedule, schedule.actions
        self.where, self.costs, self.seconds = where, costs, seconds
        self.remote_out = [sorted(t for t in sends_to[s] if where[t] != where[s]) for s in range(stages)]
        self.remote_in = [sorted(p for p in receives_from[s] if where[p] != where[s]) for s in range(stages)]
        self.split = [False] * stages  # does stage s run W actions (B = input gradient only)?
        for row in self.rows:
            for a in row:
                if a.kind == "W":
                    self.split[a.stage] = True
        self.clock = [0.0] * ranks
        self.cursor = [0] * ranks
        self.arrival: dict[tuple[str, int, int, int], float] = {}  # (F|B, src stage, dst stage, mb) -> time
        self.link_free: dict[tuple[int, int], float] = {}  # (src rank, dst rank) -> time
        self.events: list[list[TimelineEvent]] = [[] for _ in range(ranks)]
        self.in_flight = [0] * ranks
        self.peak_in_flight = [0] * ranks
        held = [sum(costs.static[s] for s in range(stages) if where[s] == r) for r in range(ranks)]
        self.memory: list[list[tuple[float, float]]] = [[(0.0, held[r])] for r in range(ranks)]
        # Without a timeline: each rank's bytes now and at most, and its compute seconds summed in event order.
        self.held, self.peak_memory = list(held), list(held)
        self.busy: list[float | int] = [0] * ranks
        self.last_backward: list[tuple[float, float] | None] = [None] * stages  # last B, or W when split

    def execute(self) -> None:
        if not self.timeline:
            self._execute_lean()
            return
        while True:
            progressed = False
            for r, row in enumerate(self.rows):
                while self.cursor[r] < len(row) and self._step(r, row[self.cursor[r]]):
                    self.cursor[r] += 1
                    progressed = True
            if all(self.cursor[r] == len(row) for r, row in enumerate(self.rows)):
                return
            if not progressed:
                raise ScheduleError(f"The schedule deadlocks in simulation: {self._stuck()}.")

    def _execute_lean(self) -> None:
        """:meth:`execute` without a timeline: :meth:`_step`'s rules and arithmetic, in the same order, inlined
        (a long schedule runs millions of actions; a call and a record per action were most of their cost)."""
        rows, cursor, clock, where = self.rows, self.cursor, self.clock, self.where
        c, host, arrival, link_free, seconds = self.costs, self.host, self.arrival, self.link_free, self.seconds
        forward, backward, weight, activation, during = c.forward, c.backward, c.weight, c.activation, c.during_backward
        remote_in, remote_out, split, factor = self.remote_in, self.remote_out, self.split, self._factor
        busy, held, peak, in_flight, most = self.busy, self.held, self.peak_memory, self.in_flight, self.peak_in_flight
        last_backward = self.last_backward
        while True:
            progressed = False
            for r, row in enumerate(rows):
                k, count = cursor[r], len(row)
                while k < count:
                    a = row[k]
                    kind, s, i = a.kind, a.stage, a.microbatch
                    now = clock[r]
                    if kind == "RF" or kind == "RB":
                        keys = [("F", p, s, i) for p in remote_in[s]] if kind == "RF" else \
                            [("B", t, s, i) for t in remote_out[s]]
                        if not all(key in arrival for key in keys):
                            break
                        clock[r] = max([now] + [arrival[key] for key in keys]) + host * len(keys)
                    elif kind == "SF" or kind == "SB":
                        peers = remote_out[s] if kind == "SF" else remote_in[s]
                        for peer in peers:  # _send
                            link = (where[s], where[peer])
                            start = max(clock[where[s]], link_free.get(link, 0.0))
                            link_free[link] = start + (seconds[s][peer] if kind == "SF" else seconds[peer][s])
                            arrival["F" if kind == "SF" else "B", s, peer, i] = link_free[link]
                        clock[r] = now + host * len(peers)
                    elif kind == "F":
                        end = now + forward[s] * factor()
                        busy[r] += end - now
                        in_flight[r] += 1  # _hold(r, now, +1, activation)
                        most[r] = max(most[r], in_flight[r])
                        held[r] += 1 * activation[s] + 0.0
                        peak[r] = max(peak[r], held[r])
                        clock[r] = end
                    elif kind == "B":
                        end = now + (backward[s] - (weight[s] if split[s] else 0.0)) * factor()
                        busy[r] += end - now
                        if during[s]:
                            held[r] += during[s]
                            peak[r] = max(peak[r], held[r])
                        if split[s]:
                            if during[s]:
                                held[r] += -during[s]
                                peak[r] = max(peak[r], held[r])
                        else:  # _hold(r, end, -1, activation, extra=-during)
                            in_flight[r] += -1
                            most[r] = max(most[r], in_flight[r])
                            held[r] += -1 * activation[s] + -during[s]
                            peak[r] = max(peak[r], held[r])
                            last_backward[s] = (now, end)
                        clock[r] = end
                    else:  # "W"
                        end = now + weight[s] * factor()
                        busy[r] += end - now
                        in_flight[r] += -1
                        most[r] = max(most[r], in_flight[r])
                        held[r] += -1 * activation[s] + 0.0
                        peak[r] = max(peak[r], held[r])
                        last_backward[s] = (now, end)
                        clock[r] = end
                    k += 1
                if k != cursor[r]:
                    cursor[r] = k
                    progressed = True
            if all(cursor[r] == len(row) for r, row in enumerate(rows)):
                return
            if not progressed:
                raise ScheduleError(f"The schedule deadlocks in simulation: {self._stuck()}.")

    def _step(self, r: int, a: Action) -> bool:
        """Run action ``a`` on rank ``r`` if it can run now; False if it must wait for a peer."""
        now = self.clock[r]
        s, i, c = a.stage, a.microbatch, self.costs
        if a.kind in ("RF", "RB"):
            keys = (
                [("F", p, s, i) for p in self.remote_in[s]]
                if a.kind == "RF"
                else [("B", t, s, i) for t in self.remote_out[s]]
            )
            if not all(k in self.arrival for k in keys):
                return False
            end = max([now] + [self.arrival[k] for k in keys]) + self.host * len(keys)
            self._record(r, a, now, end)
            self.clock[r] = end
        elif a.kind in ("SF", "SB"):
            peers = self.remote_out[s] if a.kind == "SF" else self.remote_in[s]
            for peer in peers:
                if a.kind == "SF":
                    self._send("F", s, peer, i, self.seconds[s][peer])
                else:
                    self._send("B", s, peer, i, self.seconds[peer][s])
            end = now + self.host * len(peers)
            self._record(r, a, now, end)
            self.clock[r] = end
        elif a.kind == "F":
            end = now + c.forward[s] * self._factor()
            self._record(r, a, now, end)
            self._hold(r, now, +1, c.activation[s])
            self.clock[r] = end
        elif a.kind == "B":
            end = now + (c.backward[s] - (c.weight[s] if self.split[s] else 0.0)) * self._factor()
            self._record(r, a, now, end)
            if c.during_backward[s]:
                self._add_memory(r, now, c.during_backward[s])
            if self.split[s]:
                if c.during_backward[s]:
                    self._add_memory(r, end, -c.during_backward[s])
            else:
                self._hold(r, end, -1, c.activation[s], extra=-c.during_backward[s])
                self.last_backward[s] = (now, end)
            self.clock[r] = end
        else:  # "W": the weight gradient; the stage's activations of this micro-batch go
            end = now + c.weight[s] * self._factor()
            self._record(r, a, now, end)
            self._hold(r, end, -1, c.activation[s])
            self.last_backward[s] = (now, end)
            self.clock[r] = end
        return True

    def _send(self, kind: str, src: int, dst: int, microbatch: int, seconds: float) -> None:
        link = (self.where[src], self.where[dst])
        start = max(self.clock[self.where[src]], self.link_free.get(link, 0.0))
        self.link_free[link] = start + seconds
        self.arrival[kind, src, dst, microbatch] = start + seconds

    def _hold(self, r: int, when: float, delta: int, nbytes: float, *, extra: float = 0.0) -> None:
        self.in_flight[r] += delta
        self.peak_in_flight[r] = max(self.peak_in_flight[r], self.in_flight[r])
        self._add_memory(r, when, delta * nbytes + extra)

    def _add_memory(self, r: int, when: float, nbytes: float) -> None:
        if not self.timeline:
            self.held[r] += nbytes
            self.peak_memory[r] = max(self.peak_memory[r], self.held[r])
            return
        _, before = self.memory[r][-1]
        self.memory[r].append((when, before + nbytes))

    def _factor(self) -> float:
        return 1.0 if self.draw is None else self.draw()

    def _record(self, r: int, a: Action, start: float, end: float) -> None:
        if not self.timeline:
            if a.kind in COMPUTE_KINDS:
                self.busy[r] += end - start  # as TimelineEvent.duration_s, summed in the same order
            return
        label = f"{a.kind}{a.microbatch}"
        self.events[r].append(TimelineEvent(r, label, str(a), a.microbatch, a.kind, start, end))

    def _stuck(self) -> str:
        parts = []
        for r, row in enumerate(self.rows):
            c = self.cursor[r]
            if c < len(row):
                before = " ".join(str(a) for a in row[max(0, c - 3) : c]) or "nothing"
                parts.append(f"rank {r} waits at {row[c]} (after {before})")
        return "; ".join(parts)
