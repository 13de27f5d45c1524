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
    "PropagationError",
    "ScheduleError",
]


class AutopartitionError(Exception):
    """Bad input from the user: the message explains the problem and the fix."""


class ModelFileError(AutopartitionError):
    """The model file is missing, does not import, or lacks a required name."""


class CaptureError(AutopartitionError):
    """The model cannot be turned into an fx graph."""


class PropagationError(CaptureError):
    """Running the captured graph on fake tensors failed at graph node ``node`` (captured by ``method``).

    ``op`` describes the node (its op and module), ``reason`` what it raised; ``where`` is
    the line of the model's code the node comes from, when known: the planner finds it
    for graphs captured without source lines (:meth:`at`).
    """

    def __init__(self, op: str, reason: str, advice: str, *, node: str, method: str,
                 where: str | None = None) -> None:
        self.op, self.reason, self.advice, self.node, self.method, self.where = op, reason, advice, node, method, where
        at = f", from {where}" if where else ""
        super().__init__(f"Shape propagation failed on the captured graph at {op}{at}: {reason}. {advice}")

    def at(self, where: str) -> PropagationError:
        """The same error, naming the model's line ``where`` (``file:line in function(): `code```)."""
        return PropagationError(self.op, self.reason, self.advice, node=self.node, method=self.method, where=where)


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
