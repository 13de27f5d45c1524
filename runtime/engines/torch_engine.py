"""``engine="torch"``: a plan's stages run by torch.distributed.pipelining instead of our StepRunner.

Each stage this rank holds becomes a :class:`runtime.execute.flatstage.FlatStage` (flat
tuples in and out; values skipping stages are carried through the stages in
between, one extra send per stage crossed) inside a ``PipelineStage`` on this
replica's pipeline group, driven by torch's schedule class for the plan's
schedule:

=================  =======================================================
``gpipe``          ``ScheduleGPipe``
``1f1b``           ``Schedule1F1B``
``interleaved-1f1b``  ``ScheduleInterleaved1F1B`` (stage s on rank s mod P, as ours)
``zbv``            ``ScheduleZBVZeroBubble`` (the V placement, as ours)
``zb-h1``          torch has no one-stage-per-rank ZB-H1 class: our plan's own
                   action rows (``1F3``, ``1B3`` as torch's input backward ``I``,
                   ``1W3``) run on torch's action-list runtime,
                   ``_PipelineScheduleRuntime`` (it adds the sends and receives)
=================  =======================================================

What stays ours: building and materialising the stages, precision
(``PrecisionForward``) and per-stage recomputation (``Recomputed``) inside each
stage, tied weights (one Parameter per rank, gradients summed across ranks after
the step), replicas and the returned loss.  Replicas: with one stage per rank
and no split backward each stage is wrapped in DDP, which torch's stage drives
(``no_sync`` until the last backward); otherwise (several stages per rank, or W
actions, whose ``autograd.grad`` calls fire no DDP hook) our
``ReplicaReducer`` averages the gradients after the schedule ends (not
overlapped with the backward).  Stages planned ``shard="full"`` are FSDP2 units
inside the wrapper (:mod:`runtime.parallel.shard`, made before this engine); torch's stage
sees a plain module, and the Pipeline's ``ShardedStep`` turns gradient sync off
before the schedule and runs FSDP2's post-backward (one reduce-scatter) after it,
as torch's own ``perform_reduce_grad`` would.  The loss is scaled by ``1 / M`` in
the loss function (``scale_grads=False``), so :meth:`Pipeline.step` returns the
same value under both engines.

Refused (:func:`torch_engine_refusal`, with what works instead): ``trace=True``
(our traces time our actions; torch's schedules expose none).

Example::

    >>> from partitioner.plan import example_plan
    >>> torch_schedule_name(example_plan())
    'ScheduleGPipe'
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)
from torch.nn.parallel import DistributedDataParallel

from partitioner.graph.ir import node_parameters
from partitioner.plan import Plan
from runtime.execute.comm import Groups
from runtime.execute.flatstage import Feed, FlatStage, IndexedLoss, carried_values
from runtime.execute.stage import LocalStage
from runtime.parallel.replicate import (
    ReplicaReducer,
    broadcast_replicas,
    replica_reducer,
    wrap_replicas,
)

__all__ = ["TorchEngine", "torch_engine_refusal", "torch_schedule_name", "torch_stage_refusal"]

_CLASSES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
_ACTION_LIST = "_PipelineScheduleRuntime (the plan's action rows)"



def torch_schedule_name(plan: Plan) -> str:
    """The torch schedule that runs ``plan`` under ``engine="torch"``."""
    cls = _CLASSES.get(plan.schedule)
    return _ACTION_LIST if cls is None else cls.__name__


def torch_engine_refusal(plan: Plan, *, trace: bool = False) -> str | None:
    """Why ``engine="torch"`` cannot run ``plan`` (None: it can); the message says what works."""
    if trace:
        return ("trace=True times our engine's actions; engine='torch' records none. Use --engine ours for a "
                "trace (or torch.profiler around the step with engine='torch').")
    if plan.schedule not in _CLASSES and plan.schedule != "zb-h1":
        return f"engine='torch' has no schedule for {plan.schedule!r}; run it with --engine ours."
    return None


def torch_stage_refusal(plan: Plan, stages: Sequence[LocalStage]) -> str | None:
    """Why ``engine="torch"`` cannot run these stages of ``plan`` (None: it can).

    torch's split backward (``zb-h1``, ``zbv``: ``stage_backward_weight``) groups a
    stage's weights by the autograd nodes between them and its inputs; a parameter
    read at several ops of one stage (a layer applied at every depth) lands in several
    groups and the second group's ``autograd.grad`` finds the graph freed.
    """
    if not plan.schedule_data().splits_backward:
        return None
    for local in stages:
        gm = local.module
        counts: dict[str, int] = {}
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                for name in node_parameters(gm, node):
                    counts[name] = counts.get(name, 0) + 1
        reused = sorted(name for name, n in counts.items() if n > 1)
        if reused:
            return (f"stage {local.plan.index} reads {reused[0]} at {counts[reused[0]]} ops; torch's split backward "
                    f"({plan.schedule}) computes each weight's gradient once per group of ops and cannot for a "
                    "parameter read at several: run it with --engine ours, or plan --schedule 1f1b, gpipe or "
                    "interleaved-1f1b for --engine torch.")
    return None


class TorchEngine:
    """This rank's stages as ``PipelineStage`` objects and the torch schedule that runs a step of them.

    ``runnables``: what runs each stage's forward (precision, recomputation, FSDP2 when
    ``sharded``: then FSDP2 reduces the gradients and this engine adds no replica reduction).
    """

    def __init__(
        self, plan: Plan, stages: Sequence[LocalStage], runnables: Sequence[torch.nn.Module], groups: Groups, *,
        loss_fn: Any, device: torch.device, timeout: float, sharded: bool = False,
        skip: AbstractSet[int] = frozenset(),
    ) -> None:
        """``skip``: ids of parameters the replicas leave alone (expert parallelism's: ExpertsLayer reduces them)."""
        self.plan = plan
        self.device = device
        self.records: list[Any] = []  # torch's schedules time no actions (see run)
        self._feed = Feed()
        pipeline_rank, replica = plan.rank_layout()[dist.get_rank()]
        self._group = _pipeline_group(plan, replica)
        crossing = carried_values(plan)
        last = len(plan.stages) - 1
        flats = [
            FlatStage(local, runnable, plan=plan, feed=self._feed,
                      incoming=crossing[local.plan.index - 1] if local.plan.index > 0 else (),
                      outgoing=crossing[local.plan.index] if local.plan.index < last else ())
            for local, runnable in zip(stages, runnables)
        ]
        splits = plan.schedule_data().splits_backward
        uses_ddp = plan.dp > 1 and len(stages) == 1 and not splits and not sharded
        self._reducer: ReplicaReducer | None = None
        modules: list[torch.nn.Module] = list(flats)
        if uses_ddp:  # torch's stage runs DDP's no_sync / prepare_for_backward (before the last backward) itself
            modules = [wrap_replicas(f, groups, bucket_cap_mb=plan.bucket_cap_mb, device=device, skip=skip)
                       for f in flats]
            for module in modules:
                if isinstance(module, DistributedDataParallel):
                    # Every forward outside no_sync too: torch's shape inference calls the module directly, and a
                    # synced forward whose backward never reaches the parameters leaves DDP's reducer broken.
                    module.require_backward_grad_sync = False
        elif plan.dp > 1 and not sharded:  # sharded: FSDP2 reduce-scatters (Pipeline's ShardedStep drives it)
            broadcast_replicas([local.module for local in stages], groups, skip=skip)
            self._reducer = replica_reducer({local.plan.index: local.module for local in stages},
                                            [local.plan.index for local in stages], groups,
                                            bucket_cap_mb=plan.bucket_cap_mb, timeout=timeout, skip=skip)
        self._stage_indices = [local.plan.index for local in stages]
        self._has_last = any(local.is_last for local in stages)
        self._stages = [
            PipelineStage(module, local.plan.index, len(plan.stages), device, group=self._group)
            for local, module in zip(stages, modules)
        ]
        last_local = next((local for local in stages if local.is_last), stages[0])
        loss = IndexedLoss(last_local, loss_fn, feed=self._feed, microbatches=plan.microbatches)
        self.schedule = _schedule(plan, self._stages, loss)
        _check_placement(plan, self.schedule, pipeline_rank)

    def run(self, microbatches: list[tuple[tuple[torch.Tensor, ...], Any]], *, record: bool = False
            ) -> torch.Tensor | None:
        """One step over this replica's micro-batches; the summed (1/M-scaled) loss where the last stage is held.

        ``record``: never set (:func:`torch_engine_refusal` refuses traces: torch's schedules time no actions).
        """
        self._feed.micro = microbatches
        index = torch.arange(self.plan.microbatches, device=self.device)
        losses: list[torch.Tensor] = []
        try:
            # Every stage gets its micro-batch's index (FlatStage's keyword MICROBATCH); the loss, the target's.
            self.schedule.step(target=index, losses=losses, return_outputs=False, microbatch=index)
        finally:
            self._feed.micro = []
        if self._reducer is not None:
            for stage in self._stage_indices:
                self._reducer.start(stage)
            self._reducer.finish()
        if not self._has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()


def _pipeline_group(plan: Plan, replica: int) -> dist.ProcessGroup | None:
    """This replica's pipeline ranks (the layout's ``pp`` groups); every rank creates every group, in order."""
    if plan.dp == 1:
        return None  # the world: group rank = pipeline rank
    mine = None
    for ranks in plan.layout.groups("pp"):
        group = dist.new_group(list(ranks))
        if plan.layout.coord(ranks[0], "dp") == replica:
            mine = group
    return mine


def _schedule(plan: Plan, stages: list[PipelineStage], loss: IndexedLoss) -> _PipelineSchedule:
    cls = _CLASSES.get(plan.schedule)
    options: dict[str, Any] = {"loss_fn": loss, "scale_grads": False}
    if cls in (ScheduleGPipe, Schedule1F1B):
        return cls(stages[0], plan.microbatches, **options)  # type: ignore[no-any-return]
    if cls is not None:
        return cls(stages, plan.microbatches, **options)  # type: ignore[no-any-return]
    runtime = _PipelineScheduleRuntime(stages, plan.microbatches, **options)
    runtime._prepare_schedule_with_comms(_torch_actions(plan))
    return runtime


def _torch_actions(plan: Plan) -> dict[int, list[_Action | None]]:
    """The plan's compute actions per pipeline rank in torch's form (B is torch's input-only ``I`` with W)."""
    schedule = plan.schedule_data()
    backward = _ComputationType.BACKWARD_INPUT if schedule.splits_backward else _ComputationType.FULL_BACKWARD
    kinds = {"F": _ComputationType.FORWARD, "B": backward, "W": _ComputationType.BACKWARD_WEIGHT}
    return {rank: [_Action(a.stage, kinds[a.kind], a.microbatch) for a in row if a.kind in kinds]
            for rank, row in enumerate(schedule.actions)}


def _check_placement(plan: Plan, schedule: _PipelineSchedule, pipeline_rank: int) -> None:
    """torch's stage -> rank map must be the plan's (a bug, not bad input, if not)."""
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    if mapping is None:  # one stage per rank: stage s on rank s
        return
    want = {s.index: s.rank for s in plan.stages}
    if dict(mapping) != want:
        raise RuntimeError(f"torch's schedule places stages {dict(mapping)}, the plan {want} "
                           f"(pipeline rank {pipeline_rank}, schedule {plan.schedule})")
