"""Brute-force references for the partition solvers, and random problem generators.

Enumerates every assignment of blocks to stages (``P**N`` of them, so keep
``N <= 8`` and ``P <= 4``) and keeps the valid ones that fit in memory.  Two
flavours: :func:`brute_force` (any topological assignment, what the ILP
solves) and :func:`brute_force_intervals` (contiguous intervals of the given
block order, what the interval DP solves).

Imported from the test modules as ``import _brute`` (pytest's default
``prepend`` import mode puts ``tests/`` on ``sys.path``; ``tests`` has no
``__init__.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from partitioner.problem import (
    PartitionProblem,
    ScheduleKind,
    check_assignment,
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
) -> bool:
    """Every stage within ``problem.memory_limit`` (always true without a limit)."""
    if problem.memory_limit is None:
        return True
    memory = stage_memory(problem, stage_of, stages, microbatches=microbatches, schedule=schedule)
    return all(m <= problem.memory_limit for m in memory)


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
        if not fits(problem, stage_of, stages, microbatches=microbatches, schedule=schedule):
            continue
        value, _ = step_time(problem, stage_of, microbatches=microbatches)
        if best is None or value < best[0]:
            best = (value, stage_of)
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
    assignments the solver under test may use; sometimes a little below it, so
    that the problem is infeasible) and the peak of an unconstrained optimum
    (so that the limit usually binds and changes the answer).
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

    def peak(a: tuple[int, ...]) -> float:
        return max(stage_memory(problem, a, stages, microbatches=microbatches, schedule=schedule))

    least = min(peak(a) for a in valid)
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


def _replace(problem: PartitionProblem, **changes: object) -> PartitionProblem:
    return dataclasses.replace(problem, **changes)  # type: ignore[arg-type]


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
    intervals: bool,
) -> Case:
    """A random case: ``n`` blocks in ``sizes``, up to 4 stages, M in 1..8, a DAG of one of ``kinds``.

    The floats are probabilities: ``several_ways`` of leaving more than one way to split
    (``2 <= P < n``), ``shared`` of tied parameters, ``replicas`` of all-reduce terms,
    ``transfers`` of transfer times, ``limit`` of a binding memory limit (drawn over
    interval splits when ``intervals``, else over every assignment; see
    :func:`with_limit`).  A probability of 0 or 1, like a single choice, draws nothing,
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
