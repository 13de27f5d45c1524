"""Spawned ranks training several plans of models whose weights are tied by use, and their reference (issue 29).

Starting ranks costs far more than training these tiny models, so
:func:`train_jobs` runs the jobs of a test file in few starts of the ranks (as
many as the largest plan needs; each job with DTensors in a start of its own):
each job runs on the first ``plan.gpus`` ranks with its own rendezvous port, the
others skip it.  Per job a
:class:`runtime.Pipeline` trains ``steps`` SGD steps (``pipe.optimizer``: ZeRO-1
where the plan shards the optimizer) and records, per step, the parameters before
it, the gradients (fully sharded and tensor-parallel ones gathered whole) and the
loss; optionally the whole-model norm ``clip_grad_norm_`` returns (gradients
recorded before clipping), an ``eval_step`` loss after training and a checkpoint.
:func:`compare` replays every step with the whole model in this process, from the
pipeline's parameters, on the same micro-batches (replicas averaged, clipping as
``torch.nn.utils.clip_grad_norm_``), and returns the largest differences.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile
from runtime.execute.stage import call_spec
from runtime.verify import free_port, reference_microbatches, start_ranks

__all__ = ["Differences", "Job", "compare", "plan_case", "train_jobs"]

LR = 0.05
MOMENTUM = 0.9


@dataclasses.dataclass(frozen=True)
class Job:
    """One plan to train: its directory, model file and what else to exercise."""

    plan: str
    spec: str
    engine: str = "ours"
    clip: float | None = None  # clip_grad_norm_(clip) before every optimizer step
    eval: bool = False  # an eval_step after the last step
    save: str | None = None  # a checkpoint directory, written after the last step


def plan_case(spec: str, directory: Path, *, pp: int, dp: int = 1, tp: int = 1, schedule: str,
              chunks: int | None = None, shard: str = "none", microbatches: int = 2, batch: int = 8,
              reshard_after_forward: bool = False) -> Plan:
    """Plan model file ``spec`` at this layout (predicted h100 costs: the split is the same on every run); saved."""
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    plan = compile(model_file.build(), model_file.example_inputs(batch), gpus=pp * dp * tp, pp=pp, dp=dp, tp=tp,
                   microbatches=microbatches, schedule=schedule, chunks=chunks, device="h100", shard=shard,
                   gpus_per_node=pp * dp * tp if tp > 1 else None)
    if reshard_after_forward:  # ZeRO-3: a layer gathered per forward and backward
        plan = dataclasses.replace(plan, stages=tuple(
            dataclasses.replace(s, reshard_after_forward=s.shard == "full") for s in plan.stages))
    plan.save(directory)
    return Plan.load(directory)


def _whole(value: torch.Tensor) -> torch.Tensor:
    from runtime.parallel.shard import plain_tensor

    return plain_tensor(value).detach().clone()


def _run_job(rank: int, job: Job, port: int, steps: int, out: Path) -> None:
    from runtime.pipeline import Pipeline

    plan = Plan.load(job.plan)
    if rank >= plan.gpus:
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(plan.gpus), LOCAL_RANK=str(rank))
    model_file = load_model_file(job.spec)
    torch.manual_seed(0)
    pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60.0,
                    engine=job.engine)
    inputs, target = model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size)
    opt = pipe.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    record: dict[str, Any] = {"replica": plan.rank_layout()[rank][1], "stages": pipe.stages,
                              "params": [], "grads": [], "losses": [], "norms": []}
    for _ in range(steps):
        record["params"].append({n: _whole(p) for n, p in pipe.named_parameters()})
        opt.zero_grad()
        loss = pipe.step(inputs, target)
        record["losses"].append(None if loss is None else loss.item())
        record["grads"].append({n: _whole(p.grad) for n, p in pipe.named_parameters() if p.grad is not None})
        if job.clip is not None:
            record["norms"].append(float(pipe.clip_grad_norm_(job.clip)))
        opt.step()
    record["params"].append({n: _whole(p) for n, p in pipe.named_parameters()})
    if job.eval:
        loss = pipe.eval_step(inputs, target)
        record["eval"] = None if loss is None else float(loss)
    if job.save is not None:
        pipe.save_checkpoint(job.save, step=steps)
    torch.save(record, out / f"job-{Path(job.plan).name}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, jobs: list[Job], ports: list[int], steps: int, out: str) -> None:
    torch.set_num_threads(1)
    for job, port in zip(jobs, ports, strict=True):
        try:
            _run_job(rank, job, port, steps, Path(out))
        except Exception as exc:
            raise RuntimeError(f"rank {rank}, job {job}: {type(exc).__name__}: {exc}") from exc


def _uses_dtensor(plan: Plan) -> bool:
    return plan.tp > 1 or (plan.dp > 1 and any(s.shard == "full" for s in plan.stages))


def train_jobs(jobs: Sequence[Job], *, steps: int) -> list[list[dict[str, Any]]]:
    """Train every job; per job, every rank's record (rank order).

    Jobs without DTensor run in one start of the ranks; each job with DTensors (tensor parallel, FSDP2)
    in its own: DTensor caches a redistribution per mesh *layout*, so a later job's mesh of the same
    shape would reach an earlier job's destroyed process groups.
    """
    plans = [Plan.load(j.plan) for j in jobs]
    plain = [k for k, plan in enumerate(plans) if not _uses_dtensor(plan)]
    groups = ([plain] if plain else []) + [[k] for k, plan in enumerate(plans) if _uses_dtensor(plan)]
    records: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="tied-") as out:
        for group in groups:
            ports: list[int] = []
            while len(ports) < len(group):
                port = free_port()
                if port not in ports:
                    ports.append(port)
            start_ranks(_worker, ([jobs[k] for k in group], ports, steps, out), max(plans[k].gpus for k in group))
            for k in group:
                records[k] = [torch.load(Path(out) / f"job-{Path(jobs[k].plan).name}-rank{r}.pt", weights_only=True)
                              for r in range(plans[k].gpus)]
    return [records[k] for k in range(len(jobs))]


@dataclasses.dataclass(frozen=True)
class Differences:
    """Largest absolute differences over every step and rank, and where the worst gradient is."""

    loss: float
    grad: float
    param: float
    norm: float  # clip_grad_norm_'s total norm (0 without clipping)
    eval: float  # eval_step's loss (0 without)
    worst: str
    compared: int  # gradients compared

    def largest(self) -> float:
        return max(self.loss, self.grad, self.param, self.norm, self.eval)


def compare(plan: Plan, spec: str, ranks: list[dict[str, Any]], *, clip: float | None = None) -> Differences:
    """Replay the recorded steps with the whole model (micro-batched and averaged as the plan) and compare."""
    model_file = load_model_file(spec)
    assert model_file.example_target is not None and model_file.loss_fn is not None, spec
    torch.manual_seed(0)
    model = model_file.build()
    params = dict(model.named_parameters(remove_duplicate=False))
    inputs = call_spec(plan).flatten(model_file.example_inputs(plan.batch_size))
    target = model_file.example_target(plan.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_d = grad_d = param_d = norm_d = eval_d = 0.0
    worst, compared = "-", 0
    for step in range(len(ranks[0]["grads"])):
        with torch.no_grad():
            for r in ranks:
                if r["replica"] == 0:
                    for name, value in r["params"][step].items():
                        params[name].copy_(value)
        opt.zero_grad()
        losses = []
        for replica in range(plan.dp):
            for x, y in reference_microbatches(plan, inputs, target, replica):
                loss = model_file.loss_fn(model(*x), y) / plan.microbatches / plan.dp
                loss.backward()
                losses.append(loss.detach())
        want = float(torch.stack(losses).sum())
        got = [r["losses"][step] for r in ranks if r["losses"][step] is not None]
        assert got, "no rank returned the loss"
        loss_d = max(loss_d, *(abs(g - want) for g in got))
        for i, r in enumerate(ranks):
            for name, g in r["grads"][step].items():
                d = float((g - params[name].grad).abs().max())
                compared += 1
                if d > grad_d:
                    grad_d, worst = d, f"{name} on rank {i}, step {step + 1}"
        if clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            norm_d = max(norm_d, *(abs(r["norms"][step] - norm) for r in ranks))
        opt.step()
        for r in ranks:
            for name, value in r["params"][step + 1].items():
                param_d = max(param_d, float((value - params[name].detach()).abs().max()))
    evals = [r["eval"] for r in ranks if r.get("eval") is not None]
    if evals:
        model.eval()
        with torch.no_grad():
            want = float(torch.stack([model_file.loss_fn(model(*x), y) for replica in range(plan.dp)
                                      for x, y in reference_microbatches(plan, inputs, target, replica)]).mean())
        eval_d = max(abs(e - want) for e in evals)
    return Differences(loss_d, grad_d, param_d, norm_d, eval_d, worst, compared)
