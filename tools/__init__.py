"""Benchmarks and measurement scripts, run from the repository root (each script's docstring has its commands).

A package so that tests and the scripts themselves import them one way, ``from tools import
bench_runtime`` or ``from tools.benchplanner import baselines``, with the repository root on
``sys.path`` (``tests/conftest.py`` puts it there; a script run by path inserts it itself).
"""

__all__ = ["bench_large", "bench_planner", "bench_predict", "bench_runtime", "bench_schedules", "bench_startup", "benchplanner", "model_matrix"]
