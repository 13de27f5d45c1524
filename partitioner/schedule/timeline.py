"""Timelines: what each pipeline rank did and when, and their Chrome trace form.

A :class:`TimelineEvent` is one action of one track (a pipeline rank in a
simulation, a global rank in a measured run): ``0F3`` ran on track 0 from
``start_s`` to ``end_s``; the action names its stage, so a rank holding
several stages shows them on one track.  The simulator (:mod:`partitioner.schedule.simulate`) produces them, the
runtime records measured ones, and both are written with the same
:func:`write_chrome_trace`, so a predicted and a measured step open side by
side in ``chrome://tracing`` or https://ui.perfetto.dev.

The file follows the Trace Event Format (Google, "Trace Event Format",
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
complete events (``"ph": "X"``) with ``ts`` / ``dur`` in microseconds, and
metadata events (``"ph": "M"``) naming the process and each thread.  All-reduce
events overlap the backward that triggers them, so they get a thread of their
own next to their track's (slices on one thread must nest).  Compute slices
carry a colour per kind (:data:`KIND_COLORS`, as ``"cname"``: trace viewers
take a fixed palette of names), so weight-gradient ``W`` boxes stand apart
from ``B``.

Example::

    >>> events = [TimelineEvent(0, "F0", "0F0", 0, "F", 0.0, 1e-3),
    ...           TimelineEvent(1, "F0", "1F0", 0, "F", 1e-3, 2e-3)]
    >>> trace = chrome_trace(events, title="predicted")
    >>> [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    ['pipeline rank 0', 'pipeline rank 1']
    >>> [(e["ts"], e["dur"], e["cname"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    [(0.0, 1000.0, 'thread_state_runnable'), (1000.0, 1000.0, 'thread_state_runnable')]
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "ALLREDUCE_KIND",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "KIND_COLORS",
    "TimelineEvent",
    "chrome_trace",
    "events_from_trace",
    "read_events",
    "write_chrome_trace",
]

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SF", "RF", "SB", "RB")
ALLREDUCE_KIND = "AR"

# Trace-viewer colour names (catapult's reserved "cname" palette) per kind, close to the
# figures' colours: forward blue, backward orange-brown, weight gradient green.
KIND_COLORS = {
    "F": "thread_state_runnable",
    "B": "bad",
    "W": "good",
    "RF": "thread_state_sleeping",
    "RB": "thread_state_sleeping",
    ALLREDUCE_KIND: "thread_state_iowait",
}

# Thread ids of the all-reduce lanes: track k's lane is _LANE_OFFSET + k.
_LANE_OFFSET = 10_000
_US = 1e6
_STAGE_PREFIX = re.compile(r"^(\d+)")


@dataclasses.dataclass(frozen=True)
class TimelineEvent:
    """One action on one track, in seconds from the start of the step.

    ``label`` is what a picture shows (``F3``), ``action`` the schedule's name
    for it (``0F3``), ``kind`` one of ``F B W SF RF SB RB AR`` (``AR``: one
    gradient all-reduce bucket; its ``microbatch`` is -1).
    """

    track: int
    label: str
    action: str
    microbatch: int
    kind: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def chrome_trace(
    events: Iterable[TimelineEvent],
    *,
    title: str,
    pid: int = 0,
    track_name: str = "pipeline rank",
) -> dict[str, Any]:
    """The Trace Event Format dict for ``events`` (``pid`` 0: predicted; tracks named ``"{track_name} {k}"``).

    A simulation's tracks are pipeline ranks (the default name); a measured run names its global ranks ``"rank"``.
    """
    listed = list(events)
    trace: list[dict[str, Any]] = [_meta("process_name", pid, 0, {"name": title})]
    for tid, name, order in _threads(listed, track_name):
        trace.append(_meta("thread_name", pid, tid, {"name": name}))
        trace.append(_meta("thread_sort_index", pid, tid, {"sort_index": order}))
    for e in listed:  # in the given order, so that reading the file back gives the same list
        record: dict[str, Any] = {
            "name": e.label,
            "cat": e.kind,
            "ph": "X",
            "ts": e.start_s * _US,
            "dur": max(0.0, e.end_s - e.start_s) * _US,
            "pid": pid,
            "tid": _tid(e),
            "args": {
                "stage": _stage_of(e),
                "track": e.track,
                "microbatch": e.microbatch,
                "action": e.action,
                "kind": e.kind,
            },
        }
        if e.kind in KIND_COLORS:
            record["cname"] = KIND_COLORS[e.kind]
        trace.append(record)
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_chrome_trace(
    path: str | Path,
    events: Iterable[TimelineEvent],
    *,
    title: str,
    pid: int = 0,
    track_name: str = "pipeline rank",
) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``; open it in Perfetto or ``chrome://tracing``."""
    target = Path(path)
    target.write_text(json.dumps(chrome_trace(events, title=title, pid=pid, track_name=track_name)) + "\n")
    return target


def events_from_trace(trace: dict[str, Any], *, pid: int | None = None) -> list[TimelineEvent]:
    """The :class:`TimelineEvent` list back from a :func:`chrome_trace` dict (optionally one ``pid``'s), in file order."""
    found = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or (pid is not None and e.get("pid") != pid):
            continue
        args = e.get("args", {})
        start = float(e["ts"]) / _US
        found.append(TimelineEvent(
            track=int(args.get("track", e.get("tid", 0))),
            label=str(e.get("name", "")),
            action=str(args.get("action", e.get("name", ""))),
            microbatch=int(args.get("microbatch", -1)),
            kind=str(args.get("kind", e.get("cat", ""))),
            start_s=start,
            end_s=start + float(e.get("dur", 0.0)) / _US,
        ))
    return found


def read_events(path: str | Path, *, pid: int | None = None) -> list[TimelineEvent]:
    """Read a trace written by :func:`write_chrome_trace` (predicted or measured)."""
    return events_from_trace(json.loads(Path(path).read_text()), pid=pid)


def _tid(event: TimelineEvent) -> int:
    return _LANE_OFFSET + event.track if event.kind == ALLREDUCE_KIND else event.track


def _stage_of(event: TimelineEvent) -> int:
    match = _STAGE_PREFIX.match(event.action)
    return int(match[1]) if match else event.track


def _threads(events: list[TimelineEvent], track_name: str) -> list[tuple[int, str, int]]:
    """(tid, name, sort index) of every thread the events use, each track's all-reduce lane after it."""
    tids = sorted({_tid(e) for e in events} | {e.track for e in events})
    rows = []
    for tid in tids:
        if tid >= _LANE_OFFSET:
            track = tid - _LANE_OFFSET
            rows.append((tid, f"{track_name} {track} all-reduce", 2 * track + 1))
        else:
            rows.append((tid, f"{track_name} {tid}", 2 * tid))
    return rows


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
