"""Find the experts of a mixture-of-experts model in its captured graph.

An *experts module* is recognised by its contract, not its class name: a submodule
called as ``experts(tokens, top_k_index, top_k_weights)`` on flat tokens ``(N, H)``, the
router's chosen expert per token ``(N, k)`` (integers) and their weights ``(N, k)``, that
returns the weighted sum of the chosen experts' outputs ``(N, H)``.  Its parameters are
either stacked (every tensor's dim 0 is the expert: Hugging Face Mixtral, Qwen2/3-MoE,
DeepSeek-V3, gpt-oss) or a ``ModuleList`` with one expert per entry (a user's own MoE).
The router (softmax or sigmoid gating, top-k, bias, shared experts) stays the model's
own code and is not an expert: only what runs per expert is.

That contract is what lets the runtime hold a slice of the experts on each rank, send
each token to the rank holding its expert and back (expert parallelism), and call the
module's own forward on the tokens it receives: nothing about the model's routing has
to be re-implemented.  A model with a top-k router whose experts do not follow it
plans as a dense graph, and :func:`find_experts` says why in a note.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> linear = torch.nn.Linear(4, 2)
    >>> found = find_experts(linear, capture(linear, (torch.randn(3, 4),)))
    >>> found.layers, found.notes
    ((), ())
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from partitioner.graph.ir import KIND_KEY, VALUE_KEY, module_path

if TYPE_CHECKING:  # plan.py reads ExpertLayer without importing torch
    import torch
    from torch import fx

    from partitioner.graph.capture import CapturedModel

__all__ = ["EXPERT_LAYOUTS", "ExpertLayer", "ExpertsFound", "find_experts"]

ExpertLayout = Literal["stacked", "list"]
EXPERT_LAYOUTS: tuple[ExpertLayout, ...] = ("stacked", "list")


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    """One recognised experts module and where it sits in the captured graph.

    ``nodes``: the graph's compute nodes that run inside the module, in graph order;
    ``tokens``, ``index``, ``weights``: the nodes feeding it (``(N, H)``, ``(N, k)``,
    ``(N, k)``); ``output``: the node outside code reads (``(N, H)``).  ``parameters``:
    canonical names of its parameters; with ``layout="stacked"`` each one's dim 0 is the
    expert, with ``"list"`` entry ``i`` of the ``ModuleList`` at ``module + ".<child>"``
    is expert ``i``.  ``tokens_per_batch`` is ``N`` at the captured batch size.
    """

    module: str
    module_class: str
    experts: int
    top_k: int
    hidden: int
    tokens_per_batch: int
    layout: str  # one of EXPERT_LAYOUTS
    parameters: tuple[str, ...]
    nodes: tuple[str, ...]
    tokens: str
    index: str
    weights: str
    output: str

    def expert_parameter_count(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """Elements of one expert's parameters (all experts are alike)."""
        return sum(math.prod(shapes[name]) for name in self.parameters) // self.experts


@dataclasses.dataclass(frozen=True)
class ExpertsFound:
    """What :func:`find_experts` found: the layers, and notes on what looked like experts but was not."""

    layers: tuple[ExpertLayer, ...]
    notes: tuple[str, ...]


def find_experts(model: torch.nn.Module, captured: CapturedModel) -> ExpertsFound:
    """The experts modules of ``model`` that ``captured`` runs, in graph order.

    Reads shapes from value propagation (:func:`partitioner.graph.values.propagate_values`)
    or, for an exported graph, from export's own ``val``: run it after either.
    """
    gm = captured.graph_module
    by_module: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.meta.get(KIND_KEY) not in ("compute", "constant"):
            continue
        path = module_path(node)
        while path:
            by_module.setdefault(path, []).append(node)
            path = path.rpartition(".")[0]
    layers: list[ExpertLayer] = []
    notes: list[str] = []
    for name, module in model.named_modules():
        layout = _expert_layout(module)
        if layout is None or not _takes_routing(module):
            continue
        nodes = by_module.get(name)
        if not nodes:
            continue  # not run by this capture (or captured as one call: see below)
        layer = _layer(captured, name, module, layout, nodes)
        if isinstance(layer, str):
            notes.append(layer)
        else:
            layers.append(layer)
    if not layers and not notes and _has_router(gm):
        notes.append(
            "The model routes tokens with top-k but no experts module follows the contract "
            "experts(tokens (N, H), top_k_index (N, k), top_k_weights (N, k)) -> (N, H) with its "
            "experts stacked on dim 0 or held in a ModuleList, so it plans as a dense graph "
            "(every replica holds every expert; no expert parallelism)."
        )
    return ExpertsFound(tuple(layers), tuple(notes))


def _expert_layout(module: torch.nn.Module) -> ExpertLayout | None:
    """``"stacked"`` when every parameter's dim 0 is one expert count >= 2, ``"list"`` for a ModuleList of alike experts."""
    import torch

    params = list(module.named_parameters())
    if not params:
        return None
    leading = {p.shape[0] if p.dim() >= 2 else -1 for _, p in params}
    if len(leading) == 1 and min(leading) >= 2 and all("." not in n for n, _ in params):
        return "stacked"
    children = list(module.children())
    lists = [c for c in children if isinstance(c, torch.nn.ModuleList)]
    if len(lists) == 1 and len(lists[0]) >= 2:
        entries = list(lists[0])
        shapes = [tuple((n, tuple(p.shape)) for n, p in e.named_parameters()) for e in entries]
        held = sum(p.numel() for e in entries for p in e.parameters())
        if all(s == shapes[0] for s in shapes) and shapes[0] and held == sum(p.numel() for _, p in params):
            return "list"
    return None


def _takes_routing(module: torch.nn.Module) -> bool:
    """Whether ``forward`` takes three positional arguments (tokens, indices, weights)."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3


def _layer(captured: CapturedModel, name: str, module: torch.nn.Module, layout: ExpertLayout,
           nodes: list[fx.Node]) -> ExpertLayer | str:
    """The layer, or a note saying why ``name`` does not follow the contract in this graph."""
    inside = set(nodes)
    # Factories the module's code made (``arange``, ``zeros``) may carry no module stack; they read nothing.
    for node in list(nodes):
        for arg in node.all_input_nodes:
            if (arg not in inside and arg.meta.get(KIND_KEY) in ("compute", "constant")
                    and not arg.all_input_nodes
                    and all(u in inside for u in arg.users)):
                inside.add(arg)
    order = {n: i for i, n in enumerate(captured.graph_module.graph.nodes)}
    nodes = sorted(inside, key=order.__getitem__)
    feeds: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.meta.get(KIND_KEY) not in ("parameter", "buffer") and arg not in feeds:
                feeds.append(arg)
    leaving = [n for n in nodes if any(u not in inside for u in n.users)]
    import torch

    cls = type(module).__name__
    if len(leaving) != 1:
        return f"{name} ({cls}): {len(leaving)} of its values are read outside it, not one; planned dense."
    floats: list[fx.Node] = []
    integers: list[fx.Node] = []
    for feed in feeds:
        info = _tensor(feed)
        if info is None or len(info[0]) != 2:
            return f"{name} ({cls}): it reads {feed.name}, which is not a 2-d tensor; planned dense."
        (floats if info[1] else integers).append(feed)
    # The weights are as narrow as the index (k); the tokens are as wide as the model (H).
    floats.sort(key=lambda n: _shape(n)[1])
    index = integers[0] if len(integers) == 1 else None
    weights, tokens = (floats[0], floats[1]) if len(floats) == 2 else (None, None)
    output = _tensor(leaving[0])
    if index is None or tokens is None or weights is None or output is None:
        return (f"{name} ({cls}): its inputs are not (tokens, top_k_index, top_k_weights) "
                f"(it reads {', '.join(f.name for f in feeds)}); planned dense.")
    n_tokens, hidden = _shape(tokens)
    top_k = _shape(index)[1]
    if output[0] != (n_tokens, hidden) or _shape(weights) != (n_tokens, top_k):
        return f"{name} ({cls}): output {output[0]} is not its tokens' shape {(n_tokens, hidden)}; planned dense."
    canonical = sorted({captured.parameter_names.get(k, k) for k in captured.parameter_names
                        if captured.parameter_names.get(k, k).startswith(name + ".")})
    count = (next(iter(module.parameters())).shape[0] if layout == "stacked"
             else len(next(c for c in module.children() if isinstance(c, torch.nn.ModuleList))))
    return ExpertLayer(
        module=name, module_class=cls, experts=int(count), top_k=top_k, hidden=hidden,
        tokens_per_batch=n_tokens, layout=layout, parameters=tuple(canonical),
        nodes=tuple(n.name for n in nodes), tokens=tokens.name, index=index.name, weights=weights.name,
        output=leaving[0].name,
    )


def _tensor(node: fx.Node) -> tuple[tuple[int, ...], bool] | None:
    """``(shape, is floating point)`` of a node's tensor: from value propagation, else export's ``val``."""
    import torch

    info = node.meta.get(VALUE_KEY)
    if info is not None:
        return (tuple(info.shape), info.dtype.startswith(("float", "bfloat"))) if info.kind == "tensor" else None
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape), value.dtype.is_floating_point
    return None


def _shape(node: fx.Node) -> tuple[int, ...]:
    info = _tensor(node)
    return info[0] if info is not None else ()


def _has_router(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and "topk" in str(n.target) for n in gm.graph.nodes)
