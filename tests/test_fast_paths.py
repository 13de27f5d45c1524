"""The planner's fast paths against the plain computations they replace (issue 30: the whole layout space).

Each shortcut must give the same answer to the last bit, so the chosen plan cannot change:

* the interval DP's search over caps (a bottleneck DP for the smallest feasible cap, each cap's least
  sum solved once and known over a range of caps) against plain bisection over full-matrix DPs, for
  every schedule, the ones whose closed form the DP does not optimise included;
* :class:`~partitioner.solve.problem.RankPeaks` against a walk of each rank's order action by action;
* refinement's moves (``_Moves``) against :func:`~partitioner.schedule.refine.move_block`;
* a simulation without a timeline against one with it;
* a plan's parsed schedule kept with its actions; costs kept per graph, and not shared by a copy.
"""

from __future__ import annotations

import dataclasses
import math
import random

import _brute
import numpy as np
import pytest

from partitioner.defaults import splits_backward
from partitioner.orders import rank_orders
from partitioner.plan import example_plan
from partitioner.schedule.lower import compute_order, lower
from partitioner.schedule.refine import _Moves, move_block
from partitioner.schedule.simulate import simulate, simulate_schedule
from partitioner.search.layouts import schedule_problem
from partitioner.solve import interval
from partitioner.solve.formulate import GraphCosts, zero3_costs
from partitioner.solve.problem import (
    PartitionProblem,
    RankPeaks,
    ScheduleKind,
    _activations,
    _count,
    _split_parts,
    choose_recompute,
    rank_memory,
    stage_memory,
    step_time,
)

SEEDS = range(120)


# ------------------------------------------------------------------ the interval DP


def _plain_min_sum(table: np.ndarray, variant_of: np.ndarray, member: np.ndarray, cap: float
                   ) -> tuple[float, tuple[int, ...]] | None:
    """The least sum under ``cap`` by a DP over every frontier pair (what ``_min_sum`` restricts)."""
    stages, k = variant_of.size, table.shape[1]
    allowed = np.where(table <= cap, table, np.inf)
    best = np.full(k, np.inf)
    best[0] = 0.0
    choices = np.zeros((stages, k), dtype=np.int64)
    for s in range(stages):
        total = best[:, None] + allowed[variant_of[s]]
        pick = np.argmin(total, axis=0)
        choices[s] = pick
        best = total[pick, np.arange(k)]
    if not np.isfinite(best[k - 1]):
        return None
    stage_of = np.zeros(member.shape[1], dtype=np.int64)
    end = k - 1
    for s in range(stages - 1, -1, -1):
        begin = int(choices[s, end])
        stage_of[member[end] & ~member[begin]] = s
        end = begin
    return float(best[k - 1]), tuple(int(x) for x in stage_of)


def _plain_best_split(problem: PartitionProblem, stages: int, microbatches: int, schedule: ScheduleKind
                      ) -> tuple[float, tuple[int, ...]] | None:
    """The interval DP's search as first written: bisection for the smallest feasible cap, and for each drop."""
    n = problem.size
    slow, recompute = interval._needs(problem, stages)
    frontiers = interval._build_interval_frontiers(problem, slow=slow, recompute=recompute)
    member = np.tri(n + 1, n, k=-1, dtype=bool)
    table, variant_of, candidates = interval._stage_tables(problem, frontiers, stages, microbatches, schedule)
    if candidates.size == 0:
        return None
    fixed = max(interval.allreduce_latencies(problem, stages))
    unconstrained = _plain_min_sum(table, variant_of, member, np.inf)
    if unconstrained is None:
        return None
    lo, hi = 0, candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _plain_min_sum(table, variant_of, member, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    best: tuple[float, tuple[int, ...]] | None = None
    index = lo
    while index < candidates.size:
        cap = candidates[index]
        if best is not None and unconstrained[0] + (microbatches - 1) * cap + fixed >= best[0] - 1e-15:
            break
        found = _plain_min_sum(table, variant_of, member, cap)
        assert found is not None
        objective, _ = step_time(problem, found[1], microbatches=microbatches, schedule=schedule)
        if best is None or objective < best[0] - 1e-15:
            best = (objective, found[1])
        level = interval._below(found[0])
        if index + 1 < candidates.size:
            level = min(level, -interval._below(-(best[0] - fixed - (microbatches - 1) * float(candidates[index + 1]))))
        lo, hi = index + 1, candidates.size
        while lo < hi:
            mid = (lo + hi) // 2
            found = _plain_min_sum(table, variant_of, member, candidates[mid])
            if found is not None and found[0] < level:
                hi = mid
            else:
                lo = mid + 1
        index = lo
    return best


def _case(seed: int) -> tuple[PartitionProblem, int, int, ScheduleKind]:
    """A random problem of up to 24 blocks (recomputation, links, limits), under a random schedule."""
    rng = random.Random(seed)
    case = _brute.make_case(seed, sizes=(4, 24), kinds=("chain", "chain", "dag"), several_ways=0.9,
                            intervals=True, recompute=0.8, topology=0.6, limit=0.0)
    problem, n = case.problem, case.problem.size
    kind: ScheduleKind = rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b", "zbv", "zb-h1"])
    chunks = 2 if kind in ("interleaved-1f1b", "zbv") else 1
    ranks = rng.randint(1, max(1, min(6, n // chunks)))
    microbatches = ranks * rng.choice([1, 2, 4]) if kind == "interleaved-1f1b" else rng.choice([1, 2, 4, 8, 16])
    if rng.random() < 0.7:  # a limit from tight (often nothing fits, or only by recomputing) to loose
        whole = sum(problem.static_bytes) + sum(b for b, _, _ in problem.shared) + microbatches * sum(problem.activation_bytes)
        problem = dataclasses.replace(problem, memory_limit=whole * rng.uniform(0.1, 1.2) / (ranks * chunks))
    return schedule_problem(problem, kind, ranks, chunks), ranks * chunks, microbatches, kind


@pytest.mark.parametrize("seed", SEEDS)
def test_interval_search_matches_plain_bisection(seed: int) -> None:
    problem, stages, microbatches, kind = _case(seed)
    got = interval.solve_intervals(problem, stages=stages, microbatches=microbatches, schedule=kind)
    expected = _plain_best_split(problem, stages, microbatches, kind)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.objective, got.stage_of) == expected  # to the last bit: the same split, the same step


@pytest.mark.parametrize("seed", SEEDS)
def test_min_sum_and_min_max_match_full_dps(seed: int) -> None:
    problem, stages, microbatches, kind = _case(seed)
    n = problem.size
    slow, recompute = interval._needs(problem, stages)
    frontiers = interval._interval_frontiers(problem, slow=slow, recompute=recompute)
    member = np.tri(n + 1, n, k=-1, dtype=bool)
    table, variant_of, candidates = interval._stage_tables(problem, frontiers, stages, microbatches, kind)
    feasible = [c for c in candidates if _plain_min_sum(table, variant_of, member, c) is not None]
    assert interval._min_max(table, variant_of) == (feasible[0] if feasible else math.inf)
    for cap in [*candidates[:: max(1, candidates.size // 12)], np.inf]:
        plain = _plain_min_sum(table, variant_of, member, cap)
        fast = interval._min_sum(table, variant_of, member, cap=cap)
        assert (None if fast is None else fast[:2]) == plain
        if fast is not None:  # its largest stage is a candidate, at most the cap, and the split feasible there
            assert fast[2] in candidates and fast[2] <= cap
            assert _plain_min_sum(table, variant_of, member, fast[2]) == plain


def test_frontiers_are_kept_per_problem_fields_and_read_only() -> None:
    problem, stages, _, _ = _case(3)
    slow, recompute = interval._needs(problem, stages)
    first = interval._interval_frontiers(problem, slow=slow, recompute=recompute)
    again = interval._interval_frontiers(dataclasses.replace(problem, memory_limit=problem.memory_limit),
                                         slow=slow, recompute=recompute)
    assert again is first
    assert not first.cost.flags.writeable
    other = dataclasses.replace(problem, time_s=tuple(2 * t for t in problem.time_s))
    assert interval._interval_frontiers(other, slow=slow, recompute=recompute) is not first


# ------------------------------------------------------------------ memory by rank


def _walked(problem: PartitionProblem, stage_of: tuple[int, ...], stages: int, microbatches: int,
            schedule: ScheduleKind, recompute: tuple[bool | int, ...]) -> list[float]:
    """Each rank's peak by walking its order one action at a time (rank_memory as first written)."""
    per_stage = stage_memory(problem, stage_of, stages, microbatches=microbatches, schedule=schedule,
                             recompute=recompute)
    if problem.stage_rank is None and schedule in ("gpipe", "1f1b"):
        return per_stage
    rank = problem.stage_rank or tuple(range(stages))
    ranks = max(rank) + 1
    split = _split_parts(problem, stage_of, stages)
    keep, live = zip(*(_activations(problem, split, s, _count(recompute[s], len(split.blocks[s])))
                       for s in range(stages)), strict=True)
    frees = "W" if splits_backward(schedule) else "B"
    out = []
    for r, row in enumerate(rank_orders(schedule, ranks=ranks, microbatches=microbatches, chunks=stages // ranks)):
        held = most = 0.0
        for s, kind, _ in row:
            if kind == "F":
                held += keep[s]
                most = max(most, held)
            elif kind == "B":
                most = max(most, held + live[s])
            if kind == frees:
                held -= keep[s]
        out.append(sum(split.static[s] for s in range(stages) if rank[s] == r) + most)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_rank_peaks_match_a_walk_of_each_order(seed: int) -> None:
    problem, stages, microbatches, kind = _case(seed)
    found = interval.solve_intervals(dataclasses.replace(problem, memory_limit=None), stages=stages,
                                     microbatches=microbatches, schedule=kind)
    if found is None:
        return
    recompute = choose_recompute(problem, found.stage_of, stages, microbatches=microbatches, schedule=kind)
    expected = _walked(problem, found.stage_of, stages, microbatches, kind, recompute)
    assert rank_memory(problem, found.stage_of, stages, microbatches=microbatches, schedule=kind,
                       recompute=recompute) == expected
    peaks = RankPeaks(problem, found.stage_of, stages, microbatches=microbatches, schedule=kind)
    assert [peaks.rank(r, recompute) for r in range(peaks.ranks)] == expected


# ------------------------------------------------------------------ refinement's moves


@pytest.mark.parametrize("seed", range(40))
def test_moves_match_move_block(seed: int) -> None:
    rng = random.Random(seed)
    n, stages = rng.randint(2, 30), rng.randint(1, 8)
    stages = min(stages, n)
    split = [*range(stages), *(rng.randrange(stages) for _ in range(n - stages))]
    rng.shuffle(split)
    moves = _Moves(tuple(split), stages)
    for a in range(stages):
        for b in range(stages):
            if a != b:
                assert moves.move(a, b) == move_block(tuple(split), a, b), (split, a, b)


# ------------------------------------------------------------------ simulation without a timeline


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"])
def test_simulation_without_timeline_gives_the_same_numbers(kind: str) -> None:
    rng = random.Random(kind)
    ranks, chunks = 3, 2 if kind in ("interleaved-1f1b", "zbv") else 1
    stages = ranks * chunks
    where = tuple(s % ranks for s in range(stages)) if kind == "interleaved-1f1b" else \
        tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(stages))
    chain = {"sends_to": tuple((s + 1,) if s + 1 < stages else () for s in range(stages)),
             "receives_from": tuple((s - 1,) if s else () for s in range(stages))}
    schedule = lower(compute_order(kind, ranks=ranks, microbatches=6, chunks=chunks), stage_rank=where, **chain)
    numbers = {
        "forward_s": [rng.uniform(0.5, 2) for _ in range(stages)],
        "backward_s": [rng.uniform(1, 4) for _ in range(stages)],
        "transfer_s": rng.uniform(0, 0.5), "allreduce_s": [rng.uniform(0, 2) for _ in range(stages)],
        "static_bytes": [rng.uniform(1, 9) for _ in range(stages)],
        "activation_bytes": [rng.uniform(1, 5) for _ in range(stages)],
        "backward_bytes": [rng.uniform(0, 3) for _ in range(stages)], "buckets": 2, "message_host_s": 0.01,
    }
    numbers["weight_s"] = [b * rng.uniform(0.2, 0.5) for b in numbers["backward_s"]]
    for jitter in (0.0, 0.1):
        full = simulate_schedule(schedule, stage_rank=where, jitter=jitter, samples=5, **chain, **numbers)
        lean = simulate_schedule(schedule, stage_rank=where, jitter=jitter, samples=5, timeline=False,
                                 **chain, **numbers)
        assert full.events and full.memory and not lean.events and not lean.memory
        for field in ("step_s", "rank_end_s", "busy_s", "peak_in_flight", "peak_memory_bytes"):
            assert getattr(lean, field) == getattr(full, field), field


def test_plan_simulates_alike_without_timeline() -> None:
    plan = example_plan()
    full, lean = simulate(plan), simulate(plan, timeline=False)
    assert (lean.step_s, lean.busy_s, lean.peak_memory_bytes) == (full.step_s, full.busy_s, full.peak_memory_bytes)


# ------------------------------------------------------------------ kept values


def test_a_lowered_schedule_is_kept_with_its_plans_actions() -> None:
    plan = example_plan()
    parsed = plan.schedule_data()
    assert plan.schedule_data() is parsed  # parsed once
    lowered = dataclasses.replace(plan, actions=()).with_schedule(parsed)
    assert lowered.actions == plan.actions
    assert lowered.schedule_data() is parsed  # kept, not parsed again
    edited = dataclasses.replace(plan, actions=tuple(tuple(row) for row in plan.actions))
    assert edited.schedule_data() == parsed and edited.schedule_data() is not parsed


def _graph(time: float) -> GraphCosts:
    return GraphCosts(
        blocks=(("a",), ("b",)), node_time_s={"a": time, "b": 1.0}, node_forward_s={"a": time / 3, "b": 0.3},
        node_saved_bytes={"a": 100, "b": 50}, node_output_bytes={"a": 10, "b": 10},
        parameter_bytes={"layers.0.w": 4000, "layers.1.w": 4000}, block_parameters=(("layers.0.w",), ("layers.1.w",)),
        edges=((0, 1),), block_sends=(10, 0), parameter_elements={"layers.0.w": 1000, "layers.1.w": 1000})


def test_costs_kept_per_graph_are_not_shared_by_a_copy() -> None:
    from partitioner.cost.devices import DEVICES

    graph = _graph(3.0)
    assert graph.saved_bytes(graph.blocks[0]) == 100.0
    twice = dataclasses.replace(graph, node_saved_bytes={"a": 200, "b": 50})
    assert twice.saved_bytes(twice.blocks[0]) == 200.0  # the copy counts its own
    kw = {"dp": 4, "spec": DEVICES["h100"], "precision": "bf16-mixed", "gpus_per_node": 8}
    kept = zero3_costs(graph, **kw)
    assert zero3_costs(graph, **kw) is kept
    assert zero3_costs(graph, **{**kw, "dp": 2}) != kept
    slower = dataclasses.replace(graph, node_time_s={"a": 30.0, "b": 1.0}, node_forward_s={"a": 10.0, "b": 0.3})
    assert zero3_costs(slower, **kw) is not kept
