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

import functools
import itertools
import operator
import time

import networkx as nx
import numpy as np

from partitioner.blockgraph import problem_graph
from partitioner.defaults import DEFAULT_SCHEDULE
from partitioner.problem import Partition, PartitionProblem, ScheduleKind, in_flight, step_time

__all__ = ["down_sets", "interval_matrices", "solve_down_sets", "solve_intervals"]


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
    graph = problem_graph(problem)
    for u, readers in graph.adj.items():
        if readers:
            _add_if_reader_inside(cost, sorted(readers), problem.transfer_s[u], lo=u + 1)
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
    schedule: ScheduleKind = DEFAULT_SCHEDULE,
) -> Partition | None:
    """The best split of the blocks, in their given order, into ``stages`` intervals.

    Returns None when no split meets the memory limit.
    """
    n = problem.size
    if not 1 <= stages <= n:
        return None
    cost, static, activation = interval_matrices(problem)
    prefixes = np.tri(n + 1, n, k=-1, dtype=bool)  # row i: the first i blocks
    return _best_split(problem, prefixes, cost, static, activation, stages, microbatches, schedule, "interval-dp")


def down_sets(problem: PartitionProblem, *, limit: int) -> np.ndarray | None:
    """Every set of blocks closed under predecessors that a stage boundary can leave behind.

    Rows of a (K, N) boolean matrix, by size (ties by the blocks' bit pattern, block 0
    lowest): the empty set first, all blocks last; sets holding the last block (the
    model's output) other than all blocks are left out.  None when there are more than
    ``limit``.  A chain has N + 1 (its prefixes).

    A down-set is its maximal elements (an antichain) and their ancestors, so the sets
    are counted lazily through ``nx.antichains``, which stops after ``limit`` however
    many there are.  The last block is a sink: dropping it leaves exactly the down-sets
    without it.

    >>> from partitioner.problem import PartitionProblem
    >>> p = PartitionProblem(time_s=(1.0,) * 3, static_bytes=(0,) * 3, activation_bytes=(0,) * 3,
    ...     allreduce_s=(0,) * 3, transfer_s=(0,) * 3, edges=((0, 2), (1, 2)))
    >>> down_sets(p, limit=10).astype(int).tolist()
    [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0], [1, 1, 1]]
    >>> down_sets(p, limit=4) is None
    True
    """
    n = problem.size
    graph = problem_graph(problem)
    graph.remove_node(n - 1)
    closed = {v: sum(1 << u for u in nx.ancestors(graph, v)) | 1 << v for v in graph}
    antichains = list(itertools.islice(nx.antichains(graph), limit))
    if len(antichains) + 1 > limit:  # + 1: all blocks
        return None
    found = [functools.reduce(operator.or_, (closed[v] for v in a), 0) for a in antichains]
    found = sorted(found, key=lambda d: (d.bit_count(), d)) + [(1 << n) - 1]
    return np.array([[(d >> v) & 1 for v in range(n)] for d in found], dtype=bool)


def solve_down_sets(
    problem: PartitionProblem,
    member: np.ndarray,
    *,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind = DEFAULT_SCHEDULE,
) -> Partition | None:
    """The best split over *every* topological order: stages are differences of nested down-sets.

    Every valid assignment (no edge backward) is a chain of down-sets, so the same
    bottleneck-enumerating DP over ``member``'s rows (from :func:`down_sets`) is exact
    for any DAG.  None when no split meets the memory limit.
    """
    if not 1 <= stages <= problem.size:
        return None
    cost, static, activation = _down_set_matrices(problem, member)
    return _best_split(problem, member, cost, static, activation, stages, microbatches, schedule, "down-set-dp")


def _down_set_matrices(problem: PartitionProblem, member: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like :func:`interval_matrices`, for stages ``D_b minus D_a`` with ``D_a`` strictly inside ``D_b``."""
    f = member.astype(float)
    inside = (f @ (~member).astype(float).T) == 0  # inside[a, b]: D_a is a subset of D_b
    sizes = member.sum(axis=1)
    nested = inside & (sizes[:, None] < sizes[None, :])

    def difference(values: tuple[float, ...]) -> np.ndarray:
        totals = f @ np.asarray(values, dtype=float)
        return totals[None, :] - totals[:, None]

    cost = difference(problem.time_s)
    static = difference(problem.static_bytes)
    activation = difference(problem.activation_bytes)
    for u, readers in problem_graph(problem).adj.items():
        if readers and problem.transfer_s[u] > 0:
            count = member[:, sorted(readers)].sum(axis=1)
            # u lies before the stage (in D_a) and one of its readers inside it.
            cost += problem.transfer_s[u] * (member[:, u][:, None] & (count[None, :] > count[:, None]))
    for nbytes, _, shared_readers in problem.shared:
        count = member[:, sorted(set(shared_readers))].sum(axis=1)
        static += nbytes * (count[None, :] > count[:, None])
    cost[~nested] = np.inf
    return cost, static, activation


def _best_split(
    problem: PartitionProblem,
    member: np.ndarray,
    cost: np.ndarray,
    static: np.ndarray,
    activation: np.ndarray,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind,
    name: str,
) -> Partition | None:
    """Enumerate the bottleneck cap over frontier pairs; ``member[k]``: blocks before frontier k."""
    start = time.perf_counter()
    masks = _memory_masks(problem, static, activation, stages, microbatches, schedule)
    feasible_cost = np.where(np.any(masks, axis=0), cost, np.inf)
    candidates = np.unique(feasible_cost[np.isfinite(feasible_cost)])
    if candidates.size == 0:
        return None
    # Smallest cap with any feasible split (binary search), and the least sum overall.
    unconstrained = _min_sum(cost, masks, member, stages, cap=np.inf)
    if unconstrained is None:
        return None
    lo, hi = 0, candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_sum(cost, masks, member, stages, cap=candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    min_sum = unconstrained[0]
    best: tuple[float, tuple[int, ...]] | None = None
    index = lo
    while index < candidates.size:
        cap = candidates[index]
        if best is not None and min_sum + (microbatches - 1) * cap + problem.allreduce_latency_s >= best[0] - 1e-15:
            break
        found = _min_sum(cost, masks, member, stages, cap=cap)
        assert found is not None  # caps from the smallest feasible one up are all feasible
        objective, _ = step_time(problem, found[1], microbatches=microbatches)
        if best is None or objective < best[0] - 1e-15:
            best = (objective, found[1])
        # The least sum only falls at some larger cap; every cap before that gives this split's
        # sum with a larger maximum, so jump (binary search) to where the sum first falls.
        index = _next_drop(cost, masks, member, stages, candidates, after=index, level=found[0])
    assert best is not None
    lower = min_sum + (microbatches - 1) * float(candidates[lo]) + problem.allreduce_latency_s
    return Partition(
        stage_of=best[1],
        stages=stages,
        objective=best[0],
        lower_bound=min(lower, best[0]),
        status="optimal",
        solver=name,
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
    """``masks[s, a, b]``: the stage between frontiers a and b fits in memory as stage s."""
    if problem.memory_limit is None:
        return np.ones((stages, *static.shape), dtype=bool)
    limit = problem.memory_limit * (1 + 1e-12)
    return np.stack(
        [
            static + in_flight(s, stages, microbatches, schedule) * activation <= limit
            for s in range(stages)
        ]
    )


def _next_drop(
    cost: np.ndarray,
    masks: np.ndarray,
    member: np.ndarray,
    stages: int,
    candidates: np.ndarray,
    *,
    after: int,
    level: float,
) -> int:
    """The first candidate index past ``after`` whose least sum is below ``level`` (or the end)."""
    lo, hi = after + 1, candidates.size
    while lo < hi:
        mid = (lo + hi) // 2
        found = _min_sum(cost, masks, member, stages, cap=candidates[mid])
        if found is not None and found[0] < level - 1e-12 * max(1.0, abs(level)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _min_sum(
    cost: np.ndarray, masks: np.ndarray, member: np.ndarray, stages: int, *, cap: float
) -> tuple[float, tuple[int, ...]] | None:
    """Least total stage time with every stage at most ``cap``; None if impossible.

    Frontier 0 is the empty set and the last frontier all blocks.
    """
    k = cost.shape[0]
    allowed = np.where(cost <= cap, cost, np.inf)
    best = np.full(k, np.inf)
    best[0] = 0.0
    choices = np.zeros((stages, k), dtype=np.int64)
    for s in range(stages):
        total = best[:, None] + np.where(masks[s], allowed, np.inf)  # (from frontier a, to b)
        choices[s] = np.argmin(total, axis=0)
        best = total[choices[s], np.arange(k)]
    if not np.isfinite(best[k - 1]):
        return None
    stage_of = np.zeros(member.shape[1], dtype=np.int64)
    end = k - 1
    for s in range(stages - 1, -1, -1):
        begin = int(choices[s, end])
        stage_of[member[end] & ~member[begin]] = s
        end = begin
    return float(best[k - 1]), tuple(int(s) for s in stage_of)
