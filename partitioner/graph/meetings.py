"""Where weights meet activations in a stage graph, marked once so that every forward reports them.

A split backward (:mod:`partitioner.graph.splitbackward`) needs, for every op that reads
both an *activation* (a value that depends on a received input needing a
gradient) and a *weight-side* value (a parameter requiring grad, or a value
computed from parameters and constants alone), that op's outputs and a private
alias of each weight-side input: B stops at the op's outputs, W takes them to
the aliases by one edge each, so no weight gradient is computed in B or counted
twice.  :func:`mark_meetings` finds those ops from the graph's data flow and
rewrites the stage's ``fx.GraphModule`` in place, once:

* each weight-side input of a meeting op is read through ``_alias`` (a view);
* a leaf module holding parameters that reads an activation (``nn.Linear``
  from symbolic tracing) becomes its functional form on aliased parameters
  (``F.linear``, ``F.layer_norm``, ``F.embedding``), or any other module runs
  under ``torch.func.functional_call`` with aliased parameters;
* after the op, the :class:`MeetingLog` submodule is called with its output and
  aliases: it records them while a split backward listens (``sink`` set), and
  does nothing otherwise (evaluation, verify), so the rewritten module computes
  exactly what it did.

Every node the rewrite adds goes after its arguments (the log after the op, its
aliases and its arguments, before the node that followed the op), and the result
is linted.  A graph the rewrite cannot handle keeps its captured code and is
reported ``unsplit``: its stage runs the exact whole backward in B.

The forward then pays a few views per meeting op, not a Python hook per op.
What data flow cannot show (a custom ``autograd.Function`` reading a weight it
was not passed) is caught by the split backward's graph check.

:func:`inputs_written_in_place` names the inputs a stage graph writes in place
(the runtime hands those to the stage as copies).

Example::

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()))
    >>> marked = mark_meetings(gm, active=["input_1"])
    >>> marked.meetings, marked.unsplit
    (1, None)
    >>> sink = []
    >>> with marked.log.listening(sink):
    ...     y = gm(torch.randn(2, 3, requires_grad=True))
    >>> len(sink), len(sink[0].aliases)           # the linear: its output, and aliases of weight and bias
    (1, 2)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import inspect
import operator
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils import _pytree as pytree

from partitioner.graph.capture import buffers_written
from partitioner.graph.ir import VALUE_KEY, dtype_from_name

__all__ = ["LOG_NAME", "Known", "MarkedGraph", "Meeting", "MeetingLog", "inputs_written_in_place", "mark_meetings",
           "writes_in_place", "written_state"]

LOG_NAME = "_autopartition_meetings"  # the log's submodule name in a marked stage module


@dataclasses.dataclass(frozen=True)
class Known:
    """A linear or layer norm meeting: what its weight gradients are computed from, without autograd.

    ``weight`` and ``bias`` are the op's aliases (None: the op has none, or it
    does not need a gradient); ``shape`` and ``eps`` are the layer norm's.
    """

    op: str  # "linear" | "layer_norm"
    input: torch.Tensor  # the activation the op read
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    shape: tuple[int, ...] = ()
    eps: float = 0.0

    def weight_grads(self, grad: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(alias, gradient) pairs from the op's output gradient; None where autograd must do it.

        linear ``y = x W^T + b``: ``dW = dy^T x``, ``db = sum(dy)`` over every leading
        dimension; layer norm ``y = x_hat w + b``: ``dw = sum(dy x_hat)``, ``db = sum(dy)``.
        """
        x = self.input
        if grad.dtype != x.dtype or (self.weight is not None and self.weight.dtype != x.dtype):
            return None  # autocast: the op computed in another dtype than it was given
        if self.op == "linear":
            dy = grad.reshape(-1, grad.shape[-1])  # (N, out)
            dw = dy.t() @ x.reshape(-1, x.shape[-1]) if self.weight is not None else None  # (out, in)
            db = dy.sum(0) if self.bias is not None else None
        else:
            dims = len(self.shape)
            dy = grad.reshape(-1, *grad.shape[grad.dim() - dims:])
            with torch.no_grad():
                normed = F.layer_norm(x.detach(), self.shape, None, None, self.eps)
            dw = (dy * normed.reshape(dy.shape)).sum(0) if self.weight is not None else None
            db = dy.sum(0) if self.bias is not None else None
        return [(a, g) for a, g in ((self.weight, dw), (self.bias, db)) if a is not None and g is not None]


@dataclasses.dataclass(frozen=True)
class Meeting:
    """One op where weight-side values meet activations: its outputs, the aliases of its weight inputs,
    and (linear, layer norm) what W needs to compute its weight gradients directly."""

    outputs: tuple[GradientEdge, ...]
    aliases: tuple[torch.Tensor, ...]
    known: Known | None = None


class MeetingLog(nn.Module):
    """Records each meeting op of a forward into ``sink`` while one is set; holds no state of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: list[Meeting] | None = None

    @contextlib.contextmanager
    def listening(self, sink: list[Meeting]) -> Iterator[None]:
        self.sink = sink
        try:
            yield
        finally:
            self.sink = None

    def forward(self, output: Any, aliased: tuple[Any, ...], known: tuple[Any, ...] = ()) -> None:
        """Record one meeting op; ``known``: (op, input, weight alias, bias alias, *layer norm's shape, eps)."""
        if self.sink is None:
            return
        edges = tuple(get_gradient_edge(t) for t in _needing_grad(output))
        aliases = tuple(_needing_grad(aliased))
        if edges and aliases:
            direct = None
            if known and len(edges) == 1:
                op, x, w, b, *rest = known
                w, b = (t if isinstance(t, torch.Tensor) and t.requires_grad else None for t in (w, b))
                if isinstance(x, torch.Tensor) and len(aliases) == (w is not None) + (b is not None):
                    direct = Known(op, x, w, b, *rest)
            self.sink.append(Meeting(edges, aliases, direct))


@dataclasses.dataclass(frozen=True)
class MarkedGraph:
    """The result of :func:`mark_meetings` on one stage module."""

    log: MeetingLog
    meetings: int  # ops rewritten to report
    weight_outputs: frozenset[int]  # positions of the graph's outputs computed from weights alone
    unsplit: str | None  # why the backward cannot be split (None: it can)


class _Side(enum.IntEnum):
    CONSTANT = 0  # no gradient flows through it
    WEIGHT = 1  # from parameters (and constants) alone
    ACTIVATION = 2  # depends on a received input needing a gradient


def mark_meetings(gm: fx.GraphModule, *, active: Collection[str]) -> MarkedGraph:
    """Rewrite ``gm`` (in place, once) so that its forward reports every meeting op; see the module docstring.

    ``active`` names the placeholders whose tensors need a gradient (received
    floating-point boundaries).  Marking a graph twice is refused.
    """
    if hasattr(gm, LOG_NAME):
        raise ValueError("this stage graph is marked already: mark it once")
    log = MeetingLog()
    gm.add_submodule(LOG_NAME, log)
    original = copy.deepcopy(gm.graph)  # node for node; its meta is shared, not copied
    try:
        count, weight_outputs, unsplit = _mark(gm, active)
        gm.graph.lint()
        gm.recompile()
    except Exception as exc:  # noqa: BLE001 - any graph we cannot rewrite keeps the exact whole backward
        gm.graph = original  # the module as captured (recompiled); the log stays, never called
        why = f"the stage graph could not be marked for a split backward ({type(exc).__name__}: {exc})"
        return MarkedGraph(log, 0, frozenset(), why.splitlines()[0])
    return MarkedGraph(log, count, weight_outputs, unsplit)


def _mark(gm: fx.GraphModule, active: Collection[str]) -> tuple[int, frozenset[int], str | None]:
    """The rewrite of :func:`mark_meetings`: (meeting ops, weight-only output positions, why unsplit)."""
    graph = gm.graph
    side: dict[fx.Node, _Side] = {}
    count = 0
    unsplit: str | None = None
    for node in list(graph.nodes):
        if node.op == "placeholder":
            side[node] = _Side.ACTIVATION if node.name in active else _Side.CONSTANT
            continue
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            weight = isinstance(value, torch.Tensor) and value.requires_grad
            side[node] = _Side.WEIGHT if weight else _Side.CONSTANT
            continue
        if node.op == "output":
            continue
        inputs = {n: side.get(n, _Side.CONSTANT) for n in node.all_input_nodes}
        params = _own_parameters(gm, node)
        reads_activation = _Side.ACTIVATION in inputs.values()
        reads_weight = _Side.WEIGHT in inputs.values() or bool(params)
        mutated = _mutated_input(node, gm)
        if not _may_need_grad(node):
            side[node] = _Side.CONSTANT
        elif reads_activation:
            side[node] = _Side.ACTIVATION
        else:
            side[node] = _Side.WEIGHT if reads_weight else _Side.CONSTANT
        if mutated is not None:  # the written tensor now carries what was written into it
            if side.get(mutated) == _Side.WEIGHT and reads_activation:
                unsplit = unsplit or f"{node.format_node()} writes an activation into a weight-side tensor"
            side[mutated] = max(side.get(mutated, _Side.CONSTANT), side[node])
        if reads_activation and reads_weight and side[node] == _Side.ACTIVATION:
            weights = [n for n, s in inputs.items() if s == _Side.WEIGHT]
            reported, why = _rewrite(gm, node, weights, params, log_name=LOG_NAME)
            side[reported] = _Side.ACTIVATION
            unsplit = unsplit or why
            count += 1
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    weight_outputs = frozenset(i for i, n in enumerate(flat) if isinstance(n, fx.Node) and side.get(n) == _Side.WEIGHT)
    return count, weight_outputs, unsplit


# ------------------------------------------------------------------ rewriting


def _alias(value: Any) -> Any:
    """``value`` with each tensor needing a gradient replaced by a fresh view of itself (one op's private copy)."""
    if isinstance(value, torch.Tensor):  # nearly always: skip the tree walk
        return value.view_as(value) if value.requires_grad else value
    return pytree.tree_map_only(torch.Tensor, lambda t: t.view_as(t) if t.requires_grad else t, value)


def _aliased_call(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """``module(*args, **kwargs)`` on aliases of its parameters; returns (output, aliases)."""
    aliases = {name: p.view_as(p) for name, p in module.named_parameters() if p.requires_grad}
    return torch.func.functional_call(module, aliases, args, kwargs), tuple(aliases.values())


def _rewrite(gm: fx.GraphModule, node: fx.Node, weights: list[fx.Node], params: list[str], *,
             log_name: str) -> tuple[fx.Node, str | None]:
    """Alias ``node``'s weight-side inputs (and parameters) and report it to the log after it runs.

    Returns the node computing the op now (a module call becomes a new node), and why the backward
    cannot be split there (None: it can).

    An op whose output is then written in place (``torch.relu_(fc(h))``, ``y[:, 0].mul_(2)``, ``y += h``)
    is reported after the last such write: the write replaces the output's autograd history (a view's is
    rebased onto its base), so a gradient edge taken before it would get no gradient and W would find
    none for the op's weights.  Taken after it, W's one ``autograd.grad`` runs back through the writes to
    the aliases.  Where the value before a write is read too, no single edge carries every gradient of
    the op's output: the stage's backward is not split.
    """
    graph = gm.graph
    aliases: list[fx.Node] = []
    # Every node made here goes before ``node`` (in the order made, so each after its arguments) and the
    # log before the node that followed it: after the op, its aliases and the op's own arguments.
    following = node.next
    with graph.inserting_before(node):
        for w in weights:
            a = graph.call_function(_alias, (w,))
            node.replace_input_with(w, a)
            aliases.append(a)
        reported = node
        if params:
            reported, own = _functional(gm, node)
            aliases.extend(own)
    last, why = _last_write(gm, reported)
    if last is None:
        with graph.inserting_before(following):
            graph.call_module(log_name, (reported, tuple(aliases), _known(reported, aliases)))
    else:  # after the writes: its output gradient is no longer the op's own (no direct weight gradients)
        with graph.inserting_after(last):
            graph.call_module(log_name, (reported, tuple(aliases), ()))
    return reported, why


def _last_write(gm: fx.GraphModule, output: fx.Node) -> tuple[fx.Node | None, str | None]:
    """The last node writing ``output`` in place (directly or through a view), and why a split backward cannot
    take the op's gradient after it (a node reads the value before that write); (None, None) when none writes."""
    aliases = {output}  # nodes whose value is the output's storage: views of it, in-place results on it
    writers: list[fx.Node] = []
    readers: list[fx.Node] = []  # nodes reading the output (or a view) other than to view or write it
    frontier, seen = [output], {output}
    while frontier:  # along users only: most ops' outputs are read, not written
        for node in frontier.pop().users:
            if node in seen:
                continue
            seen.add(node)
            if set(_written_args(gm, node)) & aliases:
                writers.append(node)
            elif not (node.all_input_nodes[0] in aliases and _may_alias_first(gm, node)):
                if _may_need_grad(node):
                    readers.append(node)
                continue
            aliases.add(node)
            frontier.append(node)
    if not writers:
        return None, None
    position = {n: i for i, n in enumerate(output.graph.nodes)}
    last = max(writers, key=position.__getitem__)
    early = [r for r in readers if position[r] < position[last]]
    if early:
        return last, (f"{early[0].format_node()} reads {output.name} before {last.format_node()} writes it in "
                      "place, and both reach the weight gradients of the op computing it")
    return last, None


_LINEAR = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)
_LAYER_NORM = (F.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm.default)


def _known(node: fx.Node, aliases: list[fx.Node]) -> tuple[Any, ...]:
    """What the log needs to take ``node``'s weight gradients without autograd: () unless linear or layer norm
    on an activation, with only its weight and bias weight-side."""
    args = list(node.args)
    if node.kwargs or not args or args[0] in aliases:
        return ()
    if node.target in _LINEAR and 2 <= len(args) <= 3:
        w, b = args[1], args[2] if len(args) == 3 else None
        if w in aliases and {a for a in (w, b) if a in aliases} == set(aliases):
            return ("linear", args[0], w, b if b in aliases else None)
    if node.target in _LAYER_NORM and 2 <= len(args) <= 6:
        shape = args[1]
        w = args[2] if len(args) > 2 else None
        b = args[3] if len(args) > 3 else None
        eps = args[4] if len(args) > 4 else 1e-5
        dims = tuple(shape) if isinstance(shape, (tuple, list)) else ()
        fixed = bool(dims) and all(isinstance(d, int) for d in dims)
        if fixed and isinstance(eps, float) and {a for a in (w, b) if a in aliases} == set(aliases):
            return ("layer_norm", args[0], w if w in aliases else None, b if b in aliases else None, dims, eps)
    return ()


def _functional(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Replace a module call by its functional form on aliased parameters: (the new node, the alias nodes)."""
    graph = gm.graph
    target = str(node.target)
    module = gm.get_submodule(target)

    def param(name: str) -> fx.Node | None:
        p = getattr(module, name)
        if p is None:
            return None
        got = graph.get_attr(f"{target}.{name}")
        return graph.call_function(_alias, (got,)) if p.requires_grad else got

    simple = len(node.args) == 1 and not node.kwargs
    new: fx.Node
    if simple and type(module).forward is nn.Linear.forward:
        w, b = param("weight"), param("bias")
        new = graph.call_function(F.linear, (node.args[0], w, b))
        own = [w, b]
    elif simple and type(module).forward is nn.LayerNorm.forward:
        ln = module
        assert isinstance(ln, nn.LayerNorm)
        w, b = param("weight"), param("bias")
        new = graph.call_function(F.layer_norm, (node.args[0], tuple(ln.normalized_shape), w, b, ln.eps))
        own = [w, b]
    elif simple and isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward \
            and module.max_norm is None:  # max_norm renormalises the weight in place: left to the module
        w = param("weight")
        new = graph.call_function(F.embedding, (node.args[0], w, module.padding_idx, None, module.norm_type,
                                                module.scale_grad_by_freq, module.sparse))
        own = [w]
    else:
        both = graph.call_function(_aliased_call, (graph.get_attr(target), *node.args), dict(node.kwargs))
        new = graph.call_function(operator.getitem, (both, 0))
        own = [graph.call_function(operator.getitem, (both, 1))]
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new, [a for a in own if a is not None and a.target in (_alias, operator.getitem)]


# ------------------------------------------------------------------ facts about nodes

_INPLACE_OPERATORS = frozenset({
    "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow",
    "iand", "ior", "ixor", "ilshift", "irshift", "setitem", "__setitem__",
})

# Ops whose result may share its first argument's storage (views, and ops that may return their input).
_VIEW_NAMES = frozenset({
    "getitem", "__getitem__", "getattr", "view", "view_as", "reshape", "reshape_as", "transpose", "permute",
    "narrow", "select", "expand", "expand_as", "split", "split_with_sizes", "chunk", "unbind", "tensor_split",
    "hsplit", "vsplit", "dsplit", "unsqueeze", "squeeze", "flatten", "unflatten", "t", "movedim", "moveaxis",
    "swapaxes", "swapdims", "diagonal", "unfold", "as_strided", "detach", "contiguous", "to", "type", "type_as",
    "float", "double", "half", "bfloat16", "real", "imag", "view_as_real", "view_as_complex", "alias",
    "identity", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
})
_VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                 nn.AlphaDropout, nn.FeatureAlphaDropout)


def inputs_written_in_place(gm: fx.GraphModule) -> frozenset[str]:
    """Names of the placeholders whose tensor ``gm`` writes in place (directly or through a view of it).

    A received boundary is a leaf requiring grad, which autograd refuses to let an op
    write (``nn.ReLU(inplace=True)``, ``x += y``, ``x[i] = v``); the runtime hands such
    an input to the stage as a clone.  Conservative: an op that may return its input
    (a view, ``contiguous``, ``to``, an in-place op) passes the input on.

    >>> class Net(torch.nn.Module):
    ...     def forward(self, a, b, c):
    ...         a.view(-1).add_(1)
    ...         return torch.relu(b) + torch.nn.functional.relu(c, inplace=True)
    >>> sorted(inputs_written_in_place(torch.fx.symbolic_trace(Net())))
    ['a', 'c']
    """
    of: dict[fx.Node, frozenset[str]] = {}  # the placeholders whose storage a node's value may share
    written: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            of[node] = frozenset({node.name})
            continue
        for target in _written_args(gm, node):
            written |= of.get(target, frozenset())
        first = next(iter(node.all_input_nodes), None)
        if first is not None and of.get(first) and _may_alias_first(gm, node):
            of[node] = of[first]
    return frozenset(written)


def writes_in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` of ``gm`` writes one of its inputs in place (the ops :func:`inputs_written_in_place` finds).

    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(inplace=True)))
    >>> [writes_in_place(gm, n) for n in gm.graph.nodes if n.op == "call_module"]
    [False, True]
    """
    return bool(_written_args(gm, node))


def written_state(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> list[str]:
    """Names of ``gm``'s buffers that ``nodes`` write: in place through a ``get_attr`` (``copy_`` into a
    running mean, ``num_batches_tracked.add_``), or as a norm module tracking running statistics in training.

    A recomputed forward would write them a second time (runtime/execute/recompute.py restores them around it).

    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
    >>> written_state(gm, gm.graph.nodes)
    ['1.running_mean', '1.running_var', '1.num_batches_tracked']
    """
    names: list[str] = []
    for node in nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats and module.training:
                names += [f"{node.target}.{name}" for name, _ in module.named_buffers()]
        names += [str(arg.target) for arg in _written_args(gm, node) if arg.op == "get_attr"]
        # aten's batch_norm (an exported graph) writes running statistics its schema does not mark written;
        # an in-place op on what another one returned (``self.ema.mul_(0.9).add_(x)``) writes the buffer too.
        names += [name for name in buffers_written(gm, node) if _is_buffer(gm, name)]
    return list(dict.fromkeys(names))


def _is_buffer(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_buffer(name)
    except AttributeError:
        return False
    return True


def _name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", "")


def _may_alias_first(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s value may share storage with its first input (a view of it, or the input itself)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return isinstance(module, _VIEW_MODULES) or getattr(module, "inplace", False) is True
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in target._schema.returns)
    return _name(node) in _VIEW_NAMES or bool(_written_args(gm, node))  # an in-place op returns what it wrote


def _written_args(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The inputs ``node`` writes in place: ``x.add_(y)``, ``x += y``, ``x[i] = v``, ``relu(x, inplace=True)``,
    ``nn.ReLU(inplace=True)(x)``, ``out=x``, an aten op whose schema writes an argument."""
    first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
    found: list[Any] = []
    if node.op == "call_module":
        if getattr(gm.get_submodule(str(node.target)), "inplace", False) is True:
            found.append(first)
    elif node.op in ("call_function", "call_method"):
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    found.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
        else:
            name = _name(node)
            by_name = name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
            if by_name or node.kwargs.get("inplace") is True or _inplace_positional(node):
                found.append(first)
            found.append(node.kwargs.get("out"))
    return [n for n in found if isinstance(n, fx.Node)]


def _inplace_positional(node: fx.Node) -> bool:
    """``F.relu(x, True)``: an ``inplace`` parameter given by position."""
    if node.op != "call_function" or not callable(node.target) or len(node.args) < 2:
        return False
    try:
        bound = inspect.signature(node.target).bind_partial(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("inplace") is True


def _mutated_input(node: fx.Node, gm: fx.GraphModule) -> fx.Node | None:
    """The input ``node`` writes in place (the first, if several), if it is an in-place op."""
    written = _written_args(gm, node)
    return written[0] if written else None


def _may_need_grad(node: fx.Node) -> bool:
    """False when propagation recorded a value no gradient can flow through (a size, an integer tensor)."""
    info = node.meta.get(VALUE_KEY)
    if info is None or info.kind in ("bundle", "none"):
        return True
    if info.kind == "static":
        return False
    return dtype_from_name(info.dtype).is_floating_point or dtype_from_name(info.dtype).is_complex


def _own_parameters(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    if node.op != "call_module":
        return []
    return [name for name, p in gm.get_submodule(str(node.target)).named_parameters() if p.requires_grad]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _needing_grad(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
        return [t for t in value if t.requires_grad]
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]
