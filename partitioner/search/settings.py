"""compile()'s options in four groups: the cluster, the parallelism, the numerics, the solver.

:func:`partitioner.compile` takes them as ``cluster=``, ``parallelism=``, ``numerics=`` and
``solver=``, each a frozen dataclass of keyword-only fields whose defaults are compile()'s,
or as the flat keywords it has always taken (``gpus=8, pp=2``).  :func:`settings_of` merges
the two into the four groups compile() reads from: a group given replaces its defaults
whole; a flat keyword that group holds, given beside it, is refused (which value was meant
is not guessed).  A flat keyword counts as given when its value differs from its default:
passing a default explicitly is the same as leaving it out.

The groups hold what the caller asks for, unchecked: :func:`partitioner.search.options.check_options`
checks and resolves them once, as it does the flat keywords.  No torch here.

Example::

    >>> cluster, parallelism, numerics, solver = settings_of(
    ...     {"microbatches": 4}, cluster=Cluster(gpus=8, device="h100"))
    >>> cluster.gpus, parallelism.microbatches, parallelism.pp, numerics.precision, solver.max_blocks
    (8, 4, None, 'fp32', 256)
    >>> settings_of({"pp": 2}, cluster=Cluster(gpus=8), parallelism=Parallelism(dp=4))
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: compile() got pp=2 beside parallelism=, the group that holds pp: ...
    >>> settings_of({"pp": 2})
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: compile() needs the GPU count: gpus=8 or cluster=Cluster(gpus=8, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.cost.experts import DEFAULT_IMBALANCE
from partitioner.cost.precision import DEFAULT_FP8_RECIPE, DEFAULT_OPTIMIZER, DEFAULT_PRECISION
from partitioner.defaults import DEFAULT_BUCKET_CAP_MB, DEFAULT_SCHEDULE
from partitioner.errors import AutopartitionError
from partitioner.schedule.refine import REFINE_SIMULATIONS

if TYPE_CHECKING:  # graph.capture imports torch; calibration is needed for its type only
    from partitioner.cost.calibration import Calibration
    from partitioner.graph.capture import CaptureMethod

__all__ = ["GROUP_OF", "Cluster", "Numerics", "Parallelism", "Solver", "settings_of"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """The GPUs planned for: how many, which, their memory and how they are wired."""

    gpus: int  # pp x dp x tp
    device: str = "auto"  # auto/cpu/cuda measure here; a name (h100, ...) or a device file predicts
    memory_per_gpu: float | None = None  # bytes; None: the device's
    gpus_per_node: int | None = None  # None: the largest divisor of gpus up to 8
    nvlink_domain: int | None = None  # GPUs one NVLink domain joins over hosts of gpus_per_node (GB200 NVL72: 72)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """How the model is laid out: pipeline, data, tensor and expert parallelism, micro-batches, schedule,
    sharding and recomputation (None or "auto": searched)."""

    pp: int | None = None  # pipeline ranks
    dp: int | None = None  # replicas per stage
    tp: int | str = 1  # GPUs per tensor-parallel group, or "auto"
    ep: int | str = "auto"  # expert-parallel degree of a model with experts
    microbatches: int | str = 8  # per mini-batch, or "auto"
    schedule: str = DEFAULT_SCHEDULE  # a name of partitioner.defaults.SCHEDULES, or "auto"
    chunks: int | None = None  # stages per pipeline rank of interleaved-1f1b; None: 2 and 4 tried
    shard: str = "auto"  # none, optimizer, full, zero3 or auto
    shard_span: str = "auto"  # world, node (HSDP) or auto
    zero3_unit: str = "layer"  # what one ZeRO-3 gather holds: layer (FSDP2) or module (DeepSpeed)
    recompute: str = "auto"  # auto, none or full
    expert_imbalance: float = DEFAULT_IMBALANCE  # the busiest expert-parallel member's tokens over the mean


@dataclasses.dataclass(frozen=True, kw_only=True)
class Numerics:
    """What each parameter costs in bytes and each matmul in time: precision, FP8 scaling, optimizer."""

    precision: str = DEFAULT_PRECISION  # fp32, bf16-mixed, bf16, fp8
    fp8_recipe: str = DEFAULT_FP8_RECIPE  # tensorwise, rowwise, mxfp8 (under precision fp8)
    optimizer: str = DEFAULT_OPTIMIZER  # adam, sgd
    optimizer_states: int | None = None  # state tensors per parameter; None: the optimizer's
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB  # gradient all-reduce buckets, MB (DDP's bucket_cap_mb)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Solver:
    """How the planner works: capture, blocks, solver time, refinement and the costs it trusts."""

    capture_method: CaptureMethod = "auto"  # auto, export, symbolic_trace
    max_blocks: int = 256  # the graph is coarsened to at most this many blocks
    time_limit: float = 10.0  # seconds per ILP solve
    refine_simulations: int = REFINE_SIMULATIONS  # simulated steps of local search per candidate (0: none)
    calibration: Calibration | str | Path | None = None  # a calibration or its file (autopartition calibrate)
    remeasure: bool = False  # measure again rather than reuse this process's measured costs
    priced_only: bool = False  # price layouts the runtime does not run too (a prediction, not a plan)


_GROUPS: dict[str, type[Any]] = {
    "cluster": Cluster, "parallelism": Parallelism, "numerics": Numerics, "solver": Solver,
}

# Each flat keyword of compile() -> the group argument that holds it.
GROUP_OF: dict[str, str] = {
    field.name: group for group, cls in _GROUPS.items() for field in dataclasses.fields(cls)
}


def _default(cls: type[Any], name: str) -> Any:
    """A field's default; a required field's (``Cluster.gpus``) is None, as compile()'s flat keyword is."""
    default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    return None if default is dataclasses.MISSING else default


def settings_of(
    flat: Mapping[str, Any],
    *,
    cluster: Cluster | None = None,
    parallelism: Parallelism | None = None,
    numerics: Numerics | None = None,
    solver: Solver | None = None,
) -> tuple[Cluster, Parallelism, Numerics, Solver]:
    """The four groups from compile()'s flat keywords ``flat`` (defaults may be included) and the groups given.

    A group given is taken whole; one not given is built from ``flat``.  A flat keyword whose
    value is not its default, beside the group that holds it, is an :class:`AutopartitionError`,
    and so is a missing GPU count.
    """
    unknown = sorted(set(flat) - set(GROUP_OF))
    if unknown:
        raise TypeError(f"settings_of: {', '.join(unknown)} belong to no group of partitioner.search.settings")
    given = {"cluster": cluster, "parallelism": parallelism, "numerics": numerics, "solver": solver}
    built: dict[str, Any] = {}
    for group, cls in _GROUPS.items():
        value = given[group]
        mine = {k: v for k, v in flat.items() if GROUP_OF[k] == group and v != _default(cls, k)}
        if value is None:
            if group == "cluster" and "gpus" not in mine:
                raise AutopartitionError(
                    "compile() needs the GPU count: gpus=8 or cluster=Cluster(gpus=8, ...).")
            built[group] = cls(**mine)
            continue
        if not isinstance(value, cls):
            raise AutopartitionError(f"compile()'s {group}= takes a {cls.__name__} (partitioner.{cls.__name__}), "
                                     f"got {type(value).__name__}.")
        if mine:
            both = ", ".join(f"{k}={v!r}" for k, v in mine.items())
            raise AutopartitionError(
                f"compile() got {both} beside {group}=, the group that holds {', '.join(mine)}: which value is "
                f"meant is not guessed. Set {'it' if len(mine) == 1 else 'them'} in the group "
                f"({group}={cls.__name__}(..., {both})) or pass every {cls.__name__} option flat and no {group}=.")
        built[group] = value
    return built["cluster"], built["parallelism"], built["numerics"], built["solver"]
