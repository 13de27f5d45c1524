"""Launch: ``autopartition run plan/ [torchrun options] -- train.py [args]``.

Runs ``python -m torch.distributed.run`` (torchrun) with the plan's rank count
as ``--nproc-per-node`` unless told otherwise, so multi-node jobs use
torchrun's own rendezvous options (``--nnodes``, ``--rdzv-endpoint``, ...).
The training script finds the plan through ``AUTOPARTITION_PLAN``
(:func:`plan_from_env`).

Failures and signals:

* Each rank runs the script through ``python -m runtime.launch.failure`` (unless torchrun
  is given ``--no-python`` or ``-m``): what it raises is written as a record to the
  job's directory (``AUTOPARTITION_FAILURE_DIR``, :mod:`runtime.launch.failure`) instead of
  a traceback on the console.  When the job fails, the launcher prints the first
  cause in one paragraph and exits 2 (bad input) or 1.
* torchrun runs under this module's wrapper (``python -m runtime.launch.torchrun --job DIR
  -- ...``), whose own output (its logs, ``ChildFailedError`` and the ranks'
  tracebacks) goes to ``DIR/torchrun.log``, named in the message.  The ranks keep
  the console: the script's stdout and stderr (prints, logging, warnings) show as
  before, unprefixed, because that is where a user watches training.
* The launcher starts torchrun in its own session and forwards SIGINT, SIGTERM and
  SIGHUP to it (torchrun stops its ranks with SIGTERM); after a grace period
  (``AUTOPARTITION_STOP_GRACE`` seconds, default 30) or a second signal it kills
  torchrun and every rank.  Exit code 128 + the signal.  The ranks also die with
  torchrun, and torchrun with the launcher (parent-death signals, Linux).

Example::

    autopartition run plan/ -- examples/train_gpt.py --steps 10
    # = AUTOPARTITION_PLAN=plan/ python -m torch.distributed.run --nproc-per-node 4 examples/train_gpt.py --steps 10
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from partitioner.errors import AutopartitionError
from partitioner.plan import Plan
from partitioner.units import env_seconds, plural
from runtime.engines.choice import ENGINE_ENV  # read back in every rank by engine_from_env
from runtime.launch.failure import (
    FAILURE_DIR_ENV,
    describe_exit,
    read_records,
    set_parent_death_signal,
    summarise,
    worker_pids,
    write_log,
)

__all__ = ["GRACE_ENV", "PLAN_ENV", "plan_from_env", "run_plan", "torchrun_command"]

PLAN_ENV = "AUTOPARTITION_PLAN"
GRACE_ENV = "AUTOPARTITION_STOP_GRACE"
_DEFAULT_GRACE_S = 30.0  # as long as torchrun itself waits for its ranks after SIGTERM
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_S = 0.2
_WAKE_AFTER_S = 1.0  # torchrun notices a failed rank within 0.1 s and sends SIGTERM to the others
_LOG = "torchrun.log"
_TORCHRUN_FAILURES = "torchrun.json"
_NO_WRAP = ("--no-python", "--no_python", "-m", "--module")  # the script is not a Python file run by path


def _option(args: Sequence[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _torchrun_args(plan: Plan, torchrun_args: Sequence[str]) -> list[str]:
    args = list(torchrun_args)
    nproc = _option(args, "--nproc-per-node", "--nproc_per_node")
    nnodes = _option(args, "--nnodes")
    if nproc is None:
        if nnodes not in (None, "1"):
            raise AutopartitionError(
                f"With --nnodes {nnodes}, say how many ranks each node runs: --nproc-per-node K "
                f"with nodes x K = {plan.gpus}."
            )
        args = ["--nproc-per-node", str(plan.gpus)] + args
    elif nnodes in (None, "1") and nproc.isdigit() and int(nproc) != plan.gpus:
        raise AutopartitionError(
            f"The plan needs {plural(plan.gpus, 'rank')} ({plural(plan.pp, 'stage')} x {plural(plan.dp, 'replica')}) but "
            f"--nproc-per-node is {nproc} on one node. Use --nproc-per-node {plan.gpus}, or add --nnodes."
        )
    return args


def torchrun_command(plan: Plan, torchrun_args: Sequence[str], script: Sequence[str]) -> list[str]:
    """The torchrun command line for ``plan``; checks the rank count when it can."""
    return [sys.executable, "-m", "torch.distributed.run", *_torchrun_args(plan, torchrun_args), *script]


def _supervised_command(args: Sequence[str], script: Sequence[str], job: Path) -> list[str]:
    """torchrun under :func:`_torchrun_main`, each rank's script under ``runtime.launch.failure``."""
    wrap = not any(a in _NO_WRAP or a.startswith(("--no-python=", "--module=")) for a in args)
    entry = ["-m", "runtime.launch.failure", *script] if wrap else list(script)
    return [sys.executable, "-m", "runtime.launch.torchrun", "--job", str(job), "--", *args, *entry]


def _grace() -> float:
    return env_seconds(GRACE_ENV, _DEFAULT_GRACE_S, what="to wait for the ranks after a signal", example=30,
                       zero=True)


def run_plan(plan_dir: str, torchrun_args: Sequence[str], script: Sequence[str], *, engine: str | None = None) -> int:
    """Run the training script under torchrun; returns the exit code (0, 1 or 2, or 128 + a signal).

    ``engine`` (``ours``, ``torch``) reaches every rank's ``Pipeline`` as ``$AUTOPARTITION_ENGINE``.
    """
    # Imported here: DTensor's import sets up logging that would send torchrun's own lines (in the
    # ``--job`` process, which imports this module) to the terminal instead of its log.
    from runtime.parallel.tensorparallel import refuse_unrunnable_tp

    plan = Plan.load(plan_dir)
    refuse_unrunnable_tp(plan, engine=engine)  # before torchrun starts any rank
    if not script:
        raise AutopartitionError("Name the training script after `--`, e.g. `-- train.py`.")
    if script[0].endswith(".py") and not Path(script[0]).exists():
        raise AutopartitionError(f"The training script {script[0]} does not exist (cwd {os.getcwd()}).")
    args = _torchrun_args(plan, torchrun_args)
    grace = _grace()
    job = Path(tempfile.mkdtemp(prefix="autopartition-run-"))
    log = job / _LOG
    env = dict(os.environ, **{PLAN_ENV: str(Path(plan_dir).resolve()), FAILURE_DIR_ENV: str(job)})
    if engine is not None:
        env[ENGINE_ENV] = engine
    # torchrun sets 1 itself when unset, with a multi-line banner; one thread per rank is what
    # CPU ranks are costed with too.  A value the user set is kept.
    threads = env.setdefault("OMP_NUM_THREADS", "1")
    nproc = _option(args, "--nproc-per-node", "--nproc_per_node")
    split = f" x {plan.tp} tensor-parallel" if plan.tp > 1 else ""
    print(f"[autopartition] run: starting {nproc} ranks per node with torchrun for {plural(plan.pp, 'stage')} x "
          f"{plural(plan.dp, 'replica')}{split} (OMP_NUM_THREADS={threads}); each rank builds and captures the model "
          "before its first step", file=sys.stderr, flush=True)
    shown = [sys.executable, "-m", "torch.distributed.run", *args, *script]
    print("[autopartition] " + " ".join(shlex.quote(c) for c in shown) + f"  (torchrun's own output: {log})",
          file=sys.stderr, flush=True)
    code, signum = _supervise(_supervised_command(args, script, job), env=env, job=job, grace=grace)
    return _outcome(code, signum, job)


def _outcome(code: int, signum: int | None, job: Path) -> int:
    """Say how the job ended; the launcher's exit code."""
    log = job / _LOG
    records = read_records(job)
    if signum is not None:
        left = worker_pids(job)
        state = f"ranks {sorted(left)} may still run" if left else "every rank has ended"
        print(f"[autopartition] run: stopped by {signal.Signals(signum).name}; {state} (torchrun's output: {log})",
              file=sys.stderr, flush=True)
        return 128 + signum
    if code == 0:
        shutil.rmtree(job, ignore_errors=True)
        return 0
    died = _torchrun_failures(job, records=bool(records))
    if not records and not died:  # torchrun itself failed (its options, the rendezvous): its own words
        tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log.exists() else []
        print("\n".join(tail), file=sys.stderr)
        print(f"autopartition: error: torchrun exited with {describe_exit(code)} before any rank recorded an "
              f"error; its output is above and in {log}", file=sys.stderr, flush=True)
        return 1 if code != 2 else 2
    write_log(records, log)
    summary = summarise(records, died=died, log=log, what="the training script")
    print(summary.text, file=sys.stderr, flush=True)
    return summary.exit_code


def _torchrun_failures(job: Path, *, records: bool) -> dict[int, str]:
    """rank -> how it ended, for the ranks torchrun saw fail (written by :func:`_torchrun_main`).

    With records, a rank ended by SIGTERM was stopped by the teardown (torchrun's, or
    :func:`_wake_stopped`), not a cause.
    """
    try:
        data = json.loads((job / _TORCHRUN_FAILURES).read_text())
    except (OSError, ValueError):
        return {}
    return {int(rank): describe_exit(code) for rank, code in data.items()
            if not (records and code == -signal.SIGTERM)}


# --------------------------------------------------------------- supervising


def _supervise(command: list[str], *, env: dict[str, str], job: Path, grace: float) -> tuple[int, int | None]:
    """Run ``command`` (torchrun) in its own session; forward signals; no rank outlives this call.

    Returns torchrun's exit code and the first signal received (None if none).
    """
    process = subprocess.Popen(command, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) == 1:
            _send(process.pid, signum)  # torchrun stops its ranks (SIGTERM) and exits
        else:  # a second signal: do not wait any longer
            _kill_all(process.pid, job)

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    stop_by: float | None = None
    failing_since: float | None = None
    try:
        while True:
            try:
                code = process.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if received:
                stop_by = stop_by if stop_by is not None else time.monotonic() + grace
                if time.monotonic() >= stop_by:
                    _kill_all(process.pid, job)
            if failing_since is None and (received or any(job.glob("rank*.json"))):
                failing_since = time.monotonic()
            if failing_since is not None and time.monotonic() - failing_since >= _WAKE_AFTER_S:
                _wake_stopped(job)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if process.poll() is None:  # an exception here (not a signal): take torchrun down with us
            _kill_all(process.pid, job)
            process.wait()
        for pid in worker_pids(job).values():  # ranks torchrun could not stop
            _send(pid, signal.SIGKILL)
    return code, (received[0] if received else None)


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _kill_all(leader: int, job: Path) -> None:
    """SIGKILL torchrun's process group and every rank (torchrun starts each rank in a session of its own)."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except OSError:
        pass
    for pid in worker_pids(job).values():
        _send(pid, signal.SIGKILL)


def _wake_stopped(job: Path) -> None:
    """A rank stopped (SIGSTOP) cannot act on torchrun's SIGTERM: torchrun would wait 30 s to kill it.

    Called once the job is failing or being stopped: such a rank is ended now.
    """
    for pid in worker_pids(job).values():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            _send(pid, signal.SIGTERM)
            _send(pid, signal.SIGCONT)


def _torchrun_main(argv: Sequence[str]) -> int:
    """``python -m runtime.launch.torchrun --job DIR -- [torchrun args]``: torchrun with its own output in DIR/torchrun.log.

    Python's ``sys.stderr`` of this process goes to the log before torch is imported, so
    torchrun's logging, warnings and tracebacks land there; file descriptor 2 stays the
    console, and the ranks inherit it.  When torchrun reports failed ranks, their exit
    codes go to DIR/torchrun.json.
    """
    if len(argv) < 3 or argv[0] != "--job" or argv[2] != "--":
        print("usage: python -m runtime.launch.torchrun --job DIR -- [torchrun options] script [args]", file=sys.stderr)
        return 2
    job = Path(argv[1])
    sys.argv[0] = "torchrun"  # its usage and errors name the command the user knows
    set_parent_death_signal(signal.SIGTERM)  # the launcher died: stop the ranks as if it had forwarded SIGTERM
    sys.stderr = open(job / _LOG, "a", buffering=1)  # noqa: SIM115 - for the life of the process
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(list(argv[3:]))
    except ChildFailedError as exc:
        traceback.print_exc()
        failures = {str(rank): f.exitcode for rank, f in exc.failures.items()}
        (job / _TORCHRUN_FAILURES).write_text(json.dumps(failures))
        return 1
    except SignalException as exc:
        traceback.print_exc()
        return 128 + int(exc.sigval)
    return 0


def plan_from_env(default: str | None = None) -> Plan:
    """The plan ``autopartition run`` launched this script with (or ``default``)."""
    directory = os.environ.get(PLAN_ENV, default)
    if directory is None:
        raise AutopartitionError(
            f"No plan given: launch with `autopartition run plan/ -- script.py` (it sets {PLAN_ENV}) "
            "or pass the plan directory."
        )
    return Plan.load(directory)


if __name__ == "__main__":  # torchrun, started by run_plan
    from runtime.launch.torchrun import (
        _torchrun_main as _main,  # the module, not this __main__ copy
    )

    sys.exit(_main(sys.argv[1:]))
