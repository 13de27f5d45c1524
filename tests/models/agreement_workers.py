"""Rank entry points for ``tests/test_plan_agreement.py`` (spawned; see ``rank_workers.py``).

Each worker writes what its rank saw into ``out_dir``: ``rank{R}.txt`` holds
``ok`` or ``type: message`` of what stopped it, ``rank{R}.json`` the plan it ran
(``compile_worker``), ``rank{R}.loss`` the step's loss on the last stage, and
``rank{R}.seconds`` how long it ran before stopping.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rank_workers import set_rank_env

PIPELINE_TIMEOUT_S = 30.0


def _run(rank: int, out_dir: str, body: Any) -> None:
    """Run ``body()``, reporting its outcome (and how long it took) into ``out_dir``; exit 1 on an error."""
    out = Path(out_dir)
    start = time.monotonic()
    try:
        body()
        (out / f"rank{rank}.txt").write_text("ok")
    except BaseException as exc:  # noqa: BLE001 - report whatever stopped this rank
        (out / f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    finally:
        (out / f"rank{rank}.seconds").write_text(repr(time.monotonic() - start))


def _train_step(plan: Any, model_file: Any, rank: int, out: Path) -> None:
    """Build the Pipeline on the plan and run one step; the last stage writes the loss."""
    import torch.distributed as dist

    from runtime.pipeline import Pipeline

    torch.manual_seed(0)
    pipe = Pipeline(plan, model_file.build(), model_file.loss_fn,
                    device=torch.device("cpu"), timeout=PIPELINE_TIMEOUT_S)
    loss = pipe.step(model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size))  # type: ignore[misc]
    if loss is not None:
        (out / f"rank{rank}.loss").write_text(repr(loss.item()))
    dist.barrier()
    dist.destroy_process_group()


def plan_file_worker(rank: int, world: int, port: int, plan_dirs: list[str], model_spec: str, out_dir: str) -> None:
    """Rank R loads ``plan_dirs[R]`` (they may differ) and runs one step."""
    from partitioner.modelfile import load_model_file
    from partitioner.plan import Plan

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    _run(rank, out_dir, lambda: _train_step(
        Plan.load(plan_dirs[rank]), load_model_file(model_spec), rank, Path(out_dir)))


def compile_worker(
    rank: int, world: int, port: int, model_spec: str, out_dir: str, options: dict[str, Any], slow_rank: int
) -> None:
    """Every rank calls ``partitioner.compile(**options)`` inside the process group, then runs one step.

    ``options["late_s"]`` (popped) makes every rank but 0 arrive that many seconds late.
    """
    import torch.distributed as dist

    from partitioner.modelfile import load_model_file
    from partitioner.search.planner import compile

    set_rank_env(rank, world, port)
    os.environ["AUTOPARTITION_TEST_SLOW_RANK"] = str(slow_rank)
    torch.set_num_threads(1)
    out = Path(out_dir)

    def body() -> None:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PIPELINE_TIMEOUT_S))
        model_file = load_model_file(model_spec)
        torch.manual_seed(0)
        batch = options.pop("batch")
        if rank != 0:
            time.sleep(options.pop("late_s", 0.0))
        options.pop("late_s", None)
        plan = compile(model_file.build(), model_file.example_inputs(batch), **options)
        (out / f"rank{rank}.json").write_text(plan.to_json())
        _train_step(plan, model_file, rank, out)

    _run(rank, out_dir, body)


def rank0_compiles_worker(
    rank: int, world: int, port: int, model_spec: str, out_dir: str, options: dict[str, Any], plan_dir: str
) -> None:
    """Rank 0 alone calls ``compile()`` and saves the plan; every rank waits at a barrier, then ``Plan.load``s it."""
    import torch.distributed as dist

    from partitioner.modelfile import load_model_file
    from partitioner.plan import Plan
    from partitioner.search.planner import compile

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    out = Path(out_dir)

    def body() -> None:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PIPELINE_TIMEOUT_S))
        if rank == 0:
            model_file = load_model_file(model_spec)
            batch = options.pop("batch")
            compile(model_file.build(), model_file.example_inputs(batch), **options).save(plan_dir)
        dist.barrier()
        (out / f"rank{rank}.json").write_text(Plan.load(plan_dir).to_json())
        dist.barrier()
        dist.destroy_process_group()

    _run(rank, out_dir, body)


def compile_calls_worker(
    rank: int, world: int, port: int, model_spec: str, out_dir: str, calls: list[dict[str, Any]]
) -> None:
    """Each rank makes the ``compile()`` calls of ``calls`` whose ``ranks`` name it, in order.

    ``rank{R}.json`` holds the plans it got so far (JSON list of plan texts),
    ``rank{R}.txt`` ``ok`` or the first error.  A call waits for rank 0's plan at most
    its ``wait_s`` seconds (default: ``PIPELINE_TIMEOUT_S``).  A final
    barrier keeps rank 0 (which hosts the store) alive until every rank is done.
    """
    import json

    import torch.distributed as dist

    from partitioner import agree
    from partitioner.modelfile import load_model_file
    from partitioner.search.planner import compile

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    out = Path(out_dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PIPELINE_TIMEOUT_S))

    def body() -> None:
        model_file = load_model_file(model_spec)
        plans = []
        for call in calls:
            if rank in call["ranks"]:
                options = dict(call["options"])
                batch = options.pop("batch")
                agree.COMPILE_WAIT_S = call.get("wait_s", PIPELINE_TIMEOUT_S)
                plans.append(compile(model_file.build(), model_file.example_inputs(batch), **options).to_json())
                (out / f"rank{rank}.json").write_text(json.dumps(plans))

    try:
        _run(rank, out_dir, body)
    finally:
        dist.barrier()
        dist.destroy_process_group()
