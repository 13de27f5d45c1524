"""Set the H100 roofline's efficiency from published bf16 training runs, and check it.

Commands (from the repository root)::

    .venv/bin/python tools/calibrate_published.py            # price every run with devices.py's efficiencies
    .venv/bin/python tools/calibrate_published.py --fit      # also fit the compute efficiency (a few minutes)
    .venv/bin/python tools/calibrate_published.py --only 8b-8 --efficiency 0.7

Each published run (:data:`RUNS`: bf16 on H100 SXM, its layout fixed as published) is
priced by our own cost model (:func:`partitioner.search.price.price_layout`: the
split solved for the layout, simulated as any plan), and its predicted tokens/s per
GPU is set beside the published figure.  ``--fit`` searches the one efficiency
that scales the roofline's FLOP peak for matmuls and attention alike
(``DeviceSpec.efficiency``; memory-bound ops keep the datasheet bandwidth) so that
the worst |predicted / published - 1| is smallest, then prints the table at that
value: copy it into ``partitioner/cost/devices.py`` (``H100_EFFICIENCY``).

Only bf16 runs: Megatron-Bridge publishes H100 throughput with FP8 only, and FP8 is
not in our cost model; those are priced by ``tools/bench_large.py --published``
for the layout comparison, not used here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["RUNS", "PublishedRun", "main", "relative_error"]


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published bf16 H100 run: model, GPUs, batch, layout and its measured throughput."""

    name: str
    spec: str  # model file: the factory builds the shape on meta
    gpus: int
    batch: int  # sequences per step
    seq: int
    layout: dict[str, Any]  # partitioner.search.price.Layout keywords
    tokens_per_s_per_gpu: float | None  # as published (None: derived from TFLOP/s)
    tflops_per_gpu: float | None = None  # as published, where throughput is given in model TFLOP/s
    source: str = ""
    note: str = ""


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "8b-8-torchtitan", "examples/llama.py:llama3_8b", 8, 16, 8192,
        {"name": "FSDP8", "tp": 1, "pp": 1, "dp": 8, "microbatches": 1, "schedule": "1f1b", "shard": "full",
         "recompute": "none"},
        5762.0, source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP, bf16, no compile)",
        note="selective activation checkpointing priced as none"),
    PublishedRun(
        "70b-256-torchtitan", "examples/llama.py:llama3_70b", 256, 512, 8192,
        {"name": "TP8 x FSDP32", "tp": 8, "pp": 1, "dp": 32, "microbatches": 1, "schedule": "1f1b", "shard": "full",
         "recompute": "full"},
        597.3, source="torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (bf16, vanilla TP, compile, "
                      "full AC, local batch 16)"),
    PublishedRun(
        "405b-8k-llama3", "examples/llama.py:llama3_405b", 8192, 2048, 8192,
        {"name": "TP8 x PP16 x FSDP64", "tp": 8, "pp": 16, "dp": 64, "microbatches": 32,
         "schedule": "interleaved-1f1b", "chunks": 2, "shard": "full", "recompute": "auto"},
        None, tflops_per_gpu=430.0,
        source="Llama 3 paper (arXiv:2407.21783) Table 4, 8,192 GPUs: 430 TFLOP/s per GPU, 43% MFU (bf16)",
        note="the paper's schedule is its own interleaved variant; priced as interleaved 1F1B, 2 stages per rank"),
)


def relative_error(predicted: float, published: float) -> float:
    """``predicted / published - 1``.

    >>> round(relative_error(115.0, 100.0), 3)
    0.15
    """
    return predicted / published - 1.0


def _with_efficiency(efficiency: float | None) -> None:
    """Make ``h100`` (and ``h200``, the same compute) price FLOPs at ``efficiency`` of the peak, in this process."""
    from partitioner.cost import devices

    if efficiency is None:
        return
    for name in ("h100", "h200"):
        spec = devices.DEVICES[name]
        kept = tuple((k, v) for k, v in spec.efficiency if k not in ("matmul", "attention"))
        devices.DEVICES[name] = dataclasses.replace(
            spec, efficiency=kept + (("matmul", efficiency), ("attention", efficiency)))


def _price(run: PublishedRun, models: dict[str, Any]) -> dict[str, Any]:
    import torch

    from partitioner.modelfile import load_model_file
    from partitioner.search.price import Layout, price_layout

    if run.spec not in models:
        models[run.spec] = load_model_file(str(ROOT / run.spec)).build()
    inputs = (torch.zeros(run.batch, run.seq, dtype=torch.long),)
    start = time.perf_counter()
    priced = price_layout(models[run.spec], inputs, Layout(gpus=run.gpus, **run.layout), tokens_per_sample=run.seq,
                          device="h100", precision="bf16-mixed", optimizer="adam", gpus_per_node=min(8, run.gpus))
    plan = priced.plan
    tflops = (plan.predicted.mfu or 0.0) * plan.cost_model.peak_flops / 1e12 if plan.cost_model.peak_flops else None
    if run.tokens_per_s_per_gpu is not None:
        predicted, published = priced.tokens_per_s_per_gpu, run.tokens_per_s_per_gpu
    else:  # compared as model TFLOP/s per GPU, each by its own FLOP count
        predicted, published = tflops or 0.0, run.tflops_per_gpu or 0.0
    return {"run": run.name, "layout": run.layout["name"], "predicted": predicted, "published": published,
            "unit": "tokens/s/GPU" if run.tokens_per_s_per_gpu is not None else "TFLOP/s/GPU",
            "error": relative_error(predicted, published), "fits": priced.fits, "step_s": priced.step_s,
            "mfu": plan.predicted.mfu, "wall_s": time.perf_counter() - start}


def _price_all(runs: list[PublishedRun], efficiency: float | None, models: dict[str, Any]) -> list[dict[str, Any]]:
    _with_efficiency(efficiency)
    rows = []
    for run in runs:
        rows.append(_price(run, models))
        print(f"  [{efficiency if efficiency is not None else 'devices.py'}] {run.name}: "
              f"{rows[-1]['predicted']:.1f} vs {rows[-1]['published']:.1f} {rows[-1]['unit']} "
              f"({rows[-1]['error']:+.1%}, {rows[-1]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return rows


def _worst(rows: list[dict[str, Any]]) -> float:
    return max(abs(math.log(1.0 + r["error"])) for r in rows)


def _fit(runs: list[PublishedRun], models: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
    """The efficiency that minimises the worst log ratio: a few secant steps on the mean log ratio, then refined."""
    efficiency, rows = 1.0, _price_all(runs, 1.0, models)
    for _ in range(3):  # throughput is close to proportional to the efficiency: mean log ratio to zero
        mean_log = sum(math.log(1.0 + r["error"]) for r in rows) / len(rows)
        if abs(mean_log) < 0.01:
            break
        efficiency = min(1.0, efficiency * math.exp(-mean_log))
        rows = _price_all(runs, efficiency, models)
    return round(efficiency, 3), rows


def _print(rows: list[dict[str, Any]], runs: list[PublishedRun], efficiency: float | None) -> None:
    label = f"efficiency {efficiency}" if efficiency is not None else "efficiency as in partitioner/cost/devices.py"
    print(f"\nPublished bf16 H100 runs priced by our cost model ({label}):\n")
    print("| run | layout | published | predicted | error | fits | source |")
    print("|---|---|---|---|---|---|---|")
    by_name = {r.name: r for r in runs}
    for row in rows:
        run = by_name[row["run"]]
        print(f"| {row['run']} | {row['layout']} | {row['published']:,.0f} {row['unit']} | "
              f"{row['predicted']:,.0f} | {row['error']:+.1%} | {'yes' if row['fits'] else 'no'} | {run.source}"
              f"{'; ' + run.note if run.note else ''} |")
    print(f"\nworst |error|: {max(abs(r['error']) for r in rows):.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="fit the compute efficiency to the runs")
    parser.add_argument("--efficiency", type=float, default=None, help="price at this compute efficiency")
    parser.add_argument("--only", default="", help="comma-separated run names (prefixes)")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not args.only or any(r.name.startswith(o) for o in args.only.split(","))]
    if not runs:
        parser.error(f"--only {args.only!r} names no run; runs: {', '.join(r.name for r in RUNS)}")
    models: dict[str, Any] = {}
    if args.fit:
        efficiency, rows = _fit(runs, models)
        _print(rows, runs, efficiency)
        return 0 if _worst(rows) <= math.log(1.15) else 1
    rows = _price_all(runs, args.efficiency, models)
    _print(rows, runs, args.efficiency)
    return 0 if max(abs(r["error"]) for r in rows) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
