"""``solve`` and ``solve_ilp`` against brute force over every topological assignment.

The reference (``_brute.brute_force``) tries all ``P**N`` assignments of blocks
to stages, keeps those where no edge goes backward, no stage is empty and every
stage fits in memory, and returns the least closed-form step time.  Both
solvers must reach it (to rounding) and report a valid assignment and a valid
lower bound.

The tests at the end (``test_bug_*``) pin down solver bugs found while writing
these; they fail until the solver is fixed.

The same holds with per-stage recomputation (auto, none, full) and links that
cross nodes (``test_*_with_recompute_and_topology`` and the hand-computed cases
after it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import _brute
import pytest

from partitioner.solve.ilp import is_chain, solve, solve_ilp
from partitioner.solve.interval import solve_intervals
from partitioner.solve.problem import (
    Partition,
    PartitionProblem,
    check_assignment,
    choose_recompute,
    stage_links,
    stage_memory,
    step_time,
)

REL = 1e-9
ROOT = Path(__file__).resolve().parents[1]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


Case = _brute.Case


def make_case(seed: int, *, rich: bool = False) -> Case:
    """A random small DAG: general, sparse, or a chain with skips; limits, sharing, replicas.

    ``rich``: mostly with recomputation and often on several nodes (``_brute.RICH``).
    """
    chances: _brute.Chances = _brute.RICH if rich else {"limit": 0.4}
    return _brute.make_case(
        seed,
        sizes=(3, 7),
        kinds=("dag", "dag", "sparse", "sparse", "chain"),
        replicas=0.3,
        intervals=False,
        **chances,
    )


def assert_sound(case: Case, result: Partition, expected: float) -> None:
    """Valid, fits, objective is its own step time, equals the optimum, bound below it."""
    problem, stages, microbatches = case.problem, case.stages, case.microbatches
    assert result.stages == stages
    assert check_assignment(problem, result.stage_of, stages) is None
    memory = stage_memory(
        problem, result.stage_of, stages, microbatches=microbatches, schedule=case.schedule
    )
    if problem.memory_limit is not None:
        assert max(memory) <= problem.memory_limit, (memory, problem.memory_limit)
    rule = choose_recompute(problem, result.stage_of, stages, microbatches=microbatches, schedule=case.schedule)
    assert result.recompute == rule
    value, _ = step_time(problem, result.stage_of, microbatches=microbatches, recompute=rule)
    assert close(value, result.objective)
    assert close(result.objective, expected), (result, expected)
    assert result.lower_bound <= result.objective + 1e-9
    assert result.lower_bound <= expected * (1 + REL) + 1e-12
    assert result.status == "optimal"


SEEDS = range(80)


def check_solvers(case: Case) -> None:
    """``solve_ilp`` and ``solve`` both reach the brute-force optimum, or both find nothing."""
    p, m, kind = case.stages, case.microbatches, case.schedule
    expected = _brute.brute_force(case.problem, stages=p, microbatches=m, schedule=kind)
    by_ilp = solve_ilp(case.problem, stages=p, microbatches=m, schedule=kind)
    by_solve = solve(case.problem, stages=p, microbatches=m, schedule=kind)
    if expected is None:
        assert by_ilp is None
        assert by_solve is None
        return
    assert by_ilp is not None, f"ILP found nothing, brute force {expected}"
    assert by_solve is not None, f"solve found nothing, brute force {expected}"
    assert_sound(case, by_ilp, expected)
    assert_sound(case, by_solve, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_solve_and_ilp_match_brute_force(seed: int) -> None:
    check_solvers(make_case(seed))


def test_generator_covers_the_interesting_cases() -> None:
    """The random cases include infeasible limits, reorderings that win, and replicas."""
    infeasible = reorder_wins = replicated = non_chain = 0
    for seed in SEEDS:
        case = make_case(seed)
        p, m, kind = case.stages, case.microbatches, case.schedule
        expected = _brute.brute_force(case.problem, stages=p, microbatches=m, schedule=kind)
        in_order = _brute.brute_force_intervals(
            case.problem, stages=p, microbatches=m, schedule=kind
        )
        infeasible += expected is None
        if expected is not None and (in_order is None or in_order > expected * (1 + 1e-9)):
            reorder_wins += 1
        replicated += any(a > 0 for a in case.problem.allreduce_s)
        non_chain += not is_chain(case.problem)
    assert infeasible >= 5
    assert reorder_wins >= 10
    assert replicated >= 10
    assert non_chain >= 40


# --------------------------------------------------------------------------- is_chain


def problem_with_edges(n: int, edges: tuple[tuple[int, int], ...]) -> PartitionProblem:
    zeros = (0.0,) * n
    return PartitionProblem(
        time_s=(1.0,) * n,
        static_bytes=zeros,
        activation_bytes=zeros,
        allreduce_s=zeros,
        transfer_s=zeros,
        edges=edges,
    )


@pytest.mark.parametrize(
    ("n", "edges", "expected"),
    [
        (1, (), True),
        (2, ((0, 1),), True),
        (4, ((0, 1), (1, 2), (2, 3)), True),
        (4, ((0, 1), (1, 2), (2, 3), (0, 3), (1, 3)), True),  # skips do not matter
        (4, ((2, 3), (0, 1), (1, 2)), True),  # edge order does not matter
        (2, (), False),
        (4, ((0, 1), (2, 3), (0, 2), (1, 3)), False),  # 1 and 2 may swap
        (3, ((0, 1), (0, 2)), False),
        (3, ((0, 2), (1, 2)), False),
    ],
)
def test_is_chain(n: int, edges: tuple[tuple[int, int], ...], expected: bool) -> None:
    assert is_chain(problem_with_edges(n, edges)) is expected


@pytest.mark.parametrize("seed", range(30))
def test_is_chain_means_a_single_topological_order(seed: int) -> None:
    """is_chain exactly when the interval brute force already covers every valid assignment."""
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    problem = problem_with_edges(n, _brute.random_edges(rng, n, rng.choice(["dag", "chain"])))
    assert is_chain(problem) is (len(_all_orders(n, problem.edges)) == 1)


def _all_orders(n: int, edges: tuple[tuple[int, int], ...]) -> list[tuple[int, ...]]:
    """Topological orders of ``n`` blocks (as a list of permutations)."""
    return [
        order
        for order in itertools.permutations(range(n))
        if all(order.index(u) < order.index(v) for u, v in edges)
    ]


# --------------------------------------------------------------------------- reordering


def heavy_in_the_middle() -> PartitionProblem:
    """Blocks 0 (light) and 1 (heavy) are independent; both feed 2 (light).

    In the given order the only 2-stage splits are 1 | 5 and 5 | 1 (step time
    6 + 3*5 = 21 with M = 4); putting the heavy block alone first gives 4 | 2
    (6 + 3*4 = 18).
    """
    zeros = (0.0,) * 3
    return PartitionProblem(
        time_s=(1.0, 4.0, 1.0),
        static_bytes=zeros,
        activation_bytes=zeros,
        allreduce_s=zeros,
        transfer_s=zeros,
        edges=((0, 2), (1, 2)),
    )


def test_reordering_beats_the_given_order() -> None:
    problem = heavy_in_the_middle()
    in_order = solve_intervals(problem, stages=2, microbatches=4)
    by_ilp = solve_ilp(problem, stages=2, microbatches=4)
    by_solve = solve(problem, stages=2, microbatches=4)
    assert in_order is not None and by_ilp is not None and by_solve is not None
    assert in_order.objective == pytest.approx(21.0)
    assert by_ilp.objective == pytest.approx(18.0)
    assert by_ilp.stage_of == (1, 0, 1)
    assert by_solve.objective == pytest.approx(18.0)
    assert by_solve.stage_of == (1, 0, 1)
    assert by_solve.status == "optimal"
    assert by_ilp.objective < in_order.objective


def test_reordering_needed_for_memory() -> None:
    """Feasible only out of order: the in-order DP finds nothing, the ILP does.

    Static bytes 5, 15, 5 under a 15-byte limit: block 1 must be alone, which
    in the given order (two stages) is impossible; {1} | {0, 2} fits.
    """
    problem = dataclasses.replace(
        heavy_in_the_middle(), static_bytes=(5.0, 15.0, 5.0), memory_limit=15.0
    )
    assert solve_intervals(problem, stages=2, microbatches=1) is None
    result = solve(problem, stages=2, microbatches=1)
    assert result is not None
    assert result.stage_of == (1, 0, 1)
    assert result.status == "optimal"


def test_use_ilp_false_keeps_the_given_order() -> None:
    result = solve(heavy_in_the_middle(), stages=2, microbatches=4, use_ilp=False)
    assert result is not None
    assert result.objective == pytest.approx(21.0)
    assert result.status == "feasible"  # not a chain: other orders were not tried
    assert result.lower_bound <= 18.0


def test_chain_without_replicas_skips_the_ilp() -> None:
    problem = problem_with_edges(4, ((0, 1), (1, 2), (2, 3)))
    result = solve(problem, stages=2, microbatches=4)
    assert result is not None
    assert result.solver == "interval-dp"
    assert result.status == "optimal"
    assert result.objective == pytest.approx(4.0 + 3 * 2.0)


@pytest.mark.parametrize("stages", [0, 5])
def test_stage_count_out_of_range(stages: int) -> None:
    problem = problem_with_edges(4, ())
    assert solve(problem, stages=stages, microbatches=2) is None
    assert solve_ilp(problem, stages=stages, microbatches=2) is None


def test_one_stage() -> None:
    problem = dataclasses.replace(heavy_in_the_middle(), allreduce_s=(0.5, 0.25, 0.0))
    result = solve_ilp(problem, stages=1, microbatches=3)
    assert result is not None
    assert result.stage_of == (0, 0, 0)
    assert result.objective == pytest.approx(3 * 6.0 + 0.75)


def test_one_stage_over_memory_is_infeasible() -> None:
    problem = dataclasses.replace(
        heavy_in_the_middle(), static_bytes=(1.0, 1.0, 1.0), memory_limit=2.0
    )
    assert solve_ilp(problem, stages=1, microbatches=1) is None
    assert solve(problem, stages=1, microbatches=1) is None


# --------------------------------------------------------------------------- HiGHS output


_SOLVE_ONCE = textwrap.dedent(
    """
    from partitioner.solve.problem import PartitionProblem
    from partitioner.solve.ilp import solve_ilp
    z = (0.0,) * 3
    p = PartitionProblem(time_s=(1.0, 4.0, 1.0), static_bytes=z, activation_bytes=z,
                         allreduce_s=z, transfer_s=z, edges=((0, 2), (1, 2)))
    print("objective", solve_ilp(p, stages=2, microbatches=4).objective)
    """
)


def _run_fresh(code: str) -> None:
    """Run ``code`` in a new interpreter that writes to this process's fd 1 and 2.

    HiGHS prints its banner once per process, so only a fresh process shows
    whether the first solve leaks it.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def test_highs_banner_does_not_reach_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    _run_fresh(_SOLVE_ONCE)
    out, _ = capfd.readouterr()
    assert "objective 18.0" in out
    assert "HiGHS" not in out


def test_highs_banner_would_be_printed_without_quieting(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Control for the test above: the banner is real, so its absence means something."""
    code = "import contextlib, partitioner.solve.ilp as s\ns._quiet = contextlib.nullcontext\n"
    _run_fresh(code + _SOLVE_ONCE)
    out, _ = capfd.readouterr()
    assert "objective 18.0" in out
    if "HiGHS" not in out:
        pytest.skip("this HiGHS prints no banner")


def test_stdout_still_works_after_a_solve(capfd: pytest.CaptureFixture[str]) -> None:
    """The fd-1 redirection is undone: prints after the solve are seen."""
    solve_ilp(heavy_in_the_middle(), stages=2, microbatches=4)
    print("after the solve")
    out, _ = capfd.readouterr()
    assert "after the solve" in out
    assert "HiGHS" not in out


# --------------------------------------------------------------------------- bugs


def no_costs(n: int, **fields: object) -> PartitionProblem:
    zeros = (0.0,) * n
    base: dict[str, object] = {
        "static_bytes": zeros,
        "activation_bytes": zeros,
        "allreduce_s": zeros,
        "transfer_s": zeros,
        "edges": (),
    }
    base.update(fields)
    return PartitionProblem(**base)  # type: ignore[arg-type]


def test_bug_ilp_stops_at_default_mip_gap() -> None:
    """HiGHS stops at its default 1e-4 relative gap, yet the result says "optimal".

    Four independent blocks of ~1e5 s into 2 stages, M = 2: the best pairing is
    {100000, 100007} / {100001, 100004} (max 200007, step 600019); the ILP
    returns the in-order pairing (max 200011, step 600023) with
    ``lower_bound == objective``, which is above the true optimum.
    """
    problem = no_costs(4, time_s=(100001.0, 100000.0, 100004.0, 100007.0))
    expected = _brute.brute_force(problem, stages=2, microbatches=2)
    assert expected == 600019.0
    result = solve_ilp(problem, stages=2, microbatches=2)
    assert result is not None and result.status == "optimal"
    assert result.lower_bound <= expected
    assert result.objective == expected


def test_bug_solve_stops_at_default_mip_gap() -> None:
    """Same through ``solve``: 1100039 returned as optimal, 1100036 exists."""
    problem = no_costs(
        5, time_s=(100004.0, 100004.0, 100004.0, 100000.0, 100003.0), edges=((0, 3), (1, 3))
    )
    expected = _brute.brute_force(problem, stages=3, microbatches=4)
    assert expected == 1100036.0
    result = solve(problem, stages=3, microbatches=4)
    assert result is not None and result.status == "optimal"
    assert result.lower_bound <= expected
    assert result.objective == expected


def test_bug_ilp_millisecond_times_within_solver_tolerance() -> None:
    """Stage times of ~1 ms sit inside HiGHS's absolute tolerances (1e-6).

    Blocks 1.0008 ms, 1 ms, 1 ms; edge 0 -> 2; P = 2, M = 4.  Best: {0} | {1, 2}
    (max 2 ms, step 9.0008 ms).  The ILP returns (1, 0, 1): stage 1 takes
    2.0008 ms while its T variable is 2 ms (a 0.8 us violation accepted), step
    9.0032 ms, still labelled "optimal".
    """
    problem = no_costs(3, time_s=(0.0010008, 0.001, 0.001), edges=((0, 2),))
    expected = _brute.brute_force(problem, stages=2, microbatches=4)
    assert expected is not None and close(expected, 0.0090008)
    result = solve_ilp(problem, stages=2, microbatches=4)
    assert result is not None and result.status == "optimal"
    assert close(result.objective, expected), result


def test_bug_ilp_exceeds_memory_limit() -> None:
    """The ILP's memory rows are checked only to HiGHS's tolerance: 1 byte over passes.

    Times 1, 1, 4, 4 (no edges) into 3 stages, M = 4; static bytes 1e9, 1e9,
    5e8, 5e8; limit 2e9 - 1.  Pairing blocks 0 and 1 (2e9 bytes: 1 byte over)
    would give step 22; the best split that fits gives 25.  ``solve`` returns
    (1, 1, 0, 2) at 22, over the limit.
    """
    problem = no_costs(
        4,
        time_s=(1.0, 1.0, 4.0, 4.0),
        static_bytes=(1e9, 1e9, 5e8, 5e8),
        memory_limit=2e9 - 1,
    )
    expected = _brute.brute_force(problem, stages=3, microbatches=4)
    assert expected == 25.0
    result = solve(problem, stages=3, microbatches=4)
    assert result is not None
    memory = stage_memory(problem, result.stage_of, 3, microbatches=4, schedule="gpipe")
    assert max(memory) <= 2e9 - 1, (result.stage_of, memory)
    assert result.objective == expected


def test_bug_ilp_infeasible_at_an_exactly_tight_limit() -> None:
    """With GB-scale bytes the ILP calls a problem infeasible whose best split is exactly at the
    limit (brute force: (0, 2, 1, 2) at 4.001 s, stage 2 at 2684354564 bytes == limit)."""
    problem = PartitionProblem(
        time_s=(1.0, 1.0, 1.0, 1.0),
        static_bytes=(1073741825.0, 1073741826.0, 1073741826.0, 1073741826.0),
        activation_bytes=(268435458.0, 268435456.0, 268435457.0, 268435456.0),
        allreduce_s=(0.0, 0.0, 0.0, 0.0),
        transfer_s=(0.001, 0.0, 0.008, 0.007),
        edges=((0, 2),),
        memory_limit=2684354564.0,
    )
    expected = _brute.brute_force(problem, stages=3, microbatches=1)
    assert expected is not None and close(expected, 4.001)
    result = solve(problem, stages=3, microbatches=1)
    assert result is not None, "a split that fits exists"
    assert close(result.objective, expected)


def test_bug_lower_bound_from_the_given_order_when_the_ilp_times_out() -> None:
    """When the ILP finds nothing in time, ``solve`` keeps the DP's lower bound, which holds only
    for the given order: lower_bound 21 although (1, 0, 1) reaches 18."""
    result = solve(heavy_in_the_middle(), stages=2, microbatches=4, time_limit=0.0, use_ilp=True)
    assert result is not None
    assert result.status == "feasible"
    assert result.lower_bound <= 18.0, result


def test_down_set_dp_is_exact_without_the_ilp() -> None:
    """Few down-sets and no replicas: the DP over down-sets reorders blocks like the ILP, exactly."""
    result = solve(heavy_in_the_middle(), stages=2, microbatches=4)
    assert result is not None
    assert result.solver == "down-set-dp" and result.status == "optimal"
    assert close(result.objective, 18.0) and close(result.lower_bound, 18.0)


# --------------------------------------------------------------------------- recomputation and topology


RICH_SEEDS = range(5000, 5100)


@pytest.mark.parametrize("seed", RICH_SEEDS)
def test_solve_and_ilp_match_brute_force_with_recompute_and_topology(seed: int) -> None:
    check_solvers(make_case(seed, rich=True))


def test_rich_cases_cover_the_ilp_paths() -> None:
    """The cases above reach the ILP with recomputation binaries and with links that cross."""
    auto_ilp = crossing_allreduce = recomputed = 0
    for seed in RICH_SEEDS:
        case = make_case(seed, rich=True)
        problem = case.problem
        replicated = any(a > 0 for a in problem.allreduce_s)
        auto_ilp += replicated and problem.recompute == "auto" and problem.memory_limit is not None
        _, allreduce = stage_links(problem, case.stages)
        crossing_allreduce += replicated and any(allreduce)
        best = _brute.brute_force_assignment(
            problem, stages=case.stages, microbatches=case.microbatches, schedule=case.schedule
        )
        if best is not None:
            rule = choose_recompute(
                problem, best[1], case.stages, microbatches=case.microbatches, schedule=case.schedule
            )
            recomputed += any(rule) and problem.recompute == "auto"
    assert auto_ilp >= 8
    assert crossing_allreduce >= 5
    assert recomputed >= 10


recompute_chain = _brute.recompute_chain


def test_ilp_recomputes_in_stage_0_only() -> None:
    """1F1B, P = 2, M = 4 (stage 0: 2 in flight, stage 1: 1).  Worked out in test_interval.py:
    cut after block 1, stage 0 recomputes (18 bytes, 3 s), stage 1 keeps (20 bytes, 2 s): 14."""
    for result in (
        solve_ilp(recompute_chain(), stages=2, microbatches=4, schedule="1f1b"),
        solve(recompute_chain(), stages=2, microbatches=4, schedule="1f1b"),
        solve(recompute_chain(), stages=2, microbatches=4, schedule="1f1b", use_ilp=True),
    ):
        assert result is not None
        assert result.stage_of == (0, 0, 1, 1)
        assert result.recompute == (True, False)
        assert result.objective == pytest.approx(14.0)
        assert result.status == "optimal"


def test_ilp_recompute_full_and_one_stage() -> None:
    # "full", one stage, M = 2 (gpipe): 4 + 4 x 0.5 = 6 s a micro-batch, 12 s; memory 2 x 8 + 10 = 26.
    full = recompute_chain(recompute="full", memory_limit=26.0)
    result = solve_ilp(full, stages=1, microbatches=2)
    assert result is not None
    assert result.recompute == (True,)
    assert result.objective == pytest.approx(12.0)
    assert solve_ilp(dataclasses.replace(full, memory_limit=25.0), stages=1, microbatches=2) is None


def test_infeasible_even_with_recompute() -> None:
    """Limit 15: no cut fits however the stages choose (18, 16, 22 bytes on the fuller stage)."""
    tight = recompute_chain(memory_limit=15.0)
    assert solve_ilp(tight, stages=2, microbatches=4, schedule="1f1b") is None
    assert solve(tight, stages=2, microbatches=4, schedule="1f1b") is None
    assert solve(tight, stages=2, microbatches=4, schedule="1f1b", use_ilp=True) is None


def test_heavy_allreduce_stays_off_the_crossing_stage() -> None:
    """Two replicas per stage, three GPUs per node: stage 0 (ranks 0, 1) is on node 0, stage 1
    (ranks 2, 3) spans nodes 0 and 1, so its all-reduce pays the inter-node price.

    Blocks 0 and 1 (2 s each) feed block 2 (2 s); block 0 all-reduces in 1 s (5 s across
    nodes), M = 2.  (0, 1, 1) and (0, 0, 1): 2 | 4 or 4 | 2, 6 + 4 + 1 = 11; (1, 0, 1) puts
    block 0 on the crossing stage: 6 + 4 + 5 = 15.  Without the topology all three tie at 11.
    """
    problem = no_costs(
        3,
        time_s=(2.0, 2.0, 2.0),
        allreduce_s=(1.0, 0.0, 0.0),
        allreduce_slow_s=(5.0, 0.0, 0.0),
        edges=((0, 2), (1, 2)),
        replicas=2,
        gpus_per_node=3,
    )
    assert step_time(problem, (1, 0, 1), microbatches=2)[0] == pytest.approx(15.0)
    for result in (solve_ilp(problem, stages=2, microbatches=2), solve(problem, stages=2, microbatches=2)):
        assert result is not None
        assert result.stage_of[0] == 0
        assert result.objective == pytest.approx(11.0)
        assert result.status == "optimal"


def test_slower_latency_on_the_crossing_stage_is_charged_once() -> None:
    """Latency per stage (0.1 on node 0, 2 where the all-reduce crosses) adds its maximum, 2,
    whatever the split: every split has every stage."""
    problem = no_costs(
        3,
        time_s=(2.0, 2.0, 2.0),
        edges=((0, 2), (1, 2)),
        replicas=2,
        gpus_per_node=3,
        allreduce_latency_s=0.1,
        allreduce_latency_slow_s=2.0,
    )
    # Best split 2 | 4 or 4 | 2: 6 + 4 = 10, plus 2.
    for result in (solve_ilp(problem, stages=2, microbatches=2), solve(problem, stages=2, microbatches=2)):
        assert result is not None
        assert result.objective == pytest.approx(12.0)
        assert close(result.lower_bound, 12.0)


def test_recomputation_is_per_stage_not_per_block() -> None:
    """A stage recomputes all its blocks or none: recomputing only the cheap block is no option.

    1F1B, M = 2, P = 2 (stage 0: 2 in flight, stage 1: 1); limit 16.  Block 0: 1 s, 10 bytes
    of activations, kept 0 when recomputed, 0.1 s more; block 1: 1 s, 3 bytes, kept 2.5, 5 s more;
    block 2: 2 s, 1 byte.  {0, 1} | {2}: stage 0 keeps 26 > 16, recomputes both (2 x 2.5 + 10 = 15):
    7.1 s, step 7.1 + 2 + 7.1 = 16.2 (recomputing block 0 alone, 16 bytes, would give 6.2).
    {0} | {1, 2}: stage 0 recomputes (10 bytes) 1.1 s, stage 1 keeps 4 bytes, 3 s: 1.1 + 3 + 3 = 7.1.
    """
    problem = no_costs(
        3,
        time_s=(1.0, 1.0, 2.0),
        activation_bytes=(10.0, 3.0, 1.0),
        edges=((0, 1), (1, 2)),
        recompute_bytes=(0.0, 2.5, 1.0),
        recompute_s=(0.1, 5.0, 1.0),
        recompute="auto",
        memory_limit=16.0,
    )
    result = solve_ilp(problem, stages=2, microbatches=2, schedule="1f1b")
    assert result is not None
    assert result.stage_of == (0, 1, 1) and result.recompute == (True, False)
    assert result.objective == pytest.approx(7.1)


def test_bug_ilp_keeps_a_stage_just_over_the_limit() -> None:
    """Keeping overshoots the limit by 10 bytes in 1e12 (inside HiGHS's tolerance, outside ours):
    the split must then be priced recomputed, not thrown away.

    GPipe, M = 2.  {0, 1} | {2}: stage 0 keeps 2 x (2 x 2.5e11 + 5) = 1e12 + 10 bytes, so it
    recomputes (2 x 2 + 2.5e11 bytes): 2.2 | 2 s, step 6.4.  {0} | {1, 2}: 1 | 3, step 7.
    """
    a = 2.5e11 + 2.5
    problem = no_costs(
        3,
        time_s=(1.0, 1.0, 2.0),
        activation_bytes=(a, a, 0.0),
        edges=((0, 1), (1, 2)),
        recompute_bytes=(1.0, 1.0, 0.0),
        recompute_s=(0.1, 0.1, 0.0),
        recompute="auto",
        memory_limit=1e12,
    )
    result = solve_ilp(problem, stages=2, microbatches=2)
    assert result is not None
    assert result.stage_of == (0, 0, 1) and result.recompute == (True, False)
    assert result.objective == pytest.approx(6.4)


def test_recomputed_stage_holds_its_largest_block_again() -> None:
    """The ILP's memory of a recomputed stage counts the largest block's activations; were it left
    out, dozens of splits would look feasible, each rejected by the check after solving, and the
    re-solves would run out before reaching the real optimum.

    GPipe, M = 2, limit 115.  Blocks 0..5 independent, all read by block 6 (the output); 1 s each.
    Block 0: 100 activation bytes, others 10; recomputed: 5 bytes kept, 0.01 s more.  A stage
    with block 0 keeps at least 200, recomputed 2 x 5 (k + 1) + 100 <= 115 only alone (k = 0).
    So {0} | {1..6}, the second stage recomputing too (keeps 2 x 60 = 120, recomputed 2 x 30 + 10
    = 70): 1.01 | 6.06, step 7.07 + 6.06 = 13.13 (without the 100, {0, 1, 2} | ... 3.03 | 4, 11.03).
    """
    problem = no_costs(
        7,
        time_s=(1.0,) * 7,
        activation_bytes=(100.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0),
        edges=tuple((v, 6) for v in range(6)),
        recompute_bytes=(5.0,) * 7,
        recompute_s=(0.01,) * 7,
        recompute="auto",
        memory_limit=115.0,
    )
    result = solve_ilp(problem, stages=2, microbatches=2)
    assert result is not None
    assert result.stage_of == (0, 1, 1, 1, 1, 1, 1) and result.recompute == (True, True)
    assert result.objective == pytest.approx(13.13)
