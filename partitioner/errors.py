"""Errors: user-facing ones say what is wrong and what to do; internal ones are bugs.

The CLI turns any :class:`AutopartitionError` into a one-paragraph message and
exit code 2; an :class:`InternalError`, like any other exception, is a bug in
autopartition: the CLI prints its traceback and exits with code 1.
"""

from __future__ import annotations

__all__ = [
    "AutopartitionError",
    "CaptureError",
    "CheckpointError",
    "InfeasibleError",
    "InternalError",
    "ModelFileError",
    "PlanFormatError",
    "PlanMismatchError",
    "ScheduleError",
]


class AutopartitionError(Exception):
    """Bad input from the user: the message explains the problem and the fix."""


class ModelFileError(AutopartitionError):
    """The model file is missing, does not import, or lacks a required name."""


class CaptureError(AutopartitionError):
    """The model cannot be turned into an fx graph."""


class InfeasibleError(AutopartitionError):
    """No split satisfies the constraints (memory, stage count)."""


class PlanFormatError(AutopartitionError):
    """A plan directory is missing, corrupt, or from an unknown format version."""


class PlanMismatchError(AutopartitionError):
    """A plan was made for a different model (its graph fingerprint differs)."""


class ScheduleError(AutopartitionError):
    """A schedule is malformed or would deadlock."""


class CheckpointError(AutopartitionError):
    """A weights file or checkpoint is missing, of another model, or incomplete."""


class InternalError(Exception):
    """A broken invariant inside autopartition (a bug), never bad input.

    Deliberately not an :class:`AutopartitionError`: callers that catch bad input
    must not swallow bugs, and the CLI reports it with its traceback (exit code 1).
    """
