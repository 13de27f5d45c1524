"""The interval DP (:func:`partitioner.interval.solve_intervals`) against brute force.

The reference (``_brute.brute_force_intervals``) tries every split of the
blocks, in their given order, into contiguous non-empty stages.  Without
all-reduce terms the DP is documented as exact, so objectives must agree to
rounding; with replicas it must still return a valid split no better than the
reference and a valid lower bound.
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

from partitioner.interval import down_sets, interval_matrices, solve_intervals
from partitioner.problem import (
    PartitionProblem,
    check_assignment,
    stage_costs,
    stage_memory,
    step_time,
)

REL = 1e-9
SEEDS = range(150)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


Case = _brute.Case


def make_case(seed: int, *, replicas: bool = False) -> Case:
    """Random problem: chains with skips mostly, some general DAGs, limits half the time."""
    return _brute.make_case(
        seed,
        sizes=(1, 8),
        kinds=("chain", "chain", "chain", "dag", "sparse"),
        several_ways=0.85,
        replicas=float(replicas),
        intervals=True,
    )


def assert_valid(case: Case, stage_of: tuple[int, ...]) -> None:
    problem, stages = case.problem, case.stages
    assert check_assignment(problem, stage_of, stages) is None
    assert all(a <= b for a, b in itertools.pairwise(stage_of)), "not contiguous intervals"
    assert _brute.fits(
        problem, stage_of, stages, microbatches=case.microbatches, schedule=case.schedule
    ), "memory limit exceeded"


@pytest.mark.parametrize("seed", SEEDS)
def test_matches_brute_force(seed: int) -> None:
    case = make_case(seed)
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
    assert got is not None, f"DP found nothing, brute force {expected}"
    assert close(got.objective, expected), (got, expected)
    assert_valid(case, got.stage_of)
    value, _ = step_time(case.problem, got.stage_of, microbatches=case.microbatches)
    assert close(value, got.objective)
    assert got.lower_bound <= got.objective * (1 + REL) + 1e-12
    assert got.lower_bound <= expected * (1 + REL) + 1e-12
    assert got.stages == case.stages
    assert got.status == "optimal"


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
