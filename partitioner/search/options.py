"""Planning options: every keyword of :func:`~partitioner.search.planner.compile`, checked and resolved once.

:class:`PlanOptions` is the frozen record every step of the planner reads;
:func:`check_options` builds it (an :class:`~partitioner.errors.AutopartitionError`
on the first bad option), :func:`resolve_device` and :func:`default_memory_limit`
pick the GPU planned for and its memory, :func:`microbatch_choices` the
micro-batch counts ``microbatches="auto"`` tries, and
:meth:`PlanOptions.schedule_variants` the (schedule, chunks) pairs tried per
pipeline width.

    >>> microbatch_choices(32), default_gpus_per_node(12)
    ((1, 2, 4, 8, 16, 32), 6)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from partitioner.cost.calibration import Calibration
from partitioner.cost.devices import DEVICES, DeviceSpec, device_spec
from partitioner.cost.experts import DEFAULT_IMBALANCE, ep_choices
from partitioner.cost.precision import (
    DEFAULT_FP8_RECIPE,
    OPTIMIZERS,
    Precision,
    check_fp8,
    check_fp8_recipe,
    check_optimizer,
    check_precision,
    fp8_peak,
    shard_degree,
    shard_footprint,
)
from partitioner.defaults import (
    SCHEDULES,
    SHARD_MODES,
    SHARD_SPANS,
    layout_refusal,
    schedule_chunks,
    shard_refusal,
    splits_backward,
)
from partitioner.errors import AutopartitionError
from partitioner.graph.capture import CaptureMethod
from partitioner.schedule.refine import REFINE_SIMULATIONS
from partitioner.solve.formulate import ZERO3, ZERO3_UNITS
from partitioner.solve.problem import RECOMPUTE_MODES, RecomputeMode, ScheduleKind

__all__ = [
    "AUTO",
    "CHUNK_CHOICES",
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



# Stages per pipeline rank interleaved-1f1b tries when --chunks is not given: Megatron-LM's
# usual settings (Narayanan et al. 2021 measure 2 to 4); more chunks shrink the bubble by 1/v
# but cost v times the point-to-point messages and more activations in flight.
CHUNK_CHOICES = (2, 4)



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
    optimizer: str  # a name of partitioner.cost.precision.OPTIMIZERS
    optimizer_states: int  # the optimizer's, or as given to compile()
    recompute: RecomputeMode
    gpus_per_node: int  # divides gpus
    bucket_cap_mb: float
    time_limit: float  # solver seconds per ILP
    refine_simulations: int = REFINE_SIMULATIONS  # simulated steps of local search per candidate (0: none)
    chunks: int | None = None  # stages per pipeline rank for interleaved-1f1b; None: CHUNK_CHOICES
    calibration: Calibration = dataclasses.field(default_factory=Calibration)  # from a traced run (partitioner.cost.calibration); default: none
    costed_size: int | None = None  # samples per micro-batch the costs were counted at, where compile chose (else the rule below)
    shard: str = AUTO  # how stage groups' replicas hold their state: auto (searched) or one of SHARD_MODES
    # over which replicas "full" shards where a group spans nodes: auto (both weighed), or one of SHARD_SPANS
    shard_span: str = AUTO
    # what one ZeRO-3 gather holds: "layer" (FSDP2, what the runtime runs) or "module" (DeepSpeed's ZeRO-3:
    # pricing published runs only, partitioner.search.price)
    zero3_unit: str = "layer"
    tp: int = 1  # GPUs per tensor-parallel group: ``gpus`` counts groups while a degree is searched (search/planner.py)
    priced_only: bool = False  # layouts the runtime does not run are priced too (search/price.py)
    gpus_per_host: int | None = None  # an NVLink domain of gpus_per_node over hosts of this many (--nvlink-domain)
    ep_fixed: int | None = None  # expert-parallel degree given (--ep N); None: searched (cost/experts.py)
    expert_counts: tuple[int, ...] = ()  # experts per layer of the model's experts layers (graph/experts.py)
    expert_imbalance: float = DEFAULT_IMBALANCE  # the busiest EP member's tokens over the mean (cost/experts.py)
    fp8_recipe: str = DEFAULT_FP8_RECIPE  # FP8 scaling under precision fp8 (partitioner.cost.precision.FP8_RECIPES)

    def ep_choices(self, dp: int) -> tuple[int, ...]:
        """Expert-parallel degrees to try for ``dp`` replicas: 1 for a model without experts."""
        if not self.expert_counts:
            return (1,) if self.ep_fixed in (None, 1) else ()
        return ep_choices(math.gcd(*self.expert_counts), dp, fixed=self.ep_fixed, per_node=self.gpus_per_node)

    def shard_modes(self, schedule: str, dp: int) -> tuple[str, ...]:
        """The shard modes tried for stage groups of ``dp`` replicas under ``schedule``.

        One replica shards nothing ("none"); ``auto`` tries every mode the
        runtime runs under the schedule (:func:`~partitioner.defaults.shard_refusal`;
        with ``tp > 1`` not ``optimizer``: runtime.parallel.tensorparallel runs none and full),
        a fixed ``--shard`` only itself (:func:`check_options` refused the pairs
        it cannot run).

        >>> o = PlanOptions(gpus=8, batch=8, microbatches=None, schedules=SCHEDULES, spec=DEVICES["h100"],
        ...     measure=False, local=torch.device("cpu"), memory_limit=None, pp=None, dp=None,
        ...     capture_method="auto", max_blocks=256, precision="fp32", optimizer="adam",
        ...     optimizer_states=2, recompute="auto", gpus_per_node=8, bucket_cap_mb=25.0, time_limit=1.0)
        >>> o.shard_modes("1f1b", 4), o.shard_modes("1f1b", 1)  # optimizer holds less, full moves less
        (('none', 'optimizer', 'full'), ('none',))
        >>> dataclasses.replace(o, shard="optimizer").shard_modes("zbv", 8)
        ('optimizer',)
        """
        if dp <= 1:
            return ("none",)
        if self.shard == ZERO3:
            return ()  # the search's ZeRO-3 mode alone (search.layouts._policies)
        if self.shard != AUTO:  # ZeRO-1 over tensor-parallel stages: not run (compile refuses a fixed pair)
            runs = shard_refusal(schedule, self.shard) is None and (
                self.priced_only or layout_refusal(tp=self.tp, dp=dp, shard=self.shard) is None)
            return (self.shard,) if runs else ()
        modes = [m for m in SHARD_MODES if shard_refusal(schedule, m) is None
                 and layout_refusal(tp=self.tp, dp=dp, shard=m) is None]
        # A sharded mode that holds and moves no fewer bytes per parameter than another is never worth
        # solving (every cost it adds is one of the two times the parameters: shard_footprint).  DDP stays:
        # its all-reduce overlaps the last backward.
        cost = {m: shard_footprint(self.precision, self.optimizer_states, m, shard_degree(m, dp, self.gpus_per_node))
                for m in modes}
        return tuple(m for m in modes if m == "none" or not any(
            o != m and o != "none" and cost[o][0] <= cost[m][0] and cost[o][1] <= cost[m][1] for o in modes
            if SHARD_MODES.index(o) < SHARD_MODES.index(m) or cost[o] != cost[m]))

    def schedule_variants(self, pp: int, blocks: int) -> list[tuple[ScheduleKind, int]]:
        """The (schedule, stages per rank) pairs tried with ``pp`` pipeline ranks and ``blocks`` blocks.

        One rank runs every schedule alike, so with ``pp = 1`` only the
        one-stage schedules are tried (a fixed ``--schedule`` is kept: the
        search then says why it cannot run).  ``interleaved-1f1b`` tries each of
        :data:`CHUNK_CHOICES` (or ``--chunks``) that leaves a block per stage,
        or, where none does, the first (the search records why it cannot run);
        ``zbv`` runs 2.

        >>> o = PlanOptions(gpus=8, batch=8, microbatches=None, schedules=SCHEDULES, spec=DEVICES["h100"],
        ...     measure=False, local=torch.device("cpu"), memory_limit=None, pp=None, dp=None,
        ...     capture_method="auto", max_blocks=256, precision="fp32", optimizer="adam",
        ...     optimizer_states=2, recompute="auto", gpus_per_node=8, bucket_cap_mb=25.0, time_limit=1.0)
        >>> o.schedule_variants(4, 12)
        [('gpipe', 1), ('1f1b', 1), ('interleaved-1f1b', 2), ('zb-h1', 1), ('zbv', 2)]
        >>> o.schedule_variants(2, 12), o.schedule_variants(1, 12)[-1]
        ([('gpipe', 1), ('1f1b', 1), ('interleaved-1f1b', 2), ('interleaved-1f1b', 4), ('zb-h1', 1), ('zbv', 2)], ('1f1b', 1))
        """
        fixed = len(self.schedules) == 1
        out: list[tuple[ScheduleKind, int]] = []
        for kind in self.schedules:
            if pp == 1 and not fixed and (schedule_chunks(kind) > 1 or splits_backward(kind)):
                continue
            if kind == "interleaved-1f1b":
                choices = (self.chunks,) if self.chunks is not None else CHUNK_CHOICES
                fitting = [v for v in choices if pp * v <= blocks]
                out += [(kind, v) for v in (fitting or [choices[0]])]  # none fits: the search says why
            else:
                out.append((kind, schedule_chunks(kind)))
        return out

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
        if self.costed_size is not None:
            return self.batch // self.costed_size
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
    chunks: int | None = None,
    shard: str = AUTO,
    shard_span: str = AUTO,
    fp8_recipe: str = DEFAULT_FP8_RECIPE,
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
    kinds = _check_chunks(kinds, chunks, fixed=schedule != AUTO)
    if recompute == "full" and any(splits_backward(k) for k in kinds):
        if schedule != AUTO:
            raise AutopartitionError(
                f"--schedule {schedule} splits each backward into B and a later W, which needs the stage's "
                "activations after B, so it does not recompute them; use --recompute auto or none with it, "
                "or a schedule that recomputes (gpipe, 1f1b, interleaved-1f1b)."
            )
        kinds = tuple(k for k in kinds if not splits_backward(k))  # --recompute full: they cannot take part
    kinds = _check_shard(kinds, shard, fixed=schedule != AUTO)
    if "interleaved-1f1b" in kinds and micro is not None and pp is not None and micro % pp:
        per_replica = batch // (dp or gpus // pp)
        works = [m for m in range(pp, per_replica + 1, pp) if per_replica % m == 0]
        which = (f"micro-batch counts that split the {per_replica} samples per replica and work: "
                 f"{', '.join(map(str, works[:8]))}" if works else
                 f"no micro-batch count splits the {per_replica} samples per replica into a multiple of {pp}")
        if schedule != AUTO:
            raise AutopartitionError(
                f"--schedule interleaved-1f1b runs micro-batches in rounds of one per pipeline rank, so with "
                f"--pp {pp} it needs a multiple of {pp} micro-batches, not {micro}; {which} "
                "(or --microbatches auto)."
            )
    if resolved.get("zero3_unit", "layer") not in ZERO3_UNITS:
        raise AutopartitionError(f"zero3_unit is {resolved['zero3_unit']!r}; choose one of {', '.join(ZERO3_UNITS)}.")
    if shard_span != AUTO and shard_span not in SHARD_SPANS:
        raise AutopartitionError(
            f"Unknown --shard-span {shard_span!r}; choose auto (the planner weighs both), world (a fully sharded "
            "stage group shards over every replica: FSDP FULL_SHARD, ZeRO-3) or node (over the replicas of one "
            "node, the nodes replicating each other: HSDP).")
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
    check_fp8_recipe(fp8_recipe)
    spec = resolved.get("spec")
    if spec is not None and precision == "fp8":
        if resolved.get("measure"):
            raise AutopartitionError(
                f"--precision fp8 is priced from a device's FP8 peak, but costs measured on {spec.name} are taken "
                "as profiled (in the model's dtype, no FP8 kernels run): plan for a named GPU with FP8 tensor cores "
                f"({', '.join(_fp8_devices(fp8_recipe))}), e.g. --device h100.")
        # --precision fp8 on a device without FP8 tensor cores (A100, a device file without the peak)
        check_fp8(precision, fp8_recipe, device=spec.name, peak_flops=spec.peak_flops,
                  supported=_fp8_devices(fp8_recipe))
    return PlanOptions(
        gpus=gpus, batch=batch, microbatches=micro, schedules=kinds, pp=pp, dp=dp, chunks=chunks, fp8_recipe=fp8_recipe,
        precision=check_precision(precision), optimizer=check_optimizer(optimizer),
        optimizer_states=OPTIMIZERS[optimizer] if optimizer_states is None else optimizer_states,
        recompute=next(m for m in RECOMPUTE_MODES if m == recompute),  # narrows str to RecomputeMode
        gpus_per_node=gpus_per_node or default_gpus_per_node(gpus), shard=shard, shard_span=shard_span,
        **resolved,
    )



def _check_shard(kinds: tuple[ScheduleKind, ...], shard: str, *, fixed: bool) -> tuple[ScheduleKind, ...]:
    """The schedules a fixed ``--shard`` mode runs under; an error naming why and what works where none does.

    >>> _check_shard(("gpipe", "1f1b"), "full", fixed=False), _check_shard(SCHEDULES, "auto", fixed=False) == SCHEDULES
    (('gpipe', '1f1b'), True)
    """
    if shard != AUTO and shard not in (*SHARD_MODES, ZERO3):
        raise AutopartitionError(
            f"Unknown --shard {shard!r}; choose auto (the planner picks per stage group), none (every replica "
            "holds its stage whole: DDP), optimizer (optimizer state sharded across the replicas), full "
            "(weights, gradients and optimizer state sharded: FSDP2, kept gathered or resharded as it prices "
            "best) or zero3 (full, resharded after every forward)."
        )
    if shard == AUTO:
        return kinds
    if shard == ZERO3:  # full, resharded: not under a split backward (runtime/parallel/shard.py)
        allowed = tuple(k for k in kinds if not splits_backward(k) and shard_refusal(k, "full") is None)
        if allowed:
            return allowed
        raise AutopartitionError(
            f"--shard zero3 reduces each layer's gradients after its backward, which a schedule splitting the "
            f"backward (B now, W later) cannot do; use --schedule {' or '.join(SCHEDULES[:3])} with it, or "
            "--shard full.")
    allowed = tuple(k for k in kinds if shard_refusal(k, shard) is None)
    if allowed:
        return allowed  # under --schedule auto the refused schedules take no part
    kind = kinds[0]
    works = [k for k in SCHEDULES if shard_refusal(k, shard) is None]
    modes = [m for m in SHARD_MODES if shard_refusal(kind, m) is None]
    where = f"--schedule {kind}" if fixed else "any schedule allowed here"
    raise AutopartitionError(
        f"--shard {shard} cannot run with {where}: {shard_refusal(kind, shard)}. "
        f"--shard {shard} runs with --schedule {' or '.join(works) or '(none yet)'}; "
        f"--schedule {kind} runs with --shard {' or '.join(modes)} (or --shard auto, which keeps to those)."
    )



def _check_chunks(
    kinds: tuple[ScheduleKind, ...], chunks: int | None, *, fixed: bool
) -> tuple[ScheduleKind, ...]:
    """The schedules ``--chunks`` leaves (all, with None), or an error where a fixed schedule cannot take it."""
    if chunks is None:
        return kinds
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise AutopartitionError(f"--chunks must be a whole number of stages per pipeline rank, 1 or more; got {chunks!r}.")
    if fixed:
        kind = kinds[0]
        if kind == "zbv" and chunks != 2:
            raise AutopartitionError(f"--schedule zbv always holds 2 stages per pipeline rank (its V); drop --chunks {chunks}.")
        if kind == "interleaved-1f1b" and chunks < 2:
            raise AutopartitionError(
                "--schedule interleaved-1f1b needs --chunks 2 or more (stages per pipeline rank); "
                "with one stage per rank use --schedule 1f1b."
            )
        if kind not in ("zbv", "interleaved-1f1b") and chunks != 1:
            raise AutopartitionError(
                f"--chunks {chunks} does not apply to --schedule {kind}, which holds one stage per pipeline rank; "
                "--chunks sets the stages per rank of interleaved-1f1b (zbv always has 2)."
            )
        return kinds
    if chunks == 1:  # one stage per rank: the schedules that hold one
        return tuple(k for k in kinds if schedule_chunks(k) == 1)
    return kinds


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
    return device_spec(device if name not in DEVICES else name), False, torch.device("cpu")



def default_memory_limit(device: str, spec: DeviceSpec, local: torch.device) -> float | None:
    if local.type == "cuda":
        return float(torch.cuda.get_device_properties(local).total_memory)
    if device.lower() in ("auto", "cpu"):
        return None  # CPU ranks share host memory; no per-rank limit unless given
    return float(spec.memory_bytes)


def _fp8_devices(recipe: str) -> list[str]:
    """The known devices with the FP8 peak ``recipe`` runs on (for an error naming them)."""
    return sorted(name for name, spec in DEVICES.items() if fp8_peak(spec.peak_flops, recipe) is not None)
