"""Start-up memory of fully sharded ranks (tests/test_startup_memory.py): a meta-built stage straight into shards.

``plan_sharded_startup`` plans ``tools/bench_startup.py``'s SkewedLM for one pipeline
rank of ``dp`` replicas and gives its stage ``shard`` (``full``; ``reshard``: ZeRO-3,
one FSDP2 unit per layer).  ``rank_main`` builds the model on meta, reads its peak RSS
(``VmHWM``), builds its :class:`runtime.Pipeline` (recapture on meta, every module
initialised whole one at a time, only this replica's shard kept) and reads the peak
again; it writes the growth, the bytes it holds (local shards) and the stage's whole
bytes into ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from tools.bench_startup import StartupConfig, peak_rss_bytes

__all__ = ["plan_sharded_startup", "rank_main"]


def plan_sharded_startup(cfg: StartupConfig, directory: Path, *, dp: int, shard: str, reshard: bool) -> None:
    from partitioner.search.planner import compile

    plan = compile(cfg.build(), cfg.example_inputs(), gpus=dp, pp=1, dp=dp, microbatches=cfg.microbatches,
                   schedule="1f1b", device="h100", shard="none")
    plan = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, shard=shard, reshard_after_forward=reshard and shard == "full") for s in plan.stages))
    plan.save(directory)


def rank_main(rank: int, world: int, port: int, plan_dir: str, config: dict[str, Any], out: str) -> None:
    from torch.distributed.tensor import DTensor

    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = StartupConfig(**config)
    plan = Plan.load(plan_dir)
    model = cfg.build()
    before = peak_rss_bytes()
    pipe = Pipeline(plan, model, device=torch.device("cpu"), timeout=120.0)
    after = peak_rss_bytes()
    params = {id(p): p for p in pipe.parameters()}.values()
    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)
    report = {"rank": rank, "growth_bytes": after - before, "local_bytes": local,
              "stage_bytes": sum(p.numel() * p.element_size() for p in params),
              "sharded": all(isinstance(p, DTensor) for p in params)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
