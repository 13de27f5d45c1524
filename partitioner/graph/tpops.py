"""Which aten ops of a tensor-parallel pair DTensor cannot run, found before the planner offers the pair.

The runtime splits a column/row pair with DTensor (``runtime/parallel/tensorparallel.py``):
every aten op the pair's nodes run, in forward and in backward, goes through DTensor's
sharding propagation, which raises for an op it has no rule for ("does not have a sharding
strategy registered": CPU's flash attention backward under ``nn.MultiheadAttention``,
``weight_norm``'s backward). :func:`unsupported_ops` runs one node on fake tensors of its
recorded shapes (nothing is computed or allocated, whatever the model's size), forward and
backward, under a dispatch mode that records each aten op (the level DTensor sees: after
``CompositeImplicitAutograd`` decompositions), and returns those DTensor has no rule,
decomposition or handler for. :mod:`partitioner.graph.tensorparallel` keeps such a pair
whole and names the op.

Results are kept per op and input signature: a model's repeated layers are checked once.

    >>> import torch
    >>> from torch import fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    >>> node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "1")
    >>> from partitioner.graph.ir import VALUE_KEY, ValueInfo
    >>> node.args[0].meta[VALUE_KEY] = ValueInfo("tensor", (2, 4), "torch.float32")
    >>> unsupported_ops(gm, node)
    ()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner.graph.ir import VALUE_KEY, ValueInfo

__all__ = ["has_sharding_rule", "pair_unsupported", "unsupported_ops"]


class _Recorder(TorchDispatchMode):
    """Records every aten op dispatched below autograd (what DTensor's own dispatch sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[torch._ops.OpOverload] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            self.ops.add(func)  # a factory (no tensor in: aten.scalar_tensor) never reaches DTensor
        return func(*args, **(kwargs or {}))


def has_sharding_rule(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor can propagate a sharding through ``op``: a strategy, a rule, a decomposition it knows,
    or a handler of its own.

    >>> has_sharding_rule(torch.ops.aten.mm.default)
    True
    """
    try:  # DTensor's registries are internals: a torch without them is not judged (the runtime's own check stands)
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._decompositions import DecompShardingStrategy

        dispatcher = DTensor._op_dispatcher
        propagator = dispatcher.sharding_propagator
        return bool(op in propagator.op_strategy_funcs or op in propagator.op_single_dim_strategy_funcs
                    or op in propagator.op_to_rules or op in dispatcher._custom_op_handlers
                    or op in getattr(dispatcher, "_random_ops", ()) or DecompShardingStrategy.has_decomp(op))
    except (ImportError, AttributeError):
        return True


def unsupported_ops(gm: fx.GraphModule, node: fx.Node) -> tuple[str, ...]:
    """The aten ops ``node`` runs in forward or backward that DTensor has no sharding rule for (``()``: none,
    or the node could not be run here: the runtime's own check then stands)."""
    key = _signature(gm, node)
    if key is None:
        return ()
    return _unsupported(key, gm, node)


_SEEN: dict[tuple[Any, ...], tuple[str, ...]] = {}  # per signature: a model's repeated layers are run once


def _unsupported(key: tuple[Any, ...], gm: fx.GraphModule, node: fx.Node) -> tuple[str, ...]:
    if key not in _SEEN:
        ops = _aten_ops(gm, node)
        aten = {op for op in ops if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten"}
        _SEEN[key] = tuple(sorted({str(op) for op in aten if not has_sharding_rule(op)}))
    return _SEEN[key]


def _signature(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, ...] | None:
    """What the ops a node runs depend on: its target (a module's type and settings), its inputs' shapes."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        target: Any = (type(module).__qualname__, repr(module),
                       tuple((n, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters()))
    elif node.op in ("call_function", "call_method"):
        target = node.target
    else:
        return None
    inputs = []
    for a in node.all_input_nodes:
        info = a.meta.get(VALUE_KEY)
        if not isinstance(info, ValueInfo) and a.op != "get_attr":
            return None
        inputs.append((info.kind, info.shape, info.dtype) if isinstance(info, ValueInfo) else a.target)
    return (node.op, target, tuple(inputs), _plain(node, node.args), _plain(node, node.kwargs))


def _plain(node: fx.Node, value: Any) -> str:
    """Arguments as a hashable key: input nodes by their place among the node's inputs, the rest as their repr
    (so that the same op of every layer has one key)."""
    places = {a: i for i, a in enumerate(node.all_input_nodes)}
    return repr(fx.node.map_arg(value, lambda n: f"%{places[n]}"))


def pair_unsupported(gm: fx.GraphModule, nodes: Any) -> tuple[str, str] | None:
    """(node, op) for the first of ``nodes`` (a pair's columns, region and row, and what makes their weights)
    running an op DTensor cannot, else None."""
    for node in nodes:
        ops = unsupported_ops(gm, node)
        if ops:
            return node.name, ops[0]
    return None


def _aten_ops(gm: fx.GraphModule, node: fx.Node) -> set[torch._ops.OpOverload]:
    """The aten ops of ``node``'s forward and backward on fake tensors (empty where it cannot be run so)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = _Recorder()
    try:
        with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=False) as mode:
            values: dict[fx.Node, Any] = {}
            for a in node.all_input_nodes:
                values[a] = _fake_value(gm, a, mode)
            args = fx.node.map_arg(node.args, lambda n: values[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n])
            with recorder:
                if node.op == "call_module":
                    module = gm.get_submodule(str(node.target))
                    params = {n: mode.from_tensor(p).requires_grad_(p.requires_grad)
                              for n, p in module.named_parameters()}
                    buffers = {n: mode.from_tensor(b) for n, b in module.named_buffers()}
                    out = torch.func.functional_call(module, {**params, **buffers}, tuple(args), dict(kwargs))
                elif node.op == "call_method":
                    self_arg, *rest = args
                    out = getattr(self_arg, str(node.target))(*rest, **kwargs)
                else:
                    out = node.target(*args, **kwargs)  # type: ignore[operator]
                grads = [t for t in torch.utils._pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.requires_grad]
                if grads:
                    torch.autograd.backward([g.float().sum() for g in grads])
    except Exception:  # noqa: BLE001 -- a node that cannot run apart from its graph (a bundle's part): not judged
        return set()
    return recorder.ops


def _fake_value(gm: fx.GraphModule, node: fx.Node, mode: Any) -> Any:
    """A fake stand-in for ``node``'s value: a parameter or buffer's fake copy, a tensor of its recorded shape
    (requiring gradients where it is floating point), or its static value."""
    if node.op == "get_attr":
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            return mode.from_tensor(value).requires_grad_(value.requires_grad)
        return value
    info = node.meta.get(VALUE_KEY)
    if not isinstance(info, ValueInfo):
        raise TypeError(f"{node.name} has no recorded value")
    if info.kind == "static":
        return info.static
    if info.kind != "tensor":
        raise TypeError(f"{node.name} is not one tensor")
    dtype = getattr(torch, info.dtype.removeprefix("torch."))
    value = torch.empty(info.shape, dtype=dtype)
    return value.requires_grad_(True) if value.is_floating_point() else value
