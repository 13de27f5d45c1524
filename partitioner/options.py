"""Planning options: every keyword of :func:`~partitioner.planner.compile`, checked and resolved once.

:class:`PlanOptions` is the frozen record every step of the planner reads;
:func:`check_options` builds it (an :class:`~partitioner.errors.AutopartitionError`
on the first bad option), :func:`resolve_device` and :func:`default_memory_limit`
pick the GPU planned for and its memory, :func:`microbatch_choices` the
micro-batch counts ``microbatches="auto"`` tries.

    >>> microbatch_choices(32), default_gpus_per_node(12)
    ((1, 2, 4, 8, 16, 32), 6)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from partitioner.capture import CaptureMethod
from partitioner.defaults import SCHEDULES
from partitioner.devices import DEVICES, DeviceSpec, device_spec
from partitioner.errors import AutopartitionError
from partitioner.precision import OPTIMIZERS, Precision, check_optimizer, check_precision
from partitioner.problem import RECOMPUTE_MODES, RecomputeMode, ScheduleKind
from partitioner.refine import REFINE_SIMULATIONS

__all__ = [
    "AUTO",
    "DEFAULT_GPUS_PER_NODE",
    "MAX_MICROBATCH_CHOICES",
    "PlanOptions",
    "Status",
    "batch_size_of",
    "check_options",
    "default_gpus_per_node",
    "default_memory_limit",
    "microbatch_choices",
    "resolve_device",
]


AUTO = "auto"  # microbatches / schedule: search



MAX_MICROBATCH_CHOICES = 8  # micro-batch counts tried per data-parallel degree with "auto"



DEFAULT_GPUS_PER_NODE = 8  # DGX / HGX nodes: 8 GPUs on NVLink



Status = Callable[[str], None]



@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Every planning choice, checked and resolved once by :func:`compile`, then carried through."""

    gpus: int
    batch: int  # mini-batch size: samples per step over all replicas
    microbatches: int | None  # None: search (:func:`microbatch_choices` of each replica's batch)
    schedules: tuple[ScheduleKind, ...]  # the schedules to try: one, or all ("auto")
    spec: DeviceSpec  # link, memory and roofline numbers of the GPU planned for
    measure: bool  # times measured on ``local``, else predicted for ``spec``
    local: torch.device  # where capture and profiling run
    memory_limit: float | None  # bytes per GPU; None: no limit
    pp: int | None  # a fixed shape, else every pp x dp over the divisors of ``gpus``
    dp: int | None
    capture_method: CaptureMethod
    max_blocks: int
    precision: Precision
    optimizer: str  # a name of partitioner.precision.OPTIMIZERS
    optimizer_states: int  # the optimizer's, or as given to compile()
    recompute: RecomputeMode
    gpus_per_node: int  # divides gpus
    bucket_cap_mb: float
    time_limit: float  # solver seconds per ILP
    refine_simulations: int = REFINE_SIMULATIONS  # simulated steps of local search per candidate (0: none)

    @property
    def device_name(self) -> str:
        """The plan's ``device`` field."""
        return f"{self.spec.name} (measured)" if self.measure else self.spec.name

    def microbatch_choices(self, dp: int) -> tuple[int, ...]:
        """Micro-batch counts to try with ``dp`` replicas (empty: the batch does not split)."""
        if self.batch % dp:
            return ()
        if self.microbatches is not None:
            return (self.microbatches,) if (self.batch // dp) % self.microbatches == 0 else ()
        return microbatch_choices(self.batch // dp)

    @property
    def reference_microbatches(self) -> int:
        """M of the micro-batch that is captured and costed (other sizes are scaled from it)."""
        if self.microbatches is not None:
            return self.microbatches
        # The smallest micro-batch of two samples or more: small micro-batches are where large
        # models end up, and the winner's graph is then the costed one, not captured again
        # (a graph exported at one sample may specialise the batch dimension away).
        size = next((k for k in range(2, self.batch + 1) if self.batch % k == 0), 1)
        return self.batch // size



def microbatch_choices(samples: int, *, most: int = MAX_MICROBATCH_CHOICES) -> tuple[int, ...]:
    """Divisors of ``samples`` (one replica's batch) on a geometric ladder, at most ``most`` of them.

    Always 1 (no pipelining: whole-batch kernels) and ``samples`` (micro-batches of
    one sample: the smallest bubble and activations); in between each kept count
    is at least ``ratio`` times the previous, the ratio growing from 1.5 until
    ``most`` or fewer remain.

    >>> microbatch_choices(1), microbatch_choices(6), microbatch_choices(64)
    ((1,), (1, 2, 3, 6), (1, 2, 4, 8, 16, 32, 64))
    >>> microbatch_choices(1024)
    (1, 4, 16, 64, 256, 1024)
    """
    divisors = [m for m in range(1, samples + 1) if samples % m == 0]
    ratio = 1.5
    while True:
        kept = [1]
        for m in divisors[1:]:
            if m >= ratio * kept[-1]:
                kept.append(m)
        if kept[-1] != samples:  # end on one sample per micro-batch
            if samples < ratio * kept[-1] and len(kept) > 1:
                kept[-1] = samples
            else:
                kept.append(samples)
        if len(kept) <= most:
            return tuple(kept)
        ratio *= 1.5



def default_gpus_per_node(gpus: int) -> int:
    """GPUs per node when not given: the largest divisor of ``gpus`` up to 8 (a DGX/HGX node).

    >>> default_gpus_per_node(64), default_gpus_per_node(4), default_gpus_per_node(12)
    (8, 4, 6)
    """
    return max(k for k in range(1, min(DEFAULT_GPUS_PER_NODE, gpus) + 1) if gpus % k == 0)



def batch_size_of(inputs: tuple[Any, ...]) -> int:
    sizes = {x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise AutopartitionError(
            f"Every example input needs the batch in dimension 0 with one common size; got sizes {sorted(sizes)}."
        )
    return sizes.pop()



def check_options(
    *,
    gpus: int,
    batch: int,
    microbatches: int | str,
    schedule: str,
    pp: int | None,
    dp: int | None,
    precision: str,
    optimizer: str,
    optimizer_states: int | None,
    recompute: str,
    gpus_per_node: int | None,
    **resolved: Any,
) -> PlanOptions:
    """Check every option (an :class:`AutopartitionError` on the first bad one) and resolve the defaults."""
    if gpus < 1:
        raise AutopartitionError(f"--gpus must be at least 1, got {gpus}.")
    micro: int | None = None
    if microbatches != AUTO:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int):
            raise AutopartitionError(f"--microbatches must be a whole number or 'auto', got {microbatches!r}.")
        if microbatches < 1:
            raise AutopartitionError(f"--microbatches must be at least 1, got {microbatches}.")
        if batch % microbatches:
            raise AutopartitionError(
                f"The batch of {batch} does not split into {microbatches} equal micro-batches; "
                f"choose a batch size that is a multiple of {microbatches}, another --microbatches, "
                "or --microbatches auto."
            )
        micro = microbatches
    kinds = SCHEDULES if schedule == AUTO else tuple(k for k in SCHEDULES if k == schedule)
    if not kinds:
        raise AutopartitionError(
            f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}, or auto to try each."
        )
    for name, value in (("pp", pp), ("dp", dp)):
        if value is not None and (value < 1 or gpus % value):
            raise AutopartitionError(f"--{name} {value} must be a positive divisor of --gpus {gpus}.")
    if pp is not None and dp is not None and pp * dp != gpus:
        raise AutopartitionError(f"--pp {pp} x --dp {dp} = {pp * dp}, but --gpus is {gpus}.")
    if recompute not in RECOMPUTE_MODES:
        raise AutopartitionError(
            f"Unknown recomputation {recompute!r}; choose auto (each stage recomputes only if it would "
            "not fit otherwise), none (keep every activation) or full (every stage recomputes)."
        )
    if optimizer_states is not None and optimizer_states < 0:
        raise AutopartitionError(f"optimizer_states must be 0 or more, got {optimizer_states}.")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        divisors = ", ".join(str(k) for k in range(1, gpus + 1) if gpus % k == 0)
        raise AutopartitionError(
            f"--gpus-per-node {gpus_per_node} does not divide --gpus {gpus}: ranks are laid out node by "
            f"node, every node holding the same number of GPUs. Choose one of {divisors} (a job on part "
            "of one node: --gpus-per-node equal to --gpus)."
        )
    return PlanOptions(
        gpus=gpus, batch=batch, microbatches=micro, schedules=kinds, pp=pp, dp=dp,
        precision=check_precision(precision), optimizer=check_optimizer(optimizer),
        optimizer_states=OPTIMIZERS[optimizer] if optimizer_states is None else optimizer_states,
        recompute=next(m for m in RECOMPUTE_MODES if m == recompute),  # narrows str to RecomputeMode
        gpus_per_node=gpus_per_node or default_gpus_per_node(gpus),
        **resolved,
    )



def resolve_device(device: str) -> tuple[DeviceSpec, bool, torch.device]:
    """(spec for communication and limits, measure locally?, local device to run on)."""
    name = device.lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise AutopartitionError("--device cuda was asked for but no CUDA device is visible.")
        gpu = torch.cuda.get_device_name().lower()
        known = next((k for k in ("h200", "h100", "a100") if k in gpu), "a100")
        return DEVICES[known], True, torch.device("cuda")
    if name == "cpu":
        return DEVICES["cpu"], True, torch.device("cpu")
    return device_spec(name), False, torch.device("cpu")



def default_memory_limit(device: str, spec: DeviceSpec, local: torch.device) -> float | None:
    if local.type == "cuda":
        return float(torch.cuda.get_device_properties(local).total_memory)
    if device.lower() in ("auto", "cpu"):
        return None  # CPU ranks share host memory; no per-rank limit unless given
    return float(spec.memory_bytes)
