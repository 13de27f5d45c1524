#!/usr/bin/env bash
# tools/gpu_check.sh: predicted vs measured on one GPU, for a session that is lent a GPU machine.
#
# What it does (under 8 minutes on one H200: GPU_CHECK_BUDGET, 450 s, bounds every step's limit):
#   for a ~1.3B GPT (GPT-3 XL shape, examples/gpt3.py: 24 layers, d 2048, seq 2048) and a
#   ~1.5B Llama (Llama 3.2 1B shape, examples/llama.py: 16 layers, hidden 2048, FFN 8192,
#   32/8 heads, vocab 128256, untied head; seq 2048):
#   1. plans a one-stage plan (--gpus 1, 2 micro-batches) twice: with costs measured on the GPU
#      (device "cuda") and with the H200 roofline (device "h200", model built on meta), both with
#      precision bf16-mixed (bf16 autocast, fp32 weights);
#   2. prints per-block forward/backward times side by side, summed into embeddings, transformer
#      layers (total and per layer) and head, from each plan's block graph, plus one transformer
#      layer timed directly with CUDA events (pure torch, no planner code);
#   3. trains the measured plan on 1 rank with `autopartition run` (torchrun, NCCL): 2 warm-up
#      steps, then the median of 5 timed steps, against both plans' predicted step.
#   Results: tables on stdout; NAME.json, NAME.train.json, NAME.log and summary.txt (7 files)
#   under $OUT (the device tool's folder, which brings back at most 8 files) or /tmp/gpu_check;
#   the plans themselves stay in a temporary folder.
#
# Usage:
#   bash tools/gpu_check.sh                  # on the GPU machine
#   bash tools/gpu_check.sh --cpu-dry-run    # here, on the CPU: tiny models, device "cpu", gloo; < 2 min
#   GPU_CHECK_DRY_RUN=1 bash tools/gpu_check.sh   # the same
#   GPU_CHECK_MODELS=gpt bash tools/gpu_check.sh  # only the GPT (or: llama)
#
# The GPU machine (Python 3.12, torch 2.11 + CUDA, transformers, numpy, matplotlib, networkx
# preinstalled) has no pulp or highspy and no network. Carry their wheels:
#   1. here, once: bash tools/fetch_wheels.sh        # downloads into .whl/ and git-ignores it
#      (= python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
#         -d .whl pulp highspy)
#   2. the device tool: run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
# This script installs them with
#   pip install --no-index --no-deps --find-links $WHEELS --target /tmp/site pulp highspy
# (WHEELS defaults to .whl) and puts /tmp/site and the repository on PYTHONPATH (no install of
# the package itself is needed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

DRY=${GPU_CHECK_DRY_RUN:-0}
for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) DRY=1 ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && [ "$DRY" = 1 ]; then
  PY=$ROOT/.venv/bin/python
fi
RESULTS=${OUT:-/tmp/gpu_check}
mkdir -p "$RESULTS"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - START )) s] $*"; }

# ------------------------------------------------------------------ dependencies
WHEELS=${WHEELS:-.whl}
if ! "$PY" -c "import pulp, highspy" 2>/dev/null; then
  if [ ! -d "$WHEELS" ]; then
    echo "gpu_check.sh: pulp/highspy are missing and there is no wheel folder $WHEELS;" \
         "run tools/fetch_wheels.sh here and carry .whl (see the header)" >&2
    exit 2
  fi
  say "installing pulp and highspy from $WHEELS"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --find-links "$WHEELS" --target /tmp/site pulp highspy
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
  MODE=cpu
  MODELS=${GPU_CHECK_MODELS:-gpt,llama}
  LIMIT=240
  TRAIN_LIMIT=120
else
  MODE=gpu
  MODELS=${GPU_CHECK_MODELS:-gpt,llama}
  LIMIT=180
  TRAIN_LIMIT=90
  command -v nvidia-smi >/dev/null && nvidia-smi -L || true
fi
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"

# ------------------------------------------------------------------ the Python part
cat > "$WORK/gpu_check.py" <<'PYTHON'
"""Per-block predicted vs measured, and one training step (see tools/gpu_check.sh)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(os.environ.get("GPU_CHECK_ROOT", os.getcwd()))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name -> shape; "mode" says where it runs (gpu: the real check, cpu: the dry run)
MODELS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {
        "gpu": {"kind": "gpt", "layers": 24, "width": 2048, "heads": 16, "vocab": 50257, "seq": 2048, "batch": 4},
        "cpu": {"kind": "gpt", "layers": 4, "width": 64, "heads": 4, "vocab": 512, "seq": 32, "batch": 4},
    },
    "llama": {  # Llama 3.2 1B shape (untied head here)
        "gpu": {"kind": "llama", "layers": 16, "width": 2048, "ffn": 8192, "heads": 32, "kv": 8, "vocab": 128256,
                "seq": 2048, "batch": 4},
        "cpu": {"kind": "llama", "layers": 4, "width": 64, "ffn": 176, "heads": 4, "kv": 2, "vocab": 512, "seq": 32,
                "batch": 4},
    },
}
MICROBATCHES = 2
PLANS = Path("/tmp")  # set by main()
WARMUP, STEPS = 2, 5


def example(name: str) -> Any:
    key = f"_autopartition_example_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def build(shape: dict[str, Any], device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        if shape["kind"] == "gpt":
            gpt = example("gpt")
            config = gpt.GPTConfig(vocab_size=shape["vocab"], block_size=shape["seq"], n_layer=shape["layers"],
                                   n_head=shape["heads"], n_embd=shape["width"])
            return gpt.GPT(config)
        import transformers

        llama = example("llama")
        config = llama.llama_config(llama.LlamaShape(
            layers=shape["layers"], hidden=shape["width"], ffn=shape["ffn"], heads=shape["heads"],
            kv_heads=shape["kv"], vocab=shape["vocab"], seq_len=shape["seq"], max_positions=max(shape["seq"], 128)))
        return transformers.LlamaForCausalLM(config)


def data(shape: dict[str, Any], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab"], (batch, shape["seq"] + 1), generator=g)
    if shape["kind"] == "gpt":
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # next-token targets
    ids = tokens[:, :-1].contiguous()
    return ids, ids  # Hugging Face convention: labels are the ids, shifted inside loss_fn


def loss_fn(shape: dict[str, Any]) -> Any:
    return example("gpt" if shape["kind"] == "gpt" else "llama").loss_fn


def planner_has(name: str) -> bool:
    from partitioner.search.planner import compile

    return name in inspect.signature(compile).parameters


def plan(shape: dict[str, Any], device: str, notes: list[str]) -> Any:
    """A one-stage plan: costs measured on ``device`` ("cuda"/"cpu") or predicted ("h200")."""
    from partitioner.search.planner import compile

    predicted = device not in ("cuda", "cpu")
    ids, target = data(shape, shape["batch"])
    kwargs: dict[str, Any] = {"gpus": 1, "pp": 1, "dp": 1, "microbatches": MICROBATCHES, "schedule": "gpipe",
                              "device": device, "loss_fn": loss_fn(shape), "target": target}
    mixed = planner_has("precision")
    if mixed:
        kwargs["precision"] = "bf16-mixed"
    elif "legacy: pure bf16 model" not in notes:
        notes.append("legacy: pure bf16 model")
    for where in (["meta", "cpu"] if predicted else ["cpu"]):
        model = build(shape, where)
        if not mixed:
            model = model.to(torch.bfloat16)
        start = time.perf_counter()
        try:
            result = compile(model, (ids,), **kwargs)
        except Exception as exc:  # a meta model may not plan yet: say so, then use real weights
            if where == "meta":
                notes.append(f"{device}: meta model failed ({type(exc).__name__}: {str(exc)[:160]}); real weights")
                continue
            raise
        result_s = time.perf_counter() - start
        print(f"    planned with device {device} ({where} model) in {result_s:.1f} s", flush=True)
        return result, result_s
    raise AssertionError("unreachable")


def unit_of(name: str) -> str:
    head = name.split("/")[0]
    if re.search(r"(^|\.)(layers|blocks)(\.|$)", head):
        return "layers"
    if head.split(".")[-1] in ("lm_head", "ln_f", "norm") or head in ("lm_head", "ln_f", "model.norm"):
        return "head"
    return "embeddings"


def per_unit(result: Any) -> dict[str, list[float]]:
    """unit -> [forward s, backward s] per micro-batch, summed over the plan's blocks."""
    out = {u: [0.0, 0.0] for u in ("embeddings", "layers", "head")}
    graph = getattr(result, "block_graph", None)
    if graph is None:
        return {}
    for b in graph.blocks:
        u = unit_of(b.name)
        out[u][0] += b.forward_s
        out[u][1] += b.backward_s
    return out


def direct_layer(shape: dict[str, Any], device: str) -> tuple[float, float] | None:
    """One transformer layer timed directly (bf16 autocast), forward and backward per micro-batch."""
    micro = shape["batch"] // MICROBATCHES
    model: Any = build(shape, device)
    try:
        x = torch.randn(micro, shape["seq"], shape["width"], device=device, requires_grad=True)
        if shape["kind"] == "gpt":
            layer = model.blocks[0]

            def run() -> torch.Tensor:
                return layer(x)
        else:
            layer = model.model.layers[0]
            positions = torch.arange(shape["seq"], device=device)[None]
            rope = model.model.rotary_emb(x, positions)

            def run() -> torch.Tensor:
                out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
                return out[0] if isinstance(out, tuple) else out

        return _time_fb(run, device)
    except Exception as exc:  # noqa: BLE001 - a change in the layer's signature: report, go on
        print(f"    direct layer timing failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    finally:
        del model


def _time_fb(run: Any, device: str, repeats: int = 10) -> tuple[float, float]:
    cuda = device == "cuda"
    autocast = torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16)
    forward, backward = [], []
    for i in range(3 + repeats):
        sync(device)
        t0 = time.perf_counter()
        with autocast:
            y = run()
        sync(device)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        sync(device)
        t2 = time.perf_counter()
        if i >= 3:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return statistics.median(forward), statistics.median(backward)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.3f}"


def ratio(measured: float | None, predicted: float | None) -> str:
    if not measured or not predicted:
        return "-"
    return f"{measured / predicted:.2f}x"


def check(name: str, mode: str, out: Path) -> int:
    shape = MODELS[name][mode]
    device = "cuda" if mode == "gpu" else "cpu"
    notes: list[str] = []
    print(f"== {name}: {shape}", flush=True)
    measured, measured_plan_s = plan(shape, device, notes)
    predicted, predicted_plan_s = plan(shape, "h200", notes)
    if device == "cuda":
        torch.cuda.empty_cache()
    plan_dir = PLANS / f"plan-{name}"
    measured.save(plan_dir)
    units_m, units_p = per_unit(measured), per_unit(predicted)
    layers = shape["layers"]
    direct = direct_layer(shape, device)
    if device == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for unit in ("embeddings", "layers", "head"):
        m, p = units_m.get(unit, [None, None]), units_p.get(unit, [None, None])
        rows.append([unit, ms(m[0]), ms(p[0]), ratio(m[0], p[0]), ms(m[1]), ms(p[1]), ratio(m[1], p[1])])
        if unit == "layers" and m[0] is not None and p[0] is not None:
            pf, pb = p[0] / layers, p[1] / layers
            rows.append([f"  one layer (of {layers})", ms(m[0] / layers), ms(pf), ratio(m[0] / layers, pf),
                         ms(m[1] / layers), ms(pb), ratio(m[1] / layers, pb)])
            if direct is not None:
                rows.append(["  one layer, timed directly", ms(direct[0]), ms(pf), ratio(direct[0], pf),
                             ms(direct[1]), ms(pb), ratio(direct[1], pb)])
    sm, sp = measured.stages[0].predicted, predicted.stages[0].predicted
    rows.append(["whole stage (plan)", ms(sm.forward_s), ms(sp.forward_s), ratio(sm.forward_s, sp.forward_s),
                 ms(sm.backward_s), ms(sp.backward_s), ratio(sm.backward_s, sp.backward_s)])
    print(f"\n{name}: per micro-batch ({shape['batch'] // MICROBATCHES} x {shape['seq']} tokens), ms; "
          f"measured = --device {device} plan, predicted = --device h200 roofline")
    table(["part", "fwd measured", "fwd h200", "ratio", "bwd measured", "bwd h200", "ratio"], rows)
    result = {
        "model": name, "shape": shape, "device": device, "notes": notes,
        "plan_s": {"measured": measured_plan_s, "predicted": predicted_plan_s},
        "units_measured": units_m, "units_predicted": units_p, "direct_layer": direct,
        "step_predicted_measured_costs": measured.predicted.step_s,
        "step_predicted_h200": predicted.predicted.step_s,
        "mfu_h200": getattr(predicted.predicted, "mfu", None),
        "model_flops": getattr(predicted.predicted, "model_flops", None),
        "plan_dir": str(plan_dir),
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    if notes:
        print("notes: " + "; ".join(notes))
    return 0


def train(name: str, mode: str, out: Path) -> int:
    """Run inside `autopartition run` (torchrun): the saved one-stage plan, WARMUP + STEPS steps."""
    from partitioner.plan import Plan
    from runtime import Pipeline

    shape = MODELS[name][mode]
    plan_ = Plan.load(PLANS / f"plan-{name}")
    model = build(shape, "cpu")
    if not planner_has("precision"):
        model = model.to(torch.bfloat16)
    pipe = Pipeline(plan_, model, loss_fn(shape))
    device = pipe.device.type
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-5)
    ids, target = data(shape, plan_.batch_size)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16)
    steps, pipe_steps, losses = [], [], []
    for i in range(WARMUP + STEPS):
        sync(device)
        t0 = time.perf_counter()
        with autocast:  # bf16-mixed: bf16 compute, fp32 weights (a no-op where the runtime already does it)
            loss = pipe.step((ids,), target)
        sync(device)
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t2 = time.perf_counter()
        if loss is not None:
            losses.append(float(loss))
        if i >= WARMUP:
            pipe_steps.append(t1 - t0)
            steps.append(t2 - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    result = {"pipe_step_s": statistics.median(pipe_steps), "step_s": statistics.median(steps),
              "losses": losses, "peak_bytes": peak, "backend": str(torch.distributed.get_backend()),
              "predicted_peak_bytes": plan_.stages[0].predicted.memory_bytes}
    (out / f"{name}.train.json").write_text(json.dumps(result, indent=1))
    print(f"    trained {WARMUP} + {STEPS} steps on {device} ({result['backend']}): losses "
          + ", ".join(f"{x:.3f}" for x in losses), flush=True)
    return 0


def summary(names: list[str], out: Path) -> int:
    rows = []
    for name in names:
        path = out / f"{name}.json"
        if not path.exists():
            rows.append([name, "check failed", "-", "-", "-", "-", "-", "-"])
            continue
        r = json.loads(path.read_text())
        t_path = out / f"{name}.train.json"
        t = json.loads(t_path.read_text()) if t_path.exists() else {}
        rows.append([
            name, ms(r["step_predicted_h200"]), ms(r["step_predicted_measured_costs"]), ms(t.get("pipe_step_s")),
            ms(t.get("step_s")), ratio(t.get("pipe_step_s"), r["step_predicted_h200"]),
            "-" if t.get("peak_bytes") is None else f"{t['peak_bytes'] / 2**30:.1f}",
            "-" if not t else f"{t['predicted_peak_bytes'] / 2**30:.1f}",
        ])
    print("\nOne training step of the one-stage plan (median of 5 after 2 warm-up steps), ms")
    table(["model", "predicted h200", f"predicted ({'cuda' if torch.cuda.is_available() else 'cpu'} costs)",
           "measured pipe.step", "measured + AdamW", "measured / h200", "peak GiB", "plan GiB"], rows)
    return 0


def table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for k, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["check", "train", "summary"])
    parser.add_argument("models")
    parser.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    parser.add_argument("--out", required=True, help="results (JSON)")
    parser.add_argument("--plans", required=True, help="where plans are saved")
    args = parser.parse_args()
    out = Path(args.out)
    global PLANS
    PLANS = Path(args.plans)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.mode == "cpu":
        torch.set_num_threads(1)
    if args.command == "check":
        return check(args.models, args.mode, out)
    if args.command == "train":
        return train(args.models, args.mode, out)
    return summary(args.models.split(","), out)


if __name__ == "__main__":
    sys.exit(main())
PYTHON

# ------------------------------------------------------------------ the checks
export GPU_CHECK_ROOT=$ROOT
# Whole-script budget (seconds from the start): every step's time limit is cut to what is left,
# so the script ends within it even when a step hangs (default 450 s: under 8 minutes in all).
BUDGET=${GPU_CHECK_BUDGET:-450}
limit() {  # LIMIT -> min(LIMIT, seconds left in the budget less 15 for the summary)
  local left=$(( BUDGET - ($(date +%s) - START) - 15 ))
  (( left < $1 )) && echo "$left" || echo "$1"
}
status=0
IFS=',' read -r -a names <<< "$MODELS"
for name in "${names[@]}"; do
  rm -f "$RESULTS/$name.json" "$RESULTS/$name.train.json" "$RESULTS/$name.log"  # no stale results
done
for name in "${names[@]}"; do
  t=$(limit "$LIMIT")
  if (( t < 30 )); then say "$name: skipped, the time budget is spent"; status=1; continue; fi
  say "$name: plan (measured on ${MODE/gpu/cuda} and h200 roofline), per-block times (limit $t s)"
  if timeout "$t" "$PY" "$WORK/gpu_check.py" check "$name" --mode "$MODE" --out "$RESULTS" \
      --plans "$WORK" 2>&1 | tee "$RESULTS/$name.log"; then
    t=$(limit "$TRAIN_LIMIT")
    if (( t < 20 )); then say "$name: training skipped, the time budget is spent"; status=1; continue; fi
    say "$name: training steps of the one-stage plan (autopartition run, 1 rank; limit $t s)"
    timeout "$t" "$PY" -m partitioner run "$WORK/plan-$name" --nproc-per-node 1 -- \
        "$WORK/gpu_check.py" train "$name" --mode "$MODE" --out "$RESULTS" --plans "$WORK" \
        2>&1 | tee -a "$RESULTS/$name.log" || { say "$name: training failed"; status=1; }
  else
    say "$name: check failed (see $RESULTS/$name.log)"; status=1
  fi
done
"$PY" "$WORK/gpu_check.py" summary "$MODELS" --mode "$MODE" --out "$RESULTS" --plans "$WORK" | tee "$RESULTS/summary.txt"
say "done (results in $RESULTS)"
exit $status
