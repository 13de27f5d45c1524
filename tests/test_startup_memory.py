"""A meta-built model costs each rank its stage's bytes at start-up, not the whole model's.

Four spawned CPU ranks build a Pipeline on a 389 MiB fp32 model built on meta
(``tools/bench_startup.py``'s SkewedLM: big first and last stages, small middle
ones); each reports its peak RSS (``VmHWM``) before and after.  The growth must
track the rank's own stage bytes, and one more process materialising the whole
model must grow by the whole model's bytes (so the measurement can see them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

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


def test_a_fully_sharded_rank_never_holds_its_whole_stage(tmp_path: Path) -> None:
    """pp=1 x dp=4, ZeRO-3 (per-layer FSDP2 units): each rank keeps a quarter of the stage, built on meta one
    module at a time, so its peak RSS grows by far less than under DDP, where each rank holds the stage whole.

    Measured alone on this 310 MiB stage: 177 MiB per rank against 641 MiB under DDP.  The absolute growth
    moves with what the forked ranks inherited (254 MiB in one CI run, after other rank-spawning tests), so
    the test compares the two modes, run one after the other from the same server."""
    cfg = StartupConfig(vocab=8000, width=1536, layers=24)  # 315 MiB, its largest module 47 MiB
    sharded = _startup(cfg, tmp_path / "full", shard="full", reshard=True)
    whole_copies = _startup(cfg, tmp_path / "none", shard="none", reshard=False)
    whole = cfg.parameter_bytes()
    for r in sharded:
        assert r["sharded"] and r["stage_bytes"] == whole, r
        assert r["local_bytes"] <= whole / 4 + 4 * 1024, r  # its shard of every parameter
        assert r["growth_bytes"] < whole, (r, whole / MIB)  # never the whole stage
    for r in whole_copies:
        assert not r["sharded"] and r["growth_bytes"] >= 0.9 * whole, (r, whole / MIB)  # the measurement sees it
    worst = max(r["growth_bytes"] for r in sharded)
    least = min(r["growth_bytes"] for r in whole_copies)
    assert worst < least / 2, (worst / MIB, least / MIB)


def _startup(cfg: StartupConfig, work: Path, *, shard: str, reshard: bool) -> list[dict[str, Any]]:
    """Each rank's start-up report (``tests/models/shard_startup.py``) for a pp=1 x dp=4 plan in ``shard`` mode."""
    import json

    from shard_startup import plan_sharded_startup, rank_main

    from runtime.verify import free_port, start_ranks

    work.mkdir()
    plan_sharded_startup(cfg, work / "plan", dp=4, shard=shard, reshard=reshard)
    start_ranks(rank_main, (4, free_port(), str(work / "plan"), dataclasses.asdict(cfg), str(work)), 4)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(4)]
