"""Rank failure records: every rank that raises writes what went wrong; the launcher names the first cause.

When ``AUTOPARTITION_FAILURE_DIR`` is set (``autopartition run`` and ``verify`` set
it per job), a rank that raises writes one JSON record ``rank{R}.json`` there:
the exception's type and message (of the root cause, not of a wrapper such as
``StepFailure``), the innermost frame of our code or the user's (as
``file:line: source``), the rank, its stage and the action it was running, whether
it is bad input (:class:`~partitioner.errors.AutopartitionError`) or a bug, what
kind of failure it is (an ``error`` of its own, a ``timeout`` waiting for a peer,
or a ``peer`` that failed first) and the formatted traceback.

After the ranks end, :func:`summarise` picks the first cause (a rank's own error
before a timeout before "a peer failed"; the earliest of a kind) and writes one
paragraph, e.g.::

    autopartition: error: rank 1 (stage 1, action 1F2): TypeError: bad operand
      at train.py:31: loss = loss_fn(out, y) + "x"
    Raised in your code, not in autopartition. 1 other rank stopped because of it. ...

Records are written by :func:`record_failure`: from the rank entry point
``python -m runtime.launch.failure script.py args`` (what ``autopartition run`` starts under
torchrun: it catches everything the script raises), from ``sys.excepthook``
(:func:`install_excepthook`, for ranks started otherwise) and by verify's ranks.
:func:`reports_failures` wraps :class:`~runtime.pipeline.Pipeline`'s entry points
to note the stage on the exception.  This module imports no torch (the launcher
uses it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import linecache
import os
import re
import runpy
import signal
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from partitioner.errors import AutopartitionError

__all__ = [
    "FAILURE_DIR_ENV",
    "FailureRecord",
    "RankFailure",
    "RankInputError",
    "Summary",
    "describe_exit",
    "install_excepthook",
    "make_record",
    "read_records",
    "record_failure",
    "reports_failures",
    "run_script",
    "set_parent_death_signal",
    "summarise",
    "worker_pids",
    "write_log",
]

FAILURE_DIR_ENV = "AUTOPARTITION_FAILURE_DIR"
_CONTEXT = "_autopartition_context"  # attribute on an exception: {"stage": ..., "time": ...}
_RECORDED = "_autopartition_recorded"
_PROVISIONAL = "_autopartition_recorded_provisionally"  # holds the record's path
_KINDS = ("error", "died", "timeout", "peer")  # order of preference for the first cause
# Messages that say this rank only saw another rank fail (gloo, NCCL, our PeerFailure).
_PEER_TEXT = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|socket closed|ECONNRESET|"
    r"not every rank answered|failed while building its stage|communicator was aborted", re.IGNORECASE)
_TIMEOUT_TEXT = re.compile(r"no answer (?:from rank \d+ )?within|timed out", re.IGNORECASE)
_PEER_RANK = re.compile(r"(?:waiting for|from) rank (\d+)(?: \(stages? (\d+(?:, \d+)*))?")
_ACTION = re.compile(r"stopped at action (\S+?):")
_STAGE = re.compile(r"\(stage (\d+)")
_WITHIN = re.compile(r"within ([\d.]+) s")
_OUR_DIRS = tuple(str(Path(__file__).resolve().parents[2] / d) + os.sep for d in ("partitioner", "runtime"))
_LIBRARY_DIRS = tuple(sorted({
    str(Path(p).resolve()) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
}))
_this_rank_stages: str | None = None  # set once a Pipeline is built: errors after it name the stage too

_P = ParamSpec("_P")
_R = TypeVar("_R")


# ------------------------------------------------------------------ records


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """What one rank raised; ``kind`` is ``error`` (its own), ``timeout`` (a peer did not answer) or ``peer``."""

    rank: int
    type: str
    message: str
    where: str  # "file:line: source" of the innermost frame of our code or the user's; "" if none
    bad_input: bool
    kind: str
    time: float
    traceback: str = ""
    stage: str | None = None  # "2", or "0, 3" for a rank holding several
    action: str | None = None  # "1F3"
    peer: int | None = None  # the rank it waited for (timeout / peer)
    peer_stage: str | None = None
    in_user_code: bool = False  # the innermost frame is outside partitioner/ and runtime/
    pid: int = 0

    def place(self) -> str:
        """``rank 1 (stage 1, action 1F2)``."""
        stages = "stages" if self.stage is not None and "," in self.stage else "stage"
        parts = [f"{stages} {self.stage}" if self.stage is not None else "", f"action {self.action}" if self.action else ""]
        inside = ", ".join(p for p in parts if p)
        return f"rank {self.rank}" + (f" ({inside})" if inside else "")


class RankFailure(RuntimeError):
    """A rank failed; ``str()`` is the one-paragraph cause, ``exit_code`` 1 (a bug or crash) or 2 (bad input)."""

    exit_code = 1


class RankInputError(RankFailure, AutopartitionError):
    """A rank stopped on bad input (an AutopartitionError there): exit code 2."""

    exit_code = 2


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its explicit causes (``raise ... from``), outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not c for c in chain):
        chain.append(current)
        current = current.__cause__
    return chain


def _root(chain: Sequence[BaseException]) -> BaseException:
    """The exception that explains the failure: the outermost AutopartitionError (its message says what to
    do), else the outermost PeerFailure (it names the peer), else the innermost cause (a TypeError under
    StepFailure)."""
    user = [e for e in chain if isinstance(e, AutopartitionError)]
    peer = [e for e in chain if type(e).__name__ == "PeerFailure"]
    return user[0] if user else peer[0] if peer else chain[-1]


def _is_ours(filename: str) -> bool:
    """A file of autopartition or of the user (a script, a model file), not of Python or a library."""
    if filename.startswith("<") or filename == __file__:
        return False
    path = os.path.abspath(filename)
    return path.startswith(_OUR_DIRS) or not path.startswith(_LIBRARY_DIRS)


def _innermost(chain: Sequence[BaseException], *, prefer_user: bool) -> tuple[str, bool]:
    """``file:line: source`` of the frame to show, and whether it is in the user's code.

    The innermost frame of our code or the user's, in the innermost exception that has
    one (where the failure began); with ``prefer_user`` (bad input, a peer's failure) the
    innermost frame of the user's code if any (the call that passed the input, the step
    that waited), since our check's raise or our wait says nothing.
    """
    frames = [[f for f in traceback.extract_tb(e.__traceback__) if _is_ours(f.filename)] for e in reversed(chain)]
    ours = [f for fs in frames for f in reversed(fs)]  # innermost first
    users = [f for f in ours if not os.path.abspath(f.filename).startswith(_OUR_DIRS)]
    frame = users[0] if prefer_user and users else ours[0] if ours else None
    if frame is None:
        return "", False
    source = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    name = os.path.relpath(frame.filename)
    name = frame.filename if name.startswith("..") else name
    return f"{name}:{frame.lineno}: {source}", not os.path.abspath(frame.filename).startswith(_OUR_DIRS)


def _kind(chain: Sequence[BaseException]) -> str:
    if any(isinstance(e, AutopartitionError) for e in chain):
        return "error"
    peer = any(type(e).__name__ == "PeerFailure" or _PEER_TEXT.search(str(e)) for e in chain)
    timeout = any(_TIMEOUT_TEXT.search(str(e)) and not _PEER_TEXT.search(str(e)) for e in chain)
    if timeout and (peer or any("DistBackendError" in type(e).__name__ or "gloo" in str(e) for e in chain)):
        return "timeout"
    return "peer" if peer else "error"


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "-1"))
    except ValueError:
        return -1


def _first_line(text: str, limit: int = 6) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:limit]) + ("\n  ..." if len(lines) > limit else "")


def make_record(exc: BaseException, *, rank: int | None = None) -> FailureRecord:
    """The record of ``exc`` as this rank would write it."""
    chain = _chain(exc)
    root = _root(chain)
    context: dict[str, Any] = {}
    for e in reversed(chain):  # the outer exception's note wins
        context.update(getattr(e, _CONTEXT, {}))
    text = "\n".join(str(e) for e in chain)
    action = _ACTION.search(text)
    stage_match = _STAGE.search(str(chain[0])) if action else None
    stage = stage_match.group(1) if stage_match else None  # the stage whose action failed
    peer = _PEER_RANK.search(text)
    kind = _kind(chain)
    where, in_user = _innermost(chain, prefer_user=isinstance(root, AutopartitionError) or kind != "error")
    return FailureRecord(
        rank=_rank() if rank is None else rank,
        type=type(root).__name__,
        message=_first_line(str(root)) or "(no message)",
        where=where,
        bad_input=isinstance(root, AutopartitionError),
        kind=kind,
        time=float(context.get("time", time.time())),
        traceback="".join(traceback.format_exception(exc)),
        stage=stage or context.get("stage", _this_rank_stages),
        action=action.group(1) if action else None,
        peer=int(peer.group(1)) if peer and kind != "error" else None,
        peer_stage=(peer.group(2) or None) if peer and kind != "error" else None,
        in_user_code=in_user,
        pid=os.getpid(),
    )


def record_failure(
    exc: BaseException, *, rank: int | None = None, directory: str | Path | None = None, provisional: bool = False
) -> Path | None:
    """Write ``exc``'s record to ``directory`` (default ``$AUTOPARTITION_FAILURE_DIR``); once per exception and rank.

    Returns the file, or None when there is no directory or this rank already wrote one.
    ``provisional``: written where the error leaves our API, before its traceback reaches
    the user's frames; recording the same exception again (uncaught, at the entry point)
    replaces it with the fuller record.
    """
    where = directory if directory is not None else os.environ.get(FAILURE_DIR_ENV)
    if not where or getattr(exc, _RECORDED, False):
        return None
    record = make_record(exc, rank=rank)
    folder = Path(where)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{record.rank}.json"
    if path.exists() and getattr(exc, _PROVISIONAL, None) != str(path):  # the first error of a rank is its cause
        return None
    temporary = folder / f".rank{record.rank}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(dataclasses.asdict(record), indent=1))
    temporary.replace(path)  # readers never see half a record
    with _suppress():
        setattr(exc, _PROVISIONAL if provisional else _RECORDED, str(path) if provisional else True)
    return path


def read_records(directory: str | Path) -> list[FailureRecord]:
    """Every record in ``directory`` (unreadable ones skipped: a rank killed while writing)."""
    records = []
    names = {f.name for f in dataclasses.fields(FailureRecord)}
    for path in sorted(Path(directory).glob("rank*.json")):
        try:
            data = json.loads(path.read_text())
            records.append(FailureRecord(**{k: v for k, v in data.items() if k in names}))
        except (OSError, ValueError, TypeError):
            continue
    return records


class _suppress:
    """Setting an attribute on a built-in exception type can fail; the note is only a hint."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], (AttributeError, TypeError))  # type: ignore[arg-type]


# ------------------------------------------------------------ installing it


def reports_failures(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator for Pipeline entry points: notes this rank's stages and the time on what they raise, and records it.

    Recorded as it leaves our API, not only when uncaught: a script that catches the
    error, prints it and calls ``sys.exit(2)`` (as ``examples/train_gpt.py`` does) still
    leaves its cause for the launcher, which would otherwise see only an exit code.
    """

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        global _this_rank_stages
        install_excepthook()
        try:
            result = method(*args, **kwargs)
        except Exception as exc:
            _note(exc, args[0] if args else None)
            with _quiet():
                record_failure(exc, provisional=True)
            raise
        if method.__name__ == "__init__" and args:
            _this_rank_stages = _stages_of(args[0])
        return result

    return wrapper


def _stages_of(owner: Any) -> str | None:
    try:
        return ", ".join(str(local.plan.index) for local in owner._stages) or None
    except Exception:  # noqa: BLE001 - not built yet: no stage to name
        return None


def _note(exc: BaseException, owner: Any) -> None:
    if hasattr(exc, _CONTEXT):
        return
    context: dict[str, Any] = {"time": time.time()}
    stages = _stages_of(owner)
    if stages is not None:
        context["stage"] = stages
    with _suppress():
        setattr(exc, _CONTEXT, context)


def install_excepthook() -> None:
    """When ``AUTOPARTITION_FAILURE_DIR`` is set, record uncaught exceptions there (then print as before)."""
    if not os.environ.get(FAILURE_DIR_ENV) or getattr(sys.excepthook, _RECORDED, False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(value, (KeyboardInterrupt, SystemExit)):
            with _quiet():
                record_failure(value)
        previous(kind, value, tb)

    setattr(hook, _RECORDED, True)
    sys.excepthook = hook


class _quiet:
    """Recording must never hide the error it records."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)  # type: ignore[arg-type]


def set_parent_death_signal(signum: int) -> None:
    """Linux: get ``signum`` when the parent process dies, so no rank outlives its launcher."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl: act as if the signal came
        os.kill(os.getpid(), signum)


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks (/proc), to tell it from a later process with the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def worker_pids(directory: str | Path) -> dict[int, int]:
    """rank -> pid of the ranks started through :func:`run_script` that are still running."""
    alive = {}
    for path in Path(directory).glob("pid.rank*"):
        try:
            pid_text, started = path.read_text().split()
            rank, pid = int(path.name[len("pid.rank"):]), int(pid_text)
        except (OSError, ValueError):
            continue
        if (_start_time(pid) == started or (not started and _alive(pid))) and not _zombie(pid):
            alive[rank] = pid
    return alive


def _zombie(pid: int) -> bool:
    """Exited, not yet reaped: gone for our purposes."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def run_script(argv: Sequence[str]) -> int:
    """A rank's entry point (``python -m runtime.launch.failure script.py args``): run the script as ``__main__``.

    Anything it raises is recorded, its traceback goes into the record (not onto the
    console, where every rank would print its own), and the rank exits 2 (bad input)
    or 1.  The rank dies with torchrun (parent death signal) and leaves its pid for the
    launcher, which stops every rank when it is stopped.
    """
    if not argv:
        print("usage: python -m runtime.launch.failure script.py [args]", file=sys.stderr)
        return 2
    set_parent_death_signal(signal.SIGKILL)
    directory = os.environ.get(FAILURE_DIR_ENV)
    if directory:
        with _quiet():
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / f"pid.rank{_rank()}").write_text(f"{os.getpid()} {_start_time(os.getpid())}")
    script = argv[0]
    sys.argv = list(argv)
    here = os.path.dirname(os.path.abspath(script))
    if here not in sys.path:
        sys.path.insert(0, here)  # as `python script.py` would
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt:  # torchrun passes the launcher's SIGINT on: stopped, not failed; no traceback per rank
        return 128 + signal.SIGINT
    except BaseException as exc:  # noqa: BLE001 - recorded for the launcher, then the rank exits
        with _quiet():
            path = record_failure(exc)
        if not directory or path is None and not (Path(directory) / f"rank{_rank()}.json").exists():
            traceback.print_exc()  # nowhere to record it: print it as Python would
        return 2 if any(isinstance(e, AutopartitionError) for e in _chain(exc)) else 1
    return 0


# ---------------------------------------------------------------- the cause


@dataclasses.dataclass(frozen=True)
class Summary:
    """The first cause in one paragraph, and the exit code (2 bad input, 1 otherwise)."""

    text: str
    exit_code: int
    cause: FailureRecord | None = None

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def _order(record: FailureRecord) -> tuple[int, float, int]:
    return _KINDS.index(record.kind) if record.kind in _KINDS else 0, record.time, record.rank


def _ranks(ranks: Iterable[int]) -> str:
    ordered = sorted(set(ranks))
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def summarise(
    records: Sequence[FailureRecord],
    *,
    died: Mapping[int, str] | None = None,
    log: str | Path | None = None,
    what: str = "the job",
    log_holds: str = "Every rank's traceback and torchrun's output",
) -> Summary:
    """The first cause among ``records`` and ``died`` (rank -> "exit code 17" for ranks that wrote nothing).

    A rank's own error comes first (the earliest), then a rank that died without one,
    then a timeout (it names the rank that stopped answering), then "a peer failed".
    """
    died = {r: why for r, why in (died or {}).items() if all(rec.rank != r for rec in records)}
    see = f" {log_holds}: {log}" if log else ""
    ordered = sorted(records, key=_order)
    if ordered and (ordered[0].kind == "error" or not died):
        cause = ordered[0]
        others = sorted({r.rank for r in records if r.rank != cause.rank} | set(died))
        text = _describe(cause, others, see, what)
        return Summary(text, 2 if cause.bad_input else 1, cause)
    if died:
        rank = min(died)
        waiting = [r for r in records if r.peer == rank]
        how = f" {_ranks(r.rank for r in waiting)} {'was' if len(waiting) == 1 else 'were'} waiting for it." \
            if waiting else ""
        text = (f"autopartition: error: rank {rank} ended with {died[rank]} without raising an error (sys.exit or "
                f"os._exit, a crash, or killed: out of memory?) while running {what}.{how}\n"
                f"The other ranks were stopped because of it.{see}")
        return Summary(text, 1)
    return Summary(f"autopartition: error: {what} failed, but no rank recorded why.{see}", 1)


def _describe(cause: FailureRecord, others: Sequence[int], see: str, what: str) -> str:
    at = f"\n  at {cause.where}" if cause.where else ""
    stopped = f" {_ranks(others)} stopped because of it." if others else ""
    if cause.kind == "timeout" and cause.peer is not None:
        limit = _WITHIN.search(cause.message)
        waited = f" within {limit.group(1)} s" if limit else ""
        peer_place = f" (stage {cause.peer_stage})" if cause.peer_stage else ""
        head = (f"autopartition: error: rank {cause.peer}{peer_place} stopped answering: {cause.place()} got no "
                f"answer from it{waited}.")
        hint = (f"rank {cause.peer} wrote no error: it is hung, stopped, or much slower than the others. If its "
                "steps are just slow, raise the limit: AUTOPARTITION_TIMEOUT=SECONDS or Pipeline(timeout=...).")
    elif cause.kind == "peer":
        head = f"autopartition: error: {cause.place()}: {cause.type}: {cause.message}"
        hint = "A peer of this rank failed first, but no rank recorded its own error."
    else:
        head = f"autopartition: error: {cause.place()}: {cause.type}: {cause.message}"
        if cause.bad_input:
            hint = "Bad input: the message above says what to change."
        elif cause.in_user_code:
            hint = "Raised in your code (the line above), not in autopartition."
        else:
            hint = ("This is a bug in autopartition, not in your input: please report it with the traceback "
                    "from the log named below.")
    return f"{head}{at}\n{hint}{stopped}{see}"


def describe_exit(code: int | None) -> str:
    """``exit code 17`` / ``signal SIGKILL`` for a process's exit status (negative: killed by a signal)."""
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def write_log(records: Sequence[FailureRecord], log: str | Path) -> None:
    """Append every rank's traceback to ``log`` (the launcher's file, after torchrun's output)."""
    with open(log, "a") as out:
        out.writelines(f"\n===== rank {record.rank} (pid {record.pid}, {record.kind}) =====\n{record.traceback}" for record in sorted(records, key=lambda r: r.rank))


if __name__ == "__main__":  # a rank started by `autopartition run`: python -m runtime.launch.failure script.py args
    from runtime.launch.failure import (
        run_script as _run_script,  # the module, not this __main__ copy
    )

    sys.exit(_run_script(sys.argv[1:]))
