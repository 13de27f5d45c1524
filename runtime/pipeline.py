"""``Pipeline``: one rank's view of a plan: its stage, its replicas, its schedule.

Example (in each rank started by ``autopartition run`` / torchrun)::

    plan = Plan.load("plan/")
    pipe = Pipeline(plan, build_model(), loss_fn)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for inputs, target in batches:
        loss = pipe.step(inputs, target)   # mini-batch mean loss on the last stage, else None
        opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from partitioner.errors import AutopartitionError, PlanMismatchError
from partitioner.plan import Plan
from partitioner.schedule import Action, validate
from partitioner.timeline import TimelineEvent, write_chrome_trace
from runtime.comm import init_distributed, pick_device
from runtime.execute import StepRunner
from runtime.replicate import make_groups, sum_tied_grads, sync_tied_weights, wrap_replicas
from runtime.stage import build_local_stage

__all__ = ["Pipeline"]

LossFn = Callable[[Any, Any], torch.Tensor]


class Pipeline:
    """Holds only this rank's stage; :meth:`step` trains one mini-batch.

    ``loss_fn(outputs, target)`` must return the mean loss over its batch (the
    default reduction of torch's losses): the pipeline averages it over
    micro-batches and replicas, which equals the unpartitioned model's loss.
    """

    def __init__(
        self,
        plan: Plan,
        model: torch.nn.Module,
        loss_fn: LossFn | None = None,
        *,
        device: torch.device | None = None,
        timeout: float = 300.0,
        trace: bool = False,
    ) -> None:
        self.plan = plan
        self.device = device or pick_device()
        self.timeout = timeout
        self.trace = trace
        init_distributed(self.device, timeout=timeout)
        world = dist.get_world_size()
        if world != plan.gpus:
            raise AutopartitionError(
                f"The plan needs {plan.gpus} ranks ({plan.pp} stages x {plan.dp} replicas) but "
                f"{world} were started. Launch with --nproc-per-node {plan.gpus} (or nodes x procs = {plan.gpus})."
            )
        self.rank = dist.get_rank()
        self.stage_index, self.replica = plan.rank_layout()[self.rank]
        validate(plan.schedule_data(), sends_to=plan.sends_to(), receives_from=plan.receives_from())
        self._state_keys = set(model.state_dict().keys())
        self._groups = make_groups(plan, self.rank)
        self._stage = build_local_stage(plan, model, self.stage_index)
        self._stage.module.to(self.device)
        sync_tied_weights(self._stage.module, self._groups)
        self._module = wrap_replicas(
            self._stage.module, self._groups, bucket_cap_mb=plan.bucket_cap_mb, device=self.device
        )
        self._runner = StepRunner(
            plan, self._stage, self._module, replica=self.replica, rank=self.rank,
            loss_fn=loss_fn, device=self.device, timeout=timeout,
        )
        dist.barrier()
        self._clock_zero = time.time()  # right after a barrier: a common origin for traces

    # ---------------------------------------------------------------- public

    @property
    def is_last_stage(self) -> bool:
        return self._stage.is_last

    @property
    def module(self) -> torch.nn.Module:
        """This rank's stage (an fx.GraphModule with the original parameter names)."""
        return self._stage.module

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self._stage.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self._stage.module.named_parameters()

    def step(self, inputs: tuple[torch.Tensor, ...] | torch.Tensor, target: Any = None) -> torch.Tensor | None:
        """Forward and backward one mini-batch; gradients end up in ``.grad``.

        Every rank passes the same mini-batch (only the stages that read an input
        use it, and only the last stage uses ``target``).  Returns the mini-batch
        mean loss on the last stage's ranks, None on the others.
        """
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        micro = self._split(inputs, target)
        loss = self._runner.run(micro, record=self.trace)
        sum_tied_grads(self._stage.module, self._groups)
        if loss is not None and self._groups.stage is not None:
            dist.all_reduce(loss, group=self._groups.stage)
            loss = loss / self.plan.dp
        return loss

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the original model's names.

        A tied parameter appears under every name the model's own state dict gives
        it, whichever name the captured graph used for it.
        """
        own = self._stage.module.state_dict()
        state = {k: v for k, v in own.items() if k in self._state_keys}
        for name, aliases in self._aliases().items():
            for alias in aliases:
                if alias in self._state_keys:
                    state.setdefault(alias, own[name])
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this stage's entries from a full (unpartitioned) state dict."""
        aliases = self._aliases()
        wanted: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        for key in self._stage.module.state_dict():
            if key not in self._state_keys and key not in aliases:
                continue  # non-persistent buffers: not part of a checkpoint
            found = next((state[k] for k in (key, *aliases.get(key, ())) if k in state), None)
            if found is None:
                missing.append(key)
            else:
                wanted[key] = found
        if missing:
            raise PlanMismatchError(
                f"The state dict lacks {len(missing)} entries this stage needs, e.g. {missing[:3]}. "
                "Load a checkpoint of the same model."
            )
        self._stage.module.load_state_dict(wanted, strict=False)
        sync_tied_weights(self._stage.module, self._groups)

    def _aliases(self) -> dict[str, tuple[str, ...]]:
        """Each tied parameter this stage holds (by its name here) -> all of its names."""
        own = set(self._stage.plan.parameters)
        return {name: t.aliases for t in self.plan.tied for name in t.aliases if name in own}

    @property
    def stage(self) -> int:
        return self.stage_index

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every stage's state gathered on rank 0 (replica 0 of each stage), in the original names."""
        local = {k: v.detach().cpu() for k, v in self.state_dict().items()} if self.replica == 0 else {}
        gathered: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(local, gathered if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return merged

    def trace_events(self) -> list[TimelineEvent]:
        """This rank's recorded actions (``trace=True``), seconds from the common start."""
        events = []
        for record in self._runner.records:
            action = Action.parse(record.action)
            events.append(TimelineEvent(
                track=self.rank, label=f"{action.kind}{action.microbatch}", action=record.action,
                microbatch=action.microbatch, kind=action.kind,
                start_s=record.start_s - self._clock_zero, end_s=record.end_s - self._clock_zero,
            ))
        return events

    def write_trace(self, path: str | Path) -> Path | None:
        """Gather every rank's actions; rank 0 writes one Chrome trace (one track per rank)."""
        gathered: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(self.trace_events(), gathered if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        events = [e for part in gathered for e in part]
        return write_chrome_trace(Path(path), events, title="measured", pid=1, track_name="rank")

    # --------------------------------------------------------------- helpers

    def _split(self, inputs: tuple[torch.Tensor, ...], target: Any) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
        plan = self.plan
        expected = [t.shape for t in plan.model.inputs]
        batch = plan.batch_size
        if len(inputs) != len(expected):
            raise AutopartitionError(f"The plan's model takes {len(expected)} inputs; step() got {len(inputs)}.")
        for i, x in enumerate(inputs):
            if x.shape[0] != batch:
                raise AutopartitionError(
                    f"Input {i} has batch {x.shape[0]}, but the plan was made for batches of {batch} "
                    f"({plan.dp} replicas x {plan.microbatches} micro-batches of {plan.microbatch_size}). "
                    f"Pass batches of {batch}, or re-plan with --batch-size {x.shape[0]}."
                )
        per_replica = batch // plan.dp
        lo = self.replica * per_replica

        def piece(value: Any, mb: int) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            start = lo + mb * plan.microbatch_size
            return value[start : start + plan.microbatch_size].to(self.device)

        return [
            (tuple(piece(x, mb) for x in inputs), pytree.tree_map(lambda v, mb=mb: piece(v, mb), target))
            for mb in range(plan.microbatches)
        ]
