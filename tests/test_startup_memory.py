"""A meta-built model costs each rank its stage's bytes at start-up, not the whole model's.

Four spawned CPU ranks build a Pipeline on a 389 MiB fp32 model built on meta
(``tools/bench_startup.py``'s SkewedLM: big first and last stages, small middle
ones); each reports its peak RSS (``VmHWM``) before and after.  The growth must
track the rank's own stage bytes, and one more process materialising the whole
model must grow by the whole model's bytes (so the measurement can see them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench_startup import MIB, StartupConfig, format_table, measure

pytestmark = pytest.mark.slow  # spawns ranks

OVERHEAD = 80 * MIB  # recapture, process groups, the runner: about 10 MiB measured


def test_each_rank_grows_by_its_stage_not_the_model(tmp_path: Path) -> None:
    result = measure(StartupConfig(vocab=24_000, width=1536, layers=12), work=tmp_path)
    table = format_table(result)
    ranks = result.ranks
    assert sum(r.stage_bytes for r in ranks) == result.model_bytes, table  # every tensor held once
    for r in ranks:
        assert 0.9 * r.stage_bytes <= r.growth_bytes < r.stage_bytes + OVERHEAD, table
        assert r.growth_bytes < result.model_bytes / 2, table
    big = max(ranks, key=lambda r: r.stage_bytes)
    small = min(ranks, key=lambda r: r.stage_bytes)
    assert big.stage_bytes > 2 * small.stage_bytes, table  # the stages really differ
    assert big.growth_bytes - small.growth_bytes > 0.5 * (big.stage_bytes - small.stage_bytes), table
    assert result.whole_growth_bytes >= 0.9 * result.model_bytes, table
