"""partitioner.cost.calibration: fitting a traced run, files, and planning with the fit."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from partitioner.cost.calibration import Calibration, CalibrationError, fit, load_calibration
from partitioner.orders import Action
from partitioner.plan import Plan, example_plan
from partitioner.schedule.simulate import simulate
from partitioner.schedule.timeline import TimelineEvent, write_chrome_trace
from partitioner.search.calibrate import (
    action_jitter,
    calibrate,
    plan_calibration,
    recalibrated,
    stage_pairs,
)

# ----------------------------------------------------------------- fit


def test_fit_recovers_scale_and_host_time_per_action() -> None:
    pairs = [(p, 1.3 * p + 2e-4) for p in (1e-3, 2e-3, 5e-3, 8e-3)]
    got = fit(pairs)
    assert got.scale == pytest.approx(1.3)
    assert got.action_s == pytest.approx(2e-4)
    assert got.samples == 4


def test_fit_holds_host_time_at_zero_and_refits_the_scale() -> None:
    # The best line has a negative intercept: a negative host time would make small actions free.
    got = fit([(1.0, 1.0), (2.0, 3.0), (3.0, 5.0)])
    assert got.action_s == 0.0
    assert got.scale == pytest.approx((1 + 6 + 15) / (1 + 4 + 9))


def test_fit_needs_an_action() -> None:
    with pytest.raises(CalibrationError, match="no compute action"):
        fit([])


@pytest.mark.parametrize(("scale", "action_s"), [(0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (1.0, -1e-3)])
def test_a_calibration_checks_its_numbers(scale: float, action_s: float) -> None:
    with pytest.raises(CalibrationError):
        Calibration(scale, action_s)


def test_composing_two_calibrations_applies_both() -> None:
    first, second = Calibration(2.0, 0.1), Calibration(1.5, 0.2)
    both = first.then(second)
    for x in (0.5, 1.0, 4.0):
        assert both.scale * x + both.action_s == pytest.approx(second.scale * (first.scale * x + first.action_s)
                                                              + second.action_s)


# ----------------------------------------------------------------- files


def test_a_calibration_file_round_trips(tmp_path: Path) -> None:
    c = Calibration(1.25, 3e-4, samples=6, source="trace.json of plan/")
    assert load_calibration(c.save(tmp_path / "c.json")) == c


@pytest.mark.parametrize(("text", "pattern"), [
    (None, "does not exist"),
    ("{not json", "is not JSON"),
    ('{"scale": 1.0}', "is not an autopartition calibration"),
    ('{"format": "autopartition-calibration", "scale": 1.0}', "missing or garbles a field"),
    ('{"format": "autopartition-calibration", "scale": 0, "action_s": 0}', "must be a positive number"),
])
def test_a_bad_calibration_file_is_named_with_the_fix(tmp_path: Path, text: str | None, pattern: str) -> None:
    path = tmp_path / "c.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CalibrationError, match=pattern):
        load_calibration(path)


# ----------------------------------------------------------------- traces


def _events(plan: Plan, seconds: dict[str, float], *, steps: int, first_step_factor: float = 1.0) -> list[TimelineEvent]:
    """A trace of ``steps`` steps: every compute action of the plan lasting ``seconds[kind]`` (per stage kind)."""
    events, clock = [], 0.0
    for step in range(steps):
        for rank, row in enumerate(plan.actions):
            for name in row:
                a = Action.parse(name)
                if a.kind not in ("F", "B", "W"):
                    continue
                d = seconds[f"{a.stage}{a.kind}"] * (first_step_factor if step == 0 else 1.0)
                events.append(TimelineEvent(rank, name, name, a.microbatch, a.kind, clock, clock + d))
                clock += d
    return events


def test_stage_pairs_take_each_stage_kind_s_median_over_the_later_steps() -> None:
    plan = example_plan()  # GPipe, stages of F 1 ms and B 2 ms
    seconds = {"0F": 1.5e-3, "0B": 2.7e-3, "1F": 1.6e-3, "1B": 2.6e-3}
    pairs = stage_pairs(plan, _events(plan, seconds, steps=4, first_step_factor=3.0))  # step 0 slow: left out
    # (stage, kind) order: 0B, 0F, 1B, 1F
    flat = [x for pair in pairs for x in pair]
    assert flat == pytest.approx([2e-3, 2.7e-3, 1e-3, 1.5e-3, 2e-3, 2.6e-3, 1e-3, 1.6e-3])


def test_one_action_that_waited_for_a_core_does_not_move_its_stage_s_figure() -> None:
    plan = example_plan()
    seconds = {"0F": 1.5e-3, "0B": 2.7e-3, "1F": 1.6e-3, "1B": 2.6e-3}
    events = _events(plan, seconds, steps=6)
    last = max(i for i, e in enumerate(events) if e.action == "0F0")  # stage 0's forward, in a later step
    events[last] = dataclasses.replace(events[last], end_s=events[last].start_s + 30e-3)  # 20x: descheduled
    pairs = dict(zip(["0B", "0F", "1B", "1F"], stage_pairs(plan, events)))
    assert pairs["0F"] == pytest.approx((1e-3, 1.5e-3))


def test_a_trace_of_another_plan_is_refused() -> None:
    plan = example_plan()
    stray = TimelineEvent(0, "F0", "5F0", 0, "F", 0.0, 1e-3)
    with pytest.raises(CalibrationError, match="stage 5, but the plan has 2 stages"):
        stage_pairs(plan, [stray])


def test_calibrate_fits_a_written_trace(tmp_path: Path) -> None:
    plan = example_plan()
    seconds = {"0F": 1.2e-3 + 1e-4, "0B": 2.4e-3 + 1e-4, "1F": 1.2e-3 + 1e-4, "1B": 2.4e-3 + 1e-4}
    trace = write_chrome_trace(tmp_path / "t.json", _events(plan, seconds, steps=2), title="measured", pid=1)
    got = calibrate(plan, trace, plan_label="plan/")
    assert (got.scale, got.action_s) == pytest.approx((1.2, 1e-4))
    assert "t.json" in got.source and "plan/" in got.source
    with pytest.raises(CalibrationError, match="does not exist"):
        calibrate(plan, tmp_path / "missing.json")
    for text in ("[1, 2", "[1, 2]"):  # not JSON; JSON of another shape
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(CalibrationError, match="not a trace"):
            calibrate(plan, tmp_path / "bad.json")


def test_calibrating_a_calibrated_plan_fits_from_the_uncalibrated_costs(tmp_path: Path) -> None:
    plan = example_plan()
    before = Calibration(2.0, 1e-4)
    made = recalibrated(plan, before)  # as if planned with --calibration
    assert plan_calibration(made) == Calibration(2.0, 1e-4)
    # The run shows raw x 3 + 0.3 ms: relative to the calibrated prediction that is 1.5 x + 0.15 ms.
    raw = {"F": 1e-3, "B": 2e-3}
    seconds = {f"{s}{k}": 3 * raw[k] + 3e-4 for s in (0, 1) for k in "FB"}
    trace = write_chrome_trace(tmp_path / "t.json", _events(made, seconds, steps=2), title="measured", pid=1)
    got = calibrate(made, trace)
    assert (got.scale, got.action_s) == pytest.approx((3.0, 3e-4))


# ----------------------------------------------------------------- a plan under a calibration


def test_recalibrated_scales_each_action_and_simulates_again() -> None:
    plan = example_plan()
    assert recalibrated(plan, Calibration()).predicted.step_s == pytest.approx(simulate(plan).step_s)
    c = Calibration(2.0, 5e-4)
    got = recalibrated(plan, c)
    for old, new in zip(plan.stages, got.stages, strict=True):
        assert new.predicted.forward_s == pytest.approx(2 * old.predicted.forward_s + 5e-4)
        assert new.predicted.backward_s == pytest.approx(2 * old.predicted.backward_s + 5e-4)
    assert got.predicted.step_s > 2 * simulate(plan).step_s - 1e-3  # compute doubles, messages stay
    assert (got.cost_model.calibration_scale, got.cost_model.action_host_s) == (2.0, 5e-4)
    back = recalibrated(got, Calibration())  # undoes it
    assert back.predicted.step_s == pytest.approx(simulate(plan).step_s)
    assert Plan.from_json(got.to_json()) == got  # recorded in plan.json


def test_a_split_backward_pays_the_host_time_in_b_and_w() -> None:
    plan = example_plan()
    with_w = tuple(tuple(x for a in row for x in ((a, a.replace("B", "W")) if "B" in a and "R" not in a
                                                  and "S" not in a else (a,))) for row in plan.actions)
    plan = dataclasses.replace(plan, schedule="zb-h1", actions=with_w)
    assert plan.schedule_data().splits_backward
    stages = tuple(dataclasses.replace(st, predicted=dataclasses.replace(st.predicted, weight_s=8e-4))
                   for st in plan.stages)
    plan = dataclasses.replace(plan, stages=stages)
    got = recalibrated(plan, Calibration(1.0, 1e-4))
    for new in got.stages:
        assert new.predicted.forward_s == pytest.approx(1e-3 + 1e-4)
        assert new.predicted.backward_s == pytest.approx(2e-3 + 2e-4)  # B and W: one action each
        assert new.predicted.weight_s == pytest.approx(8e-4 + 1e-4)


def test_plans_without_calibration_fields_still_load() -> None:
    data = json.loads(example_plan().to_json())
    del data["cost_model"]["calibration_scale"], data["cost_model"]["action_host_s"]
    del data["cost_model"]["action_jitter"]
    assert plan_calibration(Plan.from_json(json.dumps(data))).identity


def test_with_replicas_the_backward_that_waits_for_the_all_reduce_is_left_out() -> None:
    plan = dataclasses.replace(example_plan(), dp=2)  # 2 micro-batches: B1 of each stage all-reduces
    seconds = {"0F": 1e-3, "0B": 2e-3, "1F": 1e-3, "1B": 2e-3}
    events = [dataclasses.replace(e, end_s=e.end_s + (0.5 if e.action.endswith("B1") else 0.0))
              for e in _events(plan, seconds, steps=2)]
    assert fit(stage_pairs(plan, events)).scale == pytest.approx(1.0)
    assert fit(stage_pairs(dataclasses.replace(plan, dp=1), events)).scale > 10  # counted, it would dominate


# ----------------------------------------------------------------- jitter


def _jittered(sigma: float, *, count: int, seed: int) -> list[TimelineEvent]:
    """One stage's forwards of ``count`` steps, each 2 ms times exp(sigma x N(0, 1))."""
    rng = random.Random(seed)
    events, clock = [], 0.0
    for step in range(count):
        d = 2e-3 * math.exp(rng.gauss(0.0, sigma))
        events.append(TimelineEvent(0, "F0", "0F0", 0, "F", clock, clock + d))
        clock += d
    return events


def test_the_jitter_of_a_trace_is_the_spread_of_its_actions_about_their_median() -> None:
    assert action_jitter(_jittered(0.2, count=400, seed=1)) == pytest.approx(0.2, rel=0.15)
    assert action_jitter(_jittered(0.0, count=400, seed=1)) == pytest.approx(0.0, abs=1e-12)  # float rounding
    # Two traces pool their actions, each about its own medians (their stage numbers are their own).
    fast = [dataclasses.replace(e, end_s=e.start_s + (e.end_s - e.start_s) / 4) for e in _jittered(0.1, count=200, seed=2)]
    assert action_jitter(fast, _jittered(0.1, count=200, seed=3)) == pytest.approx(0.1, rel=0.2)
    assert action_jitter(_jittered(0.2, count=6, seed=1)) == 0.0  # too few actions to tell


def test_jitter_travels_with_the_calibration_and_reaches_the_plan(tmp_path: Path) -> None:
    c = Calibration(1.1, 0.0, jitter=0.15)
    assert load_calibration(c.save(tmp_path / "c.json")) == c
    old = {k: v for k, v in c.to_json().items() if k != "jitter"}  # a file from before jitter
    assert Calibration.from_json(old).jitter == 0.0
    with pytest.raises(CalibrationError, match="jitter"):
        Calibration(1.0, 0.0, jitter=-0.1)
    plan = example_plan()
    jittered = recalibrated(plan, c)
    assert plan_calibration(jittered) == Calibration(1.1, 0.0, jitter=0.15)
    assert Plan.from_json(jittered.to_json()).cost_model.action_jitter == 0.15
    # Late peers cost waiting: the median jittered step is longer than the steady one.
    assert jittered.predicted.step_s > recalibrated(plan, Calibration(1.1, 0.0)).predicted.step_s
