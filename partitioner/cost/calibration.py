"""Calibration: how a real run's actions compare with the plan's predictions, fitted and applied.

A plan's stage costs are measured in one process, on one micro-batch, a pass at
a time.  Inside a running pipeline the same stage also pays what that
measurement cannot see: the runtime's own host work per action (posting
receives, handing tensors over, a split backward's bookkeeping) and, where
ranks share a host's cores, each other's load.  A :class:`Calibration` fits
both from a traced run of any plan (``autopartition run --trace``, or
``Pipeline.write_trace``):

    measured median of a stage's F, B or W = scale x predicted + action_s

by least squares over every (stage, kind) of the trace (:func:`fit`; the trace is read and paired
with the plan in :mod:`partitioner.search.calibrate`), and how far single actions stray from their
stage's median (:func:`partitioner.search.calibrate.action_jitter`):
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from partitioner.defaults import MAX_ACTION_JITTER
from partitioner.errors import AutopartitionError

__all__ = ["Calibration", "CalibrationError", "fit", "load_calibration"]

_FORMAT = "autopartition-calibration"


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
