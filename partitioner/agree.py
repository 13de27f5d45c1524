"""One plan for every rank: plan digests, and compiling once inside a process group.

Ranks that each solve their own plan can disagree (measured costs are noisy), and
ranks running different splits compute a wrong loss or hang.  Two guards:

* :func:`plan_digest` hashes everything in a plan that the runtime executes;
  ``runtime.Pipeline`` compares it across ranks before the first step.
* :func:`solved_on_rank0` wraps :func:`partitioner.compile`: inside an
  initialised process group rank 0 solves and publishes ``plan.json``'s text
  (never a pickled ``Plan``) under a key of the job's store, without waiting
  for anyone; any other rank that calls ``compile()`` waits for that key and
  loads the plan.  An error on rank 0 is published too and raised on the
  ranks waiting for it; rank 0 lingers up to :data:`ERROR_LINGER_S` for them
  to read it, since outside torchrun rank 0's process hosts the store.  So both usual patterns work: every rank calls
  ``compile()``, or rank 0 alone compiles and saves, every rank waits at a
  barrier, then every rank calls ``Plan.load``.  The n-th ``compile()`` call
  of a rank gets rank 0's n-th plan.

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
import itertools
import json
import os
import time
from collections.abc import Callable
from typing import Any, ParamSpec

import torch.distributed as dist

from partitioner import errors
from partitioner.errors import AutopartitionError, InternalError
from partitioner.plan import Plan

__all__ = ["COMPILE_WAIT_S", "ERROR_LINGER_S", "INFORMATIONAL_FIELDS", "in_process_group", "plan_digest", "plan_sections",
           "solved_on_rank0"]

# How long the other ranks wait for rank 0's plan (torch's own default for gloo collectives).
# Read at each call, so a test can shorten it.
COMPILE_WAIT_S = 1800.0
# How long rank 0 keeps its failed compile() from raising while the other ranks read the error:
# outside torchrun (mp.spawn, env:// init) rank 0's process hosts the store, and a rank that
# arrives after it exited would see only "connection reset".  Ends as soon as all have read.
ERROR_LINGER_S = 10.0
_STORE_PREFIX = "compile/"
# This process's compile() calls in the current process group: call n reads rank 0's n-th plan,
# so several compiles in one job never collide; a new group (a new store) counts from 0 again.
_COUNTER: list[Any] = [None, itertools.count()]  # [the default group counted for, its calls]
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
    is unchanged.  Inside one, rank 0 solves and publishes the plan in the job's store
    without waiting for the other ranks; another rank that calls it waits for rank 0's
    plan (at most :data:`COMPILE_WAIT_S` seconds) instead of solving its own.
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
    # No collective: rank 0 may be the only rank that calls compile() (it compiles and saves,
    # the others wait at a barrier to Plan.load), so it publishes and never waits for anyone.
    call = _next_call()
    key = f"{_STORE_PREFIX}{call}"
    store = _job_store()
    if dist.get_rank() == 0:
        try:
            plan = build()
        except BaseException as exc:  # published for the waiting ranks, then raised here
            _publish(store, key, {"error": [type(exc).__name__, str(exc)]})
            _linger_until_read(store, key)
            raise
        _publish(store, key, {"plan": plan.to_json()})
        return plan  # rank 0 keeps its own, block graph and all
    payload = _wait_for(store, key, call)
    if "error" in payload:
        store.add(key + _READ_SUFFIX, 1)  # lets rank 0 stop lingering
    return _received(payload)


_READ_SUFFIX = "/error-read"


def _linger_until_read(store: dist.Store, key: str) -> None:
    """Wait (at most :data:`ERROR_LINGER_S`) until every other rank has read rank 0's error."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return  # torchrun's agent hosts the store: it outlives this process
    others = dist.get_world_size() - 1
    deadline = time.monotonic() + ERROR_LINGER_S
    try:
        while store.add(key + _READ_SUFFIX, 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:
        pass  # the store is gone: nothing left to wait for; the original error is raised


def _next_call() -> int:
    """This compile() call's number in the current process group (0, 1, ...)."""
    world = dist.group.WORLD
    if _COUNTER[0] is not world:  # holding the group keeps its id from being reused
        _COUNTER[:] = [world, itertools.count()]
    return next(_COUNTER[1])


def _job_store() -> dist.Store:
    """The key-value store every rank of the job reaches: the default group's (its rendezvous store)."""
    from torch.distributed import distributed_c10d

    default_store = getattr(distributed_c10d, "_get_default_store", None)  # torch >= 2.1; not public
    if default_store is not None:
        return dist.PrefixStore("autopartition", default_store())
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise AutopartitionError(
            "compile() inside a process group needs the job's store, which this torch does not expose, "
            "and MASTER_ADDR / MASTER_PORT are not set. Compile before init_process_group (or with "
            "`autopartition model.py --out plan/`), save the plan, and `Plan.load` it in every rank."
        )
    return dist.PrefixStore("autopartition", dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False))


def _publish(store: dist.Store, key: str, payload: dict[str, Any]) -> None:
    try:
        store.set(key, json.dumps(payload))
    except RuntimeError as exc:
        raise AutopartitionError(
            f"Rank 0 could not publish its compile() result in the job's store ({_first_line(exc)}); the "
            "other ranks' compile() calls will time out. Check that the job's rendezvous is alive."
        ) from exc


def _wait_for(store: dist.Store, key: str, call: int) -> dict[str, Any]:
    """Rank 0's published result of compile() call ``call``; a clear error when it never comes."""
    wait_s = COMPILE_WAIT_S
    start = time.monotonic()
    try:
        store.wait([key], datetime.timedelta(seconds=wait_s))
        text = store.get(key)
    except RuntimeError as exc:  # DistStoreError (timeout) and DistNetworkError (rank 0's store gone)
        waited = time.monotonic() - start
        nth = "first" if call == 0 else f"call #{call + 1}"
        raise AutopartitionError(
            f"Rank {dist.get_rank()} waited {waited:.0f} s in compile() ({nth} in this process) for the plan "
            f"that rank 0 solves and got none ({_first_line(exc)}). Inside a process group rank 0 solves "
            "every compile() and the other ranks wait for its plan: rank 0 must make the same compile() "
            "calls (or compile alone, save, barrier, and every rank `Plan.load`s), and must not have died."
        ) from exc
    payload: dict[str, Any] = json.loads(text)
    return payload


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def _received(payload: dict[str, Any]) -> Plan:
    """The plan rank 0 published, or its error raised here as the same kind."""
    if "plan" in payload:
        return Plan.from_json(payload["plan"], origin="the plan rank 0 sent")
    kind, message = payload["error"]
    where = "(raised on rank 0, which compiles the plan for every rank)"
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, AutopartitionError):
        raise cls(f"{message} {where}")
    raise InternalError(f"compile() failed on rank 0 with {kind}: {message} {where}; see rank 0's traceback.")
