"""Test-wide set-up: import paths for the model files and the benchmark tools.

The model files under tests/models import each other by name, so their folder goes
on ``sys.path``; the repository root goes there too, so that ``tools`` (a package,
not installed) imports one way everywhere: ``from tools import bench_runtime``.
Done here, it also reaches spawned ranks, which start with the parent's ``sys.path``.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE / "models"), str(_HERE.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
