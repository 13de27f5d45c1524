"""One rank fails mid-step: the others must stop, say who failed and where, and exit.

Three CPU ranks (gloo) run a three-stage GPipe plan of ``tests/models/dying.py``; on
the last stage (rank 2) ``loss_fn`` calls ``os._exit(17)`` (or, in the hang test,
sleeps) on the second micro-batch of the second step.  Each surviving rank catches
what ``Pipeline.step`` raises and writes ``type: message`` to a file
(``tests/models/rank_workers.failure_worker``), then exits non-zero.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest

from partitioner.plan import Plan
from runtime.verify import free_port, start_ranks

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "dying.py")
BATCH = 8
STEPS = 3
PIPELINE_TIMEOUT_S = 10.0  # Pipeline(timeout=...): the limit of every wait
HANG_TIMEOUT_S = 5.0  # the same in the hang test, which waits it out: long enough for a step on a loaded machine
LIMIT_S = 60.0  # every survivor must have exited by then (the default collective timeout is 30 min)

import dying
import rank_workers
from planning_helpers import make_plan

pytestmark = pytest.mark.slow  # spawns ranks


@dataclasses.dataclass
class Outcome:
    plan: Plan
    failing_rank: int
    codes: list[int | None]  # exit codes when every survivor had exited (None: still running)
    reports: dict[int, str]  # "type: message" per rank, "<no report>" where none was written
    steps_done: dict[int, str]  # content of rank{R}.steps
    stop_delay_s: dict[int, float]  # per survivor: from finishing step 0 to catching the failure


def run_with_failing_rank(tmp_path: Path, *, hang: bool, timeout: float = PIPELINE_TIMEOUT_S) -> Outcome:
    """Plan pp=3, spawn the ranks, wait until every rank but the failing one has exited."""
    plan = make_plan(SPEC, tmp_path / "plan", pp=3, dp=1, microbatches=dying.MICROBATCHES, schedule="gpipe")
    assert (plan.pp, plan.dp, plan.gpus) == (3, 1, 3)
    failing = plan.stages[-1].ranks[0]
    out = tmp_path / "out"
    out.mkdir()
    context = start_ranks(
        rank_workers.failure_worker,
        (plan.gpus, free_port(), str(tmp_path / "plan"), SPEC, str(out), STEPS, timeout, failing, hang),
        plan.gpus, join=False,
    )
    assert context is not None
    processes = context.processes
    survivors = [p for r, p in enumerate(processes) if r != failing]
    start = time.monotonic()
    while time.monotonic() - start < LIMIT_S and any(p.is_alive() for p in survivors):
        time.sleep(0.1)
    if not hang:  # the dead rank is gone already; give its exit status a moment to be collected
        processes[failing].join(timeout=5)
    codes = [p.exitcode for p in processes]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()

    def read(path: Path) -> str:
        return path.read_text() if path.exists() else "<no report>"

    delays = {}
    for r in range(plan.gpus):
        failed_at, steps = out / f"rank{r}.failed_at", out / f"rank{r}.steps"
        if failed_at.exists() and steps.exists():
            delays[r] = float(failed_at.read_text()) - steps.stat().st_mtime
    return Outcome(
        plan=plan, failing_rank=failing, codes=codes,
        reports={r: read(out / f"rank{r}.txt") for r in range(plan.gpus)},
        steps_done={r: read(out / f"rank{r}.steps") for r in range(plan.gpus)},
        stop_delay_s=delays,
    )


def check_survivors(o: Outcome, *, max_delay_s: float) -> None:
    """Survivors exited non-zero, mid-run, with StepFailure messages naming the right peers."""
    survivors = [r for r in range(o.plan.gpus) if r != o.failing_rank]
    assert all(o.codes[r] is not None for r in survivors), (
        f"survivors still running after {LIMIT_S:g} s: exit codes {o.codes}, reports {o.reports}")
    assert all(o.codes[r] != 0 for r in survivors), f"survivors must exit non-zero: {o.codes}, {o.reports}"
    # Mid-run: every rank finished step 0 (and no later step) before the failure.
    assert all(o.steps_done[r] == "1" for r in range(o.plan.gpus)), o.steps_done
    assert o.reports[o.failing_rank] == "<no report>", o.reports[o.failing_rank]
    for r in survivors:
        delay = o.stop_delay_s.get(r)
        assert delay is not None, f"rank {r} wrote no report: {o.reports[r]}"
        assert 0 <= delay <= max_delay_s, f"rank {r} stopped {delay:.1f} s after step 0 (limit {max_delay_s:g} s)"

    # Rank 1 (stage 1) waits on the failing rank itself: its message names rank 2 and the action.
    neighbour = o.plan.stages[-2].ranks[0]
    message = o.reports[neighbour]
    assert message.startswith("StepFailure: "), message
    assert re.search(rf"rank {neighbour} \(stage 1, replica 0\) stopped at action 1(RB|RF|SB|SF)\d+: "
                     "peer failure: ", message), message
    assert f"waiting for rank {o.failing_rank} (stage 2, replica 0)" in message, message
    assert "schedule:" in message, message
    # Rank 0 only talks to rank 1, so it learns of the failure through rank 1's exit.
    first = o.reports[0]
    assert first.startswith("StepFailure: "), first
    assert re.search(r"rank 0 \(stage 0, replica 0\) stopped at action 0(RB|RF|SB|SF)\d+: peer failure: ", first), first
    assert re.search(r"waiting for rank [12] \(stage [12], replica 0\)", first), first


def test_killed_rank_stops_the_others_with_a_message_naming_it(tmp_path: Path) -> None:
    o = run_with_failing_rank(tmp_path, hang=False)
    assert o.codes[o.failing_rank] == dying.EXIT_CODE, f"rank 2 should have died in loss_fn: {o.codes}"
    # A closed connection is noticed at once (rank 0 a moment later, when rank 1 exits),
    # not by waiting out the Pipeline's timeout.
    check_survivors(o, max_delay_s=PIPELINE_TIMEOUT_S / 2)


def test_hung_rank_stops_the_others_after_the_pipeline_timeout(tmp_path: Path) -> None:
    o = run_with_failing_rank(tmp_path, hang=True, timeout=HANG_TIMEOUT_S)
    assert o.codes[o.failing_rank] is None, f"rank 2 should still hang in loss_fn: {o.codes}"
    # Rank 1 waits HANG_TIMEOUT_S for rank 2, then rank 0 learns of rank 1's exit.
    check_survivors(o, max_delay_s=2 * HANG_TIMEOUT_S + 10)
    # Nothing broke a connection: rank 1 stopped because its wait for rank 2 timed out.
    assert o.stop_delay_s[1] >= 0.8 * HANG_TIMEOUT_S, o.stop_delay_s
