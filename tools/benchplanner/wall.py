"""Planner wall time: ``compile`` over every pp x dp, phase by phase, in a fresh process.

A fresh process, so that the first ``torch.export`` of the process is included:
:func:`run_wall` starts ``python -m tools.benchplanner --wall-child L,G`` from the
repository root, which runs :func:`wall_child` and prints its result as one JSON line.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from tools.benchplanner.tables import ms, print_table
from tools.benchplanner.zoo import DEVICE, MICROBATCHES, WALL_MODELS

__all__ = ["PHASES", "WALL_TARGETS", "print_wall", "run_wall", "wall_child"]

_ROOT = Path(__file__).resolve().parents[2]
WALL_TARGETS = {(12, 8): 3.0, (96, 64): 60.0}
_COUNTED = ("capture", "propagate_values")  # phases whose call count is shown when > 1
PHASES = (
    "capture",
    "propagate_values",
    "profile",
    "coarsen",
    "graph_costs",
    "formulate",
    "solve",
    "build_plan",
)
# Where each phase is looked up when called: it is timed by patching it in every such module.
_CALLERS = {
    "capture": ("planner",),
    "propagate_values": ("planner",),
    "profile": ("planner",),
    "coarsen": ("planner",),
    "graph_costs": ("scaledcosts",),
    "formulate": ("scaledcosts",),
    "solve": ("planner", "search"),
    "build_plan": ("assemble",),  # the planner calls it as ``assemble.build_plan``
}


def wall_child(layers: int, gpus: int, repeat: bool, cprofile: bool) -> dict[str, Any]:
    """Time ``compile`` over every pp x dp in this (fresh) process, phase by phase."""
    from partitioner.search import planner

    spec = WALL_MODELS[layers, gpus]
    model = spec.build()
    inputs = spec.inputs(gpus * MICROBATCHES)  # every dp divides the batch
    spent: dict[str, list[float]] = {}
    active: list[str] = []  # a phase called inside another counts for the outer one
    for name, module in _phase_functions():
        fn = getattr(module, name)

        def timed(
            *args: Any, _fn: Callable[..., Any] = fn, _name: str = name, **kwargs: Any
        ) -> Any:
            if active:
                return _fn(*args, **kwargs)
            active.append(_name)
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                active.pop()
                entry = spent.setdefault(_name, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        setattr(module, name, timed)
    runs = []
    for attempt in range(2 if repeat else 1):
        spent.clear()
        profiler = None
        if cprofile and attempt == 0:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        start, cpu_start = time.perf_counter(), time.process_time()
        plan = planner.compile(
            model, inputs, gpus=gpus, microbatches=MICROBATCHES, device=DEVICE, status=_child_status
        )
        total = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        runs.append(
            {
                "total": total,
                "cpu": cpu,
                "phases": {k: v[0] for k, v in spent.items()},
                "calls": {k: v[1] for k, v in spent.items()},
                "pp": plan.pp,
                "dp": plan.dp,
                "blocks": plan.solver.blocks,
                "candidates": [[c.pp, c.dp, c.step_s, c.status, c.note] for c in plan.candidates],
            }
        )
    return {
        "model": spec.name,
        "describe": spec.describe(),
        "batch": gpus * MICROBATCHES,
        "runs": runs,
    }


def _phase_functions() -> list[tuple[str, ModuleType]]:
    """(phase, module that calls it) for every phase this planner has."""
    found = []
    for name in PHASES:
        for module_name in _CALLERS[name]:
            try:
                module = importlib.import_module(f"partitioner.{module_name}")
            except ImportError:
                continue
            if hasattr(module, name):
                found.append((name, module))
    return found


def _child_status(message: str) -> None:
    """The planner's status lines, without the per-node progress (only its last line)."""
    if message.startswith(("counting costs", "measuring costs")):
        done, _, total = message.rpartition(" ")[2].partition("/")
        if done != total:
            return
    print(f"    {message}", file=sys.stderr, flush=True)


def run_wall(
    layers: int, gpus: int, repeat: bool, cprofile: bool, say: Callable[[str], None]
) -> dict[str, Any]:
    """:func:`wall_child` in a fresh interpreter (``python -m tools.benchplanner --wall-child``)."""
    say(f"wall time: {layers}-layer GPT on {gpus} GPUs (fresh process)")
    cmd = [sys.executable, "-m", "tools.benchplanner", "--wall-child", f"{layers},{gpus}"]
    if repeat:
        cmd.append("--repeat")
    if cprofile:
        cmd.append("--cprofile")
    done = subprocess.run(
        cmd,
        check=False,
        stdout=subprocess.PIPE,
        text=True,
        cwd=_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"wall-time child failed ({done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load"] = os.getloadavg()[0]  # other work on the machine inflates wall times
    return result


def print_wall(results: dict[tuple[int, int], dict[str, Any]]) -> bool:
    """Print the wall-time table; True when every cold run met its target."""
    ok_all = True
    print(
        "Planner wall time: compile() over every pp x dp, in a fresh process (cold), then again (warm)"
    )
    print("(cpu s: the process's CPU time, less sensitive to other load; torch may use 2 threads)")
    short = ["capture", "values", "profile", "coarsen", "costs", "formulate", "solve", "build plan"]
    header = (
        ["case", "run", "total s", "cpu s", "target", "met"] + short + ["other", "chose", "blocks"]
    )
    table = []
    for (layers, gpus), res in results.items():
        target = WALL_TARGETS[layers, gpus]
        for k, run in enumerate(res["runs"]):
            met = run["total"] <= target
            if k == 0:
                ok_all &= met
            phases = run["phases"]
            calls = run["calls"]
            cells = []
            for n in PHASES:
                v = phases.get(n)
                cells.append(
                    "-"
                    if v is None
                    else f"{v:.2f}" + (f" x{calls[n]}" if n in _COUNTED and calls[n] > 1 else "")
                )
            other = run["total"] - sum(phases.values())
            table.append(
                [
                    f"{layers}L / {gpus} GPUs",
                    "cold" if k == 0 else "warm",
                    f"{run['total']:.2f}",
                    f"{run['cpu']:.2f}",
                    f"< {target:.0f}",
                    "yes" if met else "NO",
                ]
                + cells
                + [f"{other:.2f}", f"{run['pp']}x{run['dp']}", run["blocks"]]
            )
    print_table(header, table)
    for (layers, gpus), res in results.items():
        run = res["runs"][0]
        print(
            f"  {layers}L / {gpus} GPUs: {res['model']} = {res['describe']}, batch {res['batch']}, M = {MICROBATCHES}; "
            f"1-min load average after the run {res['load']:.1f} on {os.cpu_count()} cores; "
            "candidates (pp x dp: step ms, status):"
        )
        print(
            "    "
            + "; ".join(
                f"{p}x{d}: {ms(s)} {st} ({note})" for p, d, s, st, note in run["candidates"]
            )
        )
        if run["total"] > WALL_TARGETS[layers, gpus]:
            phases = run["phases"]
            top = max(phases, key=phases.get)  # type: ignore[arg-type]
            print(
                f"    TARGET MISSED: {run['total']:.1f} s > {WALL_TARGETS[layers, gpus]:.0f} s; "
                f"largest phase {top} ({phases[top]:.1f} s, {100 * phases[top] / run['total']:.0f}%)"
            )
    return ok_all
