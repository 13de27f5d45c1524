"""Set the Hopper roofline's efficiencies from published bf16 training runs, and check them.

Commands (from the repository root)::

    .venv/bin/python tools/calibrate_published.py             # price every bf16 run with devices.py's values
    .venv/bin/python tools/calibrate_published.py --fit       # fit them to the "fit" runs (~15 min)
    .venv/bin/python tools/calibrate_published.py --only 8b-8 --set matmul=0.7,peak500=0.9

Each published bf16 Hopper run of issue 23's set (``tools/published``'s ``CALIBRATION_RUNS``;
``tools/validate_published.py`` prices every run and fits every generation): layout as published, on the
machine it ran on) is priced by our own cost model
(:func:`partitioner.search.price.price_layout`: the split solved for the layout and
simulated as any plan), and its predicted throughput set beside the published one.

What is modelled rather than fitted:

* the machine: torchtitan's H100s are ``h100-500w`` (96 GB HBM2e at 2.4 TB/s, 500 W),
  Meta's Llama 3 cluster the 700 W, 3.35 TB/s ``h100`` (``partitioner/cost/devices.py``);
* the sharding: a run whose published layout our memory model says does not fit
  (``unlimited``: Llama 3 405B, parameters kept gathered through the step) is priced
  without the limit, as published, rather than as the ZeRO-3 plan the limit forces;
  the table's "fits" column is our memory model's verdict either way;
* the recomputation each run did: full AC as ``recompute="full"``; torchtitan's per-op
  selective AC (saves every other matmul's output and attention's, recomputes the rest:
  ``torchtitan/distributed/activation_checkpoint.py``) as full recomputation less the
  share of its recomputed forward that SAC keeps (:data:`SAC_SHARE`; one pipeline
  stage).  Priced with full recomputation, the layout fits as torchtitan's did (FSDP2's
  ZeRO-3, resharded after forward); without any, our memory model says it does not.

What is fitted (``--fit``, on the runs whose role is ``fit``; the ``held-out`` runs are
priced at the result and reported, never fitted): :data:`FITTED` (the matmul
efficiency and the 500 W part's peak, bounded by the published range), the least
worst |log ratio| of the model linearised by finite differences, then priced again.
The attention efficiency is not fitted: it is :data:`ATTENTION_EFFICIENCY`, from
FlashAttention's published utilisation; the memory-bound efficiency stays at 1.0.  Copy the printed values into
``partitioner/cost/devices.py`` (``H100_EFFICIENCY``, ``H100_500W_PEAK_SHARE``).

Model TFLOP/s (the Llama 3 paper's unit) are compared each by its own FLOP count.
FP8 runs (Megatron-Bridge, torchtitan's Float8) are not priced here (bf16 only):
``tools/validate_published.py`` prices them at ``--precision fp8``.
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

from tools.published_runs import CALIBRATION_RUNS, RUNS, PublishedRun

__all__ = ["ATTENTION_EFFICIENCY", "BOUNDS", "FITTED", "SAC_SHARE", "current_parameters", "main", "relative_error",
           "with_parameters"]

# FlashAttention-2 (PyTorch's flash SDPA) reaches about 35% of the H100's BF16 peak on causal attention
# (Shah et al., "FlashAttention-3", arXiv:2407.08608, abstract and Figure 5), counting the causal half's
# FLOPs; torch.utils.flop_counter (our count) counts the whole square, so twice that share of ours.
ATTENTION_EFFICIENCY = 0.70
# Per-op SAC recomputes every other matmul and the elementwise ops, not attention: about half of the
# forward that full recomputation runs again.
SAC_SHARE = 0.5
# Fitted: the matmul efficiency (most of every step) and the 500 W part's peak.  Not fitted: attention
# (above) and the memory-bound ops' share of the bandwidth, which these runs cannot tell apart from the
# matmuls' (d log predicted / d log efficiency 0.07 to 0.14 against 0.67 to 0.78): left at the datasheet.
FITTED = ("matmul", "peak500")
BOUNDS: dict[str, tuple[float, float]] = {"matmul": (0.3, 1.0), "peak500": (835.0 / 989.0, 1.0)}  # NVL .. SXM


def relative_error(predicted: float, published: float) -> float:
    """``predicted / published - 1``.

    >>> round(relative_error(115.0, 100.0), 3)
    0.15
    """
    return predicted / published - 1.0


def current_parameters() -> dict[str, float]:
    """devices.py's values: the efficiencies of ``H100_EFFICIENCY`` and ``peak500``."""
    from partitioner.cost import devices

    return {**dict(devices.H100_EFFICIENCY), "peak500": devices.H100_500W_PEAK_SHARE}


def with_parameters(params: dict[str, float]) -> None:
    """Rebuild the Hopper devices (``h100``, ``h100-500w``, ``h200``) with ``params``, in this process.

    >>> from partitioner.cost.devices import device_spec
    >>> saved = current_parameters()
    >>> with_parameters({**saved, "matmul": 0.5, "peak500": 0.9})
    >>> device_spec("h100").efficiency_of("matmul"), device_spec("h100-500w").peak("bfloat16") / 1e12
    (0.5, 890.1)
    >>> with_parameters(saved)
    """
    from partitioner.cost import devices

    efficiency = tuple((k, params[k]) for k, _ in devices.H100_EFFICIENCY)
    sxm = devices.DEVICES["h100"]
    for name in ("h100", "h200"):
        devices.DEVICES[name] = dataclasses.replace(devices.DEVICES[name], efficiency=efficiency)
    share = params["peak500"]
    devices.DEVICES["h100-500w"] = dataclasses.replace(
        devices.DEVICES["h100-500w"], efficiency=efficiency,
        peak_flops={k: v * share for k, v in sxm.peak_flops.items()})


def _price(run: PublishedRun, models: dict[str, Any]) -> dict[str, Any]:
    """Predicted throughput of ``run`` under the devices as they stand (per-op SAC: none and full, interpolated)."""
    import torch

    from partitioner.cost.devices import device_spec
    from partitioner.modelfile import load_model_file
    from partitioner.search.price import UNLIMITED_MEMORY, Layout, price_layout

    if run.spec not in models:
        models[run.spec] = load_model_file(str(ROOT / run.spec)).build()
    inputs = (torch.zeros(run.batch, run.seq, dtype=torch.long),)
    start = time.perf_counter()
    priced = price_layout(models[run.spec], inputs, Layout(gpus=run.gpus, **run.layout), tokens_per_sample=run.seq,
                          device=run.device, precision="bf16-mixed", optimizer="adam", gpus_per_node=min(8, run.gpus),
                          memory_per_gpu=UNLIMITED_MEMORY if run.unlimited else None)
    plan, step = priced.plan, priced.step_s
    fits = priced.peak_bytes <= device_spec(run.device).memory_bytes  # by our memory model, whatever was priced
    if run.checkpointing == "selective":  # one stage, recomputing fully: SAC keeps part of that forward
        if plan.pp != 1 or run.layout["recompute"] != "full":
            raise ValueError(f"{run.name}: selective AC is priced on one fully recomputing stage")
        step -= (1.0 - SAC_SHARE) * plan.microbatches * sum(s.predicted.recompute_s for s in plan.stages)
    if run.unit == "tokens/s/GPU":
        predicted = run.batch * run.seq / step / run.gpus
    else:  # model TFLOP/s per GPU, by our own FLOP count
        predicted = (plan.predicted.model_flops or 0.0) / step / run.gpus / 1e12
    return {"run": run.name, "predicted": predicted, "published": run.figure,
            "error": relative_error(predicted, run.figure), "fits": fits, "peak_gib": priced.peak_bytes / 2**30,
            "step_s": step, "wall_s": time.perf_counter() - start}


def _price_all(runs: list[PublishedRun], params: dict[str, float], models: dict[str, Any]) -> list[dict[str, Any]]:
    with_parameters(params)
    rows = []
    label = ", ".join(f"{k}={v:.3f}" for k, v in params.items())
    for run in runs:
        rows.append(_price(run, models))
        r = rows[-1]
        print(f"  [{label}] {run.name}: {r['predicted']:,.1f} vs {r['published']:,.1f} {run.unit} "
              f"({r['error']:+.1%}, {r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return rows


def _logs(rows: list[dict[str, Any]]) -> list[float]:
    return [math.log(1.0 + r["error"]) for r in rows]


def _clip(name: str, value: float) -> float:
    low, high = BOUNDS.get(name, (0.0, 1.0))
    return min(high, max(low, value))


def _minimax(jacobian: list[list[float]], residual: list[float], low: list[float], high: list[float],
             steps: int = 60) -> list[float]:
    """The step ``d`` (within ``low .. high``) whose linearised residuals ``r + J d`` have the least largest |value|.

    A grid over the box (two or three parameters), then a finer grid about the best point.

    >>> [round(x, 2) for x in _minimax([[1.0, 0.0], [0.0, 1.0]], [0.3, -0.2], [-1.0, -1.0], [1.0, 1.0])]
    [-0.3, 0.2]
    >>> [round(x, 2) for x in _minimax([[1.0], [1.0]], [0.3, 0.1], [-0.1], [1.0])]  # bounded below: -0.1
    [-0.1]
    """
    import itertools

    def worst(d: tuple[float, ...]) -> float:
        return max(abs(r + sum(j * x for j, x in zip(row, d))) for row, r in zip(jacobian, residual))

    lo, hi = list(low), list(high)
    best: tuple[float, ...] = tuple(0.0 if a <= 0.0 <= b else a for a, b in zip(lo, hi))
    for _ in range(4):  # coarse, then three zooms about the best point
        axes = [[a + (b - a) * i / steps for i in range(steps + 1)] for a, b in zip(lo, hi)]
        best = min(itertools.product(*axes), key=worst)
        span = [(b - a) / steps * 2 for a, b in zip(lo, hi)]
        lo = [max(low[i], best[i] - span[i]) for i in range(len(best))]
        hi = [min(high[i], best[i] + span[i]) for i in range(len(best))]
    return list(best)


def _fit(runs: list[PublishedRun], start: dict[str, float], models: dict[str, Any],
         iterations: int = 2) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Minimax of the log ratios over ``FITTED`` within ``BOUNDS``: linearised (finite differences), then re-priced."""
    params = {**start, "attention": ATTENTION_EFFICIENCY}
    rows = _price_all(runs, params, models)
    for _ in range(iterations):
        base = _logs(rows)
        if max(map(abs, base)) < 0.02:
            break
        columns = []
        for name in FITTED:
            step = -0.1 if params[name] * 0.9 >= BOUNDS[name][0] else 0.1
            moved = {**params, name: params[name] * math.exp(step)}
            columns.append([(m - b) / step for m, b in zip(_logs(_price_all(runs, moved, models)), base)])
        jacobian = [[col[i] for col in columns] for i in range(len(runs))]
        low = [math.log(BOUNDS[n][0] / params[n]) for n in FITTED]
        high = [math.log(BOUNDS[n][1] / params[n]) for n in FITTED]
        print("  jacobian (d log predicted / d log parameter): "
              + "; ".join(f"{r.name} " + " ".join(f"{n} {j:.2f}" for n, j in zip(FITTED, row))
                          for r, row in zip(runs, jacobian)), file=sys.stderr, flush=True)
        delta = _minimax(jacobian, base, low, high)
        params = {**params, **{n: _clip(n, params[n] * math.exp(d)) for n, d in zip(FITTED, delta)}}
        rows = _price_all(runs, params, models)
    return {k: round(v, 3) for k, v in params.items()}, rows


def _print(rows: list[dict[str, Any]], params: dict[str, float]) -> None:
    by_name = {r.name: r for r in RUNS}
    print("\nPublished bf16 H100 runs priced by our cost model ("
          + ", ".join(f"{k} {v:.3g}" for k, v in params.items()) + "):\n")
    print("| run | layout | role | published | predicted | error | fits | source |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        run = by_name[row["run"]]
        print(f"| {run.name} | {run.layout['name']} | {run.role} | {run.figure:,.0f} {run.unit} | "
              f"{row['predicted']:,.0f} | {row['error']:+.1%} | {'yes' if row['fits'] else 'no'} "
              f"({row['peak_gib']:.0f} GiB) | {run.source}; {run.device}{'; ' + run.note if run.note else ''} |")
    for role in ("fit", "held-out"):
        errors = [abs(r["error"]) for r in rows if by_name[r["run"]].role == role]
        if errors:
            print(f"\nworst |error| of the {role} runs: {max(errors):.1%}")


def _parse_set(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ("matmul", "attention", "memory", "peak500"):
            raise argparse.ArgumentTypeError(f"--set {key!r}: choose matmul, attention, memory or peak500")
        out[key] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="fit the efficiencies to the runs whose role is fit")
    parser.add_argument("--set", type=_parse_set, default={}, help="price at these values, e.g. matmul=0.7,peak500=0.9")
    parser.add_argument("--only", default="", help="comma-separated run names (prefixes)")
    parser.add_argument("--iterations", type=int, default=2, help="Gauss-Newton steps of --fit (default 2)")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not r.fp8 and r.name in CALIBRATION_RUNS
            and (not args.only or any(r.name.startswith(o) for o in args.only.split(",")))]
    if not runs:
        parser.error(f"--only {args.only!r} names no bf16 run; runs: {', '.join(r.name for r in RUNS if not r.fp8)}")
    models: dict[str, Any] = {}
    params = {**current_parameters(), **args.set}
    if args.fit:
        fitting = [r for r in runs if r.role == "fit"]
        params, rows = _fit(fitting, params, models, iterations=args.iterations)
        held = [r for r in runs if r.role != "fit"]
        rows += _price_all(held, params, models) if held else []
    else:
        rows = _price_all(runs, params, models)
    _print(rows, params)
    fit_errors = [abs(r["error"]) for r in rows if r["run"] in {x.name for x in runs if x.role == "fit"}]
    return 0 if max(fit_errors, default=0.0) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
