"""Refine a split in simulation: local search over stage boundaries, judged by the simulator.

The solvers minimise the closed form ``sum t + (M-1) max t + all-reduce``
(:func:`partitioner.solve.problem.step_time`), which charges every transfer a stage
receives to that stage's time, so M-1 times over.  The simulator
(:mod:`partitioner.schedule.simulate`), like the runtime, posts sends without blocking
and lets a link carry messages while both ends compute: a transfer mostly
delays the fill and the drain, once.  Behind a slow (inter-node) boundary the
closed form therefore under-loads the receiving stage, and a hand-made split
that ignores transfers can simulate faster than the closed form's optimum.

This module closes that gap without touching the solvers: starting from a
solver's split (or a given alternative that simulates faster) it moves one
block of work at a time from a stage to another, shifting every boundary
between them by one block in the block order (:func:`move_block`), keeps only
valid assignments
(:func:`~partitioner.solve.problem.check_assignment`) that fit in memory
(:func:`~partitioner.solve.problem.stage_memory` with the per-stage recomputation
re-chosen by :func:`~partitioner.solve.problem.choose_recompute`), and accepts a move
when the simulated step gets shorter (first improvement, boundary by boundary,
sweeping until a sweep changes nothing or the simulation budget is spent).  Moves
only ever lower the simulated step, so the result is never worse than the start.

Each candidate is simulated from the problem's numbers by :class:`SplitSimulator`:
the same action lists (:func:`~partitioner.schedule.lower.compute_order`,
:func:`~partitioner.schedule.lower.lower`) replayed with the same rules as
:func:`~partitioner.schedule.simulate.simulate_schedule` (non-blocking sends, one message
at a time per directed link, receives wait for every peer, DDP buckets
overlapping the last backward via :func:`~partitioner.schedule.simulate.allreduce_buckets`),
but computing only the step time, without events or a memory timeline (about
ten times faster).  ``tests/test_refine.py`` checks both give the same step.

Local search over the boundaries of a pipeline split is the refinement step of
e.g. PipeDream's planner follow-ups and of Alpa's stage construction
heuristics; here its objective is the simulator, the planner's final judge.

Example: two stages, heavy transfers out of blocks 1 and 2.  The closed form
charges one to stage 1 on every micro-batch (3 + 2 = 5 s, paced 7 more times)
and so prefers the split 1 | 1 + 1 + 3; the simulator overlaps the transfer::

    >>> p = PartitionProblem(time_s=(1.0, 1.0, 1.0, 3.0), static_bytes=(0.0,) * 4,
    ...     activation_bytes=(0.0,) * 4, allreduce_s=(0.0,) * 4,
    ...     transfer_s=(0.0, 2.0, 2.0, 0.0), edges=((0, 1), (1, 2), (2, 3)))
    >>> step_time(p, (0, 1, 1, 1), microbatches=8)[0], step_time(p, (0, 0, 0, 1), microbatches=8)[0]
    (41.0, 43.0)
    >>> r = refine_split(p, (0, 1, 1, 1), 2, microbatches=8, schedule="1f1b")
    >>> r.stage_of, r.before_s, r.after_s, r.moves
    ((0, 0, 0, 1), 41.0, 35.0, 2)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from partitioner.cost.comm import bucket_count, p2p_crosses_nodes
from partitioner.defaults import splits_backward
from partitioner.orders import Schedule
from partitioner.schedule.lower import compute_order, lower
from partitioner.solve.problem import (
    PartitionProblem,
    ScheduleKind,
    StageRecompute,
    allreduce_latencies,
    check_assignment,
    choose_recompute,
    rank_memory,
    recomputed_blocks,
    split_backward,
    stage_costs,
    stage_memory,
    stage_rank_of,
    step_time,
    within_limit,
)

__all__ = [
    "REFINE_SIMULATIONS",
    "RefinedSplit",
    "SplitSimulator",
    "StepModel",
    "compile_rows",
    "layer_starts",
    "move_block",
    "refine_split",
    "shift_boundary",
]

# Default budget of one refinement, in simulated steps: a count, not seconds, so a plan
# does not depend on how busy the machine was (about 3 s at 32 stages x 64 micro-batches).
REFINE_SIMULATIONS = 600

_IMPROVES = 1e-9  # relative: a move must shorten the step by more than rounding
_ROUNDING = 1e-12  # relative: a lower bound summed in another order than the replay's may exceed it by this


@dataclasses.dataclass(frozen=True)
class StepModel:
    """What the simulator needs beyond the :class:`PartitionProblem` (per micro-batch, per replica).

    ``forward_s[v]``: the part of ``time_s[v]`` spent in block v's forward (the
    rest is its backward).  ``parameters``: ``(bytes, reader blocks)`` of each
    parameter, to count a stage's DDP buckets (:func:`~partitioner.cost.comm.bucket_count`
    of the parameter bytes it holds, at ``bucket_cap_mb``); empty: one bucket per
    stage (the all-reduce fully exposed after the last backward).
    """

    forward_s: tuple[float, ...]
    parameters: tuple[tuple[float, tuple[int, ...]], ...] = ()
    bucket_cap_mb: float = 0.0

    @staticmethod
    def default(problem: PartitionProblem) -> StepModel:
        """Forward = the recomputation seconds where known, else a third of the block's time.

        (A backward costs about twice its forward: Narayanan et al., "Efficient
        Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, sec. 5.1.)
        """
        if problem.recompute_s is not None:
            return StepModel(tuple(problem.recompute_s))
        return StepModel(tuple(t / 3 for t in problem.time_s))


@dataclasses.dataclass(frozen=True)
class RefinedSplit:
    """What :func:`refine_split` found: the split, its recomputation, and the simulated steps."""

    stage_of: tuple[int, ...]
    recompute: tuple[StageRecompute, ...]  # per stage (partitioner.solve.problem.StageRecompute)
    before_s: float  # simulated step of the starting split
    after_s: float  # simulated step of ``stage_of`` (<= before_s)
    moves: int  # accepted boundary moves
    simulations: int  # candidate splits simulated
    wall_s: float
    objective: float  # closed form of ``stage_of`` (the solver's measure; may exceed the start's)

    @property
    def gain(self) -> float:
        """Share of the starting step saved: ``1 - after / before``."""
        return 1 - self.after_s / self.before_s if self.before_s > 0 else 0.0


def shift_boundary(stage_of: Sequence[int], stage: int, by: int) -> tuple[int, ...] | None:
    """Move the boundary between ``stage`` and ``stage + 1`` by ``by`` blocks in the block order.

    ``by > 0``: the last ``by`` blocks of ``stage`` join ``stage + 1``; ``by < 0``:
    the first ``-by`` blocks of ``stage + 1`` join ``stage``.  None when the giving
    stage has too few blocks.  The result may still break an edge: check it.

    >>> shift_boundary((0, 0, 0, 1, 1), 0, 1), shift_boundary((0, 0, 0, 1, 1), 0, -1)
    ((0, 0, 1, 1, 1), (0, 0, 0, 0, 1))
    >>> shift_boundary((0, 1), 0, 1) is None  # stage 0 would be empty
    True
    """
    source, target = (stage, stage + 1) if by > 0 else (stage + 1, stage)
    members = [v for v, s in enumerate(stage_of) if s == source]
    count = abs(by)
    if count >= len(members):
        return None
    moved = members[-count:] if by > 0 else members[:count]
    out = list(stage_of)
    for v in moved:
        out[v] = target
    return tuple(out)


class SplitSimulator:
    """Simulated step of any split of one problem, at ``microbatches`` and ``schedule``.

    Stage numbers follow the plan's (:func:`partitioner.search.assemble.build_plan`):
    forward and backward from the blocks (a recomputing stage runs its forwards
    again in the backward; a split backward's W takes the blocks' ``weight_s``),
    transfers one message per (block, receiving stage) on the link the two
    stages' ranks share (none between two stages of one rank), all-reduce as
    :func:`~partitioner.solve.problem.stage_costs` prices it plus the stage's latency
    term.  ``stages`` counts every stage; a problem with ``stage_rank`` (a
    schedule with several stages per pipeline rank) is replayed per rank, as
    :func:`~partitioner.schedule.simulate.simulate_schedule` does.
    """

    def __init__(
        self,
        problem: PartitionProblem,
        stages: int,
        *,
        microbatches: int,
        schedule: ScheduleKind,
        model: StepModel | None = None,
    ) -> None:
        self.problem, self.stages, self.microbatches, self.schedule = problem, stages, microbatches, schedule
        self.model = model or StepModel.default(problem)
        if len(self.model.forward_s) != problem.size:
            raise ValueError(f"forward_s has {len(self.model.forward_s)} entries, expected {problem.size}")
        self.latency = allreduce_latencies(problem, stages)
        self.where = stage_rank_of(problem, stages)
        self.ranks = max(self.where) + 1
        self.split = splits_backward(schedule)
        # Forwards each rank runs before its first backward (one stage per rank, GPipe or 1F1B; else empty).
        self._warmup: tuple[int, ...] = ()
        if self.ranks == stages and schedule in ("gpipe", "1f1b"):
            rows = [[str(a) for a in row] for row in compute_order(schedule, ranks=stages, microbatches=microbatches)]
            self._warmup = tuple(next(i for i, a in enumerate(row) if "B" in a) for row in rows)
        self._rows: dict[tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]], _Rows] = {}
        # Steps already simulated: (split, recomputation) -> (step, the limit it was cut off at, or inf).
        self._steps: dict[tuple[tuple[int, ...], tuple[StageRecompute, ...]], tuple[float, float]] = {}
        self.simulations = 0

    def recompute(self, stage_of: Sequence[int]) -> tuple[StageRecompute, ...]:
        """The per-stage recomputation the planner would take for ``stage_of``."""
        return choose_recompute(self.problem, stage_of, self.stages,
                                microbatches=self.microbatches, schedule=self.schedule)

    def fits(self, stage_of: Sequence[int], recompute: Sequence[StageRecompute]) -> bool:
        """Every stage within the memory limit (its cap), and every rank within the GPU's where that is apart."""
        p, n, m, kind = self.problem, self.stages, self.microbatches, self.schedule
        memory = stage_memory(p, stage_of, n, microbatches=m, schedule=kind, recompute=recompute)
        if not all(within_limit(x, p.memory_limit) for x in memory):
            return False
        limit = p.rank_memory_limit
        return limit is None or all(
            within_limit(x, limit) for x in rank_memory(p, stage_of, n, microbatches=m, schedule=kind, recompute=recompute))

    def step(self, stage_of: Sequence[int], recompute: Sequence[StageRecompute] | None = None, *,
             limit: float = math.inf) -> float:
        """Simulated step seconds of ``stage_of`` (a valid assignment).

        ``limit``: a step known not to be wanted from ``limit`` on; the replay stops
        as soon as some rank's clock reaches it and returns ``inf`` (any step from
        ``limit`` on is equally rejected, and a local search rejects most of the
        splits it tries).  Every call counts as one simulation, whether replayed,
        cut off or remembered, so a search's budget means the same either way.
        """
        p, n, model, where = self.problem, self.stages, self.model, self.where
        chosen = tuple(recompute) if recompute else self.recompute(stage_of)
        self.simulations += 1
        key = (tuple(stage_of), chosen)
        known = self._steps.get(key)
        if known is not None and (known[1] == math.inf or known[1] >= limit):
            return known[0] if known[0] < limit else math.inf
        forward, backward = [p.action_s] * n, [p.action_s] * n  # the runtime's host time per F and B
        redo = recomputed_blocks(stage_of, n, chosen)  # a stage's first blocks (selective), all or none
        for v, s in enumerate(stage_of):
            forward[s] += model.forward_s[v]
            backward[s] += p.time_s[v] - model.forward_s[v]
            if redo[v]:
                assert p.recompute_s is not None
                backward[s] += p.recompute_s[v]
        weight = [0.0] * n
        if self.split:
            weight, added, in_forward = split_backward(p, stage_of, n, forward_s=model.forward_s)
            forward = [f + x for f, x in zip(forward, in_forward, strict=True)]
            backward = [b + x - y for b, x, y in zip(backward, added, in_forward, strict=True)]
        seconds = [[0.0] * n for _ in range(n)]
        sent: set[tuple[int, int]] = set()
        dp, per_node = p.replicas, p.gpus_per_node
        for u, v in p.edges:
            a, b = stage_of[u], stage_of[v]
            if a != b and (u, b) not in sent:
                sent.add((u, b))
                if where[a] == where[b]:
                    continue  # handed over in memory
                prices = p.transfer_s
                if p.transfer_slow_s is not None and p2p_crosses_nodes(where[a], where[b], dp=dp, gpus_per_node=per_node):
                    prices = p.transfer_slow_s
                seconds[a][b] += prices[u] / 2  # transfer_s holds both directions
        pairs = {(stage_of[u], b) for u, b in sent}
        if limit < math.inf and self._bound(forward, backward, pairs) * (1 - _ROUNDING) >= limit:
            self._steps[key] = (math.inf, limit)
            return math.inf  # no replay can make it shorter than its busiest rank's compute
        sends_to = tuple(tuple(b for b in range(n) if (a, b) in pairs) for a in range(n))
        receives_from = tuple(tuple(a for a in range(n) if (a, b) in pairs) for b in range(n))
        _, allreduce = stage_costs(p, stage_of, n, recompute=chosen)
        reduce = [a + x for a, x in zip(allreduce, self.latency, strict=True)]
        buckets = self._buckets(stage_of)
        try:
            found = _replay(self._compiled(sends_to, receives_from), _Stages(
                where, forward, backward, weight, seconds, reduce, buckets, p.message_host_s), limit=limit)
        except _Deadlock:
            # Several stages per rank with a skip connection can order their messages into a deadlock:
            # such a split cannot run, so it never wins (validate() rejects its plan as well).
            found, limit = math.inf, math.inf
        self._steps[key] = (found, limit if found == math.inf else math.inf)
        return found if found < limit else math.inf

    def _bound(self, forward: Sequence[float], backward: Sequence[float], pairs: set[tuple[int, int]]) -> float:
        """A lower bound on the replayed step, from compute alone (messages and all-reduces only add).

        Every rank computes its stages' M forwards and backwards one at a time.  With
        one stage per rank in a chain (stage s receives from s-1) under GPipe or
        1F1B, rank r also waits: its first backward needs a first forward through
        every stage and the gradient back through the stages after r, before which r
        runs only its warm-up forwards; and its last action, a backward, is followed
        by that micro-batch's backward on every stage before r.
        """
        m, n = self.microbatches, self.stages
        work = [0.0] * self.ranks
        for s in range(n):
            work[self.where[s]] += m * (forward[s] + backward[s])
        bound = max(work)
        if self._warmup and all((s - 1, s) in pairs for s in range(1, n)):
            total_f, later_b = sum(forward), sum(backward)
            before_f = before_b = 0.0
            for r, k in enumerate(self._warmup):
                later_b -= backward[r]
                first_backward = max(total_f + later_b, before_f + k * forward[r])
                bound = max(bound, first_backward + (m - k) * forward[r] + m * backward[r] + before_b)
                before_f += forward[r]
                before_b += backward[r]
        return bound

    def _buckets(self, stage_of: Sequence[int]) -> list[int]:
        held = [0.0] * self.stages
        for nbytes, readers in self.model.parameters:
            for s in {stage_of[r] for r in readers}:
                held[s] += nbytes
        return [bucket_count(b, bucket_cap_mb=self.model.bucket_cap_mb) if self.model.parameters else 1
                for b in held]

    def _compiled(self, sends_to: tuple[tuple[int, ...], ...], receives_from: tuple[tuple[int, ...], ...]) -> _Rows:
        key = (sends_to, receives_from)
        if key not in self._rows:
            order = compute_order(self.schedule, ranks=self.ranks, microbatches=self.microbatches,
                                  chunks=self.stages // self.ranks)
            schedule = lower(order, sends_to=sends_to, receives_from=receives_from, stage_rank=self.where,
                             kind=self.schedule)
            self._rows[key] = compile_rows(schedule, self.where, sends_to, receives_from)
        return self._rows[key]


_F, _B, _BI, _W = range(4)  # compute codes; _B: a whole backward; _BI: the input-gradient part (W follows)
_NONE = -1  # an entry without compute (a receive or a send on its own)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Per rank, its actions in the form :func:`_replay` runs, worked out once per topology.

    An entry fuses what a rank does back to back around one compute: ``(receive,
    code, stage, sends)``: the numbers of the messages a receive waits for (None:
    no receive), the compute (:data:`_NONE`: none), and per message sent after it
    ``(link, message, src stage, dst stage)`` (None: no send; ``seconds[src][dst]``,
    ``link = src rank x ranks + dst rank``).  ``RF F SF`` is one entry.  Messages
    are numbered densely so that arrivals and link clocks are lists.
    """

    rows: tuple[tuple[tuple[Any, ...], ...], ...]
    messages: int
    links: int
    stages_per_rank: int  # most stages any rank holds
    # Every entry (as :func:`_run_order` gives it), in an order that runs each only after the sends it waits
    # for (the same for any seconds: who waits for whom is fixed); None: the rows deadlock.
    order: tuple[tuple[Any, ...], ...] | None = None
    fan: int = 0  # most messages one receive or send moves


class _Deadlock(RuntimeError):
    """The replayed rows wait on each other forever (only ever with several stages per rank)."""


def compile_rows(
    schedule: Schedule,
    where: Sequence[int],
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
) -> _Rows:
    """``schedule``'s rows in the form :func:`_replay` runs: the messages worked out once per topology.

    A message is (micro-batch, direction, src stage, dst stage), numbered in the
    order first met; only peers on other ranks take messages.
    """
    n, ranks = len(where), schedule.ranks
    split = schedule.splits_backward
    out_ = [[t for t in sends_to[s] if where[t] != where[s]] for s in range(n)]
    in_ = [[q for q in receives_from[s] if where[q] != where[s]] for s in range(n)]
    numbers: dict[tuple[int, int, int, int], int] = {}

    def number(message: tuple[int, int, int, int]) -> int:
        return numbers.setdefault(message, len(numbers))

    codes = {"F": _F, "B": _BI if split else _B, "W": _W}
    rows: list[tuple[tuple[Any, ...], ...]] = []
    for row in schedule.actions:
        entries: list[tuple[Any, ...]] = []
        # The entry being built: [receive, code, stage, sends]; a new one starts where the order would break.
        current: list[Any] | None = None
        for a in row:
            s, i = a.stage, a.microbatch
            if a.kind in ("RF", "RB"):
                keys = tuple(number((i, 0, q, s)) for q in in_[s]) if a.kind == "RF" else \
                    tuple(number((i, 1, t, s)) for t in out_[s])
                if current is not None:
                    entries.append(tuple(current))
                current = [keys, _NONE, s, None]
            elif a.kind in codes:
                if current is None or current[1] != _NONE or current[3] is not None:
                    if current is not None:
                        entries.append(tuple(current))
                    current = [None, _NONE, s, None]
                current[1], current[2] = codes[a.kind], s
            else:  # SF / SB (the gradient back to each producer, priced as its forward message)
                sends = tuple((where[s] * ranks + where[t], number((i, 0, s, t)), s, t) for t in out_[s]) \
                    if a.kind == "SF" else \
                    tuple((where[s] * ranks + where[q], number((i, 1, s, q)), q, s) for q in in_[s])
                if current is None or current[3] is not None:
                    if current is not None:
                        entries.append(tuple(current))
                    current = [None, _NONE, s, None]
                current[3] = sends
        if current is not None:
            entries.append(tuple(current))
        rows.append(tuple(entries))
    held = [0] * ranks
    for r in where:
        held[r] += 1
    fan = max((len(e[k] or ()) for row in rows for e in row for k in (0, 3)), default=0)
    return _Rows(tuple(rows), len(numbers), ranks * ranks, max(held, default=1),
                 _run_order(rows, len(numbers), n), fan)


def _run_order(rows: Sequence[Sequence[tuple[Any, ...]]], messages: int, stages: int) -> tuple[tuple[Any, ...], ...] | None:
    """Every entry of ``rows`` once, each rank's in its order, each receive after the sends it waits for.

    The ranks are swept in turn, each running until a receive waits for a message
    not yet sent; None when a sweep moves no rank (the rows deadlock).  Entries
    come out as :func:`_replay` reads them: ``(rank, receive, its message count,
    compute code, stage, last, sends, their count)``, ``last`` marking a stage's
    last B (or W where split), whose span its all-reduce overlaps, and each send
    as ``(link, message, src x stages + dst)``.
    """
    final: dict[int, tuple[int, int]] = {}  # stage -> (rank, entry) of its last B or W
    for r, row in enumerate(rows):
        for c, (_, code, stage, _) in enumerate(row):
            if code in (_B, _W):
                final[stage] = (r, c)
    sent = [False] * messages
    cursor = [0] * len(rows)
    order: list[tuple[Any, ...]] = []
    remaining = sum(len(row) for row in rows)
    while remaining:
        before = remaining
        for r, row in enumerate(rows):
            c = cursor[r]
            while c < len(row):
                receive, code, stage, sends = row[c]
                if receive is not None and not all(sent[k] for k in receive):
                    break
                flat = None if sends is None else tuple((link, key, a * stages + b) for link, key, a, b in sends)
                for _, key, _ in flat or ():
                    sent[key] = True
                order.append((r, receive, len(receive or ()), code, stage, final.get(stage) == (r, c),
                              flat, len(flat or ())))
                c += 1
            remaining -= c - cursor[r]
            cursor[r] = c
        if remaining == before:
            return None
    return tuple(order)


@dataclasses.dataclass(frozen=True)
class _Stages:
    """Per stage, what :func:`_replay` needs: its rank, seconds (W 0 unless split), messages, all-reduce."""

    where: Sequence[int]
    forward: list[float]
    backward: list[float]  # the whole backward; B takes it less W where W is split off
    weight: list[float]
    seconds: list[list[float]]  # [src][dst] one message of a micro-batch
    allreduce: list[float]
    buckets: list[int]
    message_host_s: float = 0.0  # the rank's own seconds per message sent or received


def _replay(compiled: _Rows, st: _Stages, *, limit: float = math.inf) -> float:
    """The step time :func:`~partitioner.schedule.simulate.simulate_schedule` would give, by its rules, without events.

    ``compiled``: from :func:`compile_rows`.  ``inf`` as soon as a rank's clock
    reaches ``limit`` (the step can only be later still).

    The entries run in :attr:`_Rows.order`: every receive finds its messages
    sent.  Each rank's clock and each link's queue take their times in the same
    order as ranks running their rows in turn would, so the step is the same
    to the last bit (a link carries one rank's sends, in that rank's order).
    """
    order = compiled.order
    if order is None:
        raise _Deadlock("the schedule deadlocks in simulation")
    ranks, n = len(compiled.rows), len(st.where)
    where, forward, weight, seconds, host = st.where, st.forward, st.weight, st.seconds, st.message_host_s
    partial = [b - w for b, w in zip(st.backward, weight, strict=True)]
    whole = st.backward
    clock = [0.0] * ranks
    arrival = [0.0] * compiled.messages
    link_free = [0.0] * compiled.links
    last_backward: list[tuple[float, float] | None] = [None] * n  # last B, or W where split
    seconds_of = (forward, whole, partial, weight)  # by compute code: _F, _B, _BI, _W
    transfer = [x for row in seconds for x in row]  # [src x stages + dst]
    hosted = [host * k for k in range(compiled.fan + 1)]  # a rank's own seconds for k messages
    for r, receive, received, kind, s, last, sends, sent in order:
        now = clock[r]
        if receive is not None:
            for key in receive:
                t = arrival[key]
                if t > now:  # noqa: PLR1730 - not max(): a builtin call per message costs a tenth of the replay
                    now = t
            now += hosted[received]
        if kind != _NONE:
            if last:
                took = now + seconds_of[kind][s]
                last_backward[s] = (now, took)
                now = took
            else:
                now += seconds_of[kind][s]
        if sends is not None:  # posted now, each queued behind its link's earlier messages
            for link, key, pair in sends:
                free = link_free[link]
                if now > free:  # noqa: PLR1730 - as above
                    free = now
                free += transfer[pair]
                link_free[link] = free
                arrival[key] = free
            now += hosted[sent]
        if now >= limit:
            return math.inf
        clock[r] = now
    end = max(clock)
    if end >= limit:
        return math.inf  # the all-reduces only add
    spans = [last_backward[s] or (clock[where[s]], clock[where[s]]) for s in range(n)]
    reducing = [-math.inf] * ranks  # a rank's stages all-reduce one after another on its link
    alone = compiled.stages_per_rank == 1
    for s in sorted(range(n), key=lambda s: (spans[s][1], s)):
        start, stop = spans[s]
        seconds_s, after = st.allreduce[s], reducing[where[s]]
        if seconds_s <= 0:
            continue  # no buckets
        # The last bucket ends by max(stop, after) + seconds_s, up to rounding: when that cannot move
        # the step and no later stage of this rank queues behind it, its buckets need no replay.
        if alone and (max(stop, after) + seconds_s) * (1 + _SLACK * (max(1, st.buckets[s]) + 8)) < end:
            continue
        last = _last_bucket_end(start, stop, allreduce_s=seconds_s, buckets=st.buckets[s], after=after)
        if last > after:
            reducing[where[s]] = last
        end = max(end, last)
    return end


# Relative rounding _last_bucket_end may add to its exact value, per bucket: each step adds at most
# one unit in the last place (1.1e-16), and a few more come from each bucket's share and start.
_SLACK = 1e-15


def _last_bucket_end(start: float, stop: float, *, allreduce_s: float, buckets: int, after: float) -> float:
    """When the last bucket of :func:`~partitioner.schedule.simulate.allreduce_buckets` ends (``allreduce_s > 0``).

    The same arithmetic, in the same order, without building the list.

    >>> _last_bucket_end(0.0, 4.0, allreduce_s=2.0, buckets=2, after=3.5)
    5.5
    """
    count = max(1, buckets)
    length = stop - start
    each = allreduce_s / count
    free = after
    for k in range(1, count + 1):
        ready = start + length * k / count
        free = max(ready, free) + each
    return free


def layer_starts(block_layer: Sequence[int | None], stages: int) -> list[tuple[int, ...]]:
    """Splits people make by hand over a model's repeated layers, as starts for :func:`refine_split`.

    ``block_layer[v]``: the index of the repeated layer (transformer block) block v
    belongs to, or None for blocks outside the layers (embeddings, final norm, head),
    which go with the nearest layer before them (or the first stage).  Returns the
    splits that exist for ``stages``: equal layers per stage, extras first
    (Megatron-LM, DeepSpeed ``partition_uniform``), and equal parts of the layers plus
    one unit each for the input and output ends (torchtitan's first and last stages
    one layer lighter).  Starting the local search from them too means the chosen
    split is never slower in simulation than these hand-made ones.

    >>> layer_starts([None, 0, 0, 1, 1, 2, 2, 3, 3, None], 2)
    [(0, 0, 0, 0, 0, 1, 1, 1, 1, 1), (0, 0, 0, 0, 0, 1, 1, 1, 1, 1)]
    >>> layer_starts([None, 0, 1, None], 3)  # too few layers to split equally; ends as units
    [(0, 0, 1, 2)]
    >>> layer_starts([None, 0, None], 4)
    []
    """
    layers = sorted({layer for layer in block_layer if layer is not None})
    starts: list[tuple[int, ...]] = []
    for ends in (0, 1):  # 1: the input and output ends count as one layer each
        units = len(layers) + 2 * ends
        if units < stages or not layers:
            continue
        size, extra = divmod(units, stages)
        unit_stage = [s for s in range(stages) for _ in range(size + (1 if s < extra else 0))]
        stage_of_layer = {layer: unit_stage[i + ends] for i, layer in enumerate(layers)}
        last_layer_block = max(v for v, layer in enumerate(block_layer) if layer is not None)
        current = unit_stage[0]  # blocks before the first layer: the input end
        split: list[int] = []
        for v, layer in enumerate(block_layer):
            if layer is not None:
                current = stage_of_layer[layer]
            elif v > last_layer_block:
                current = unit_stage[-1]  # blocks after the last layer: the output end
            split.append(current)
        if sorted(set(split)) == list(range(stages)):
            starts.append(tuple(split))
    return starts


def move_block(stage_of: Sequence[int], source: int, target: int) -> tuple[int, ...] | None:
    """One block's worth of work from stage ``source`` to ``target``: every boundary between them shifts by one.

    Stages in between keep their block counts (each gives one block on and takes
    one), so this moves load between any two stages; between neighbours it is
    :func:`shift_boundary` by one.  None when a stage on the way would be emptied.

    >>> move_block((0, 0, 0, 1, 2), 0, 2), move_block((0, 1, 2, 2, 2), 2, 0)
    ((0, 0, 1, 2, 2), (0, 0, 1, 2, 2))
    """
    out: tuple[int, ...] | None = tuple(stage_of)
    steps = range(source, target) if source < target else range(source - 1, target - 1, -1)
    for s in steps:
        assert out is not None
        out = shift_boundary(out, s, 1 if source < target else -1)
        if out is None:
            return None
    return out


class _Moves:
    """:func:`move_block` of one split to every pair of stages, from its stages' first and last blocks.

    Each boundary shift between ``source`` and ``target`` hands one block on: a stage's last (moving
    forward) or first (moving back), which is its own or the one it was just handed; so the blocks
    that move follow from each stage's extremes and counts, without scanning the split per shift.
    """

    def __init__(self, stage_of: tuple[int, ...], stages: int) -> None:
        self.stage_of = stage_of
        self.first, self.last, self.count = [len(stage_of)] * stages, [-1] * stages, [0] * stages
        for v, s in enumerate(stage_of):
            self.first[s] = min(self.first[s], v)
            self.last[s] = max(self.last[s], v)
            self.count[s] += 1

    def move(self, source: int, target: int) -> tuple[int, ...] | None:
        """``move_block(stage_of, source, target)``."""
        if self.count[source] <= 1:
            return None  # the source would be emptied
        forward = source < target
        out = list(self.stage_of)
        handed: int | None = None
        for s in range(source, target) if forward else range(source, target, -1):
            own = self.last[s] if forward else self.first[s]
            block = own if handed is None else (max(own, handed) if forward else min(own, handed))
            out[block] = s + 1 if forward else s - 1
            handed = block
        return tuple(out)


def refine_split(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    microbatches: int,
    schedule: ScheduleKind,
    model: StepModel | None = None,
    budget: int = REFINE_SIMULATIONS,
    reach: int | None = None,
    alternatives: Sequence[Sequence[int]] = (),
) -> RefinedSplit:
    """Local search from ``stage_of`` (valid, fitting) that only accepts shorter simulated steps.

    Moves (:func:`move_block`) take one block of work from a stage to another
    ``d`` stages away, ``d`` = 1 (a boundary shift), 2, ... up to ``reach``
    (default: every distance): the simulated step of a 1F1B or GPipe pipeline
    depends on where the load sits, not only on the slowest stage, and a single
    boundary shift rarely helps when several stages tie for the slowest.  A sweep
    tries every move once, accepting each valid, fitting move that simulates
    faster (first improvement); sweeps repeat until one accepts nothing or
    ``budget`` simulations have run (a count, so the result is deterministic).
    ``alternatives``: other starts (e.g. another closed form's optimum); the
    search starts from the fastest valid, fitting one, or ``stage_of``.
    ``before_s`` is always ``stage_of``'s step.
    """
    started = time.perf_counter()
    sim = SplitSimulator(problem, stages, microbatches=microbatches, schedule=schedule, model=model)
    best = tuple(stage_of)
    why = check_assignment(problem, best, stages)
    if why is not None:
        raise ValueError(f"cannot refine an invalid split: {why}")
    best_recompute = sim.recompute(best)
    before = best_s = sim.step(best, best_recompute)
    moves = 0
    for other in alternatives:
        other = tuple(other)
        if other == best or check_assignment(problem, other, stages) is not None:
            continue
        recompute = sim.recompute(other)
        if sim.fits(other, recompute) and (t := sim.step(other, recompute, limit=best_s * (1 - _IMPROVES))) \
                < best_s * (1 - _IMPROVES):
            best, best_s, best_recompute = other, t, recompute
            moves += 1
    farthest = stages - 1 if reach is None else min(reach, stages - 1)
    pairs = [(a, b) for d in range(1, farthest + 1) for a in range(stages) for b in (a + d, a - d) if 0 <= b < stages]
    moves_of = _Moves(best, stages)
    improved = True
    while improved and sim.simulations < budget:
        improved = False
        for a, b in pairs:
            if sim.simulations >= budget:
                break
            if moves_of.stage_of is not best:
                moves_of = _Moves(best, stages)
            candidate = moves_of.move(a, b)  # move_block(best, a, b)
            if candidate is None or check_assignment(problem, candidate, stages) is not None:
                continue
            recompute = sim.recompute(candidate)
            if not sim.fits(candidate, recompute):
                continue
            t = sim.step(candidate, recompute, limit=best_s * (1 - _IMPROVES))  # slower ones are cut short
            if t < best_s * (1 - _IMPROVES):
                best, best_s, best_recompute = candidate, t, recompute
                moves += 1
                improved = True
    objective, _ = step_time(problem, best, microbatches=microbatches, schedule=schedule, recompute=best_recompute)
    return RefinedSplit(best, best_recompute, before, best_s, moves, sim.simulations, time.perf_counter() - started, objective)
