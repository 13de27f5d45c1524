"""What each pipeline schedule buys: the best plan per schedule on the large examples, predicted for H100s.

One ``compile(schedule="auto")`` per model plans every schedule at once (the planner
tries each, with interleaved-1f1b at 2 and 4 stages per rank); the table then shows,
for every (schedule, chunks) tried, its best combination: pp x dp x M, the simulated
step (``~`` marks a closed form where the schedule's best was not simulated), the
bubble, the peak memory per GPU and the step against the chosen plan.  The best
:data:`~partitioner.search.layouts.SIMULATED_CANDIDATES` by closed form are refined in
simulation; the best of every other schedule is simulated without refinement
(refinement gains a few percent at most), so a schedule's row is a little pessimistic
unless it is among those.

Cases (``--schedules``): Llama 3 70B on 64 H100s (256 x 4,096 tokens) and GPT-3 175B
on 512 H100s (1,536 x 2,048), bf16-mixed, Adam, recomputation where needed, 8 GPUs
per node, as in ``tools/bench_large.py``; ``--quick``: the tiny Llama and GPT of the
same files on 8 GPUs.

>>> row = ScheduleRow("m", "zbv", 2, 4, 2, 8, 1.0, True, 0.05, 2**30, "feasible", "chosen", chosen_s=1.0)
>>> print_schedule_table([row])
model  schedule  pp x dp x M    step  bubble  peak memory / GPU  vs chosen    note
-----  --------  -----------  ------  ------  -----------------  ---------  ------
m           zbv    4 x 2 x 8  1.00 s    5.0%           1.00 GiB         +0  chosen
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.benchplanner.tables import print_table

__all__ = ["LARGE", "QUICK", "ScheduleCase", "ScheduleRow", "print_schedule_table", "schedule_rows"]

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class ScheduleCase:
    name: str
    spec: str  # model file[:factory], relative to the repository root
    gpus: int
    batch: int
    device: str = "h100"
    gpus_per_node: int = 8


LARGE = (
    ScheduleCase("llama3-70b", "examples/llama.py:llama3_70b", 64, 256),
    ScheduleCase("gpt3-175b", "examples/gpt3.py:gpt3_175b", 512, 1536),
)
QUICK = (
    ScheduleCase("tiny-llama", "examples/llama.py", 8, 128),
    ScheduleCase("tiny-gpt", "examples/gpt3.py", 8, 32),
)
OPTIONS: dict[str, Any] = {"precision": "bf16-mixed", "optimizer": "adam", "recompute": "auto",
                           "microbatches": "auto", "schedule": "auto"}


@dataclasses.dataclass(frozen=True)
class ScheduleRow:
    model: str
    schedule: str
    chunks: int
    pp: int | None
    dp: int | None
    microbatches: int | None
    step_s: float | None  # simulated, else the closed form (``simulated`` False), None: nothing solved
    simulated: bool
    bubble: float | None
    memory: float | None  # peak bytes per GPU
    status: str
    note: str
    chosen_s: float = 0.0  # the chosen plan's simulated step
    wall_s: float = 0.0  # the compile that planned the model


def schedule_rows(
    case: ScheduleCase, say: Callable[[str], None], *, memory_per_gpu: float | None = None
) -> list[ScheduleRow]:
    """Plan ``case`` once with every schedule; the best trial of each (schedule, chunks) as a row.

    ``memory_per_gpu``: a budget other than the device's (a large one shows what each schedule
    would buy if memory did not bind).
    """
    import torch

    from partitioner.modelfile import load_model_file
    from partitioner.search import planner
    from partitioner.search.layouts import Trial

    torch.manual_seed(0)
    model_file = load_model_file(str(ROOT / case.spec))
    model = model_file.build()
    inputs = model_file.example_inputs(case.batch)
    seen: list[list[Trial]] = []
    original = planner.candidate_rows

    def recorded(trials: list[Trial], *args: Any, **kwargs: Any) -> Any:
        seen.append(trials)  # the planner's every trial, with its chunks (a Candidate row may lack them)
        return original(trials, *args, **kwargs)

    planner.candidate_rows = recorded  # type: ignore[assignment]
    start = time.perf_counter()
    try:
        plan = planner.compile(model, inputs, gpus=case.gpus, device=case.device, memory_per_gpu=memory_per_gpu,
                               gpus_per_node=min(case.gpus_per_node, case.gpus), status=say, **OPTIONS)
    finally:
        planner.candidate_rows = original  # type: ignore[assignment]
    wall = time.perf_counter() - start
    chosen_s = plan.predicted.step_s
    best: dict[tuple[str, int], Trial] = {}
    for t in seen[-1]:
        if t.schedule is None:
            continue
        key = (t.schedule, t.chunks)
        if key not in best or _rank(t) < _rank(best[key]):
            best[key] = t
    rows = []
    for (schedule, chunks), t in sorted(best.items(), key=lambda kv: _order(kv[0])):
        chosen = (t.pp, t.dp, t.microbatches, schedule, chunks) == (
            plan.pp, plan.dp, plan.microbatches, plan.schedule, plan.chunks)
        step = t.simulated_s if t.simulated_s is not None else (
            t.partition.objective if t.partition is not None else None)
        note = "chosen" if chosen else _why(t)
        rows.append(ScheduleRow(
            case.name, schedule, chunks, t.pp, t.dp, t.microbatches, step, t.simulated_s is not None,
            t.simulated_bubble if t.simulated_bubble is not None else t.bubble, t.memory, t.status, note,
            chosen_s, wall))
    return rows


def _rank(t: Any) -> tuple[int, float]:
    """Simulated and usable first, then solved by closed form, pruned (by bound), not fitting (least
    memory first), skipped."""
    if t.status == "skipped":
        return (5, 0.0)
    if t.simulated_s is not None:
        return (0, t.simulated_s)
    if t.partition is not None:
        return (1, t.partition.objective)
    if t.status == "pruned":
        return (2, t.bound)
    return (3, t.memory if t.memory is not None else float("inf"))


def _order(key: tuple[str, int]) -> tuple[int, int]:
    from partitioner.defaults import SCHEDULES

    return (SCHEDULES.index(key[0]) if key[0] in SCHEDULES else 99, key[1])


def _why(t: Any) -> str:
    if t.simulated_s is not None:
        return "simulated"
    if t.partition is not None:
        return "closed form only"
    if t.status == "pruned":
        from partitioner.units import format_seconds

        return f"pruned: its lower bound {format_seconds(t.bound)} loses"
    return f"{t.status}: {t.reason}" if t.reason else t.status


def print_schedule_table(rows: list[ScheduleRow]) -> None:
    """The rows as one table (steps in the units of ``partitioner.units.format_seconds``)."""
    from partitioner.report.table import schedule_label
    from partitioner.units import format_bytes, format_seconds

    body = []
    for r in rows:
        shape = "-" if r.pp is None else f"{r.pp} x {r.dp} x {r.microbatches or '-'}"
        step = "-" if r.step_s is None else ("" if r.simulated else "~") + format_seconds(r.step_s)
        versus = "-"
        if r.step_s is not None and r.chosen_s > 0:
            change = r.step_s / r.chosen_s - 1
            versus = "+0" if abs(change) < 5e-4 else f"{change:+.1%}"
        body.append([
            r.model, schedule_label(r.schedule, r.chunks), shape, step,
            "-" if r.bubble is None else f"{r.bubble:.1%}", "-" if r.memory is None else format_bytes(r.memory),
            versus, r.note[:60],
        ])
    print_table(["model", "schedule", "pp x dp x M", "step", "bubble", "peak memory / GPU", "vs chosen", "note"],
                body)
