"""The plan report and its figures, written from a saved plan alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from chunked import plan_schedule

from partitioner.plan import (
    Boundary,
    Candidate,
    CostModelInfo,
    Plan,
    StagePlan,
    StagePrediction,
    StepPrediction,
    TiedParameter,
    example_plan,
)
from partitioner.report.figures import rank_memory_bars, stage_bars_png, timeline_png, track_stages
from partitioner.report.markdown import REPORT_FILES, report_markdown, write_report
from partitioner.schedule.lower import compute_order, lower
from partitioner.schedule.simulate import simulate, stage_static_bytes
from partitioner.schedule.timeline import read_events
from partitioner.solve.problem import in_flight

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def pipeline_plan(stages: int = 4, microbatches: int = 8, *, dp: int = 2, kind: str = "1f1b") -> Plan:
    """A synthetic chain plan: stage s is (1 + s/5) times slower than stage 0, 400 MiB of parameters each."""
    bounds = [Boundary(f"h{s}", (8, 1024, 256), "float32", s, s + 1) for s in range(stages - 1)]
    parts = []
    for s in range(stages):
        pred = StagePrediction(
            forward_s=1e-3 * (1 + 0.2 * s), backward_s=2e-3 * (1 + 0.2 * s), memory_bytes=0.0,
            parameter_bytes=400 * MIB, activation_bytes=300.0 * MIB,
            send_bytes=bounds[s].nbytes if s < stages - 1 else 0, allreduce_s=4e-3,
        )
        parts.append(StagePlan(
            s, tuple(range(s * dp, (s + 1) * dp)), (f"n{s}",), 1, (f"{s}.weight",), ("x",) if s == 0 else (),
            (bounds[s - 1],) if s else (), (bounds[s],) if s < stages - 1 else (), (str(s), str(s)), pred,
            rank=s,
        ))
    sends_to = tuple((s + 1,) if s + 1 < stages else () for s in range(stages))
    receives_from = tuple((s - 1,) if s else () for s in range(stages))
    sched = lower(compute_order(kind, stages=stages, microbatches=microbatches),
                  sends_to=sends_to, receives_from=receives_from, kind=kind)
    memory = tuple(400 * MIB * 4 + in_flight(s, stages, microbatches, kind) * 300.0 * MIB  # type: ignore[arg-type]
                   for s in range(stages))
    return dataclasses.replace(
        example_plan(), gpus=stages * dp, pp=stages, dp=dp, microbatches=microbatches, schedule=kind,
        batch_size=microbatches * dp * 8, stages=tuple(parts),
        actions=tuple(tuple(str(a) for a in row) for row in sched.actions),
        predicted=StepPrediction(0.06, 0.3, 1000.0, memory),
        cost_model=CostModelInfo("predicted for h100", 450e9, 1e-5, 80e9, 2),
        candidates=(Candidate(stages * dp, 1, None, "infeasible", "no split fits in memory"),
                    Candidate(stages, dp, 0.06, "optimal", "interval-dp, gap 0.0%"),
                    Candidate(stages // 2, dp * 2, 0.09, "feasible", "ilp, gap 2.0%")),
        tied=(TiedParameter("wte.weight", ("wte.weight", "lm_head.weight"), (0, stages - 1)),),
        stage_code=tuple(f"# stage {s}\n" for s in range(stages)),
        gpus_per_node=stages * dp,
    )


def test_report_from_a_saved_plan(tmp_path: Path) -> None:
    directory = Plan.save(example_plan(), tmp_path / "plan")
    plan = Plan.load(directory)
    report = write_report(plan, directory)
    assert report == directory / "report.md"
    for name in REPORT_FILES:
        assert (directory / name).exists(), name
    for name in ("timeline.png", "stages.png"):
        assert (directory / name).read_bytes()[:8] == PNG_MAGIC
    text = report.read_text()
    sim = simulate(plan)
    assert f"{sim.step_s * 1e3:.4g} ms" in text and "9 ms" in text  # simulated and closed-form step
    assert "(timeline.png)" in text and "(stages.png)" in text
    assert f"autopartition verify {directory} --model model.py" in text
    assert f"autopartition run {directory} --nproc-per-node 2 -- train.py" in text
    assert "interval-dp" in text and "optimal" in text
    assert len(read_events(directory / "predicted_trace.json")) == len(sim.events)


def test_report_sections_for_a_replicated_pipeline() -> None:
    plan = pipeline_plan()
    text = report_markdown(plan, directory="out")
    for heading in ("## Summary", "## Assumptions", "## Stages", "## Simulation", "## Combinations considered",
                    "## Solver", "## Tied parameters", "## Rank layout", "## Commands"):
        assert heading in text
    assert "8 = 4 pipeline stages (pp) x 2 data-parallel replicas (dp)" in text
    assert "| 7 | 3 | 1 |" in text  # rank 7 is stage 3's second replica
    assert "`wte.weight`, `lm_head.weight`" in text
    assert "no split fits in memory" in text
    assert "4 x 2, M = 8, 1f1b won with the lowest predicted step time" in text and "+50.0%" in text
    assert "--nproc-per-node 8" in text
    assert "peak memory (simulated)" in text and "differs" not in text  # simulation agrees with the plan


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_figures_for_four_stages(tmp_path: Path, suffix: str) -> None:
    plan = pipeline_plan(4, 8, kind="gpipe")
    sim = simulate(plan)
    timeline = timeline_png(sim.events, tmp_path / f"timeline{suffix}", title="4 x 8 GPipe")
    bars = stage_bars_png(plan, tmp_path / f"stages{suffix}", simulation=sim)
    for path in (timeline, bars):
        head = path.read_bytes()[:200]
        assert head.startswith(PNG_MAGIC) if suffix == ".png" else b"<svg" in head


@pytest.mark.parametrize(("schedule", "ranks", "microbatches"), [("interleaved-1f1b", 2, 4), ("zbv", 2, 4)])
def test_report_of_a_chunked_plan_draws_both_figures(
    tmp_path: Path, schedule: str, ranks: int, microbatches: int
) -> None:
    """A plan with two stages per pipeline rank (from the planner): timeline and stages.png, memory per rank."""
    directory = tmp_path / "plan"
    plan = plan_schedule(str(ROOT / "examples" / "gpt.py"), directory, ranks=ranks, chunks=2,
                         microbatches=microbatches, schedule=schedule)
    assert plan.chunks == 2 and len(plan.stages) == 2 * ranks
    for name in REPORT_FILES:
        (directory / name).unlink(missing_ok=True)
    text = write_report(plan, directory).read_text()
    for name in ("timeline.png", "stages.png"):
        assert (directory / name).read_bytes()[:8] == PNG_MAGIC, name
        assert f"({name})" in text
    sim = simulate(plan)
    # The memory panel: one bar per pipeline rank, the static bytes of every stage it holds + activations.
    static, activations = rank_memory_bars(plan, sim)
    per_stage = stage_static_bytes(plan)
    assert static == [sum(per_stage[s] for s in plan.stages_of(r)) for r in range(ranks)]
    assert [a + b for a, b in zip(static, activations)] == pytest.approx(list(sim.peak_memory_bytes))
    assert list(sim.peak_memory_bytes) == pytest.approx(list(plan.predicted.peak_memory_bytes))
    assert all(a > 0 for a in activations)
    # The timeline tells a rank's chunks apart by the stages its boxes name.
    assert track_stages(sim.events) == {r: plan.stages_of(r) for r in range(ranks)}


def test_timeline_draws_one_collection_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Boxes are batched per track (a 70B plan has ~17,000 of them; a patch per box took over a minute)."""
    from partitioner.report import figures

    drawn: list[object] = []
    save = figures._save

    def keep(fig: object, path: Path) -> Path:
        drawn.append(fig)
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", keep)
    plan = pipeline_plan(4, 8, kind="1f1b")
    sim = simulate(plan)
    timeline_png(sim.events, tmp_path / "timeline.png", title="4 x 8 1F1B")
    (ax,) = drawn[0].axes  # type: ignore[attr-defined]
    tracks = sorted({e.track for e in sim.events})
    compute = [e for e in sim.events if e.kind in ("F", "B", "W")]
    # Per track: one collection of its compute boxes, one of its waits, one of its all-reduce buckets.
    assert len(ax.collections) <= 3 * len(tracks) < len(compute)
    filled = [c for c in ax.collections if len(c.get_facecolors()) and c.get_facecolors()[0][3] > 0]
    assert len(filled) == len(tracks)
    assert sorted(len(c.get_paths()) for c in filled) == sorted(
        sum(1 for e in compute if e.track == t) for t in tracks)
    assert ax.get_xlim()[1] == pytest.approx(max(e.end_s for e in sim.events) * 1e3 * 1.02)
