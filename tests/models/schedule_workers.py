"""Spawned ranks that train several saved plans in one process group, and the reference to compare them with.

Starting ranks (interpreter, torch, rendezvous) costs far more than training a
tiny model, so :func:`train_plans` runs every plan of a test file in one spawn:
each rank builds one ``Pipeline`` per plan in turn and records, per step, the
parameters before it, the gradients, the loss (ranks of the last stage), and
the parameters after the last step (SGD with momentum, as ``autopartition
verify`` trains).  :func:`compare_with_reference` replays every step with the
whole model in this process, from the pipeline's parameters of that step, on
the same micro-batches (``runtime.verify.reference_microbatches``), and
returns the largest differences.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from runtime.execute.stage import call_spec
from runtime.verify import free_port, reference_microbatches, start_ranks

__all__ = ["Differences", "compare_with_reference", "train_plans"]

LR = 0.05
MOMENTUM = 0.9


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, str]], steps: int, out: str) -> None:
    from rank_workers import set_rank_env

    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    for k, (plan_dir, spec) in enumerate(jobs):
        plan = Plan.load(plan_dir)
        model_file = load_model_file(spec)
        assert model_file.example_target is not None, spec
        torch.manual_seed(0)
        pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60.0)
        inputs, target = model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size)
        opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=MOMENTUM)
        record: dict[str, Any] = {"replica": plan.rank_layout()[rank][1], "stages": pipe.stages,
                                  "params": [], "grads": [], "losses": []}
        for _ in range(steps):
            record["params"].append({n: p.detach().clone() for n, p in pipe.named_parameters()})
            opt.zero_grad()
            loss = pipe.step(inputs, target)
            record["losses"].append(None if loss is None else loss.item())
            record["grads"].append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
            opt.step()
        record["params"].append({n: p.detach().clone() for n, p in pipe.named_parameters()})
        torch.save(record, Path(out) / f"job{k}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def train_plans(jobs: Sequence[tuple[Path, str]], *, steps: int) -> list[list[dict[str, Any]]]:
    """Train each (plan directory, model file) for ``steps`` steps on spawned gloo ranks; records per job, per rank.

    Every plan must need the same number of ranks.
    """
    worlds = {Plan.load(d).gpus for d, _ in jobs}
    assert len(worlds) == 1, f"plans for different rank counts in one spawn: {worlds}"
    world = worlds.pop()
    with tempfile.TemporaryDirectory(prefix="schedules-") as out:
        start_ranks(_worker, (world, free_port(), [(str(d), s) for d, s in jobs], steps, out), world)
        return [[torch.load(Path(out) / f"job{k}_rank{r}.pt", weights_only=True) for r in range(world)]
                for k in range(len(jobs))]


@dataclasses.dataclass(frozen=True)
class Differences:
    """Largest absolute differences over every step, rank and parameter, with where the worst gradient is."""

    loss: float
    grad: float
    param: float
    worst: str
    compared: int  # gradients compared

    def largest(self) -> float:
        return max(self.loss, self.grad, self.param)


def compare_with_reference(plan: Plan, spec: str, ranks: list[dict[str, Any]]) -> Differences:
    """Replay the recorded steps with the whole model (micro-batched like the plan) and compare."""
    model_file = load_model_file(spec)
    assert model_file.example_target is not None and model_file.loss_fn is not None, spec
    torch.manual_seed(0)
    model = model_file.build()
    params = dict(model.named_parameters(remove_duplicate=False))
    inputs = call_spec(plan).flatten(model_file.example_inputs(plan.batch_size))
    target = model_file.example_target(plan.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_d = grad_d = param_d = 0.0
    worst, compared = "-", 0
    steps = len(ranks[0]["grads"])
    for step in range(steps):
        with torch.no_grad():
            for r in ranks:  # every rank's copies must agree with this start; replica 0's is loaded
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
        want_loss = float(torch.stack(losses).sum())
        got_losses = [r["losses"][step] for r in ranks if r["losses"][step] is not None]
        assert got_losses, "no rank returned the loss"
        loss_d = max(loss_d, *(abs(g - want_loss) for g in got_losses))
        for i, r in enumerate(ranks):
            for name, g in r["grads"][step].items():
                d = float((g - params[name].grad).abs().max())
                compared += 1
                if d > grad_d:
                    grad_d, worst = d, f"{name} on rank {i}, step {step + 1}"
        opt.step()
        for r in ranks:
            for name, value in r["params"][step + 1].items():
                param_d = max(param_d, float((value - params[name].detach()).abs().max()))
    return Differences(loss_d, grad_d, param_d, worst, compared)
