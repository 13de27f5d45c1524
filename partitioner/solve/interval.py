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

What a candidate stage costs may depend on its index: under 1F1B it holds
fewer micro-batches the later it sits, its inbound link may cross nodes
(:func:`~partitioner.solve.problem.stage_links`), and whether it must recompute
(:func:`~partitioner.solve.problem.choose_recompute`: keep if that fits, else
recompute if that fits) follows from its blocks and its micro-batches in
flight.  So the DP keeps one cost matrix per distinct (in flight, link) pair
of stages, each entry the time of the option the rule picks (``inf`` where
neither fits), and stays exact: the rule is optimal stage by stage.

Selective recomputation (``layer_start``, "auto"): over intervals a stage ``[a, b)``
that recomputes its blocks ``[a, c)`` holds ``static + f (K[c] - K[a] + A[b] - A[c])
+ peak[a, c]`` (K, A: prefix sums of the kept inputs and of the activations, f its
micro-batches in flight), so it fits iff ``g[a, c] = f (K[c] - A[c]) + peak[a, c]``
is at most ``limit - static - f (A[b] - K[a])``.  The fewest layers that fit is the
first c where the running minimum of ``g[a, .]`` (over the layer starts) drops to that
level, found for every interval at once by a binary search along the rows.  The
down-set DP and the ILP price a stage as recomputing all its blocks or none
(:func:`all_or_nothing`); the rule's selective choice is applied to their split
afterwards (:func:`selective_again`), which only shortens stages, and their answer
is then no proven optimum.

Example::

    >>> from partitioner.solve.problem import PartitionProblem
    >>> p = PartitionProblem(time_s=(1.0, 1.0, 2.0), static_bytes=(0,) * 3,
    ...     activation_bytes=(0,) * 3, allreduce_s=(0,) * 3, transfer_s=(0,) * 3,
    ...     edges=((0, 1), (1, 2)))
    >>> solve_intervals(p, stages=2, microbatches=4).stage_of
    (0, 0, 1)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import time
from collections.abc import Callable
from typing import Any

import networkx as nx
import numpy as np

from partitioner.defaults import DEFAULT_SCHEDULE
from partitioner.solve.blockgraph import problem_graph
from partitioner.solve.problem import (
    MEMORY_TOLERANCE,
    Partition,
    PartitionProblem,
    ScheduleKind,
    allreduce_latencies,
    can_recompute,
    choose_recompute,
    in_flight,
    recompute_peak,
    stage_links,
    step_time,
)

__all__ = [
    "all_or_nothing",
    "down_sets",
    "interval_matrices",
    "selective_again",
    "simple_bound",
    "solve_down_sets",
    "solve_intervals",
]


@dataclasses.dataclass(frozen=True)
class _Frontiers:
    """For every pair of frontiers ``(a, b)``: what the stage between them costs.

    ``cost`` is ``inf`` where ``(a, b)`` is no stage.  The optional matrices are None
    when nothing needs them: ``cost_slow`` without an inbound link across nodes,
    ``kept``/``peak``/``extra`` without recomputation.
    """

    cost: np.ndarray  # compute + transfers in over the intra-node link
    cost_slow: np.ndarray | None  # compute + transfers in over the inter-node link
    static: np.ndarray
    activation: np.ndarray
    kept: np.ndarray | None  # bytes kept per micro-batch when recomputing (block inputs)
    peak: np.ndarray | None  # the largest block's activations
    extra: np.ndarray | None  # recomputation seconds
    # Intervals only, selective recomputation: where [a, c) cannot be a recomputed prefix (c <= a, or c no layer
    # start), and where [a, b) holds a layer start c with a < c < b.
    no_cut: np.ndarray | None = None
    has_cut: np.ndarray | None = None


def _needs(problem: PartitionProblem, stages: int) -> tuple[bool, bool]:
    """(some stage's inbound link is priced differently, some stage may recompute).

    ("auto" without a memory limit never recomputes: keeping always fits and is never slower.)
    """
    inbound, _ = stage_links(problem, stages)
    slow = problem.transfer_slow_s is not None and any(inbound)
    recompute = can_recompute(problem) and (problem.recompute == "full" or problem.memory_limit is not None)
    return slow, recompute


def _selective(problem: PartitionProblem) -> bool:
    """Can a stage recompute only some of its blocks (the rule of :func:`choose_recompute` may pick it)?"""
    return (problem.layer_start is not None and problem.recompute == "auto" and problem.memory_limit is not None
            and can_recompute(problem))


def all_or_nothing(problem: PartitionProblem) -> PartitionProblem:
    """``problem`` with each stage recomputing all its blocks or none (no ``layer_start``): the model of the
    down-set DP and the ILP."""
    return dataclasses.replace(problem, layer_start=None) if problem.layer_start is not None else problem


def selective_again(
    problem: PartitionProblem, partition: Partition | None, *, microbatches: int, schedule: ScheduleKind,
    lower_bound: float,
) -> Partition | None:
    """``partition`` (solved on :func:`all_or_nothing`'s problem) with ``problem``'s own recomputation rule.

    Where the rule recomputes fewer blocks of some stage the split is priced again (never
    slower) and is no proven optimum any more: status "feasible", ``lower_bound`` (a bound
    valid whatever each stage recomputes) at most the objective.
    """
    if partition is None or not _selective(problem):
        return partition
    chosen = choose_recompute(problem, partition.stage_of, partition.stages, microbatches=microbatches,
                              schedule=schedule)
    if chosen == partition.recompute and all(isinstance(r, bool) for r in chosen):
        return partition
    objective, _ = step_time(problem, partition.stage_of, microbatches=microbatches, schedule=schedule,
                             recompute=chosen)
    return dataclasses.replace(partition, recompute=chosen, objective=objective, status="feasible",
                               lower_bound=min(lower_bound, objective))


def interval_matrices(problem: PartitionProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(time, static, activation)`` of every interval ``[i, j)`` as (N+1, N+1) arrays.

    ``time`` includes the transfers the interval receives (over the intra-node
    link); entries with ``j <= i`` are ``inf`` / unused.
    """
    frontiers = _interval_frontiers(problem, slow=False, recompute=False)
    return frontiers.cost, frontiers.static, frontiers.activation


# The frontiers of the last few problems: the search solves one problem for many schedules and stage counts
# (dataclasses.replace keeps the fields that define them), so they are kept by those fields' identity.
_FRONTIERS: collections.OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], _Frontiers]] = collections.OrderedDict()
_FRONTIERS_KEPT = 32


def _interval_frontiers(problem: PartitionProblem, *, slow: bool, recompute: bool) -> _Frontiers:
    """:class:`_Frontiers` of the intervals ``[i, j)`` of the given order (kept for the problems solved last)."""
    p = problem
    fields = (p.time_s, p.static_bytes, p.shared, p.edges, p.transfer_s, p.transfer_slow_s, p.activation_bytes,
              p.recompute_bytes, p.recompute_s, p.recompute_peak_bytes, p.layer_start)
    # The fields are held with the entry, so no other object can take one of their ids while it is kept.
    key = (slow, recompute, _selective(p), *map(id, fields))
    kept = _FRONTIERS.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], fields, strict=True)):
        _FRONTIERS.move_to_end(key)
        return kept[1]
    frontiers = _build_interval_frontiers(problem, slow=slow, recompute=recompute)
    for field in dataclasses.fields(frontiers):
        array = getattr(frontiers, field.name)
        if isinstance(array, np.ndarray):
            array.flags.writeable = False  # shared by every solve of these fields
    _FRONTIERS[key] = (fields, frontiers)
    if len(_FRONTIERS) > _FRONTIERS_KEPT:
        _FRONTIERS.popitem(last=False)
    return frontiers


def _build_interval_frontiers(problem: PartitionProblem, *, slow: bool, recompute: bool) -> _Frontiers:
    n = problem.size

    def prefix_difference(values: tuple[float, ...]) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])
        return prefix[None, :] - prefix[:, None]

    compute = prefix_difference(problem.time_s)
    static = prefix_difference(problem.static_bytes)
    graph = problem_graph(problem)
    invalid = np.tril(np.ones((n + 1, n + 1), dtype=bool))

    def with_transfers(prices: tuple[float, ...]) -> np.ndarray:
        cost = compute.copy()
        for u, readers in graph.adj.items():
            if readers:
                _add_if_reader_inside(cost, sorted(readers), prices[u], lo=u + 1)
        cost[invalid] = np.inf
        return cost

    for nbytes, _, shared_readers in problem.shared:
        _add_if_reader_inside(static, sorted(set(shared_readers)), nbytes, lo=0)

    def largest() -> np.ndarray:  # peak[i, j] = max(recompute_peak[i:j]): running maxima along rows
        rows = np.where(np.tri(n + 1, n, k=-1, dtype=bool), 0.0, np.asarray(recompute_peak(problem), dtype=float))
        peak = np.zeros((n + 1, n + 1))
        peak[:, 1:] = np.maximum.accumulate(rows, axis=1)
        return peak

    frontiers = _assemble(problem, static, prefix_difference, with_transfers, largest, slow=slow, recompute=recompute)
    if recompute and frontiers.kept is not None and _selective(problem):
        assert problem.layer_start is not None
        starts = np.asarray((*problem.layer_start, False), dtype=bool)
        no_cut = ~np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1) | ~starts[None, :]
        # The first layer start after a, per row: [a, b) holds one iff it is below b.
        first = np.where(no_cut, n + 1, np.arange(n + 1)[None, :]).min(axis=1)
        frontiers = dataclasses.replace(frontiers, no_cut=no_cut, has_cut=first[:, None] < np.arange(n + 1)[None, :])
    return frontiers


def _assemble(
    problem: PartitionProblem,
    static: np.ndarray,
    difference: Callable[[tuple[float, ...]], np.ndarray],
    with_transfers: Callable[[tuple[float, ...]], np.ndarray],
    largest: Callable[[], np.ndarray],
    *,
    slow: bool,
    recompute: bool,
) -> _Frontiers:
    """:class:`_Frontiers` from how a layout sums block values over a stage, prices its transfers in,
    and finds its largest block activations; only the matrices ``slow`` and ``recompute`` need."""
    kept = peak = extra = None
    if recompute and problem.recompute_bytes is not None and problem.recompute_s is not None:
        kept, extra, peak = difference(problem.recompute_bytes), difference(problem.recompute_s), largest()
    cost_slow = None
    if slow and problem.transfer_slow_s is not None:
        cost_slow = with_transfers(problem.transfer_slow_s)
    return _Frontiers(
        cost=with_transfers(problem.transfer_s),
        cost_slow=cost_slow,
        static=static,
        activation=difference(problem.activation_bytes),
        kept=kept,
        peak=peak,
        extra=extra,
    )


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
    slow, recompute = _needs(problem, stages)
    frontiers = _interval_frontiers(problem, slow=slow, recompute=recompute)
    prefixes = np.tri(n + 1, n, k=-1, dtype=bool)  # row i: the first i blocks
    return _best_split(problem, prefixes, frontiers, stages, microbatches, schedule, "interval-dp")


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

    >>> from partitioner.solve.problem import PartitionProblem
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
    whole = all_or_nothing(problem)  # a stage recomputes all its blocks or none here (see the module docstring)
    slow, recompute = _needs(whole, stages)
    frontiers = _down_set_frontiers(whole, member, slow=slow, recompute=recompute)
    found = _best_split(whole, member, frontiers, stages, microbatches, schedule, "down-set-dp")
    if found is None:
        return None
    return selective_again(problem, found, microbatches=microbatches, schedule=schedule,
                           lower_bound=simple_bound(problem, stages, microbatches))


def simple_bound(problem: PartitionProblem, stages: int, microbatches: int) -> float:
    """A bound valid for any split: all work once, plus M-1 times an even share or the largest block.

    (Recomputation and transfers only add time; every stage pays at least its latency term.)
    """
    total = sum(problem.time_s)
    fixed = max(allreduce_latencies(problem, stages))
    return total + (microbatches - 1) * max(total / stages, max(problem.time_s)) + fixed


def _down_set_frontiers(
    problem: PartitionProblem, member: np.ndarray, *, slow: bool, recompute: bool
) -> _Frontiers:
    """Like :func:`_interval_frontiers`, for stages ``D_b minus D_a`` with ``D_a`` strictly inside ``D_b``."""
    f = member.astype(float)
    inside = (f @ (~member).astype(float).T) == 0  # inside[a, b]: D_a is a subset of D_b
    sizes = member.sum(axis=1)
    nested = inside & (sizes[:, None] < sizes[None, :])

    def difference(values: tuple[float, ...]) -> np.ndarray:
        totals = f @ np.asarray(values, dtype=float)
        return totals[None, :] - totals[:, None]

    compute = difference(problem.time_s)
    static = difference(problem.static_bytes)
    # received[u][a, b]: u lies before the stage (in D_a) and one of its readers inside it.
    received = {}
    for u, readers in problem_graph(problem).adj.items():
        if readers:
            count = member[:, sorted(readers)].sum(axis=1)
            received[u] = member[:, u][:, None] & (count[None, :] > count[:, None])

    def with_transfers(prices: tuple[float, ...]) -> np.ndarray:
        cost = compute.copy()
        for u, inbound in received.items():
            if prices[u] > 0:
                cost += prices[u] * inbound
        cost[~nested] = np.inf
        return cost

    for nbytes, _, shared_readers in problem.shared:
        count = member[:, sorted(set(shared_readers))].sum(axis=1)
        static += nbytes * (count[None, :] > count[:, None])

    def largest() -> np.ndarray:
        return _largest_in_difference(member, nested, np.asarray(recompute_peak(problem), dtype=float))

    return _assemble(problem, static, difference, with_transfers, largest, slow=slow, recompute=recompute)


def _largest_in_difference(member: np.ndarray, nested: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out[a, b]``: the largest ``values[v]`` over v in ``D_b minus D_a`` (0 if none), where ``nested``.

    Blocks by decreasing value: each pair takes the first value whose block it holds.
    """
    out = np.zeros(nested.shape)
    open_pairs = nested.copy()
    for v in np.argsort(-values, kind="stable"):
        if values[v] <= 0 or not open_pairs.any():
            break
        hit = open_pairs & np.outer(~member[:, v], member[:, v])
        out[hit] = values[v]
        open_pairs &= ~hit
    return out


def _best_split(
    problem: PartitionProblem,
    member: np.ndarray,
    frontiers: _Frontiers,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind,
    name: str,
) -> Partition | None:
    """Enumerate the bottleneck cap over frontier pairs; ``member[k]``: blocks before frontier k."""
    start = time.perf_counter()
    table, variant_of, candidates = _stage_tables(problem, frontiers, stages, microbatches, schedule)
    if candidates.size == 0:
        return None
    # The all-reduce latency of the stage that pays the most: every split has every stage.
    fixed = max(allreduce_latencies(problem, stages))
    # The least sum overall, and the smallest cap with any feasible split: the least possible largest stage
    # (a bottleneck DP over the same table; every finite entry is a candidate, so it is one of them).
    probes = _Probes(table, variant_of, member, candidates)
    unconstrained = probes.min_sum(np.inf)
    if unconstrained is None:
        return None
    lo = int(np.searchsorted(candidates, _min_max(table, variant_of), side="left"))
    min_sum_all = unconstrained[0]
    best: tuple[float, tuple[int, ...]] | None = None
    index = lo
    while index < candidates.size:
        cap = candidates[index]
        if best is not None and min_sum_all + (microbatches - 1) * cap + fixed >= best[0] - 1e-15:
            break
        found = probes.min_sum(float(cap))
        assert found is not None  # caps from the smallest feasible one up are all feasible
        objective, _ = step_time(problem, found[1], microbatches=microbatches, schedule=schedule)
        if best is None or objective < best[0] - 1e-15:
            best = (objective, found[1])
        # The least sum only falls at some larger cap; every cap before that gives this split's
        # sum with a larger maximum, so jump (binary search) to where the sum first falls, and
        # far enough to beat the best: at cap c >= the next candidate, the step is at least
        # sum + (M-1) c + fixed, so a sum of best - fixed - (M-1) next or more cannot win.
        level = _below(found[0])
        if index + 1 < candidates.size:
            level = min(level, -_below(-(best[0] - fixed - (microbatches - 1) * float(candidates[index + 1]))))
        # No cap's least sum is below the least sum overall: nothing left to find.
        index = candidates.size if level <= min_sum_all else probes.next_drop(after=index, level=level)
    assert best is not None
    lower = min_sum_all + (microbatches - 1) * float(candidates[lo]) + fixed
    return Partition(
        stage_of=best[1],
        stages=stages,
        objective=best[0],
        lower_bound=min(lower, best[0]),
        status="optimal",
        solver=name,
        wall_s=time.perf_counter() - start,
        recompute=choose_recompute(problem, best[1], stages, microbatches=microbatches, schedule=schedule),
    )


def _stage_tables(
    problem: PartitionProblem,
    frontiers: _Frontiers,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(table, variant_of, candidates)``: stage s between frontiers a and b takes ``table[variant_of[s], a, b]``.

    Stages that hold as many micro-batches and share a kind of inbound link cost the
    same, so there is one matrix per such variant, each entry the time of the option
    :func:`~partitioner.solve.problem.choose_recompute` picks (``inf``: no stage, or nothing
    fits).  ``candidates``: every finite entry, sorted, without repeats.
    """
    inbound, _ = stage_links(problem, stages)
    keys = [
        (in_flight(s, stages, microbatches, schedule, chunks=problem.chunks if problem.stage_rank else None),
         bool(inbound[s]) and frontiers.cost_slow is not None)
        for s in range(stages)
    ]
    variants = sorted(set(keys))
    variant_of = np.array([variants.index(k) for k in keys], dtype=np.int64)
    limit = None if problem.memory_limit is None else problem.memory_limit * (1 + MEMORY_TOLERANCE)
    recompute = frontiers.kept is not None
    everywhere = np.ones(frontiers.cost.shape, dtype=bool)
    nowhere = np.zeros(frontiers.cost.shape, dtype=bool)
    tables = []
    values: list[np.ndarray] = []
    used: dict[tuple[bool, bool], np.ndarray] = {}  # (slow link, recomputed): where some variant uses it
    unlimited: dict[bool, np.ndarray] = {}  # without a memory limit the micro-batches in flight change nothing
    for flight, slow in variants:
        if limit is None and slow in unlimited:
            tables.append(unlimited[slow])
            continue
        base = frontiers.cost_slow if slow and frontiers.cost_slow is not None else frontiers.cost
        keep = everywhere if limit is None else frontiers.static + flight * frontiers.activation <= limit
        redo = nowhere
        if recompute:
            assert frontiers.kept is not None and frontiers.peak is not None
            fits = everywhere if limit is None else (
                frontiers.static + flight * frontiers.kept + frontiers.peak <= limit
            )
            if problem.recompute == "full":
                keep, redo = nowhere, fits
            elif limit is not None:  # auto: recompute only where keeping does not fit
                redo = ~keep & fits
        table = np.where(keep, base, np.inf)
        if redo is not nowhere:
            assert frontiers.extra is not None
            table = np.where(redo, base + frontiers.extra, table)
        if frontiers.has_cut is not None and limit is not None:
            partial = _fewest_layers(frontiers, flight, limit, need=frontiers.has_cut & ~keep & np.isfinite(base))
            if partial is not None:  # takes precedence over recomputing every block: never slower
                rows, cols, extra = partial
                table[rows, cols] = base[rows, cols] + extra
                values.append(table[rows, cols])
        tables.append(table)
        if limit is None:
            unlimited[slow] = table
        for flag, where in ((False, keep), (True, redo)):
            if where is not nowhere:
                used[slow, flag] = used[slow, flag] | where if (slow, flag) in used else where
    for (slow, flag), where in used.items():
        base = frontiers.cost_slow if slow and frontiers.cost_slow is not None else frontiers.cost
        chosen = base[where] + (frontiers.extra[where] if flag and frontiers.extra is not None else 0.0)
        values.append(chosen[np.isfinite(chosen)])
    candidates = np.unique(np.concatenate(values)) if values else np.zeros(0)
    return np.stack(tables), variant_of, candidates


def _fewest_layers(
    frontiers: _Frontiers, flight: int, limit: float, *, need: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Intervals ``[a, b)`` of ``need`` where recomputing their first layers fits: (a's, b's, extra seconds).

    For each, the fewest leading blocks ``[a, c)``, c a layer start with ``a < c < b``
    (see the module docstring); None if there is nothing to look for.
    """
    assert frontiers.kept is not None and frontiers.peak is not None and frontiers.extra is not None
    assert frontiers.no_cut is not None
    rows, cols = np.nonzero(need)
    if rows.size == 0:
        return None
    kept, activation = frontiers.kept[0], frontiers.activation[0]  # prefix sums K and A
    g = flight * (kept - activation)[None, :] + frontiers.peak
    size = g.shape[1]
    g[frontiers.no_cut] = np.inf  # a < c, c a layer start
    running = np.minimum.accumulate(g, axis=1)  # non-increasing along each row
    level = limit - frontiers.static[rows, cols] - flight * (activation[cols] - kept[rows])
    lo, hi = rows + 1, cols  # the first c in [lo, hi) with running[a, c] <= level; hi: none
    while True:
        active = lo < hi
        if not active.any():
            break
        mid = np.minimum((lo + hi) // 2, size - 1)
        fits = running[rows, mid] <= level
        hi = np.where(active & fits, mid, hi)
        lo = np.where(active & ~fits, mid + 1, lo)
    found = lo < cols
    if not found.any():
        return None
    rows, cols, cut = rows[found], cols[found], lo[found]
    return rows, cols, frontiers.extra[rows, cut]


class _Probes:
    """:func:`_min_sum` at the candidate caps, each cap solved once, and what each answer says of other caps.

    The least sum is a non-increasing step function of the cap.  A split found at cap ``c`` whose
    largest stage is ``m`` is feasible at every cap in ``[m, c]``, and none there has a smaller
    sum, so the least sum is the same all along it: a search for where the sum drops knows it
    over that whole range (:meth:`next_drop`).
    """

    def __init__(self, table: np.ndarray, variant_of: np.ndarray, member: np.ndarray, candidates: np.ndarray) -> None:
        self.table, self.variant_of, self.member, self.candidates = table, variant_of, member, candidates
        self._found: dict[float, tuple[float, tuple[int, ...]] | None] = {}
        self._known: list[tuple[int, int, float]] = []  # (first, last candidate index, least sum there)

    def min_sum(self, cap: float) -> tuple[float, tuple[int, ...]] | None:
        """:func:`_min_sum` at ``cap`` (the sum and the split)."""
        if cap not in self._found:
            found = _min_sum(self.table, self.variant_of, self.member, cap=cap)
            self._found[cap] = None if found is None else found[:2]
            if found is not None:
                c = self.candidates
                last = c.size - 1 if cap == np.inf else int(np.searchsorted(c, cap, side="left"))
                self._known.append((int(np.searchsorted(c, found[2], side="left")), last, found[0]))
        return self._found[cap]

    def next_drop(self, *, after: int, level: float) -> int:
        """The first candidate index past ``after`` whose least sum is below ``level`` (or the end): a
        binary search over the indices the answers so far leave open."""
        lo, hi = after + 1, self.candidates.size
        for first, last, value in self._known:
            if value < level and last >= lo:
                hi = min(hi, max(first, lo))
            elif value >= level:
                lo = max(lo, last + 1)
        while lo < hi:
            mid = (lo + hi) // 2
            found = self.min_sum(float(self.candidates[mid]))
            if found is not None and found[0] < level:
                first, _, _ = self._known[-1] if self._known and self._known[-1][1] == mid else (mid, mid, 0.0)
                hi = max(min(mid, first), lo)
            else:
                lo = mid + 1
        return lo


def _below(value: float) -> float:
    """``value`` less a rounding margin (1e-12 relative): a sum must fall below this to count as smaller.

    >>> _below(1.0) < 1.0 < -_below(-1.0)
    True
    """
    return value - 1e-12 * max(1.0, abs(value))


def _min_sum(
    table: np.ndarray, variant_of: np.ndarray, member: np.ndarray, *, cap: float
) -> tuple[float, tuple[int, ...], float] | None:
    """Least total stage time with every stage at most ``cap``, the split and its largest stage; None if impossible.

    Frontier 0 is the empty set and the last frontier all blocks; stage s between
    frontiers a and b costs ``table[variant_of[s], a, b]``.  A stage ends past its start
    (``table`` is ``inf`` elsewhere) and leaves a frontier for each stage after it, so
    stage s looks only at ends ``(a, K - stages + s]``: the others reach no last frontier.
    """
    stages, k = variant_of.size, table.shape[1]
    best, offset = np.zeros(1), 0  # the least sums at frontiers offset, offset + 1, ... (inf: not reached)
    choices = np.zeros((stages, k), dtype=np.int64)
    for s in range(stages):
        reached = np.flatnonzero(best < np.inf)  # frontiers s stages can reach (few, early on)
        if reached.size == 0:
            return None
        lo, hi = offset + reached[0], offset + reached[-1] + 1
        # The ends stage s may reach (the last stage: the last frontier only).
        first, end = (lo + 1, k - stages + s + 1) if s < stages - 1 else (max(lo + 1, k - 1), k)
        if first >= end:
            return None
        block = table[variant_of[s], lo:hi, first:end]
        total = best[reached[0]:reached[-1] + 1, None] + np.where(block <= cap, block, np.inf)
        pick = total.argmin(axis=0)  # (from frontier lo + i, to first + j)
        choices[s, first:end] = lo + pick
        best, offset = total.min(axis=0), first
    if best[-1] == np.inf:
        return None
    stage_of = np.zeros(member.shape[1], dtype=np.int64)
    end = k - 1
    largest = -np.inf
    for s in range(stages - 1, -1, -1):
        begin = int(choices[s, end])
        stage_of[member[end] & ~member[begin]] = s
        largest = max(largest, float(table[variant_of[s], begin, end]))
        end = begin
    return float(best[-1]), tuple(int(s) for s in stage_of), largest


def _min_max(table: np.ndarray, variant_of: np.ndarray) -> float:
    """The least possible largest stage over every split (``inf`` if none): the smallest feasible cap of
    :func:`_min_sum`, by the same recurrence with max for + and no cap."""
    stages, k = variant_of.size, table.shape[1]
    best = np.full(k, np.inf)
    best[0] = -np.inf
    for s in range(stages):
        reached = np.flatnonzero(best < np.inf)
        if reached.size == 0:
            return np.inf
        lo, hi = reached[0], reached[-1] + 1
        first, end = lo + 1, k - stages + s + 1
        if first >= end:
            return np.inf
        block = np.maximum(best[lo:hi, None], table[variant_of[s], lo:hi, first:end])
        best = np.full(k, np.inf)
        best[first:end] = block.min(axis=0)
    return float(best[k - 1])
