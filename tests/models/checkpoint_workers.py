"""Rank entry points of the weights and checkpoint tests (tests/test_weights.py, tests/test_checkpoint.py).

Spawned ranks pickle their entry point by module and name, so these live in an
importable module (``tests/models`` is on ``sys.path``).  Each worker writes what
it saw to ``rank{R}.pt`` in ``out_dir``; the tests compare that with a
single-process reference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_workers import error_of, set_rank_env

LR = 0.01
STEPS_BEFORE = 2  # Adam steps before the checkpoint


def adam_records(spec: str, *, batch: int, lr: float = LR, eps: float = 1e-8, before: int = STEPS_BEFORE,
                 records: int = 1, seed: int | None = None) -> list[dict[str, Any]]:
    """The uninterrupted run a resumed one is compared with: Adam on the whole model of ``spec``, and after
    ``before``, ``before + 1``, ... steps (``records`` of them) its parameters and Adam state, the loss of the
    step that follows and the parameters after that step."""
    from partitioner.modelfile import load_model_file

    model_file = load_model_file(spec)
    if seed is not None:
        torch.manual_seed(seed)
    model = model_file.build()
    assert model_file.loss_fn is not None and model_file.example_target is not None, spec
    loss_fn = model_file.loss_fn
    inputs, target = model_file.example_inputs(batch), model_file.example_target(batch)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)

    def step() -> float:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        return float(loss.item())

    def record() -> dict[str, Any]:
        return {"parameters": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}}

    for _ in range(before):
        step()
    out = []
    for _ in range(records):
        now = record()
        now["next_loss"] = step()
        now["after_next"] = record()["parameters"]
        out.append(now)
    return out




def _pipeline(plan_dir: str, spec: str, *, meta: bool = False, **options: Any) -> Any:
    from partitioner.modelfile import load_model_file
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    model_file = load_model_file(spec)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = model_file.build()
    return Pipeline(Plan.load(plan_dir), model, model_file.loss_fn, device=torch.device("cpu"), timeout=60,
                    **options)


def weights_worker(
    rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str,
    sources: dict[str, str], broken: str,
) -> None:
    """One Pipeline per weights source; records each one's state dict, and the error of ``broken``.

    Source ``env`` is passed through ``AUTOPARTITION_WEIGHTS`` instead of ``weights=``; source
    ``meta`` goes into a model built on the meta device.
    """
    from runtime.state.weights import WEIGHTS_ENV

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for label, path in sources.items():
        if label == "env":
            os.environ[WEIGHTS_ENV] = path
            pipe = _pipeline(plan_dir, spec)
            del os.environ[WEIGHTS_ENV]
        elif label == "meta":
            pipe = _pipeline(plan_dir, spec, meta=True, weights=path)
        else:
            pipe = _pipeline(plan_dir, spec, weights=path)
        result[label] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    result["broken"] = error_of(lambda: _pipeline(plan_dir, spec, weights=broken))
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _optimizer_state(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state by original parameter name (a tied weight under each name this rank holds it by)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in pipe.named_parameters():
        state = opt.state.get(param, {})
        if state:
            out[name] = {k: v.detach().clone() for k, v in state.items()}
    return out


def _training(rank: int, world: int, port: int, plan_dir: str, spec: str) -> tuple[Any, Any, Any, Any]:
    """This rank's process group, Pipeline, the model file's mini-batch and an Adam optimizer."""
    from partitioner.modelfile import load_model_file

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    model_file = load_model_file(spec)
    pipe = _pipeline(plan_dir, spec)
    inputs = model_file.example_inputs(pipe.plan.batch_size)
    target = model_file.example_target(pipe.plan.batch_size)  # type: ignore[misc]
    return pipe, inputs, target, torch.optim.Adam(pipe.parameters(), lr=LR)


def save_worker(
    rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str, checkpoints: dict[str, str],
    foreign_plan: str, foreign_spec: str,
) -> None:
    """Train ``STEPS_BEFORE`` Adam steps; save with the optimizer, and without; save another model too."""
    pipe, inputs, target, opt = _training(rank, world, port, plan_dir, spec)
    losses = []
    for _ in range(STEPS_BEFORE):
        opt.zero_grad()
        loss = pipe.step(inputs, target)
        losses.append(None if loss is None else loss.item())
        opt.step()
    pipe.save_checkpoint(checkpoints["full"], optimizer=opt, step=STEPS_BEFORE)
    pipe.save_checkpoint(checkpoints["model_only"], step=STEPS_BEFORE)
    foreign = _pipeline(foreign_plan, foreign_spec)
    foreign.save_checkpoint(checkpoints["foreign"], step=7)
    torch.save({"losses": losses}, Path(out_dir) / f"save_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def resume_worker(
    rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str, checkpoints: dict[str, str],
    not_a_checkpoint: str,
) -> None:
    """Under another plan: the error cases first, then resume, record, take one more step and save."""
    pipe, inputs, target, opt = _training(rank, world, port, plan_dir, spec)
    # State that loading must replace: moved weights and one step of optimizer state.
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(0.5)
    pipe.step(inputs, target)
    opt.step()
    opt.zero_grad()
    result: dict[str, Any] = {"errors": {
        "not_a_checkpoint": error_of(lambda: pipe.load_checkpoint(not_a_checkpoint, optimizer=opt)),
        "absent": error_of(lambda: pipe.load_checkpoint(checkpoints["absent"], optimizer=opt)),
        "no_optimizer_state": error_of(lambda: pipe.load_checkpoint(checkpoints["model_only"], optimizer=opt)),
        "foreign": error_of(lambda: pipe.load_checkpoint(checkpoints["foreign"], optimizer=opt)),
    }}
    result["step"] = pipe.load_checkpoint(checkpoints["full"], optimizer=opt)
    result["parameters"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    result["optimizer"] = _optimizer_state(pipe, opt)
    result["lr"] = [g["lr"] for g in opt.param_groups]
    loss = pipe.step(inputs, target)
    opt.step()
    result["next_loss"] = None if loss is None else loss.item()
    result["after_next"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    pipe.save_checkpoint(checkpoints["resaved"], optimizer=opt, step=result["step"] + 1)
    model_only = pipe.load_checkpoint(checkpoints["model_only"])  # no optimizer: the model alone loads
    result["model_only_step"] = model_only
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def continue_worker(
    rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str, checkpoint: str,
) -> None:
    """Resume from ``checkpoint`` (a rank may hold several stages here); record, then take one more step."""
    pipe, inputs, target, opt = _training(rank, world, port, plan_dir, spec)
    result: dict[str, Any] = {"stages": pipe.stages, "step": pipe.load_checkpoint(checkpoint, optimizer=opt)}
    result["parameters"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    result["optimizer"] = _optimizer_state(pipe, opt)
    loss = pipe.step(inputs, target)
    opt.step()
    result["next_loss"] = None if loss is None else loss.item()
    result["after_next"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    torch.save(result, Path(out_dir) / f"continue_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
