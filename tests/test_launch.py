"""``autopartition run``: a failed rank names its cause first; signals reach every rank; the timeout is settable.

Default tier: the failure records and the summary (:mod:`runtime.launch.failure`), the
timeout setting, and the launcher's signal handling with a stand-in torchrun (plain
Python processes that start "ranks" in sessions of their own, as torchrun does).
Slow tier: the real thing, ``python -m partitioner run plan/ -- failing_workers.py``
with two CPU ranks, a fault injected into one of them or a signal sent to the launcher.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from partitioner.errors import AutopartitionError
from runtime.launch import failure
from runtime.launch.failure import (
    FailureRecord,
    make_record,
    read_records,
    record_failure,
    summarise,
)

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).resolve().parent / "models"
PYTHON = sys.executable


class StepFailure(RuntimeError):  # runtime.execute.runner's wrapper, by name as the records see it
    pass


class PeerFailure(RuntimeError):
    pass


def _users_bug() -> None:
    raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'str'")


def _raised(make: object) -> BaseException:
    try:
        make()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return exc
    raise AssertionError("did not raise")


def _step_failure_from_type_error() -> None:
    try:
        _users_bug()
    except TypeError as exc:
        raise StepFailure("rank 1 (stage 1, replica 0) stopped at action 1F2: TypeError: unsupported\n"
                          "  schedule: 1F0 1F1 [1F2] 1B0") from exc


def _record(rank: int, kind: str, t: float, **extra: object) -> FailureRecord:
    fields: dict[str, object] = {"rank": rank, "type": "RuntimeError", "message": f"{kind} on {rank}",
                                 "where": "x.py:1: x", "bad_input": False, "kind": kind, "time": t,
                                 "stage": str(rank)}
    fields.update(extra)
    return FailureRecord(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------ records


def test_a_record_names_the_root_cause_its_frame_stage_and_action(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    path = record_failure(_raised(_step_failure_from_type_error), directory=tmp_path)
    assert path == tmp_path / "rank1.json"
    [r] = read_records(tmp_path)
    assert (r.rank, r.type, r.kind, r.bad_input) == (1, "TypeError", "error", False)
    assert r.message == "unsupported operand type(s) for +: 'Tensor' and 'str'"
    assert r.where.startswith("tests/test_launch.py:") and r.where.endswith(
        ": raise TypeError(\"unsupported operand type(s) for +: 'Tensor' and 'str'\")"), r.where
    assert (r.stage, r.action, r.in_user_code) == ("1", "1F2", True)
    assert "StepFailure: rank 1 (stage 1, replica 0)" in r.traceback
    # One record per rank: its first error is its cause.
    assert record_failure(_raised(_users_bug), directory=tmp_path) is None


def test_without_the_directory_nothing_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(failure.FAILURE_DIR_ENV, raising=False)
    assert record_failure(_raised(_users_bug)) is None


def test_kinds_bad_input_timeouts_and_peers() -> None:
    def bad() -> None:
        try:
            _users_bug()
        except TypeError:
            raise StepFailure("rank 0 (stage 0, replica 0) stopped at action 0F1: x") from AutopartitionError(
                "The target has 5 classes: give targets in 0..3.")

    r = make_record(_raised(bad), rank=0)
    assert (r.kind, r.bad_input, r.type) == ("error", True, "AutopartitionError")

    def timed_out() -> None:
        try:
            raise PeerFailure("no answer from rank 2 within 3 s (AUTOPARTITION_TIMEOUT or Pipeline(timeout=...))")
        except PeerFailure as exc:
            try:
                raise PeerFailure("waiting for rank 2 (stage 2, replica 0), which died, raised, hung, or was "
                                  f"itself stopped by another rank's failure: {exc}") from exc
            except PeerFailure as outer:
                raise StepFailure("rank 1 (stage 1, replica 0) stopped at action 1RB3: peer failure: ...") from outer

    r = make_record(_raised(timed_out), rank=1)
    assert (r.kind, r.peer, r.peer_stage, r.action, r.type) == ("timeout", 2, "2", "1RB3", "PeerFailure")
    assert r.message.startswith("waiting for rank 2 (stage 2, replica 0)")

    def closed() -> None:
        try:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4711")
        except RuntimeError as exc:
            raise PeerFailure("waiting for rank 1 (stage 1, replica 0), which died: Connection closed by peer") from exc

    r = make_record(_raised(closed), rank=0)
    assert (r.kind, r.peer) == ("peer", 1)


def test_the_first_cause_is_an_error_not_the_earlier_peer_failures() -> None:
    records = [
        _record(0, "peer", 1.0, peer=1),
        _record(2, "timeout", 1.5, peer=1),
        _record(1, "error", 2.0, type="TypeError", message="bad operand", action="1F2",
                where="train.py:31: loss = loss + 'x'", in_user_code=True),
        _record(3, "error", 3.0, type="ValueError"),
    ]
    s = summarise(records, log="/tmp/job/torchrun.log")
    assert s.first_line == "autopartition: error: rank 1 (stage 1, action 1F2): TypeError: bad operand"
    assert s.text.splitlines()[1] == "  at train.py:31: loss = loss + 'x'"
    assert "Raised in your code" in s.text and "ranks 0, 2, 3 stopped because of it" in s.text
    assert s.text.endswith("/tmp/job/torchrun.log") and s.exit_code == 1


def test_bad_input_exits_2_and_a_bug_in_autopartition_says_so() -> None:
    assert summarise([_record(0, "error", 1.0, bad_input=True)]).exit_code == 2
    bug = summarise([_record(0, "error", 1.0, where="runtime/execute/runner.py:250: out = x")])
    assert bug.exit_code == 1 and "This is a bug in autopartition" in bug.text


def test_a_timeout_names_the_rank_that_stopped_answering() -> None:
    s = summarise([_record(0, "peer", 0.5, peer=1),
                   _record(1, "timeout", 1.0, type="PeerFailure", peer=2, peer_stage="2", action="1RB3",
                           message="waiting for rank 2 (stage 2, replica 0): no answer from rank 2 within 3 s")])
    assert s.first_line.startswith("autopartition: error: rank 2 (stage 2) stopped answering: rank 1 (stage 1, "
                                   "action 1RB3) got no answer from it within 3 s"), s.first_line
    assert "AUTOPARTITION_TIMEOUT" in s.text and s.exit_code == 1


def test_a_rank_that_died_without_a_record_is_the_cause() -> None:
    s = summarise([_record(0, "peer", 1.0, peer=1)], died={1: "exit code 17", 0: "exit code 1"})
    assert s.first_line.startswith("autopartition: error: rank 1 ended with exit code 17 without raising an error")
    assert "rank 0 was waiting for it" in s.text


# ------------------------------------------------------------------ timeout


def test_the_timeout_comes_from_the_argument_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.execute.comm import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, rank_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert rank_timeout() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    assert rank_timeout() == 3.0
    assert rank_timeout(7) == 7.0
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(AutopartitionError, match="AUTOPARTITION_TIMEOUT='soon'"):
        rank_timeout()


def test_a_timed_out_wait_names_the_peer() -> None:
    from runtime.execute.comm import PeerFailure as RealPeerFailure
    from runtime.execute.comm import _PeerWork, wait_all

    class Silent:
        def wait(self, timeout: datetime.timedelta) -> bool:
            return False

    with pytest.raises(RealPeerFailure, match=r"no answer from rank 2 within 3 s \(AUTOPARTITION_TIMEOUT"):
        wait_all([_PeerWork(Silent(), 2)], timeout=3.0)  # type: ignore[arg-type]


# ------------------------------------------------- signals, stand-in torchrun

# A stand-in for torchrun: starts two "ranks" in sessions of their own (as torchrun does),
# each leaving its pid as runtime.launch.failure.run_script does; on SIGTERM it stops them
# (unless told to ignore signals, like a torchrun stuck in its teardown).
_FAKE_TORCHRUN = """
import os, signal, subprocess, sys, time
from runtime.launch.failure import _start_time
job, ignore = sys.argv[1], sys.argv[2] == "ignore"
rank_code = "import time\\nwhile True: time.sleep(0.05)"
ranks = [subprocess.Popen([sys.executable, "-c", rank_code], start_new_session=True) for _ in range(2)]
for r, p in enumerate(ranks):
    with open(os.path.join(job, f"pid.rank{r}"), "w") as f:
        f.write(f"{p.pid} {_start_time(p.pid)}")
def stop(signum, frame):
    if ignore:
        return
    for p in ranks:
        p.terminate()
    for p in ranks:
        p.wait()
    sys.exit(128 + signum)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, stop)
with open(os.path.join(job, "started"), "w") as f:
    f.write("")
while True:
    time.sleep(0.05)
"""

_LAUNCHER = """
import sys
from pathlib import Path
from runtime.launch import torchrun as launch
job = Path(sys.argv[1])
code, signum = launch._supervise([sys.executable, sys.argv[2], str(job), sys.argv[3]], env=dict(__import__("os").environ),
                                 job=job, grace=float(sys.argv[4]))
sys.exit(launch._outcome(code, signum, job))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(check: object, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _rank_pids(job: Path) -> list[int]:
    return [int(p.read_text().split()[0]) for p in sorted(job.glob("pid.rank*"))]


def _fake_run(tmp_path: Path, *, ignore: bool, grace: float) -> tuple[subprocess.Popen[str], Path]:
    job = tmp_path / "job"
    job.mkdir()
    torchrun = tmp_path / "fake_torchrun.py"
    torchrun.write_text(_FAKE_TORCHRUN)
    launcher = subprocess.Popen(
        [PYTHON, "-c", _LAUNCHER, str(job), str(torchrun), "ignore" if ignore else "obey", str(grace)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    assert _wait_for(lambda: (job / "started").exists() and len(_rank_pids(job)) == 2, 30), "stand-in did not start"
    return launcher, job


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path: Path, signum: int) -> None:
    launcher, job = _fake_run(tmp_path, ignore=False, grace=30)
    pids = _rank_pids(job)
    start = time.monotonic()
    launcher.send_signal(signum)
    _, err = launcher.communicate(timeout=20)
    took = time.monotonic() - start
    assert launcher.returncode == 128 + signum, err
    assert not [p for p in pids if _alive(p)], "a rank outlived the launcher"
    assert took < 5, took
    assert f"stopped by {signal.Signals(signum).name}; every rank has ended" in err


def test_ranks_are_killed_after_the_grace_period_or_a_second_signal(tmp_path: Path) -> None:
    launcher, job = _fake_run(tmp_path, ignore=True, grace=1.0)  # torchrun does not stop its ranks
    pids = _rank_pids(job)
    start = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=20) == 128 + signal.SIGTERM
    assert 0.9 <= time.monotonic() - start < 6
    assert _wait_for(lambda: not [p for p in pids if _alive(p)], 2), "a rank outlived the launcher"

    other = tmp_path / "again"
    other.mkdir()
    launcher, job = _fake_run(other, ignore=True, grace=60.0)
    pids = _rank_pids(job)
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGINT)  # the second: no more waiting
    assert launcher.wait(timeout=20) == 128 + signal.SIGINT
    assert time.monotonic() - start < 5
    assert _wait_for(lambda: not [p for p in pids if _alive(p)], 2), "a rank outlived the launcher"


# ------------------------------------------------------- real runs (torchrun)


def _plan(tmp_path: Path) -> Path:
    import dying  # type: ignore[import-not-found]
    from planning_helpers import make_plan  # type: ignore[import-not-found]  # tests/models, on sys.path

    make_plan(str(MODELS / "dying.py"), tmp_path / "plan", pp=2, microbatches=dying.MICROBATCHES, schedule="1f1b")
    return tmp_path / "plan"


def _launch(tmp_path: Path, *, steps: int, fault: str | None = None, rank: int = 1,
            timeout: float | None = None) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, AUTOPARTITION_TEST_OUT=str(out), AUTOPARTITION_TEST_STEPS=str(steps),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(MODELS)]))
    if fault is not None:
        env.update(AUTOPARTITION_TEST_DIE_RANK=str(rank), AUTOPARTITION_TEST_FAULT=fault)
    if timeout is not None:
        env["AUTOPARTITION_TIMEOUT"] = str(timeout)
    process = subprocess.Popen(
        [PYTHON, "-m", "partitioner", "run", str(_plan(tmp_path)), "--", str(MODELS / "failing_workers.py")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return process, out


def _finish(process: subprocess.Popen[str], limit_s: float = 120) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"the launcher did not exit within {limit_s} s:\n{err}") from None
    return process.returncode, out, err


def _summary(err: str) -> list[str]:
    lines = err.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("autopartition: error:"))
    return lines[first:]


@pytest.mark.slow  # starts torchrun with two ranks (~15 s)
@pytest.mark.parametrize("signum", [
    signal.SIGTERM,
    # the stand-in torchrun tests cover these on every run; real ones in the exhaustive tier
    pytest.param(signal.SIGINT, marks=pytest.mark.exhaustive),
    pytest.param(signal.SIGHUP, marks=pytest.mark.exhaustive),
])
def test_stopping_the_launcher_stops_every_rank(tmp_path: Path, signum: int) -> None:
    process, out = _launch(tmp_path, steps=0)
    started = _wait_for(lambda: all((out / f"step{r}").exists() for r in range(2)) or process.poll() is not None, 120)
    assert started and process.poll() is None, _finish(process)
    pids = [int((out / f"pid{r}").read_text()) for r in range(2)]
    start = time.monotonic()
    process.send_signal(signum)
    code, stdout, err = _finish(process, 60)
    took = time.monotonic() - start
    assert code == 128 + signum, err
    assert _wait_for(lambda: not [p for p in pids if _alive(p)], 1), "a rank outlived the launcher"
    assert took < 10, took
    assert "step 1: loss" in stdout  # the script's own output is still shown
    assert "Traceback" not in err, err  # a rank stopped by the user is not an error to show
    assert f"stopped by {signal.Signals(signum).name}; every rank has ended" in err


@pytest.mark.slow
def test_an_error_in_a_rank_is_named_first_and_exits_1(tmp_path: Path) -> None:
    import dying

    code, stdout, err = _finish(_launch(tmp_path, steps=3, fault="raise")[0])
    summary = _summary(err)
    assert code == 1, err
    assert summary[0] == f"autopartition: error: rank 1 (stage 1, action 1F1): TypeError: {dying.TYPE_ERROR}"
    assert summary[1] == "  at tests/models/dying.py:52: raise TypeError(TYPE_ERROR)"
    assert "Raised in your code" in summary[2] and "rank 0 stopped because of it" in summary[2]
    # torchrun's output and the tracebacks go to the log the message names, not onto the console.
    assert "Traceback" not in err and "ChildFailedError" not in err
    assert len(err.splitlines()) <= 6, err
    log = Path(summary[-1].rsplit(": ", 1)[1])
    assert "ChildFailedError" in log.read_text() and "TypeError: " + dying.TYPE_ERROR in log.read_text()
    assert "step 1: loss" in stdout


# One real launch each (~10 s of CPU). Bad input runs in the exhaustive tier: its exit 2 is summarise's
# (test_bad_input_exits_2_and_a_bug_in_autopartition_says_so), carried out of a real launch as
# test_an_error_in_a_rank_is_named_first_and_exits_1's exit 1 is, from the same kind of record.
@pytest.mark.slow
@pytest.mark.parametrize(("fault", "code", "first"), [
    pytest.param("bad_input", 2,
                 "autopartition: error: rank 1 (stage 1, action 1F1): AutopartitionError: The target has 5",
                 marks=pytest.mark.exhaustive),
    ("exit", 1, "autopartition: error: rank 1 ended with exit code 17 without raising an error"),
    ("script", 1, ("autopartition: error: rank 0 (stage 0): NameError: name 'undefined_name_in_the_script' is "
                   "not defined")),
])
def test_other_faults_are_named_first(tmp_path: Path, fault: str, code: int, first: str) -> None:
    got, _, err = _finish(_launch(tmp_path, steps=3, fault=fault, rank=0 if fault == "script" else 1)[0])
    assert got == code, err
    assert _summary(err)[0].startswith(first), err


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_after_the_timeout_and_is_named(tmp_path: Path) -> None:
    process, out = _launch(tmp_path, steps=3, fault="stop", timeout=3)
    pids: list[int] = []

    def stopped() -> bool:
        if not pids and all((out / f"pid{r}").exists() for r in range(2)):
            pids.extend(int((out / f"pid{r}").read_text()) for r in range(2))
        return bool(pids) and _state(pids[1]) == "T" or process.poll() is not None

    assert _wait_for(stopped, 120) and process.poll() is None, _finish(process)
    start = time.monotonic()
    code, _, err = _finish(process, 60)
    took = time.monotonic() - start
    assert code == 1, err
    summary = _summary(err)
    assert summary[0] == ("autopartition: error: rank 1 (stage 1) stopped answering: rank 0 (stage 0, action 0RB1) "
                          "got no answer from it within 3 s."), err
    step = "loss = pipe.step(inputs, target)"
    assert summary[1] == f"  at tests/models/failing_workers.py:{_line_of(MODELS / 'failing_workers.py', step)}: {step}", err
    assert "AUTOPARTITION_TIMEOUT" in summary[2]
    assert took < 15, took
    assert not [p for p in pids if _alive(p)], "a rank outlived the launcher"


def _line_of(path: Path, text: str) -> int:
    """The number of the one line of ``path`` that holds ``text`` (so that editing the file moves no test)."""
    found = [n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(found) == 1, f"{text!r} is on lines {found} of {path}"
    return found[0]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_the_rank_entry_point_records_an_error_in_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        print("args", sys.argv[1:], __name__)
        def main():
            return {}["missing"]
        main()
    """))
    job = tmp_path / "job"
    env = dict(os.environ, RANK="3", **{failure.FAILURE_DIR_ENV: str(job)})
    done = subprocess.run([PYTHON, "-m", "runtime.launch.failure", str(script), "--steps", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert "args ['--steps', '2'] __main__" in done.stdout
    assert "Traceback" not in done.stderr  # it is in the record
    [r] = read_records(job)
    assert (r.rank, r.type, r.message, r.in_user_code) == (3, "KeyError", "'missing'", True)
    assert r.where == f"{os.path.relpath(script, ROOT)}:5: return {{}}[\"missing\"]" or r.where.endswith(
        ':5: return {}["missing"]'), r.where
    assert json.loads((job / "rank3.json").read_text())["traceback"].startswith("Traceback")


def test_an_error_a_script_catches_from_the_pipeline_is_still_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found: train_gpt.py catches Pipeline's AutopartitionError and exits 2; the launcher said "without an error"."""
    from partitioner.errors import AutopartitionError

    class _Owner:
        @failure.reports_failures
        def step(self) -> None:
            raise AutopartitionError("the weights file is empty; pass a safetensors file")

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv(failure.FAILURE_DIR_ENV, str(tmp_path))
    with pytest.raises(AutopartitionError) as caught:
        _Owner().step()
    [r] = read_records(tmp_path)
    assert (r.rank, r.type, r.bad_input) == (2, "AutopartitionError", True), r
    assert "weights file is empty" in r.message
    # Uncaught after all, the entry point records it again with the user's frames: it replaces the first.
    assert record_failure(caught.value) == tmp_path / "rank2.json"
    assert record_failure(_raised(_users_bug)) is None  # another error later is not the cause


def test_the_excepthook_records_an_uncaught_error_and_still_prints_it(tmp_path: Path) -> None:
    """Ranks started without the entry point (torchrun --no-python / -m): Pipeline installs the hook."""
    code = "from runtime.launch.failure import install_excepthook\ninstall_excepthook()\nraise ValueError('lr must be > 0')"
    env = dict(os.environ, RANK="0", **{failure.FAILURE_DIR_ENV: str(tmp_path)})
    done = subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 1 and "ValueError: lr must be > 0" in done.stderr
    [r] = read_records(tmp_path)
    assert (r.rank, r.type, r.message, r.kind) == (0, "ValueError", "lr must be > 0", "error")


def test_stop_grace_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.launch import torchrun as launch

    monkeypatch.setenv("AUTOPARTITION_STOP_GRACE", "0")
    assert launch._grace() == 0.0  # 0: kill at once
    monkeypatch.setenv("AUTOPARTITION_STOP_GRACE", "-1")
    with pytest.raises(AutopartitionError, match="AUTOPARTITION_STOP_GRACE='-1': give the seconds to wait"):
        launch._grace()
