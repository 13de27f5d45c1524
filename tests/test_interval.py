"""The interval DP (:func:`partitioner.solve.interval.solve_intervals`) against brute force.

The reference (``_brute.brute_force_intervals``) tries every split of the
blocks, in their given order, into contiguous non-empty stages.  Without
all-reduce terms the DP is documented as exact, so objectives must agree to
rounding; with replicas it must still return a valid split no better than the
reference and a valid lower bound.  The same holds with per-stage
recomputation and node-crossing links, for the interval DP and the down-set DP
(against every assignment).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

import _brute
import numpy as np
import pytest

from partitioner.solve.interval import (
    down_sets,
    interval_matrices,
    solve_down_sets,
    solve_intervals,
)
from partitioner.solve.problem import (
    Partition,
    PartitionProblem,
    check_assignment,
    choose_recompute,
    stage_costs,
    stage_links,
    stage_memory,
    step_time,
)

REL = 1e-9
SEEDS = range(150)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


Case = _brute.Case


def make_case(seed: int, *, replicas: bool = False, rich: bool = False, orders: bool = False) -> Case:
    """Random problem: chains with skips mostly, some general DAGs, limits half the time.

    ``rich``: mostly with recomputation and often on several nodes (``_brute.RICH``).
    ``orders``: DAGs with several topological orders, limits drawn over every
    assignment (for the down-set DP).
    """
    return _brute.make_case(
        seed,
        sizes=(3, 7) if orders else (1, 8),
        kinds=("dag", "dag", "sparse") if orders else ("chain", "chain", "chain", "dag", "sparse"),
        several_ways=0.85,
        replicas=float(replicas),
        intervals=not orders,
        **(_brute.RICH if rich else {}),
    )


def assert_valid(case: Case, stage_of: tuple[int, ...]) -> None:
    problem, stages = case.problem, case.stages
    assert check_assignment(problem, stage_of, stages) is None
    assert all(a <= b for a, b in itertools.pairwise(stage_of)), "not contiguous intervals"
    assert _brute.fits(
        problem, stage_of, stages, microbatches=case.microbatches, schedule=case.schedule
    ), "memory limit exceeded"


def assert_priced_by_the_rule(case: Case, got: Partition) -> None:
    """The partition's recomputation is the rule's, and its objective the step time with it."""
    kw = {"microbatches": case.microbatches, "schedule": case.schedule}
    assert got.recompute == choose_recompute(case.problem, got.stage_of, case.stages, **kw)  # type: ignore[arg-type]
    value, _ = step_time(case.problem, got.stage_of, recompute=got.recompute, **kw)  # type: ignore[arg-type]
    assert close(value, got.objective)
    assert _brute.fits(case.problem, got.stage_of, case.stages, recompute=got.recompute, **kw)  # type: ignore[arg-type]


def assert_exact(case: Case, got: Partition | None, expected: float | None) -> None:
    """``got`` (a DP's answer) is None exactly when brute force finds nothing, else optimal and sound."""
    if expected is None:
        assert got is None
        return
    assert got is not None, f"DP found nothing, brute force {expected}"
    assert close(got.objective, expected), (got, expected)
    assert check_assignment(case.problem, got.stage_of, case.stages) is None
    assert_priced_by_the_rule(case, got)
    assert got.lower_bound <= got.objective * (1 + REL) + 1e-12
    assert got.lower_bound <= expected * (1 + REL) + 1e-12
    assert got.stages == case.stages
    assert got.status == "optimal"


def check_interval_dp(case: Case) -> None:
    kw = {"stages": case.stages, "microbatches": case.microbatches, "schedule": case.schedule}
    got = solve_intervals(case.problem, **kw)  # type: ignore[arg-type]
    assert_exact(case, got, _brute.brute_force_intervals(case.problem, **kw))  # type: ignore[arg-type]
    if got is not None:
        assert_valid(case, got.stage_of)


@pytest.mark.parametrize("seed", SEEDS)
def test_matches_brute_force(seed: int) -> None:
    check_interval_dp(make_case(seed))


@pytest.mark.parametrize("seed", range(1000, 1040))
def test_with_replicas_valid_and_bounded(seed: int) -> None:
    """With all-reduce terms the DP may miss the optimum, but never beats it or lies."""
    case = make_case(seed, replicas=True)
    expected = _brute.brute_force_intervals(
        case.problem,
        stages=case.stages,
        microbatches=case.microbatches,
        schedule=case.schedule,
    )
    got = solve_intervals(
        case.problem,
        stages=case.stages,
        microbatches=case.microbatches,
        schedule=case.schedule,
    )
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert_valid(case, got.stage_of)
    value, _ = step_time(case.problem, got.stage_of, microbatches=case.microbatches)
    assert close(value, got.objective)
    assert got.objective >= expected * (1 - REL)
    assert got.lower_bound <= expected * (1 + REL) + 1e-12


def test_generator_covers_infeasible_and_limited_cases() -> None:
    """The random cases above include infeasible limits, binding limits, and 1f1b."""
    infeasible = limited = onef1b = 0
    for seed in SEEDS:
        case = make_case(seed)
        limited += case.problem.memory_limit is not None
        onef1b += case.schedule == "1f1b"
        infeasible += (
            _brute.brute_force_intervals(
                case.problem,
                stages=case.stages,
                microbatches=case.microbatches,
                schedule=case.schedule,
            )
            is None
        )
    assert infeasible >= 10
    assert limited >= 50
    assert onef1b >= 50


# --------------------------------------------------------------------------- small cases


def chain(times: tuple[float, ...], **changes: object) -> PartitionProblem:
    n = len(times)
    problem = PartitionProblem(
        time_s=times,
        static_bytes=(0.0,) * n,
        activation_bytes=(0.0,) * n,
        allreduce_s=(0.0,) * n,
        transfer_s=(0.0,) * n,
        edges=tuple((i, i + 1) for i in range(n - 1)),
    )
    return dataclasses.replace(problem, **changes)  # type: ignore[arg-type]


def test_docstring_example() -> None:
    result = solve_intervals(chain((1.0, 1.0, 2.0)), stages=2, microbatches=4)
    assert result is not None
    assert result.stage_of == (0, 0, 1)
    assert result.objective == pytest.approx(4.0 + 3 * 2.0)


@pytest.mark.parametrize("stages", [0, 4, 5])
def test_stage_count_out_of_range(stages: int) -> None:
    assert solve_intervals(chain((1.0, 2.0, 3.0)), stages=stages, microbatches=2) is None


def test_one_block_per_stage() -> None:
    result = solve_intervals(chain((1.0, 2.0, 3.0)), stages=3, microbatches=2)
    assert result is not None and result.stage_of == (0, 1, 2)


def test_one_stage() -> None:
    result = solve_intervals(chain((1.0, 2.0, 3.0)), stages=1, microbatches=2)
    assert result is not None
    assert result.stage_of == (0, 0, 0)
    assert result.objective == pytest.approx(12.0)


def test_transfer_moves_the_cut() -> None:
    # Times 2, 2, 2, 2: the even cut after block 1 would be best, but sending
    # block 0's or 1's output costs 5, sending block 2's costs nothing.
    # Cut after 0: 2 | 11 -> 24; after 1: 4 | 9 -> 22; after 2: 6 | 2 -> 14.
    problem = chain((2.0, 2.0, 2.0, 2.0), transfer_s=(5.0, 5.0, 0.0, 0.0))
    result = solve_intervals(problem, stages=2, microbatches=2)
    assert result is not None
    assert result.stage_of == (0, 0, 0, 1)
    assert result.objective == pytest.approx(14.0)


def test_memory_limit_forces_uneven_split() -> None:
    # 4 blocks into 3 stages puts 2 blocks (20 bytes) on some stage:
    # infeasible under a 15-byte limit, feasible at exactly 20.
    problem = chain((1.0, 1.0, 1.0, 1.0), static_bytes=(10.0,) * 4, memory_limit=15.0)
    assert solve_intervals(problem, stages=3, microbatches=1) is None
    problem = dataclasses.replace(problem, memory_limit=20.0)
    result = solve_intervals(problem, stages=3, microbatches=1)
    assert result is not None and sorted(set(result.stage_of)) == [0, 1, 2]


def test_1f1b_memory_depends_on_stage() -> None:
    # 1f1b with P=2, M=4: stage 0 holds 2 micro-batches, stage 1 holds 1.
    # Activations 10 per block, limit 20: stage 0 may hold 1 block, stage 1 two.
    problem = chain((1.0, 1.0, 1.0), activation_bytes=(10.0,) * 3, memory_limit=20.0)
    result = solve_intervals(problem, stages=2, microbatches=4, schedule="1f1b")
    assert result is not None and result.stage_of == (0, 1, 1)
    # Under gpipe every stage holds 4: nothing fits.
    assert solve_intervals(problem, stages=2, microbatches=4, schedule="gpipe") is None


# --------------------------------------------------------------------------- matrices


@pytest.mark.parametrize("seed", range(20))
def test_interval_matrices_match_stage_costs(seed: int) -> None:
    """``cost[i, j]`` and ``static[i, j]`` are what stage [i, j) costs in a 3-way split."""
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    problem = _brute.random_problem(
        rng, n, kind=rng.choice(["chain", "dag", "sparse"]), shared=rng.random() < 0.5
    )
    cost, static, activation = interval_matrices(problem)
    assert cost.shape == static.shape == activation.shape == (n + 1, n + 1)
    no_activation = dataclasses.replace(problem, activation_bytes=(0.0,) * n)
    for i, j in itertools.product(range(n + 1), repeat=2):
        if j <= i:
            assert np.isinf(cost[i, j])
            continue
        stage_of = tuple(0 if v < i else 1 if v < j else 2 for v in range(n))
        times, _ = stage_costs(problem, stage_of, 3)
        assert cost[i, j] == pytest.approx(times[1], rel=1e-12, abs=1e-15)
        memory = stage_memory(no_activation, stage_of, 3, microbatches=1, schedule="gpipe")
        assert static[i, j] == pytest.approx(memory[1])
        assert activation[i, j] == pytest.approx(sum(problem.activation_bytes[i:j]))


# --------------------------------------------------------------------------- down-sets


def _down_sets_by_levels(problem: PartitionProblem) -> list[int]:
    """The enumeration ``down_sets`` replaced: grow every down-set one block at a time, level by level."""
    n = problem.size
    preds = [0] * n
    for u, v in problem.edges:
        preds[v] |= 1 << u
    full, last = (1 << n) - 1, 1 << (n - 1)
    level, found = {0}, [0]
    for _ in range(n):
        level = {d | (1 << v) for d in level for v in range(n) if not (d >> v) & 1 and not preds[v] & ~d}
        found.extend(sorted(d for d in level if d == full or not d & last))
    return found


@pytest.mark.parametrize("seed", range(60))
def test_down_sets_match_level_enumeration(seed: int) -> None:
    """Same sets in the same order (by size, then bit pattern) as the level-by-level enumeration."""
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    problem = _brute.random_problem(rng, n, kind=rng.choice(["chain", "dag", "sparse"]))
    expected = _down_sets_by_levels(problem)
    got = down_sets(problem, limit=len(expected))
    assert got is not None
    assert [sum(1 << v for v in range(n) if row[v]) for row in got] == expected
    assert down_sets(problem, limit=len(expected) - 1) is None


def test_down_sets_of_a_chain_are_its_prefixes() -> None:
    member = down_sets(chain((1.0,) * 5), limit=6)
    assert member is not None
    assert member.astype(int).tolist() == np.tri(6, 5, k=-1, dtype=int).tolist()


def test_down_sets_stop_at_the_limit_on_a_wide_graph() -> None:
    """40 independent blocks have 2**39 + 1 down-sets: counting stops lazily past the limit."""
    wide = dataclasses.replace(chain((1.0,) * 40), edges=())
    start = time.perf_counter()
    assert down_sets(wide, limit=2000) is None
    assert time.perf_counter() - start < 2.0


# --------------------------------------------------------------------------- recomputation and topology
#
# No all-reduce terms (the DPs are exact only without them); the all-reduce latency may
# still differ between stages (a constant of the stage count: every split has every stage).

RICH_SEEDS = range(2000, 2100)


@pytest.mark.parametrize("seed", RICH_SEEDS)
def test_matches_brute_force_with_recompute_and_topology(seed: int) -> None:
    check_interval_dp(make_case(seed, rich=True))


@pytest.mark.parametrize("seed", range(3000, 3100))
def test_down_set_dp_matches_brute_force_with_recompute_and_topology(seed: int) -> None:
    """Over every assignment (not only intervals of the given order)."""
    case = make_case(seed, rich=True, orders=True)
    kw = {"stages": case.stages, "microbatches": case.microbatches, "schedule": case.schedule}
    member = down_sets(case.problem, limit=1 << case.problem.size)
    assert member is not None
    got = solve_down_sets(case.problem, member, **kw)  # type: ignore[arg-type]
    assert_exact(case, got, _brute.brute_force(case.problem, **kw))  # type: ignore[arg-type]


def test_rich_cases_cover_recomputation_and_crossings() -> None:
    """The cases above recompute in some but not all stages, cross nodes, and are sometimes infeasible."""
    some_recompute = mixed = crossing = infeasible = modes = 0
    seen_modes = set()
    for seed in RICH_SEEDS:
        case = make_case(seed, rich=True)
        kw = {"stages": case.stages, "microbatches": case.microbatches, "schedule": case.schedule}
        best = _brute.brute_force_intervals_assignment(case.problem, **kw)  # type: ignore[arg-type]
        seen_modes.add(case.problem.recompute if case.problem.recompute_bytes is not None else "-")
        inbound, _ = stage_links(case.problem, case.stages)
        crossing += any(inbound) and case.problem.transfer_slow_s is not None
        if best is None:
            infeasible += 1
            continue
        rule = choose_recompute(case.problem, best[1], case.stages, microbatches=case.microbatches,
                                schedule=case.schedule)
        some_recompute += any(rule) and case.problem.recompute == "auto"
        mixed += any(rule) and not all(rule)
    modes = len(seen_modes)
    assert some_recompute >= 10
    assert mixed >= 5
    assert crossing >= 20
    assert infeasible >= 5
    assert modes == 4  # auto, none, full and no recomputation costs


recompute_chain = _brute.recompute_chain


def test_recompute_needed_in_stage_0_only() -> None:
    """1F1B, P = 2, M = 4: stage 0 holds 2 micro-batches in flight, stage 1 holds 1; limit 25.

    Cut after block 1: stage 0 keeps 2 x 20 = 40 > 25, recomputed 2 x 4 + 10 = 18: recomputes,
    3 s; stage 1 keeps 1 x 20 = 20: 2 s.  Step 5 + 3 x 3 = 14.
    Cut after block 0: stage 1 keeps 30 > 25, recomputed 6 + 10 = 16: 4.5 s; step 5.5 + 3 x 4.5 = 19.
    Cut after block 2: stage 0 keeps 60, recomputed 2 x 6 + 10 = 22: 4.5 s; step 19.
    """
    result = solve_intervals(recompute_chain(), stages=2, microbatches=4, schedule="1f1b")
    assert result is not None
    assert result.stage_of == (0, 0, 1, 1)
    assert result.recompute == (True, False)
    assert result.objective == pytest.approx(14.0)


def test_recompute_none_or_full_on_the_same_problem() -> None:
    # "none": no cut keeps every stage under 25 (40, 30, 60 on the fuller stage): infeasible.
    none = recompute_chain(recompute="none")
    assert solve_intervals(none, stages=2, microbatches=4, schedule="1f1b") is None
    # "full": both stages recompute; cut after 1: 3 | 3 s, step 6 + 3 x 3 = 15 (stage 1: 1 x 4 + 10 = 14).
    full = solve_intervals(recompute_chain(recompute="full"), stages=2, microbatches=4, schedule="1f1b")
    assert full is not None
    assert full.stage_of == (0, 0, 1, 1) and full.recompute == (True, True)
    assert full.objective == pytest.approx(15.0)


def test_infeasible_even_with_recompute() -> None:
    """Limit 15: cut after 1 recomputed needs 18 in stage 0; after 0, stage 1 needs 16; after 2, 22."""
    assert solve_intervals(recompute_chain(memory_limit=15.0), stages=2, microbatches=4, schedule="1f1b") is None


def test_topology_moves_the_cut_to_the_cheaper_crossing() -> None:
    """Two replicas per stage, two GPUs per node: stage 1 is on the other node, its inbound link crosses.

    Times 2 each, M = 4, transfers 0.1 intra-node; inter-node 5, 5, 0.5.
    One node: cut after 1 (4 | 4.1): 8.1 + 3 x 4.1 = 20.4, best.
    Two nodes: after 0: 2 | 11 -> 46; after 1: 4 | 9 -> 40; after 2: 6 | 2.5 -> 8.5 + 18 = 26.5, best.
    """
    one_node = chain((2.0,) * 4, transfer_s=(0.1, 0.1, 0.1, 0.0), transfer_slow_s=(5.0, 5.0, 0.5, 0.0), replicas=2)
    result = solve_intervals(one_node, stages=2, microbatches=4)
    assert result is not None and result.stage_of == (0, 0, 1, 1)
    assert result.objective == pytest.approx(20.4)
    two_nodes = dataclasses.replace(one_node, gpus_per_node=2)
    result = solve_intervals(two_nodes, stages=2, microbatches=4)
    assert result is not None and result.stage_of == (0, 0, 0, 1)
    assert result.objective == pytest.approx(26.5)


def test_topology_only_the_crossing_boundary_pays() -> None:
    """Three stages, one GPU each, two per node: boundary 0->1 stays on node 0, 1->2 crosses.

    Six blocks of 1 s, transfers 0.1 inside a node, 3 across except 0.2 after block 3: the
    crossing cut goes after block 3 (stages 2 | 2.1 | 2.2), the other where the balance is best.
    """
    problem = chain(
        (1.0,) * 6,
        transfer_s=(0.1,) * 6,
        transfer_slow_s=(3.0, 3.0, 3.0, 0.2, 3.0, 3.0),
        gpus_per_node=2,
    )
    assert stage_links(problem, 3)[0] == (False, False, True)
    result = solve_intervals(problem, stages=3, microbatches=4)
    assert result is not None
    assert result.stage_of == (0, 0, 1, 1, 2, 2)
    assert result.objective == pytest.approx(6.3 + 3 * 2.2)
