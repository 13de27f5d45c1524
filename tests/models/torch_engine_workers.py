"""Spawned ranks training saved plans with ``Pipeline(..., engine=...)``, for tests/test_torch_engine.py.

As :mod:`schedule_workers` (one spawn for every plan of a test; SGD with
momentum; per step the parameters before it, the gradients and the loss), with
each job naming its engine, and the buffers after the last step.  A rank whose ``Pipeline`` refuses the plan records
the refusal (type and message) instead of steps, so a test can check the refusal
is the same on every rank.  Compare records with
``schedule_workers.compare_with_reference``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partitioner.errors import AutopartitionError
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from runtime.verify import free_port, start_ranks

__all__ = ["train_plans"]

LR = 0.05  # as schedule_workers, whose reference replays these steps
MOMENTUM = 0.9


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, str, str]], steps: int, out: str) -> None:
    from rank_workers import set_rank_env

    from runtime.parallel.shard import plain_tensor
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    for k, (plan_dir, spec, engine) in enumerate(jobs):
        plan = Plan.load(plan_dir)
        model_file = load_model_file(spec)
        assert model_file.example_target is not None, spec
        torch.manual_seed(0)
        record: dict[str, Any] = {"replica": plan.rank_layout()[rank][1], "params": [], "grads": [], "losses": []}
        try:
            pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60.0,
                            engine=engine)
        except AutopartitionError as exc:  # refused on every rank alike (the ranks agree before raising)
            record["refused"] = (type(exc).__name__, str(exc))
            torch.save(record, Path(out) / f"job{k}_rank{rank}.pt")
            continue
        record["stages"] = pipe.stages
        inputs, target = model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size)
        opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
        for _ in range(steps):
            # plain_tensor: a fully sharded stage's DTensor gathered whole (every replica calls it, in one order).
            record["params"].append({n: plain_tensor(p).detach().clone() for n, p in pipe.named_parameters()})
            opt.zero_grad()
            loss = pipe.step(inputs, target)
            record["losses"].append(None if loss is None else loss.item())
            record["grads"].append({n: plain_tensor(p.grad).clone() for n, p in pipe.named_parameters()
                                    if p.grad is not None})
            opt.step()
        record["params"].append({n: plain_tensor(p).detach().clone() for n, p in pipe.named_parameters()})
        record["buffers"] = {n: b.detach().clone() for m in pipe.modules for n, b in m.named_buffers()}
        torch.save(record, Path(out) / f"job{k}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def train_plans(jobs: Sequence[tuple[Path, str, str]], *, steps: int) -> list[list[dict[str, Any]]]:
    """Train each (plan directory, model file, engine) ``steps`` steps on spawned gloo ranks; records per job, rank.

    Every plan must need the same number of ranks.
    """
    worlds = {Plan.load(d).gpus for d, _, _ in jobs}
    assert len(worlds) == 1, f"plans for different rank counts in one spawn: {worlds}"
    world = worlds.pop()
    with tempfile.TemporaryDirectory(prefix="torch-engine-") as out:
        start_ranks(_worker, (world, free_port(), [(str(d), s, e) for d, s, e in jobs], steps, out), world)
        return [[torch.load(Path(out) / f"job{k}_rank{r}.pt", weights_only=True) for r in range(world)]
                for k in range(len(jobs))]
