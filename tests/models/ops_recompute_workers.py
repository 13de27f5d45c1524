"""Spawned ranks training plans whose stages recompute some layers' cheap ops only, for tests/test_ops_recompute.py.

:func:`train_plans` runs every (plan directory, engine, model file) in one spawn, as
:mod:`schedule_workers` does (one ``Pipeline`` per plan in turn; SGD with
momentum; per step the parameters before it, the gradients and the loss), and
records how each stage of the rank runs its layer runs (``kinds``: the
``Recomputed`` or ZeRO-3 ``LayeredStage`` modules' per-run kinds), or the error a
plan met.  Compare records with ``schedule_workers.compare_with_reference``.
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from schedule_workers import LR, MOMENTUM

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from runtime.verify import free_port

__all__ = ["train_plans"]


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, str, str]], steps: int, out: str) -> None:
    from rank_workers import set_rank_env

    from runtime.execute.recompute import Recomputed
    from runtime.parallel.shard import LayeredStage, plain_tensor
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    for k, (plan_dir, engine, spec) in enumerate(jobs):
        plan = Plan.load(plan_dir)
        model_file = load_model_file(spec)
        record: dict[str, Any] = {"replica": plan.rank_layout()[rank][1], "params": [], "grads": [], "losses": []}
        try:
            torch.manual_seed(0)
            pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60.0,
                            engine=engine)
            record["kinds"] = [list(x.kinds) for m in pipe._runnables for x in m.modules()
                               if isinstance(x, (Recomputed, LayeredStage))]
            inputs = model_file.example_inputs(plan.batch_size)
            target = model_file.example_target(plan.batch_size)  # type: ignore[misc]
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
        except Exception as exc:  # noqa: BLE001 - the test reads it
            record["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        torch.save(record, Path(out) / f"job{k}_rank{rank}.pt")
        if "error" in record:
            break  # the other rank may wait in a collective: end the job, the test reports the error
    dist.barrier()
    dist.destroy_process_group()


def train_plans(jobs: Sequence[tuple[Path, str, str]], *, steps: int, limit_s: float = 120.0
                ) -> list[list[dict[str, Any]]]:
    """Train each (plan directory, engine, model file) ``steps`` steps on 2 spawned gloo ranks; records per job,
    then rank.

    A job a rank did not reach (an earlier one failed) has no record: an empty dict.
    """
    from rank_workers import spawn_and_wait

    world = 2
    assert all(Plan.load(d).gpus == world for d, _, _ in jobs)
    with tempfile.TemporaryDirectory(prefix="ops-recompute-") as out:
        codes = spawn_and_wait(_worker, world, (world, free_port(), [(str(d), e, s) for d, e, s in jobs], steps, out),
                               limit_s=limit_s)
        records = [[torch.load(Path(out) / f"job{k}_rank{r}.pt", weights_only=True)
                    if (Path(out) / f"job{k}_rank{r}.pt").exists() else {} for r in range(world)]
                   for k in range(len(jobs))]
    assert codes == [0] * world or any("error" in r for job in records for r in job), f"rank exit codes {codes}"
    return records
