"""autopartition's planner: capture, cost, solve and plan a model for pipeline x data parallelism.

``import partitioner`` is cheap and does not import torch: :func:`compile` (which
needs torch), :class:`Plan` and compile()'s option groups (:class:`Cluster`,
:class:`Parallelism`, :class:`Numerics`, :class:`Solver`: :mod:`partitioner.search.settings`)
are imported on first use, so the command line's ``--help`` and the torch-free solver
modules (``partitioner.solve.problem`` and friends) stay fast to import.

Example::

    >>> import torch
    >>> from partitioner import compile
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> plan = compile(model, (torch.randn(8, 16),), gpus=2, microbatches=2, device="h100", pp=2)
    >>> len(plan.stages)
    2
    >>> from partitioner import Cluster, Parallelism
    >>> plan = compile(model, (torch.randn(8, 16),), cluster=Cluster(gpus=2, device="h100"),
    ...                parallelism=Parallelism(pp=2, microbatches=2))
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
    from partitioner.search.settings import Cluster, Numerics, Parallelism, Solver

__all__ = ["AutopartitionError", "Cluster", "Numerics", "Parallelism", "Plan", "Solver", "compile", "load_plan"]

# Public name -> the module that defines it, imported on first access.
_LAZY = {
    "compile": "partitioner.search.planner",
    "Plan": "partitioner.plan",
    **dict.fromkeys(("Cluster", "Parallelism", "Numerics", "Solver"), "partitioner.search.settings"),
}


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
