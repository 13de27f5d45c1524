"""Published training runs (kept for its importers): the data is :mod:`tools.published`, one module per source.

>>> run_named("8b-8-torchtitan").gpus
8
"""

from __future__ import annotations

from tools.published import CALIBRATION_RUNS, RUNS, PublishedRun, run_named

__all__ = ["CALIBRATION_RUNS", "RUNS", "PublishedRun", "run_named"]
