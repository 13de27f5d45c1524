"""Command line of the planner benchmark (``tools/bench_planner.py``, ``python -m tools.benchplanner``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import tools.benchplanner
from tools.benchplanner.tables import Row, bench_row, print_tables
from tools.benchplanner.wall import print_wall, run_wall, wall_child
from tools.benchplanner.zoo import (
    FULL_MODELS,
    FULL_STAGES,
    MICROBATCHES,
    QUICK_MODELS,
    QUICK_STAGES,
    build_problem,
)

__all__ = ["main"]


def _schedules(
    quick: bool, say: Callable[[str], None], *, only: set[str] | None = None, memory_per_gpu: float | None = None
) -> int:
    """Plan each case with every schedule and print the best plan per schedule."""
    from tools.benchplanner.schedules import LARGE, QUICK, print_schedule_table, schedule_rows

    rows = []
    for case in QUICK if quick else LARGE:
        if only is not None and case.name not in only:
            continue
        say(f"{case.name}: {case.spec} on {case.gpus} {case.device.upper()}s, batch {case.batch}")

        def status(message: str, name: str = case.name) -> None:
            say(f"  {name}: {message}")

        rows += schedule_rows(case, status, memory_per_gpu=memory_per_gpu)
    budget = "the device's memory" if memory_per_gpu is None else f"{memory_per_gpu / 2**30:.0f} GiB per GPU"
    print(f"Best plan per pipeline schedule, {budget} (step simulated; ~: closed form only; vs chosen: against "
          "the plan compile chose)")
    print_schedule_table(rows)
    for name in dict.fromkeys(r.model for r in rows):
        wall = next(r.wall_s for r in rows if r.model == name)
        print(f"{name}: compile with every schedule took {wall:.1f} s")
    return 0

_DESCRIPTION = (tools.benchplanner.__doc__ or "").splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=_DESCRIPTION)
    parser.add_argument(
        "--quick", action="store_true", help="small model, two widths, 12L/8 wall time (< 60 s)"
    )
    parser.add_argument("--no-wall", action="store_true", help="skip the wall-time rows")
    parser.add_argument("--wall-only", action="store_true", help="only the wall-time rows")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact-optimum references")
    parser.add_argument(
        "--schedules",
        action="store_true",
        help="only the schedule table: the best plan per schedule for Llama 3 70B and GPT-3 175B on "
        "H100s (with --quick: tiny Llama and GPT on 8 GPUs)",
    )
    parser.add_argument("--only", help="with --schedules: the cases to run, comma-separated (e.g. llama3-70b)")
    parser.add_argument("--memory-per-gpu", type=float, metavar="BYTES",
                        help="with --schedules: the budget per GPU instead of the device's")
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="print cProfile's top functions of each cold compile",
    )
    parser.add_argument("--wall-child", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.wall_child:
        layers, gpus = (int(x) for x in args.wall_child.split(","))
        print(json.dumps(wall_child(layers, gpus, args.repeat, args.cprofile)))
        return 0

    start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    import torch

    torch.manual_seed(0)
    if args.schedules:
        only = set(args.only.split(",")) if args.only else None
        return _schedules(args.quick, say, only=only, memory_per_gpu=args.memory_per_gpu)
    models = QUICK_MODELS if args.quick else FULL_MODELS
    stage_sets = QUICK_STAGES if args.quick else FULL_STAGES
    rows: list[Row] = []
    for spec in [] if args.wall_only else models:
        built = build_problem(spec, MICROBATCHES, say)
        say(
            f"{spec.name}: {built.problem.size} solver blocks, {len(built.unit_params)} layer units"
        )
        for stages in stage_sets[spec.name]:
            rows.append(bench_row(spec, built, stages, MICROBATCHES, say, exact=not args.no_exact))
    ok = print_tables(rows, {m.name: m for m in models}) if rows else True
    if not args.no_wall:
        cases = [(12, 8)] if args.quick else [(12, 8), (96, 64)]
        results = {
            c: run_wall(
                *c, repeat=(c == (12, 8) and not args.quick), cprofile=args.cprofile, say=say
            )
            for c in cases
        }
        print()
        ok &= print_wall(results)
    print()
    print(
        f"All targets met: {'yes' if ok else 'NO'} (bench wall time {time.perf_counter() - start:.0f} s)"
    )
    return 0 if ok else 1
