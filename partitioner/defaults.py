"""Names and defaults the planner, the solver, the command line and the runtime share.

One place, importable without torch, so that a schedule added or a default
changed here reaches ``autopartition --schedule``, :func:`partitioner.compile`,
the solver and the schedule builder at once.

Example::

    >>> SCHEDULES, DEFAULT_SCHEDULE, DEFAULT_BUCKET_CAP_MB
    (('gpipe', '1f1b'), 'gpipe', 25.0)
"""

from __future__ import annotations

import typing
from typing import Literal

__all__ = ["DEFAULT_BUCKET_CAP_MB", "DEFAULT_SCHEDULE", "SCHEDULES", "ScheduleKind"]

ScheduleKind = Literal["gpipe", "1f1b"]

# Every pipeline schedule, in the order the command line lists them.
SCHEDULES: tuple[ScheduleKind, ...] = typing.get_args(ScheduleKind)

DEFAULT_SCHEDULE: ScheduleKind = "gpipe"

# MiB of gradients per DDP all-reduce bucket: DDP's own default
# (torch.nn.parallel.DistributedDataParallel, ``bucket_cap_mb``).
DEFAULT_BUCKET_CAP_MB = 25.0
