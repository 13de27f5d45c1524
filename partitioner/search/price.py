"""Price a fixed layout (pp x tp x dp, sharding, micro-batches, schedule, recomputation) by our cost model.

Published training layouts (Megatron-LM / Megatron-Bridge, torchtitan, the Llama 3
paper) fix every parallel degree by hand.  :func:`price_layout` plans a model
under exactly such a layout with the planner's own machinery
(:func:`partitioner.search.planner.compile` with every choice fixed: only the
split into stages is solved, then refined and simulated as for any plan), so a
published layout and the planner's own choice are predicted by the same cost
model, the same solver and the same simulator, and can be compared.

A layout that does not fit the GPU's memory under our memory model is priced
anyway, without the memory limit (recomputation ``"auto"`` then recomputes
nothing), and marked as not fitting, with the peak it would need.  A layout that
leaves nothing to trade for memory (one pipeline stage, recomputation fixed, no
fully sharded state: :func:`leaves_no_choice`) is planned once, without the limit,
and fits when its peak does; any other is planned under the limit first and again
without it only when nothing fits.

    >>> Layout("x", gpus=64, tp=4, pp=8, dp=2, microbatches=64, schedule="interleaved-1f1b", chunks=5,
    ...        shard="optimizer").describe()
    'TP4 x PP8 (5 stages per rank) x DP2 (optimizer-sharded), 64 micro-batches, interleaved-1f1b, recompute auto'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from partitioner.errors import InfeasibleError
from partitioner.layout import Layout as Degrees
from partitioner.plan import Plan
from partitioner.search.options import default_memory_limit, resolve_device
from partitioner.search.planner import compile

__all__ = ["UNLIMITED_MEMORY", "Layout", "Priced", "leaves_no_choice", "price_layout"]

UNLIMITED_MEMORY = 1e15  # bytes per GPU: a layout that does not fit is priced as if memory were no limit


@dataclasses.dataclass(frozen=True)
class Layout:
    """One fixed parallel layout: every degree and choice the planner would otherwise search.

    ``source``: where it was published (for the table).
    """

    name: str
    gpus: int
    tp: int
    pp: int
    dp: int
    microbatches: int
    schedule: str
    chunks: int | None = None
    shard: str = "none"
    recompute: str = "auto"
    source: str = ""
    shard_span: str = "auto"  # "full" over every replica ("world") or one node's (HSDP, "node"); auto: weighed
    zero3_unit: str = "layer"  # ZeRO-3's unit of gathering: FSDP2's layer, or DeepSpeed's module
    ep: int = 1  # expert parallelism: groups of ep replicas share each layer's experts (cost/experts.py)

    def __post_init__(self) -> None:
        if self.tp * self.pp * self.dp != self.gpus:
            raise ValueError(f"{self.name}: tp x pp x dp = {self.tp} x {self.pp} x {self.dp} is not {self.gpus} GPUs")
        try:
            self.degrees  # noqa: B018 -- checked once, by the layout object's rules
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    @property
    def degrees(self) -> Degrees:
        """Its parallel degrees as the planner's one layout object (:class:`partitioner.layout.Layout`)."""
        return Degrees(pp=self.pp, dp=self.dp, tp=self.tp, ep=self.ep, chunks=self.chunks or 1)

    def describe(self) -> str:
        chunks = f" ({self.chunks} stages per rank)" if self.chunks and self.chunks > 1 else ""
        shard = {"none": "", "optimizer": " (optimizer-sharded)", "full": " (fully sharded)",
                 "zero3": " (ZeRO-3)"}[self.shard]
        if self.shard == "full" and self.shard_span != "auto":
            shard = {"world": " (fully sharded over all)", "node": " (fully sharded per node: HSDP)"}[self.shard_span]
        experts = f" (EP{self.ep})" if self.ep > 1 else ""
        return (f"TP{self.tp} x PP{self.pp}{chunks} x DP{self.dp}{experts}{shard}, {self.microbatches} micro-batches, "
                f"{self.schedule}, recompute {self.recompute}")


@dataclasses.dataclass(frozen=True)
class Priced:
    """A layout's predicted step: the plan, whether it fits, and the throughput it implies."""

    layout: Layout
    plan: Plan
    fits: bool
    tokens_per_sample: int

    @property
    def step_s(self) -> float:
        return self.plan.predicted.step_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Tokens of one step over the step and every GPU.

        >>> import dataclasses
        >>> from partitioner.plan import example_plan
        >>> plan = example_plan()
        >>> p = Priced(Layout("x", gpus=plan.gpus, tp=1, pp=plan.pp, dp=plan.dp, microbatches=plan.microbatches,
        ...            schedule=plan.schedule), plan, True, tokens_per_sample=4096)
        >>> round(p.tokens_per_s_per_gpu) == round(plan.batch_size * 4096 / plan.predicted.step_s / plan.gpus)
        True
        """
        plan = self.plan
        if plan.predicted.step_s <= 0:
            return 0.0
        return plan.batch_size * self.tokens_per_sample / plan.predicted.step_s / plan.gpus

    @property
    def mfu(self) -> float | None:
        return self.plan.predicted.mfu

    @property
    def peak_bytes(self) -> float:
        return max(self.plan.predicted.peak_memory_bytes, default=0.0)


def leaves_no_choice(layout: Layout) -> bool:
    """True when the memory limit cannot change ``layout``'s plan: the unconstrained plan fits or nothing does.

    The choices a limit can change are the split (pp > 1), recomputation (``auto``)
    and, for ``full`` sharding, ZeRO-3 against stages kept gathered (and either span, unless fixed).

    >>> leaves_no_choice(Layout("x", gpus=8, tp=1, pp=1, dp=8, microbatches=1, schedule="1f1b", recompute="full"))
    True
    >>> leaves_no_choice(Layout("x", gpus=8, tp=1, pp=1, dp=8, microbatches=1, schedule="1f1b", shard="full",
    ...                         recompute="full"))
    False
    """
    fixed = layout.shard in ("none", "optimizer") or (layout.shard == "zero3" and layout.shard_span != "auto")
    return layout.pp == 1 and layout.recompute != "auto" and fixed


def price_layout(
    model: torch.nn.Module,
    example_inputs: Any,
    layout: Layout,
    *,
    tokens_per_sample: int,
    memory_per_gpu: float | None = None,
    **common: Any,
) -> Priced:
    """Plan ``model`` under ``layout`` exactly (the split solved for it) and predict its step.

    ``common``: the other :func:`~partitioner.search.planner.compile` keywords
    (``device``, ``precision``, ``optimizer``, ``gpus_per_node``, ...).  A layout
    that does not fit ``memory_per_gpu`` (the device's by default) is priced
    without the limit and returned with ``fits=False``.
    """
    fixed: dict[str, Any] = dict(
        gpus=layout.gpus, tp=layout.tp, pp=layout.pp, dp=layout.dp, microbatches=layout.microbatches,
        schedule=layout.schedule, chunks=layout.chunks, shard=layout.shard, shard_span=layout.shard_span,
        zero3_unit=layout.zero3_unit, recompute=layout.recompute, priced_only=True, ep=layout.ep, **common)
    if leaves_no_choice(layout):  # one plan whatever the limit: planned once, compared with the limit
        plan = compile(model, example_inputs, memory_per_gpu=UNLIMITED_MEMORY, **fixed)
        limit = memory_per_gpu if memory_per_gpu is not None else _device_limit(fixed.get("device", "auto"))
        fits = limit is None or max(plan.predicted.peak_memory_bytes, default=0.0) <= limit * (1 + 1e-9)
        return Priced(layout, plan, fits, tokens_per_sample)
    try:
        plan = compile(model, example_inputs, memory_per_gpu=memory_per_gpu, **fixed)
        return Priced(layout, plan, True, tokens_per_sample)
    except InfeasibleError:
        plan = compile(model, example_inputs, memory_per_gpu=UNLIMITED_MEMORY, **fixed)
        return Priced(layout, plan, False, tokens_per_sample)


def _device_limit(device: str) -> float | None:
    """The memory limit compile() applies for ``device`` by default (the same function)."""
    spec, _, local = resolve_device(device)
    return default_memory_limit(device, spec, local)
