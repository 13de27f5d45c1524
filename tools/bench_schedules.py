"""Benchmark our chunked and zero-bubble schedules on 2 CPU ranks against torch.distributed.pipelining.

Commands (from the repository root)::

    .venv/bin/python tools/bench_schedules.py                 # full: 8-layer GPT, n_embd 96, seq 64, batch 32, M=8
    .venv/bin/python tools/bench_schedules.py --quick         # small configuration, < 90 s
    .venv/bin/python tools/bench_schedules.py --rounds 6 --steps 5 --json schedules.json
    .venv/bin/python tools/bench_schedules.py --only ours_zbv,torch_zbv   # a subset
    .venv/bin/python tools/bench_schedules.py --no-calibration    # predictions as planned only

One run, two processes (gloo, one thread each, ``torch.set_num_threads(1)``),
one GPT (tools/bench_runtime.py's model and batch) and one number of
micro-batches M for every configuration:

* ours: :class:`runtime.Pipeline` on plans from ``partitioner.compile(...,
  gpus=2, pp=2, dp=1, schedule=..., chunks=..., device="cpu")`` (costs measured
  on this machine, once: every compile of the model in this process plans from
  the same measurement, :mod:`partitioner.cost.measured`) for ``1f1b``, ``interleaved-1f1b`` with v=2 (4 stages,
  stage s on rank s % 2), ``zb-h1`` and ``zbv`` (4 stages in a V: rank 0 holds
  stages 0 and 3); and the plan ``schedule="auto"`` picks (same M);
* torch's ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` on
  our interleaved plan's stage modules, and ``ScheduleZBVZeroBubble`` on our
  zbv plan's (torch places ZBV's stages in the same V), built with
  ``PipelineStage`` and the adaptations of tools/bench_runtime.py (contiguous
  outputs, contiguous input gradients, arguments in the receiving stage's
  order, the tied embedding / LM head gradients summed across ranks as our
  Pipeline does).  Each stage is built from its own copy of the model: torch
  scales each stage's gradients by 1/M after that stage's last backward, so a
  Parameter two stages of one rank share (zbv: ``wte`` / ``lm_head`` on rank 0)
  would be scaled twice; the copies' gradients are summed after the step.  A
  torch schedule whose first step fails (under a short timeout) is tried once
  more with *cloned* stage outputs (:class:`_Cloned`; marked ``*``): torch's
  split backward detaches stage outputs in place, which fails on our splits
  (a view output, or one a layer norm of the same stage saved).  Its exact
  errors are printed; where both attempts fail they replace its time;
* the simulator's prediction for each of our plans next to the measurement:
  calibrated (below) and as planned (``plan.predicted.step_s``).

Predictions are calibrated in the same run, each on the *other* plans: our
configurations run traced, and for each plan
:func:`partitioner.cost.calibration.fit` relates the stages' measured F, B and W of
every other plan of ours to their predictions (``measured = scale x predicted
+ host seconds per action``, over the later half of the steps) and how far
single actions stray from their stage's median (the simulator's jitter:
:func:`partitioner.search.calibrate.action_jitter`); the plan's step is then
simulated again with its own stage costs calibrated
(:func:`partitioner.search.calibrate.recalibrated`), as ``autopartition calibrate``
and ``--calibration`` do for users.  No plan is fitted on its own run (auto's
pick and the configuration with the same plan are left out of each other's
fits), so the simulator and the cost model still predict what the plan's
stages take and how its schedule overlaps them.  Why calibrate at all: this
machine's speed drifts (a fixed matmul loop ran 1,900 to 3,000 times a second
within one minute; one 2-rank step measured 172 ms and 251 ms fifteen minutes
apart), and a plan's costs are measured in the few seconds of its compile,
one process alone, while its steps run later, in two processes that also
run the runtime's own host work per action.  The verdicts show each
prediction three ways: calibrated (jitter replayed), calibrated without the
jitter, and as planned.

When ``auto`` picks the very plan of another configuration (same schedule, same
split), that plan is measured twice: the pick is judged on the median of both
measurements, and the gap between them is printed, the run's own noise.

Every step is forward + backward of one mini-batch with the gradients set to
None before it and no optimizer step.  Each configuration first runs
``warmup`` untimed steps (8; the first ~10 steps of a process run up to 1.4x
slower while the allocator maps its memory).  Configurations are interleaved in rounds
(a barrier, one untimed step, ``--steps`` timed steps, a barrier) so that load
from other work spreads over all of them; a step time is rank 0's wall time of
the step call (for ours it also covers the tied-weight all-reduce the
simulator does not model).  As in tools/bench_runtime.py, a step is
*uncontended* when no rank spent more than ``CLEAN_WAIT`` of it runnable but
not running.  The first step's loss and the norm of all gradients after it are
printed for every configuration: they compute the same mini-batch from the
same weights, so both must agree (the gradient norm shows that W actions ran).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist
from torch import nn

from tools.bench_runtime import (
    CLEAN_WAIT,
    BenchConfig,
    _Case,
    _Contiguous,
    _ReceiveSide,
    _zero,
    batch_data,
    build_gpt,
    describe_split,
    timed_steps,
)

__all__ = ["CONFIGS", "ConfigSpec", "Row", "default_config", "format_table", "main", "run_benchmark", "verdicts"]

WORLD = 2
PROBE_TIMEOUT = 15.0  # seconds a torch schedule's first step may wait on a peer that failed


@dataclasses.dataclass(frozen=True)
class ConfigSpec:
    """One measured configuration: whose runtime, on which of our plans, and (torch) which schedule class."""

    label: str
    plan: str  # key of PLANS
    torch_schedule: str | None = None  # class name in torch.distributed.pipelining; None: ours
    same_split_as: str | None = None  # our configuration on the same plan (ours vs theirs)


# Plans compiled per run: key -> (schedule, chunks).
# Compiled in this order: auto first, so that the one measurement every plan shares
# (partitioner.cost.measured) holds the W shares the zero-bubble schedules need.
PLANS: dict[str, tuple[str, int | None]] = {
    "auto": ("auto", None),
    "1f1b": ("1f1b", None),
    "interleaved": ("interleaved-1f1b", 2),
    "zbh1": ("zb-h1", None),
    "zbv": ("zbv", None),
}

CONFIGS: dict[str, ConfigSpec] = {
    "ours_1f1b": ConfigSpec("ours, 1F1B", "1f1b"),
    "ours_interleaved": ConfigSpec("ours, interleaved 1F1B v=2", "interleaved"),
    "ours_zbh1": ConfigSpec("ours, ZB-H1", "zbh1"),
    "ours_zbv": ConfigSpec("ours, ZBV", "zbv"),
    "ours_auto": ConfigSpec("ours, auto", "auto"),
    "torch_interleaved": ConfigSpec("torch Interleaved1F1B", "interleaved", "ScheduleInterleaved1F1B",
                                    "ours_interleaved"),
    "torch_interleaved_zb": ConfigSpec("torch InterleavedZeroBubble", "interleaved",
                                       "ScheduleInterleavedZeroBubble", "ours_interleaved"),
    "torch_zbv": ConfigSpec("torch ZBVZeroBubble", "zbv", "ScheduleZBVZeroBubble", "ours_zbv"),
}


def default_config(*, quick: bool) -> BenchConfig:
    """The full run: bench_runtime's GPT at n_embd 96 (a 2-rank step of ~150-250 ms here); quick: its quick one.

    >>> cfg = default_config(quick=False)
    >>> cfg.layers, cfg.embd, cfg.seq, cfg.batch, cfg.microbatches
    (8, 96, 64, 32, 8)
    """
    if quick:
        return dataclasses.replace(BenchConfig.quick(), warmup=2)
    return BenchConfig(embd=96, rounds=4, steps=5, warmup=8)


@dataclasses.dataclass
class Row:
    key: str
    label: str
    split: str
    schedule: str  # the plan's schedule (and chunks)
    step_s: float | None  # rank 0's median step; None: the configuration failed
    p25_s: float | None = None
    p75_s: float | None = None
    clean_s: float | None = None  # median over the uncontended steps
    clean_steps: int = 0
    steps: int = 0
    predicted_s: float | None = None  # the simulator's step (ours), calibrated where a calibration was fitted
    planned_s: float | None = None  # the plan's own prediction (uncalibrated)
    steady_s: float | None = None  # calibrated, but every action at its median (no jitter)
    loss: float | None = None  # first step
    grad_norm: float | None = None  # after the first step, over every parameter name of both ranks
    error: str | None = None  # why a torch schedule could not run
    note: str | None = None  # why a torch schedule ran only with cloned outputs (its error as is)
    wait_share: tuple[float, ...] = ()  # per rank: runnable-but-not-running time / wall
    step_times: tuple[float, ...] = ()



# ------------------------------------------------------------------ plans


def make_plans(cfg: BenchConfig, out: Path, names: Sequence[str]) -> dict[str, Path]:
    """Compile and save the plans ``names`` (keys of :data:`PLANS`), all with M = ``cfg.microbatches``."""
    from examples.gpt import loss_fn
    from partitioner.search.planner import compile as plan_compile

    x, y = batch_data(cfg)
    dirs = {}
    for name in names:
        schedule, chunks = PLANS[name]
        plan = plan_compile(build_gpt(cfg), (x,), gpus=WORLD, pp=2, dp=1, microbatches=cfg.microbatches,
                            schedule=schedule, chunks=chunks, device="cpu", loss_fn=loss_fn, target=y)
        if plan.microbatches != cfg.microbatches:
            raise SystemExit(f"plan {name!r} has M={plan.microbatches}, not the forced {cfg.microbatches}")
        dirs[name] = plan.save(out / f"plan_{name}")
    return dirs


def chain_problems(plan: Any) -> list[str]:
    """Why torch's PipelineStage cannot run ``plan``'s stages (empty: it can).

    torch feeds stage s exactly stage s - 1's outputs and the model inputs only
    to stage 0, so every boundary must go from one stage to the next.
    """
    problems = []
    stages = plan.stages
    if len(stages[0].model_inputs) != len(plan.model.inputs):
        problems.append("stage 0 does not read every model input")
    for prev, stage in itertools.pairwise(stages):
        if stage.model_inputs:
            problems.append(f"stage {stage.index} reads model inputs {stage.model_inputs}")
        if {b.source for b in stage.inputs} != {prev.index}:
            problems.append(f"stage {stage.index} receives from stages {sorted({b.source for b in stage.inputs})}")
        if {b.target for b in prev.outputs} != {stage.index}:
            problems.append(f"stage {prev.index} sends to stages {sorted({b.target for b in prev.outputs})}")
    return problems


def schedule_name(plan: Any) -> str:
    return f"{plan.schedule} v={plan.chunks}" if plan.chunks > 1 else str(plan.schedule)


# ------------------------------------------------------------------ ranks


@dataclasses.dataclass
class _Measured:
    case: _Case
    named: Callable[[], list[tuple[str, nn.Parameter]]]  # this rank's parameters, original names
    pipe: Any = None  # ours: the runtime.Pipeline (traced in the timed rounds when calibrating)


def _ours(key: str, plan_dir: str, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor) -> _Measured:
    from examples.gpt import loss_fn
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    pipe = Pipeline(Plan.load(plan_dir), build_gpt(cfg), loss_fn, device=torch.device("cpu"), timeout=cfg.timeout)

    def step() -> float | None:
        _zero(pipe.parameters())
        loss = pipe.step((x,), y)
        return None if loss is None else float(loss)

    return _Measured(_Case(key, (0, 1), step), lambda: list(pipe.named_parameters()), pipe)


class _Cloned(_Contiguous):
    """Returns copies of ``inner``'s outputs, so that nothing inside the stage saved them for its backward.

    torch's split backward (``stage_backward_input``) detaches each stage output
    in place after the input gradient; where an op of the stage saved that
    tensor for its own backward (our splits send the residual stream a layer
    norm of the same stage also reads), the weight gradient then fails with
    "Trying to use a saved tensor that has been detached in-place".  A copy is
    a tensor no op saved.
    """

    @staticmethod
    def _copy(t: torch.Tensor) -> torch.Tensor:
        return t.clone()


def _theirs(key: str, rank: int, plan_dir: str, class_name: str, cfg: BenchConfig, x: torch.Tensor,
            y: torch.Tensor, group: Any, *, clone: bool = False) -> _Measured:
    """torch's ``class_name`` schedule with PipelineStage on this rank's stages of our plan.

    ``clone``: stage outputs are copies (:class:`_Cloned`), else made contiguous as in bench_runtime.
    """
    from torch.distributed import pipelining

    from examples.gpt import loss_fn
    from partitioner.plan import Plan
    from runtime.execute.comm import make_groups
    from runtime.execute.stage import build_local_stages
    from runtime.parallel.replicate import sum_tied_grads

    plan = Plan.load(plan_dir)
    problems = chain_problems(plan)
    if problems:
        raise RuntimeError("our split does not map onto torch's stage chain: " + "; ".join(problems))
    held = plan.stages_of(plan.rank_layout()[rank][0])
    # Each stage from its own model: a weight two stages of this rank use (zbv: wte / lm_head) is two copies.
    # torch scales a stage's gradients by 1/M after the stage's last backward, so one Parameter shared by two
    # stages would be scaled twice, part of it once more; the copies' gradients are summed after the step.
    locals_ = [build_local_stages(plan, build_gpt(cfg), (s,))[0] for s in held]
    inner = [local.module for local in locals_]
    groups = make_groups(plan, rank)  # tied copies on different ranks (interleaved): summed after each step
    stages = []
    for local in locals_:
        module: nn.Module = local.module
        s = local.plan.index
        if s > 0:  # arguments arrive in the previous stage's send order
            sent = list(dict.fromkeys(b.producer for b in plan.stages[s - 1].outputs))
            module = _ReceiveSide(module, [sent.index(n) for n in local.signature.received])
        if not local.is_last:
            module = _Cloned(module) if clone else _Contiguous(module)
        stages.append(pipelining.PipelineStage(module, s, len(plan.stages), torch.device("cpu"), group=group))
    last = next((local for local in locals_ if local.is_last), None)

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        assert last is not None
        flat = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return loss_fn(last.captured.unflatten_outputs(flat), target)

    sched = getattr(pipelining, class_name)(stages, cfg.microbatches, loss_fn=loss)
    params = list({id(p): p for m in inner for p in m.parameters()}.values())
    first = any(local.plan.index == 0 for local in locals_)

    def step() -> float | None:
        _zero(params)
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        if last is not None:
            sched.step(*args, target=y, losses=losses)
        else:
            sched.step(*args)
        _sum_local_copies(plan, inner)
        sum_tied_grads(inner, groups)
        return torch.stack(losses).mean().item() if losses else None

    def named() -> list[tuple[str, nn.Parameter]]:
        return [pair for m in inner for pair in m.named_parameters()]

    return _Measured(_Case(key, (0, 1), step), named)


def _sum_local_copies(plan: Any, modules: Sequence[nn.Module]) -> None:
    """Every copy of a tied parameter held by several of ``modules`` gets the sum of their gradients."""
    for t in plan.tied:
        copies = []
        for module in modules:
            for name in t.aliases:
                with contextlib.suppress(AttributeError):
                    copies.append(module.get_parameter(name))
                    break
        grads = [p.grad for p in copies if p.grad is not None]
        if len(copies) > 1 and grads:
            total = torch.stack(grads).sum(0)
            for p in copies:
                p.grad = total.clone()


def _grad_sums(named: Sequence[tuple[str, nn.Parameter]]) -> dict[str, float]:
    """Squared gradient norm per parameter name (a tied copy under two names counts under both, everywhere)."""
    return {n: float(p.grad.double().pow(2).sum()) for n, p in named if p.grad is not None}


def _describe(exc: BaseException) -> str:
    """The error and what caused it, on one line (torch wraps autograd's message in its own).

    >>> try:
    ...     try:
    ...         raise ValueError("inner")
    ...     except ValueError as e:
    ...         raise RuntimeError("outer,\\n  wrapped") from e
    ... except RuntimeError as e:
    ...     print(_describe(e))
    RuntimeError: outer, wrapped <- caused by ValueError: inner
    """
    parts = []
    current: BaseException | None = exc
    while current is not None:
        parts.append(f"{type(current).__name__}: {' '.join(str(current).split())}")
        current = current.__cause__
    return " <- caused by ".join(parts)


def _probe_theirs(key: str, rank: int, plan_dir: str, class_name: str, cfg: BenchConfig, x: torch.Tensor,
                  y: torch.Tensor, probe_timeout: float) -> tuple[_Measured | None, float | None, list[str]]:
    """Build torch's schedule and run its first step; if it fails, once more with cloned stage outputs.

    Returns (the configuration or None, its first loss, one line per failed attempt with every rank's error).
    """
    notes: list[str] = []
    for clone in (False, True):
        # Its own group with a short timeout: if one rank fails, the other stops waiting on it soon.
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=probe_timeout))
        error = None
        try:
            measured = _theirs(key, rank, plan_dir, class_name, cfg, x, y, group, clone=clone)
            loss = measured.case.step()  # also torch's shape inference
        except Exception as exc:  # noqa: BLE001 - reported in the table
            error = _describe(exc)
        gathered: list[str | None] = [None] * WORLD
        dist.all_gather_object(gathered, error)
        failed = [f"rank {r}: {e}" for r, e in enumerate(gathered) if e is not None]
        if not failed:
            return measured, loss, notes
        notes.append(f"{'with cloned outputs' if clone else 'as is'}: " + " | ".join(failed))
    return None, None, notes


def _rank_main(rank: int, port: int, cfg_dict: dict[str, Any], plans: dict[str, str], keys: list[str],
               out: str, probe_timeout: float, calibrating: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # torch logs a failed schedule's whole action grid; the table reports its error instead.
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.CRITICAL)
    cfg = BenchConfig(**cfg_dict)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout))
    x, y = batch_data(cfg)
    cases: list[_Case] = []
    losses: dict[str, float] = {}
    grads: dict[str, dict[str, float]] = {}
    errors: dict[str, list[str]] = {}
    cloned: list[str] = []
    traced: dict[str, Any] = {}
    for key in keys:  # every rank builds the same configurations in the same order (collectives inside)
        spec = CONFIGS[key]
        if spec.torch_schedule is None:
            measured = _ours(key, plans[spec.plan], cfg, x, y)
            loss = measured.case.step()  # first step: loss and gradients to compare
        else:
            probed, loss, notes = _probe_theirs(key, rank, plans[spec.plan], spec.torch_schedule, cfg, x, y,
                                                probe_timeout)
            if notes:
                errors[key] = notes
            if probed is None:
                continue
            measured = probed
            if notes:  # ran only with its outputs cloned
                cloned.append(key)
        if loss is not None:
            losses[key] = loss
        grads[key] = _grad_sums(measured.named())
        for _ in range(cfg.warmup):  # the first steps run slower (memory still being mapped)
            measured.case.step()
        if measured.pipe is not None and calibrating:
            measured.pipe.trace = True  # the timed rounds' actions calibrate the other plans
            traced[key] = measured.pipe
        cases.append(measured.case)
    times: dict[str, list[float]] = {c.key: [] for c in cases}
    waits: dict[str, list[float]] = {c.key: [] for c in cases}
    sched: dict[str, list[float]] = {c.key: [0.0, 0.0, 0.0] for c in cases}  # wall, run, wait
    dist.barrier()
    for _ in range(cfg.rounds):
        for case in cases:
            dist.barrier()
            case.step()  # untimed
            timed_steps(case.step, steps=cfg.steps, times=times[case.key], waits=waits[case.key],
                        totals=sched[case.key])
            dist.barrier()
    events = {key: [dataclasses.asdict(e) for e in pipe.trace_events()] for key, pipe in traced.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "events": events,
        "times": times, "waits": waits, "losses": losses, "grads": grads, "errors": errors, "cloned": cloned,
        "sched": sched}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def run_benchmark(cfg: BenchConfig, *, keys: Sequence[str] | None = None, work: Path | None = None,
                  probe_timeout: float = PROBE_TIMEOUT, calibrated: bool = True,
                  say: Callable[[str], None] = print) -> list[Row]:
    """Plan, run the configurations ``keys`` (default: all of :data:`CONFIGS`) on 2 ranks, and summarise.

    ``calibrated``: trace our configurations and calibrate each plan's prediction
    on the others' traces (see the module docstring).
    """
    from partitioner.plan import Plan
    from runtime.verify import free_port, start_ranks

    chosen = [k for k in CONFIGS if keys is None or k in keys]
    needed = [p for p in PLANS if any(CONFIGS[k].plan == p for k in chosen)]
    with tempfile.TemporaryDirectory(prefix="bench-schedules-") as tmp:
        base = work or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        dirs = make_plans(cfg, base, needed)
        plans = {k: Plan.load(v) for k, v in dirs.items()}
        say(f"planned {len(plans)} plans in {time.perf_counter() - t0:.1f} s"
            + (f" (auto picked {schedule_name(plans['auto'])})" if "auto" in plans else "")
            + f"; running {WORLD} ranks ({cfg.rounds} rounds x {cfg.steps} timed steps per configuration)")
        t0 = time.perf_counter()
        start_ranks(_rank_main, (free_port(), dataclasses.asdict(cfg), {k: str(v) for k, v in dirs.items()},
                                 chosen, str(base), probe_timeout, calibrated),
                    WORLD)
        say(f"ranks finished in {time.perf_counter() - t0:.1f} s")
        results = [json.loads(Path(base, f"rank{r}.json").read_text()) for r in range(WORLD)]
    calibrations = calibrate_each(plans, results) if calibrated else {}
    for key, c in calibrations.items():
        say(f"calibration for {CONFIGS[key].label}, on {c.source}: measured = {c.scale:.3f} x predicted + "
            f"{1e6 * c.action_s:.0f} us per action ({c.samples} stage actions), jitter {100 * c.jitter:.0f}%")
    return [_row(key, plans[CONFIGS[key].plan], results, calibrations.get(key)) for key in chosen]


def calibrate_each(plans: dict[str, Any], results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per traced configuration of ours, a calibration fitted on every *other* plan's traced actions.

    Configurations on the same plan (auto's pick and the configuration of its
    schedule, when the split is the same) are left out of each other's fits.
    A configuration with no other plan traced gets none.
    """
    from partitioner.cost.calibration import fit
    from partitioner.schedule.timeline import TimelineEvent
    from partitioner.search.calibrate import action_jitter, stage_pairs

    traced = [k for k in results[0]["events"] if all(k in res["events"] for res in results)]
    events = {k: [TimelineEvent(**e) for res in results for e in res["events"][k]] for k in traced}
    pairs = {k: stage_pairs(plans[CONFIGS[k].plan], events[k]) for k in traced}
    ident = {k: (schedule_name(plans[CONFIGS[k].plan]), describe_split(plans[CONFIGS[k].plan])) for k in traced}
    found = {}
    for key in traced:
        others = [k for k in traced if ident[k] != ident[key]]
        if others:
            fitted = fit([p for k in others for p in pairs[k]])
            found[key] = dataclasses.replace(fitted, source=", ".join(k.removeprefix("ours_") for k in others),
                                             jitter=action_jitter(*(events[k] for k in others)))
    return found


def _row(key: str, plan: Any, results: list[dict[str, Any]], calibration: Any) -> Row:
    spec = CONFIGS[key]
    label = f"{spec.label} -> {schedule_name(plan)}" if key == "ours_auto" else spec.label
    notes = results[0]["errors"].get(key)
    cloned = key in results[0]["cloned"]
    if cloned:
        label += " *"  # ran only with cloned outputs (see format_table)
    common: dict[str, Any] = {"key": key, "label": label, "split": describe_split(plan),
                              "schedule": schedule_name(plan)}
    from partitioner.search.calibrate import recalibrated

    planned = plan.predicted.step_s if spec.torch_schedule is None else None
    predicted = planned if planned is None or calibration is None else recalibrated(plan, calibration).predicted.step_s
    steady = None if planned is None or calibration is None or not calibration.jitter else \
        recalibrated(plan, dataclasses.replace(calibration, jitter=0.0)).predicted.step_s
    if notes and not cloned:
        return Row(**common, step_s=None, error="; ".join(notes))
    times = results[0]["times"][key]
    ts = sorted(times)
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
    step_wait = [max(res["waits"][key][i] / res["times"][key][i] for res in results) for i in range(len(times))]
    clean = [t for t, w in zip(times, step_wait) if w <= CLEAN_WAIT]
    loss = results[0]["losses"].get(key, results[1]["losses"].get(key))
    # One entry per parameter, a tied one under its group's name (its copies hold the same summed gradient).
    alias = {a: t.name for t in plan.tied for a in t.aliases}
    sums: dict[str, float] = {}
    for res in results:
        sums.update({alias.get(n, n): v for n, v in res["grads"][key].items()})
    return Row(**common, step_s=statistics.median(ts), p25_s=q[0], p75_s=q[2],
               clean_s=statistics.median(clean) if len(clean) >= 3 else None, clean_steps=len(clean),
               steps=len(ts), predicted_s=predicted, planned_s=planned, steady_s=steady, loss=loss, grad_norm=math.sqrt(sum(sums.values())),
               note="; ".join(notes) if notes else None,
               wait_share=tuple(res["sched"][key][2] / res["sched"][key][0] for res in results),
               step_times=tuple(times))


def _ms(seconds: float | None, width: int = 8) -> str:
    return f"{seconds * 1e3:{width}.1f}" if seconds is not None else f"{'-':>{width}}"


def _ratio(a: float | None, b: float | None, width: int = 6) -> str:
    return f"{a / b:{width}.2f}" if a is not None and b is not None else f"{'-':>{width}}"


def format_table(rows: Sequence[Row]) -> str:
    """One line per configuration; a failed torch schedule shows its error instead of times."""
    by_key = {r.key: r for r in rows}
    base = by_key.get("ours_1f1b")
    head = (f"{'configuration':<34} {'split':<40} | {'step ms':>8} {'p25-p75':>9} {'uncont.':>8} {'n':>5} | "
            f"{'vs 1f1b':>7} {'uncont.':>7} | {'pred ms':>8} {'meas/pred':>9} {'uncont.':>7} "
            f"{'planned':>8} {'meas/pl.':>8} | "
            f"{'loss':>7} {'grad norm':>10} {'cpu wait':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        start = f"{r.label[:34]:<34} {r.split[:40]:<40} | "
        if r.error is not None:
            lines.append(start + f"FAILED: {r.error}")
            continue
        assert r.p25_s is not None and r.p75_s is not None
        lines.append(
            start + f"{_ms(r.step_s)} {f'{r.p25_s * 1e3:.0f}-{r.p75_s * 1e3:.0f}':>9} {_ms(r.clean_s)} "
            f"{r.clean_steps:>2}/{r.steps:<2} | "
            f"{_ratio(r.step_s, base.step_s if base else None, 7)} {_ratio(r.clean_s, base.clean_s if base else None, 7)} | "
            f"{_ms(r.predicted_s)} {_ratio(r.step_s, r.predicted_s, 9)} {_ratio(r.clean_s, r.predicted_s, 7)} "
            f"{_ms(r.planned_s)} {_ratio(r.step_s, r.planned_s, 8)} | "
            f"{(f'{r.loss:.4f}' if r.loss is not None else '-'):>7} "
            f"{(f'{r.grad_norm:.5f}' if r.grad_norm is not None else '-'):>10} "
            f"{100 * max(r.wait_share, default=0):7.0f}%"
        )
    for r in rows:
        if r.note is not None:
            lines.append(f"* {r.label[:-2]} ran with cloned stage outputs (_Cloned); with bench_runtime's "
                         f"adaptations it failed, {r.note}")
    return "\n".join(lines)


def _pick(rows: Sequence[Row], clean: bool) -> dict[str, float]:
    got = {r.key: r.clean_s if clean else r.step_s for r in rows}
    return {k: v for k, v in got.items() if v is not None}


def _twin(rows: Sequence[Row], key: str) -> Row | None:
    """Another of our configurations whose plan is the same as ``key``'s (same schedule, same split)."""
    row = next(r for r in rows if r.key == key)
    return next((r for r in rows if r.key != key and CONFIGS[r.key].torch_schedule is None
                 and (r.schedule, r.split) == (row.schedule, row.split)), None)


def _auto_verdict(rows: Sequence[Row], times: dict[str, float], which: str) -> str:
    """Auto's pick against the fastest of ours.  When auto chose the very plan of another configuration,
    that plan was measured twice: both measurements count (their median), and their gap is the run's noise."""
    by_key = {r.key: r for r in rows}
    auto, twin = by_key["ours_auto"], _twin(rows, "ours_auto")
    mine, noise = times["ours_auto"], ""
    others = {k: v for k, v in times.items() if k != "ours_auto"}
    if twin is not None and twin.key in others:
        both = [*auto.step_times, *twin.step_times] if which == "all steps" else [mine, others[twin.key]]
        mine = statistics.median(both)
        noise = (f"; the plan of '{twin.label}' (same schedule and split), measured twice: "
                 f"{times['ours_auto'] * 1e3:.1f} and {others.pop(twin.key) * 1e3:.1f} ms, median of both "
                 f"{mine * 1e3:.1f} ms")
    best = min(others, key=others.__getitem__)
    ratio = mine / min(mine, others[best])
    return (f"{'MET ' if ratio <= 1.05 else 'MISS'} [{which}] auto's pick ({auto.schedule}) is {ratio:.2f}x "
            f"the fastest of ours ({by_key[best].label if others[best] < mine else 'itself'}) "
            f"(target <= 1.05){noise}")


def verdicts(rows: Sequence[Row]) -> list[str]:
    """The issue's targets, on all steps and on the uncontended ones, plus agreement of losses and gradients."""
    by_key = {r.key: r for r in rows}
    out = []
    for which, clean in (("all steps", False), ("uncontended", True)):
        times = _pick(rows, clean)
        for r in rows:  # ours vs torch on the same split
            spec = CONFIGS[r.key]
            ours = spec.same_split_as
            if spec.torch_schedule is None or ours not in by_key:
                continue
            assert ours is not None
            if r.error is not None:
                out.append(f"n/a  [{which}] {by_key[ours].label} vs {r.label}: torch's schedule failed")
            elif ours in times and r.key in times:
                ratio = times[ours] / times[r.key]
                out.append(f"{'MET ' if ratio <= 1 else 'MISS'} [{which}] {by_key[ours].label} vs {r.label} "
                           f"(same split): step ratio {ratio:.2f} (target <= 1.00)")
            else:
                out.append(f"n/a  [{which}] {by_key[ours].label} vs {r.label}: too few uncontended steps")
        ours_times = {k: v for k, v in times.items() if CONFIGS[k].torch_schedule is None}
        if "ours_auto" in ours_times and len(ours_times) > 1:
            out.append(_auto_verdict(rows, ours_times, which))
        theirs_times = {k: v for k, v in times.items() if CONFIGS[k].torch_schedule is not None}
        if ours_times and theirs_times:
            a = min(ours_times, key=ours_times.__getitem__)
            b = min(theirs_times, key=theirs_times.__getitem__)
            ratio = ours_times[a] / theirs_times[b]
            out.append(f"{'MET ' if ratio <= 1 else 'MISS'} [{which}] fastest of ours ({by_key[a].label}) vs fastest "
                       f"of torch's ({by_key[b].label}): step ratio {ratio:.2f} (target <= 1.00)")
        if not clean and ours_times:
            measured = sorted(ours_times, key=ours_times.__getitem__)
            predicted = sorted(ours_times, key=lambda k: by_key[k].predicted_s or 0.0)
            out.append("note: ours fastest first, measured: " + ", ".join(k.removeprefix("ours_") for k in measured)
                       + "; predicted: " + ", ".join(k.removeprefix("ours_") for k in predicted))
        for key, t in ours_times.items():
            r = by_key[key]
            if r.predicted_s is not None:
                err = t / r.predicted_s - 1
                steady = "" if r.steady_s is None else f"without jitter: {100 * (t / r.steady_s - 1):+.0f}%; "
                calibrated = "" if r.planned_s in (None, r.predicted_s) else \
                    f" calibrated ({steady}as planned: {100 * (t / r.planned_s - 1):+.0f}% vs {r.planned_s * 1e3:.1f} ms)"
                out.append(f"{'MET ' if abs(err) <= 0.15 else 'MISS'} [{which}] {r.label}: measured "
                           f"{100 * err:+.0f}% vs predicted {r.predicted_s * 1e3:.1f} ms{calibrated} (target within 15%)")
    for what, get in (("loss", lambda r: r.loss), ("gradient norm", lambda r: r.grad_norm)):
        values = [v for v in (get(r) for r in rows if r.error is None) if v is not None]
        if values:
            spread = (max(values) - min(values)) / max(abs(max(values)), 1e-12)
            out.append(f"{'MET ' if spread <= 1e-4 else 'MISS'} first-step {what} agrees across configurations: "
                       f"relative spread {spread:.1e} (target <= 1e-4)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small configuration (< 90 s)")
    for name in ("layers", "embd", "heads", "seq", "batch", "vocab", "microbatches", "rounds", "steps"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--only", default=None, help=f"comma-separated configurations: {', '.join(CONFIGS)}")
    parser.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT,
                        help="seconds a torch schedule's first step waits for a failed peer")
    parser.add_argument("--no-calibration", action="store_true",
                        help="no tracing: judge the predictions as planned")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--work", type=Path, default=None, help="keep plans and rank results in this directory")
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(default_config(quick=args.quick),
                              **{k: v for k, v in vars(args).items()
                                 if k in BenchConfig.__dataclass_fields__ and v is not None})
    if cfg.batch % cfg.microbatches or cfg.microbatches % WORLD:
        parser.error(f"--batch {cfg.batch} must be a multiple of --microbatches {cfg.microbatches}, itself a "
                     f"multiple of {WORLD} (interleaved 1F1B runs rounds of one micro-batch per rank)")
    keys = args.only.split(",") if args.only else None
    unknown = sorted(set(keys or ()) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    print(f"GPT: {cfg.layers} layers, n_embd {cfg.embd}, {cfg.heads} heads, seq {cfg.seq}, batch {cfg.batch}, "
          f"vocab {cfg.vocab}; M={cfg.microbatches} micro-batches; {WORLD} CPU ranks x 1 thread (gloo); "
          f"torch {torch.__version__}")
    rows = run_benchmark(cfg, keys=keys, work=args.work, probe_timeout=args.probe_timeout,
                         calibrated=not args.no_calibration)
    print()
    print(format_table(rows))
    print()
    print(f"step = rank 0's median over {cfg.rounds} x {cfg.steps} timed steps; uncont. = median over the steps "
          f"where no rank waited for a CPU more than {100 * CLEAN_WAIT:.0f}% of the step (n of them); "
          "vs 1f1b = step / ours 1F1B's; pred = the simulator's step for the plan, calibrated on the other plans' "
          "traced runs (planned: as the plan predicts it)")
    for line in verdicts(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"config": dataclasses.asdict(cfg),
                                         "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
