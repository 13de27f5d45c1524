"""Plans for interleaved and zero-bubble schedules, for the runtime's tests.

:func:`plan_schedule` asks the planner (``partitioner.compile`` with the
schedule and ``chunks``) with predicted h100 costs, so the split is the same on
every run, and saves the plan (loading it back runs the plan format's checks).
"""

from __future__ import annotations

from pathlib import Path

import torch

from partitioner.defaults import DEFAULT_BUCKET_CAP_MB
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile

__all__ = ["plan_schedule"]


def plan_schedule(
    spec: str, directory: Path, *, ranks: int, dp: int = 1, chunks: int | None = None, microbatches: int,
    schedule: str, batch: int = 16, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> Plan:
    """Plan model file ``spec`` for ``ranks x dp`` GPUs under ``schedule``; saved into and loaded from ``directory``.

    ``chunks``: stages per pipeline rank (None: the schedule's default).
    """
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    plan = compile(
        model_file.build(), model_file.example_inputs(batch), gpus=ranks * dp, pp=ranks, dp=dp,
        microbatches=microbatches, schedule=schedule, chunks=chunks, device="h100", bucket_cap_mb=bucket_cap_mb,
    )
    assert (plan.pp, plan.dp, plan.microbatches, plan.schedule) == (ranks, dp, microbatches, schedule)
    assert chunks is None or plan.chunks == chunks
    plan.save(directory)
    return Plan.load(directory)
