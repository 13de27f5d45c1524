"""Predicted vs. measured: run a few plans on CPU ranks and compare step and per-stage times.

Commands (from the repository root)::

    .venv/bin/python tools/bench_predict.py                    # full: 8-layer GPT, 4 plans; traces in $TMPDIR/autopartition-bench-predict/
    .venv/bin/python tools/bench_predict.py --quick            # one small plan, < 60 s
    .venv/bin/python tools/bench_predict.py --plans pp2-gpipe,pp2-1f1b --steps 10 --out /tmp/predict
    .venv/bin/python tools/bench_predict.py --json predict.json

Each plan is compiled with ``device="cpu"`` (costs measured on this machine with
one thread, as the ranks run), saved, and run on ``plan.gpus`` spawned CPU ranks
(gloo, ``torch.set_num_threads(1)``) with ``Pipeline(trace=True)``: warm-up
steps untraced, then ``--steps`` traced steps.  From each rank's
``trace_events()`` (passed back through files):

* measured step = median over steps of the step's wall span (first action
  start to last action end over all ranks); the ``step()`` column is rank 0's
  median wall time of the ``Pipeline.step`` call, which also covers what the
  trace does not (splitting the batch, waiting for sends, the tied-weight
  all-reduce);
* measured stage compute = median over steps of the sum of that rank's ``F``
  and ``B`` durations;

against the prediction: ``plan.predicted.step_s`` (the simulator) and
``(forward_s + backward_s) x microbatches`` of each stage.

For every plan the output directory gets ``measured.json`` (``Pipeline.write_trace``,
every traced step), ``predicted.json`` (``write_chrome_trace`` of ``simulate(plan)``),
and ``measured.png`` / ``predicted.png`` (the median step next to the simulated
one, same layout): open the JSON files in https://ui.perfetto.dev side by side.

With more ranks than cores (``pp3``: 3 ranks on a 2-core machine) ranks take
turns on the cores and the measured times say more about the scheduler than
about the plan; such rows are marked.  The ``cpu wait`` column is the share of
the wall time a rank was runnable but not running (from /proc/thread-self/schedstat):
other work on the machine taking the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
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

from tools.bench_runtime import CLEAN_WAIT, BenchConfig, batch_data, build_gpt, sched_times

__all__ = ["PlanSpec", "Result", "format_table", "main", "run_plan"]

PLANS = ("pp2-gpipe", "pp2-1f1b", "dp2", "pp3-gpipe")


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    name: str
    pp: int
    dp: int
    schedule: str
    microbatches: int

    @property
    def gpus(self) -> int:
        return self.pp * self.dp


def plan_specs(names: Sequence[str], microbatches: int) -> list[PlanSpec]:
    table = {
        "pp2-gpipe": PlanSpec("pp2-gpipe", 2, 1, "gpipe", microbatches),
        "pp2-1f1b": PlanSpec("pp2-1f1b", 2, 1, "1f1b", microbatches),
        "dp2": PlanSpec("dp2", 1, 2, "gpipe", max(1, microbatches // 2)),
        "pp3-gpipe": PlanSpec("pp3-gpipe", 3, 1, "gpipe", microbatches),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown plan(s) {unknown}; choose from {', '.join(table)}")
    return [table[n] for n in names]


@dataclasses.dataclass
class StageResult:
    stage: int
    rank: int
    predicted_compute_s: float  # (forward + backward) x microbatches
    measured_compute_s: float  # median over steps of the sum of F and B durations
    predicted_f_s: float  # per micro-batch
    measured_f_s: float
    predicted_b_s: float
    measured_b_s: float
    predicted_wait_s: float  # RF + RB durations in the simulated step
    measured_wait_s: float  # median over steps of RF + RB durations (waiting for a peer)
    predicted_send_s: float  # SF + SB durations in the simulated step (0: sends are free in the model)
    measured_send_s: float  # median over steps of SF + SB durations (posting the sends)
    measured_gap_s: float  # median over steps of untraced time between this rank's first and last action
    measured_idle_s: float  # median over steps of the span before this rank's first / after its last action
    cpu_wait: float  # share of wall time runnable but not running


@dataclasses.dataclass
class Result:
    name: str
    ranks: int
    predicted_step_s: float
    measured_step_s: float  # median span
    span_p25_s: float
    span_p75_s: float
    call_step_s: float  # rank 0's median Pipeline.step wall
    stages: list[StageResult]
    oversubscribed: bool
    split: str
    clean_step_s: float | None = None  # median span over the uncontended steps
    clean_steps: int = 0
    steps: int = 0

    @property
    def error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1

    @property
    def clean_error(self) -> float | None:
        return None if self.clean_step_s is None else self.predicted_step_s / self.clean_step_s - 1


# ------------------------------------------------------------------ ranks


def _rank_main(rank: int, world: int, port: int, plan_dir: str, cfg_dict: dict[str, Any], warmup: int,
               steps: int, out: str) -> None:
    from examples.gpt import loss_fn
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = BenchConfig(**cfg_dict)
    plan = Plan.load(plan_dir)
    x, y = batch_data(cfg)
    pipe = Pipeline(plan, build_gpt(cfg), loss_fn, device=torch.device("cpu"), timeout=cfg.timeout, trace=False)

    def step() -> None:
        for p in pipe.parameters():
            p.grad = None
        pipe.step((x,), y)

    for _ in range(warmup):
        step()
    pipe.trace = True
    dist.barrier()
    calls, waits = [], []
    run0, wait0 = sched_times()
    wall0 = time.perf_counter()
    for _ in range(steps):
        before = sched_times()[1]
        start = time.perf_counter()
        step()
        calls.append(time.perf_counter() - start)
        waits.append(sched_times()[1] - before)
    wall = time.perf_counter() - wall0
    run1, wait1 = sched_times()
    events = [dataclasses.asdict(e) for e in pipe.trace_events()]
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "stage": pipe.stage, "calls": calls, "waits": waits, "events": events,
        "actions_per_step": len(plan.actions[pipe.stage]), "cpu": (run1 - run0) / wall,
        "cpu_wait": (wait1 - wait0) / wall,
    }))
    pipe.write_trace(Path(out, "measured.json"))  # collective: rank 0 writes every rank's actions
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ analysis


def _per_step(events: list[dict[str, Any]], per_step: int) -> list[list[dict[str, Any]]]:
    return [events[i : i + per_step] for i in range(0, len(events), per_step)]


def _dur(e: dict[str, Any]) -> float:
    return float(e["end_s"] - e["start_s"])


def analyse(plan: Any, ranks: list[dict[str, Any]], *, name: str, cores: int) -> tuple[Result, int]:
    """The comparison, and the index of the median step (for the picture)."""
    from tools.bench_runtime import describe_split

    steps = [_per_step(r["events"], r["actions_per_step"]) for r in ranks]
    n = min(len(s) for s in steps)
    spans = []
    for i in range(n):
        evs = [e for s in steps for e in s[i]]
        spans.append(max(e["end_s"] for e in evs) - min(e["start_s"] for e in evs))
    order = sorted(range(n), key=lambda i: spans[i])
    median_step = order[n // 2]
    q = statistics.quantiles(spans, n=4) if n > 1 else [spans[0]] * 3
    m = plan.microbatches
    from partitioner.schedule.simulate import simulate

    sim_events = simulate(plan).events
    stage_results = []
    for r, per in zip(ranks, steps):
        sp = plan.stages[r["stage"]].predicted
        comp, f, b, wait, send, gap, idle = [], [], [], [], [], [], []
        for i, evs in enumerate(per[:n]):
            fs = [_dur(e) for e in evs if e["kind"] == "F"]
            bs = [_dur(e) for e in evs if e["kind"] == "B"]
            comp.append(sum(fs) + sum(bs))
            f.append(sum(fs) / len(fs))
            b.append(sum(bs) / len(bs))
            wait.append(sum(_dur(e) for e in evs if e["kind"] in ("RF", "RB")))
            send.append(sum(_dur(e) for e in evs if e["kind"] in ("SF", "SB")))
            busy = max(e["end_s"] for e in evs) - min(e["start_s"] for e in evs)
            gap.append(busy - sum(_dur(e) for e in evs))
            idle.append(spans[i] - busy)
        stage_results.append(StageResult(
            stage=r["stage"], rank=r["rank"], predicted_compute_s=(sp.forward_s + sp.backward_s) * m,
            measured_compute_s=statistics.median(comp), predicted_f_s=sp.forward_s,
            measured_f_s=statistics.median(f), predicted_b_s=sp.backward_s, measured_b_s=statistics.median(b),
            predicted_wait_s=sum(e.duration_s for e in sim_events
                                 if e.track == r["stage"] and e.kind in ("RF", "RB")),
            measured_wait_s=statistics.median(wait),
            predicted_send_s=sum(e.duration_s for e in sim_events
                                 if e.track == r["stage"] and e.kind in ("SF", "SB")),
            measured_send_s=statistics.median(send), measured_gap_s=statistics.median(gap),
            measured_idle_s=statistics.median(idle), cpu_wait=r["cpu_wait"],
        ))
    clean = [spans[i] for i in range(n)
             if all(r["waits"][i] <= CLEAN_WAIT * r["calls"][i] for r in ranks)]
    result = Result(name=name, ranks=len(ranks), predicted_step_s=plan.predicted.step_s,
                    measured_step_s=statistics.median(spans), span_p25_s=q[0], span_p75_s=q[2],
                    call_step_s=statistics.median(ranks[0]["calls"]), stages=stage_results,
                    oversubscribed=len(ranks) > cores, split=describe_split(plan),
                    clean_step_s=statistics.median(clean) if len(clean) >= 3 else None, clean_steps=len(clean),
                    steps=n)
    return result, median_step


def write_pictures(plan: Any, ranks: list[dict[str, Any]], step: int, out: Path, name: str) -> None:
    """predicted.json / .png from the simulator, measured.png of one step (shifted to start at 0)."""
    from partitioner.report.figures import timeline_png
    from partitioner.schedule.simulate import simulate
    from partitioner.schedule.timeline import TimelineEvent, write_chrome_trace

    sim = simulate(plan)
    write_chrome_trace(out / "predicted.json", list(sim.events), title="predicted")
    timeline_png(sim.events, out / "predicted.png", title=f"{name}: predicted step {sim.step_s * 1e3:.1f} ms")
    events = [e for r in ranks for e in _per_step(r["events"], r["actions_per_step"])[step]]
    t0 = min(e["start_s"] for e in events)
    shifted = [TimelineEvent(**{**e, "start_s": e["start_s"] - t0, "end_s": e["end_s"] - t0}) for e in events]
    write_chrome_trace(out / "measured_step.json", shifted, title="measured (median step)", track_name="rank")
    span = max(e.end_s for e in shifted)
    timeline_png(shifted, out / "measured.png", title=f"{name}: measured step {span * 1e3:.1f} ms (median step)",
                 track_name="rank")


# ------------------------------------------------------------------ driver


def run_plan(spec: PlanSpec, cfg: BenchConfig, out: Path, *, warmup: int, steps: int,
             say: Callable[[str], None] = print) -> Result:
    from examples.gpt import loss_fn
    from partitioner.search.planner import compile as plan_compile
    from runtime.verify import free_port, start_ranks

    out.mkdir(parents=True, exist_ok=True)
    x, y = batch_data(cfg)
    t0 = time.perf_counter()
    plan = plan_compile(build_gpt(cfg), (x,), gpus=spec.gpus, pp=spec.pp, dp=spec.dp,
                        microbatches=spec.microbatches, schedule=spec.schedule, device="cpu",
                        loss_fn=loss_fn, target=y)
    plan.save(out / "plan")
    say(f"{spec.name}: planned in {time.perf_counter() - t0:.1f} s (predicted step "
        f"{plan.predicted.step_s * 1e3:.1f} ms); running {spec.gpus} ranks")
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as tmp:
        start_ranks(_rank_main, (spec.gpus, free_port(), str(out / "plan"), dataclasses.asdict(cfg),
                                 warmup, steps, tmp),
                    spec.gpus)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(spec.gpus)]
        shutil.move(str(Path(tmp, "measured.json")), str(out / "measured.json"))
    result, median_step = analyse(plan, ranks, name=spec.name, cores=os.cpu_count() or 1)
    write_pictures(plan, ranks, median_step, out, spec.name)
    return result


def format_table(results: Sequence[Result]) -> str:
    head = (f"{'plan':<10} {'ranks':>5} {'split':<18} {'pred step':>9} {'meas step':>9} {'p25-p75':>9} "
            f"{'error':>7} {'uncont.':>7} {'n':>5} {'error':>7} {'step()':>7}  "
            "per-stage compute, predicted/measured ms (error)")
    lines = [head, "-" * 150]
    for r in results:
        stages = "  ".join(
            f"s{s.stage}r{s.rank} {s.predicted_compute_s * 1e3:.0f}/{s.measured_compute_s * 1e3:.0f} "
            f"({100 * (s.predicted_compute_s / s.measured_compute_s - 1):+.0f}%)" for s in r.stages)
        mark = " *" if r.oversubscribed else ""
        lines.append(
            f"{r.name + mark:<10} {r.ranks:>5} {r.split[:18]:<18} {r.predicted_step_s * 1e3:9.1f} "
            f"{r.measured_step_s * 1e3:9.1f} "
            f"{f'{r.span_p25_s * 1e3:.0f}-{r.span_p75_s * 1e3:.0f}':>9} {100 * r.error:+6.1f}% "
            f"{(f'{r.clean_step_s * 1e3:7.1f}' if r.clean_step_s else '      -')} {r.clean_steps:>2}/{r.steps:<2} "
            f"{(f'{100 * r.clean_error:+6.1f}%' if r.clean_error is not None else '      -')} "
            f"{r.call_step_s * 1e3:7.1f}  {stages}"
        )
    lines += ["",
              ("per stage: F, B = forward, backward per micro-batch (ms), predicted/measured; per step (ms): "
               "wait = in RF/RB (bubble + transfers), sends = in SF/SB,"),
              ("gaps = untraced time between the rank's first and last action, idle = rest of the step span; "
               "cpu wait = share of the wall time runnable but not running"),
              ""]
    sub = (f"{'plan':<10} {'stage':>5} {'rank':>4} {'F pred/meas':>12} {'B pred/meas':>12} {'F err':>6} "
           f"{'B err':>6} {'wait pred/meas':>15} {'sends':>6} {'gaps':>6} {'idle':>6} {'cpu wait':>8}")
    lines += [sub, "-" * len(sub)]
    for r in results:
        for s in r.stages:
            lines.append(
                f"{r.name:<10} {s.stage:>5} {s.rank:>4} "
                f"{f'{s.predicted_f_s * 1e3:.2f}/{s.measured_f_s * 1e3:.2f}':>12} "
                f"{f'{s.predicted_b_s * 1e3:.2f}/{s.measured_b_s * 1e3:.2f}':>12} "
                f"{100 * (s.predicted_f_s / s.measured_f_s - 1):+5.0f}% {100 * (s.predicted_b_s / s.measured_b_s - 1):+5.0f}% "
                f"{f'{s.predicted_wait_s * 1e3:.1f}/{s.measured_wait_s * 1e3:.1f}':>15} "
                f"{s.measured_send_s * 1e3:6.1f} {s.measured_gap_s * 1e3:6.1f} {s.measured_idle_s * 1e3:6.1f} "
                f"{100 * s.cpu_wait:7.0f}%"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small plan (< 60 s)")
    parser.add_argument("--plans", default=None, help=f"comma-separated, from {', '.join(PLANS)} (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="traced steps per plan")
    parser.add_argument("--warmup", type=int, default=2)
    for name in ("layers", "embd", "heads", "seq", "batch", "vocab", "microbatches"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "autopartition-bench-predict")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    cfg = dataclasses.replace(cfg, **{k: v for k, v in vars(args).items()
                                      if k in BenchConfig.__dataclass_fields__ and v is not None})
    names = args.plans.split(",") if args.plans else (["pp2-gpipe"] if args.quick else list(PLANS))
    steps = args.steps or (4 if args.quick else 12)
    specs = plan_specs(names, cfg.microbatches)
    cores = os.cpu_count() or 1
    print(f"GPT: {cfg.layers} layers, n_embd {cfg.embd}, {cfg.heads} heads, seq {cfg.seq}, batch {cfg.batch}; "
          f"{cores} cores; {args.warmup} warm-up + {steps} traced steps per plan; traces under {args.out}/")
    results = [run_plan(spec, cfg, args.out / spec.name, warmup=args.warmup, steps=steps) for spec in specs]
    print()
    print(format_table(results))
    if any(r.oversubscribed for r in results):
        print(f"\n* more ranks than the {cores} cores: ranks take turns, so measured times include the wait")
    print("\nerror = predicted / measured - 1; uncont. = median over the steps where no rank waited for a CPU "
          f"more than {100 * CLEAN_WAIT:.0f}% of the step; target: |step error| <= 15% for plans costed on this device")
    for r in results:
        note = " (oversubscribed)" if r.oversubscribed else ""
        print(f"{'MET ' if abs(r.error) <= 0.15 else 'MISS'} {r.name}: step error {100 * r.error:+.1f}% "
              f"(all steps){note}")
        if r.clean_error is not None:
            print(f"{'MET ' if abs(r.clean_error) <= 0.15 else 'MISS'} {r.name}: step error "
                  f"{100 * r.clean_error:+.1f}% (uncontended steps, {r.clean_steps} of {r.steps}){note}")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
