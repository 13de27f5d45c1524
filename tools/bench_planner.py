"""Benchmark the planner: predicted step time against standard pipeline splits; wall time.

Commands (from the repository root)::

    .venv/bin/python tools/bench_planner.py --quick     # smoke run, under a minute
    .venv/bin/python tools/bench_planner.py             # full run: the numbers (a few minutes)
    .venv/bin/python tools/bench_planner.py --no-wall   # only the split tables
    .venv/bin/python tools/bench_planner.py --wall-only # only the wall-time rows
    .venv/bin/python tools/bench_planner.py --cprofile  # + cProfile's top functions per compile
    .venv/bin/python tools/bench_planner.py --schedules          # best plan per schedule, Llama 3 70B, GPT-3 175B
    .venv/bin/python tools/bench_planner.py --schedules --quick  # the same on tiny models, < 1 min

The tables go to stdout, progress to stderr.

What each column means and how it is computed: ``tools/benchplanner/__init__.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, sys.path starts at tools/, not at the root that holds the package.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tools.benchplanner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
