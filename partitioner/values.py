"""Value propagation: what each node produces, without computing anything.

Runs the graph under ``FakeTensorMode`` and writes one key,
``node.meta["autopartition_value"]``, a :class:`ValueInfo`:

* ``tensor``: a tensor (shape, dtype) that can be sent between stages;
* ``static``: a Python value fixed by the input shapes (``x.size(1)``), baked
  into a stage as a literal instead of being sent;
* ``bundle``: a tuple or list holding tensors (``split``); its readers
  (``getitem``) must sit in the same stage, so no cut may separate them.

Example::

    >>> import torch
    >>> from partitioner.capture import capture
    >>> c = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    >>> infos = propagate_values(c.graph_module, (torch.randn(3, 4),))
    >>> infos["linear"].shape
    (3, 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from partitioner.capture import KIND_KEY
from partitioner.errors import CaptureError

__all__ = ["VALUE_KEY", "ValueInfo", "dtype_from_name", "dtype_name", "propagate_values"]

VALUE_KEY = "autopartition_value"


@dataclasses.dataclass(frozen=True)
class ValueInfo:
    """What one node produces."""

    kind: Literal["tensor", "static", "bundle", "none"]
    shape: tuple[int, ...] = ()
    dtype: str = ""
    static: Any = None

    @property
    def nbytes(self) -> int:
        if self.kind != "tensor":
            return 0
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * dtype_from_name(self.dtype).itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004 - a bad value in a plan file
    return value


def propagate_values(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> dict[str, ValueInfo]:
    """Annotate every node of ``gm`` with a :class:`ValueInfo`; return them by node name."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        FakeTensorProp(gm, mode).propagate(*inputs)
    except Exception as exc:
        raise CaptureError(
            f"Shape propagation failed on the captured graph: {str(exc).splitlines()[0]}. "
            "The example inputs must have the shapes the model was captured with."
        ) from exc
    infos: dict[str, ValueInfo] = {}
    for node in gm.graph.nodes:
        info = _info(node.meta.get("val"))
        node.meta[VALUE_KEY] = info
        infos[node.name] = info
        if info.kind == "none" and node.meta.get(KIND_KEY) == "compute" and all(
            a.meta.get(KIND_KEY) in ("input", "buffer", "constant") for a in node.all_input_nodes
        ):
            # Metadata of a model input (``x.device``): every stage can read it itself.
            node.meta[KIND_KEY] = "constant"
    return infos


def _info(value: Any) -> ValueInfo:
    if isinstance(value, torch.Tensor):
        return ValueInfo("tensor", tuple(int(d) for d in value.shape), dtype_name(value.dtype))
    if value is None:
        return ValueInfo("none")
    leaves = pytree.tree_leaves(value)
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return ValueInfo("bundle")
    if isinstance(value, torch.Size):
        value = tuple(int(d) for d in value)
    return ValueInfo("static", static=value)
