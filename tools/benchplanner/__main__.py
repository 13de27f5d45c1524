"""``python -m tools.benchplanner``: the same as ``tools/bench_planner.py`` (the wall-time child runs this way)."""

import sys

from tools.benchplanner.cli import main

__all__: list[str] = []

sys.exit(main())
