"""The text report of a plan, and the byte/second formatting helpers."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.plan import (
    Candidate,
    CostModelInfo,
    Plan,
    SolverInfo,
    StagePrediction,
    TiedParameter,
    example_plan,
)
from partitioner.report.table import WIDTH, format_bytes, format_plan, format_seconds


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (32 * 1024, "32.0 KiB"),
     (3 * 1024**2, "3.00 MiB"), (80 * 1024**3, "80.0 GiB"), (141e9, "131 GiB"), (2 * 1024**4, "2.00 TiB"),
     (-2048, "-2.00 KiB"), (float("nan"), "? B")],
)
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("s", "text"),
    [(0, "0 s"), (5e-9, "5.00 ns"), (2.5e-6, "2.50 µs"), (1.5e-3, "1.50 ms"), (0.0123, "12.3 ms"),
     (0.9999, "1000 ms"), (4.0, "4.00 s"), (59.4, "59.4 s"), (200, "3 min 20 s"), (7300, "2 h 1 min"),
     (-1e-3, "-1.00 ms")],
)
def test_format_seconds(s: float, text: str) -> None:
    assert format_seconds(s) == text


def test_format_plan_example() -> None:
    text = format_plan(example_plan())
    lines = text.splitlines()
    assert lines[0] == "Sequential: 2 parameters (export) | 2 GPUs = 2 stages x 1 replica, one node of 2"
    assert lines[1] == "gpipe, 2 micro-batches of 2, batch 4 | fp32, adam | costs measured on cpu"
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    for column in ("ranks", "modules", "params", "peak memory", "fwd ms", "bwd ms", "recomp", "sends"):
        assert column in lines[header]
    rows = lines[header + 2: header + 4]
    assert rows[0].split()[:5] == ["0", "0", "0", "…", "1"]
    assert rows[1].split()[:4] == ["1", "1", "2", "64"]
    assert "1.000" in rows[0] and "2.000" in rows[0] and "32 B" in rows[0] and "320 B" in rows[0]
    assert "predicted step 9.00 ms | bubble 33.3% | 444 samples/s" in text
    assert "MFU" not in lines[header + 5]  # no FLOPs recorded: no MFU claimed
    for topic in ("precision: fp32", "optimizer: adam, 2 state tensors per parameter: 16 bytes per parameter",
                  "recomputation: none", "links: one node of 2; 1 GB/s, 60 µs per message inside a node",
                  "across nodes: everything stays inside one node"):
        assert topic in text
    assert "solver interval-dp: optimal, gap 0.0% to the lower bound, 3 blocks" in text
    assert "tied parameters" not in text
    chosen = [line for line in lines if line.lstrip().startswith("*")]
    assert len(chosen) == 1 and chosen[0].split()[1:7] == ["2", "1", "2", "gpipe", "-", "9.00"]
    assert max(len(line) for line in lines) <= WIDTH


def test_format_plan_tied_candidates_and_limit() -> None:
    base = example_plan()
    plan = dataclasses.replace(
        base,
        tied=(TiedParameter("0.weight", ("0.weight", "2.weight"), (0, 1)),),
        candidates=(
            Candidate(2, 1, 9e-3, "optimal", "chosen"),
            Candidate(1, 2, None, "skipped", "batch 4 does not split into 2 replicas x 4 micro-batches"),
            Candidate(1, 2, None, "infeasible", "no split fits in memory"),
        ),
        cost_model=dataclasses.replace(base.cost_model, memory_limit=1280.0),
    )
    text = format_plan(plan)
    assert "0.weight = 2.weight on stages 0, 1" in text
    assert "(25%)" in text and "| 1.25 KiB per GPU" in text
    lines = text.splitlines()
    skipped = next(line for line in lines if "does not split" in line)
    assert not skipped.lstrip().startswith("*") and " - " in skipped
    assert any("no split fits in memory" in line for line in lines)
    assert sum(line.lstrip().startswith("*") for line in lines) == 1
    # Ranked: chosen first, then what does not fit, then what cannot be planned.
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("candidates:")) + 3:]
    assert ["chosen" in rows[0], "no split fits" in rows[1], "does not split" in rows[2]] == [True] * 3


def test_many_candidates_keep_the_best_of_each_shape() -> None:
    chosen = Candidate(2, 1, 9e-3, "optimal", "chosen", 8e-3, microbatches=2, schedule="1f1b", recomputed_stages=1)
    losers = [Candidate(2, 1, 9e-3 + k * 1e-3, "optimal", f"slower: +{10 * k}.0% (closed form)",
                        microbatches=2 ** k, schedule="gpipe", recomputed_stages=0) for k in range(1, 15)]
    pruned = Candidate(1, 2, None, "pruned", "slower: at least +50.0% (bound)", microbatches=1, schedule="gpipe")
    plan = dataclasses.replace(example_plan(), candidates=(*losers, chosen, pruned))
    lines = format_plan(plan).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("candidates:"))
    table = lines[start + 1:]
    assert table[0].split() == ["pp", "dp", "M", "sched", "recomp", "closed", "form", "simulated", "why", "not",
                                "chosen"]
    assert table[2].split()[:8] == ["*", "2", "1", "2", "1f1b", "1/2", "9.00", "ms"]
    assert "slower: +10.0% (closed form)" in table[3] and table[3].split()[4] == "none"
    assert [row.split()[2] for row in table[3:8]] == ["2", "4", "8", "16", "32"]  # the best six, chosen first
    assert "slower: at least +50.0% (bound)" in table[-2]  # the best (only) row of shape 1 x 2 is kept
    assert table[-1] == "  (+9 more combinations: report.md and plan.json list every one)"
    assert max(len(line) for line in lines) <= WIDTH


def test_format_plan_replicated_shows_allreduce() -> None:
    base = example_plan()
    stages = tuple(dataclasses.replace(s, ranks=(2 * s.index, 2 * s.index + 1)) for s in base.stages)
    plan = dataclasses.replace(base, gpus=4, dp=2, stages=stages,
                               cost_model=CostModelInfo("predicted for h100", 4.5e11, 1e-5, 80e9, 2))
    text = format_plan(plan)
    assert "allreduce ms" in text and "2 stages x 2 replicas" in text
    assert "costs predicted for h100" in text and "(<0.1%)" in text


# ----------------------------------------------------------------- issue 10: rough edges


def _replicated(pp: int, dp: int) -> Plan:
    """example_plan's first stage repeated ``pp`` times, each on ``dp`` replicas, on H100s."""
    base = example_plan()
    pred = StagePrediction(1.6e-5, 1.6e-5, 74_752.0, 16_640, 32.0, 2048, 6.0e-5)
    stages = tuple(dataclasses.replace(base.stages[0], index=s, ranks=tuple(range(s * dp, (s + 1) * dp)),
                                       modules=(f"encoder.layers.{s}.attention", f"encoder.layers.{s}.mlp"),
                                       predicted=pred)
                   for s in range(pp))
    return dataclasses.replace(base, gpus=pp * dp, pp=pp, dp=dp, stages=stages,
                               cost_model=CostModelInfo("predicted for h100", 4.5e11, 1e-5, 80e9, 2))


def test_one_stage_and_one_gpu_are_singular() -> None:
    """Issue 10: "1 stages x 4 replicas"."""
    assert "| 4 GPUs = 1 stage x 4 replicas," in format_plan(_replicated(1, 4))
    single = _replicated(1, 1)
    one = format_plan(dataclasses.replace(single, cost_model=dataclasses.replace(single.cost_model, peak_flops=1e15)))
    assert "| 1 GPU = 1 stage x 1 replica," in one and "(1 GPU x" in " ".join(one.split())


def test_exact_solver_reports_gap_0() -> None:
    """Issue 10: an exact DP reported "optimal, gap 3.4%" (its pruning bound, not its optimum)."""
    base = example_plan()
    optimal = dataclasses.replace(base, solver=SolverInfo("interval-dp", "optimal", 10e-3, 9.66e-3, 0.01, 3))
    assert "solver interval-dp: optimal, gap 0.0% to the lower bound" in format_plan(optimal)
    feasible = dataclasses.replace(optimal, solver=dataclasses.replace(optimal.solver, status="feasible"))
    assert "solver interval-dp: feasible, gap 3.4% to the lower bound" in format_plan(feasible)


@pytest.mark.parametrize(("pp", "dp"), [(16, 4), (300, 4), (1200, 4), (2000, 8)])
def test_many_stages_fit_100_columns(pp: int, dp: int) -> None:
    """Issue 10: tables fit 100 columns, also with 4-digit ranks and the all-reduce column."""
    lines = format_plan(_replicated(pp, dp)).splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    last = lines[header + 1 + pp].split()
    assert last[:2] == [str(pp - 1), f"{(pp - 1) * dp}-{pp * dp - 1}"] and last[-1] == "0.060"


@pytest.mark.parametrize("seed", range(5))
def test_exact_dp_lower_bound_is_its_objective(seed: int) -> None:
    """The exact interval DP reported the bound it pruned with, below its own optimum (gap > 0)."""
    import random

    from partitioner.solve.ilp import solve
    from partitioner.solve.problem import PartitionProblem

    rng = random.Random(seed)
    n = 12
    problem = PartitionProblem(
        time_s=tuple(rng.uniform(0.1, 3) for _ in range(n)), static_bytes=(0.0,) * n,
        activation_bytes=(0.0,) * n, allreduce_s=(0.0,) * n,
        transfer_s=tuple(rng.uniform(0, 0.5) for _ in range(n)), edges=tuple((i, i + 1) for i in range(n - 1)),
    )
    part = solve(problem, stages=3, microbatches=4)
    assert part is not None and part.status == "optimal"
    assert part.lower_bound == part.objective and part.gap == 0.0


def test_a_calibrated_plan_says_so_with_its_jitter() -> None:
    plan = example_plan()
    assert "calibrated" not in format_plan(plan)
    cm = dataclasses.replace(plan.cost_model, calibration_scale=1.25, action_host_s=2e-4, action_jitter=0.12)
    text = " ".join(format_plan(dataclasses.replace(plan, cost_model=cm)).split())
    assert "calibrated (x1.25, +200 µs per action, jitter 12%)" in text
