"""Test-wide set-up: import paths for the model files and the benchmark tools.

The model files under tests/models import each other by name, so their folder goes
on ``sys.path``; the repository root goes there too, so that ``tools`` (a package,
not installed) imports one way everywhere: ``from tools import bench_runtime``.
Done here, it also reaches spawned ranks, which start with the parent's ``sys.path``.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE / "models"), str(_HERE.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from runtime.verify import RANK_PRELOAD

# Ranks are forked from one server that imported these (runtime.verify.start_ranks); the
# Hugging Face models' ranks also import transformers' model base (a second each).
if importlib.util.find_spec("transformers") is not None:
    RANK_PRELOAD.append("transformers.modeling_utils")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the exhaustive tier (``@pytest.mark.exhaustive``) unless ``AUTOPARTITION_EXHAUSTIVE=1``.

    That tier repeats, over every combination, what one default-tier test already proves
    (the whole model x schedule matrix, every kill point of a save on real ranks, every
    signal on a real launch); CI runs the default and slow tiers.
    """
    if os.environ.get("AUTOPARTITION_EXHAUSTIVE") == "1":
        return
    skip = pytest.mark.skip(reason="exhaustive tier: AUTOPARTITION_EXHAUSTIVE=1 runs it")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)
