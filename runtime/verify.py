"""Verify a plan: run it on CPU ranks and compare with the unpartitioned model.

``verify(plan_dir, model_spec)`` spawns ``plan.gpus`` CPU processes (gloo),
trains ``steps`` optimizer steps (SGD with momentum) through
:class:`~runtime.Pipeline`, and compares every step's loss, every gradient and
the final parameters with the same training on one process with the whole
model.  Differences are absolute, after scaling by the reference's largest
magnitude when that exceeds 1.

Example::

    result = verify("plan/", "examples/gpt.py", steps=3)
    print(result.summary())
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partitioner.errors import AutopartitionError
from partitioner.plan import Plan
from runtime.stage import recapture

__all__ = ["VerifyResult", "free_port", "verify", "verify_plan"]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    steps: int
    max_loss_diff: float
    max_grad_diff: float
    worst_grad: str
    max_param_diff: float
    worst_param: str
    tolerance: float
    losses: tuple[float, ...]  # the reference's

    @property
    def ok(self) -> bool:
        return max(self.max_loss_diff, self.max_grad_diff, self.max_param_diff) <= self.tolerance

    def summary(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        return (
            f"{verdict}: {self.steps} steps, losses {', '.join(f'{x:.6f}' for x in self.losses)}; "
            f"largest difference: loss {self.max_loss_diff:.2e}, gradient {self.max_grad_diff:.2e} "
            f"({self.worst_grad}), parameter {self.max_param_diff:.2e} ({self.worst_param}); "
            f"tolerance {self.tolerance:.0e}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def verify(
    plan_dir: str | Path,
    model_spec: str,
    *,
    steps: int = 3,
    lr: float = 0.01,
    timeout: float = 120.0,
    tolerance: float = 1e-5,
) -> VerifyResult:
    """Train ``steps`` steps with the plan on CPU ranks and with the whole model; compare."""
    from partitioner.modelfile import load_model_file

    plan = Plan.load(plan_dir)
    model_file = load_model_file(model_spec)
    if model_file.loss_fn is None or model_file.example_target is None:
        raise AutopartitionError(
            f"{model_spec} needs loss_fn(outputs, target) and example_target(batch_size) for verification."
        )
    torch.manual_seed(0)
    recapture(plan, model_file.build())  # a plan for another model fails here, before any rank starts
    reference = _reference(model_file, plan, steps=steps, lr=lr)
    with tempfile.TemporaryDirectory(prefix="autopartition-verify-") as out:
        port = free_port()
        try:
            mp.start_processes(
                _rank_main,
                args=(plan.gpus, port, str(plan_dir), model_spec, steps, lr, out, timeout),
                nprocs=plan.gpus,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            raise AutopartitionError(f"A rank failed while verifying the plan:\n{_last_lines(str(exc))}") from exc
        except mp.ProcessExitedException as exc:
            raise AutopartitionError(f"A rank exited while verifying the plan: {exc}") from exc
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(plan.gpus)]
    aliases = {name: set(t.aliases) for t in plan.tied for name in t.aliases}
    return _compare(reference, ranks, steps=steps, tolerance=tolerance, aliases=aliases)


def verify_plan(plan_dir: str, model_spec: str, *, steps: int = 3, timeout: float = 120.0) -> int:
    """The ``autopartition verify`` command: print the comparison; exit code 0 when within tolerance."""
    result = verify(plan_dir, model_spec, steps=steps, timeout=timeout)
    print(result.summary())
    return 0 if result.ok else 1


# ----------------------------------------------------------------- helpers


def _reference(model_file: Any, plan: Plan, *, steps: int, lr: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = model_file.build()
    inputs = model_file.example_inputs(plan.batch_size)
    target = model_file.example_target(plan.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model_file.loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
                      if p.grad is not None})
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "grads": grads, "params": params}


def _rank_main(
    rank: int, world: int, port: int, plan_dir: str, model_spec: str, steps: int, lr: float, out: str, timeout: float
) -> None:
    from partitioner.modelfile import load_model_file
    from runtime.pipeline import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    plan = Plan.load(plan_dir)
    model_file = load_model_file(model_spec)
    torch.manual_seed(0)
    model = model_file.build()
    pipe = Pipeline(plan, model, model_file.loss_fn, device=torch.device("cpu"), timeout=timeout)
    inputs = model_file.example_inputs(plan.batch_size)
    assert model_file.example_target is not None  # checked by verify() before spawning
    target = model_file.example_target(plan.batch_size)
    opt = torch.optim.SGD(pipe.parameters(), lr=lr, momentum=0.9)
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    for _ in range(steps):
        opt.zero_grad()
        loss = pipe.step(inputs, target)
        if loss is not None:
            losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None})
        opt.step()
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    torch.save({"losses": losses, "grads": grads, "params": params}, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    return float((got - want).abs().max()) / scale if want.numel() else 0.0


def _compare(
    reference: dict[str, Any],
    ranks: list[dict[str, Any]],
    *,
    steps: int,
    tolerance: float,
    aliases: dict[str, set[str]] | None = None,
) -> VerifyResult:
    loss_diff = 0.0
    grad_diff, worst_grad = 0.0, "-"
    param_diff, worst_param = 0.0, "-"
    seen_loss = False
    for rank, result in enumerate(ranks):
        if result["losses"]:
            seen_loss = True
            for got, want in zip(result["losses"], reference["losses"]):
                loss_diff = max(loss_diff, abs(got - want) / max(1.0, abs(want)))
        for step in range(steps):
            for name, grad in result["grads"][step].items():
                want = reference["grads"][step].get(name)
                d = float("inf") if want is None else _diff(grad, want)
                if d > grad_diff:
                    grad_diff, worst_grad = d, f"{name} on rank {rank}, step {step + 1}"
        for name, value in result["params"].items():
            d = _diff(value, reference["params"][name])
            if d > param_diff:
                param_diff, worst_param = d, f"{name} on rank {rank}"
    if not seen_loss:
        loss_diff = float("inf")
    held = {name for result in ranks for name in result["params"]}
    orphans = sorted(n for n in reference["params"] if not ({n} | (aliases or {}).get(n, set())) & held)
    if orphans:  # a parameter no stage holds would never train
        param_diff, worst_param = float("inf"), f"{orphans[0]} is held by no rank"
    return VerifyResult(steps, loss_diff, grad_diff, worst_grad, param_diff, worst_param, tolerance,
                        tuple(reference["losses"]))


def _last_lines(text: str, n: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-n:])
