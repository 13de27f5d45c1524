"""Each parameter's element count, which a plan does not record, from the model it was planned from.

The exports place a block the plan cuts by the parameters on each side of the
cut (:mod:`partitioner.export.blocks`); plan.json names a stage's parameters but
not their sizes.  :func:`plan_parameter_sizes` imports the model file the plan
records (``plan.model.source``) and builds the model under
``torch.device("meta")``: shapes only, no memory for the weights, so a 405B
model builds in seconds.  It is the one export module that imports torch (and
:mod:`partitioner.modelfile`), and only when called.

Example::

    >>> import torch
    >>> parameter_sizes(torch.nn.Linear(3, 2))
    {'weight': 6, 'bias': 2}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partitioner.errors import AutopartitionError
from partitioner.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["parameter_sizes", "plan_parameter_sizes"]


def parameter_sizes(model: torch.nn.Module) -> dict[str, int]:
    """Parameter name -> elements, every alias of a shared (tied) tensor included."""
    return {name: p.numel() for name, p in model.named_parameters(remove_duplicate=False)}


def plan_parameter_sizes(plan: Plan) -> tuple[dict[str, int] | None, str]:
    """(sizes, "") from the model ``plan`` was made from, or (None, why not) where it cannot be built."""
    source = plan.model.source
    if not source:
        return None, "the plan records no model file (it was planned from Python)"
    import torch

    from partitioner.modelfile import load_model_file

    try:
        model_file = load_model_file(source)
        with torch.device("meta"):  # shapes only: nothing allocated, whatever the factory's size
            model = model_file.build()
    except (AutopartitionError, ImportError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"its model file {source} could not be built ({first})"
    return parameter_sizes(model), ""
