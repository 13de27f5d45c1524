"""Smoke tests of tools/bench_runtime.py, bench_predict.py and bench_schedules.py: their smallest runs work end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import bench_predict, bench_runtime

pytestmark = pytest.mark.slow  # all spawn ranks: about 35 s together

# Big enough that splitting pays: at n_embd 32 and seq 16, a 2-stage split costs more in transfers than it
# saves here, and the planner puts a lone size() node in stage 0, which torch's chain cannot take.
TINY = ["--layers", "4", "--embd", "64", "--heads", "2", "--seq", "32", "--batch", "8", "--microbatches", "2"]


def test_bench_runtime_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runtime.json"
    only = "ours_gpipe,torch_gpipe_our_split"  # one plan to make: keeps the test short
    assert bench_runtime.main(["--quick", *TINY, "--rounds", "1", "--steps", "1", "--only", only,
                               "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch ScheduleGPipe, our split" in text and "of ideal" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["key"] for r in rows] == ["single", "ours_gpipe", "torch_gpipe_our_split"]
    losses = [r["loss"] for r in rows]
    # Every configuration computes the same mini-batch from the same weights: same loss.
    assert max(losses) - min(losses) < 1e-4, losses
    assert all(r["step_s"] > 0 for r in rows)


def test_bench_predict_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "predict"
    assert bench_predict.main(["--quick", *TINY, "--steps", "2", "--warmup", "1", "--out", str(out),
                               "--json", str(tmp_path / "p.json")]) == 0
    assert "pred step" in capsys.readouterr().out
    for name in ("measured.json", "predicted.json", "measured.png", "predicted.png", "plan/plan.json"):
        assert (out / "pp2-gpipe" / name).exists(), name
    (result,) = json.loads((tmp_path / "p.json").read_text())
    assert result["measured_step_s"] > 0 and len(result["stages"]) == 2
    assert all(s["measured_compute_s"] > 0 for s in result["stages"])


def test_bench_schedules_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools import bench_schedules

    out = tmp_path / "schedules.json"
    tiny = [*TINY[:-1], "4"]  # 4 micro-batches: zbv's V needs at least 2P - 1 = 3 to fill
    assert bench_schedules.main(["--quick", *tiny, "--rounds", "1", "--steps", "1", "--only", "ours_zbv,torch_zbv",
                                 "--probe-timeout", "5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "meas/pred" in text and "ours, ZBV vs torch ZBVZeroBubble" in text
    ours, theirs = json.loads(out.read_text())["rows"]
    assert (ours["key"], theirs["key"]) == ("ours_zbv", "torch_zbv")
    assert ours["step_s"] > 0 and ours["predicted_s"] > 0
    if theirs["error"] is None:  # torch ran (maybe with cloned outputs): same loss, same gradients
        assert abs(ours["loss"] - theirs["loss"]) < 1e-5
        assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-5 * ours["grad_norm"]


def test_bench_schedules_calibrates_each_plan_on_the_others_only() -> None:
    """No plan's prediction is fitted on its own run, nor on a configuration of the very same plan."""
    import dataclasses

    from partitioner.orders import Action
    from partitioner.plan import example_plan
    from tools import bench_schedules

    gpipe = example_plan()
    plans = {"1f1b": gpipe, "auto": gpipe, "zbh1": dataclasses.replace(gpipe, schedule="1f1b")}
    slower = {"ours_1f1b": 2.0, "ours_auto": 2.0, "ours_zbh1": 3.0}  # measured / predicted, per configuration

    def events(key: str) -> list[dict[str, object]]:
        out, clock = [], 0.0
        for _ in range(4):  # steps
            for rank, row in enumerate(gpipe.actions):
                for name in row:
                    a = Action.parse(name)
                    if a.kind in "FB":
                        p = gpipe.stages[a.stage].predicted
                        d = slower[key] * (p.forward_s if a.kind == "F" else p.backward_s)
                        out.append({"track": rank, "label": name, "action": name, "microbatch": a.microbatch,
                                    "kind": a.kind, "start_s": clock, "end_s": clock + d})
                        clock += d
        return out

    results = [{"events": {key: events(key) for key in slower}}, {"events": {key: [] for key in slower}}]
    found = bench_schedules.calibrate_each(plans, results)
    assert found["ours_1f1b"].source == found["ours_auto"].source == "zbh1"  # auto runs 1f1b's plan
    assert found["ours_1f1b"].scale == pytest.approx(3.0)
    assert found["ours_zbh1"].source == "1f1b, auto"
    assert found["ours_zbh1"].scale == pytest.approx(2.0)
