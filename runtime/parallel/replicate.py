"""Replication: gradient averaging over each pipeline rank's replicas, and tied parameters across stages.

Rank layout (rank-major, as Megatron orders pipeline ranks): pipeline rank p,
replica r is global rank ``p * dp + r``; ``plan.rank_layout()`` prints it.
Every stage a pipeline rank holds has the same replicas, so one process group
per pipeline rank serves all of them.

* With ``dp > 1`` and one stage per rank without a split backward (``gpipe``,
  ``1f1b``) each stage's module is wrapped in ``DistributedDataParallel`` on
  its group (:func:`wrap_replicas`): DDP broadcasts the initial state from the
  group's first rank and all-reduces (averages) gradients in buckets of
  ``plan.bucket_cap_mb`` as the last backward produces them.
* Otherwise (several stages per rank, or W actions, whose
  ``torch.autograd.grad`` calls never fire DDP's hooks) :func:`broadcast_replicas`
  does the initial broadcast, and a :class:`ReplicaReducer` averages each
  stage's gradients once they are complete in the step, in buckets of the same
  size, asynchronously, in the same order on every replica.
* A pipeline rank whose stages are planned ``shard="full"`` uses neither: FSDP2
  reduce-scatters its gradients (:mod:`runtime.parallel.shard`); under ``"optimizer"``
  gradients are averaged as above and the optimizer state is split.
* A parameter tied across stages (GPT-2's token embedding is also its LM head;
  or tied by use: one name read by several stages, an LM head
  ``F.linear(h, self.emb.weight)``, a layer applied at every depth: ``plan.tied``
  lists both kinds) is one Parameter object within a rank (:func:`share_tied_parameters`; its
  gradients add up there by themselves), and one copy per pipeline rank
  holding it; the copies start equal (broadcast from the rank of the first
  stage holding it) and their gradients are summed over those ranks, replica
  by replica, before the optimizer step, so they stay equal.  In fully sharded
  stages (:mod:`runtime.parallel.shard`) each replica does so with its own shard.

All ranks create every group in the same order, as torch.distributed requires.

Example (which way a plan's replicas are averaged)::

    >>> from partitioner.plan import example_plan
    >>> needs_explicit_reduce(example_plan())
    False
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from partitioner.plan import Plan
from runtime.execute.comm import Groups, PeerFailure, Work, wait_all

__all__ = [
    "ReplicaReducer",
    "broadcast_replicas",
    "needs_explicit_reduce",
    "replica_reducer",
    "share_tied_parameters",
    "sum_tied_grads",
    "sync_tied_weights",
    "wrap_replicas",
]

Modules = torch.nn.Module | Sequence[torch.nn.Module]


def needs_explicit_reduce(plan: Plan) -> bool:
    """Whether replicas average gradients with :class:`ReplicaReducer` rather than DDP.

    DDP's reducer fires on gradient accumulation hooks during ``backward()``: it
    cannot see W actions (``torch.autograd.grad``), and one DDP per stage of a rank
    would interleave their reductions; and DDP takes no DTensor parameters
    (tensor-parallel stages average their local shards).
    """
    return plan.tp > 1 or plan.chunks > 1 or plan.schedule_data().splits_backward


def wrap_replicas(
    module: torch.nn.Module, groups: Groups, *, bucket_cap_mb: float, device: torch.device,
    skip: AbstractSet[int] = frozenset(),
) -> torch.nn.Module:
    """DDP over the stage group (identity when there is no group or nothing to train).

    ``skip``: ids of parameters DDP leaves alone (neither broadcast nor averaged: expert parallelism's).
    """
    if groups.stage is None or not any(p.requires_grad and id(p) not in skip for p in module.parameters()):
        return module
    if skip:
        ignored = [n for n, p in module.named_parameters() if id(p) in skip]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
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


def broadcast_replicas(modules: Modules, groups: Groups, *, skip: AbstractSet[int] = frozenset()) -> None:
    """Every replica starts from the first replica's parameters and buffers (what DDP does at construction),
    except the parameters in ``skip`` (ids: expert parallelism's, equal per expert-data-parallel group)."""
    if groups.stage is None:
        return
    with torch.no_grad():
        for tensor in _unique((*(p for m in _listed(modules) for p in m.parameters() if id(p) not in skip),
                               *(b for m in _listed(modules) for b in m.buffers()))):
            dist.broadcast(_local(tensor.data), src=groups.replicas[0], group=groups.stage)


class ReplicaReducer:
    """Averages the gradients of this rank's stages over their replicas with explicit all-reduces.

    ``owned``: stage -> the parameters whose gradients are complete once that
    stage's are (each parameter under one stage).  :meth:`start` launches a
    stage's buckets (non-blocking) as soon as the runner reports the stage done;
    :meth:`finish` waits for them and writes the averages back into ``.grad``.
    """

    def __init__(
        self, owned: Mapping[int, Sequence[torch.nn.Parameter]], group: dist.ProcessGroup, *,
        dp: int, bucket_cap_mb: float, timeout: float,
    ) -> None:
        self._owned = {s: list(ps) for s, ps in owned.items()}
        self._group = group
        self._dp = dp
        self._cap = max(1, int(bucket_cap_mb * 2**20))
        self._timeout = timeout
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor, Work | None]] = []

    def start(self, stage: int) -> None:
        grads = [_local_grad(p) for p in self._owned.get(stage, ()) if p.grad is not None]
        for bucket in _buckets(grads, self._cap):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            work = dist.all_reduce(flat, group=self._group, async_op=True)
            self._pending.append((bucket, flat, work))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        try:
            wait_all([w for _, _, w in pending if w is not None], timeout=self._timeout)
        except PeerFailure as exc:
            raise PeerFailure(
                f"rank {dist.get_rank()}: the gradient all-reduce over this rank's replicas did not complete "
                f"(a replica died, raised or hung): {exc}"
            ) from exc
        for bucket, flat, _ in pending:
            flat.div_(self._dp)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def replica_reducer(
    modules: Mapping[int, torch.nn.Module], finish_order: Sequence[int], groups: Groups, *,
    bucket_cap_mb: float, timeout: float, skip: AbstractSet[int] = frozenset(),
) -> ReplicaReducer | None:
    """A reducer for this rank's stages (None without replicas).

    ``finish_order``: the stages in the order their gradients are complete in a
    step (:func:`runtime.execute.runner.gradient_order`); a parameter two stages share
    goes with the later one.  ``skip``: ids of parameters averaged elsewhere (expert parallelism's).
    """
    if groups.stage is None:
        return None
    owned: dict[int, list[torch.nn.Parameter]] = {}
    claimed: set[int] = set()
    for stage in reversed(finish_order):
        for p in modules[stage].parameters():
            if p.requires_grad and id(p) not in claimed and id(p) not in skip:
                claimed.add(id(p))
                owned.setdefault(stage, []).append(p)
    return ReplicaReducer(owned, groups.stage, dp=len(groups.replicas), bucket_cap_mb=bucket_cap_mb,
                          timeout=timeout)


def share_tied_parameters(plan: Plan, modules: Sequence[torch.nn.Module]) -> None:
    """A tied parameter held by several stages of this rank becomes one Parameter object in all of them."""
    for t in plan.tied:
        first: torch.nn.Parameter | None = None
        for module in modules:
            for name in t.aliases:
                owner, _, leaf = name.rpartition(".")
                try:
                    holder = module.get_submodule(owner) if owner else module
                except AttributeError:
                    continue
                param = holder._parameters.get(leaf)
                if param is None:
                    continue
                if first is None:
                    first = param
                elif param is not first:
                    holder._parameters[leaf] = first


def sync_tied_weights(modules: Modules, groups: Groups) -> None:
    """Every copy of a tied parameter starts as the first holder's.

    Pass all of this rank's stage modules at once: a tied parameter none of
    ``modules`` holds is skipped (one call per module broadcasts each once, as long
    as one module holds it).
    """
    with torch.no_grad():
        for t in groups.tied:
            param = _find_parameter(modules, t.local_name)
            if param is not None:
                dist.broadcast(_local(param.data), src=t.source, group=t.group)


def sum_tied_grads(modules: Modules, groups: Groups) -> None:
    """Sum each tied parameter's gradient over the ranks holding a copy (replica by replica)."""
    for t in groups.tied:
        param = _find_parameter(modules, t.local_name)
        if param is None:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(_local_grad(param), op=dist.ReduceOp.SUM, group=t.group)


# ------------------------------------------------------------------ helpers


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A fully sharded copy's own shard (runtime.parallel.shard), else the tensor.

    Every copy of a sharded tied parameter is split the same way over replicas of one
    size, so replica r's shards of all copies are the same slice: summed or broadcast
    over the copies of replica r, shard for shard.
    """
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient laid out as ``param`` is (a DTensor gradient may come back a pending sum or
    whole: made a shard like its parameter first, so every copy reduces the same slice), local part."""
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
    return _local(cast(torch.Tensor, grad))  # callers skip parameters without a gradient


def _listed(modules: Modules) -> list[torch.nn.Module]:
    return [modules] if isinstance(modules, torch.nn.Module) else list(modules)


def _find_parameter(modules: Modules, name: str) -> torch.nn.Parameter | None:
    for module in _listed(modules):
        try:
            return module.get_parameter(name)
        except AttributeError:
            continue
    return None


def _unique(tensors: Iterator[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def _buckets(grads: Sequence[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, up to ``cap`` bytes each (one may exceed it alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > cap or (g.dtype, g.device) != (last[0].dtype, last[0].device):
            buckets.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return buckets
