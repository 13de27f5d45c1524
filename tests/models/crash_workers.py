"""Rank entry points and helpers of the checkpoint crash tests (tests/test_checkpoint_crash.py).

A saving job trains ``tests/models/tied_lm.py``, saves step 1 (complete), trains
one more step and saves step 2 while a fault kills one rank at a chosen point:

* ``before-shards``: the victim exits before DCP writes anything (the others wait in DCP's collectives);
* ``mid-shard``: the victim writes its shard, cuts it to half its length, and exits (a torn file on disk);
* ``sigkill``: the victim announces that it is saving and sleeps; the test kills it with SIGKILL;
* ``plan``, ``manifest``, ``rename``: rank 0 exits before writing plan.json, before writing the
  manifest (every shard written), before the rename (manifest written);
* ``prune``: rank 0 exits after the rename, before pruning (step 2 is complete);
* ``replace``: the second save is of step 1 again; rank 0 exits between renaming the old
  step 1 aside and renaming the new one into place.

Every rank records its state dict just before each save (``state_save{I}_rank{R}.pt``, I = 1, 2),
so the test can compare what a fresh job resumes with, exactly.  The process exits
with :data:`KILLED` at the fault (``os._exit``: no cleanup, no flush, as a crash).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_workers import error_of, set_rank_env

__all__ = [
    "KILLED",
    "POINTS",
    "crash_save_worker",
    "resume_worker",
    "run_crash_job",
    "single_rank_group",
]

KILLED = 17  # the exit code of a rank the fault stopped
# kill point -> (victim rank, the save a fresh job must resume: 1 or 2)
POINTS: dict[str, tuple[int, int]] = {
    "before-shards": (1, 1),
    "mid-shard": (1, 1),
    "sigkill": (1, 1),
    "plan": (0, 1),
    "manifest": (0, 1),
    "rename": (0, 1),
    "prune": (0, 2),
    "replace": (0, 1),
}
LR = 0.01


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo process group in this process (save_checkpoint / load_checkpoint are collectives)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as scratch:
        store = dist.FileStore(os.path.join(scratch, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _pipeline(plan_dir: str, spec: str) -> Any:
    from partitioner.modelfile import load_model_file
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    model_file = load_model_file(spec)
    torch.manual_seed(0)
    return Pipeline(Plan.load(plan_dir), model_file.build(), model_file.loss_fn, device=torch.device("cpu"),
                    timeout=30)


def _state(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def _die() -> None:
    os._exit(KILLED)


def _arm(point: str, rank: int, victim: int, out: Path) -> None:
    """Install the fault of ``point`` in this process (the victim's), for the second save only."""
    import torch.distributed.checkpoint as dcp

    from runtime.state import checkpoint

    if rank != victim:
        return
    if point == "mid-shard":
        original = dcp.FileSystemWriter.write_data

        def torn(self: Any, plan: Any, planner: Any) -> Any:
            future = original(self, plan, planner)
            for result in future.wait():
                shard = Path(str(self.path)) / result.storage_data.relative_path
                with shard.open("r+b") as f:
                    f.truncate(shard.stat().st_size // 2)
            _die()

        dcp.FileSystemWriter.write_data = torn  # type: ignore[method-assign]
        return

    def hook(reached: str) -> None:
        if point == "before-shards" and reached == "shards":
            _die()
        if point == "sigkill" and reached == "shards":
            (out / "saving").write_text(str(os.getpid()))
            time.sleep(60)  # the test kills this process now
        if point == reached:
            _die()

    checkpoint._fault_hook = hook


def crash_save_worker(rank: int, world: int, port: int, plan_dir: str, spec: str, root: str, point: str) -> None:
    """Save step 1, train, then save step 2 (``replace``: step 1 again) with ``point``'s fault armed."""
    from partitioner.modelfile import load_model_file

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    out = Path(root)
    model_file = load_model_file(spec)
    pipe = _pipeline(plan_dir, spec)
    inputs = model_file.example_inputs(pipe.plan.batch_size)
    target = model_file.example_target(pipe.plan.batch_size)  # type: ignore[misc]
    opt = torch.optim.Adam(pipe.parameters(), lr=LR)
    for save, step in ((1, 1), (2, 1 if point == "replace" else 2)):
        opt.zero_grad()
        pipe.step(inputs, target)
        opt.step()
        torch.save(_state(pipe), out / f"state_save{save}_rank{rank}.pt")
        if save == 2:
            _arm(point, rank, POINTS[point][0], out)
        pipe.save_checkpoint(out / "ckpt", optimizer=opt, step=step)
    dist.barrier()
    dist.destroy_process_group()


def run_crash_job(
    fn: Any, nprocs: int, args: tuple[Any, ...], *, victim: int, marker: Path | None, limit_s: float
) -> list[int | None]:
    """Start the saving ranks; when the victim has died, kill the others (SIGKILL) as a crashed job's are.

    ``marker``: a file the victim writes when it is mid-save; the test then sends it SIGKILL.
    Returns the exit codes (negative: killed by that signal; None: still running at ``limit_s``).
    """
    from runtime.verify import start_ranks

    context = start_ranks(fn, args, nprocs, join=False)
    assert context is not None
    processes = context.processes
    deadline = time.monotonic() + limit_s
    killed_at: float | None = None
    while time.monotonic() < deadline and any(p.is_alive() for p in processes):
        if marker is not None and marker.exists() and processes[victim].is_alive():
            processes[victim].kill()  # SIGKILL, mid-save
        if killed_at is None and not processes[victim].is_alive():
            killed_at = time.monotonic()
        if killed_at is not None and time.monotonic() > killed_at + 1.0:
            break  # the victim is gone: the rest of a crashed job goes down with it
        time.sleep(0.05)
    codes = [p.exitcode for p in processes]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def resume_worker(
    rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str, directories: dict[str, str],
    broken: dict[str, str],
) -> None:
    """Fresh ranks: load each crashed directory (recording the step and state), then each broken one
    (recording the error), then one collective to show that no rank was left behind."""
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    pipe = _pipeline(plan_dir, spec)
    opt = torch.optim.Adam(pipe.parameters(), lr=LR)
    result: dict[str, Any] = {"resumed": {}, "errors": {}}
    for label, directory in directories.items():
        step = pipe.load_checkpoint(directory, optimizer=opt)
        result["resumed"][label] = {"step": step, "state": _state(pipe)}
    for label, directory in broken.items():
        result["errors"][label] = error_of(lambda d=directory: pipe.load_checkpoint(d, optimizer=opt))
    dist.barrier()
    result["after"] = "reached"
    torch.save(result, Path(out_dir) / f"resume_rank{rank}.pt")
    dist.destroy_process_group()
