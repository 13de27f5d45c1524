"""Exact reference splits: the best contiguous split and the best split over every valid assignment.

The independent check of the product's solver, so it shares none of its code:
:mod:`partitioner.solve.interval` and :mod:`partitioner.solve.ilp` (min-plus recurrences over
block intervals and down-sets, an ILP) are what the benchmark measures, and a
reference built from them would repeat any mistake in them — how a stage's
transfers are charged, which down-sets are enumerated, when a cap is skipped — and
agree with it.  This module states the same problem a second way (dense
state-to-state cost matrices, over interval cuts or over down-sets as bit masks,
and one bottleneck-capped path DP for both) and only shares the problem's
*definition*: the :class:`~partitioner.solve.problem.PartitionProblem` data and
:func:`partitioner.solve.problem.step_time`, which every returned split is re-evaluated
with.  ``tests/test_bench_planner.py`` checks both functions against brute force.

>>> import numpy as np
>>> cost = np.array([[np.inf, 1.0, 3.0], [np.inf, np.inf, 2.0], [np.inf, np.inf, np.inf]])
>>> chain_dp(cost, stages=2, microbatches=4)  # 0 -> 1 -> 2: 1 + 2 + 3 * max(1, 2)
(9.0, [0, 1, 2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MAX_DOWN_SETS",
    "best_contiguous",
    "best_whole_layer_split",
    "chain_dp",
    "down_sets",
    "evaluate",
    "exact_split",
    "interval_cost",
]

MAX_DOWN_SETS = 5000


def chain_dp(
    cost: np.ndarray,
    stages: int,
    microbatches: int,
    masks: np.ndarray | None = None,
) -> tuple[float, list[int]] | None:
    """Least ``sum + (M-1) max`` over paths ``0 = k_0 -> k_1 -> ... -> k_P = K-1`` of states.

    ``cost[a, b]`` is the time of a stage that goes from state a to state b (``inf`` where
    not allowed); ``masks[s, a, b]`` (optional) whether that stage fits in memory as stage
    s.  Exact: for each cap T the DP finds the least sum with every stage at most T; the
    least sum is a non-increasing step function of T and the optimum sits at the left end
    of a step, which bisection over the sorted caps finds without trying every cap.
    Returns (objective, states on the path) or None when no path exists.
    """
    k = cost.shape[0]
    if masks is None:
        masks = np.ones((stages, k, k), dtype=bool)
    usable = np.where(np.any(masks, axis=0), cost, np.inf)
    caps = np.unique(usable[np.isfinite(usable)])
    if caps.size == 0:
        return None

    def min_sum(cap: float) -> tuple[float, float, list[int]] | None:
        allowed = np.where(cost <= cap, cost, np.inf)
        best = np.full(k, np.inf)
        best[0] = 0.0
        worst = np.full(k, 0.0)  # max stage time along the chosen path
        choice = np.zeros((stages, k), dtype=np.int64)
        for s in range(stages):
            total = best[:, None] + np.where(masks[s], allowed, np.inf)
            choice[s] = np.argmin(total, axis=0)
            rows = choice[s]
            new_best = total[rows, np.arange(k)]
            worst = np.maximum(
                worst[rows], np.where(np.isfinite(new_best), allowed[rows, np.arange(k)], 0.0)
            )
            best = new_best
        if not np.isfinite(best[k - 1]):
            return None
        path = [k - 1]
        for s in range(stages - 1, -1, -1):
            path.append(int(choice[s, path[-1]]))
        path.reverse()
        return float(best[k - 1]), float(worst[k - 1]), path

    unconstrained = min_sum(np.inf)
    if unconstrained is None:
        return None
    floor = unconstrained[0]
    if microbatches == 1:
        return unconstrained[0], unconstrained[2]
    lo, hi = 0, caps.size - 1
    while lo < hi:  # least feasible cap
        mid = (lo + hi) // 2
        if min_sum(float(caps[mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    found: dict[int, tuple[float, float, list[int]]] = {}
    best: list[Any] = [math.inf, None]

    def evaluate(i: int) -> float:
        if i not in found:
            r = min_sum(float(caps[i]))
            assert r is not None
            found[i] = r
            value = r[0] + (microbatches - 1) * r[1]
            if value < best[0]:
                best[0], best[1] = value, r[2]
        return found[i][0]

    evaluate(lo)
    limit = (best[0] - floor) / (microbatches - 1)
    top = int(np.searchsorted(caps, limit, side="right")) - 1
    top = max(lo, min(top, caps.size - 1))
    evaluate(top)
    tol = 1e-12

    def bisect(i: int, j: int) -> None:
        si, sj = evaluate(i), evaluate(j)
        if j - i <= 1 or si - sj <= tol * abs(si):
            return  # the least sum is the same across (i, j]: cap i is at least as good
        if sj + (microbatches - 1) * float(caps[i + 1]) >= best[0]:
            return  # nothing in (i, j] can beat the best found
        mid = (i + j) // 2
        evaluate(mid)
        bisect(i, mid)
        bisect(mid, j)

    bisect(lo, top)
    return float(best[0]), list(best[1])


def interval_cost(problem: Any, cuts: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage time, static and activation bytes of every interval ``[cuts[a], cuts[b])`` of the blocks.

    Written independently of :mod:`partitioner.solve.interval`: compute of the blocks plus,
    once per block u before the interval, u's transfer if any reader of u is inside.
    """
    k = len(cuts)
    t = np.concatenate([[0.0], np.cumsum(problem.time_s)])
    st = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
    ac = np.concatenate([[0.0], np.cumsum(problem.activation_bytes)])
    c = np.asarray(cuts)
    cost = t[c][None, :] - t[c][:, None]
    static = st[c][None, :] - st[c][:, None]
    act = ac[c][None, :] - ac[c][:, None]
    readers: dict[int, list[int]] = {}
    for u, v in problem.edges:
        readers.setdefault(u, []).append(v)

    def add_if_inside(matrix: np.ndarray, inside: Sequence[int], amount: float, after: int) -> None:
        # Intervals [lo, hi) with lo > after that hold one of ``inside``: the first one at or
        # after lo must come before hi.
        rs = np.unique(np.asarray(inside))
        for a in range(k):
            if cuts[a] <= after:
                continue
            pos = int(np.searchsorted(rs, cuts[a]))
            if pos < rs.size:
                matrix[a, c > rs[pos]] += amount

    for u, vs in readers.items():
        if problem.transfer_s[u] > 0:
            add_if_inside(cost, vs, problem.transfer_s[u], after=u)
    for nbytes, _, rs in problem.shared:
        add_if_inside(static, rs, nbytes, after=-1)
    invalid = ~np.triu(np.ones((k, k), dtype=bool), 1)
    cost[invalid] = np.inf
    return cost, static, act


def _masks(
    problem: Any, static: np.ndarray, act: np.ndarray, stages: int, microbatches: int
) -> np.ndarray | None:
    if problem.memory_limit is None:
        return None
    limit = problem.memory_limit * (1 + 1e-12)
    # GPipe: every stage holds all M micro-batches' activations.
    fits = static + microbatches * act <= limit
    return np.broadcast_to(fits, (stages, *fits.shape))


def best_contiguous(
    problem: Any, cuts: Sequence[int], stages: int, microbatches: int
) -> tuple[float, tuple[int, ...]] | None:
    """Exact best split of the blocks into stages that start only at ``cuts`` (0 first, N last)."""
    if stages > len(cuts) - 1:
        return None
    cost, static, act = interval_cost(problem, cuts)
    found = chain_dp(cost, stages, microbatches, _masks(problem, static, act, stages, microbatches))
    if found is None:
        return None
    _, path = found
    stage_of = [0] * problem.size
    for s in range(stages):
        stage_of[cuts[path[s]] : cuts[path[s + 1]]] = [s] * (cuts[path[s + 1]] - cuts[path[s]])
    return evaluate(problem, stage_of, microbatches), tuple(stage_of)


def best_whole_layer_split(
    problem: Any, unit_of_block: Sequence[int], stages: int, microbatches: int
) -> tuple[float, tuple[int, ...]] | None:
    """Exact least ``step_time`` over contiguous splits of whole units (stage per block)."""
    cuts = (
        [0]
        + [b for b in range(1, problem.size) if unit_of_block[b] != unit_of_block[b - 1]]
        + [problem.size]
    )
    return best_contiguous(problem, cuts, stages, microbatches)


def down_sets(problem: Any, limit: int = MAX_DOWN_SETS) -> list[int] | None:
    """Every set of blocks closed under predecessors (as bit masks, by size), or None if > limit."""
    n = problem.size
    preds = [0] * n
    for u, v in problem.edges:
        preds[v] |= 1 << u
    level = {0}
    out = [0]
    for _ in range(n):
        nxt: set[int] = set()
        for d in level:
            for v in range(n):
                if not (d >> v) & 1 and not preds[v] & ~d:
                    nxt.add(d | (1 << v))
        out.extend(sorted(nxt))
        if len(out) > limit:
            return None
        level = nxt
    return out


def exact_split(
    problem: Any, stages: int, microbatches: int, limit: int = MAX_DOWN_SETS
) -> tuple[float, tuple[int, ...]] | None:
    """Least ``step_time`` over every valid assignment (no edge backward, no stage empty, the
    last block in the last stage, memory within the limit), by a DP over down-sets.

    Exact for any DAG; practical while the number of down-sets is small.  Only for
    problems without all-reduce terms (one replica).  None when there are too many
    down-sets or no valid assignment.
    """
    if any(a > 0 for a in problem.allreduce_s) or any(s[1] > 0 for s in problem.shared):
        raise ValueError("exact_split handles one replica only (no all-reduce terms)")
    sets = down_sets(problem, limit)
    if sets is None:
        return None
    n = problem.size
    full = (1 << n) - 1
    last = 1 << (n - 1)
    # Intermediate boundaries must leave the last block (the model's output) for the last stage.
    sets = [d for d in sets if d == full or not d & last]
    member = np.array([[(d >> v) & 1 for v in range(n)] for d in sets], dtype=bool)
    f = member.astype(np.float64)
    subset = (f @ (~member).astype(np.float64).T) == 0  # subset[a, b]: D_a within D_b
    sizes = member.sum(axis=1)
    strict = subset & (sizes[:, None] < sizes[None, :])
    t = f @ np.asarray(problem.time_s, dtype=float)
    cost = t[None, :] - t[:, None]
    st = f @ np.asarray(problem.static_bytes, dtype=float)
    ac = f @ np.asarray(problem.activation_bytes, dtype=float)
    static = st[None, :] - st[:, None]
    act = ac[None, :] - ac[:, None]
    readers: dict[int, list[int]] = {}
    for u, v in problem.edges:
        readers.setdefault(u, []).append(v)
    for u, vs in readers.items():
        if problem.transfer_s[u] <= 0:
            continue
        count = member[:, sorted(set(vs))].sum(axis=1)
        # u sits before the stage (in D_a) and a reader of u inside it (more readers in D_b).
        cost += problem.transfer_s[u] * (member[:, u][:, None] & (count[None, :] > count[:, None]))
    for nbytes, _, rs in problem.shared:
        count = member[:, sorted(set(rs))].sum(axis=1)
        static += nbytes * (count[None, :] > count[:, None])
    cost[~strict] = np.inf
    found = chain_dp(cost, stages, microbatches, _masks(problem, static, act, stages, microbatches))
    if found is None:
        return None
    _, path = found
    stage_of = [0] * n
    for s in range(stages):
        inside = member[path[s + 1]] & ~member[path[s]]
        for v in np.flatnonzero(inside):
            stage_of[v] = s
    return evaluate(problem, stage_of, microbatches), tuple(stage_of)


def evaluate(problem: Any, stage_of: Sequence[int], microbatches: int) -> float:
    """GPipe step time of ``stage_of``: the product's own objective, the thing both optimise."""
    from partitioner.solve.problem import step_time

    return step_time(problem, stage_of, microbatches=microbatches)[0]
