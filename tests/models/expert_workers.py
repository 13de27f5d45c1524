"""Spawned ranks of an expert-parallel plan: what each one holds, and its whole state dict (issue 32).

:func:`holdings_worker` builds a :class:`runtime.Pipeline` on an ``ep > 1`` plan and writes
``rank{R}.pt``: its parameters' names and shapes (this member's slice), ``pipe.state_dict()``
(whole experts, gathered over the EP group), the whole gradient norm and the one
``clip_grad_norm_`` returns, the state after one training step and after ``load_state_dict`` of
the model's own state, the loss of ``eval_step``, and its checkpoint's step.  :func:`checkpoint_worker` trains with Adam,
saves and resumes checkpoints under one ``ep`` or another (``checkpoint{tag}.pt``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_workers import set_rank_env

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan

__all__ = ["ADAM_EPS", "LR", "STEPS_BEFORE", "checkpoint_worker", "clip_worker", "holdings_worker"]

LR = 0.01
STEPS_BEFORE = 2  # Adam steps before the first checkpoint
# Adam's eps: tiny Qwen3-MoE's experts have gradients of ~1e-8 where Adam's g / sqrt(v) (eps 1e-8) would turn
# last-bit differences of the summation order (micro-batches, replicas) into 1e-5 of the parameters.
ADAM_EPS = 1e-6


def holdings_worker(rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str) -> None:
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    model = model_file.build()
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = Plan.load(plan_dir)
    pipe = Pipeline(plan, model, model_file.loss_fn, device=torch.device("cpu"), timeout=60)
    record: dict[str, object] = {"replica": pipe.dp_rank}
    record["shapes"] = {n: tuple(p.shape) for n, p in pipe.named_parameters()}
    record["state"] = pipe.state_dict()
    inputs, target = model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(inputs, target)
    # The whole model's gradient norm (one stage: every gradient, experts gathered whole) against clipping's.
    grads = pipe.whole_experts({n: p.grad for n, p in pipe.named_parameters() if p.grad is not None})
    record["grad_norm"] = torch.nn.utils.get_total_norm(list(grads.values()))
    record["clip_norm"] = pipe.clip_grad_norm_(1e9)
    opt.step()
    record["trained"] = pipe.state_dict()
    pipe.load_state_dict(original)
    record["reloaded"] = pipe.state_dict()
    record["eval_loss"] = pipe.eval_step(inputs, target)
    record["checkpoint"] = pipe.save_checkpoint(Path(out_dir) / "checkpoint").name
    torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _whole_optimizer_state(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state by original name, expert slices gathered whole (collective over the EP group); under
    ZeRO-1 the dense parameters' state is this replica's share."""
    from runtime.parallel.shard import plain_tensor

    by_key: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in pipe.named_parameters():
        for key, value in opt.state.get(param, {}).items():
            by_key.setdefault(key, {})[name] = plain_tensor(value.detach()).clone()  # tp: DTensors whole
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(by_key):
        for name, value in pipe.whole_experts(by_key[key]).items():
            out.setdefault(name, {})[key] = value
    return out


def checkpoint_worker(rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str, tag: str,
                      load: str | None, save_before: str | None, save_after: str | None) -> None:
    """Load ``load`` (or train ``STEPS_BEFORE`` Adam steps and save ``save_before``); record the whole state
    and Adam's; one more step (its loss, the state after it); then save ``save_after``."""
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    model = model_file.build()
    plan = Plan.load(plan_dir)
    pipe = Pipeline(plan, model, model_file.loss_fn, device=torch.device("cpu"), timeout=60)
    inputs, target = model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size)
    opt = pipe.optimizer(torch.optim.Adam, lr=LR, eps=ADAM_EPS)  # shard "optimizer": ZeRO-1 for the dense parameters

    def train() -> float | None:
        opt.zero_grad()
        loss = pipe.step(inputs, target)
        opt.step()
        return None if loss is None else loss.item()

    record: dict[str, Any] = {"ep": plan.ep}
    if load is not None:
        train()  # state that loading must replace
        record["step"] = pipe.load_checkpoint(load, optimizer=opt)
    else:
        for _ in range(STEPS_BEFORE):
            train()
        record["step"] = STEPS_BEFORE
        if save_before is not None:
            pipe.save_checkpoint(save_before, optimizer=opt, step=STEPS_BEFORE)
    record["parameters"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}  # the step changes them
    record["optimizer"] = _whole_optimizer_state(pipe, opt)
    record["next_loss"] = train()
    record["after_next"] = pipe.state_dict()
    if save_after is not None:
        pipe.save_checkpoint(save_after, optimizer=opt, step=record["step"] + 1)
    torch.save(record, Path(out_dir) / f"checkpoint{tag}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def clip_worker(rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str) -> None:
    """One step, then ``clip_grad_norm_``'s whole-model norm and the state dict (``clip{R}.pt``)."""
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    plan = Plan.load(plan_dir)
    pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60)
    pipe.step(model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size))
    record = {"clip_norm": pipe.clip_grad_norm_(1e9), "state": pipe.state_dict()}
    torch.save(record, Path(out_dir) / f"clip{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
