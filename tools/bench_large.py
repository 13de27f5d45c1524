"""Plan real model sizes: Llama 3 70B / 405B and GPT-3 175B on 64 to 1,024 H100s, on this machine.

Commands (from the repository root)::

    .venv/bin/python tools/bench_large.py                  # every case below, one fresh process each
    .venv/bin/python tools/bench_large.py --only llama3-70b,gpt3-175b
    .venv/bin/python tools/bench_large.py --quick          # tiny Llama and GPT on 8 GPUs, < 1 min
    .venv/bin/python tools/bench_large.py --json large.json
    .venv/bin/python tools/bench_large.py --published       # published layouts priced beside ours
    .venv/bin/python tools/bench_large.py --published --only 70b-64-megatron,8b-8-torchtitan

Cases (all ``--device h100``, ``precision="bf16-mixed"``, ``optimizer="adam"``,
``recompute="auto"``, ``microbatches="auto"``, ``schedule="auto"``, 8 GPUs per node):

==============  ==============================  =====  ============================  =============
case            model file                      GPUs   batch (sequences x tokens)    targets
==============  ==============================  =====  ============================  =============
llama3-70b      examples/llama.py:llama3_70b      64     256 x 4,096 = 1 M tokens     < 60 s, < 2 GB
llama3-405b     examples/llama.py:llama3_405b  1,024   1,024 x 4,096 = 4 M tokens     < 3 min, < 4 GB
llama3-405b-8m  examples/llama.py:llama3_405b  1,024   2,048 x 4,096 = 8 M tokens     < 90 s, < 4 GB
gpt3-175b       examples/gpt3.py:gpt3_175b       512   1,536 x 2,048 = 3.2 M tokens   (reported)
gpt3-xl         examples/gpt3.py:gpt3_xl           8      32 x 2,048                  (reported)
==============  ==============================  =====  ============================  =============

Batches: Llama 3 405B's first pre-training stage used 4 M-token batches of 4,096-token
sequences (Llama 3 paper, section 3.4.1); GPT-3 175B used 3.2 M tokens (Brown et al.
2020, Table 2.1); 70B gets 1 M tokens on its 64 GPUs.  The batch is fixed and the
planner chooses pp x dp x micro-batches (so sequences per replica follow from dp).
``gpt3-xl`` is the 1.3B GPT of issue 8 (24 layers, d 2,048, seq 2,048) on 8 H100s.

For every case a fresh interpreter (``tools/bench_large.py --child CASE``) builds the
model on the meta device and runs ``partitioner.compile``; it reports

* the planner's wall time (``compile`` alone) and the process's peak RSS right after
  it (``ru_maxrss``, imports and the model file included; the parent also reads the
  whole child's peak through ``os.wait4``);
* the chosen pp x dp x M, schedule, recomputation per stage, predicted MFU and step;
* the hand-made splits people use today, at the *same* pp x dp x M, schedule and
  stages per rank (an interleaved or zbv plan's pp x chunks stages are split by
  hand over the same ranks), with the same cost model, the same per-stage recomputation rule and the same
  simulator: **equal layers** (Megatron-LM's default: L / pp transformer layers per
  stage, the embedding with the first stage, the final norm and LM head with the
  last; ``tools.benchplanner.baselines.equal_layers``) and **first/last lighter**
  (torchtitan ``generate_llm_fqn_per_model_part`` with input and output weights 1:
  the embedding and the head each count as one layer, so the first and last stages
  get one layer fewer, as in the Llama 3 405B run, paper section 3.3.2).

How a hand-made split is evaluated: ``compile`` builds a plan for each of its best
shapes with ``partitioner.search.assemble.build_plan(..., solved, ...)``.  This tool records
those calls and, for the chosen shape, calls ``build_plan`` again with the solver's
``Partition`` replaced by the hand-made one (stages of the solver blocks: each block
belongs to the embeddings, a transformer layer, or the head by its module path).
The resulting plan is simulated exactly as ours is.  (The recorder keeps the
captured graph of the best few shapes alive until the end of ``compile``; ``compile``
itself holds two of them while it re-captures, so the peak RSS hardly moves.)

Exit status: 0 when every target is met and ours is never slower than a hand-made
split that fits; 1 otherwise.

Published layouts (``--published``, issue 22): the layouts practitioners chose by hand,
each priced by our own cost model (``partitioner.search.price.price_layout``: every
degree fixed, the split solved for it, simulated as any plan) beside the best plan
``--tp auto`` finds and today's best (``--tp 1``), at the published GPUs, batch and
sequence length, bf16-mixed with Adam on 80 GB H100s, or at ``--precision fp8`` with the
run's FP8 recipe where the run trained in FP8 (Megatron-Bridge's FP8-CS, torchtitan's Float8:
``tensorwise``; the searches beside it alike) (a layout that does not fit is
priced without the limit and marked).  What is priced (:data:`PUBLISHED`, from
``tools/published_runs.py``, which also holds each published figure):

====================  ======  =================  =========================================================
group                 GPUs    batch x seq        published layout (source)
====================  ======  =================  =========================================================
70b-64-megatron           64    128 x 8,192      TP4 x PP8 (VP5) x DP2, distributed optimizer, MBS 1
                                                 (Megatron-Bridge performance summary, 25.11, DGX-H100)
70b-256-torchtitan       256    512 x 8,192      TP8 x FSDP32, local batch 16, full AC
                                                 (torchtitan benchmarks/asyncTP_llama3_h100_2025-06, bf16)
405b-8k-llama3         8,192  2,048 x 8,192      TP8 x PP16 x FSDP64, 32 sequences per replica: the Llama 3
                                                 paper's 8K-GPU row (Table 4; the 16K row doubles DP)
405b-512-torchtitan      512    256 x 8,192      TP8 x PP8 x FSDP8, interleaved 1F1B, local batch 32, full AC
                                                 (torchtitan benchmarks, Table 5)
405b-1024-megatron     1,024  1,024 x 4,096      TP8 x PP8 (VP8) x DP8 x CP2, distributed optimizer: CP2 is
                                                 priced as DP16 on half-length sequences (the same 4 M
                                                 tokens; Megatron-Bridge 25.11, DGX-H100: 512 x 8,192)
8b-8-torchtitan            8     16 x 8,192      FSDP8, local batch 2, selective AC priced as full
                                                 (torchtitan benchmarks, Table 1)
====================  ======  =================  =========================================================

Published throughputs were measured with FP8 (Megatron-Bridge) or Float8 and
torch.compile (torchtitan) on their own machines; ours are bf16-mixed predictions.
Schedules not published are our choice and said so (torchtitan 405B and Llama 3:
interleaved 1F1B with 2 stages per rank).  Megatron-LM's tensor-parallel collectives
and our prediction assume sequence parallelism.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.benchplanner.baselines import equal_layers, format_runs
from tools.published_runs import run_named

__all__ = [
    "CASES",
    "PUBLISHED",
    "QUICK_CASES",
    "Case",
    "PublishedGroup",
    "block_units",
    "equal_layer_split",
    "first_last_lighter_split",
    "main",
    "print_published",
    "print_shard_table",
    "published_row",
    "run_published_child",
    "summarize_recompute",
]

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    spec: str  # model file, relative to the repository root
    gpus: int
    batch: int
    seq: int
    wall_target_s: float | None = None
    rss_target_bytes: float | None = None
    device: str = "h100"
    gpus_per_node: int = 8

    def describe(self) -> str:
        return f"{self.spec} on {self.gpus} {self.device.upper()}s, batch {self.batch} x {self.seq}"


CASES: tuple[Case, ...] = (
    Case("llama3-70b", "examples/llama.py:llama3_70b", 64, 256, 4096, 60.0, 2e9),
    Case("llama3-405b", "examples/llama.py:llama3_405b", 1024, 1024, 4096, 180.0, 4e9),
    # Twice the batch: every replica's micro-batches are one sample, the size the graph is not costed at.
    Case("llama3-405b-8m", "examples/llama.py:llama3_405b", 1024, 2048, 4096, 90.0, 4e9),
    Case("gpt3-175b", "examples/gpt3.py:gpt3_175b", 512, 1536, 2048),
    Case("gpt3-xl", "examples/gpt3.py:gpt3_xl", 8, 32, 2048),
)
QUICK_CASES: tuple[Case, ...] = (
    Case("tiny-llama", "examples/llama.py", 8, 128, 32, 60.0, 2e9),
    Case("tiny-gpt", "examples/gpt3.py", 8, 32, 32, 60.0, 2e9),
)

# Planner options of every case (issue 8); dropped, with a note, where this planner lacks them.
OPTIONS: dict[str, Any] = {
    "precision": "bf16-mixed",
    "optimizer": "adam",
    "recompute": "auto",
    "microbatches": "auto",
    "schedule": "auto",
    "shard": "auto",
}
LEGACY = {"microbatches": 8, "schedule": "gpipe"}  # for a planner without precision/auto support


@dataclasses.dataclass(frozen=True)
class PublishedGroup:
    """A published layout (or several) with the model, GPUs, batch and sequence length it was run at."""

    name: str
    spec: str  # model file: the factory builds the shape, inputs are (batch, seq) token ids
    gpus: int
    batch: int
    seq: int
    layouts: tuple[dict[str, Any], ...]  # partitioner.search.price.Layout keywords
    note: str = ""
    search_tp: bool = True  # also plan it ourselves with --tp auto and --tp 1 (the larger ones take minutes)
    precision: str = "bf16-mixed"  # the run's: "fp8" for a published FP8 run (searches priced alike)
    fp8_recipe: str = ""  # its FP8 scaling (tools/published: PublishedRun.fp8_recipe)


# The layouts are tools/published_runs.py's (one list for this tool and tools/calibrate_published.py).
_PUBLISHED_HERE: tuple[tuple[str, str, bool], ...] = (  # (run, note, search_tp)
    ("70b-64-megatron", "", True),
    ("70b-256-torchtitan", "", True),
    ("405b-8k-llama3", "the 16,384-GPU row (DP128, 16 sequences per replica) is the same layout twice as wide", False),
    ("405b-512-torchtitan", "", True),
    ("405b-1024-megatron", "CP2 priced as DP16 on 4,096-token halves of the published 512 x 8,192", True),
    ("8b-8-torchtitan", ("per-op selective activation checkpointing priced as full recomputation here "
     "(tools/calibrate_published.py prices it as full less half the recomputed forward)"), True),
)
PUBLISHED: tuple[PublishedGroup, ...] = tuple(
    PublishedGroup(run.name, run.spec, run.gpus, run.batch, run.seq, ({**run.layout, "source": run.cite()},),
                   note=note, search_tp=search_tp, precision="fp8" if run.fp8 else "bf16-mixed",
                   fp8_recipe=run.fp8_recipe)
    for run, note, search_tp in ((run_named(name), note, search_tp) for name, note, search_tp in _PUBLISHED_HERE))

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(?:\.|$)")
_HEAD = ("lm_head", "ln_f", "norm", "model.norm", "output", "final_layernorm")


# ----------------------------------------------------------------- hand-made splits


def block_units(paths: Sequence[str], n_layers: int) -> list[int]:
    """The unit of each solver block: 0 embeddings (and other model-level prologue), i + 1 layer i, L + 1 head.

    ``paths`` is the module path of each block's first node.  A block outside any
    module (root-level glue) joins the previous block's unit.

    >>> block_units(["model.embed_tokens", "model.rotary_emb", "model.layers.0.mlp",
    ...              "", "model.layers.1", "model.norm", "lm_head"], n_layers=2)
    [0, 0, 1, 1, 2, 3, 3]
    >>> block_units(["wte", "", "blocks.0.attn", "blocks.1.ln_1", "ln_f"], n_layers=2)
    [0, 0, 1, 2, 3]
    """
    units: list[int] = []
    for path in paths:
        match = _LAYER.search(path)
        if match:
            units.append(int(match.group(1)) + 1)
        elif path in _HEAD or path.split(".")[-1] in ("lm_head", "ln_f") or path == "model.norm":
            units.append(n_layers + 1)
        elif path == "":
            units.append(units[-1] if units else 0)
        else:
            units.append(0)
    return units


def equal_layer_split(n_layers: int, stages: int) -> tuple[int, ...] | None:
    """Stage of each unit (embeddings, L layers, head) for Megatron's equal layers per stage.

    ``L // P`` layers per stage, one more for the first ``L % P`` stages (DeepSpeed's
    ``partition_uniform``; Megatron needs ``P | L``); embeddings with the first stage,
    head with the last.  None when there are fewer layers than stages.

    >>> equal_layer_split(4, 2)
    (0, 0, 0, 1, 1, 1)
    """
    if stages > n_layers:
        return None
    return (0, *equal_layers(n_layers, stages), stages - 1)


def first_last_lighter_split(n_layers: int, stages: int) -> tuple[int, ...] | None:
    """Stage of each unit when the embeddings and the head each count as one layer.

    torchtitan's ``generate_llm_fqn_per_model_part(P, L, input_weight=1, output_weight=1)``:
    ``L + 2`` effective layers, ``(L + 2) // P`` per stage, one more for the first
    ``(L + 2) % P`` stages; so the first and the last stage hold one layer fewer (Llama 3
    405B: 126 layers on 16 stages = 7, 8 x 14, 7).  None when a stage would get no unit.

    >>> first_last_lighter_split(2, 2)
    (0, 0, 1, 1)
    """
    if stages > n_layers + 2:
        return None
    return equal_layers(n_layers + 2, stages)


def layers_per_stage(unit_stage: Sequence[int], stages: int) -> str:
    """Transformer layers per stage (the units less the embeddings and the head), as runs.

    >>> layers_per_stage(first_last_lighter_split(126, 16), 16)
    '7|8x14|7'
    >>> layers_per_stage((0, 0, 0, 1, 1), 2)
    '2|1'
    """
    counts = [0] * stages
    for s in unit_stage[1:-1]:
        counts[s] += 1
    return format_runs(counts)


def summarize_recompute(choices: Sequence[str]) -> str:
    """Per-stage recomputation as runs: ``none 0-1, full 2-7``; ``-`` when unknown.

    >>> summarize_recompute(["none", "none", "full", "full", "full"])
    'none 0-1, full 2-4'
    >>> summarize_recompute(["full"])
    'full 0'
    """
    if not choices:
        return "-"
    runs: list[list[Any]] = []
    for s, c in enumerate(choices):
        if runs and runs[-1][0] == c:
            runs[-1][2] = s
        else:
            runs.append([c, s, s])
    return ", ".join(f"{c} {a}" if a == b else f"{c} {a}-{b}" for c, a, b in runs)


def _repair(stage_of: list[int], edges: Sequence[tuple[int, int]]) -> list[int]:
    """Move blocks later where a reader sits in an earlier stage than its producer (root-level glue)."""
    out = list(stage_of)
    preds: dict[int, list[int]] = {}
    for u, v in edges:
        preds.setdefault(v, []).append(u)
    for v in range(len(out)):
        for u in preds.get(v, ()):
            out[v] = max(out[v], out[u])
    return out


# ----------------------------------------------------------------- the child


class _Recorder:
    """Wraps ``partitioner.search.assemble.build_plan``: remembers the last call per (pp, dp, M, schedule).

    The planner calls it as ``assemble.build_plan``, so patching the module attribute takes
    effect (a planner from before the split: ``partitioner.search.planner._build_plan``).
    """

    def __init__(self) -> None:
        module: ModuleType
        try:
            module, name = importlib.import_module("partitioner.search.assemble"), "build_plan"
        except ImportError:  # a planner from before partitioner.search.assemble
            module, name = importlib.import_module("partitioner.search.planner"), "_build_plan"
        self.module, self.name = module, name
        self.original = getattr(module, name)
        self.calls: dict[tuple[Any, ...], tuple[tuple[Any, ...], dict[str, Any]]] = {}

        def recorded(*args: Any, **kwargs: Any) -> Any:
            plan = self.original(*args, **kwargs)
            self.calls[_shape(plan)] = (args, kwargs)
            return plan

        setattr(module, name, recorded)

    def restore(self) -> None:
        setattr(self.module, self.name, self.original)


def _shape(plan: Any) -> tuple[Any, ...]:
    """The recorder's key: pp x dp x M, schedule, stages per rank (a planner before chunks: 1) and shard modes."""
    shards = tuple(dict.fromkeys(getattr(s, "shard", "none") for s in plan.stages))
    return (plan.pp, plan.dp, plan.microbatches, plan.schedule, getattr(plan, "chunks", 1), shards)


def _stage_count(plan: Any) -> int:
    """Stages of a plan or a solved combination: pp x chunks (``len(plan.stages)``; ``Solved.stages``)."""
    stages = getattr(plan, "stages", None)
    if isinstance(stages, int):
        return stages
    return len(stages) if stages is not None else int(plan.pp)


def _gpu_peak(plan: Any) -> float:
    """Peak bytes on the fullest GPU: the largest stage with one stage per rank, else the fullest rank's.

    A rank holding several stages holds them all at once, so its simulated peak
    (``predicted.peak_memory_bytes``, per pipeline rank) is what has to fit.
    """
    stage_peak = max(s.predicted.memory_bytes for s in plan.stages)
    if getattr(plan, "chunks", 1) == 1:
        return float(stage_peak)
    return float(max(plan.predicted.peak_memory_bytes, default=stage_peak))


def _find(values: Sequence[Any], test: Callable[[Any], bool]) -> tuple[int, Any]:
    for i, v in enumerate(values):
        if test(v):
            return i, v
    raise LookupError("not found")


def _optional_kwargs(function: Callable[..., Any], wanted: dict[str, Any]) -> dict[str, Any]:
    names = inspect.signature(function).parameters
    return {k: v for k, v in wanted.items() if k in names}


def _evaluate_split(
    recorder: _Recorder, plan: Any, unit_stage: Sequence[int], n_layers: int
) -> dict[str, Any]:
    """Our chosen shape, with the hand-made split of the units: closed form, simulation, memory."""
    from partitioner.graph.ir import module_path
    from partitioner.solve import problem as problem_module

    args, kwargs = recorder.calls[_shape(plan)]
    values = list(args) + list(kwargs.values())
    index, solved = _find(values, lambda v: type(v).__name__ in ("Solved", "_Solved"))
    _, graph = _find(values, lambda v: hasattr(v, "blocks") and hasattr(v, "node_time_s"))
    _, captured = _find(values, lambda v: hasattr(v, "graph_module") and hasattr(v, "nodes"))
    problem, stages = solved.problem, _stage_count(solved)  # pp x chunks stages, placed by problem.stage_rank
    nodes = captured.nodes()
    units = block_units([module_path(nodes[members[0]]) for members in graph.blocks], n_layers)
    stage_of = _repair([unit_stage[u] for u in units], problem.edges)
    stage_of[-1] = stages - 1
    why = problem_module.check_assignment(problem, stage_of, stages)
    if why is not None:
        return {"error": f"invalid split: {why}"}
    microbatches, schedule = plan.microbatches, plan.schedule
    recompute, ops = _choose_recompute(problem, stage_of, stages, microbatches, schedule)
    closed_kwargs = _optional_kwargs(
        problem_module.step_time, {"recompute": recompute, "schedule": schedule, "ops": ops}
    )
    closed, _ = problem_module.step_time(
        problem, stage_of, microbatches=microbatches, **closed_kwargs
    )
    changes: dict[str, Any] = {
        "stage_of": tuple(stage_of),
        "objective": closed,
        "solver": "hand-made",
        "status": "feasible",
    }
    fields = {f.name for f in dataclasses.fields(solved.partition)}
    if recompute is not None and "recompute" in fields:
        changes["recompute"] = tuple(recompute)
    if ops is not None and "recompute_ops" in fields:
        changes["recompute_ops"] = tuple(ops)
    partition = dataclasses.replace(solved.partition, **changes)
    replaced = dataclasses.replace(solved, partition=partition)
    if index < len(args):
        new_args = list(args)
        new_args[index] = replaced
        built = recorder.original(*new_args, **kwargs)
    else:
        key = list(kwargs)[index - len(args)]
        built = recorder.original(*args, **{**kwargs, key: replaced})
    peak = _gpu_peak(built)
    limit = built.cost_model.memory_limit
    return {
        "split": layers_per_stage(unit_stage, stages),
        "closed_s": closed,
        "step_s": built.predicted.step_s,
        "mfu": getattr(built.predicted, "mfu", None),
        "peak_bytes": peak,
        "fits": limit is None or peak <= limit * (1 + 1e-9),
        "recompute": summarize_recompute(_stage_recompute(built)),
        "stage_compute_s": _stage_compute(built),
    }


def _choose_recompute(
    problem: Any, stage_of: Sequence[int], stages: int, microbatches: int, schedule: str
) -> tuple[list[Any] | None, list[int] | None]:
    """The planner's own per-stage recomputation rule for a given split, if this planner has one:
    (per-stage choice, per-stage blocks recomputing only their cheap ops, None where not known).

    Where the planner also spends each rank's exact headroom on recomputing less, or only
    cheap ops (``partitioner.solve.headroom``), the hand-made split gets that too.
    """
    from partitioner.solve import problem as problem_module

    choose = getattr(problem_module, "choose_recompute", None)
    if choose is None:
        return None, None
    wanted = {"stages": stages, "microbatches": microbatches, "schedule": schedule}
    result = choose(problem, stage_of, **_optional_kwargs(choose, wanted))
    if result is None:
        return None, None
    try:
        from partitioner.solve.headroom import spend_rank_headroom
    except ImportError:  # a planner from before it
        return list(result), None
    recompute, ops = spend_rank_headroom(problem, stage_of, stages, recompute=result, microbatches=microbatches,
                                         schedule=schedule)  # type: ignore[arg-type]
    return list(recompute), list(ops)


def _stage_recompute(plan: Any) -> list[str]:
    """Per stage: ``none``, ``full``, ``selective`` (its first layers wholly), ``ops`` (some layers only their
    cheap ops) or ``selective+ops``."""
    out = []
    for s in plan.stages:
        value = getattr(s, "recompute", None)
        if value is None:
            return []
        if value == "selective":
            whole, cheap = getattr(s, "recompute_layers", 1), getattr(s, "recompute_ops_layers", 0)
            value = "selective+ops" if whole and cheap else "ops" if cheap else "selective"
        out.append(value if isinstance(value, str) else ("full" if value else "none"))
    return out


def _stage_compute(plan: Any) -> list[float]:
    """Forward + backward seconds of each stage per micro-batch (recomputation included)."""
    return [s.predicted.forward_s + s.predicted.backward_s for s in plan.stages]


def _n_layers(model: Any) -> int:
    config = getattr(model, "config", None)
    for name in ("num_hidden_layers", "n_layer"):
        if config is not None and hasattr(config, name):
            return int(getattr(config, name))
    raise ValueError(f"cannot tell the layer count of {type(model).__name__}")


def run_child(case: Case) -> dict[str, Any]:
    """Plan one case in this process; the result as a JSON-ready dict."""
    start = time.perf_counter()
    import torch

    from partitioner.modelfile import load_model_file
    from partitioner.search.planner import compile

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model_file = load_model_file(str(ROOT / case.spec))
    model = model_file.build()
    inputs = model_file.example_inputs(case.batch)
    parameters = sum(p.numel() for p in model.parameters())
    setup_s = time.perf_counter() - start
    options = dict(OPTIONS, gpus_per_node=min(case.gpus_per_node, case.gpus))
    supported = _optional_kwargs(compile, options)
    notes = [f"planner lacks {k}" for k in options if k not in supported]
    from partitioner.search import planner

    if "precision" not in supported or getattr(planner, "AUTO", None) != "auto":
        supported.update(LEGACY)  # a planner that cannot search M and the schedule
        notes.append("legacy: M = 8, gpipe")
    recorder = _Recorder()
    status: list[str] = []

    def say(message: str) -> None:
        status.append(message)
        if not message.startswith(("counting costs", "measuring costs")):
            print(
                f"    [{case.name} {time.perf_counter() - start:6.1f} s] {message}",
                file=sys.stderr,
                flush=True,
            )

    t0 = time.perf_counter()
    try:
        plan = compile(model, inputs, gpus=case.gpus, device=case.device, status=say, **supported)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        recorder.restore()
        return {
            "case": case.name,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "wall_s": time.perf_counter() - t0,
            "rss_bytes": _self_rss(),
            "notes": notes,
            "parameters": parameters,
        }
    wall = time.perf_counter() - t0
    rss = _self_rss()
    recorder.restore()
    n_layers = _n_layers(model)
    stages = _stage_count(plan)  # a hand-made split has as many stages as ours, on the same ranks
    baselines: dict[str, Any] = {}
    for name, split in (
        ("equal layers", equal_layer_split(n_layers, stages)),
        ("first/last lighter", first_last_lighter_split(n_layers, stages)),
    ):
        if split is None:
            baselines[name] = {"error": f"{stages} stages > {n_layers} layers"}
            continue
        try:
            baselines[name] = _evaluate_split(recorder, plan, split, n_layers)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            baselines[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    predicted = plan.predicted
    ddp = None
    if "shard" in supported:
        # Every stage group DDP already: the DDP-only search chooses the same plan (its trials are a subset).
        ddp = _ddp_only(case, compile, model, inputs, supported) if set(_stage_shard(plan)) != {"none"} else \
            _plan_row(plan)
    return {
        "ddp": ddp,
        "shard": summarize_recompute(_stage_shard(plan)),
        "bubble": predicted.bubble_fraction,
        "case": case.name,
        "parameters": parameters,
        "setup_s": setup_s,
        "wall_s": wall,
        "rss_bytes": rss,
        "pp": plan.pp,
        "dp": plan.dp,
        "microbatches": plan.microbatches,
        "schedule": plan.schedule,
        "chunks": getattr(plan, "chunks", 1),
        "precision": getattr(plan, "precision", None),
        "recompute": summarize_recompute(_stage_recompute(plan)),
        "step_s": predicted.step_s,
        "closed_s": plan.solver.objective,
        "mfu": getattr(predicted, "mfu", None),
        "peak_bytes": _gpu_peak(plan),
        "memory_limit": plan.cost_model.memory_limit,
        "solver": f"{plan.solver.name} ({plan.solver.status}, {plan.solver.blocks} blocks)",
        "candidates": len(plan.candidates),
        "ours_split": _ours_split(plan),
        "stage_compute_s": _stage_compute(plan),
        "baselines": baselines,
        "notes": notes,
    }


def run_published_child(group: PublishedGroup) -> dict[str, Any]:
    """Price ``group``'s layouts and, where ``search_tp``, plan it with --tp auto and --tp 1: rows for the table."""
    import torch

    from partitioner.modelfile import load_model_file
    from partitioner.search.planner import compile
    from partitioner.search.price import Layout, price_layout

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model = load_model_file(str(ROOT / group.spec)).build()
    inputs = (torch.zeros(group.batch, group.seq, dtype=torch.long),)
    common: dict[str, Any] = {"device": "h100", "precision": group.precision, "optimizer": "adam",
                              "gpus_per_node": min(8, group.gpus)}
    if group.fp8_recipe:  # a published FP8 run: its layout and our searches priced at --precision fp8
        common["fp8_recipe"] = group.fp8_recipe
    rows: list[dict[str, Any]] = []

    def say(message: str) -> None:
        if not message.startswith(("counting costs", "measuring costs")):
            print(f"    [{group.name}] {message}", file=sys.stderr, flush=True)

    searches = (("ours (--tp auto)", "auto"), ("today (--tp 1)", 1)) if group.search_tp else ()
    for label, tp in searches:
        t0 = time.perf_counter()
        try:
            plan = compile(model, inputs, gpus=group.gpus, tp=tp, microbatches="auto", schedule="auto",
                           recompute="auto", shard="auto", status=say, **common)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append({"layout": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        limit = plan.cost_model.memory_limit
        rows.append(published_row(label, plan, tokens_per_sample=group.seq,
                                  fits=limit is None or _gpu_peak(plan) <= limit * (1 + 1e-9),
                                  wall_s=time.perf_counter() - t0))
    for keywords in group.layouts:
        layout = Layout(gpus=group.gpus, **keywords)
        t0 = time.perf_counter()
        try:
            priced = price_layout(model, inputs, layout, tokens_per_sample=group.seq, status=say, **common)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append({"layout": layout.name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        rows.append(published_row(layout.name, priced.plan, tokens_per_sample=group.seq, fits=priced.fits,
                                  wall_s=time.perf_counter() - t0, source=layout.source))
    return {"group": group.name, "gpus": group.gpus, "batch": group.batch, "seq": group.seq,
            "note": group.note, "rows": rows}


def published_row(label: str, plan: Any, *, tokens_per_sample: int, fits: bool, wall_s: float,
                  source: str = "") -> dict[str, Any]:
    """One table row from a plan: layout, step, tokens/s/GPU, MFU, peak memory, fits.

    >>> from partitioner.plan import example_plan
    >>> row = published_row("x", example_plan(), tokens_per_sample=10, fits=True, wall_s=1.0)
    >>> row["layout"], row["tp"], row["fits"], row["tokens_per_s_per_gpu"] > 0
    ('x', 1, True, True)
    """
    step = plan.predicted.step_s
    return {
        "layout": label,
        "tp": getattr(plan, "tp", 1), "pp": plan.pp, "dp": plan.dp, "chunks": getattr(plan, "chunks", 1),
        "microbatches": plan.microbatches, "schedule": plan.schedule,
        "shard": summarize_recompute(_stage_shard(plan)), "recompute": summarize_recompute(_stage_recompute(plan)),
        "step_s": step, "mfu": plan.predicted.mfu, "peak_bytes": _gpu_peak(plan), "fits": fits,
        "tokens_per_s_per_gpu": plan.batch_size * tokens_per_sample / step / plan.gpus if step > 0 else 0.0,
        "wall_s": wall_s, "source": source,
    }


def print_published(results: list[dict[str, Any]]) -> bool:
    """The published-layouts table; True when ours (--tp auto) is at least as fast as every published layout.

    >>> rows = [{"layout": "ours (--tp auto)", "tp": 4, "pp": 8, "dp": 2, "chunks": 1, "microbatches": 64,
    ...          "schedule": "1f1b", "shard": "none", "recompute": "none", "step_s": 10.0, "mfu": 0.5,
    ...          "peak_bytes": 7e10, "fits": True, "tokens_per_s_per_gpu": 1000.0, "wall_s": 50.0, "source": ""},
    ...         {"layout": "pub", "tp": 4, "pp": 8, "dp": 2, "chunks": 5, "microbatches": 64,
    ...          "schedule": "interleaved-1f1b", "shard": "optimizer", "recompute": "none", "step_s": 11.0,
    ...          "mfu": 0.45, "peak_bytes": 9e10, "fits": False, "tokens_per_s_per_gpu": 900.0, "wall_s": 20.0,
    ...          "source": "x"}]
    >>> print_published([{"group": "g", "gpus": 64, "batch": 128, "seq": 8192, "note": "", "rows": rows}])
    ... # doctest: +NORMALIZE_WHITESPACE
    | group | layout | TP x PP x DP | M, schedule | shard / recompute | step s | tokens/s/GPU | MFU | peak GB | fits | plan s |
    |---|---|---|---|---|---|---|---|---|---|---|
    | g (64 GPUs, 128 x 8192) | ours (--tp auto) | 4 x 8 x 2 | 64, 1f1b | none / none | 10 | 1000 | 50% | 70.00 | yes | 50.0 |
    | g (64 GPUs, 128 x 8192) | pub | 4 x 8 x 2 | 64, interleaved-1f1b x5 | optimizer / none | 11 | 900 | 45% | 90.00 | no | 20.0 |
    True
    """
    header = ["group", "layout", "TP x PP x DP", "M, schedule", "shard / recompute", "step s", "tokens/s/GPU",
              "MFU", "peak GB", "fits", "plan s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    ok = True
    for result in results:
        where = f"{result['group']} ({result.get('gpus')} GPUs, {result.get('batch')} x {result.get('seq')})"
        if "error" in result:
            print(f"| {where} | {result['error']} |" + " |" * (len(header) - 2))
            ok = False
            continue
        ours = next((r.get("step_s") for r in result["rows"] if r["layout"].startswith("ours") and "error" not in r),
                    None)
        for r in result["rows"]:
            if "error" in r:
                print(f"| {where} | {r['layout']} | {r['error']} |" + " |" * (len(header) - 3))
                continue
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.0f}%"
            print(f"| {where} | {r['layout']} | {r['tp']} x {r['pp']} x {r['dp']} | "
                  f"{r['microbatches']}, {_schedule_cell(r)} | {r['shard']} / {r['recompute']} | {_s(r['step_s'])} | "
                  f"{r['tokens_per_s_per_gpu']:.0f} | {mfu} | {_gb(r['peak_bytes'])} | {'yes' if r['fits'] else 'no'} | "
                  f"{r['wall_s']:.1f} |")
            if ours is not None and r["source"] and r["fits"] and ours > r["step_s"] * (1 + 1e-9):
                ok = False
    return ok


def _stage_shard(plan: Any) -> list[str]:
    return [getattr(s, "shard", "none") for s in plan.stages]


def _ddp_only(case: Case, compile: Callable[..., Any], model: Any, inputs: Any,
              supported: dict[str, Any]) -> dict[str, Any]:
    """The best plan with every stage group DDP (``shard="none"``), for the side-by-side table."""
    t0 = time.perf_counter()
    try:
        plan = compile(model, inputs, gpus=case.gpus, device=case.device, **{**supported, "shard": "none"})
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"wall_s": time.perf_counter() - t0, **_plan_row(plan)}


def _plan_row(plan: Any) -> dict[str, Any]:
    """A plan's shape, modes and predictions for the side-by-side table."""
    return {
        "pp": plan.pp, "dp": plan.dp, "microbatches": plan.microbatches, "schedule": plan.schedule,
        "chunks": getattr(plan, "chunks", 1), "shard": summarize_recompute(_stage_shard(plan)),
        "recompute": summarize_recompute(_stage_recompute(plan)), "step_s": plan.predicted.step_s,
        "bubble": plan.predicted.bubble_fraction, "peak_bytes": _gpu_peak(plan), "mfu": plan.predicted.mfu,
    }


# Issue 21's target: sharding shortens 70B/64's step by at least 25% against the DDP-only plan, on at most 16
# pipeline ranks.
SHARD_TARGETS: dict[str, tuple[float, int]] = {"llama3-70b": (0.25, 16)}


def _shard_problems(result: dict[str, Any]) -> list[str]:
    target = SHARD_TARGETS.get(result["case"])
    ddp = result.get("ddp")
    if target is None or "error" in result or not ddp or "error" in ddp:
        return []
    shorter, most = target
    problems = []
    gain = 1 - result["step_s"] / ddp["step_s"]
    if gain < shorter:
        problems.append(f"{result['case']}: sharding shortens the step by {gain:.1%} < {shorter:.0%} "
                        f"({_s(result['step_s'])} s against DDP-only {_s(ddp['step_s'])} s)")
    if result["pp"] > most:
        problems.append(f"{result['case']}: sharded plan on {result['pp']} pipeline ranks > {most}")
    return problems


def print_shard_table(results: list[dict[str, Any]]) -> list[str]:
    """Each case's best plan with sharding (``--shard auto``) beside the DDP-only one; the targets missed."""
    rows = [r for r in results if "error" not in r and r.get("ddp")]
    if not rows:
        return []
    header = ["case", "plan", "pp x dp x M", "schedule", "shard per stage", "recompute per stage", "step s",
              "bubble", "peak GB", "step vs DDP-only"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    problems: list[str] = []
    for r in rows:
        ddp = r["ddp"]
        for label, x in (("shard auto", r), ("DDP only", ddp)):
            if "error" in x:
                print(f"| {r['case']} | {label} | error: {x['error']} |" + " - |" * 7)
                continue
            versus = "" if x is ddp or "error" in ddp else f"{100 * (x['step_s'] / ddp['step_s'] - 1):+.1f}%"
            print("| " + " | ".join([
                r["case"], label, f"{x['pp']} x {x['dp']} x {x['microbatches']}", _schedule_cell(x), x["shard"],
                x["recompute"], _s(x["step_s"]), f"{100 * x['bubble']:.1f}%", _gb(x["peak_bytes"]), versus or "-",
            ]) + " |")
        problems += _shard_problems(r)
    print()
    print("shard auto: the planner chooses each stage group's mode (none = DDP, optimizer, full) with pp x dp x M, "
          "the schedule and recomputation; DDP only: the same search with --shard none. Target (issue 21): "
          "70B/64 at least 25% shorter than DDP only, on at most 16 pipeline ranks.")
    return problems


def _ours_split(plan: Any) -> str:
    firsts = [s.modules[0] for s in plan.stages]
    if len(firsts) <= 6:
        return " | ".join(firsts)
    return (
        " | ".join(firsts[:3]) + f" | ... ({len(firsts) - 5} more) ... | " + " | ".join(firsts[-2:])
    )


def _self_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ----------------------------------------------------------------- the parent


def run_case(case: Case, *, timeout_s: float, quick: bool) -> dict[str, Any]:
    """``run_child`` in a fresh interpreter; adds the child's whole-process peak RSS and wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            case.name,
            "--result",
            str(out),
        ]
        if quick:
            cmd.append("--quick")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        elapsed = time.perf_counter() - start
        if out.exists():
            result: dict[str, Any] = json.loads(out.read_text())
        else:
            result = {
                "case": case.name,
                "error": f"child exited with {proc.returncode}"
                + (f" (killed after {timeout_s:.0f} s)" if elapsed >= timeout_s else ""),
            }
    result["process_s"] = elapsed
    result["load"] = os.getloadavg()[0]  # other work on the machine inflates wall times
    result["process_rss_bytes"] = usage.ru_maxrss * 1024
    return result


def _run_published(group: PublishedGroup, *, timeout_s: float) -> dict[str, Any]:
    """``run_published_child`` in a fresh interpreter (its own peak memory, nothing shared)."""
    print(f"  {group.name}: {group.spec} on {group.gpus} H100s, {group.batch} x {group.seq}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--published-child", group.name, "--result", str(out)]
        try:
            subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"group": group.name, "error": f"killed after {timeout_s:.0f} s"}
        if not out.exists():
            return {"group": group.name, "error": "child wrote no result"}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _s(x: float | None) -> str:
    """Seconds, 4 significant digits: ``12.35``, ``0.0001234``."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.4g}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _schedule_cell(result: dict[str, Any]) -> str:
    """The schedule, with its stages per rank where it chooses them (``interleaved-1f1b x2``).

    >>> _schedule_cell({"schedule": "interleaved-1f1b", "chunks": 2}), _schedule_cell({"schedule": "zbv", "chunks": 2})
    ('interleaved-1f1b x2', 'zbv')
    """
    chunks = result.get("chunks") or 1
    schedule = str(result["schedule"])
    return f"{schedule} x{chunks}" if schedule == "interleaved-1f1b" and chunks > 1 else schedule


def _baseline_cell(b: dict[str, Any], ours: float | None) -> str:
    if "error" in b:
        return f"n/a ({b['error']})"
    cell = f"{_s(b['step_s'])} ({b['split']})"
    if ours and b.get("step_s"):
        cell += f" {100 * (b['step_s'] / ours - 1):+.1f}%"
    if not b["fits"]:
        cell += f", over memory ({_gb(b['peak_bytes'])} GB)"
    return cell


def _ok(result: dict[str, Any], case: Case) -> tuple[bool, list[str]]:
    problems = []
    if "error" in result:
        return False, [f"{case.name}: {result['error']}"]
    if case.wall_target_s is not None and result["wall_s"] > case.wall_target_s:
        problems.append(
            f"{case.name}: planner {result['wall_s']:.1f} s > {case.wall_target_s:.0f} s"
        )
    if case.rss_target_bytes is not None and result["rss_bytes"] > case.rss_target_bytes:
        problems.append(
            f"{case.name}: peak RSS {_gb(result['rss_bytes'])} GB > {_gb(case.rss_target_bytes)} GB"
        )
    for name, b in result["baselines"].items():
        if "error" not in b and b["fits"] and result["step_s"] > b["step_s"] * (1 + 1e-9):
            problems.append(
                f"{case.name}: ours {_s(result['step_s'])} s slower than {name} {_s(b['step_s'])} s"
            )
    return not problems, problems


def print_results(results: list[dict[str, Any]], cases: dict[str, Case]) -> bool:
    """The markdown table and the notes under it; True when every target is met."""
    header = [
        "case",
        "params",
        "GPUs",
        "batch",
        "plan s (target)",
        "peak RSS GB (target)",
        "pp x dp x M",
        "schedule",
        "recompute per stage",
        "MFU",
        "step s (ours)",
        "equal layers",
        "first/last lighter",
        "ok",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    all_ok = True
    messages: list[str] = []
    for r in results:
        case = cases[r["case"]]
        ok, problems = _ok(r, case)
        all_ok &= ok
        messages += problems
        target_s = f" (< {case.wall_target_s:.0f})" if case.wall_target_s else ""
        target_b = f" (< {_gb(case.rss_target_bytes)})" if case.rss_target_bytes else ""
        params = (
            f"{r.get('parameters', 0) / 1e9:.1f} B"
            if r.get("parameters", 0) >= 1e8
            else f"{r.get('parameters', 0):,}"
        )
        if "error" in r:
            row = [
                case.name,
                params,
                str(case.gpus),
                f"{case.batch} x {case.seq}",
                f"{_s(r.get('wall_s'))}{target_s}",
                f"{_gb(r.get('rss_bytes'))}{target_b}",
                "error",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "NO",
            ]
        else:
            ours = r["step_s"]
            mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
            row = [
                case.name,
                params,
                str(case.gpus),
                f"{case.batch} x {case.seq}",
                f"{_s(r['wall_s'])}{target_s}",
                f"{_gb(r['rss_bytes'])}{target_b}",
                f"{r['pp']} x {r['dp']} x {r['microbatches']}",
                _schedule_cell(r),
                r["recompute"],
                mfu,
                _s(ours),
                _baseline_cell(r["baselines"]["equal layers"], ours),
                _baseline_cell(r["baselines"]["first/last lighter"], ours),
                "yes" if ok else "NO",
            ]
        print("| " + " | ".join(row) + " |")
    print()
    print(
        "plan s: compile() wall time in a fresh process (model built on meta before it); peak RSS: "
        "ru_maxrss of that process right after compile (imports included). Hand-made splits: "
        "simulated step at our pp x dp x M and schedule, same cost model and recomputation rule; "
        "in brackets the transformer layers per stage; % = slower (+) than ours."
    )
    for r in results:
        extra = []
        if "error" not in r:
            extra.append(
                f"ours: {r['ours_split']} [{r['solver']}, {r['candidates']} candidates; "
                f"closed form {_s(r['closed_s'])} s; slowest stage {_s(max(r['stage_compute_s']))} s; "
                f"peak {_gb(r['peak_bytes'])} GB of {_gb(r['memory_limit'])} GB]"
            )
            for name, b in r["baselines"].items():
                if "error" not in b:
                    extra.append(
                        f"{name}: recompute {b['recompute']}, closed form {_s(b['closed_s'])} s, "
                        f"slowest stage {_s(max(b['stage_compute_s']))} s, peak {_gb(b['peak_bytes'])} GB"
                    )
        extra.append(
            f"whole child process: {_s(r.get('process_s'))} s, peak RSS "
            f"{_gb(r.get('process_rss_bytes'))} GB; 1-min load average after it "
            f"{r.get('load', 0):.1f} on {os.cpu_count()} cores"
        )
        if r.get("notes"):
            extra.append("notes: " + "; ".join(r["notes"]))
        print(f"- {r['case']}: " + "; ".join(extra))
    shard_messages = print_shard_table(results)
    all_ok &= not shard_messages
    messages += shard_messages
    if messages:
        print()
        for m in messages:
            print(f"TARGET MISSED: {m}")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny Llama and GPT on 8 GPUs")
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per case (default 900)"
    )
    parser.add_argument("--published", action="store_true",
                        help="price the published layouts beside ours (--tp auto) and today's (--tp 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--published-child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    table = QUICK_CASES if args.quick else CASES
    cases = {c.name: c for c in (*CASES, *QUICK_CASES)}
    groups = {g.name: g for g in PUBLISHED}
    if args.published_child:
        Path(args.result).write_text(json.dumps(run_published_child(groups[args.published_child])))
        return 0
    if args.published:
        picked = [g for g in PUBLISHED if not args.only or g.name in args.only.split(",")]
        if not picked:
            parser.error(f"--only matches no group; choose from {', '.join(groups)}")
        published = [_run_published(g, timeout_s=args.timeout) for g in picked]
        ok = print_published(published)
        for g in picked:
            if g.note:
                print(f"- {g.name}: {g.note}")
        if args.json:
            Path(args.json).write_text(json.dumps(published, indent=1))
        return 0 if ok else 1
    if args.child:
        result = run_child(cases[args.child])
        Path(args.result).write_text(json.dumps(result))
        return 0
    chosen = [c for c in table if not args.only or c.name in args.only.split(",")]
    if not chosen:
        parser.error(f"--only matches no case; choose from {', '.join(c.name for c in table)}")
    print(
        f"{len(chosen)} case(s) on {os.cpu_count()} cores; one fresh process each", file=sys.stderr
    )
    results = []
    for case in chosen:
        print(f"  {case.name}: {case.describe()}", file=sys.stderr, flush=True)
        results.append(run_case(case, timeout_s=args.timeout, quick=args.quick))
    ok = print_results(results, cases)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
