"""Gradient clipping over the whole pipelined model, as ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.

After :meth:`runtime.Pipeline.step` every replica of a stage holds the same
(averaged) gradients and every copy of a tied parameter the same (summed)
gradient, so the whole model's norm counts each stage once (replica 0's ranks
contribute, the others add nothing) and each tied parameter once (on the
lowest stage holding it: ``plan.tied``, aliases and parameters read by several
stages under one name alike).  Per-tensor norms are combined across ranks with one
all-reduce (a sum of ``norm ** p``, or a max for ``inf``); every rank then
scales all of its gradients, every copy and replica alike, by the same factor,
so replicas and tied copies stay equal.  A fully sharded stage's gradients are
``DTensor`` shards, each replica holding a different part: every replica counts
(and scales) its own shard, so the sum over ranks is still the whole stage once.
Tensor-parallel stages (:mod:`runtime.parallel.tensorparallel`) likewise: a split
parameter's shards count on every rank of the group, a replicated one (a norm)
on the group's first rank only.  Expert-parallel slices count on the first EP group's
``ep`` replicas, each holding other experts (under tensor parallelism on their groups' first
ranks: every tensor-parallel rank holds the same whole experts; FSDP2 never shards them).

Example (one process; a pipeline passes its stages and a process group)::

    >>> import torch
    >>> from partitioner.plan import example_plan
    >>> m = torch.nn.Linear(2, 2)
    >>> m(torch.ones(1, 2)).sum().backward()
    >>> counted, scaled = local_gradients(example_plan(), [(0, m)], replica=0)
    >>> total = total_norm(counted, 2.0, device=torch.device("cpu"), group=None)
    >>> float(total) == float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import AutopartitionError
from partitioner.plan import Plan

__all__ = ["clip_gradients", "local_gradients", "scale_gradients", "total_norm"]


def local_gradients(
    plan: Plan, stages: Sequence[tuple[int, nn.Module]], *, replica: int, sharded: bool = False,
    experts: AbstractSet[int] = frozenset(), tp_rank: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(gradients this rank counts in the whole model's norm, every gradient it holds).

    ``stages``: (stage index, stage module) for each stage this rank holds.
    Counted: replica 0 only (``sharded``: every replica, its own shard); a tied
    parameter on the lowest stage holding it only; a parameter shared by two
    local stage modules once.  Sharded gradients come as their local tensors.
    ``experts``: ids of expert-parallel parameters, whose slices count on the first EP group's
    ``ep`` replicas (each holds different experts; :mod:`runtime.parallel.experts`), on tensor-parallel
    rank ``tp_rank`` 0 only (plain tensors, the same on each).
    """
    owner = {alias: min(t.stages) for t in plan.tied for alias in t.aliases}
    counted: list[torch.Tensor] = []
    held: list[torch.Tensor] = []
    seen: set[int] = set()
    for index, module in stages:
        for name, param in module.named_parameters():
            if param.grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            grad = _local(param.grad)
            held.append(grad)
            # Expert slices are whole (never FSDP2 shards): the first EP group's, on tensor-parallel rank 0.
            counts = replica < plan.ep and tp_rank == 0 if id(param) in experts else sharded or replica == 0
            if counts and owner.get(name, index) == index and _first_copy(param.grad):
                counted.append(grad)
    return counted, held


def total_norm(
    grads: Sequence[torch.Tensor], norm_type: float, *, device: torch.device, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The ``norm_type``-norm of all ranks' ``grads`` together (float32, the same on every rank).

    With ``group`` None and no process group initialised it is this process's norm.
    Every rank of ``group`` (default: all) must call it.
    """
    p = _check_norm_type(norm_type)
    with torch.no_grad():
        norms = [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32).to(device) for g in grads]
        if math.isinf(p):
            local = torch.stack(norms).max() if norms else torch.zeros((), device=device)
            op = dist.ReduceOp.MAX
        else:
            # float64 for the sum of powers: the per-tensor terms are rounded once, as torch's stack-then-norm does.
            local = torch.stack(norms).double().pow(p).sum() if norms else torch.zeros((), device=device).double()
            op = dist.ReduceOp.SUM
        local = local.reshape(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(local, op=op, group=group)
        total = local[0] if math.isinf(p) else local[0].pow(1.0 / p)
    return total.float()


def scale_gradients(grads: Sequence[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total + 1e-6))``, torch's clipping factor."""
    with torch.no_grad():
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))


def clip_gradients(
    plan: Plan,
    stages: Sequence[tuple[int, nn.Module]],
    *,
    replica: int,
    sharded: bool = False,
    max_norm: float,
    norm_type: float = 2.0,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    error_if_nonfinite: bool = False,
    experts: AbstractSet[int] = frozenset(),
    tp_rank: int = 0,
) -> torch.Tensor:
    """Clip every gradient of the pipelined model to a whole-model norm of ``max_norm``; returns that norm."""
    counted, held = local_gradients(plan, stages, replica=replica, sharded=sharded, experts=experts, tp_rank=tp_rank)
    total = total_norm(counted, norm_type, device=device, group=group)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise AutopartitionError(
            f"The total norm of order {norm_type} of the gradients is {float(total)}, so they cannot be "
            "clipped. Look for an overflow or a NaN in the loss, or pass error_if_nonfinite=False."
        )
    scale_gradients(held, total, max_norm)
    return total


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` gradient's local shard (a view: scaling it scales the gradient); any other as it is."""
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad


def _first_copy(grad: torch.Tensor) -> bool:
    """Whether this rank's part of ``grad`` counts: a ``DTensor`` replicated over a mesh dimension (a
    tensor-parallel group's norm weights, HSDP's nodes) counts on that dimension's first rank only."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return True
    coordinate: Sequence[int] = grad.device_mesh.get_coordinate() or ()
    return all(c == 0 for c, p in zip(coordinate, grad.placements) if p.is_replicate())


def _check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise AutopartitionError(
            f"norm_type must be a positive number or inf (2.0 for the Euclidean norm), got {norm_type!r}."
        )
    return p
