"""Chrome / Perfetto traces of timelines: valid JSON, named tracks, and a lossless round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.schedule import compute_order, lower
from partitioner.simulate import simulate_schedule
from partitioner.timeline import (
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
    sched = lower(compute_order("1f1b", stages=stages, microbatches=4), sends_to=sends_to, receives_from=receives_from)
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
    assert [names[t] for t in (0, 1, 2)] == ["stage 0", "stage 1", "stage 2"]
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
