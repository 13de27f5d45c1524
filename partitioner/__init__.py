"""autopartition's planner: capture, cost, solve and plan a model for pipeline x data parallelism.

Example::

    >>> import torch
    >>> from partitioner import compile
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> plan = compile(model, (torch.randn(8, 16),), gpus=2, microbatches=2, device="h100", pp=2)
    >>> len(plan.stages)
    2
"""

from partitioner.errors import AutopartitionError
from partitioner.plan import Plan
from partitioner.planner import compile

__all__ = ["AutopartitionError", "Plan", "compile", "load_plan"]


def load_plan(directory: str) -> Plan:
    """Read a plan directory (or a plan.json file)."""
    return Plan.load(directory)
