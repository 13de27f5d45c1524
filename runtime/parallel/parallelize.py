"""The stage stack's parallel steps (torchtitan's ``parallelize``): groups, ties, tensor split, sharding, replicas.

Each step takes the rank's :class:`~runtime.execute.stack.StageStack` and returns it;
``Pipeline`` applies them in this order, which is also the order of their collectives
(every rank makes every group and mesh in one order, as torch.distributed requires):

* :func:`apply_groups`: the replica and tied-copy process groups, the tensor-parallel
  mesh and FSDP2's (:mod:`~runtime.execute.comm`, :mod:`~runtime.parallel.tensorparallel`,
  :mod:`~runtime.parallel.shard`);
* :func:`tie_parameters`, then (values on the device) :func:`sync_tied_copies`: a tied
  weight is one Parameter per rank, equal on every rank, its gradients summed
  (:class:`TiedLayer`);
* :func:`apply_tp`: each stage's layers split over the tensor-parallel group;
* :func:`apply_fsdp`: a fully sharded stage becomes one FSDP2 unit (:class:`ShardingLayer`,
  which also warns when a ZeRO-1 plan's optimizer is not built by ``pipe.optimizer``);
* :func:`apply_tp_io`: tensors enter and leave each stage as DTensors, the loss runs
  vocabulary-parallel (:class:`TensorSplitLayer`);
* :func:`apply_replicas`: DDP or the explicit reducer over the replicas (:class:`ReplicaLayer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from partitioner.plan import Plan
from runtime.execute.comm import Groups, make_groups
from runtime.execute.runner import gradient_order
from runtime.execute.stack import StackLayer, StageStack
from runtime.execute.stage import LocalStage
from runtime.parallel.experts import expert_parameters
from runtime.parallel.fp8_gather import FP8Gathers, enable_fp8_all_gather, fp8_gathered_weights
from runtime.parallel.replicate import (
    ReplicaReducer,
    broadcast_replicas,
    needs_explicit_reduce,
    replica_reducer,
    share_tied_parameters,
    sum_tied_grads,
    sync_tied_weights,
    wrap_replicas,
)
from runtime.parallel.shard import (
    ShardedStep,
    build_optimizer,
    fill_shards,
    shard_layout,
    shard_modules,
    shard_of,
    shardable_on_meta,
    stage_meshes,
)
from runtime.parallel.tensorparallel import (
    TensorParallelStage,
    has_vocabulary_head,
    match_gradients,
    parallelize_stages,
    tensor_parallel_loss,
    tensor_parallel_meshes,
    tensor_parallel_step,
)

__all__ = [
    "ReplicaLayer",
    "ShardingLayer",
    "TensorSplitLayer",
    "TiedLayer",
    "apply_fsdp",
    "apply_groups",
    "apply_replicas",
    "apply_tp",
    "apply_tp_io",
    "shard_while_loading",
    "sync_tied_copies",
    "tie_parameters",
]

Keep = Callable[[torch.Tensor, bool], torch.Tensor]


def shard_while_loading(stack: StageStack, *, weights_given: bool) -> Keep | None:
    """How a fully sharded rank keeps only its shard of each value of a meta model, one module at a time
    (None: it materialises whole): read by :func:`runtime.state.values.load_values`, put in by :func:`apply_fsdp`."""
    plan = stack.plan
    # ep > 1: whole first, then apply_experts keeps this member's experts (a slice of a shard is no expert).
    if stack.shard_mode != "full" or weights_given or plan.tp != 1 or plan.ep != 1 or not shardable_on_meta(stack.held):
        return None
    parts = shard_layout(plan, stack.pipeline_rank)[1]  # HSDP: a node's replicas split it
    part = dataclasses.replace(plan.layout, dp_shard=parts).coord(stack.rank, "dp_shard")
    return lambda value, is_param: shard_of(value, dp=parts, replica=part) if is_param else value


def apply_groups(stack: StageStack) -> StageStack:
    """The process groups and meshes (collective: every rank).  FSDP2's mesh is None unless this rank's stages
    are "full"; with tp > 1 both it and the tensor-parallel mesh are slices of one (pp, dp, tp) mesh, as FSDP2
    over DTensor-split layers requires."""
    plan = stack.plan
    groups = make_groups(plan, stack.rank)
    if plan.tp > 1:
        tp_mesh, dp_mesh = tensor_parallel_meshes(plan, stack.device)
        return stack.replace(groups=groups, tp_mesh=tp_mesh,
                             shard_mesh=dp_mesh if stack.shard_mode == "full" else None)
    return stack.replace(groups=groups, shard_mesh=stage_meshes(plan, stack.rank, groups.stage, stack.device))


def tie_parameters(stack: StageStack) -> StageStack:
    """A weight two stages of this rank use becomes one Parameter in both."""
    share_tied_parameters(stack.plan, stack.held)
    return stack


class TiedLayer(StackLayer):
    """A tied weight's copies on several pipeline ranks: their gradients summed after every step."""

    def __init__(self, modules: Sequence[nn.Module], groups: Groups) -> None:
        self._modules = modules
        self._groups = groups

    def after_step(self) -> None:
        sum_tied_grads(self._modules, self._groups)

    def sync(self, modules: Sequence[nn.Module]) -> None:
        """Every copy takes the first holder's values (after loading a state dict)."""
        sync_tied_weights(modules, self._groups)


def sync_tied_copies(stack: StageStack) -> StageStack:
    """The copies of a tied weight start equal on every rank (a meta stage's get theirs from one rule)."""
    if stack.deferred is None:
        sync_tied_weights(stack.held, stack.replica_groups)
    return stack.with_layer(TiedLayer(stack.held, stack.replica_groups))


def apply_tp(stack: StageStack) -> StageStack:
    """tp > 1: each stage's layers split over this rank's tensor-parallel group (DTensor)."""
    if stack.tp_mesh is not None:
        parallelize_stages(stack.held, stack.tp_mesh)
    return stack


class ShardingLayer(StackLayer):
    """This rank's shard mode: FSDP2 units driven across the step ("full"), ZeRO-1's optimizer ("optimizer")."""

    def __init__(self, stack: StageStack, sharded: ShardedStep | None, units: list[nn.Module], *,
                 fp8: FP8Gathers | None = None) -> None:
        self.mode = stack.shard_mode
        self.fp8 = fp8  # weights gathered as FP8 casts: their scales precomputed once per step
        self.sharded = sharded
        self.units = units  # the FSDP2 units ("full"), each resharded after an evaluation
        self._rank = stack.rank
        self._stages = [local.plan.index for local in stack.stages]
        self._plan = stack.plan
        self._group = stack.replica_groups.stage
        self._built_optimizer = False
        self._warned = False

    def before_step(self) -> None:
        if self.sharded is not None:
            self.sharded.begin()
        if self.fp8 is not None:
            self.fp8.precompute()

    def reduce(self) -> None:
        if self.fp8 is not None:
            self.fp8.forget()  # the optimizer moves the weights next
        if self.sharded is not None:
            self.sharded.end()  # one reduce-scatter per stage, averaged over the replicas
        elif self.mode == "optimizer" and not self._built_optimizer and not self._warned:
            self._warned = True
            warnings.warn(
                f"rank {self._rank}: the plan shards the optimizer state of stages {self._stages} over their "
                f"{self._plan.dp} replicas, but no optimizer was built with pipe.optimizer(...): an optimizer over "
                "pipe.parameters() holds the whole state on every replica (training is right, the memory the plan "
                "counted on is not saved). Build it with pipe.optimizer(torch.optim.AdamW, lr=...).",
                RuntimeWarning, stacklevel=4,
            )

    def after_eval(self) -> None:
        for module in self.units:  # gathered by the forward: an optimizer step must not miss them
            module.reshard()  # type: ignore[operator]

    def optimizer(self, params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                  **defaults: Any) -> torch.optim.Optimizer:
        """The optimizer that fits the shard mode (ZeRO-1's over the stage group under "optimizer")."""
        self._built_optimizer = True
        return build_optimizer(params, optimizer_class, mode=self.mode, group=self._group, **defaults)

    def counts_shards_once(self, replica: int, pipeline_rank: int) -> bool:
        """Whether this replica's shards count in a global norm (HSDP's other nodes hold copies of them)."""
        return self.sharded is not None and replica < shard_layout(self._plan, pipeline_rank)[1]


def apply_fsdp(stack: StageStack) -> StageStack:
    """shard "full": each stage's runnable becomes one FSDP2 unit over its stage group (runtime.parallel.shard)."""
    if stack.shard_mesh is None:
        return stack.with_layer(ShardingLayer(stack, None, []))
    if stack.deferred is None:  # every replica keeps its shard of equal values (experts: equal per their group)
        broadcast_replicas(stack.held, stack.replica_groups, skip=expert_parameters(stack))
    policy = [local.plan.reshard_after_forward for local in stack.stages]
    runnables = shard_modules(stack.runnables, policy, stack.shard_mesh, precision=stack.plan.precision)
    if stack.deferred is not None:
        fill_shards(runnables, stack.held, stack.deferred, stack.device)
    # Tensorwise FP8 linears' weights gathered as their FP8 casts (1 byte per element; runtime.parallel.fp8_gather).
    fp8 = enable_fp8_all_gather(runnables, fp8_gathered_weights(stack.held))
    sharded = ShardedStep(runnables, policy, splits_backward=stack.plan.schedule_data().splits_backward)
    return stack.with_layer(ShardingLayer(stack, sharded, list(runnables), fp8=fp8), runnables=tuple(runnables),
                            deferred=None)


class TensorSplitLayer(StackLayer):
    """tp > 1: DTensor's switches around each step, then every gradient laid out as its parameter."""

    def __init__(self, plan: Plan, modules: Sequence[nn.Module], *, vocabulary_parallel: bool) -> None:
        self._plan = plan
        self._modules = modules
        self._vocabulary_parallel = vocabulary_parallel  # this rank holds the LM head: loss_parallel

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        return tensor_parallel_step(self._plan, vocabulary_parallel=self._vocabulary_parallel)

    def after_step(self) -> None:
        match_gradients(self._modules)  # each rank's part of the whole gradient, as its parameter is laid out


def apply_tp_io(stack: StageStack) -> StageStack:
    """tp > 1, outermost: tensors enter and leave each stage as DTensors, around FSDP2's unit."""
    if stack.tp_mesh is None:
        return stack
    mesh = stack.tp_mesh
    runnables = tuple(TensorParallelStage(r, mesh, model_inputs=len(local.signature.model_inputs),
                                          received=_received_shapes(local), sent=len(local.signature.sent))
                      for local, r in stack.zipped(stack.runnables))
    layer = TensorSplitLayer(stack.plan, stack.held, vocabulary_parallel=has_vocabulary_head(stack.held))
    return stack.with_layer(layer, runnables=runnables, loss_fn=tensor_parallel_loss(stack.loss_fn))


class ReplicaLayer(StackLayer):
    """The replicas' gradient average: our reducer's (started as each stage's gradients complete), or DDP's,
    synced in each stage's last backward of the step only (``ddp``: stage -> its DDP wrapper)."""

    def __init__(self, reducer: ReplicaReducer | None, group: dist.ProcessGroup | None, dp: int, *,
                 ddp: Mapping[int, DistributedDataParallel]) -> None:
        self._reducer = reducer
        self._group = group
        self._dp = dp
        self._ddp = dict(ddp)

    def forwarding(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        module = self._ddp.get(stage)
        return contextlib.nullcontext() if module is None else module.no_sync()

    def backwarding(self, stage: int, outputs: Sequence[torch.Tensor], *, last: bool
                    ) -> contextlib.AbstractContextManager[Any]:
        module = self._ddp.get(stage)
        if module is None or not last:
            return contextlib.nullcontext() if module is None else module.no_sync()
        module.reducer.prepare_for_backward(list(_find_tensors(outputs)))
        return contextlib.nullcontext()

    def gradients_done(self, stage: int) -> None:
        if self._reducer is not None:
            self._reducer.start(stage)

    def reduce(self) -> None:
        if self._reducer is not None:
            self._reducer.finish()

    def mean(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        """The replicas' mean of a loss (this rank's replica's, where the last stage is held)."""
        if loss is None or self._group is None:
            return loss
        dist.all_reduce(loss, group=self._group)
        return loss / self._dp


def apply_replicas(stack: StageStack) -> StageStack:
    """What averages the replicas' gradients: FSDP2 ("full", already there), torch's engine (it replicates
    itself), our reducer (W actions or several stages: no DDP hooks), else DDP around each runnable.
    Expert-parallel parameters are left to :class:`~runtime.parallel.experts.ExpertsLayer`."""
    plan, groups = stack.plan, stack.replica_groups
    modules, reducer = stack.runnables, None
    experts = expert_parameters(stack)  # expert parallelism's: reduced over their own groups (ExpertsLayer)
    if stack.engine == "torch" or stack.layer(ShardingLayer).sharded is not None:
        pass
    elif needs_explicit_reduce(plan):
        broadcast_replicas(stack.held, groups, skip=experts)
        reducer = replica_reducer(
            {local.plan.index: local.module for local in stack.stages},
            gradient_order(plan.schedule_data().actions[stack.pipeline_rank]), groups,
            bucket_cap_mb=plan.bucket_cap_mb, timeout=stack.timeout, skip=experts,
        )
    else:
        modules = tuple(wrap_replicas(m, groups, bucket_cap_mb=plan.bucket_cap_mb, device=stack.device,
                                      skip=experts)
                        for m in stack.runnables)
    ddp = {local.plan.index: m for local, m in stack.zipped(modules) if isinstance(m, DistributedDataParallel)}
    return stack.with_layer(ReplicaLayer(reducer, groups.stage, plan.dp, ddp=ddp), modules=modules)


def _received_shapes(local: LocalStage) -> list[tuple[tuple[int, ...], str]]:
    """(whole shape, dtype) of each tensor the stage receives, in its signature's order."""
    planned = {b.producer: b for b in local.plan.inputs}
    return [(planned[name].shape, planned[name].dtype) for name in local.signature.received]
