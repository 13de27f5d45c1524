"""Value propagation: what each node produces, without computing anything.

Runs the graph under ``FakeTensorMode`` and writes one key,
:data:`partitioner.graph.ir.VALUE_KEY`, a :class:`partitioner.graph.ir.ValueInfo`:

* ``tensor``: a tensor (shape, dtype) that can be sent between stages;
* ``static``: a Python value fixed by the input shapes (``x.size(1)``), baked
  into a stage as a literal instead of being sent;
* ``bundle``: a tuple or list holding tensors (``split``); its readers
  (``getitem``) must sit in the same stage, so no cut may separate them.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> c = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    >>> infos = propagate_values(c.graph_module, (torch.randn(3, 4),))
    >>> infos["linear"].shape
    (3, 2)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from partitioner.errors import CaptureError, PropagationError
from partitioner.graph.capture import node_source
from partitioner.graph.ir import KIND_KEY, VALUE_KEY, ValueInfo, dtype_name, module_path
from partitioner.graph.meta import FakeState, StandIns, fake_kernels, fake_like, home_device

__all__ = ["propagate_values"]


def propagate_values(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> dict[str, ValueInfo]:
    """Annotate every node of ``gm`` with a :class:`ValueInfo`; return them by node name.

    Parameters, buffers and inputs are replaced by fake tensors on one device
    (:func:`partitioner.graph.meta.home_device`), so a model built on ``meta`` runs on CPU
    or meta inputs alike and no weight is read.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    home = home_device(gm, inputs)
    propagator = _Propagate(gm, mode)
    propagator.state = FakeState(gm, mode, home)
    propagator.home = home
    try:
        with fake_kernels():
            with mode:
                fakes = [fake_like(x, home) if isinstance(x, torch.Tensor) else x for x in inputs]
            propagator.propagate_dont_convert_inputs(*fakes)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        expected = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        method = str(gm.meta.get("autopartition_capture", ""))
        captured = [_captured_shape(n) for n in gm.graph.nodes if n.op == "placeholder"]
        given = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs]
        if len(inputs) != expected:
            advice = f"The graph takes {expected} input tensor(s) but got {len(inputs)}."
        elif any(c is not None and c != g for c, g in zip(captured, given)):
            advice = (f"The example inputs must have the shapes the model was captured with: {captured}, "
                      f"got {given}.")
        else:
            advice = ("That op cannot run on fake tensors (shapes without values): make that line of the model "
                      "traceable (it may read a tensor's values, or the op may lack a fake-tensor kernel).")
        if method == "symbolic_trace":
            # Symbolic tracing can record a branch the real call does not take: export runs the call.
            advice += " If forward branches on its arguments, capture with --capture export."
        node = propagator.current
        if node is None:
            raise CaptureError(f"Shape propagation failed on the captured graph: {reason}. {advice}") from exc
        raise PropagationError(_describe(node), reason, advice, node=node.name, method=method,
                               where=node_source(node)) from exc
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


class _Propagate(StandIns, FakeTensorProp):
    """``FakeTensorProp`` on fake stand-ins for the module's parameters, buffers and constants."""

    current: fx.Node | None = None  # the node running (the one that failed, after a failure)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


def _captured_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The shape an input placeholder was captured at (export records it), or None."""
    value = node.meta.get("val")
    return tuple(int(d) for d in value.shape) if isinstance(value, torch.Tensor) else None


def _describe(node: fx.Node) -> str:
    """``node histc (aten.histc.default) in model.layers.1.mlp.experts (DeepseekV3Experts)``."""
    op = node.target if node.op == "call_module" else getattr(node.target, "__name__", node.target)
    if isinstance(node.target, torch._ops.OpOverload):
        op = str(node.target)
    path = module_path(node)
    kind = next((entry[1] for entry in reversed((node.meta.get("nn_module_stack") or {}).values())
                 if entry[0] == path), None)
    name = str(getattr(kind, "__qualname__", kind)).rpartition(".")[2] if kind is not None else ""
    inside = f" in {path}" + (f" ({name})" if name else "") if path else ""
    return f"node {node.name} ({op}){inside}"


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
