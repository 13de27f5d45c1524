"""Which nodes of a captured graph ``--precision fp8`` runs in FP8: the linear layers' matmuls.

As torchao's float8 training (``convert_to_float8_training``, which swaps
``nn.Linear`` modules) and Transformer Engine's FP8 layers, only matmuls of an
activation by a weight run in FP8; attention's matmuls (activation by
activation), norms, embeddings and everything else keep bf16-mixed.  A node is
one when it is

* a call of an ``nn.Linear`` module (symbolic-trace graphs), or
* ``linear`` (``F.linear``, ``aten.linear``), ``mm`` / ``matmul`` / ``@``, or
  ``addmm`` whose weight operand is a parameter of 2 dimensions, read directly or
  through one transpose (``aten.t``, ``transpose``, ``permute``, ``.T``),

its weight's dimensions both multiples of 16 (what ``torch._scaled_mm`` and
torchao ask), and it is not the model's last linear layer: a matmul with no
other such matmul downstream of it (the LM head, which torchtitan's float8
converter leaves in bf16, ``filter_fqns=["output"]``; in a model without one,
its final projection).

The planner marks those nodes' costs (``NodeCost.fp8_matmul``) and the runtime
rewrites the same nodes of each stage's graph (``runtime/state/fp8.py``), both
from :func:`fp8_matmuls` of the whole captured graph.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    >>> fp8_matmuls(capture(m, (torch.randn(4, 32),)).graph_module)  # the last one is the "head"
    {'_0': FP8Matmul(activation='input_1', weight='0.weight', bias='0.bias', transposed=False)}
"""

from __future__ import annotations

import collections
import operator
from typing import Any, NamedTuple

import torch
from torch import fx, nn

from partitioner.graph.ir import KIND_KEY

__all__ = ["FP8_MULTIPLE", "FP8Matmul", "fp8_matmuls", "fp8_only_weights"]

# Both dimensions of an FP8 weight must be multiples of this (torch._scaled_mm's layout rule).
FP8_MULTIPLE = 16

_aten = torch.ops.aten
_LINEAR = {nn.functional.linear, torch._C._nn.linear, _aten.linear.default}
_MATMUL = {operator.matmul, torch.matmul, torch.mm, _aten.mm.default, _aten.matmul.default}
_ADDMM = {torch.addmm, _aten.addmm.default}
_TRANSPOSE_FUNCTIONS = {torch.t, torch.transpose, torch.permute, _aten.t.default, _aten.transpose.int,
                        _aten.permute.default, _aten.numpy_T.default}
_TRANSPOSE_METHODS = {"t", "transpose", "permute"}


class FP8Matmul(NamedTuple):
    """One FP8 matmul: the names of its operands (fx node names, the weight's and bias's as parameter names).

    ``activation``: the input node; ``weight``: the 2-d parameter's qualified name;
    ``bias``: the bias parameter's name or ``None``; ``transposed``: the weight is
    stored ``[in, out]`` (``x @ W``), not ``[out, in]`` as ``nn.Linear`` holds it.
    """

    activation: str
    weight: str
    bias: str | None
    transposed: bool


def fp8_matmuls(gm: fx.GraphModule) -> dict[str, FP8Matmul]:
    """The nodes of ``gm`` that run in FP8 under ``--precision fp8``, by node name, in graph order (module docstring)."""
    found: dict[str, FP8Matmul] = {}
    for node in gm.graph.nodes:
        match = _match(gm, node)
        if match is not None:
            found[node.name] = match
    # The last linear layers (no FP8 candidate downstream) stay in bf16: the LM head.
    below: dict[fx.Node, bool] = {}
    for node in reversed(gm.graph.nodes):
        below[node] = any(u.name in found or below.get(u, False) for u in node.users)
    return {name: m for name, m in found.items() if below[_node(gm, name)]}


def fp8_only_weights(gm: fx.GraphModule, matmuls: dict[str, FP8Matmul] | None = None) -> frozenset[str]:
    """The FP8 matmuls' weights (``matmuls``, default :func:`fp8_matmuls` of ``gm``) each read by one of them alone.

    A fully sharded stage gathers these as their FP8 casts (tensorwise: ``runtime/parallel/fp8_gather.py``,
    which finds the same ones in the rewritten stage graphs); a weight read elsewhere too is gathered in bf16.

    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    >>> from partitioner.graph.capture import capture
    >>> sorted(fp8_only_weights(capture(m, (torch.randn(4, 32),)).graph_module))
    ['0.weight']
    """
    matmuls = fp8_matmuls(gm) if matmuls is None else matmuls
    reads = collections.Counter(m.weight for m in matmuls.values())
    weights = {w for w, n in reads.items() if n == 1}  # read by one matmul (fp8_gather.fp8_gathered_weights' rule)

    def fp8_only(node: fx.Node) -> bool:  # a read of a weight: every user an FP8 matmul, or its transpose
        return all(u.name in matmuls or (_transposed_parameter(gm, u) is not None
                                         and all(v.name in matmuls for v in u.users)) for u in node.users)

    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in weights and not fp8_only(node):
            weights.discard(str(node.target))
        elif node.op == "call_module" and f"{node.target}.weight" in weights and node.name not in matmuls:
            weights.discard(f"{node.target}.weight")
    return frozenset(weights)


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _match(gm: fx.GraphModule, node: fx.Node) -> FP8Matmul | None:
    """``node`` as an FP8 matmul, or ``None`` when it is not a linear layer's matmul."""
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        if type(sub) is not nn.Linear or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            return None
        own_bias = f"{node.target}.bias" if sub.bias is not None else None
        return FP8Matmul(node.args[0].name, f"{node.target}.weight", own_bias, False) if _fits(sub.weight) else None
    if node.op not in ("call_function", "call_method") or node.kwargs:
        return None
    args = node.args
    if node.target in _LINEAR and len(args) in (2, 3):
        x, w, b = args[0], args[1], args[2] if len(args) == 3 else None
        transposed = False
    elif node.target in _MATMUL and len(args) == 2:
        x, w, b = args[0], args[1], None
        transposed = True  # x @ W: W [in, out] (a transposed [out, in] parameter is found below)
    elif node.target in _ADDMM and len(args) == 3:
        b, x, w = args
        transposed = True
    else:
        return None
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
        return None
    weight = _parameter(gm, w)
    if weight is None:
        weight = _transposed_parameter(gm, w)
        if weight is None:
            return None
        transposed = not transposed
    bias: str | None = None
    if b is not None:
        bias = _parameter(gm, b) if isinstance(b, fx.Node) else None
        if bias is None or _attribute(gm, bias).dim() != 1:
            return None
    return FP8Matmul(x.name, weight, bias, transposed) if _fits(_attribute(gm, weight)) else None


def _parameter(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The qualified name of the parameter ``node`` reads, or ``None``."""
    if node.op == "get_attr" and node.meta.get(KIND_KEY) == "parameter":
        return str(node.target)
    return None


def _transposed_parameter(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The name of a 2-d parameter ``node`` transposes (``W.t()``, ``W.T``, ``W.transpose(0, 1)``), or ``None``."""
    if not node.all_input_nodes:
        return None
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return None
    name = _parameter(gm, source)
    if name is None:
        return None
    is_t = ((node.op == "call_function" and node.target in _TRANSPOSE_FUNCTIONS)
            or (node.op == "call_method" and node.target in _TRANSPOSE_METHODS)
            or (node.op == "call_function" and node.target is getattr and node.args[1:] == ("T",)))
    if not is_t or _attribute(gm, name).dim() != 2:
        return None
    rest: list[Any] = [a for a in node.args[1:] if a != "T"]
    order = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    if not all(isinstance(d, int) for d in order):
        return None
    permute = getattr(node.target, "__name__", str(node.target)).startswith("permute")
    swaps = order in ([1, 0], [-1, -2], [1, -2], [-1, 0]) if permute else \
        order == [] or sorted(d % 2 for d in order) == [0, 1]
    return name if swaps else None


def _attribute(gm: fx.GraphModule, name: str) -> torch.Tensor:
    """The tensor ``gm`` holds under the qualified ``name``."""
    value = gm
    for part in name.split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value


def _fits(weight: torch.Tensor) -> bool:
    """A weight ``torch._scaled_mm`` takes: 2-d, floating, both dimensions multiples of 16."""
    return weight.dim() == 2 and weight.is_floating_point() and all(d % FP8_MULTIPLE == 0 for d in weight.shape)
