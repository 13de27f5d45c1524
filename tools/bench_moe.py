"""The same mixture of experts planned without expert parallelism (every replica holds every expert) and with it.

Commands (from the repository root)::

    .venv/bin/python tools/bench_moe.py                       # every case below (about 10 min on 2 cores)
    .venv/bin/python tools/bench_moe.py --only qwen3-30b-64    # one case
    .venv/bin/python tools/bench_moe.py --json moe.json
    .venv/bin/python tools/bench_moe.py --deepseek             # DeepSeek-V3's published layout against ours

Each case plans one model on meta for ``--device h100`` (bf16-mixed, Adam, 8 GPUs per node,
recomputation, micro-batches, schedule, sharding and tensor parallelism searched) twice, in
one process, side by side: ``--ep 1`` (what the planner did before it knew experts: the
experts planned as dense weights every replica holds) and ``--ep auto`` (expert-parallel
degrees searched with the rest, :mod:`partitioner.cost.experts`).  It prints the chosen
layout, the predicted step, the tokens per second per GPU, the peak memory per GPU and the
planner's wall time, and the ratio of the two steps.  A plan that does not fit says so.

==================  ================================  =====  ======================
case                model file                        GPUs   batch (sequences)
==================  ================================  =====  ======================
qwen3-30b-64        examples/moe.py:qwen3_30b_a3b        64  512 x 4,096 tokens
qwen3-30b-1024      examples/moe.py:qwen3_30b_a3b     1,024  4,096 x 4,096
qwen3-235b-256      examples/moe.py:qwen3_235b_a22b     256  2,048 x 4,096
qwen3-235b-1024     examples/moe.py:qwen3_235b_a22b   1,024  4,096 x 4,096
==================  ================================  =====  ======================

Batches follow Megatron-Bridge's Qwen3 recipes (512 sequences of 4,096 for 30B) and
Megatron-MoE-ModelZoo's 256-H100 Qwen3-235B runs (2,048), and grow with the GPUs at 1,024.
Qwen3-235B does not fit 64 H100s under our memory model (16 bytes per parameter of state is
59 GiB per GPU fully sharded, before activations), so its small case is 256 GPUs.

``--deepseek``: DeepSeek-V3 671B (``examples/deepseek_v3.py:deepseek_v3_671b``) on 2,048 H800s
(``--device h800``) at its final batch, 15,360 sequences of 4,096 tokens (arXiv:2412.19437,
sections 3.1-3.2 and 4.2): its published layout (PP 16, EP 64 over 8 nodes, ZeRO-1 data
parallelism over 128 replicas, no tensor parallelism, one sequence per micro-batch, a
bidirectional pipeline priced as ``zbv``, the nearest schedule we run, and as ``1f1b``) priced by
:func:`partitioner.search.price.price_layout`, beside the planner's own choice with ``--ep auto``
and the planner's wall time.  Both in bf16-mixed: DeepSeek trained in FP8, which the cost model
does not price (issue 33), so neither figure is comparable with the paper's own throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

__all__ = ["CASES", "Case", "main"]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    spec: str  # model file and factory
    gpus: int
    batch: int


CASES = (
    Case("qwen3-30b-64", "examples/moe.py:qwen3_30b_a3b", 64, 512),
    Case("qwen3-30b-1024", "examples/moe.py:qwen3_30b_a3b", 1024, 4096),
    Case("qwen3-235b-256", "examples/moe.py:qwen3_235b_a22b", 256, 2048),
    Case("qwen3-235b-1024", "examples/moe.py:qwen3_235b_a22b", 1024, 4096),
)


def _plan(case: Case, ep: int | str) -> dict[str, Any]:
    """One plan of ``case`` at ``ep``: layout, step, tokens/s/GPU, peak memory, wall time (or why nothing fits)."""
    import partitioner
    from partitioner.errors import InfeasibleError
    from partitioner.modelfile import load_model_file

    model_file = load_model_file(case.spec)
    model = model_file.build()
    inputs = model_file.example_inputs(case.batch)
    if model_file.example_target is None:
        raise SystemExit(f"{case.spec} defines no example_target(batch): bench_moe plans with its loss")
    seq = int(inputs[0].shape[1])
    start = time.perf_counter()
    try:
        plan = partitioner.compile(
            model, inputs, gpus=case.gpus, device="h100", precision="bf16-mixed", gpus_per_node=8, tp="auto",
            microbatches="auto", schedule="auto", recompute="auto",
            ep=ep, loss_fn=model_file.loss_fn, target=model_file.example_target(case.batch))
    except InfeasibleError as exc:
        return {"ep": ep, "fits": False, "why": str(exc).splitlines()[0], "wall_s": time.perf_counter() - start}
    step = plan.predicted.step_s
    return {
        "ep": plan.ep, "fits": True, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "microbatches": plan.microbatches,
        "schedule": plan.schedule, "chunks": plan.chunks, "shard": sorted({s.shard for s in plan.stages}),
        "step_s": step, "tokens_per_s_per_gpu": case.batch * seq / step / case.gpus, "mfu": plan.predicted.mfu,
        "peak_gib": max(plan.predicted.peak_memory_bytes, default=0.0) / 2**30, "wall_s": time.perf_counter() - start,
    }


def _row(label: str, r: dict[str, Any]) -> str:
    if not r["fits"]:
        return f"  {label:8s} does not fit: {r['why'][:110]} ({r['wall_s']:.0f} s to plan)"
    layout = f"TP{r['tp']} PP{r['pp']} DP{r['dp']} EP{r['ep']} M{r['microbatches']} {r['schedule']}" + (
        f" x{r['chunks']}" if r["chunks"] > 1 else "") + f" {'/'.join(r['shard'])}"
    return (f"  {label:8s} {layout:52s} step {r['step_s']:8.2f} s  {r['tokens_per_s_per_gpu']:8.0f} tok/s/GPU  "
            f"peak {r['peak_gib']:5.1f} GiB  ({r['wall_s']:.0f} s to plan)")


def _deepseek() -> dict[str, Any]:
    """DeepSeek-V3's published layout and the planner's --ep auto plan, priced by the same cost model."""
    import partitioner
    from partitioner.modelfile import load_model_file
    from partitioner.search.price import Layout, price_layout

    model_file = load_model_file("examples/deepseek_v3.py:deepseek_v3_671b")
    batch, gpus = 15360, 2048
    common: dict[str, Any] = {"device": "h800", "precision": "bf16-mixed", "gpus_per_node": 8,
                              "loss_fn": model_file.loss_fn}
    searched: dict[str, Any] = {"microbatches": "auto", "schedule": "auto", "recompute": "auto"}
    out: dict[str, Any] = {}
    model = model_file.build()
    if model_file.example_target is None:
        raise SystemExit("examples/deepseek_v3.py defines no example_target(batch): bench_moe plans with its loss")
    inputs, target = model_file.example_inputs(batch), model_file.example_target(batch)
    start = time.perf_counter()
    ours = partitioner.compile(model, inputs, gpus=gpus, tp="auto", ep="auto", target=target, **searched, **common)
    out["ours"] = {"layout": f"TP{ours.tp} PP{ours.pp} x{ours.chunks} DP{ours.dp} EP{ours.ep} M{ours.microbatches} "
                   f"{ours.schedule} {'/'.join(sorted({s.shard for s in ours.stages}))}",
                   "step_s": ours.predicted.step_s, "wall_s": time.perf_counter() - start,
                   "peak_gib": max(ours.predicted.peak_memory_bytes) / 2**30}
    for schedule, chunks in (("zbv", 2), ("1f1b", None)):
        layout = Layout(f"deepseek-v3-{schedule}", gpus=gpus, tp=1, pp=16, dp=128, ep=64, microbatches=120,
                        schedule=schedule, chunks=chunks, shard="optimizer", recompute="auto",
                        source="DeepSeek-V3 Technical Report (arXiv:2412.19437), section 3.2")
        priced = price_layout(model_file.build(), inputs, layout, tokens_per_sample=4096, target=target, **common)
        out[f"published-{schedule}"] = {"layout": layout.describe(), "step_s": priced.step_s, "fits": priced.fits,
                                        "peak_gib": priced.peak_bytes / 2**30}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--deepseek", action="store_true", help="DeepSeek-V3's published layout against ours")
    args = parser.parse_args(argv)
    if args.deepseek:
        found = _deepseek()
        for name, r in found.items():
            fits = "" if r.get("fits", True) else " (does not fit our memory model)"
            print(f"{name:18s} {r['layout']:70s} step {r['step_s']:7.2f} s  peak {r['peak_gib']:5.1f} GiB{fits}"
                  + (f"  ({r['wall_s']:.0f} s to plan)" if "wall_s" in r else ""))
        if args.json:
            args.json.write_text(json.dumps(found, indent=2))
        return 0
    chosen = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    if not chosen:
        parser.error(f"--only names none of {', '.join(c.name for c in CASES)}")
    results: dict[str, Any] = {}
    for case in chosen:
        without, with_ep = _plan(case, 1), _plan(case, "auto")
        results[case.name] = {"case": dataclasses.asdict(case), "ep1": without, "ep_auto": with_ep}
        print(f"{case.name}: {case.spec} on {case.gpus} H100s, batch {case.batch}")
        print(_row("ep 1", without))
        print(_row("ep auto", with_ep))
        if without["fits"] and with_ep["fits"]:
            print(f"  step ep auto / ep 1: {with_ep['step_s'] / without['step_s']:.3f}")
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
