"""Test-wide set-up: the model files under tests/models import each other by name.

Putting their folder on ``sys.path`` here also reaches spawned ranks, which start
with the parent's ``sys.path``.
"""

import sys
from pathlib import Path

_MODELS = str(Path(__file__).parent / "models")
if _MODELS not in sys.path:
    sys.path.insert(0, _MODELS)
