"""Replication: DDP inside each stage group, and tied parameters shared across stages.

Rank layout (stage-major, as Megatron orders pipeline ranks): stage s, replica
r is global rank ``s * dp + r``; ``plan.rank_layout()`` prints it.

* With ``dp > 1`` each stage's module is wrapped in ``DistributedDataParallel``
  on its own process group (the stage's replicas); DDP broadcasts the initial
  state from the group's first rank, and all-reduces (averages) gradients in
  buckets of ``plan.bucket_cap_mb``.
* A parameter tied across stages (GPT-2's token embedding is also its LM head)
  has one copy per stage that uses it; the copies start equal (broadcast from
  the first stage holding it) and their gradients are summed over those
  stages, replica by replica, before the optimizer step, so they stay equal.

All ranks create every group in the same order, as torch.distributed requires.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from partitioner.plan import Plan

__all__ = ["Groups", "TiedCopy", "make_groups", "sum_tied_grads", "sync_tied_weights", "wrap_replicas"]


@dataclasses.dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a tied parameter and the group of ranks holding the other copies."""

    name: str  # canonical name
    local_name: str  # the alias this stage holds
    group: dist.ProcessGroup
    source: int  # global rank whose copy wins at start


@dataclasses.dataclass(frozen=True)
class Groups:
    stage: dist.ProcessGroup | None  # this stage's replicas, when dp > 1
    tied: tuple[TiedCopy, ...]


def make_groups(plan: Plan, rank: int) -> Groups:
    stage_index, _ = plan.rank_layout()[rank]
    stage_group = None
    if plan.dp > 1:
        for stage in plan.stages:
            group = dist.new_group(list(stage.ranks))
            if stage.index == stage_index:
                stage_group = group
    tied: list[TiedCopy] = []
    for t in plan.tied:
        if len(t.stages) < 2:
            continue
        for r in range(plan.dp):
            ranks = [plan.stages[s].ranks[r] for s in t.stages]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = set(t.aliases) & set(plan.stages[stage_index].parameters)
                tied.append(TiedCopy(t.name, min(mine), group, ranks[0]))
    return Groups(stage=stage_group, tied=tuple(tied))


def wrap_replicas(
    module: torch.nn.Module, groups: Groups, *, bucket_cap_mb: float, device: torch.device
) -> torch.nn.Module:
    """DDP over the stage group (identity when there is no group or nothing to train)."""
    if groups.stage is None or not any(p.requires_grad for p in module.parameters()):
        return module
    # Buffers are synced once at construction; re-broadcasting them every forward wastes time.
    # (torch >= 2.13 renamed the switch; it keeps the sync at construction either way.)
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=groups.stage,
        bucket_cap_mb=bucket_cap_mb,
        **no_buffer_sync,  # type: ignore[arg-type]
    )


def sync_tied_weights(module: torch.nn.Module, groups: Groups) -> None:
    with torch.no_grad():
        for t in groups.tied:
            dist.broadcast(module.get_parameter(t.local_name).data, src=t.source, group=t.group)


def sum_tied_grads(module: torch.nn.Module, groups: Groups) -> None:
    for t in groups.tied:
        param = module.get_parameter(t.local_name)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=t.group)
