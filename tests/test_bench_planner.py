"""Smoke tests of the planner benchmark (``tools/benchplanner``): baseline splits and exact references (< 10 s).

The split functions are checked against brute force over every contiguous split;
the exact references (:func:`best_contiguous`, :func:`exact_split`) against
``_brute`` on small random problems.
"""

from __future__ import annotations

import itertools
import math
import random

import _brute
import pytest

from partitioner.solve.problem import PartitionProblem, check_assignment, step_time
from tools.benchplanner import baselines, reference, zoo


def contiguous_splits(n: int, stages: int):
    """Every split of n units into ``stages`` non-empty contiguous parts, as stage per unit."""
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield tuple(s for s in range(stages) for _ in range(bounds[s + 1] - bounds[s]))


def largest_part(weights, stage_of) -> float:
    totals: dict[int, float] = {}
    for w, s in zip(weights, stage_of):
        totals[s] = totals.get(s, 0.0) + w
    return max(totals.values())


def is_split(stage_of, n: int, stages: int) -> bool:
    return (
        len(stage_of) == n
        and stage_of[0] == 0
        and stage_of[-1] == stages - 1
        and all(b - a in (0, 1) for a, b in itertools.pairwise(stage_of))
    )


def test_equal_layers() -> None:
    assert baselines.equal_layers(10, 4) == (0, 0, 0, 1, 1, 1, 2, 2, 3, 3)
    assert baselines.equal_layers(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert baselines.equal_layers(3, 3) == (0, 1, 2)
    assert baselines.equal_layers(5, 1) == (0,) * 5
    for n in range(1, 12):
        for p in range(1, n + 1):
            split = baselines.equal_layers(n, p)
            assert is_split(split, n, p)
            sizes = [split.count(s) for s in range(p)]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        baselines.equal_layers(2, 3)


@pytest.mark.parametrize("seed", range(60))
def test_min_max_splits_are_optimal(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    p = rng.randint(1, n)
    weights = [rng.choice([rng.randint(0, 5), rng.uniform(0, 10)]) for _ in range(n)]
    best = min(largest_part(weights, s) for s in contiguous_splits(n, p))
    for fn in (baselines.min_max_split, baselines.equal_parameters, baselines.balance_by_time):
        split = fn(weights, p)
        assert is_split(split, n, p)
        assert math.isclose(largest_part(weights, split), best, rel_tol=1e-12, abs_tol=1e-12)


def test_min_max_ties_fill_from_the_left() -> None:
    # DeepSpeed's partition_balanced: every stage takes as much as the bottleneck allows.
    assert baselines.min_max_split([1, 1, 1, 1, 4], 2) == (0, 0, 0, 0, 1)
    assert baselines.min_max_split([2, 1, 1, 2], 3) == (0, 1, 1, 2)
    # The embedding and head (tied weight counted in both) dominate a parameter split.
    assert baselines.equal_parameters([100, 10, 10, 10, 10, 100], 3) == (0, 1, 1, 1, 1, 2)


def test_ideal_and_helpers() -> None:
    assert baselines.ideal_step([1.0, 2.0, 3.0], 3, 4) == pytest.approx(6 + 3 * 2)
    assert baselines.units_to_blocks((0, 0, 1), (0, 0, 1, 2, 2)) == (0, 0, 0, 1, 1)
    assert baselines.stage_sizes((0, 0, 0, 1, 1, 2)) == "3|2|1"
    assert zoo.unit_of_path("wpe", 4) == 0
    assert zoo.unit_of_path("blocks.3.attn.c_attn", 4) == 4
    assert zoo.unit_of_path("lm_head", 4) == 5
    assert zoo.unit_of_path("", 4) is None


def _problem(seed: int, kind: str) -> tuple[PartitionProblem, int, int]:
    case = _brute.make_case(
        seed,
        sizes=(2, 7),
        kinds=(kind,),
        schedules=("gpipe",),  # the references are GPipe only
        shared=0.5,
        transfers=1.0,
        intervals=kind == "chain",
    )
    return case.problem, case.stages, case.microbatches


@pytest.mark.parametrize("seed", range(40))
def test_best_contiguous_matches_brute_force(seed: int) -> None:
    problem, stages, microbatches = _problem(seed, "chain")
    want = _brute.brute_force_intervals(problem, stages=stages, microbatches=microbatches)
    got = reference.best_contiguous(problem, list(range(problem.size + 1)), stages, microbatches)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert check_assignment(problem, got[1], stages) is None
    assert math.isclose(got[0], step_time(problem, got[1], microbatches=microbatches)[0])
    assert math.isclose(got[0], want, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_exact_split_matches_brute_force(seed: int) -> None:
    problem, stages, microbatches = _problem(seed, ["chain", "dag", "sparse"][seed % 3])
    want = _brute.brute_force(problem, stages=stages, microbatches=microbatches)
    got = reference.exact_split(problem, stages, microbatches)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert check_assignment(problem, got[1], stages) is None
    assert math.isclose(got[0], want, rel_tol=1e-9, abs_tol=1e-12)


def test_whole_layer_split_only_cuts_between_units() -> None:
    rng = random.Random(7)
    problem = _brute.random_problem(rng, 8, kind="chain")
    units = (0, 0, 1, 1, 1, 2, 3, 3)
    got = reference.best_whole_layer_split(problem, units, 3, 4)
    assert got is not None
    for b in range(1, 8):
        if units[b] == units[b - 1]:
            assert got[1][b] == got[1][b - 1]
    best = min(
        step_time(problem, baselines.units_to_blocks(split, units), microbatches=4)[0]
        for split in contiguous_splits(4, 3)
    )
    assert math.isclose(got[0], best, rel_tol=1e-12)


def test_stage_sizes_runs_for_many_stages() -> None:
    split = baselines.equal_layers(98, 64)
    assert baselines.stage_sizes(split) == "2x34|1x30"
