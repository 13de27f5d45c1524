"""The graph IR's vocabulary: what the passes write on fx nodes and read back.

Capture writes each node's kind under :data:`KIND_KEY`, value propagation a
:class:`ValueInfo` under :data:`VALUE_KEY`; every later pass and the runtime
read them through this module, so the keys, kinds and their helpers have one
definition.  Importing it does not import torch: ``plan.py`` (and through it
``autopartition show`` and the simulator) uses dtype sizes without paying for
torch, which is imported only by the few helpers that need a ``torch.dtype``.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> gm = capture(m, (torch.randn(2, 4),)).graph_module
    >>> [(n.name, n.meta[KIND_KEY], module_path(n)) for n in compute_nodes(gm)]
    [('_0', 'compute', '0'), ('_1', 'compute', '1')]
    >>> node_parameters(gm, compute_nodes(gm)[0])
    ['0.weight', '0.bias']
    >>> ValueInfo("tensor", (2, 4), "bfloat16").nbytes
    16
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import fx

__all__ = [
    "KIND_KEY",
    "VALUE_KEY",
    "NodeKind",
    "ValueInfo",
    "compute_nodes",
    "dtype_from_name",
    "dtype_itemsize",
    "dtype_name",
    "graph_fingerprint",
    "layer_of",
    "layer_runs",
    "module_path",
    "node_parameters",
    "tensor_nbytes",
]

NodeKind = Literal["input", "parameter", "buffer", "constant", "compute", "output"]
KIND_KEY = "autopartition_kind"  # node.meta key: the node's NodeKind (written by capture)
VALUE_KEY = "autopartition_value"  # node.meta key: the node's ValueInfo (written by values)

# Bytes per element of the dtypes models use, so sizes need no torch; others ask torch.
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ValueInfo:
    """What one node produces.

    ``tensor``: a tensor (shape, dtype) that can be sent between stages;
    ``static``: a Python value fixed by the input shapes (``x.size(1)``), baked
    into a stage as a literal; ``bundle``: a tuple or list holding tensors, whose
    readers must share its stage; ``none``: nothing fake propagation could see.
    """

    kind: Literal["tensor", "static", "bundle", "none"]
    shape: tuple[int, ...] = ()
    dtype: str = ""
    static: Any = None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype) if self.kind == "tensor" else 0


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that do the model's work, in graph order: what stages are cut from."""
    return [n for n in gm.graph.nodes if n.meta.get(KIND_KEY) == "compute"]


def layer_of(path: str) -> str:
    """The layer a module path belongs to: up to the first index of a list (``blocks.3``), else itself.

    Children of ``nn.ModuleList`` and ``nn.Sequential`` are named by their index; they are
    the repeated layers of a model (transformer blocks, CNN stages).  The runtime recomputes
    and shards by these layers, and the planner prices them the same way.

    >>> layer_of("model.layers.3.self_attn.q_proj"), layer_of("lm_head"), layer_of("")
    ('model.layers.3', 'lm_head', '')
    """
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return path


def module_path(node: fx.Node) -> str:
    """The innermost user module a node belongs to (``blocks.3.attn``), or ``""`` for the root."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    # Non-strict export and symbolic tracing both give plain dotted paths.
    return str(list(stack.values())[-1][0])


def node_parameters(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """Graph names of the parameters a compute node reads directly."""
    names: list[str] = []
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        names.extend(f"{node.target}.{n}" for n, _ in sub.named_parameters(remove_duplicate=False))
    for arg in node.all_input_nodes:
        if arg.meta.get(KIND_KEY) == "parameter":
            names.append(str(arg.target))
    return names


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """Hash of the graph's structure (ops, targets, wiring), independent of batch size."""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        target = getattr(node.target, "__name__", str(node.target))
        inputs = ",".join(a.name for a in node.all_input_nodes)
        digest.update(f"{node.op}|{node.name}|{target}|{inputs}\n".encode())
    return digest.hexdigest()[:16]


def dtype_name(dtype: torch.dtype) -> str:
    """How plans spell a dtype (``float32``): JSON-friendly and :func:`dtype_from_name`'s inverse."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The ``torch.dtype`` a plan's dtype name stands for; ``ValueError`` for unknown names."""
    import torch  # here, not at the top: only callers that build tensors pay for torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004 - a bad value in a plan file
    return value


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``, without importing torch for common dtypes."""
    size = _ITEMSIZE.get(name)
    return size if size is not None else dtype_from_name(name).itemsize


def tensor_nbytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of a dense tensor from its shape and dtype name: numel x itemsize (1 element for ``()``).

    The one size rule for a node's value and a plan's boundary tensor.

    >>> tensor_nbytes((2, 4), "float32"), tensor_nbytes((), "bfloat16")
    (32, 2)
    """
    return math.prod(shape) * dtype_itemsize(dtype)


def layer_runs(graph_nodes: Iterable[Any]) -> list[tuple[str, ...]]:
    """The call nodes among ``graph_nodes`` (fx nodes, graph order) in layer runs: how the runtime
    recomputes a stage graph (``runtime.execute.recompute.block_nodes``) and how the planner prices it.

    A run is consecutive nodes of one layer (:func:`layer_of`), root-level glue joining the run
    before it (or the first run, when it leads).
    """
    nodes = [n for n in graph_nodes if n.op in ("call_function", "call_method", "call_module")]
    keys = [layer_of(module_path(n)) for n in nodes]
    current = next((k for k in keys if k), "")
    runs: list[tuple[str, list[str]]] = []
    for node, key in zip(nodes, keys, strict=True):
        current = key or current
        if not runs or runs[-1][0] != current:
            runs.append((current, []))
        runs[-1][1].append(node.name)
    return [tuple(names) for _, names in runs]
