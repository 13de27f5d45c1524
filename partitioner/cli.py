"""The ``autopartition`` command line: plan a model file, show a plan, verify it, run it.

Exit codes: 0 ok, 2 bad input (with a one-paragraph message), 1 internal error,
130 interrupted; ``run`` exits 128 + N when stopped by signal N (forwarded to every rank).

Example::

    >>> main(["examples/gpt.py", "--gpus", "4", "--batch-size", "16",
    ...       "--microbatches", "4", "--device", "h100", "--out", "plan/"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shlex
import sys
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from partitioner.cost.devices import DEVICES
from partitioner.cost.experts import DEFAULT_IMBALANCE
from partitioner.cost.precision import (
    DEFAULT_FP8_RECIPE,
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    FP8_RECIPES,
    OPTIMIZERS,
    PRECISIONS,
)
from partitioner.defaults import SCHEDULES, SHARD_MODES, SHARD_SPANS
from partitioner.errors import AutopartitionError
from partitioner.report.progress import Reporter, hide_library_output
from partitioner.units import SIZE_HELP, parse_size, plural

__all__ = ["main", "parse_size"]  # parse_size lives in partitioner.units

_DEVICES = ("auto", "cpu", "cuda", *sorted(k for k in DEVICES if k != "cpu"))
_CAPTURE = ("auto", "export", "symbolic_trace")
_DEFAULT_BATCH = 32
_AUTO = "auto"
_RECOMPUTE = ("auto", "none", "full")
_SHARD = ("auto", *SHARD_MODES, "zero3")
_SPAN = ("auto", *SHARD_SPANS)
_WIDTH = 100
_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"  # in a checkout (pip install -e .)
_WEIGHTS_ENV = "AUTOPARTITION_WEIGHTS"  # runtime.state.weights.WEIGHTS_ENV: Pipeline reads it (no torch import here)

_EPILOG = """\
examples:
  autopartition examples/gpt.py --gpus 4 --batch-size 16 --microbatches 4 --out plan/
  autopartition examples/gpt.py:gpt_medium --gpus 8 --device h100 --memory-per-gpu 80GiB
  autopartition examples/gpt3.py:gpt3_xl --gpus 8 --device h100 --precision bf16-mixed
  autopartition model.py --gpus 8 --pp 4 --dp 2 --schedule 1f1b --recompute none
  autopartition examples/llama.py:llama3_70b --gpus 64 --device h100 --precision bf16-mixed --shard auto
  autopartition model.py --gpus 8 --pp 4 --schedule interleaved-1f1b --chunks 2 --microbatches 8
  autopartition show plan/                         # the report again, from plan.json
  autopartition verify plan/ --model model.py      # run on CPU ranks, compare with the model
  autopartition run plan/ --nproc-per-node 8 -- train.py --epochs 1
  autopartition calibrate plan/ trace.json -o calib.json   # fit the costs to a traced run
  autopartition model.py --gpus 8 --calibration calib.json   # plan again with them
  autopartition export plan/ --to torchtitan -o pp.toml      # the plan as torchtitan (or megatron) settings

model file: build_model() (or a module-level `model`), example_inputs(batch_size) (or a
module-level tuple), optionally loss_fn(outputs, target) and example_target(batch_size).

exit codes: 0 ok, 2 bad input, 1 internal error (a bug), 130 interrupted; run: 128+N on signal N.
"""


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except AutopartitionError as exc:
        _error(str(exc))
        return 2
    except KeyboardInterrupt:
        print("autopartition: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:  # noqa: BLE001 - InternalError or anything unexpected: a bug, exit 1
        traceback.print_exc()
        print(
            "autopartition: internal error: this is a bug in autopartition, not in your input. "
            "Please report it with the traceback above and the command you ran.",
            file=sys.stderr,
        )
        return 1


# ----------------------------------------------------------------- parsers


def _dispatch(args: list[str]) -> int:
    handlers: dict[str, tuple[Callable[[], argparse.ArgumentParser], Callable[[Any], int]]] = {
        "show": (_show_parser, _show),
        "verify": (_verify_parser, _verify),
        "calibrate": (_calibrate_parser, _calibrate),
        "export": (_export_parser, _export),
    }
    if args and args[0] == "run":
        return _run(args[1:])
    if args and args[0] in handlers:
        make, handle = handlers[args[0]]
        parsed = _parse(make(), args[1:])
    else:
        make, handle = _plan_parser, _plan
        parsed = _parse(make(), args)
    if isinstance(parsed, int):
        return parsed
    return handle(parsed)


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace | int:
    """Parse, turning argparse's exits (errors: 2, --help: 0) into return codes."""
    try:
        return parser.parse_args(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2


def _fill(text: str) -> str:
    return textwrap.fill(text, width=_WIDTH - 2)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32, width=_WIDTH)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _microbatches(text: str) -> int | str:
    if text.lower() == _AUTO:
        return _AUTO
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or auto)") from None


def _size(text: str) -> float:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopartition",
        usage="autopartition MODEL.py[:FACTORY] --gpus N [options]\n"
        "       autopartition {show,verify,run,calibrate,export} ... (see `autopartition show --help`)",
        description=_fill("Split a PyTorch model into pipeline stages (x data-parallel replicas) over N GPUs: "
        "capture, cost, solve; print the stage table and write the plan directory."),
        epilog=_EPILOG,
        formatter_class=_formatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"autopartition {_version()}")
    parser.add_argument("model", metavar="MODEL.py[:FACTORY]",
                        help="model file; :FACTORY picks a factory other than build_model")
    parser.add_argument("--gpus", type=_positive_int, metavar="N",
                        help="number of GPUs (pipeline stages x replicas) (default: the GPUs on this machine)")
    parser.add_argument("--batch-size", type=_positive_int, metavar="B",
                        help=f"mini-batch size (default: the model file's fixed batch, else {_DEFAULT_BATCH})")
    parser.add_argument("--microbatches", type=_microbatches, default=_AUTO, metavar="auto|M",
                        help="micro-batches per mini-batch (default auto: try divisors of each replica's batch)")
    parser.add_argument("--schedule", choices=(_AUTO, *SCHEDULES), default=_AUTO, type=str.lower,
                        help="pipeline schedule (default auto: try each, keep the fastest simulated)")
    parser.add_argument("--chunks", type=_positive_int, metavar="V",
                        help="stages per pipeline rank of interleaved-1f1b (default: try 2 and 4 where the "
                        "model has the blocks; zbv always holds 2, the others 1)")
    parser.add_argument("--pp", type=_positive_int, metavar="P", help="fix the number of pipeline ranks (stages = pp x chunks)")
    parser.add_argument("--dp", type=_positive_int, metavar="D", help="fix the number of replicas per stage")
    parser.add_argument("--device", default="auto", type=_device, metavar="NAME|FILE",
                        help=f"auto/cpu/cuda measure here; {'/'.join(_DEVICES[3:])} predict for that GPU; FILE: a "
                        "JSON or TOML file of your own device's numbers (docs/devices.md) (default auto)")
    parser.add_argument("--memory-per-gpu", type=_size, metavar="SIZE",
                        help=f"memory cap per GPU: {SIZE_HELP} (default: the device's)")
    parser.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION, type=str.lower,
                        help="fp32; bf16-mixed: bf16 compute and activations, fp32 weights, gradients and "
                        f"optimizer state; bf16: everything bf16; fp8: bf16-mixed with the linear layers' matmuls "
                        f"in FP8 on a GPU with FP8 tensor cores (h100, h200, b200, mi300x, l40s, ...; docs/planning.md) "
                        f"(default {DEFAULT_PRECISION})")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=DEFAULT_FP8_RECIPE, type=str.lower,
                        help="FP8 scaling under --precision fp8: tensorwise (one scale per tensor), rowwise (per "
                        "row, priced at 0.9 of tensorwise's matmul speed), mxfp8 (per 32 elements, Blackwell "
                        f"b200/gb200/b300 only) (default {DEFAULT_FP8_RECIPE})")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=DEFAULT_OPTIMIZER, type=str.lower,
                        help=f"adam (2 state tensors per parameter) or sgd (1) (default {DEFAULT_OPTIMIZER})")
    parser.add_argument("--recompute", choices=_RECOMPUTE, default=_AUTO, type=str.lower,
                        help="recompute activations in backward: auto (per stage, only where needed to fit, and only as "
                        "many of its first layers as needed; where a rank has room, some layers recompute only their "
                        "cheap ops, keeping matmul and attention outputs), "
                        "none, full (default auto)")
    parser.add_argument("--shard", choices=_SHARD, default=_AUTO, type=str.lower,
                        help="how each stage group's replicas hold their state: auto (chosen with pp, dp and the "
                        "schedule), none (whole on every replica: DDP), optimizer (optimizer state sharded), "
                        "full (weights, gradients and optimizer state sharded: FSDP2, kept gathered across "
                        "micro-batches or resharded, as it prices best), zero3 (full, resharded after every "
                        "forward) (default auto)")
    parser.add_argument("--shard-span", choices=_SPAN, default=_AUTO, type=str.lower,
                        help="over which replicas a fully sharded stage group spanning nodes shards: auto (both "
                        "weighed), world (every replica: FSDP FULL_SHARD, ZeRO-3), node (the replicas of one node, "
                        "the nodes replicating each other: HSDP) (default auto)")
    parser.add_argument("--tp", type=_microbatches, default=_AUTO, metavar="auto|N",
                        help="GPUs per tensor-parallel group, inside a node: auto (searched with pp and dp over the "
                        "divisors of --gpus-per-node the model's heads and widths allow) or N (default auto)")
    parser.add_argument("--ep", type=_microbatches, default=_AUTO, metavar="auto|N",
                        help="expert-parallel degree of a model with experts: each stage group's replicas form groups "
                        "of N consecutive replicas, each holding 1/N of every experts layer, tokens sent to their "
                        "experts and back (all-to-all): auto (searched with pp, dp and tp) or N (default auto)")
    parser.add_argument("--expert-imbalance", type=float, default=DEFAULT_IMBALANCE, metavar="F",
                        help="with expert parallelism, the busiest member's routed tokens over the mean (1: a "
                        f"perfectly balanced router; default {DEFAULT_IMBALANCE}, the capacity factor of GShard "
                        "and Switch)")
    parser.add_argument("--gpus-per-node", type=_positive_int, metavar="K",
                        help="GPUs per node, a divisor of N: links between nodes are slower "
                        "(default: the largest divisor of N up to 8)")
    parser.add_argument("--nvlink-domain", type=_positive_int, metavar="K",
                        help="GPUs one NVLink domain joins when it spans several hosts of --gpus-per-node (GB200 "
                        "NVL72: --gpus-per-node 4 --nvlink-domain 72): links, tensor- and expert-parallel groups "
                        "follow the domain (default: a host is a domain)")
    parser.add_argument("--capture", choices=_CAPTURE, default="auto",
                        help="how to capture the graph (default auto: symbolic_trace, then export)")
    parser.add_argument("--out", default="plan", metavar="DIR", help="plan directory to write (default plan/)")
    parser.add_argument("--force", action="store_true",
                        help="write --out even if it holds a plan for another model, or other files")
    parser.add_argument("--calibration", metavar="FILE",
                        help="costs fitted to a traced run (autopartition calibrate): node times scaled, "
                        "the runtime's host time per action charged, the run's jitter replayed in simulation")
    parser.add_argument("--time-limit", type=_positive_float, default=10.0, metavar="S",
                        help="time limit of each ILP solve, seconds (default 10)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="let torch's own warnings, logs and graph dumps through (hidden by default)")
    return parser


def _show_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopartition show",
        description=_fill("Print the report of a saved plan (from plan.json alone)."),
        epilog="example:\n  autopartition show plan/",
        formatter_class=_formatter,
    )
    parser.add_argument("plan", metavar="DIR", help="plan directory (or its plan.json)")
    return parser


def _calibrate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopartition calibrate",
        description=_fill("Fit the plan's costs to a traced run of it: each stage's median F, B and W against "
        "its prediction, measured = scale x predicted + host seconds per action (least squares), and how far "
        "single actions stray from their stage's median (the jitter the simulator replays). Plan "
        "again with --calibration FILE to use the fit; steps of the trace's first half are left out "
        "(a process's first steps run slow)."),
        epilog="example:\n  autopartition run plan/ -- examples/train_gpt.py --steps 20 --trace trace.json\n"
        "  autopartition calibrate plan/ trace.json -o calibration.json\n"
        "  autopartition examples/gpt.py --gpus 4 --calibration calibration.json",
        formatter_class=_formatter,
    )
    parser.add_argument("plan", metavar="DIR", help="the plan the trace was recorded with (its directory or plan.json)")
    parser.add_argument("trace", metavar="TRACE", help="the run's trace (Pipeline.write_trace, train_gpt.py --trace)")
    parser.add_argument("-o", "--out", metavar="FILE", default="calibration.json",
                        help="where to write the calibration (default calibration.json)")
    return parser


def _calibrate(args: argparse.Namespace) -> int:
    from partitioner.plan import Plan
    from partitioner.schedule.timeline import read_events
    from partitioner.search.calibrate import calibrate, recalibrated, stage_pairs

    plan = Plan.load(args.plan)
    found = calibrate(plan, args.trace, plan_label=f"plan {args.plan}")
    saved = found.save(args.out)
    pairs = stage_pairs(plan, read_events(args.trace))
    measured = sum(m for _, m in pairs)
    predicted = sum(p for p, _ in pairs)
    print(f"{found.samples} stage actions: measured {1e3 * measured:.2f} ms vs predicted {1e3 * predicted:.2f} ms "
          f"in all ({100 * (measured / predicted - 1):+.0f}%)")
    print(f"fit: measured = {found.scale:.3f} x predicted + {1e6 * found.action_s:.0f} us per action "
          f"(from the plan's uncalibrated costs); actions spread {100 * found.jitter:.0f}% about that "
          "(the simulator's jitter)")
    again = recalibrated(plan, found).predicted.step_s
    print(f"this plan's step under it: {1e3 * again:.1f} ms (as the plan predicts it: "
          f"{1e3 * plan.predicted.step_s:.1f} ms)")
    print(f"calibration saved to {saved}; plan with it: autopartition MODEL --gpus N --calibration {shlex.quote(str(saved))}")
    return 0


def _verify_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopartition verify",
        description=_fill("Run the plan on CPU ranks and compare loss, gradients and buffers, step by "
        "step, with the unpartitioned model run on the same micro-batches; print each step and the verdict."),
        epilog="example:\n  autopartition verify plan/ --model examples/gpt.py --steps 3",
        formatter_class=_formatter,
    )
    parser.add_argument("plan", metavar="DIR", help="plan directory")
    parser.add_argument("--model", required=True, metavar="MODEL.py[:FACTORY]",
                        help="the model file the plan was made from")
    parser.add_argument("--steps", type=_positive_int, default=3, metavar="K",
                        help="training steps to compare (default 3)")
    parser.add_argument("--timeout", type=_positive_float, metavar="S",
                        help="give up after S seconds (default: the verifier's)")
    parser.add_argument("--dtype", choices=("float32", "float64"),
                        help="precision of both runs (default float32, tolerance 1e-5; float64: 1e-10)")
    parser.add_argument("--engine", choices=("ours", "torch"), default="ours",
                        help="what runs the stages: ours (default) or torch (torch.distributed.pipelining's schedules)")
    return parser


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopartition run",
        usage="autopartition run DIR [--nproc-per-node K] [torchrun options] -- train.py [args]",
        description=_fill("Start the training script on torchrun ranks laid out as the plan says. "
        "Options other than --nproc-per-node go to torchrun (e.g. --nnodes, --rdzv-endpoint)."),
        epilog="examples:\n  autopartition run plan/ -- train.py --epochs 1\n"
        "  autopartition run plan/ --nnodes 2 --nproc-per-node 4 --rdzv-endpoint host:29500 -- train.py\n\n"
        "environment:\n"
        "  AUTOPARTITION_TIMEOUT=S     seconds a rank waits for a peer before it stops (default 300)\n"
        "  AUTOPARTITION_STOP_GRACE=S  seconds from SIGINT/SIGTERM/SIGHUP until every rank is killed (30)\n\n"
        "A failed rank is named with its error first (exit 2: bad input, 1: otherwise); torchrun's output\n"
        "and every rank's traceback go to a log named in the message. Exit 128+N when stopped by signal N.",
        formatter_class=_formatter,
        allow_abbrev=False,
    )
    parser.add_argument("plan", metavar="DIR", help="plan directory")
    parser.add_argument("--nproc-per-node", type=_positive_int, metavar="K",
                        help="ranks per node (default: the plan's GPU count on one node)")
    parser.add_argument("--weights", metavar="PATH",
                        help="initial weights: model.safetensors, a directory with it or a sharded index, or a "
                        "torch.distributed.checkpoint directory; each rank reads only its stages' tensors "
                        f"(passed as {_WEIGHTS_ENV}, which Pipeline reads when not given weights=)")
    parser.add_argument("--engine", choices=("ours", "torch"),
                        help="what runs the stages: ours (default) or torch (torch.distributed.pipelining's "
                        "schedules); passed as AUTOPARTITION_ENGINE, which Pipeline reads when not given engine=")
    return parser


# ----------------------------------------------------------------- commands


def _plan(args: argparse.Namespace) -> int:
    from partitioner.modelfile import load_model_file
    from partitioner.report.table import format_plan
    from partitioner.search import planner

    say = Reporter(quiet=args.quiet)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise AutopartitionError(f"--out {args.out} is a file; choose a directory for the plan.")
    gpus = _gpus(args, say)
    # torch's warnings, logs and partial-graph dumps would bury our one-paragraph errors.
    with hide_library_output(verbose=args.verbose):
        say(f"loading {args.model}")
        model_file = load_model_file(args.model)
        batch = args.batch_size or model_file.default_batch_size or _DEFAULT_BATCH
        model = model_file.build()
        inputs = model_file.example_inputs(batch)
        source = _model_source(args.model)

        def fingerprint(method: str) -> str | None:
            return _fingerprint(model, inputs, method)

        _check_out(out, type(model).__name__, source=source, fingerprint=fingerprint, force=args.force, say=say)
        plan = planner.compile(
            model,
            inputs,
            gpus=gpus,
            microbatches=args.microbatches,
            schedule=args.schedule,
            device=args.device,
            memory_per_gpu=args.memory_per_gpu,
            pp=args.pp,
            dp=args.dp,
            capture_method=cast(Any, args.capture),
            time_limit=args.time_limit,
            precision=args.precision,
            fp8_recipe=args.fp8_recipe,
            optimizer=args.optimizer,
            recompute=args.recompute,
            gpus_per_node=args.gpus_per_node,
            chunks=args.chunks,
            shard=args.shard,
            shard_span=args.shard_span,
            tp=args.tp,
            ep=args.ep,
            expert_imbalance=args.expert_imbalance,
            nvlink_domain=args.nvlink_domain,
            calibration=args.calibration,
            loss_fn=model_file.loss_fn,
            target=model_file.example_target(batch) if model_file.example_target else None,
            status=say,
        )
        plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, source=source))  # for --out's check
        saved = plan.save(out)
        report = _write_report(plan, saved, say=say)
    print(format_plan(plan))
    print()
    if report is not None:
        print(f"report: {report}")
    quoted = shlex.quote(str(saved))
    stages = "stage_0.py" if len(plan.stages) == 1 else f"stage_0.py … stage_{len(plan.stages) - 1}.py"
    refusal = _tensor_parallel_refusal(plan)
    if refusal is not None:  # the runtime refuses it: say so here, not at `run`
        print(f"plan saved to {saved}{os.sep} (plan.json, {stages}); {refusal}")
        return 0
    print(f"plan saved to {saved}{os.sep} (plan.json, {stages}); next:")
    print(f"  autopartition verify {quoted} --model {shlex.quote(args.model)}")
    print(f"  autopartition run {quoted} -- {_training_script(args.model)}")
    return 0


def _device(text: str) -> str:
    """A device name (any case) or a device file's path (as given)."""
    return text.lower() if text.lower() in _DEVICES else text


def _gpus(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """--gpus, else the local GPU count (said); with neither, bad input.  Also warns about CPU timings."""
    local = _local_gpus()
    if args.gpus is None and local == 0:
        raise AutopartitionError(
            "No --gpus given and this machine has no GPU to count. Say how many GPUs to plan for, "
            "and for which: e.g. `--gpus 4 --device h100` (costs predicted for H100s; --help lists the other devices)."
        )
    gpus = args.gpus if args.gpus is not None else local
    if args.gpus is None:
        say(f"planning for {plural(gpus, 'GPU')} (the GPUs on this machine; --gpus N to change)")
    if args.device == "auto" and local == 0:
        say("no GPU here: planning with CPU timings; for GPU costs try --device h100 (or b200, mi300x, ...: --help)")
    return gpus


def _local_gpus() -> int:
    """GPUs visible here (0 without CUDA); a function so tests can pretend."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_out(
    out: Path, model_name: str, *, source: str, fingerprint: Callable[[str], str | None], force: bool,
    say: Callable[[str], None],
) -> None:
    """Refuse to overwrite another model's plan (or a directory of other files) unless ``force``.

    "Another model" is told by the plan's model file and its graph fingerprint, never by the class
    name (every nanoGPT is a ``GPT``): a plan made from the same model file is replaced (the model
    may have changed: re-planning is why one plans into the same folder), and so is one whose graph
    is this model's, captured as that plan captured it (``fingerprint(method)``).
    """
    if not out.is_dir() or not any(out.iterdir()):
        return
    existing = out / "plan.json"
    if not existing.is_file():
        if force:
            return
        raise AutopartitionError(
            f"--out {out} already holds files but no plan.json; writing a plan there would mix them "
            "(and remove any stage_*.py). Choose another --out, or add --force."
        )
    try:
        info = json.loads(existing.read_text())["model"]
        previous, theirs = str(info["class_name"]), str(info["fingerprint"])
        method, made_from = str(info.get("capture", "auto")), str(info.get("source", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        say(f"replacing an unreadable plan.json in {out}{os.sep}")  # nothing worth keeping is lost
        return
    if force or (made_from and made_from == source):
        say(f"replacing the plan for {previous} in {out}{os.sep}")
        return
    ours = fingerprint(method)
    if ours == theirs:
        say(f"replacing the plan for {previous} in {out}{os.sep} (the same graph)")
        return
    mine = f"graph fingerprint {ours}" if ours else f"a graph {method} cannot capture"
    raise AutopartitionError(
        f"--out {out} holds the plan of another model: a {previous} with graph fingerprint {theirs}"
        f"{f' from {made_from}' if made_from else ''}, while this {model_name} from {source} has {mine}; "
        "not overwriting it. Choose another --out, or add --force to replace it."
    )


def _model_source(spec: str) -> str:
    """The model file ``spec`` names, resolved (``path`` or ``path:FACTORY``): what plan.json records."""
    from partitioner.modelfile import split_spec

    path, factory = split_spec(spec)
    resolved = str(Path(path).resolve())
    return f"{resolved}:{factory}" if factory else resolved


def _fingerprint(model: Any, inputs: Any, method: str) -> str | None:
    """The graph fingerprint of ``model`` captured by ``method``; None when it cannot be captured so."""
    from partitioner.graph.capture import capture
    from partitioner.graph.ir import graph_fingerprint

    try:
        return graph_fingerprint(capture(model, inputs, method=cast(Any, method)).graph_module)
    except AutopartitionError:
        return None



def _training_script(model: str) -> str:
    """A training script that exists: the example GPT's trainer (the one to copy for another model)."""
    script = _EXAMPLES / "train_gpt.py"
    if not script.is_file():
        return "your_training_script.py  # see examples/train_gpt.py in autopartition's repository"
    relative = os.path.relpath(script)
    shown = shlex.quote(str(script) if relative.startswith("..") else relative)
    model_path = Path(model.split(":", 1)[0]).resolve()
    return shown if model_path == _EXAMPLES / "gpt.py" else f"{shown}  # trains examples/gpt.py: copy it for your model"


def _show(args: argparse.Namespace) -> int:
    from partitioner.plan import Plan
    from partitioner.report.table import format_plan

    plan = Plan.load(args.plan)
    print(format_plan(plan))
    path = Path(args.plan)
    report = _write_report(plan, path if path.is_dir() else path.parent)
    if report is not None:
        print()
        print(f"report: {report}")
    return 0


def _export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopartition export",
        description=_fill("Write a plan as another framework's settings, to run it with that framework's "
        "trainer. torchtitan: its [parallelism] (stages as module_fqns_per_model_part, schedule, micro-batches, "
        "data-parallel degrees and resharding), [training] and [activation_checkpoint] sections as TOML, with "
        "torchtitan 0.3's full command line in its header. megatron: a Megatron-Bridge recipe override (YAML) "
        "with the Megatron-LM arguments in its header. Stages are whole blocks, placed from the parameter sizes "
        "of the plan's model file. What the framework cannot express is said on stderr with the nearest setting "
        "written."),
        epilog="examples:\n  autopartition export plan/ --to torchtitan -o pp.toml\n"
        "  autopartition export plan/ --to megatron -o megatron.yaml",
        formatter_class=_formatter,
    )
    parser.add_argument("plan", metavar="DIR", help="plan directory (or its plan.json)")
    parser.add_argument("--to", required=True, metavar="FRAMEWORK", help="the framework: torchtitan or megatron")
    parser.add_argument("-o", "--out", metavar="FILE", help="file to write (default: standard output)")
    parser.add_argument("--names", default="auto", metavar="STYLE",
                        help="torchtitan module names: auto (default: torchtitan's Llama 3 for a Hugging Face "
                        "LlamaForCausalLM, else the model's own), model or torchtitan-llama")
    return parser


def _export(args: argparse.Namespace) -> int:
    from partitioner.export.megatron import export_megatron
    from partitioner.export.sizes import plan_parameter_sizes
    from partitioner.export.torchtitan import export_torchtitan
    from partitioner.plan import Plan

    if args.to not in ("torchtitan", "megatron"):
        raise AutopartitionError(f"--to {args.to}: autopartition exports to torchtitan or megatron; use one of those.")
    if args.to == "megatron" and args.names != "auto":
        raise AutopartitionError("--names applies to --to torchtitan; Megatron names no modules. Drop --names.")
    plan = Plan.load(args.plan)
    sizes, why = plan_parameter_sizes(plan)  # a plan names its parameters, not their sizes: the model file has them
    if sizes is None:
        _stderr(f"export: parameter sizes unknown: {why}")
    if args.to == "torchtitan":
        exported = export_torchtitan(plan, names=args.names, sizes=sizes, source=args.plan)
        notes, text, example = exported.notes, exported.toml(), "torchtitan.toml"
    else:
        megatron = export_megatron(plan, sizes=sizes, source=args.plan)
        notes, text, example = megatron.notes, megatron.yaml(), "megatron.yaml"
    for note in notes:
        _stderr(f"export: {note}")
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if out.is_dir():
        raise AutopartitionError(f"-o {args.out} is a directory; give a file name, e.g. -o {out / example}.")
    try:
        out.write_text(text)
    except OSError as exc:
        raise AutopartitionError(f"cannot write -o {args.out}: {exc.strerror}.") from exc
    run = "torchtitan 0.3 reads no TOML: run the command in its header" if args.to == "torchtitan" else \
        "Megatron-LM: the arguments in its header; Megatron-Bridge: the file itself, as a recipe override"
    _stderr(f"export: wrote {out} ({run})")
    return 0


def _tensor_parallel_refusal(plan: Any, engine: str | None = None) -> str | None:
    """Why the runtime cannot run this plan's tensor parallelism (None: it can, or no runtime installed)."""
    try:
        refusal = _runtime().tensor_parallel_refusal
    except ImportError:
        return None
    return refusal(plan, engine=engine or "ours")


def _verify(args: argparse.Namespace) -> int:
    from partitioner.plan import Plan

    plan = Plan.load(args.plan)  # a missing or corrupt plan is bad input (exit 2), found before any rank starts
    refusal = _tensor_parallel_refusal(plan, getattr(args, "engine", None))
    if refusal is not None:  # before any rank starts
        raise AutopartitionError(refusal)
    try:
        commands = _runtime()
        verify_plan = commands.verify_plan
    except ImportError as exc:
        return _runtime_missing("verify", "runtime.verify.verify_plan", exc)
    shape = plural(plan.pp, "stage") if plan.chunks == 1 else f"{plural(plan.pp, 'pipeline rank')} of {plan.chunks} stages"
    split = f" x {plan.tp} tensor-parallel" if plan.tp > 1 else ""
    print(f"[autopartition] verify: starting {plural(plan.gpus, 'CPU rank')} ({shape} x "
          f"{plural(plan.dp, 'replica')}{split}) for {plural(args.steps, 'step')} against the unpartitioned "
          f"{plan.model.class_name}; each rank builds and captures the model first", file=sys.stderr, flush=True)
    options: dict[str, Any] = {"steps": args.steps}
    if args.timeout is not None:  # else the verifier's own default
        options["timeout"] = args.timeout
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if args.engine != "ours":
        options["engine"] = args.engine
    rank_failure = commands.RankFailure  # looked up before any rank starts

    try:
        return verify_plan(args.plan, args.model, **options)
    except rank_failure as exc:  # a rank's first cause, one paragraph: 2 bad input, 1 a bug or crash
        print(f"autopartition: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _run(args: list[str]) -> int:
    parser = _run_parser()
    if "--" in args:
        split = args.index("--")
        own, script = args[:split], args[split + 1:]
    else:
        own, script = args, []
    try:
        parsed, torchrun_args = parser.parse_known_args(own)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if not script:
        scripts = [a for a in torchrun_args if a.endswith(".py")]
        hint = f" (did you mean `-- {' '.join(scripts)}`?)" if scripts else ""
        parser.print_usage(sys.stderr)
        raise AutopartitionError(
            "`autopartition run` needs the training script after `--`, as in "
            f"`autopartition run {parsed.plan} -- train.py [args]`{hint}."
        )
    if parsed.nproc_per_node is not None:
        torchrun_args = ["--nproc-per-node", str(parsed.nproc_per_node)] + torchrun_args
    from partitioner.plan import Plan

    refusal = _tensor_parallel_refusal(Plan.load(parsed.plan), parsed.engine)  # a corrupt plan: exit 2 here
    if refusal is not None:  # before torchrun starts any rank
        raise AutopartitionError(refusal)
    if parsed.weights is not None:
        weights = Path(parsed.weights)
        if not weights.exists():
            raise AutopartitionError(f"--weights {parsed.weights}: no such file or directory.")
        os.environ[_WEIGHTS_ENV] = str(weights.resolve())  # the ranks inherit it through torchrun
    try:
        run_plan = _runtime().run_plan
    except ImportError as exc:
        return _runtime_missing("run", "runtime.launch.torchrun.run_plan", exc)
    engine = {} if parsed.engine is None else {"engine": parsed.engine}  # else each rank's own default
    return run_plan(parsed.plan, torchrun_args, script, **engine)


# ----------------------------------------------------------------- helpers


def _stderr(message: str) -> None:
    print(f"[autopartition] {message}", file=sys.stderr, flush=True)


def _error(message: str) -> None:
    paragraphs = message.splitlines() or [""]
    lines = textwrap.wrap(f"autopartition: error: {paragraphs[0]}", width=_WIDTH,
                          break_on_hyphens=False, break_long_words=False) or ["autopartition: error:"]
    for paragraph in paragraphs[1:]:
        lines += textwrap.wrap(paragraph, width=_WIDTH, break_on_hyphens=False, break_long_words=False) or [""]
    print("\n".join(lines), file=sys.stderr)


def _runtime() -> ModuleType:
    """The runtime's commands (:mod:`runtime.commands`): the one runtime module the partitioner imports.

    Imported here, inside the commands that need it, so that ``--help`` loads no runtime
    (and no torch).  Each of its names imports the runtime module that defines it on use;
    an ``ImportError`` there, or here, is a runtime that is absent or broken.
    """
    import runtime.commands

    return runtime.commands


def _runtime_missing(command: str, name: str, exc: ImportError) -> int:
    """A broken installation, not bad input: say how to fix it; exit code 1."""
    _error(
        f"`autopartition {command}` needs {name}, which cannot be imported "
        f"({type(exc).__name__}: {exc}). Reinstall autopartition (`pip install -e .` in its "
        "checkout) so that the runtime package is present."
    )
    return 1


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autopartition")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _write_report(plan: Any, directory: Path, *, say: Callable[[str], None] | None = None) -> Path | None:
    """Call ``partitioner.report.markdown.write_report`` when that module exists; return where it wrote."""
    try:
        report = importlib.import_module("partitioner.report.markdown")
    except ImportError as exc:
        if getattr(exc, "name", None) != "partitioner.report.markdown":
            (say or _stderr)(f"no report written: {type(exc).__name__}: {exc}")
        return None
    written = report.write_report(plan, directory)
    return Path(written) if written is not None else None
