"""autopartition's planner: capture, cost, solve and plan a model for pipeline x data parallelism.

``import partitioner`` is cheap and does not import torch: :func:`compile` (which
needs torch) and :class:`Plan` are imported on first use, so the command line's
``--help`` and the torch-free solver modules (``partitioner.solve.problem`` and friends)
stay fast to import.

Example::

    >>> import torch
    >>> from partitioner import compile
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> plan = compile(model, (torch.randn(8, 16),), gpus=2, microbatches=2, device="h100", pp=2)
    >>> len(plan.stages)
    2
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from partitioner.errors import AutopartitionError

if TYPE_CHECKING:  # the real names for type checkers; at run time module __getattr__ below
    from partitioner.plan import Plan
    from partitioner.search.planner import compile

__all__ = ["AutopartitionError", "Plan", "compile", "load_plan"]

# Public name -> the module that defines it, imported on first access.
_LAZY = {"compile": "partitioner.search.planner", "Plan": "partitioner.plan"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def load_plan(directory: str) -> Plan:
    """Read a plan directory (or a plan.json file)."""
    from partitioner.plan import Plan

    return Plan.load(directory)
