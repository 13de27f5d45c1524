"""The model x schedule matrix: every plan the planner picks either verifies or is refused up front.

Commands (from the repository root)::

    .venv/bin/python tools/model_matrix.py                       # every cell: a markdown table
    .venv/bin/python tools/model_matrix.py --models cnn,bn_unet --schedules zb-h1,zbv
    .venv/bin/python tools/model_matrix.py --json matrix.json

Each cell plans one model (:data:`MODELS`: the examples, CNNs with BatchNorm,
GroupNorm, max-pool, skips and in-place residuals, models written with ``torch.nn``'s
own attention, an encoder-decoder, an LSTM, mixtures of experts and the Hugging Face
zoo) for one schedule on 2 pipeline ranks (``auto``: 4 GPUs as 2 stages x 2 replicas,
the schedule and micro-batches chosen by the planner), with predicted ``h100`` costs so that the split is
the same on every machine; then verifies the plan on real CPU ranks against the
unpartitioned model (fp32, 1e-5, 2 steps).  A cell is ``verified`` (with the largest
difference), ``refused`` (the planner's reason, before any rank started) or ``FAILED``.
:data:`REFUSED` lists the refusals we expect; ``tests/test_model_matrix.py`` holds every
cell to it (one row per model by default, the whole matrix with
``AUTOPARTITION_EXHAUSTIVE=1``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from partitioner.errors import AutopartitionError
from partitioner.plan import Plan

__all__ = ["DEFAULT_SCHEDULE", "MODELS", "REFUSED", "SCHEDULES", "CellResult", "MatrixModel", "plan_cell",
           "run_cell"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "auto")


@dataclass(frozen=True)
class MatrixModel:
    """One row: a model file (relative to the repository root) and its mini-batch."""

    spec: str
    batch: int = 8
    microbatches: int = 4
    hf: bool = False  # needs transformers (the dev extra)


MODELS: dict[str, MatrixModel] = {
    # the repository's examples
    "gpt": MatrixModel("examples/gpt.py"),
    "cnn": MatrixModel("examples/cnn.py"),
    "two_inputs": MatrixModel("examples/two_inputs.py"),
    "llama_tiny": MatrixModel("examples/llama.py", hf=True),
    # CNNs: BatchNorm, GroupNorm, max-pool, skips, in-place residuals
    "bn_unet": MatrixModel("tests/models/bn_unet.py"),
    "maxpool_net": MatrixModel("tests/models/maxpool_net.py"),
    "resnet_inplace": MatrixModel("tests/models/resnet_inplace.py"),
    "unet_groupnorm": MatrixModel("tests/models/unet_groupnorm.py"),
    "user_mobilenet": MatrixModel("tests/models/user_mobilenet.py"),
    # dropout, tied weights, skips in MLPs
    "dropout_mlp": MatrixModel("tests/models/dropout_mlp.py"),
    "skip_mlp": MatrixModel("tests/models/skip_mlp.py"),
    "tied_lm": MatrixModel("tests/models/tied_lm.py"),
    # torch.nn's own attention, an encoder-decoder, a recurrent net, a mixture of experts
    "user_transformer": MatrixModel("tests/models/user_transformer.py"),
    "user_seq2seq": MatrixModel("tests/models/user_seq2seq.py"),
    "user_lstm": MatrixModel("tests/models/user_lstm.py"),
    "user_moe": MatrixModel("tests/models/user_moe.py"),
    # the Hugging Face zoo (each model's own loss from labels)
    "hf_gpt2": MatrixModel("tests/models/zoo_gpt2.py", batch=4, microbatches=2, hf=True),
    "hf_bert": MatrixModel("tests/models/zoo_bert.py", batch=4, microbatches=2, hf=True),
    "hf_vit": MatrixModel("tests/models/zoo_vit.py", batch=4, microbatches=2, hf=True),
    "hf_qwen2": MatrixModel("tests/models/zoo_qwen2.py", batch=4, microbatches=2, hf=True),
    "hf_bart": MatrixModel("tests/models/zoo_bart.py", batch=4, microbatches=2, hf=True),
    "hf_mixtral": MatrixModel("tests/models/zoo_mixtral.py", batch=4, microbatches=2, hf=True),
}

# The default tier's row per model: every schedule appears, on models of several kinds.
DEFAULT_SCHEDULE: dict[str, str] = {
    "gpt": "zbv",
    "cnn": "zb-h1",
    "two_inputs": "interleaved-1f1b",
    "llama_tiny": "zb-h1",
    "bn_unet": "interleaved-1f1b",
    "maxpool_net": "gpipe",
    "resnet_inplace": "1f1b",
    "unet_groupnorm": "zbv",
    "user_mobilenet": "zb-h1",
    "dropout_mlp": "auto",
    "skip_mlp": "interleaved-1f1b",
    "tied_lm": "zbv",
    "user_transformer": "zb-h1",
    "user_seq2seq": "1f1b",
    "user_lstm": "zb-h1",
    "user_moe": "zbv",
    "hf_gpt2": "zb-h1",
    "hf_bert": "interleaved-1f1b",
    "hf_vit": "zbv",
    "hf_qwen2": "1f1b",
    "hf_bart": "gpipe",
    "hf_mixtral": "auto",
}

# Cells the planner refuses before solving: (model, schedule) -> a part of its reason.
REFUSED: dict[tuple[str, str], str] = {}


@dataclass
class CellResult:
    """One cell's outcome: ``verified`` (largest difference), ``refused`` (reason) or ``FAILED``."""

    model: str
    schedule: str
    outcome: str
    detail: str
    chosen: str = ""  # the plan's shape and schedule, for a cell that planned
    seconds: float = 0.0


def plan_cell(model: str, schedule: str) -> Plan:
    """Plan one cell; raises the planner's :class:`AutopartitionError` for a refused one."""
    from partitioner.modelfile import load_model_file
    from partitioner.search.planner import compile

    entry = MODELS[model]
    model_file = load_model_file(str(ROOT / entry.spec))
    make_target = model_file.example_target if model_file.loss_fn is not None else None  # the loss's cost
    target = make_target(entry.batch) if make_target is not None else None
    dp = 2 if schedule == "auto" else 1
    return compile(model_file.build(), model_file.example_inputs(entry.batch), gpus=2 * dp, pp=2, dp=dp,
                   microbatches="auto" if schedule == "auto" else entry.microbatches, schedule=schedule, device="h100",
                   loss_fn=model_file.loss_fn, target=target)


def run_cell(model: str, schedule: str, workdir: Path, *, steps: int = 2) -> CellResult:
    """Plan and verify one cell; never raises for the model's outcome."""
    from runtime.verify import verify

    start = time.perf_counter()
    try:
        plan = plan_cell(model, schedule)
    except AutopartitionError as exc:
        return CellResult(model, schedule, "refused", _first_line(str(exc)), seconds=time.perf_counter() - start)
    chosen = f"{plan.pp}x{plan.dp} {plan.schedule}" + (f" v{plan.chunks}" if plan.chunks > 1 else "") + \
        f" M{plan.microbatches}"
    plan_dir = workdir / f"{model}-{schedule}"
    plan.save(plan_dir)
    try:
        result = verify(plan_dir, str(ROOT / MODELS[model].spec), steps=steps)
    except Exception as exc:  # noqa: BLE001 - a cell reports whatever stopped it
        return CellResult(model, schedule, "FAILED", f"{type(exc).__name__}: {_first_line(str(exc))}", chosen,
                          time.perf_counter() - start)
    outcome = "verified" if result.ok else "FAILED"
    return CellResult(model, schedule, outcome, result.summary(), chosen, time.perf_counter() - start)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]


def _table(results: list[CellResult], schedules: list[str]) -> str:
    rows = ["| model | " + " | ".join(schedules) + " |", "|---" * (len(schedules) + 1) + "|"]
    by_cell = {(r.model, r.schedule): r for r in results}
    for model in dict.fromkeys(r.model for r in results):
        cells = []
        for schedule in schedules:
            r = by_cell.get((model, schedule))
            cells.append("" if r is None else r.outcome if r.outcome != "refused" else f"refused: {r.detail[:80]}")
        rows.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated rows (default: all)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated columns")
    parser.add_argument("--json", help="also write every cell's result here")
    args = parser.parse_args(argv)
    models, schedules = args.models.split(","), args.schedules.split(",")
    results: list[CellResult] = []
    with tempfile.TemporaryDirectory(prefix="autopartition-matrix-") as work:
        for model in models:
            for schedule in schedules:
                r = run_cell(model, schedule, Path(work))
                print(f"{model:18} {schedule:17} {r.outcome:9} {r.seconds:5.1f}s  {r.chosen:24} {r.detail[:140]}",
                      file=sys.stderr, flush=True)
                results.append(r)
    print(_table(results, schedules))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.outcome != "FAILED" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
