"""autopartition's runtime: execute a plan on torchrun ranks (GPipe / 1F1B, DDP per stage group).

:class:`Pipeline` is imported on first use, so ``runtime.launch.torchrun`` (``autopartition run``)
starts torchrun without importing torch and ``torch.distributed`` itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real name for type checkers; at run time module __getattr__ below
    from runtime.pipeline import Pipeline

__all__ = ["Pipeline"]


def __getattr__(name: str) -> Any:
    if name != "Pipeline":
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = importlib.import_module("runtime.pipeline").Pipeline
    globals()[name] = value  # later lookups skip __getattr__
    return value
