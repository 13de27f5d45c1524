"""Simulate: replay a plan's schedule in time, action by action.

A discrete-event simulation of the very :class:`~partitioner.schedule.Schedule`
the runtime executes.  Each stage runs its actions in order:

* ``F`` / ``B`` take the stage's forward / backward seconds per micro-batch;
* ``SF`` / ``SB`` are non-blocking sends: they take no time on the sender; the
  data reaches each peer after its transfer time.  A directed link
  (sender -> receiver) carries one message at a time, in the order the sender
  posted them, so a slow link queues (the alpha-beta model per message,
  :func:`partitioner.commcost.message_seconds`, as the solver prices it);
* ``RF`` / ``RB`` wait until the matching data of every peer has arrived; their
  event spans the wait.

Data parallelism: a stage's gradients are all-reduced in ``buckets`` equal
buckets (by default DDP's, :func:`partitioner.commcost.bucket_count`) that
overlap the stage's last backward (DDP syncs only then), assuming gradients
become ready uniformly during it: bucket k of n may start once k/n of that
backward has run, buckets run one after another, and the stage's step
ends when its last bucket is done (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020, section 3.2.3).
The step time is the latest stage's end.

Memory follows the saved activations: a forward adds one micro-batch's
activations when it starts, its backward frees them when it ends; the peak is
static bytes plus the most micro-batches in flight times their activations.  A
stage that recomputes keeps only its blocks' inputs per micro-batch and holds
one block's re-made activations while each backward runs (``backward_bytes``).

Topology (:func:`simulate` of a plan): replica ``r`` of stage ``s`` is rank
``s x dp + r`` and node ``rank // gpus_per_node``; a message between two
stages is priced on the inter-node link when any replica's pair of ranks is on
two nodes (:func:`partitioner.commcost.p2p_crosses_nodes`: replicas run in
lockstep, so the slowest pair sets the pace), else on the intra-node link.

Example (GPipe, 2 stages, 2 micro-batches, forward 1 s, backward 2 s: the
closed form ``(M + P - 1)(f + b)`` gives 9 s)::

    >>> from partitioner.schedule import compute_order, lower
    >>> sched = lower(compute_order("gpipe", stages=2, microbatches=2),
    ...               sends_to=((1,), ()), receives_from=((), (0,)))
    >>> sim = simulate_schedule(sched, forward_s=[1.0, 1.0], backward_s=[2.0, 2.0])
    >>> sim.step_s, round(sim.bubble_fraction, 3), sim.peak_in_flight
    (9.0, 0.333, (2, 2))
    >>> from partitioner.plan import example_plan
    >>> simulate(example_plan()).events[0]
    TimelineEvent(track=0, label='F0', action='0F0', microbatch=0, kind='F', start_s=0.0, end_s=0.001)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from partitioner.commcost import Link, bucket_count, message_seconds, p2p_crosses_nodes
from partitioner.errors import ScheduleError
from partitioner.plan import Plan
from partitioner.precision import activation_scale, state_bytes
from partitioner.schedule import Action, Schedule
from partitioner.timeline import ALLREDUCE_KIND, COMPUTE_KINDS, TimelineEvent

__all__ = [
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
    """The simulated step: every action's timing, and what follows from it."""

    events: tuple[TimelineEvent, ...]  # per stage in execution order, then all-reduce buckets
    step_s: float
    stage_end_s: tuple[float, ...]  # when each stage's last action / bucket finished
    busy_s: tuple[float, ...]  # forward + backward seconds per stage
    peak_in_flight: tuple[int, ...]  # most micro-batches with saved activations, per stage
    peak_memory_bytes: tuple[float, ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]  # per stage: (time, bytes) at every change

    @property
    def stages(self) -> int:
        return len(self.busy_s)

    @property
    def busy_fraction(self) -> tuple[float, ...]:
        """Share of the step each stage spends computing."""
        return tuple(b / self.step_s if self.step_s > 0 else 0.0 for b in self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        """``1 - total compute / (stages x step)``: the idle share of the pipeline."""
        if self.step_s <= 0:
            return 0.0
        return max(0.0, 1 - sum(self.busy_s) / (self.stages * self.step_s))


# ------------------------------------------------------------------ maths


def allreduce_buckets(
    backward_start: float, backward_end: float, *, allreduce_s: float, buckets: int
) -> list[tuple[float, float]]:
    """(start, end) of each bucket: bucket k of n is ready at k/n of the backward; buckets run in turn.

    >>> allreduce_buckets(0.0, 4.0, allreduce_s=2.0, buckets=2)
    [(2.0, 3.0), (4.0, 5.0)]
    >>> allreduce_buckets(0.0, 4.0, allreduce_s=2.0, buckets=1)  # fully exposed
    [(4.0, 6.0)]
    """
    if allreduce_s <= 0:
        return []
    n = max(1, buckets)
    length = backward_end - backward_start
    each = allreduce_s / n
    spans = []
    free = -math.inf
    for k in range(1, n + 1):
        start = max(backward_start + length * k / n, free)
        free = start + each
        spans.append((start, free))
    return spans


def chain_topology(schedule: Schedule) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(sends_to, receives_from) of a plain chain: stage s sends to s + 1 when its list has ``SF``/``RB``."""
    sends = [any(a.kind in ("SF", "RB") for a in row) for row in schedule.actions]
    stages = schedule.stages
    sends_to = tuple((s + 1,) if sends[s] and s + 1 < stages else () for s in range(stages))
    receives_from = tuple((s - 1,) if s > 0 and sends[s - 1] else () for s in range(stages))
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
    sends_to: Sequence[Sequence[int]] | None = None,
    receives_from: Sequence[Sequence[int]] | None = None,
    transfer_s: TransferSpec = 0.0,
    allreduce_s: Sequence[float] | None = None,
    buckets: int | Sequence[int] = 1,
    static_bytes: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    backward_bytes: Sequence[float] | None = None,
) -> Simulation:
    """Run ``schedule`` in simulated time; raise :class:`ScheduleError` if it deadlocks.

    ``forward_s`` / ``backward_s``: seconds per micro-batch per stage.  ``sends_to``
    / ``receives_from``: the stage graph (default: a chain wherever the lists
    communicate).  ``transfer_s``: seconds to move stage src's activations to dst
    for one micro-batch; the gradients going back cost the same.  ``allreduce_s``:
    each stage's gradient all-reduce per step, split into ``buckets`` (one count,
    or one per stage; 1 = no overlap with the backward).  ``static_bytes`` and
    ``activation_bytes`` (per micro-batch in flight) drive the memory timeline;
    ``backward_bytes`` are held on top while each backward runs (a recomputing
    stage's re-made activations).
    """
    stages = schedule.stages
    forward = _per_stage(forward_s, stages, "forward_s")
    backward = _per_stage(backward_s, stages, "backward_s")
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

    run = _Run(schedule, forward, backward, sends_to, receives_from, seconds, static, activation, during_backward)
    run.execute()

    events: list[TimelineEvent] = [e for row in run.events for e in row]
    ends = list(run.clock)
    for s in range(stages):
        b_start, b_end = run.last_backward[s] or (run.clock[s], run.clock[s])
        spans = allreduce_buckets(b_start, b_end, allreduce_s=reduce[s], buckets=counts[s])
        for k, (start, end) in enumerate(spans):
            events.append(TimelineEvent(s, f"AR{k}", f"{s}AR{k}", -1, ALLREDUCE_KIND, start, end))
            ends[s] = max(ends[s], end)
    return Simulation(
        events=tuple(events),
        step_s=max(ends, default=0.0),
        stage_end_s=tuple(ends),
        busy_s=tuple(
            sum(e.duration_s for e in row if e.kind in COMPUTE_KINDS) for row in run.events
        ),
        peak_in_flight=tuple(run.peak_in_flight),
        peak_memory_bytes=tuple(max(b for _, b in points) for points in run.memory),
        memory=tuple(tuple(points) for points in run.memory),
    )


def simulate(plan: Plan, *, buckets: int | Sequence[int] | None = None) -> Simulation:
    """Simulate one step of ``plan`` from its saved numbers alone.

    Stage times and all-reduce seconds are the plan's predictions (the planner
    prices each stage's all-reduce on the link its replica group uses);
    transfers follow the plan's boundary tensors, one message each on the link
    their ranks share (:func:`boundary_seconds`); static memory is
    :func:`stage_static_bytes`; a recomputing stage holds its largest block's
    activations during each backward; buckets default to DDP's
    ``bucket_cap_mb`` split of each stage's parameters.
    """
    stages = plan.stages
    if buckets is None:
        buckets = [bucket_count(st.predicted.parameter_bytes, bucket_cap_mb=plan.bucket_cap_mb) for st in stages]
    return simulate_schedule(
        plan.schedule_data(),
        forward_s=[st.predicted.forward_s for st in stages],
        backward_s=[st.predicted.backward_s for st in stages],
        sends_to=plan.sends_to(),
        receives_from=plan.receives_from(),
        transfer_s=boundary_seconds(plan),
        allreduce_s=[st.predicted.allreduce_s for st in stages],
        buckets=buckets,
        static_bytes=stage_static_bytes(plan),
        activation_bytes=[st.predicted.activation_bytes for st in stages],
        backward_bytes=[float(getattr(st.predicted, "recompute_peak_bytes", 0.0)) for st in stages],
    )


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
    it is one node).

    >>> from partitioner.plan import example_plan
    >>> [[round(x * 1e9) for x in row] for row in boundary_seconds(example_plan())]  # ns: 60 µs + 32 B at 1 GB/s
    [[0, 60032], [0, 0]]
    """
    intra, inter = plan_links(plan)
    gpus_per_node: int | None = getattr(plan, "gpus_per_node", None)
    precision: str = getattr(plan, "precision", "fp32")
    seconds = [[0.0] * len(plan.stages) for _ in plan.stages]
    for st in plan.stages:
        for b in st.outputs:
            crosses = p2p_crosses_nodes(b.source, b.target, dp=plan.dp, gpus_per_node=gpus_per_node)
            on = inter if crosses else intra
            seconds[b.source][b.target] += on.message_seconds(b.nbytes * activation_scale(precision, b.dtype))
    return seconds


def stage_static_bytes(plan: Plan) -> list[float]:
    """Bytes each stage holds for the whole step: its parameters, gradients and optimizer states.

    At the plan's precision (:func:`partitioner.precision.state_bytes`); a
    stage's parameter elements are its parameter bytes over the model's bytes
    per element.

    >>> from partitioner.plan import example_plan
    >>> stage_static_bytes(example_plan())  # 64 bytes of fp32 weights, Adam: x 4
    [256.0, 256.0]
    """
    precision: str = getattr(plan, "precision", "fp32")
    states = plan.cost_model.optimizer_states
    m = plan.model
    per_element = m.parameter_bytes / m.parameters if m.parameters else 4.0
    return [
        float(state_bytes(precision, states, elements=st.predicted.parameter_bytes / per_element,
                          model_bytes=st.predicted.parameter_bytes))
        for st in plan.stages
    ]


# ------------------------------------------------------------------ internals


def _per_stage(values: Sequence[float], stages: int, name: str) -> list[float]:
    if len(values) != stages:
        raise ValueError(f"{name} has {len(values)} entries for {stages} stages")
    return [float(v) for v in values]


class _Run:
    """Mutable state of one simulation: a clock and a cursor per stage, messages in flight."""

    def __init__(
        self,
        schedule: Schedule,
        forward: list[float],
        backward: list[float],
        sends_to: Sequence[Sequence[int]],
        receives_from: Sequence[Sequence[int]],
        seconds: list[list[float]],
        static: list[float],
        activation: list[float],
        during_backward: list[float],
    ) -> None:
        stages = schedule.stages
        if len(sends_to) != stages or len(receives_from) != stages:
            raise ScheduleError(f"The schedule has {stages} stages but the topology has {len(sends_to)}.")
        self.rows = schedule.actions
        self.forward, self.backward = forward, backward
        self.sends_to, self.receives_from = sends_to, receives_from
        self.seconds = seconds
        self.activation = activation
        self.during_backward = during_backward
        self.clock = [0.0] * stages
        self.cursor = [0] * stages
        self.arrival: dict[tuple[str, int, int, int], float] = {}  # (F|B, src, dst, mb) -> time
        self.link_free: dict[tuple[int, int], float] = {}
        self.events: list[list[TimelineEvent]] = [[] for _ in range(stages)]
        self.in_flight = [0] * stages
        self.peak_in_flight = [0] * stages
        self.memory: list[list[tuple[float, float]]] = [[(0.0, static[s])] for s in range(stages)]
        self.last_backward: list[tuple[float, float] | None] = [None] * stages

    def execute(self) -> None:
        while True:
            progressed = False
            for s, row in enumerate(self.rows):
                while self.cursor[s] < len(row) and self._step(s, row[self.cursor[s]]):
                    self.cursor[s] += 1
                    progressed = True
            if all(self.cursor[s] == len(row) for s, row in enumerate(self.rows)):
                return
            if not progressed:
                raise ScheduleError(f"The schedule deadlocks in simulation: {self._stuck()}.")

    def _step(self, s: int, a: Action) -> bool:
        """Run action ``a`` of stage ``s`` if it can run now; False if it must wait for a peer."""
        now = self.clock[s]
        i = a.microbatch
        if a.kind in ("RF", "RB"):
            keys = (
                [("F", p, s, i) for p in self.receives_from[s]]
                if a.kind == "RF"
                else [("B", p, s, i) for p in self.sends_to[s]]
            )
            if not all(k in self.arrival for k in keys):
                return False
            end = max([now] + [self.arrival[k] for k in keys])
            self._record(s, a, now, end)
            self.clock[s] = end
        elif a.kind == "SF":
            for t in self.sends_to[s]:
                self._send("F", s, t, i, self.seconds[s][t])
            self._record(s, a, now, now)
        elif a.kind == "SB":
            for p in self.receives_from[s]:
                self._send("B", s, p, i, self.seconds[p][s])
            self._record(s, a, now, now)
        elif a.kind == "F":
            self._record(s, a, now, now + self.forward[s])
            self._hold(s, now, +1)
            self.clock[s] = now + self.forward[s]
        else:  # "B"
            end = now + self.backward[s]
            self._record(s, a, now, end)
            if self.during_backward[s]:
                self._add_memory(s, now, self.during_backward[s])
            self._hold(s, end, -1, extra=-self.during_backward[s])
            self.last_backward[s] = (now, end)
            self.clock[s] = end
        return True

    def _send(self, kind: str, src: int, dst: int, microbatch: int, seconds: float) -> None:
        start = max(self.clock[src], self.link_free.get((src, dst), 0.0))
        self.link_free[src, dst] = start + seconds
        self.arrival[kind, src, dst, microbatch] = start + seconds

    def _hold(self, s: int, when: float, delta: int, *, extra: float = 0.0) -> None:
        self.in_flight[s] += delta
        self.peak_in_flight[s] = max(self.peak_in_flight[s], self.in_flight[s])
        self._add_memory(s, when, delta * self.activation[s] + extra)

    def _add_memory(self, s: int, when: float, nbytes: float) -> None:
        _, before = self.memory[s][-1]
        self.memory[s].append((when, before + nbytes))

    def _record(self, s: int, a: Action, start: float, end: float) -> None:
        label = f"{a.kind}{a.microbatch}"
        self.events[s].append(TimelineEvent(s, label, str(a), a.microbatch, a.kind, start, end))

    def _stuck(self) -> str:
        parts = []
        for s, row in enumerate(self.rows):
            c = self.cursor[s]
            if c < len(row):
                before = " ".join(str(a) for a in row[max(0, c - 3) : c]) or "nothing"
                parts.append(f"stage {s} waits at {row[c]} (after {before})")
        return "; ".join(parts)
