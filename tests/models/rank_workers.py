"""Rank entry points for tests that spawn their own ranks (rank failure, Pipeline API).

``torch.multiprocessing`` with the spawn start method pickles the entry point by
module and name, so these functions live in an importable module: the tests put
``tests/models`` on ``sys.path`` before spawning (spawned children inherit it).
Each worker reports through files in ``out_dir`` (one per rank), never through
return values, so a test can read what every surviving rank saw.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

LR = 0.01
MOMENTUM = 0.9


def spawn_and_wait(fn: Any, nprocs: int, args: tuple[Any, ...], *, limit_s: float) -> list[int | None]:
    """Start ``nprocs`` spawned ranks running ``fn(rank, *args)``; wait until all exit or ``limit_s`` passes.

    Returns every rank's exit code (None for a rank still running at the limit; such
    ranks are then killed).
    """
    from runtime.verify import start_ranks

    context = start_ranks(fn, args, nprocs, join=False)
    assert context is not None
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(p.is_alive() for p in context.processes):
        time.sleep(0.05)
    codes = [p.exitcode for p in context.processes]
    for p in context.processes:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def error_of(call: Any) -> str | None:
    """``call()``'s exception as ``"Type: message"``, or None when it returns."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the tests check the type and message
        return f"{type(exc).__name__}: {exc}"
    return None


def set_rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )


def failure_worker(
    rank: int,
    world: int,
    port: int,
    plan_dir: str,
    model_spec: str,
    out_dir: str,
    steps: int,
    timeout: float,
    die_rank: int,
    hang: bool = False,
) -> None:
    """Train ``steps`` steps; on any exception write ``type: message`` to ``rank{R}.txt`` and exit 1.

    ``rank{R}.steps`` holds the number of steps this rank completed, ``rank{R}.failed_at``
    the time (``time.time()``) the exception was caught.  ``die_rank`` dies (or with
    ``hang`` hangs) mid-step in ``tests/models/dying.py``'s loss_fn.
    """
    from partitioner.modelfile import load_model_file
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    os.environ["AUTOPARTITION_TEST_DIE_RANK"] = str(die_rank)
    os.environ["AUTOPARTITION_TEST_HANG"] = "1" if hang else "0"
    torch.set_num_threads(1)
    out = Path(out_dir)
    done = 0
    try:
        plan = Plan.load(plan_dir)
        model_file = load_model_file(model_spec)
        torch.manual_seed(0)
        pipe = Pipeline(plan, model_file.build(), model_file.loss_fn,
                        device=torch.device("cpu"), timeout=timeout)
        inputs = model_file.example_inputs(plan.batch_size)
        target = model_file.example_target(plan.batch_size)  # type: ignore[misc]
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        for _ in range(steps):
            opt.zero_grad()
            pipe.step(inputs, target)
            opt.step()
            done += 1
            (out / f"rank{rank}.steps").write_text(str(done))
    except BaseException as exc:  # noqa: BLE001 - report whatever stopped this rank
        (out / f"rank{rank}.failed_at").write_text(repr(time.time()))
        (out / f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        (out / f"rank{rank}.traceback").write_text(traceback.format_exc())
        sys.exit(1)
    (out / f"rank{rank}.txt").write_text("finished without error")


def api_worker(
    rank: int,
    world: int,
    port: int,
    plan_dir: str,
    model_spec: str,
    out_dir: str,
    steps: int,
    checkpoint: str,
) -> None:
    """Exercise the Pipeline API on one rank; results go to ``rank{R}.pt`` in ``out_dir``.

    Records: the stage's state-dict keys before training; the error of a step with a
    mini-batch of the wrong size and of one with too many inputs; the state dict
    after ``steps`` SGD steps (with momentum, as the tests' reference); the state dict
    after loading the full checkpoint at ``checkpoint``, and the loss of one more step
    from it (None off the last stage).
    """
    import torch.distributed as dist

    from partitioner.modelfile import load_model_file
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    plan = Plan.load(plan_dir)
    model_file = load_model_file(model_spec)
    torch.manual_seed(0)
    pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60)
    result: dict[str, Any] = {"keys_before": sorted(pipe.state_dict())}
    inputs = model_file.example_inputs(plan.batch_size)
    target = model_file.example_target(plan.batch_size)  # type: ignore[misc]

    def error_of(call: Any) -> str | None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test checks the type and message
            return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        return None

    wrong = model_file.example_inputs(plan.batch_size + plan.dp * plan.microbatches)
    wrong_target = model_file.example_target(plan.batch_size + plan.dp * plan.microbatches)  # type: ignore[misc]
    result["wrong_batch_error"] = error_of(lambda: pipe.step(wrong, wrong_target))
    result["extra_input_error"] = error_of(lambda: pipe.step(inputs + inputs, target))

    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = pipe.step(inputs, target)
        losses.append(None if loss is None else loss.item())
        opt.step()
    result["losses"] = losses
    result["trained"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}

    full = torch.load(checkpoint, weights_only=True)
    pipe.load_state_dict(full)
    result["loaded"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.step(inputs, target)
    result["loss_after_load"] = None if loss is None else loss.item()
    result["grads_after_load"] = {n: p.grad.detach().clone() for n, p in pipe.named_parameters()
                                  if p.grad is not None}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def environment_worker(rank: int, variable: str, out_dir: str) -> None:
    """Write ``variable``'s value in this rank's environment and the rank's process id to ``rank{R}.txt``."""
    (Path(out_dir) / f"rank{rank}.txt").write_text(f"{os.environ.get(variable)} {os.getpid()}")
