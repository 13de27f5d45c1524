"""Calibrate from a traced run: pair a plan's predictions with what its actions took, and predict again.

The numbers side (:class:`~partitioner.cost.calibration.Calibration`, :func:`~partitioner.cost.calibration.fit`)
is in the cost pass; this module reads a plan and a trace (``autopartition run --trace``,
``Pipeline.write_trace``), and re-predicts a plan's step under a calibration
with the search's own :func:`~partitioner.search.assemble.predict`.  It sits in
``search/`` because it needs the plan, the timeline and the simulator alike.

Example::

    >>> from partitioner.plan import example_plan
    >>> plan_calibration(example_plan()).identity
    True
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

from partitioner.cost.calibration import Calibration, CalibrationError, fit
from partitioner.defaults import MAX_ACTION_JITTER
from partitioner.orders import Action
from partitioner.plan import Plan
from partitioner.schedule.timeline import TimelineEvent, read_events
from partitioner.search.assemble import predict

__all__ = ["action_jitter", "calibrate", "plan_calibration", "recalibrated", "stage_pairs"]

_KINDS = ("F", "B", "W")
_JITTER_MIN_S = 100e-6  # actions shorter than this are host time, not compute


def stage_pairs(plan: Plan, events: Iterable[TimelineEvent]) -> list[tuple[float, float]]:
    """(predicted, measured median) seconds for each stage's F, B and W found in ``events``.

    B is the stage's backward less its W under a schedule that splits it, else
    the whole backward.  Predictions are the plan's own (calibrated ones where
    the plan was made with a calibration).  A trace holds every step of its run
    and a process's first steps run slower (memory still being mapped): only the
    later half of each action's occurrences (its later steps) count, by their
    median (one action that waited for a shared core does not move it).  With
    replicas, a stage's last backward of a step (and its W) also waits for the
    gradient all-reduce, which the simulator prices apart: those are left out.
    """
    split = plan.schedule_data().splits_backward
    events = list(events)
    for e in events:
        if e.kind in _KINDS and not 0 <= Action.parse(e.action).stage < len(plan.stages):
            raise CalibrationError(
                f"the trace has action {e.action} for stage {Action.parse(e.action).stage}, but the plan has "
                f"{len(plan.stages)} stages: give the plan the trace was recorded with")
    durations = _later_durations(events, all_reduce_microbatch=plan.microbatches - 1 if plan.dp > 1 else None)
    pairs = []
    for (stage, kind), seconds in sorted(durations.items()):
        p = plan.stages[stage].predicted
        predicted = {"F": p.forward_s, "B": p.backward_s - (p.weight_s if split else 0.0), "W": p.weight_s}[kind]
        pairs.append((predicted, statistics.median(seconds)))
    return pairs


def action_jitter(*traces: Iterable[TimelineEvent]) -> float:
    """How far single compute actions stray from their stage's median: the std of log(seconds / median).

    Over the later half of each trace's steps (as :func:`stage_pairs`), every
    (stage, kind) with 4 occurrences or more and a median of 100 us or more (a
    first stage's empty B is all host time), pooled over ``traces`` (each of one
    plan: its stage numbers are its own).  0 with fewer than 8 such actions.

    >>> from partitioner.schedule.timeline import TimelineEvent
    >>> def events(seconds):
    ...     return [TimelineEvent(0, "F", "0F0", 0, "F", 0.0, s) for s in seconds]
    >>> round(action_jitter(events([1e-3] * 8 + [2e-3, 1e-3, 0.5e-3, 1e-3] * 2)), 3)   # later half
    0.49
    >>> action_jitter(events([1e-3] * 16))
    0.0
    """
    logs: list[float] = []
    for events in traces:
        for seconds in _later_durations(events, all_reduce_microbatch=None).values():
            middle = statistics.median(seconds)
            if len(seconds) >= 4 and middle >= _JITTER_MIN_S:
                logs.extend(math.log(max(x, 1e-9) / middle) for x in seconds)
    return min(MAX_ACTION_JITTER, statistics.pstdev(logs)) if len(logs) >= 8 else 0.0


def _later_durations(events: Iterable[TimelineEvent], *,
                     all_reduce_microbatch: int | None) -> dict[tuple[int, str], list[float]]:
    """Seconds of each (stage, kind) of F, B, W over the later half of each action's occurrences (its later
    steps: a process's first steps run slower while memory is mapped).  ``all_reduce_microbatch``: B and W of
    that micro-batch are left out (with replicas they also wait for the gradient all-reduce)."""
    occurrences: dict[str, list[float]] = {}  # per action (0F3), in run order: one per step
    for e in events:
        if e.kind not in _KINDS:
            continue
        action = Action.parse(e.action)
        if action.kind != "F" and action.microbatch == all_reduce_microbatch:
            continue
        occurrences.setdefault(e.action, []).append(e.end_s - e.start_s)
    durations: dict[tuple[int, str], list[float]] = {}
    for name, seconds in occurrences.items():
        action = Action.parse(name)
        durations.setdefault((action.stage, action.kind), []).extend(seconds[len(seconds) // 2:])
    return durations


def calibrate(plan: Plan, trace: str | Path, *, plan_label: str = "") -> Calibration:
    """The calibration a traced run of ``plan`` gives, from the plan's uncalibrated costs."""
    path = Path(trace)
    if not path.is_file():
        raise CalibrationError(f"trace {path} does not exist; record one with `autopartition run --trace {path}`.")
    try:
        events = read_events(path)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, or JSON of another shape
        raise CalibrationError(f"{path} is not a trace written by autopartition ({exc}).") from exc
    fitted = fit(stage_pairs(plan, events))
    source = f"{path}" + (f" of {plan_label}" if plan_label else "")
    return plan_calibration(plan).then(dataclasses.replace(fitted, source=source, jitter=action_jitter(events)))


def recalibrated(plan: Plan, calibration: Calibration) -> Plan:
    """``plan`` (same split, same schedule) with its stage costs and step predicted under ``calibration``.

    The plan's stage predictions are taken back to uncalibrated costs (undoing
    the calibration it was made with) and ``calibration`` applied: F, B and W
    each ``scale x`` theirs ``+ action_s``; the step is simulated again.  (A
    split backward's measured host cost is scaled with the rest, a small error.)
    """
    before = plan_calibration(plan)
    split = plan.schedule_data().splits_backward

    def again(seconds: float, actions: int) -> float:
        raw = max(0.0, seconds - actions * before.action_s) / before.scale
        return calibration.scale * raw + actions * calibration.action_s

    stages = []
    for st in plan.stages:
        p = st.predicted
        weight = again(p.weight_s, 1) if split else p.weight_s / before.scale * calibration.scale
        stages.append(dataclasses.replace(st, predicted=dataclasses.replace(
            p, forward_s=again(p.forward_s, 1), backward_s=again(p.backward_s, 2 if split else 1),
            weight_s=weight, recompute_s=p.recompute_s / before.scale * calibration.scale)))
    cost_model = dataclasses.replace(plan.cost_model, calibration_scale=calibration.scale,
                                     action_host_s=calibration.action_s, action_jitter=calibration.jitter)
    return predict(dataclasses.replace(plan, stages=tuple(stages), cost_model=cost_model))


def plan_calibration(plan: Plan) -> Calibration:
    """The calibration ``plan`` was made with (none: the identity)."""
    cm = plan.cost_model
    return Calibration(cm.calibration_scale, cm.action_host_s, jitter=cm.action_jitter)
