"""Calibration: how a real run's actions compare with the plan's predictions, fitted and applied.

A plan's stage costs are measured in one process, on one micro-batch, a pass at
a time.  Inside a running pipeline the same stage also pays what that
measurement cannot see: the runtime's own host work per action (posting
receives, handing tensors over, a split backward's bookkeeping) and, where
ranks share a host's cores, each other's load.  A :class:`Calibration` fits
both from a traced run of any plan (``autopartition run --trace``, or
``Pipeline.write_trace``):

    measured median of a stage's F, B or W = scale x predicted + action_s

by least squares over every (stage, kind) of the trace (:func:`fit`), and
how far single actions stray from their stage's median (:func:`action_jitter`):
the simulator then runs each step with actions drawn about their times, which
costs a tightly coupled schedule (1F1B) more waiting than a zero-bubble one.
``autopartition plan --calibration FILE`` then multiplies every measured node
time by ``scale`` and charges ``action_s`` to each compute action (F, B, and W
where the backward is split), in the solver's closed forms, the refinement's
simulator and the plan's stage predictions alike.  A plan made with a
calibration records it (``cost_model.calibration``); calibrating from a trace of
such a plan composes the two (:meth:`Calibration.then`), so the fit always
relates the run to uncalibrated costs.

Example::

    >>> c = fit([(1.0, 1.5), (2.0, 2.7), (4.0, 5.1)])
    >>> round(c.scale, 3), round(c.action_s, 3)
    (1.2, 0.3)
    >>> Calibration.from_json(c.to_json()) == c
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from partitioner.errors import AutopartitionError
from partitioner.plan import MAX_ACTION_JITTER, Plan
from partitioner.schedule import Action
from partitioner.timeline import TimelineEvent, read_events

__all__ = ["Calibration", "CalibrationError", "action_jitter", "calibrate", "fit", "load_calibration",
           "plan_calibration", "recalibrated", "stage_pairs"]

_KINDS = ("F", "B", "W")
_FORMAT = "autopartition-calibration"
_JITTER_MIN_S = 100e-6  # actions shorter than this are host time, not compute


class CalibrationError(AutopartitionError):
    """A calibration file or trace that cannot be used; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """``measured = scale x predicted + action_s`` per compute action; ``samples`` (stage, kind) pairs fitted.

    ``jitter``: the standard deviation of log(an action's seconds / its stage's median) (0: none).
    """

    scale: float = 1.0
    action_s: float = 0.0
    samples: int = 0
    source: str = ""  # what it was fitted from (a trace's path and plan)
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise CalibrationError(f"calibration scale is {self.scale}; it must be a positive number")
        if not (math.isfinite(self.action_s) and self.action_s >= 0):
            raise CalibrationError(f"calibration action_s is {self.action_s}; it must be 0 or more seconds")
        if not 0 <= self.jitter <= MAX_ACTION_JITTER:
            raise CalibrationError(
                f"calibration jitter is {self.jitter}; it must be between 0 and {MAX_ACTION_JITTER}")

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.action_s == 0.0 and self.jitter == 0.0

    def then(self, fitted: Calibration) -> Calibration:
        """This calibration followed by one ``fitted`` on a plan made with it: one calibration from raw costs.

        The spread is the newer trace's (it is measured, not relative to the plan).

        >>> Calibration(2.0, 0.1).then(Calibration(1.5, 0.2))   # 1.5 (2 x + 0.1) + 0.2
        Calibration(scale=3.0, action_s=0.35000000000000003, samples=0, source='', jitter=0.0)
        """
        return Calibration(self.scale * fitted.scale, fitted.scale * self.action_s + fitted.action_s,
                           fitted.samples, fitted.source, fitted.jitter)

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, **dataclasses.asdict(self)}

    @staticmethod
    def from_json(data: Any, *, where: str = "calibration") -> Calibration:
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise CalibrationError(
                f"{where} is not an autopartition calibration (no \"format\": \"{_FORMAT}\"). "
                "Make one with `autopartition calibrate PLAN_DIR TRACE.json -o calibration.json`.")
        try:
            return Calibration(scale=float(data["scale"]), action_s=float(data["action_s"]),
                               samples=int(data.get("samples", 0)), source=str(data.get("source", "")),
                               jitter=float(data.get("jitter", 0.0)))  # files before it: none
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{where} is missing or garbles a field ({exc}); "
                                   "make it again with `autopartition calibrate`.") from exc

    def save(self, path: str | Path) -> Path:
        target = Path(path)
        target.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return target


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file written by :meth:`Calibration.save` (data only: nothing in it is run)."""
    target = Path(path)
    if not target.is_file():
        raise CalibrationError(f"calibration file {target} does not exist; make one with `autopartition calibrate`.")
    try:
        data = json.loads(target.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"calibration file {target} is not JSON ({exc}).") from exc
    return Calibration.from_json(data, where=f"calibration file {target}")


def fit(pairs: Sequence[tuple[float, float]]) -> Calibration:
    """Least-squares ``measured = scale x predicted + action_s`` over (predicted, measured) seconds.

    ``action_s`` is kept at 0 or more (a negative one would make small actions
    free); with fewer than two distinct predictions only ``scale`` is fitted.

    >>> fit([(1.0, 1.2), (1.0, 1.2)])
    Calibration(scale=1.2, action_s=0.0, samples=2, source='', jitter=0.0)
    >>> fit([(1.0, 1.0), (2.0, 3.0)]).action_s   # would be -1: held at 0, scale refitted
    0.0
    """
    pairs = [(p, m) for p, m in pairs if p > 0 and m > 0]
    if not pairs:
        raise CalibrationError(
            "no compute action to fit: the trace holds no F, B or W of the plan's stages. Record it on this "
            "plan with Pipeline(..., trace=True) and write_trace (examples/train_gpt.py --trace), for 2 steps or more.")
    xs, ys = [p for p, _ in pairs], [m for _, m in pairs]
    through_origin = sum(x * y for x, y in pairs) / sum(x * x for x in xs)
    if len(set(xs)) < 2:
        return Calibration(through_origin, 0.0, len(pairs))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    scale = sum((x - mx) * (y - my) for x, y in pairs) / sxx
    action = my - scale * mx
    if action < 0 or scale <= 0:
        return Calibration(through_origin, 0.0, len(pairs))
    return Calibration(scale, action, len(pairs))


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

    >>> from partitioner.timeline import TimelineEvent
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
    # assemble imports the planner's options, which import this module: imported here.
    from partitioner.assemble import predict

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
