"""Exact split of blocks in a fixed order into contiguous intervals (dynamic programming).

The step time ``sum_s t_s + (M-1) max_s t_s`` is not a sum over stages, so the
DP enumerates the bottleneck: for a cap ``T`` on every stage's time it finds
the split with the smallest ``sum_s t_s`` (a min-plus recurrence over interval
ends), and the best split over all caps is optimal.  Caps are the interval
costs themselves, scanned upward from the smallest feasible one, and the scan
stops once ``min_sum + (M-1) T`` cannot beat the best found.

Exact for the order given, including transfers into each stage and memory
limits; the all-reduce term (replicas > 1) is evaluated for every candidate but
not enumerated, so with replicas the answer is exact only when that term does
not decide between candidates (``solve`` then asks the ILP).

Example::

    >>> from partitioner.problem import PartitionProblem
    >>> p = PartitionProblem(time_s=(1.0, 1.0, 2.0), static_bytes=(0,) * 3,
    ...     activation_bytes=(0,) * 3, allreduce_s=(0,) * 3, transfer_s=(0,) * 3,
    ...     edges=((0, 1), (1, 2)))
    >>> solve_intervals(p, stages=2, microbatches=4).stage_of
    (0, 0, 1)
"""

from __future__ import annotations

import time

import numpy as np

from partitioner.problem import Partition, PartitionProblem, ScheduleKind, in_flight, step_time

__all__ = ["interval_matrices", "solve_intervals"]


def interval_matrices(problem: PartitionProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(time, static, activation)`` of every interval ``[i, j)`` as (N+1, N+1) arrays.

    ``time`` includes the transfers the interval receives; entries with ``j <= i``
    are ``inf`` / unused.
    """
    n = problem.size
    t = np.asarray(problem.time_s, dtype=float)
    prefix_t = np.concatenate([[0.0], np.cumsum(t)])
    prefix_s = np.concatenate([[0.0], np.cumsum(np.asarray(problem.static_bytes, dtype=float))])
    prefix_a = np.concatenate([[0.0], np.cumsum(np.asarray(problem.activation_bytes, dtype=float))])
    cost = prefix_t[None, :] - prefix_t[:, None]
    static = prefix_s[None, :] - prefix_s[:, None]
    activation = prefix_a[None, :] - prefix_a[:, None]
    consumers: dict[int, list[int]] = {}
    for u, v in problem.edges:
        consumers.setdefault(u, []).append(v)
    for u, readers in consumers.items():
        _add_if_reader_inside(cost, sorted(set(readers)), problem.transfer_s[u], lo=u + 1)
    for nbytes, _, shared_readers in problem.shared:
        _add_if_reader_inside(static, sorted(set(shared_readers)), nbytes, lo=0)
    invalid = np.tril(np.ones((n + 1, n + 1), dtype=bool))
    cost[invalid] = np.inf
    return cost, static, activation


def _add_if_reader_inside(matrix: np.ndarray, readers: list[int], amount: float, *, lo: int) -> None:
    """Add ``amount`` to every interval [i, j) with i >= lo that contains one of ``readers``."""
    if amount == 0:
        return
    position = 0
    for i in range(lo, readers[-1] + 1):
        while readers[position] < i:
            position += 1
        matrix[i, readers[position] + 1 :] += amount


def solve_intervals(
    problem: PartitionProblem,
    *,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind = "gpipe",
) -> Partition | None:
    """The best split of the blocks, in their given order, into ``stages`` intervals.

    Returns None when no split meets the memory limit.
    """
    start = time.perf_counter()
    n = problem.size
    if not 1 <= stages <= n:
        return None
    cost, static, activation = interval_matrices(problem)
    masks = _memory_masks(problem, static, activation, stages, microbatches, schedule)
    feasible_cost = np.where(np.any(masks, axis=0), cost, np.inf)
    candidates = np.unique(feasible_cost[np.isfinite(feasible_cost)])
    if candidates.size == 0:
        return None
    # Smallest cap with any feasible split (binary search), and the least sum overall.
    unconstrained = _min_sum(cost, masks, stages, cap=np.inf)
    if unconstrained is None:
        return None
    lo, hi = 0, candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_sum(cost, masks, stages, cap=candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    min_sum = unconstrained[0]
    best: tuple[float, tuple[int, ...]] | None = None
    for cap in candidates[lo:]:
        if best is not None and min_sum + (microbatches - 1) * cap >= best[0] - 1e-15:
            break
        found = _min_sum(cost, masks, stages, cap=cap)
        if found is None:
            continue
        objective, _ = step_time(problem, found[1], microbatches=microbatches)
        if best is None or objective < best[0] - 1e-15:
            best = (objective, found[1])
    assert best is not None
    lower = min_sum + (microbatches - 1) * float(candidates[lo])
    return Partition(
        stage_of=best[1],
        stages=stages,
        objective=best[0],
        lower_bound=min(lower, best[0]),
        status="optimal",
        solver="interval-dp",
        wall_s=time.perf_counter() - start,
    )


def _memory_masks(
    problem: PartitionProblem,
    static: np.ndarray,
    activation: np.ndarray,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind,
) -> np.ndarray:
    """``masks[s, i, j]``: interval [i, j) fits in memory as stage s."""
    n = problem.size
    if problem.memory_limit is None:
        return np.ones((stages, n + 1, n + 1), dtype=bool)
    limit = problem.memory_limit * (1 + 1e-12)
    return np.stack(
        [
            static + in_flight(s, stages, microbatches, schedule) * activation <= limit
            for s in range(stages)
        ]
    )


def _min_sum(
    cost: np.ndarray, masks: np.ndarray, stages: int, *, cap: float
) -> tuple[float, tuple[int, ...]] | None:
    """Least total stage time with every stage at most ``cap``; None if impossible."""
    n = cost.shape[0] - 1
    allowed = np.where(cost <= cap, cost, np.inf)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choices = np.zeros((stages, n + 1), dtype=np.int64)
    for s in range(stages):
        total = best[:, None] + np.where(masks[s], allowed, np.inf)  # (start i, end j)
        choices[s] = np.argmin(total, axis=0)
        best = total[choices[s], np.arange(n + 1)]
    if not np.isfinite(best[n]):
        return None
    stage_of = [0] * n
    end = n
    for s in range(stages - 1, -1, -1):
        begin = int(choices[s, end])
        stage_of[begin:end] = [s] * (end - begin)
        end = begin
    return float(best[n]), tuple(stage_of)
