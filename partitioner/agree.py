"""One plan for every rank: plan digests, and compiling once inside a process group.

Ranks that each solve their own plan can disagree (measured costs are noisy), and
ranks running different splits compute a wrong loss or hang.  Two guards:

* :func:`plan_digest` hashes everything in a plan that the runtime executes;
  ``runtime.Pipeline`` compares it across ranks before the first step.
* :func:`solved_on_rank0` wraps :func:`partitioner.compile`: inside an
  initialised process group rank 0 solves and broadcasts ``plan.json``'s text
  (never a pickled ``Plan``), and the other ranks load it.  An error on rank 0
  is broadcast too and raised on every rank, so nobody waits for a plan that
  never comes.

Uses ``torch.distributed`` directly: partitioner modules never import the runtime.

Example::

    >>> from partitioner.plan import example_plan
    >>> plan_digest(example_plan()) == plan_digest(Plan.from_json(example_plan().to_json()))
    True
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any, ParamSpec

import torch.distributed as dist

from partitioner import errors
from partitioner.errors import AutopartitionError, InternalError
from partitioner.plan import Plan

__all__ = ["COMPILE_WAIT_S", "INFORMATIONAL_FIELDS", "in_process_group", "plan_digest", "plan_sections",
           "solved_on_rank0"]

# How long the other ranks wait for rank 0 to compile (torch's own default for gloo collectives).
COMPILE_WAIT_S = 1800.0
# Plan fields that never change what a step computes, and differ between two compiles of the
# same model (timings): predictions, solver statistics, the candidate table, the cost model,
# the readable stage code (generated from the nodes, which are hashed).  Everything else,
# including fields added later, is part of the digest.
INFORMATIONAL_FIELDS = ("predicted", "solver", "candidates", "cost_model", "stage_code")
_STAGE_INFORMATIONAL = ("predicted",)

_P = ParamSpec("_P")


def plan_sections(plan: Plan) -> dict[str, str]:
    """A short hash of each top-level field of ``plan`` that the runtime executes.

    The plan goes through its JSON round trip first, so a plan compiled in memory and
    the same plan loaded from ``plan.json`` hash alike (``25`` vs ``25.0``).
    """
    data = json.loads(Plan.from_json(plan.to_json(), origin="the plan").to_json())
    for name in INFORMATIONAL_FIELDS:
        data.pop(name, None)
    for stage in data["stages"]:
        for name in _STAGE_INFORMATIONAL:
            stage.pop(name, None)
    return {key: _sha(value)[:12] for key, value in sorted(data.items())}


def plan_digest(plan: Plan) -> str:
    """sha256 (hex) of what ``plan`` makes every rank execute; equal digests, equal steps."""
    return _sha(plan_sections(plan))


def in_process_group() -> bool:
    """True inside an initialised ``torch.distributed`` job of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def solved_on_rank0(compile_fn: Callable[_P, Plan]) -> Callable[_P, Plan]:
    """Decorate ``compile``: inside a process group, rank 0 solves and every rank gets its plan.

    Outside one (the CLI, a notebook, a script before ``init_process_group``) the call
    is unchanged.  Inside one, the call is collective: every rank must make it.
    """

    @functools.wraps(compile_fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> Plan:
        if not in_process_group():
            return compile_fn(*args, **kwargs)
        return _compile_on_rank0(lambda: compile_fn(*args, **kwargs))

    return wrapper


# --------------------------------------------------------------- helpers


def _sha(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _compile_on_rank0(build: Callable[[], Plan]) -> Plan:
    # A gloo group of its own: objects travel on the CPU whatever the default backend
    # (NCCL needs CUDA tensors), and the wait for rank 0 is COMPILE_WAIT_S, not the
    # default group's timeout, which may be a few seconds.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=COMPILE_WAIT_S))
    try:
        if dist.get_rank() == 0:
            try:
                plan = build()
            except Exception as exc:
                _broadcast(group, ["error", type(exc).__name__, str(exc)])
                raise
            _broadcast(group, ["plan", plan.to_json()])
            return plan  # rank 0 keeps its own, block graph and all
        payload: list[Any] = []
        _broadcast(group, payload)
        return _received(payload)
    finally:
        dist.destroy_process_group(group)


def _broadcast(group: dist.ProcessGroup, payload: list[Any]) -> None:
    """Broadcast ``payload`` (strings only) from rank 0 in place; a timeout or dead rank 0 is explained."""
    obj = [payload]
    try:
        dist.broadcast_object_list(obj, src=0, group=group)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise AutopartitionError(
            "Inside a process group compile() is collective: rank 0 solves and sends its plan to every "
            f"other rank, and that exchange failed ({first}). Call compile() in every rank, or compile "
            "once before init_process_group (or with `autopartition model.py --out plan/`), save it, and "
            "`Plan.load` it in every rank."
        ) from exc
    payload[:] = obj[0]


def _received(payload: list[str]) -> Plan:
    """The plan rank 0 sent, or its error raised here as the same kind."""
    if payload[0] == "plan":
        return Plan.from_json(payload[1], origin="the plan rank 0 sent")
    _, kind, message = payload
    where = "(raised on rank 0, which compiles the plan for every rank)"
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, AutopartitionError):
        raise cls(f"{message} {where}")
    raise InternalError(f"compile() failed on rank 0 with {kind}: {message} {where}; see rank 0's traceback.")
