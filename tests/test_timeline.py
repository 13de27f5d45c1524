"""Chrome / Perfetto traces of timelines: valid JSON, named tracks, and a lossless round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from partitioner.schedule.lower import compute_order, lower
from partitioner.schedule.simulate import simulate_schedule
from partitioner.schedule.timeline import (
    TimelineEvent,
    chrome_trace,
    events_from_trace,
    read_events,
    write_chrome_trace,
)


def _events() -> list[TimelineEvent]:
    stages = 3
    sends_to = tuple((s + 1,) if s + 1 < stages else () for s in range(stages))
    receives_from = tuple((s - 1,) if s else () for s in range(stages))
    sched = lower(compute_order("1f1b", ranks=stages, microbatches=4), sends_to=sends_to, receives_from=receives_from)
    sim = simulate_schedule(sched, forward_s=[1e-3, 1.2e-3, 0.9e-3], backward_s=[2e-3, 2.1e-3, 1.7e-3],
                            transfer_s=1e-4, allreduce_s=[1e-3, 2e-3, 0.0], buckets=3)
    return list(sim.events)


def test_trace_is_valid_json_with_named_tracks() -> None:
    events = _events()
    trace = json.loads(json.dumps(chrome_trace(events, title="predicted")))
    records = trace["traceEvents"]
    complete = [e for e in records if e["ph"] == "X"]
    assert len(complete) == len(events)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0 for e in complete)
    names = {e["tid"]: e["args"]["name"] for e in records if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(names) == len([e for e in records if e["ph"] == "M" and e["name"] == "thread_name"])
    assert set(names) == {e["tid"] for e in complete}  # one name per thread used, no more
    assert [names[t] for t in (0, 1, 2)] == ["pipeline rank 0", "pipeline rank 1", "pipeline rank 2"]
    assert sum(1 for n in names.values() if n.endswith("all-reduce")) == 2  # stage 2 has none
    forward = next(e for e in complete if e["args"]["action"] == "1F2")
    assert forward["name"] == "F2" and forward["args"]["stage"] == 1 and forward["args"]["microbatch"] == 2
    process = [e for e in records if e["ph"] == "M" and e["name"] == "process_name"]
    assert process[0]["args"]["name"] == "predicted"


def test_write_and_read_round_trip(tmp_path: Path) -> None:
    events = _events()
    path = write_chrome_trace(tmp_path / "trace.json", events, title="predicted")
    back = read_events(path)
    assert len(back) == len(events)
    for a, b in zip(events, back):
        assert (a.track, a.label, a.action, a.microbatch, a.kind) == (b.track, b.label, b.action, b.microbatch, b.kind)
        assert (b.start_s, b.end_s) == pytest.approx((a.start_s, a.end_s), abs=1e-12)


def test_measured_ranks_under_another_pid() -> None:
    measured = [TimelineEvent(3, "B1", "1B1", 1, "B", 0.5, 0.75)]
    trace = chrome_trace(measured, title="measured", pid=1, track_name="rank")
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["rank 3"]
    assert events_from_trace(trace, pid=0) == []
    assert events_from_trace(trace, pid=1) == measured


def test_weight_gradients_have_their_own_colour() -> None:
    from partitioner.schedule.timeline import COMPUTE_KINDS, KIND_COLORS

    events = [TimelineEvent(0, "F0", "0F0", 0, "F", 0.0, 1.0), TimelineEvent(0, "B0", "0B0", 0, "B", 1.0, 2.0),
              TimelineEvent(0, "W0", "0W0", 0, "W", 2.0, 3.0), TimelineEvent(0, "SB0", "0SB0", 0, "SB", 2.0, 2.0)]
    colours = {e["args"]["action"]: e.get("cname") for e in chrome_trace(events, title="t")["traceEvents"]
               if e["ph"] == "X"}
    assert colours["0W0"] == KIND_COLORS["W"] and len({colours["0F0"], colours["0B0"], colours["0W0"]}) == 3
    assert colours["0SB0"] is None  # a send takes no time: nothing to colour
    assert "W" in COMPUTE_KINDS
    assert events_from_trace(chrome_trace(events, title="t")) == events


def test_one_track_per_pipeline_rank() -> None:
    # ZB-V on 2 ranks: four stages, two tracks; each event still names its stage.
    from partitioner.orders import stage_ranks

    where = stage_ranks("zbv", ranks=2, chunks=2)
    chain: dict[str, Any] = {"sends_to": ((1,), (2,), (3,), ()), "receives_from": ((), (0,), (1,), (2,))}
    sched = lower(compute_order("zbv", ranks=2, microbatches=3, chunks=2), stage_rank=where, **chain)
    sim = simulate_schedule(sched, forward_s=[1e-3] * 4, backward_s=[2e-3] * 4, weight_s=[1e-3] * 4,
                            allreduce_s=[1e-3] * 4, stage_rank=where, **chain)
    trace = chrome_trace(sim.events, title="predicted")
    names = sorted(e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name")
    assert names == ["pipeline rank 0", "pipeline rank 0 all-reduce", "pipeline rank 1", "pipeline rank 1 all-reduce"]
    stages_on = {(e["tid"], e["args"]["stage"]) for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] < 2}
    assert stages_on == {(0, 0), (0, 3), (1, 1), (1, 2)}
