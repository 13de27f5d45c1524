"""Start-up memory of a meta-built model: each rank's peak RSS against the whole model in one process.

Commands (from the repository root)::

    .venv/bin/python tools/bench_startup.py                     # 1.2 GB fp32 model on 4 CPU ranks
    .venv/bin/python tools/bench_startup.py --vocab 24000 --width 1536 --layers 12   # 0.4 GB (the test's)
    .venv/bin/python tools/bench_startup.py --json startup.json

The model (:class:`SkewedLM`) is an embedding (``vocab x width``), ``layers``
residual linear layers (``width x width``) and an LM head (``width x vocab``), built
on the meta device: the embedding and the head hold most of the weights, so the
first and last stages are much bigger than the middle ones.  It is planned for
``ranks`` pipeline stages (``device="h100"``: the split is the same on every run),
then

* every rank (a spawned CPU process, gloo) builds the model on meta, reads its peak
  RSS (``VmHWM``), builds its :class:`runtime.Pipeline` (recapture on meta, its
  stage's nodes, only its stage's tensors materialised) and reads the peak again;
* one more process builds the model on meta and materialises all of it
  (:func:`runtime.state.materialise.materialise_model`): what a rank holding the whole
  model (a model built with real weights) costs.

It prints, per rank, the stage's parameter and buffer bytes and the growth of the
peak RSS over building the Pipeline.

Example::

    >>> cfg = StartupConfig(vocab=1000, width=64, layers=2)
    >>> cfg.parameter_bytes()
    545792
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch import nn

__all__ = ["RankMemory", "SkewedLM", "StartupConfig", "StartupResult", "format_table", "main", "measure"]

MIB = 1024**2


class SkewedLM(nn.Module):
    """Embedding, residual linear layers, LM head: the first and last stages hold most of the bytes."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # (B, T, W)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))  # (B, T, W)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


@dataclasses.dataclass(frozen=True)
class StartupConfig:
    vocab: int = 64_000
    width: int = 2048
    layers: int = 8
    ranks: int = 4
    seq: int = 16
    batch: int = 8
    microbatches: int = 2

    def build(self) -> SkewedLM:
        """The model on the meta device."""
        with torch.device("meta"):
            return SkewedLM(self.vocab, self.width, self.layers)

    def parameter_bytes(self) -> int:
        return sum(p.nbytes for p in self.build().parameters())

    def example_inputs(self) -> tuple[torch.Tensor]:
        return (torch.zeros(self.batch, self.seq, dtype=torch.long),)


@dataclasses.dataclass(frozen=True)
class RankMemory:
    rank: int
    stages: tuple[int, ...]
    stage_bytes: int  # parameters and buffers the rank holds after building its Pipeline
    growth_bytes: int  # peak RSS after the Pipeline minus peak RSS before it
    peak_bytes: int  # peak RSS of the process


@dataclasses.dataclass(frozen=True)
class StartupResult:
    config: StartupConfig
    model_bytes: int
    ranks: tuple[RankMemory, ...]
    whole_growth_bytes: int  # materialising the whole model in one process
    whole_peak_bytes: int
    seconds: float


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _plan(cfg: StartupConfig, directory: Path) -> None:
    from partitioner.search.planner import compile

    plan = compile(cfg.build(), cfg.example_inputs(), gpus=cfg.ranks, pp=cfg.ranks, dp=1,
                   microbatches=cfg.microbatches, schedule="gpipe", device="h100")
    plan.save(directory)


def _rank_main(rank: int, world: int, port: int, plan_dir: str, config: dict[str, Any], out: str) -> None:
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
    held = {id(t): t for m in pipe.modules for t in (*m.parameters(), *m.buffers())}
    assert not any(t.is_meta for t in held.values())
    report = {"rank": rank, "stages": list(pipe.stages), "stage_bytes": sum(t.nbytes for t in held.values()),
              "growth_bytes": after - before, "peak_bytes": after}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _whole_main(_: int, config: dict[str, Any], out: str) -> None:
    from runtime.state.materialise import materialise_model

    model = StartupConfig(**config).build()
    before = peak_rss_bytes()
    materialise_model(model, seed=0)
    after = peak_rss_bytes()
    Path(out, "whole.json").write_text(json.dumps({"growth_bytes": after - before, "peak_bytes": after}))


def measure(cfg: StartupConfig, *, work: Path | None = None) -> StartupResult:
    """Plan ``cfg``'s model, start its ranks and one whole-model process; their peak memory."""
    from runtime.verify import free_port, start_ranks

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        base = work or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        _plan(cfg, base / "plan")
        config = dataclasses.asdict(cfg)
        start_ranks(_rank_main, (cfg.ranks, free_port(), str(base / "plan"), config, str(base)), cfg.ranks)
        start_ranks(_whole_main, (config, str(base)), 1)
        rows = [json.loads((base / f"rank{r}.json").read_text()) for r in range(cfg.ranks)]
        whole = json.loads((base / "whole.json").read_text())
    return StartupResult(
        config=cfg, model_bytes=cfg.parameter_bytes(),
        ranks=tuple(RankMemory(r["rank"], tuple(r["stages"]), r["stage_bytes"], r["growth_bytes"],
                               r["peak_bytes"]) for r in rows),
        whole_growth_bytes=whole["growth_bytes"], whole_peak_bytes=whole["peak_bytes"],
        seconds=time.perf_counter() - start,
    )


def format_table(result: StartupResult) -> str:
    """One line per rank, then the whole model in one process (MiB)."""
    lines = [f"{'':<22}{'stage MiB':>10}{'peak RSS growth MiB':>21}{'peak RSS MiB':>14}"]
    for r in result.ranks:
        label = f"rank {r.rank} (stage {', '.join(map(str, r.stages))})"
        lines.append(f"{label:<22}{r.stage_bytes / MIB:>10.0f}{r.growth_bytes / MIB:>21.0f}{r.peak_bytes / MIB:>14.0f}")
    lines.append(f"{'whole model, 1 process':<22}{result.model_bytes / MIB:>10.0f}"
                 f"{result.whole_growth_bytes / MIB:>21.0f}{result.whole_peak_bytes / MIB:>14.0f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = StartupConfig()
    for name in ("vocab", "width", "layers", "ranks"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    cfg = StartupConfig(vocab=args.vocab, width=args.width, layers=args.layers, ranks=args.ranks)
    print(f"SkewedLM: vocab {cfg.vocab}, width {cfg.width}, {cfg.layers} layers: "
          f"{cfg.parameter_bytes() / MIB:.0f} MiB fp32 on meta; {cfg.ranks} CPU ranks; torch {torch.__version__}")
    result = measure(cfg)
    print(format_table(result))
    print(f"({result.seconds:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
