"""Names and defaults the planner, the solver, the command line and the runtime share.

One place, importable without torch, so that a schedule added or a default
changed here reaches ``autopartition --schedule``, :func:`partitioner.compile`,
the solver and the schedule builder at once.

Schedules and what they need (:func:`schedule_chunks`, :func:`splits_backward`):
``gpipe`` and ``1f1b`` hold one stage per pipeline rank; ``interleaved-1f1b``
holds ``chunks >= 2`` stages per rank (stage s on rank s mod ranks);
``zb-h1`` holds one stage per rank and splits each backward into B (input
gradient) and W (weight gradient); ``zbv`` holds two stages per rank in a V
and splits the backward too.

Example::

    >>> SCHEDULES, DEFAULT_SCHEDULE, DEFAULT_BUCKET_CAP_MB
    (('gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1', 'zbv'), 'gpipe', 25.0)
    >>> [schedule_chunks(k) for k in SCHEDULES], [k for k in SCHEDULES if splits_backward(k)]
    ([1, 1, 2, 1, 2], ['zb-h1', 'zbv'])
"""

from __future__ import annotations

import typing
from typing import Literal

from partitioner.errors import ScheduleError

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_SCHEDULE",
    "MAX_ACTION_JITTER",
    "SCHEDULES",
    "SHARD_MODES",
    "SHARD_SPANS",
    "SPLIT_BACKWARD_SCHEDULES",
    "ScheduleKind",
    "ShardMode",
    "ShardSpan",
    "layout_refusal",
    "schedule_chunks",
    "shard_refusal",
    "splits_backward",
]

ScheduleKind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"]
ShardMode = Literal["none", "optimizer", "full"]
ShardSpan = Literal["world", "node"]

# Every pipeline schedule, in the order the command line lists them.
SCHEDULES: tuple[ScheduleKind, ...] = typing.get_args(ScheduleKind)

DEFAULT_SCHEDULE: ScheduleKind = "gpipe"

# Schedules whose backward is two actions: B (input gradient) then W (weight gradient).
SPLIT_BACKWARD_SCHEDULES: tuple[ScheduleKind, ...] = ("zb-h1", "zbv")

# MiB of gradients per DDP all-reduce bucket: DDP's own default
# (torch.nn.parallel.DistributedDataParallel, ``bucket_cap_mb``).
DEFAULT_BUCKET_CAP_MB = 25.0

# How a stage group's replicas hold their state (ZeRO, Rajbhandari et al., SC 2020, section 5): "none" whole on
# every replica (DDP); "optimizer" optimizer state sharded across the group; "full" parameters, gradients and
# optimizer state sharded (FSDP2 ``fully_shard``).  The plan records one per stage (``StagePlan.shard``).
SHARD_MODES: tuple[ShardMode, ...] = typing.get_args(ShardMode)

# Over which replicas a "full" stage group shards its state (``StagePlan.shard_span``): "world", every replica of
# the group (FSDP's FULL_SHARD, DeepSpeed's ZeRO-3); "node", the replicas on one node, the nodes replicas of each
# other (HSDP: FSDP's HYBRID_SHARD, torchtitan's dp_replicate x dp_shard).  The same where the group fits a node.
SHARD_SPANS: tuple[ShardSpan, ...] = typing.get_args(ShardSpan)

# (schedule, shard mode) pairs the runtime cannot run yet, with the reason the planner gives when refusing them.
# The runtime's tests prove every pair not listed here (tests/test_shard_runtime.py: every schedule with
# "optimizer" and "full", pp=2 x dp=2, against the whole model); the planner never plans a listed one.
_SHARD_UNSUPPORTED: dict[tuple[str, str], str] = {}


# Largest spread of one action about its stage's median, as the std of log(seconds / median): e^1 either
# way.  Beyond it a trace is not of a steady run (calibration files and plan.json are checked against it).
MAX_ACTION_JITTER = 1.0


def splits_backward(kind: str) -> bool:
    """Does schedule ``kind`` run each backward as B (input gradient) and a later W (weight gradient)?

    >>> splits_backward("zbv"), splits_backward("1f1b")
    (True, False)
    """
    return kind in SPLIT_BACKWARD_SCHEDULES


def schedule_chunks(kind: str, chunks: int | None = None) -> int:
    """The stages per pipeline rank schedule ``kind`` runs with: ``chunks`` checked, or its default.

    ``zbv`` needs exactly 2, ``interleaved-1f1b`` at least 2 (default 2), the
    others exactly 1.

    >>> schedule_chunks("interleaved-1f1b"), schedule_chunks("interleaved-1f1b", 4), schedule_chunks("gpipe", 1)
    (2, 4, 1)
    >>> schedule_chunks("zbv", 3)
    Traceback (most recent call last):
    ...
    partitioner.errors.ScheduleError: Schedule 'zbv' runs exactly 2 stages per pipeline rank (its V), not chunks=3.
    """
    if kind not in SCHEDULES:
        raise ScheduleError(f"Unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}.")
    if kind == "interleaved-1f1b":
        if chunks is None:
            return 2
        if chunks < 2:
            raise ScheduleError(
                f"Schedule 'interleaved-1f1b' needs at least 2 stages per pipeline rank, not chunks={chunks}; "
                "use chunks=2 or more, or schedule '1f1b' for one stage per rank."
            )
        return chunks
    need = 2 if kind == "zbv" else 1
    if chunks is not None and chunks != need:
        why = " (its V)" if kind == "zbv" else ""
        plural = "stages" if need > 1 else "stage"
        raise ScheduleError(
            f"Schedule {kind!r} runs exactly {need} {plural} per pipeline rank{why}, not chunks={chunks}."
        )
    return need


# What the runtime does not run, by combination of degrees and modes, with the reason: the one table every
# refusal reads (the search leaves such a combination out, compile refuses it when the user fixes it, and
# verify/run refuse a plan holding it before any rank starts); each caller adds what to do instead.
# A row: (applies to (tp, dp, shard, engine), reason with {tp}).
_LAYOUT_UNSUPPORTED: tuple[tuple[typing.Callable[[int, int, str, str], bool], str], ...] = (
    (lambda tp, dp, shard, engine: tp > 1 and dp > 1 and shard == "optimizer",
     ("tp {tp} with optimizer-sharded (ZeRO-1) replicas: the runtime runs tensor parallelism with replicated or "
     "fully sharded (FSDP2) stage groups")),
    (lambda tp, dp, shard, engine: tp > 1 and engine == "torch",
     "tp {tp} under torch.distributed.pipelining's engine (--engine torch), which runs tp = 1 plans only"),
)


def layout_refusal(*, tp: int = 1, dp: int = 1, shard: str = "none", engine: str = "ours") -> str | None:
    """Why the runtime cannot run ``tp``-way tensor parallelism over ``dp`` replicas sharded as ``shard`` on
    ``engine`` (None: it can).

    >>> layout_refusal(tp=2, dp=4, shard="optimizer")
    'tp 2 with optimizer-sharded (ZeRO-1) replicas: the runtime runs tensor parallelism with replicated or fully sharded (FSDP2) stage groups'
    >>> layout_refusal(tp=2, dp=4, shard="full") is None, layout_refusal(tp=1, dp=4, shard="optimizer") is None
    (True, True)
    """
    return next((why.format(tp=tp) for applies, why in _LAYOUT_UNSUPPORTED if applies(tp, dp, shard, engine)), None)


def shard_refusal(kind: str, mode: str) -> str | None:
    """Why schedule ``kind`` cannot run stage groups sharded as ``mode`` (None: it can).

    >>> shard_refusal("1f1b", "full") is None, shard_refusal("gpipe", "none") is None
    (True, True)
    """
    if mode not in SHARD_MODES:
        raise ScheduleError(f"Unknown shard mode {mode!r}; choose one of {', '.join(SHARD_MODES)}.")
    return _SHARD_UNSUPPORTED.get((kind, mode))
