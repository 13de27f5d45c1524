"""A rank's stage stack: its stages, and what each layer of the runtime built around them.

``Pipeline`` builds it as a recipe of steps, each a function in its layer's subpackage
that takes the stack and returns it (as torchtitan's ``parallelize`` applies tensor
parallelism, activation checkpointing and FSDP in turn):

    stages (runtime.execute.stage) -> values (runtime.state.values) -> tensor split,
    recomputation, precision, sharding, replication (runtime.parallel.parallelize,
    runtime.execute.recompute, runtime.state.precision) -> the schedule runner
    (runtime.engines.runners)

A layer that acts around every training step adds a :class:`StackLayer`; the Pipeline
(and the runner, for :meth:`StackLayer.gradients_done`) call the layers' hooks instead
of asking which modes the plan uses.  The hooks run in the order the layers were added.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from partitioner.plan import Plan
from runtime.execute.comm import Groups
from runtime.execute.stage import LocalStage

__all__ = ["LossFn", "Runner", "StackLayer", "StageStack", "StepHooks"]

LossFn = Callable[[Any, Any], torch.Tensor]
_Layer = TypeVar("_Layer", bound="StackLayer")


class Runner(Protocol):
    """What runs a step's schedule over the stack (ours, :class:`~runtime.execute.runner.StepRunner`, or torch's)."""

    records: list[Any]  # the actions timed with ``record=True``

    def run(self, microbatches: list[tuple[tuple[torch.Tensor, ...], Any]], /, *, record: bool) -> torch.Tensor | None:
        ...


class StepHooks(Protocol):
    """What :class:`~runtime.execute.runner.StepRunner` asks the layers during a step (a :class:`StageStack`)."""

    def forwarding(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        ...

    def backwarding(self, stage: int, outputs: Sequence[torch.Tensor], *, last: bool
                    ) -> contextlib.AbstractContextManager[Any]:
        ...

    def gradients_done(self, stage: int) -> None:
        ...


class StackLayer:
    """One layer's hooks around a step; each does nothing unless the layer overrides it."""

    def before_step(self) -> None:
        """Before a training step's first action (FSDP2: gradient sync off until the step's end)."""

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """Held around a step's (and an evaluation's) forwards and backwards (DTensor's switches)."""
        return contextlib.nullcontext()

    def forwarding(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        """Around each forward of ``stage`` in a training step (DDP: no gradient sync there)."""
        return contextlib.nullcontext()

    def backwarding(self, stage: int, outputs: Sequence[torch.Tensor], *, last: bool
                    ) -> contextlib.AbstractContextManager[Any]:
        """Around a whole backward of ``stage`` from ``outputs`` (``last``: its last of the step, where DDP syncs)."""
        return contextlib.nullcontext()

    def gradients_done(self, stage: int) -> None:
        """``stage``'s parameter gradients of this step are complete (the runner says so; a reducer starts)."""

    def reduce(self) -> None:
        """After the runner: gradients averaged over the replicas (FSDP2's reduce-scatter, the explicit reducer)."""

    def after_step(self) -> None:
        """After :meth:`reduce`, every layer's: gradients as the optimizer reads them (tied sums, tp layouts)."""

    def after_eval(self) -> None:
        """After an evaluation's forwards (FSDP2: reshard what the forwards gathered)."""


@dataclasses.dataclass(frozen=True)
class StageStack:
    """What one rank runs: its stages and, layer by layer, what wraps them (built bottom up, never torn down)."""

    plan: Plan  # the plan the ranks run (runtime.state.precision.at_precision: boundaries as computed)
    stages: tuple[LocalStage, ...]  # the stages this rank holds, by stage index
    rank: int
    pipeline_rank: int
    replica: int
    device: torch.device
    timeout: float
    engine: str = "ours"
    shard_mode: str = "none"  # this rank's stages' shard mode (runtime.parallel.shard.rank_shard_mode)
    deferred: dict[str, torch.Tensor] | None = None  # a meta stage's values, put in once sharded
    groups: Groups | None = None  # replicas and tied copies (runtime.parallel.parallelize.apply_groups)
    tp_mesh: DeviceMesh | None = None  # tp > 1: this rank's tensor-parallel group
    shard_mesh: DeviceMesh | None = None  # FSDP2's, when this rank's stages are "full"
    runnables: tuple[nn.Module, ...] = ()  # what runs each stage's forward: wrappers around its module
    modules: tuple[nn.Module, ...] = ()  # what the runner drives per stage: the runnables, or DDP around them
    loss_fn: LossFn | None = None  # the loss as the layers run it (precision, vocabulary-parallel)
    layers: tuple[StackLayer, ...] = ()
    runner: Runner | None = None

    @property
    def held(self) -> list[fx.GraphModule]:
        """The stage modules (fx.GraphModules under the original names), by stage index."""
        return [local.module for local in self.stages]

    @property
    def replica_groups(self) -> Groups:
        """The process groups (once :func:`~runtime.parallel.parallelize.apply_groups` made them)."""
        if self.groups is None:
            raise RuntimeError("the stage stack has no process groups yet: apply_groups comes first")
        return self.groups

    def with_layer(self, layer: StackLayer, **changes: Any) -> StageStack:
        """This stack with ``layer`` added on top (and ``changes`` made)."""
        return dataclasses.replace(self, layers=(*self.layers, layer), **changes)

    def layer(self, kind: type[_Layer]) -> _Layer:
        """The layer of type ``kind`` (its step comes before whatever asks for it)."""
        found = next((layer for layer in self.layers if isinstance(layer, kind)), None)
        if found is None:
            raise LookupError(f"the stage stack has no {kind.__name__} yet: its step comes first")
        return found

    @contextlib.contextmanager
    def stepping(self, *, training: bool) -> Iterator[None]:
        """Around a step's runner (``training``: each layer's :meth:`~StackLayer.before_step` first)."""
        if training:
            for layer in self.layers:
                layer.before_step()
        with contextlib.ExitStack() as held:
            for layer in self.layers:
                held.enter_context(layer.stepping())
            yield

    @contextlib.contextmanager
    def forwarding(self, stage: int) -> Iterator[None]:
        with contextlib.ExitStack() as held:
            for layer in self.layers:
                held.enter_context(layer.forwarding(stage))
            yield

    @contextlib.contextmanager
    def backwarding(self, stage: int, outputs: Sequence[torch.Tensor], *, last: bool) -> Iterator[None]:
        with contextlib.ExitStack() as held:
            for layer in self.layers:
                held.enter_context(layer.backwarding(stage, outputs, last=last))
            yield

    def gradients_done(self, stage: int) -> None:
        for layer in self.layers:
            layer.gradients_done(stage)

    def after_step(self) -> None:
        """Every layer's :meth:`~StackLayer.reduce`, then every layer's :meth:`~StackLayer.after_step`."""
        for layer in self.layers:
            layer.reduce()
        for layer in self.layers:
            layer.after_step()

    def after_eval(self) -> None:
        for layer in self.layers:
            layer.after_eval()

    def replace(self, **changes: Any) -> StageStack:
        return dataclasses.replace(self, **changes)

    def zipped(self, modules: Sequence[nn.Module]) -> list[tuple[LocalStage, nn.Module]]:
        """Each stage with its entry of ``modules`` (runnables, or what the runner drives)."""
        return list(zip(self.stages, modules, strict=True))
