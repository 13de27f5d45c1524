"""Price every published training run with our cost model and say how far each lands from its figure.

Commands (from the repository root)::

    .venv/bin/python tools/validate_published.py --jobs 2                 # every run, today's devices
    .venv/bin/python tools/validate_published.py --only megatron2021-t2,korthikanti2022-22b
    .venv/bin/python tools/validate_published.py --role held-out --json validate.json
    .venv/bin/python tools/validate_published.py --precision fp8 --jobs 2 # every FP8 run
    .venv/bin/python tools/validate_published.py --fit --jobs 2           # fit each generation's efficiencies

Each run of ``tools/published`` (layout as published, on the machine it ran on) is priced by
:func:`partitioner.search.price.price_layout` (the split solved for the layout, simulated as any
plan) and its predicted step turned into the run's own figure by the run's own counting rule
(:func:`tools.published.figure_from_step`: Megatron's Eq. 3 TFLOP/s with the predicted step,
MFU by the model FLOPs the source counts, tokens/s per GPU, seconds per iteration).  FP8 runs
are priced at ``--precision fp8`` with their recipe (``PublishedRun.fp8_recipe``), fit or held
out like the others; runs with ``unpriced`` set (FP8 mixture of experts) are listed, not priced.

How a run is priced:

* bf16 and fp16 alike as ``bf16-mixed`` with Adam; ``gpus_per_node`` the run's hosts' (8 unless it
  says otherwise) and its ``nvlink_domain`` where NVLink joins several hosts (GB200 NVL72); the
  layout's ``ep`` (expert parallelism); the device's memory
  limit, or none for a run marked ``unlimited`` (a layout our memory model says does not fit
  is priced anyway, as :func:`~partitioner.search.price.price_layout` does, and marked).
* Selective recomputation (Korthikanti et al.'s attention core, torchtitan's per-op SAC) as
  no recomputation (priced without the memory limit: the run fit keeping all but its attention
  cores, and our split must not bend to memory it did not use) plus ``selective_share`` of the
  difference to full recomputation (two plans); "fits" is then the fully recomputing plan's.
* The sharding span: a run whose state is sharded over every replica (ZeRO-3 / FSDP over all
  GPUs) is priced with that span when ``price_layout`` (or ``Layout``, or ``compile``) takes a
  ``shard_span`` or ``span`` keyword; otherwise as today (``shard="full"`` at tp = 1 over more
  than a node is HSDP inside a node) and flagged ``span not priced``.  Other flags: ``SP not
  priced`` (sequence parallelism), ``ZeRO-2 as ZeRO-1``, ``assumed`` (the source leaves part of
  the layout unpublished).

Output: one row per run (GPUs, layout, published and predicted figure, error in the run's own
unit, fits, role, flags), then per role and GPU generation: runs within 15% and 30%, median
and worst |error|; fitted runs within 10%; and for every published comparison (runs sharing a
``group``: same model and GPUs, another layout, schedule or recomputation) whether each pair
is ordered as measured (pairs measured within 2% of each other are ties, not scored).
``--json OUT`` writes the same as data.  ``--fit``: for each GPU generation, the matmul and
attention efficiencies (``DeviceSpec.efficiency``) that minimise the worst |log error| of its
"fit" runs (finite differences, then a minimax step, :func:`tools.calibrate_published._minimax`,
re-priced), then every run priced at them; the values are printed for ``devices.py``, not
written there.  ``--params`` picks what is fitted (default ``matmul,attention``; ``fp8-matmul``:
the FP8 matmuls' own share, fitted to the FP8 fit runs ``--only`` selects), ``--generations``
which generations.  ``--jobs N`` prices N runs at a time (processes; 2 on this 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.published import GENERATIONS, RUNS, PublishedRun, figure_from_step

__all__ = [
    "BOUNDS",
    "FITTED",
    "compare_groups",
    "efficiencies",
    "main",
    "price_run",
    "select_runs",
    "span_keyword",
    "speed_ratio",
    "step_from_figure",
    "summarise",
    "with_efficiencies",
]

FITTED = ("matmul", "attention")  # fitted per GPU generation (memory-bound ops stay at the datasheet)
BOUNDS: dict[str, tuple[float, float]] = {"matmul": (0.2, 1.0), "attention": (0.1, 1.0), "fp8-matmul": (0.2, 1.0)}
_TIE = 0.02  # measured within 2%: a tie, not scored
_SAME = 1e-3  # predicted within 0.1%: no difference predicted, so a measured one is not ordered right
_models: dict[str, Any] = {}  # spec -> model built on meta (per process)


# ----------------------------------------------------------------------------- conversions


def step_from_figure(run: PublishedRun, figure: float) -> float:
    """The step (seconds) ``figure`` implies, by ``run``'s own count (not for counts ``"ours"``).

    >>> from tools.published import run_named
    >>> r = run_named("megatron2021-t1-145b")
    >>> round(step_from_figure(r, r.figure), 2)
    24.82
    """
    if run.counts == "ours":
        raise ValueError(f"{run.name}: a figure by our own count implies no step without a plan")
    at_one = figure_from_step(run, 1.0)
    return figure if run.counts == "seconds" else at_one / figure


def speed_ratio(run: PublishedRun, predicted: float) -> float:
    """Predicted over published throughput (above 1: predicted faster than measured), for any unit.

    >>> from tools.published import run_named
    >>> speed_ratio(run_named("korthikanti2022-22b-full"), 0.71)  # 0.71 s against 1.42 s
    2.0
    """
    return run.figure / predicted if run.counts == "seconds" else predicted / run.figure


# ----------------------------------------------------------------------------- devices


def efficiencies() -> dict[str, dict[str, float]]:
    """Each generation's efficiencies as devices.py has them now (its first device's).

    ``fp8-matmul`` only where the device gives it (elsewhere FP8 matmuls take ``matmul``'s share).
    """
    from partitioner.cost.devices import DEVICES

    out: dict[str, dict[str, float]] = {}
    for device, generation in GENERATIONS.items():
        if generation not in out and device in DEVICES:
            spec = DEVICES[device]
            out[generation] = {k: spec.efficiency_of(k) for k in (*FITTED, "memory")}
            if "fp8-matmul" in dict(spec.efficiency):
                out[generation]["fp8-matmul"] = spec.efficiency_of("fp8-matmul")
    return out


def with_efficiencies(values: dict[str, dict[str, float]]) -> None:
    """Set every device of each generation in ``values`` to those efficiencies (in this process).

    >>> from partitioner.cost.devices import device_spec
    >>> saved = efficiencies()
    >>> with_efficiencies({"ampere": {"matmul": 0.6, "attention": 0.5, "memory": 1.0}})
    >>> from partitioner.cost.devices import H100_EFFICIENCY
    >>> device_spec("a100-40gb").efficiency_of("matmul"), device_spec("h100").efficiency == H100_EFFICIENCY
    (0.6, True)
    >>> with_efficiencies(saved)
    """
    from partitioner.cost import devices

    for device, generation in GENERATIONS.items():
        if generation in values and device in devices.DEVICES:
            spec = devices.DEVICES[device]
            merged = {**dict(spec.efficiency), **values[generation]}  # the device's own order kept
            devices.DEVICES[device] = dataclasses.replace(spec, efficiency=tuple(merged.items()))


# ----------------------------------------------------------------------------- pricing


def span_keyword() -> tuple[str, str] | None:
    """Where the cost model takes the sharding span: ``("layout" | "call", name)``, or None (not yet)."""
    from partitioner.search import planner
    from partitioner.search.price import Layout, price_layout

    fields = {f.name for f in dataclasses.fields(Layout)}
    for name in ("shard_span", "span"):
        if name in fields:
            return "layout", name
        for function in (price_layout, planner.compile):
            if name in inspect.signature(function).parameters:
                return "call", name
    return None


def _model(spec: str) -> Any:
    from partitioner.modelfile import load_model_file

    if spec not in _models:
        _models[spec] = load_model_file(str(ROOT / spec)).build()
    return _models[spec]


def _flags(run: PublishedRun, span: tuple[str, str] | None) -> list[str]:
    lay = run.layout
    flags = []
    wide = lay["shard"] in ("full", "zero3") and lay["tp"] == 1 and lay["dp"] > min(8, run.gpus)
    if run.shard_span == "world" and wide and span is None:
        flags.append("span not priced")
    if run.sequence_parallel:
        flags.append("SP not priced")
    if run.zero_stage == 2:
        flags.append("ZeRO-2 as ZeRO-1")
    if run.assumed:
        flags.append("assumed")
    if run.from_plot:
        flags.append("plot")
    return flags


def price_run(run: PublishedRun, *, values: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """``run`` priced by our cost model: the predicted figure in its own unit, error, fits, flags.

    ``values``: each generation's efficiencies to price at (default: devices.py's).
    """
    import torch

    from partitioner.cost.devices import device_spec
    from partitioner.search.price import UNLIMITED_MEMORY, Layout, price_layout

    if values:
        with_efficiencies(values)
    start = time.perf_counter()
    span = span_keyword()
    row: dict[str, Any] = {"run": run.name, "gpus": run.gpus, "device": run.device, "generation": run.generation,
                           "layout": run.describe(), "role": run.role, "published": run.figure, "unit": run.unit,
                           "group": run.group, "source": run.source, "flags": _flags(run, span), "fp8": run.fp8,
                           "recipe": run.fp8_recipe}
    if run.unpriced:
        return {**row, "priced": False, "why": run.unpriced, "wall_s": 0.0}
    model = _model(run.spec)
    inputs = (torch.zeros(run.batch, run.seq, dtype=torch.long),)
    common: dict[str, Any] = {"device": run.device, "precision": "fp8" if run.fp8 else "bf16-mixed",
                              "optimizer": "adam", "gpus_per_node": min(run.gpus_per_node, run.gpus)}
    if run.fp8:
        common["fp8_recipe"] = run.fp8_recipe
    if run.nvlink_domain:
        common["nvlink_domain"] = run.nvlink_domain
    keywords = dict(run.layout)
    if span is not None and run.shard_span:
        (common if span[0] == "call" else keywords)[span[1]] = run.shard_span
    limit = UNLIMITED_MEMORY if run.unlimited else None

    def priced(recompute: str, memory: float | None = limit) -> Any:
        layout = Layout(gpus=run.gpus, **{**keywords, "recompute": recompute})
        return price_layout(model, inputs, layout, tokens_per_sample=run.seq, memory_per_gpu=memory, **common)

    if run.checkpointing == "selective":
        # The run kept all but its attention cores and fit: its no-recomputation side is priced without the
        # limit, so that memory does not bend the split (the limit holds for the fully recomputing plan).
        none, full = priced("none", UNLIMITED_MEMORY), priced("full")
        step = none.step_s + run.selective_share * (full.step_s - none.step_s)
        chosen = full
    else:
        chosen = priced(keywords["recompute"])
        step = chosen.step_s
    predicted = figure_from_step(run, step, model_flops=chosen.plan.predicted.model_flops)
    peak = chosen.peak_bytes
    return {**row, "priced": True, "predicted": predicted, "step_s": step,
            "error": predicted / run.figure - 1.0, "speed": speed_ratio(run, predicted),
            "fits": peak <= device_spec(run.device).memory_bytes, "peak_gib": peak / 2**30,
            "wall_s": time.perf_counter() - start}


def _task(args: tuple[PublishedRun, dict[str, dict[str, float]] | None]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    run, values = args
    try:
        return price_run(run, values=values)
    except Exception as exc:  # noqa: BLE001 - one failing run is a row, not the end of the table
        return {"run": run.name, "gpus": run.gpus, "device": run.device, "generation": run.generation,
                "layout": run.describe(), "role": run.role, "published": run.figure, "unit": run.unit,
                "group": run.group, "source": run.source, "flags": [], "priced": False, "fp8": run.fp8,
                "recipe": run.fp8_recipe,
                "why": f"{type(exc).__name__}: {exc}"[:300], "wall_s": 0.0}


def _cost_guess(run: PublishedRun) -> float:
    """A rough size of the pricing work, to start the long ones first."""
    lay = run.layout
    return lay["microbatches"] * lay["pp"] * (lay.get("chunks") or 1) * (2 if run.checkpointing == "selective" else 1)


def _price_all(runs: list[PublishedRun], *, jobs: int, values: dict[str, dict[str, float]] | None,
               say: Callable[[str], None]) -> list[dict[str, Any]]:
    order = sorted(runs, key=_cost_guess, reverse=True)
    rows: dict[str, dict[str, Any]] = {}

    def report(row: dict[str, Any]) -> None:
        rows[row["run"]] = row
        if row.get("priced"):
            say(f"  {row['run']}: {_fmt(row['predicted'], row['unit'])} vs {_fmt(row['published'], row['unit'])} "
                f"({row['error']:+.1%}, {row['wall_s']:.0f} s) [{len(rows)}/{len(runs)}]")
        else:
            say(f"  {row['run']}: not priced ({row.get('why', '')}) [{len(rows)}/{len(runs)}]")

    if jobs <= 1:
        for run in order:
            report(_task((run, values)))
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            for row in pool.map(_task, [(run, values) for run in order]):
                report(row)
    return [rows[r.name] for r in runs]


# ----------------------------------------------------------------------------- summaries


def _fmt(value: float, unit: str) -> str:
    if unit == "MFU":
        return f"{value:.1%} MFU"
    if unit == "s/iteration":
        return f"{value:,.2f} s"
    return f"{value:,.1f} {unit}"


def summarise(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per role and generation: runs, within 15% and 30%, median and worst |error|; fitted within 10%.

    FP8 rows are also scored apart: ``"fp8"`` (all) and ``"fp8 <generation>"``.

    >>> rows = [{"run": "a", "priced": True, "role": "held-out", "generation": "ampere", "error": 0.1},
    ...         {"run": "b", "priced": True, "role": "held-out", "generation": "ampere", "error": -0.4},
    ...         {"run": "c", "priced": True, "role": "fit", "generation": "hopper", "error": 0.05}]
    >>> s = summarise(rows)
    >>> s["held-out"]["all"]["within_15"], s["held-out"]["all"]["worst"], s["fit"]["all"]["within_10"]
    (1, ('b', -0.4), 1)
    >>> summarise([{**rows[0], "fp8": True}])["held-out"]["fp8 ampere"]["runs"]
    1
    """
    out: dict[str, Any] = {}
    priced = [r for r in rows if r.get("priced")]

    def groups(r: dict[str, Any]) -> set[str]:
        return {"all", r["generation"], *(("fp8", f"fp8 {r['generation']}") if r.get("fp8") else ())}

    fp8 = sorted({f"fp8 {r['generation']}" for r in priced if r.get("fp8")})
    for role in ("held-out", "fit"):
        out[role] = {}
        for generation in ("all", *sorted({r["generation"] for r in priced}), *(("fp8", *fp8) if fp8 else ())):
            sel = [r for r in priced if r["role"] == role and generation in groups(r)]
            if not sel:
                continue
            errors = [abs(r["error"]) for r in sel]
            worst = max(sel, key=lambda r: abs(r["error"]))
            out[role][generation] = {
                "runs": len(sel), "within_10": sum(e <= 0.10 for e in errors), "within_15": sum(e <= 0.15 for e in errors),
                "within_30": sum(e <= 0.30 for e in errors), "median": statistics.median(errors),
                "worst": (worst["run"], worst["error"]),
                "optimistic": sum(r["speed"] > 1 for r in sel if "speed" in r),
            }
    return out


def compare_groups(runs: list[PublishedRun], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pair of runs in a published comparison: is the faster measured also the faster predicted?

    Throughput is compared as tokens per second over the whole step (every run of a group has the
    same model and GPUs).  Pairs measured within 2% of each other are ties (``agrees`` None); a
    pair measured apart but predicted within 0.1% is not ordered right (``agrees`` False).
    """
    by_name = {r["run"]: r for r in rows}
    groups: dict[str, list[PublishedRun]] = {}
    for run in runs:
        if run.group:
            groups.setdefault(run.group, []).append(run)
    pairs = []
    for group, members in sorted(groups.items()):
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                ra, rb = by_name.get(a.name, {}), by_name.get(b.name, {})
                pair: dict[str, Any] = {"group": group, "a": a.name, "b": b.name}
                if not (ra.get("priced") and rb.get("priced")):
                    pairs.append({**pair, "agrees": None, "why": "not priced"})
                    continue
                measured = (a.batch * a.seq / step_from_figure(a, a.figure)) / (b.batch * b.seq / step_from_figure(b, b.figure))
                predicted = (a.batch * a.seq / ra["step_s"]) / (b.batch * b.seq / rb["step_s"])
                # A pair predicted alike (the cost model sees no difference: a dispatcher, an overlap) is wrong,
                # not right by the sign of a rounding error.
                same = abs(predicted - 1) < _SAME
                agrees = None if abs(measured - 1) < _TIE else (not same and (measured > 1) == (predicted > 1))
                pairs.append({**pair, "measured": measured, "predicted": predicted, "agrees": agrees,
                              "why": "tie" if agrees is None else "predicted alike" if same else ""})
    return pairs


def _print(runs: list[PublishedRun], rows: list[dict[str, Any]], pairs: list[dict[str, Any]],
           values: dict[str, dict[str, float]]) -> None:
    print("\nPublished runs priced by our cost model (efficiencies: "
          + "; ".join(f"{g} " + ", ".join(f"{k} {v:.3g}" for k, v in vals.items()) for g, vals in values.items())
          + ")\n")
    print("| run | GPUs | device | layout | published | predicted | error | fits | role | flags |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row.get("priced"):
            fits = f"{'yes' if row['fits'] else 'no'} ({row['peak_gib']:.0f} GiB)"
            print(f"| {row['run']} | {row['gpus']:,} | {row['device']} | {row['layout']} | "
                  f"{_fmt(row['published'], row['unit'])} | {_fmt(row['predicted'], row['unit'])} | "
                  f"{row['error']:+.1%} | {fits} | {row['role']} | {', '.join(row['flags'])} |")
        else:
            print(f"| {row['run']} | {row['gpus']:,} | {row['device']} | {row['layout']} | "
                  f"{_fmt(row['published'], row['unit'])} | - | - | - | {row['role']} | {row.get('why', '')} |")
    summary = summarise(rows)
    print()
    for role, by_gen in summary.items():
        for generation, s in by_gen.items():
            share = f"within 10% {s['within_10']}/{s['runs']}, " if role == "fit" else ""
            print(f"{role:8s} {generation:16s}: {share}within 15% {s['within_15']}/{s['runs']}, within 30% "
                  f"{s['within_30']}/{s['runs']}, median |error| {s['median']:.1%}, worst {s['worst'][0]} "
                  f"{s['worst'][1]:+.1%}, predicted faster than measured {s['optimistic']}/{s['runs']}")
    scored = [p for p in pairs if p["agrees"] is not None]
    print(f"\nPublished comparisons: {sum(p['agrees'] for p in scored)}/{len(scored)} pairs ordered as measured"
          + (f" ({sum(p['agrees'] for p in scored) / len(scored):.0%})" if scored else "")
          + f"; {sum(p['why'] == 'tie' for p in pairs)} ties, {sum(p['why'] == 'not priced' for p in pairs)} "
          "not priced")
    for p in pairs:
        if p["agrees"] is not None:
            print(f"  {'ok   ' if p['agrees'] else 'WRONG'} {p['group']}: {p['a']} / {p['b']}: measured "
                  f"{p['measured']:.2f}x, predicted {p['predicted']:.2f}x")


# ----------------------------------------------------------------------------- fitting


def _log_speeds(rows: list[dict[str, Any]]) -> list[float]:
    return [math.log(r["speed"]) for r in rows]


def _fit_generation(generation: str, runs: list[PublishedRun], start: dict[str, dict[str, float]], *, jobs: int,
                    iterations: int, say: Callable[[str], None], fitted: tuple[str, ...] = FITTED) -> dict[str, float]:
    from tools.calibrate_published import _minimax

    params = dict(start[generation])
    params.setdefault("fp8-matmul", params["matmul"])  # FP8 matmuls start at the bf16 share (their fallback)
    if "fp8-matmul" not in fitted and "fp8-matmul" not in start[generation]:
        params.pop("fp8-matmul")  # not fitted apart: FP8 matmuls follow "matmul"

    def at(p: dict[str, float]) -> list[dict[str, Any]]:
        say(f"[fit {generation}] " + ", ".join(f"{k}={v:.3f}" for k, v in p.items()))
        rows = _price_all(runs, jobs=jobs, values={**start, generation: p}, say=say)
        missing = [r["run"] for r in rows if not r.get("priced")]
        if missing:
            raise RuntimeError(f"fit runs not priced: {', '.join(missing)}")
        return rows

    rows = at(params)
    for _ in range(iterations):
        base = _log_speeds(rows)
        if max(map(abs, base)) < 0.02:
            break
        columns = []
        for name in fitted:
            step = -0.1 if params[name] * math.exp(-0.1) >= BOUNDS[name][0] else 0.1
            moved = {**params, name: params[name] * math.exp(step)}
            columns.append([(m - b) / step for m, b in zip(_log_speeds(at(moved)), base)])
        jacobian = [[col[i] for col in columns] for i in range(len(runs))]
        low = [math.log(BOUNDS[n][0] / params[n]) for n in fitted]
        high = [math.log(BOUNDS[n][1] / params[n]) for n in fitted]
        delta = _minimax(jacobian, base, low, high)
        params = {**params, **{n: min(BOUNDS[n][1], max(BOUNDS[n][0], params[n] * math.exp(d)))
                               for n, d in zip(fitted, delta)}}
        rows = at(params)
    return {k: round(v, 3) for k, v in params.items()}


# ----------------------------------------------------------------------------- command line


def select_runs(*, only: str = "", role: str = "", precision: str = "") -> list[PublishedRun]:
    """The runs ``--only`` (comma-separated name prefixes), ``--role`` and ``--precision`` pick.

    >>> [r.name for r in select_runs(only="megatron2021-t1-1")]
    ['megatron2021-t1-1.7b', 'megatron2021-t1-18b', 'megatron2021-t1-145b', 'megatron2021-t1-1t']
    >>> {r.precision for r in select_runs(precision="fp8")}
    {'fp8'}
    """
    prefixes = [o for o in only.split(",") if o]
    return [r for r in RUNS if (not prefixes or any(r.name.startswith(p) for p in prefixes))
            and (not role or r.role == role) and (not precision or r.precision == precision)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated run names (prefixes)")
    parser.add_argument("--role", choices=("fit", "held-out"), default="", help="only runs of this role")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp8"), default="",
                        help="only runs published in this precision (fp8: every FP8 run)")
    parser.add_argument("--json", default="", help="write the rows, summary and comparisons here")
    parser.add_argument("--fit", action="store_true", help="fit each generation's efficiencies to its fit runs")
    parser.add_argument("--iterations", type=int, default=1, help="minimax steps of --fit (default 1)")
    parser.add_argument("--params", default=",".join(FITTED),
                        help=f"efficiencies --fit fits, comma-separated, of {', '.join(BOUNDS)} (default matmul,attention)")
    parser.add_argument("--generations", default="", help="comma-separated generations --fit fits (default: every one)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs priced at a time")
    args = parser.parse_args(argv)
    runs = select_runs(only=args.only, role=args.role, precision=args.precision)
    if not runs:
        parser.error(f"--only {args.only!r} --role {args.role!r} --precision {args.precision!r} names no run")

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    start = time.perf_counter()
    values = efficiencies()
    fitted = tuple(p for p in args.params.split(",") if p)
    if unknown := [p for p in fitted if p not in BOUNDS]:
        parser.error(f"--params {','.join(unknown)}: not fitted; choose from {', '.join(BOUNDS)}")
    if args.fit:
        wanted = [g for g in args.generations.split(",") if g]
        for generation in sorted({r.generation for r in runs if r.role == "fit" and not r.unpriced}):
            if wanted and generation not in wanted:
                continue
            fitting = [r for r in runs if r.role == "fit" and r.generation == generation and not r.unpriced]
            values[generation] = _fit_generation(generation, fitting, values, jobs=args.jobs,
                                                 iterations=args.iterations, say=say, fitted=fitted)
    rows = _price_all(runs, jobs=args.jobs, values=values if args.fit else None, say=say)
    pairs = compare_groups(runs, rows)
    _print(runs, rows, pairs, values)
    wall = time.perf_counter() - start
    print(f"\n{len(rows)} runs ({sum(bool(r.get('priced')) for r in rows)} priced) in {wall:.0f} s, {args.jobs} at a time")
    if args.fit:
        print("\nFitted efficiencies (paste into partitioner/cost/devices.py):")
        for generation, vals in values.items():
            print(f"  {generation}: " + ", ".join(f'("{k}", {v})' for k, v in vals.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summarise(rows), "pairs": pairs,
                                               "efficiencies": values, "wall_s": wall}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
