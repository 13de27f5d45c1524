"""Spawned ranks of an expert-parallel plan: what each one holds, and its whole state dict (issue 32).

:func:`holdings_worker` builds a :class:`runtime.Pipeline` on an ``ep > 1`` plan and writes
``rank{R}.pt``: its parameters' names and shapes (this member's slice), ``pipe.state_dict()``
(whole experts, gathered over the EP group), the whole gradient norm and the one
``clip_grad_norm_`` returns, the state after one training step and after ``load_state_dict`` of
the model's own state, the loss of ``eval_step``, and why ``save_checkpoint`` refuses.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from rank_workers import set_rank_env

from partitioner.errors import AutopartitionError
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan

__all__ = ["holdings_worker"]


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
    try:
        pipe.save_checkpoint(Path(out_dir) / f"checkpoint{rank}")
    except AutopartitionError as exc:
        record["checkpoint"] = str(exc)
    torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
