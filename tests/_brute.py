"""Brute-force references for the partition solvers, and random problem generators.

Enumerates every assignment of blocks to stages (``P**N`` of them, so keep
``N <= 8`` and ``P <= 4``) and keeps the valid ones that fit in memory.  Two
flavours: :func:`brute_force` (any topological assignment, what the ILP
solves) and :func:`brute_force_intervals` (contiguous intervals of the given
block order, what the interval DP solves).

Each assignment is priced with every recomputation choice its mode allows
(all ``2**P`` per-stage choices under "auto") and the least step time among
those that fit is kept; :func:`best_choice` asserts that the problem's local
rule (:func:`~partitioner.solve.problem.choose_recompute`) reaches that least.  Links
(node-crossing transfers and all-reduces) are priced by the shared closed form,
:func:`~partitioner.solve.problem.step_time`, checked by hand in ``test_problem.py``.

Imported from the test modules as ``import _brute`` (pytest's default
``prepend`` import mode puts ``tests/`` on ``sys.path``; ``tests`` has no
``__init__.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TypedDict, TypeVar

from partitioner.solve.problem import (
    RECOMPUTE_MODES,
    PartitionProblem,
    RecomputeMode,
    ScheduleKind,
    allreduce_latencies,
    check_assignment,
    choose_recompute,
    stage_costs,
    stage_memory,
    step_time,
)

Best = tuple[float, tuple[int, ...]]
_T = TypeVar("_T")


def fits(
    problem: PartitionProblem,
    stage_of: tuple[int, ...],
    stages: int,
    *,
    microbatches: int,
    schedule: ScheduleKind,
    recompute: Sequence[bool] | None = None,
) -> bool:
    """Every stage within ``problem.memory_limit`` (always true without a limit).

    ``recompute``: the per-stage choice; None: the problem's rule.
    """
    if problem.memory_limit is None:
        return True
    memory = stage_memory(
        problem, stage_of, stages, microbatches=microbatches, schedule=schedule, recompute=recompute
    )
    return all(m <= problem.memory_limit for m in memory)


def recompute_options(problem: PartitionProblem, stages: int) -> list[tuple[bool, ...]]:
    """The per-stage recomputation choices the problem's mode allows: all ``2**stages`` under "auto"."""
    if problem.recompute_bytes is None or problem.recompute == "none":
        return [(False,) * stages]
    if problem.recompute == "full":
        return [(True,) * stages]
    return list(itertools.product((False, True), repeat=stages))


def best_choice(
    problem: PartitionProblem,
    stage_of: tuple[int, ...],
    stages: int,
    *,
    microbatches: int,
    schedule: ScheduleKind,
) -> tuple[float, tuple[bool, ...]] | None:
    """The least step time of a valid assignment over the recomputation choices that fit, or None.

    Every choice is enumerated; the stage costs and memory of "keep" and
    "recompute" are taken once each and combined per choice (the closed form,
    spelled out here: ``sum t + (M-1) max t + max (all-reduce + latency)``).
    Asserts that :func:`~partitioner.solve.problem.choose_recompute` attains the least.
    """
    options = recompute_options(problem, stages)
    if len(options) == 1:
        if not fits(problem, stage_of, stages, microbatches=microbatches, schedule=schedule, recompute=options[0]):
            return None
        assert choose_recompute(problem, stage_of, stages, microbatches=microbatches, schedule=schedule) == options[0]
        value, _ = step_time(problem, stage_of, microbatches=microbatches, recompute=options[0])
        return value, options[0]
    memory = [
        stage_memory(problem, stage_of, stages, microbatches=microbatches, schedule=schedule, recompute=r)
        for r in ((False,) * stages, (True,) * stages)
    ]
    times = [stage_costs(problem, stage_of, stages, recompute=(r,) * stages)[0] for r in (False, True)]
    _, allreduce = stage_costs(problem, stage_of, stages, recompute=(False,) * stages)
    reduce_term = max(a + x for a, x in zip(allreduce, allreduce_latencies(problem, stages), strict=True))
    limit = math.inf if problem.memory_limit is None else problem.memory_limit
    best: tuple[float, tuple[bool, ...]] | None = None
    for choice in options:
        if any(memory[c][s] > limit for s, c in enumerate(choice)):
            continue
        t = [times[c][s] for s, c in enumerate(choice)]
        value = sum(t) + (microbatches - 1) * max(t) + reduce_term
        if best is None or value < best[0] - 1e-12 * abs(value):
            best = (value, choice)
    rule = choose_recompute(problem, stage_of, stages, microbatches=microbatches, schedule=schedule)
    kw = {"microbatches": microbatches, "schedule": schedule, "recompute": rule}
    if best is None:
        assert not fits(problem, stage_of, stages, **kw)  # type: ignore[arg-type]
        return None
    assert fits(problem, stage_of, stages, **kw), (stage_of, rule)  # type: ignore[arg-type]
    value, _ = step_time(problem, stage_of, microbatches=microbatches, recompute=rule)
    assert math.isclose(value, best[0], rel_tol=1e-9, abs_tol=1e-12), (stage_of, rule, value, best)
    return value, rule


def _best(
    problem: PartitionProblem,
    assignments: Iterable[tuple[int, ...]],
    stages: int,
    microbatches: int,
    schedule: ScheduleKind,
) -> Best | None:
    best: Best | None = None
    for stage_of in assignments:
        if check_assignment(problem, stage_of, stages) is not None:
            continue
        found = best_choice(problem, stage_of, stages, microbatches=microbatches, schedule=schedule)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], stage_of)
    return best


def brute_force_assignment(
    problem: PartitionProblem, *, stages: int, microbatches: int, schedule: ScheduleKind = "gpipe"
) -> Best | None:
    """The best (step time, stage_of) over all valid assignments, or None if none fits."""
    assert problem.size <= 8 and stages <= 4, "brute force is P**N"
    everything = itertools.product(range(stages), repeat=problem.size)
    return _best(problem, everything, stages, microbatches, schedule)


def brute_force(
    problem: PartitionProblem, *, stages: int, microbatches: int, schedule: ScheduleKind = "gpipe"
) -> float | None:
    """The least step time over all valid assignments, or None if none fits."""
    best = brute_force_assignment(
        problem, stages=stages, microbatches=microbatches, schedule=schedule
    )
    return None if best is None else best[0]


def _non_decreasing(n: int, stages: int) -> Iterator[tuple[int, ...]]:
    return (
        a
        for a in itertools.product(range(stages), repeat=n)
        if all(a[i] <= a[i + 1] for i in range(n - 1))
    )


def brute_force_intervals_assignment(
    problem: PartitionProblem, *, stages: int, microbatches: int, schedule: ScheduleKind = "gpipe"
) -> Best | None:
    """Like :func:`brute_force_assignment`, restricted to contiguous intervals of the order."""
    assert problem.size <= 8 and stages <= 4, "brute force is P**N"
    return _best(problem, _non_decreasing(problem.size, stages), stages, microbatches, schedule)


def brute_force_intervals(
    problem: PartitionProblem, *, stages: int, microbatches: int, schedule: ScheduleKind = "gpipe"
) -> float | None:
    """The least step time over interval splits of the given order, or None if none fits."""
    best = brute_force_intervals_assignment(
        problem, stages=stages, microbatches=microbatches, schedule=schedule
    )
    return None if best is None else best[0]


# --------------------------------------------------------------------------- generators


def random_edges(rng: random.Random, n: int, kind: str) -> tuple[tuple[int, int], ...]:
    """Edges ``u < v`` of a random DAG.

    ``kind``: ``"chain"`` (i -> i+1 plus random skips), ``"dag"`` (each pair with
    some probability, consecutive pairs sometimes missing, so several orders are
    topological), ``"sparse"`` (few edges; blocks often independent).
    """
    edges: set[tuple[int, int]] = set()
    if kind == "chain":
        edges.update((i, i + 1) for i in range(n - 1))
        for _ in range(rng.randint(0, n)):
            u = rng.randrange(n)
            v = rng.randrange(n)
            if u + 1 < v:
                edges.add((u, v))
    else:
        p = 0.5 if kind == "dag" else 0.2
        for u in range(n):
            for v in range(u + 1, n):
                if rng.random() < p:
                    edges.add((u, v))
    return tuple(sorted(edges))


def random_problem(
    rng: random.Random,
    n: int,
    *,
    kind: str = "chain",
    shared: bool = False,
    replicas: bool = False,
    transfers: bool = True,
) -> PartitionProblem:
    """A random problem without a memory limit; see :func:`with_limit`.

    Times are drawn from a few scales so that ties and near-ties both happen;
    bytes are integers (exact in float, so memory comparisons are exact).
    """
    scale = rng.choice([1.0, 1e-3])
    integers = rng.random() < 0.3  # small integers: many exact ties

    def seconds(lo: float, hi: float) -> float:
        if integers:
            return float(rng.randint(int(lo * 4), int(hi * 4))) * scale
        return rng.uniform(lo, hi) * scale

    time_s = tuple(seconds(0.25, 5.0) for _ in range(n))
    transfer_s = tuple(seconds(0.0, 2.0) if transfers else 0.0 for _ in range(n))
    allreduce_s = tuple(seconds(0.0, 2.0) if replicas else 0.0 for _ in range(n))
    static_bytes = tuple(float(rng.randint(0, 100)) for _ in range(n))
    activation_bytes = tuple(float(rng.randint(0, 50)) for _ in range(n))
    shared_params: list[tuple[float, float, tuple[int, ...]]] = []
    if shared and n >= 2:
        for _ in range(rng.randint(1, 2)):
            readers = tuple(sorted(rng.sample(range(n), rng.randint(2, min(3, n)))))
            shared_params.append(
                (float(rng.randint(1, 200)), seconds(0.0, 2.0) if replicas else 0.0, readers)
            )
    return PartitionProblem(
        time_s=time_s,
        static_bytes=static_bytes,
        activation_bytes=activation_bytes,
        allreduce_s=allreduce_s,
        transfer_s=transfer_s,
        edges=random_edges(rng, n, kind),
        shared=tuple(shared_params),
    )


def with_limit(
    problem: PartitionProblem,
    rng: random.Random,
    *,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind,
    intervals: bool,
) -> PartitionProblem:
    """The problem with a memory limit near the least feasible peak (sometimes just below).

    The limit is drawn between the smallest achievable peak memory (over the
    assignments the solver under test may use, each stage recomputing where that
    is allowed and smaller; sometimes a little below it, so that the problem is
    infeasible) and the peak of an unconstrained optimum (so that the limit
    usually binds and changes the answer: under "auto", often by forcing stages
    to recompute).
    """
    unlimited = _replace(problem, memory_limit=None)
    assignments: list[tuple[int, ...]]
    if intervals:
        assignments = list(_non_decreasing(problem.size, stages))
    else:
        assignments = list(itertools.product(range(stages), repeat=problem.size))
    valid = [a for a in assignments if check_assignment(problem, a, stages) is None]
    if not valid:
        return problem

    def peak(a: tuple[int, ...]) -> float:  # the unlimited rule's choice: keep unless "full"
        return max(stage_memory(unlimited, a, stages, microbatches=microbatches, schedule=schedule))

    def least_peak(a: tuple[int, ...]) -> float:  # each stage at its smaller allowed choice
        choices = {c for option in recompute_options(problem, stages) for c in option}
        memory = [
            stage_memory(problem, a, stages, microbatches=microbatches, schedule=schedule, recompute=(c,) * stages)
            for c in sorted(choices)
        ]
        return max(min(m[s] for m in memory) for s in range(stages))

    least = min(least_peak(a) for a in valid)
    best = _best(unlimited, valid, stages, microbatches, schedule)
    assert best is not None
    optimum_peak = peak(best[1])
    roll = rng.random()
    if roll < 0.2:
        limit = least - rng.randint(1, 10)  # infeasible
    elif roll < 0.35 or optimum_peak <= least:
        limit = least  # feasible only at the least peak
    else:
        # Integer limit (bytes are integers): comparisons stay exact.
        limit = float(rng.randint(int(least), int(optimum_peak) - 1))
    return _replace(problem, memory_limit=float(limit))


def with_recompute(
    problem: PartitionProblem, rng: random.Random, *, modes: Sequence[RecomputeMode] = RECOMPUTE_MODES
) -> PartitionProblem:
    """The problem with recomputation costs and a mode drawn from ``modes``.

    Kept bytes (block inputs) are integers below most activations; extra seconds a
    share of the block's time, sometimes 0 (keeping and recomputing then tie).
    """
    n = problem.size
    return _replace(
        problem,
        recompute_bytes=tuple(float(rng.randint(0, 20)) for _ in range(n)),
        recompute_s=tuple(t * rng.choice((0.0, 0.25, 0.5)) for t in problem.time_s),
        recompute=_pick(rng, modes),
    )


def with_topology(problem: PartitionProblem, rng: random.Random) -> PartitionProblem:
    """The problem on several nodes: 1-3 replicas per stage, 1-4 GPUs per node, slower inter-node prices.

    Slow prices are the fast ones times a small integer (ties stay ties); the
    all-reduce latency terms (fast, and slow at least as large) are a share of the
    largest block time, sometimes 0.
    """
    unit = max(problem.time_s)
    latency = rng.choice((0.0, 0.05, 0.2)) * unit
    return _replace(
        problem,
        replicas=rng.choice((1, 1, 2, 3)),
        gpus_per_node=rng.randint(1, 4),
        transfer_slow_s=tuple(t * rng.randint(1, 6) for t in problem.transfer_s),
        allreduce_slow_s=tuple(a * rng.randint(1, 6) for a in problem.allreduce_s),
        shared_slow_allreduce_s=tuple(k[1] * rng.randint(1, 6) for k in problem.shared),
        allreduce_latency_s=latency,
        allreduce_latency_slow_s=latency + rng.choice((0.0, 0.1, 0.5)) * unit,
    )


def recompute_chain(**changes: object) -> PartitionProblem:
    """A hand-computed case (``test_interval.py``, ``test_solve.py``): a chain of four blocks of
    1 s and 10 activation bytes; recomputed, 2 bytes kept and 0.5 s more each; "auto", limit 25."""
    n = 4
    problem = PartitionProblem(
        time_s=(1.0,) * n,
        static_bytes=(0.0,) * n,
        activation_bytes=(10.0,) * n,
        allreduce_s=(0.0,) * n,
        transfer_s=(0.0,) * n,
        edges=tuple((v, v + 1) for v in range(n - 1)),
        memory_limit=25.0,
        recompute_bytes=(2.0,) * n,
        recompute_s=(0.5,) * n,
        recompute="auto",
    )
    return _replace(problem, **changes)


def _replace(problem: PartitionProblem, **changes: object) -> PartitionProblem:
    return dataclasses.replace(problem, **changes)  # type: ignore[arg-type]


class Chances(TypedDict, total=False):
    """Some of :func:`make_case`'s probabilities, to pass as ``**chances``."""

    recompute: float
    topology: float
    limit: float


# Mostly recomputation (auto, none, full), often several nodes, binding limits more often.
RICH: Chances = {"recompute": 0.8, "topology": 0.6, "limit": 0.7}


@dataclasses.dataclass(frozen=True)
class Case:
    problem: PartitionProblem
    stages: int
    microbatches: int
    schedule: ScheduleKind


def make_case(
    seed: int,
    *,
    sizes: tuple[int, int],
    kinds: Sequence[str],
    schedules: Sequence[ScheduleKind] = ("gpipe", "1f1b"),
    several_ways: float = 0.0,
    shared: float = 0.3,
    replicas: float = 0.0,
    transfers: float = 0.8,
    limit: float = 0.5,
    recompute: float = 0.0,
    recompute_modes: Sequence[RecomputeMode] = ("auto", "auto", "none", "full"),
    topology: float = 0.0,
    intervals: bool,
) -> Case:
    """A random case: ``n`` blocks in ``sizes``, up to 4 stages, M in 1..8, a DAG of one of ``kinds``.

    The floats are probabilities: ``several_ways`` of leaving more than one way to split
    (``2 <= P < n``), ``shared`` of tied parameters, ``replicas`` of all-reduce terms,
    ``transfers`` of transfer times, ``recompute`` of recomputation costs (mode from
    ``recompute_modes``; :func:`with_recompute`), ``topology`` of several nodes with
    slower links between them (:func:`with_topology`), ``limit`` of a binding memory
    limit (drawn over interval splits when ``intervals``, else over every assignment;
    see :func:`with_limit`).  A probability of 0 or 1, like a single choice, draws nothing,
    so each test module's cases stay the same whichever options it does not use.
    """
    rng = random.Random(seed)
    n = rng.randint(*sizes)
    if n >= 3 and _chance(rng, several_ways):
        stages = rng.randint(2, min(4, n - 1))
    else:
        stages = rng.randint(1, min(4, n))
    microbatches = rng.choice([1, 2, 4, 8])
    schedule = _pick(rng, schedules)
    problem = random_problem(
        rng,
        n,
        kind=_pick(rng, kinds),
        shared=_chance(rng, shared),
        replicas=_chance(rng, replicas),
        transfers=_chance(rng, transfers),
    )
    if _chance(rng, recompute):
        problem = with_recompute(problem, rng, modes=recompute_modes)
    if _chance(rng, topology):
        problem = with_topology(problem, rng)
    if _chance(rng, limit):
        problem = with_limit(
            problem,
            rng,
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            intervals=intervals,
        )
    return Case(problem, stages, microbatches, schedule)


def _chance(rng: random.Random, p: float) -> bool:
    return p >= 1 or (p > 0 and rng.random() < p)


def _pick(rng: random.Random, options: Sequence[_T]) -> _T:
    return options[0] if len(options) == 1 else rng.choice(options)
