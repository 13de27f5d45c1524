"""Refine a split in simulation: local search over stage boundaries, judged by the simulator.

The solvers minimise the closed form ``sum t + (M-1) max t + all-reduce``
(:func:`partitioner.problem.step_time`), which charges every transfer a stage
receives to that stage's time, so M-1 times over.  The simulator
(:mod:`partitioner.simulate`), like the runtime, posts sends without blocking
and lets a link carry messages while both ends compute: a transfer mostly
delays the fill and the drain, once.  Behind a slow (inter-node) boundary the
closed form therefore under-loads the receiving stage, and a hand-made split
that ignores transfers can simulate faster than the closed form's optimum.

This module closes that gap without touching the solvers: starting from a
solver's split (or a given alternative that simulates faster) it moves one
block of work at a time from a stage to another, shifting every boundary
between them by one block in the block order (:func:`move_block`), keeps only
valid assignments
(:func:`~partitioner.problem.check_assignment`) that fit in memory
(:func:`~partitioner.problem.stage_memory` with the per-stage recomputation
re-chosen by :func:`~partitioner.problem.choose_recompute`), and accepts a move
when the simulated step gets shorter (first improvement, boundary by boundary,
sweeping until a sweep changes nothing or the simulation budget is spent).  Moves
only ever lower the simulated step, so the result is never worse than the start.

Each candidate is simulated from the problem's numbers by :class:`SplitSimulator`:
the same action lists (:func:`~partitioner.schedule.compute_order`,
:func:`~partitioner.schedule.lower`) replayed with the same rules as
:func:`~partitioner.simulate.simulate_schedule` (non-blocking sends, one message
at a time per directed link, receives wait for every peer, DDP buckets
overlapping the last backward via :func:`~partitioner.simulate.allreduce_buckets`),
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
import time
from collections.abc import Sequence

from partitioner.commcost import bucket_count, p2p_crosses_nodes
from partitioner.problem import (
    PartitionProblem,
    ScheduleKind,
    allreduce_latencies,
    check_assignment,
    choose_recompute,
    stage_costs,
    stage_memory,
    step_time,
    within_limit,
)
from partitioner.schedule import compute_order, lower
from partitioner.simulate import allreduce_buckets

__all__ = [
    "REFINE_SIMULATIONS",
    "RefinedSplit",
    "SplitSimulator",
    "StepModel",
    "layer_starts",
    "move_block",
    "refine_split",
    "shift_boundary",
]

# Default budget of one refinement, in simulated steps: a count, not seconds, so a plan
# does not depend on how busy the machine was (about 3 s at 32 stages x 64 micro-batches).
REFINE_SIMULATIONS = 600

_IMPROVES = 1e-9  # relative: a move must shorten the step by more than rounding


@dataclasses.dataclass(frozen=True)
class StepModel:
    """What the simulator needs beyond the :class:`PartitionProblem` (per micro-batch, per replica).

    ``forward_s[v]``: the part of ``time_s[v]`` spent in block v's forward (the
    rest is its backward).  ``parameters``: ``(bytes, reader blocks)`` of each
    parameter, to count a stage's DDP buckets (:func:`~partitioner.commcost.bucket_count`
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
    recompute: tuple[bool, ...]
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

    Stage numbers follow the plan's (:func:`partitioner.planner._stages`):
    forward and backward from the blocks (a recomputing stage runs its forwards
    again in the backward), transfers one message per (block, receiving stage) on
    the link the two stages' ranks share, all-reduce as :func:`~partitioner.problem.stage_costs`
    prices it plus the stage's latency term.
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
        self._rows: dict[tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]], list[list[tuple[int, int]]]] = {}
        self.simulations = 0

    def recompute(self, stage_of: Sequence[int]) -> tuple[bool, ...]:
        """The per-stage recomputation the planner would take for ``stage_of``."""
        return choose_recompute(self.problem, stage_of, self.stages,
                                microbatches=self.microbatches, schedule=self.schedule)

    def fits(self, stage_of: Sequence[int], recompute: Sequence[bool]) -> bool:
        """Every stage within the memory limit."""
        memory = stage_memory(self.problem, stage_of, self.stages, microbatches=self.microbatches,
                              schedule=self.schedule, recompute=recompute)
        return all(within_limit(m, self.problem.memory_limit) for m in memory)

    def step(self, stage_of: Sequence[int], recompute: Sequence[bool] | None = None) -> float:
        """Simulated step seconds of ``stage_of`` (a valid assignment)."""
        p, n, model = self.problem, self.stages, self.model
        chosen = tuple(recompute) if recompute else self.recompute(stage_of)
        forward, backward = [0.0] * n, [0.0] * n
        for v, s in enumerate(stage_of):
            forward[s] += model.forward_s[v]
            backward[s] += p.time_s[v] - model.forward_s[v]
            if chosen[s]:
                assert p.recompute_s is not None
                backward[s] += p.recompute_s[v]
        seconds = [[0.0] * n for _ in range(n)]
        sent: set[tuple[int, int]] = set()
        dp, per_node = p.replicas, p.gpus_per_node
        for u, v in p.edges:
            a, b = stage_of[u], stage_of[v]
            if a != b and (u, b) not in sent:
                sent.add((u, b))
                prices = p.transfer_s
                if p.transfer_slow_s is not None and p2p_crosses_nodes(a, b, dp=dp, gpus_per_node=per_node):
                    prices = p.transfer_slow_s
                seconds[a][b] += prices[u] / 2  # transfer_s holds both directions
        pairs = {(stage_of[u], b) for u, b in sent}
        sends_to = tuple(tuple(b for b in range(n) if (a, b) in pairs) for a in range(n))
        receives_from = tuple(tuple(a for a in range(n) if (a, b) in pairs) for b in range(n))
        _, allreduce = stage_costs(p, stage_of, n, recompute=chosen)
        reduce = [a + x for a, x in zip(allreduce, self.latency, strict=True)]
        buckets = self._buckets(stage_of)
        self.simulations += 1
        return _replay(self._compiled(sends_to, receives_from), forward, backward, sends_to, receives_from,
                       seconds, reduce, buckets, self.microbatches)

    def _buckets(self, stage_of: Sequence[int]) -> list[int]:
        held = [0.0] * self.stages
        for nbytes, readers in self.model.parameters:
            for s in {stage_of[r] for r in readers}:
                held[s] += nbytes
        return [bucket_count(b, bucket_cap_mb=self.model.bucket_cap_mb) if self.model.parameters else 1
                for b in held]

    def _compiled(
        self, sends_to: tuple[tuple[int, ...], ...], receives_from: tuple[tuple[int, ...], ...]
    ) -> list[list[tuple[int, int]]]:
        key = (sends_to, receives_from)
        if key not in self._rows:
            schedule = lower(compute_order(self.schedule, stages=self.stages, microbatches=self.microbatches),
                             sends_to=sends_to, receives_from=receives_from, kind=self.schedule)
            self._rows[key] = [[(_CODES[a.kind], a.microbatch) for a in row] for row in schedule.actions]
        return self._rows[key]


_F, _B, _SF, _SB, _RF, _RB = range(6)
_CODES = {"F": _F, "B": _B, "SF": _SF, "SB": _SB, "RF": _RF, "RB": _RB}


def _replay(
    rows: list[list[tuple[int, int]]],
    forward: list[float],
    backward: list[float],
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
    seconds: list[list[float]],
    allreduce: list[float],
    buckets: list[int],
    microbatches: int,
) -> float:
    """The step time :func:`~partitioner.simulate.simulate_schedule` would give, by its rules, without events."""
    n = len(rows)
    clock = [0.0] * n
    cursor = [0] * n
    arrival: dict[int, float] = {}  # ((mb x 2 + backward?) x n + src) x n + dst -> time
    link_free: dict[int, float] = {}
    last_backward: list[tuple[float, float] | None] = [None] * n
    remaining = sum(len(r) for r in rows)
    while remaining:
        progressed = False
        for s in range(n):
            row, c, now = rows[s], cursor[s], clock[s]
            while c < len(row):
                kind, i = row[c]
                if kind == _F:
                    now += forward[s]
                elif kind == _B:
                    last_backward[s] = (now, now + backward[s])
                    now += backward[s]
                elif kind == _RF or kind == _RB:
                    peers, base = (receives_from[s], 2 * i) if kind == _RF else (sends_to[s], 2 * i + 1)
                    end = now
                    for q in peers:
                        t = arrival.get((base * n + q) * n + s)
                        if t is None:
                            break
                        end = max(end, t)
                    else:
                        now = end
                        c += 1
                        continue
                    break
                else:  # a send: posted now, queued behind the link's earlier messages
                    peers, base = (sends_to[s], 2 * i) if kind == _SF else (receives_from[s], 2 * i + 1)
                    for q in peers:
                        link = s * n + q
                        start = max(now, link_free.get(link, 0.0))
                        free = start + (seconds[s][q] if kind == _SF else seconds[q][s])
                        link_free[link] = free
                        arrival[(base * n + s) * n + q] = free
                c += 1
            if c != cursor[s]:
                progressed = True
                remaining -= c - cursor[s]
                cursor[s], clock[s] = c, now
        if not progressed:
            raise RuntimeError("the schedule deadlocks in simulation")  # lower() never makes one
    end = 0.0
    for s in range(n):
        start, stop = last_backward[s] or (clock[s], clock[s])
        spans = allreduce_buckets(start, stop, allreduce_s=allreduce[s], buckets=buckets[s])
        end = max(end, clock[s], *(e for _, e in spans))
    return end


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
        if sim.fits(other, recompute) and (t := sim.step(other, recompute)) < best_s * (1 - _IMPROVES):
            best, best_s, best_recompute = other, t, recompute
            moves += 1
    farthest = stages - 1 if reach is None else min(reach, stages - 1)
    pairs = [(a, b) for d in range(1, farthest + 1) for a in range(stages) for b in (a + d, a - d) if 0 <= b < stages]
    improved = True
    while improved and sim.simulations < budget:
        improved = False
        for a, b in pairs:
            if sim.simulations >= budget:
                break
            candidate = move_block(best, a, b)
            if candidate is None or check_assignment(problem, candidate, stages) is not None:
                continue
            recompute = sim.recompute(candidate)
            if not sim.fits(candidate, recompute):
                continue
            t = sim.step(candidate, recompute)
            if t < best_s * (1 - _IMPROVES):
                best, best_s, best_recompute = candidate, t, recompute
                moves += 1
                improved = True
    objective, _ = step_time(problem, best, microbatches=microbatches, schedule=schedule, recompute=best_recompute)
    return RefinedSplit(best, best_recompute, before, best_s, moves, sim.simulations, time.perf_counter() - started, objective)
