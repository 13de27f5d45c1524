"""Models without real weights: fake state for counting, placeholders and layers for timing.

Planning never needs a model's weight values, only their shapes, so costs are
counted on fake tensors (``torch._subclasses.FakeTensor``: shape, dtype, strides
and device, storage on ``meta``, no memory) that stand in for every parameter,
buffer and input, whether the model holds real weights or was built under
``torch.device("meta")``.  Timing (``--device cpu|cuda``) does need real tensors:
a meta model is timed one layer at a time with *placeholder* values (values do not
change the time of dense kernels), and a layer identical to one already timed
(same module class, same parameter shapes, same ops on the same shapes) is not run
again: it reuses that layer's times.

Example::

    >>> import torch
    >>> with torch.device("meta"):
    ...     lin = torch.nn.Linear(4, 2)
    >>> is_meta(lin.weight), placeholder(lin.weight, torch.device("cpu")).shape
    (True, torch.Size([2, 4]))
    >>> layer_of("blocks.3.attn.c_attn"), layer_of("model.norm"), layer_of("")
    ('blocks.3', 'model.norm', '')
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from partitioner.graph.ir import KIND_KEY, VALUE_KEY, layer_of, module_path

__all__ = [
    "FakeState",
    "Layer",
    "StandIns",
    "attribute",
    "fake_kernels",
    "fake_like",
    "has_meta",
    "home_device",
    "is_meta",
    "layers",
    "materialise",
    "placeholder",
]


def is_meta(value: Any) -> bool:
    """Is ``value`` a tensor on the meta device (shape and dtype only, no data)?"""
    return isinstance(value, torch.Tensor) and value.is_meta


def has_meta(gm: fx.GraphModule, inputs: Iterable[Any] = ()) -> bool:
    """Does running ``gm`` on ``inputs`` read any meta tensor (parameter, buffer, constant or input)?"""
    state = [*gm.parameters(), *gm.buffers()]
    constants = (attribute(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr")
    return any(is_meta(t) for t in (*state, *constants, *pytree.tree_leaves(tuple(inputs))))


def fake_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor with ``tensor``'s shape, strides and dtype on ``device``, made by the active mode.

    Called under a ``FakeTensorMode`` this allocates nothing: the weights of the
    original are neither read nor copied.  Parameters stay parameters.
    """
    made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(made, requires_grad=tensor.requires_grad)
    return made


@contextlib.contextmanager
def fake_kernels() -> Iterator[None]:
    """Fake-tensor rules torch lacks that the planner's fake runs need, in force for the ``with`` block only.

    ``torch.histc`` on integer input: a graph exported on meta takes a model's
    non-CPU branch (Hugging Face MoE layers count tokens per expert with
    ``histc(expert_ids.int(), ...)``, as CUDA requires), and torch's meta kernel
    refuses integers on a fake *CPU* tensor, the device the planner's fakes claim
    for CPU example inputs.  The result is ``bins`` counts of the input's dtype, as
    CUDA gives.  Floating-point input keeps torch's own rule.

    >>> with fake_kernels(), FakeTensorMode() as mode:
    ...     counts = torch.histc(mode.from_tensor(torch.tensor([0, 3, 3], dtype=torch.int32)), bins=4, min=0, max=3)
    >>> counts.shape, counts.dtype
    (torch.Size([4]), torch.int32)
    """
    added = [op for op in _FAKE_KERNELS if op not in fake_impls.op_implementations_dict]
    for op in added:  # a rule already there (torch's own, or an outer block's) stays
        fake_impls.op_implementations_dict[op] = _FAKE_KERNELS[op]
    try:
        yield
    finally:
        for op in added:
            fake_impls.op_implementations_dict.pop(op, None)


def _histc(mode: FakeTensorMode, func: Any, input: torch.Tensor, bins: int = 100, min: Any = 0,
           max: Any = 0) -> Any:
    if input.is_floating_point():
        return NotImplemented  # torch's meta kernel
    torch._check(bins > 0, lambda: f"histc(): bins must be > 0, but got {bins}")
    torch._check(max >= min, lambda: "histc(): max must be larger than min")
    with mode:
        return torch.empty(bins, dtype=input.dtype, device=input.device)


_FAKE_KERNELS: dict[Any, Callable[..., Any]] = {torch.ops.aten.histc.default: _histc}


def home_device(gm: fx.GraphModule, inputs: Iterable[Any]) -> torch.device:
    """The device fake stand-ins claim: the inputs' (else the weights') first real device, else meta.

    One device for everything, so a meta-built model run on CPU inputs does not mix devices.
    """
    tensors = [*pytree.tree_leaves(tuple(inputs)), *gm.parameters(), *gm.buffers()]
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta), torch.device("meta"))


class FakeState:
    """Fake stand-ins for the tensors a graph module reads, by graph name, made on first use.

    Parameters and buffers become fakes of their shape on ``device`` (ties stay one
    tensor); plain tensor constants that hold real values on ``device`` keep them
    (``mode.from_tensor``), as ops may read them.  Call under ``mode``.
    """

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, device: torch.device) -> None:
        self.gm = gm
        self.mode = mode
        self.device = device
        self.state = {id(t) for t in (*gm.parameters(), *gm.buffers())}
        self.made: dict[int, torch.Tensor] = {}

    def __call__(self, name: str) -> Any:
        original = attribute(self.gm, name)
        if not isinstance(original, torch.Tensor):
            return original
        key = id(original)
        if key not in self.made:
            constant = key not in self.state and not original.is_meta and original.device == self.device
            self.made[key] = self.mode.from_tensor(original) if constant else fake_like(original, self.device)
        return self.made[key]


class StandIns(fx.Interpreter):
    """An interpreter that reads ``self.state(name)`` instead of the module's own tensors.

    ``get_attr`` nodes and the parameters and buffers of ``call_module`` submodules
    (through ``torch.func.functional_call``, for that call only) take the stand-ins;
    without a ``state`` the module's own tensors are used.  With a ``home`` device,
    device literals baked into the graph (``arange(..., device=meta)`` in a graph
    exported on meta inputs) are read as ``home``: everything runs on one device.
    """

    state: Callable[[str], Any] | None = None
    home: torch.device | None = None

    def call_function(self, target: fx.node.Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return super().call_function(target, *self._at_home(args, kwargs))

    def call_method(self, target: fx.node.Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return super().call_method(target, *self._at_home(args, kwargs))

    def _at_home(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        home = self.home
        if home is None:
            return args, kwargs
        return pytree.tree_map_only(torch.device, lambda _: home, (args, kwargs))

    def tensor(self, name: str) -> Any:
        """What graph name ``name`` (a parameter, buffer or constant) stands for in this run."""
        return self.fetch_attr(name) if self.state is None else self.state(name)

    def get_attr(self, target: fx.node.Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.tensor(str(target))

    def call_module(self, target: fx.node.Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.state is None:
            return super().call_module(target, args, kwargs)
        module = self.fetch_attr(str(target))
        own = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        local = {name: self.tensor(f"{target}.{name}") for name, _ in own}
        return torch.func.functional_call(module, local, args, kwargs)


def placeholder(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Real values of ``tensor``'s shape, strides and dtype on ``device``, for timing only.

    Floating point: N(0, 0.02) (a typical weight init: finite, no denormals);
    integers: zeros (a valid index into any table); bool: ``True``.
    """
    made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    with torch.no_grad():
        if made.is_floating_point() or made.is_complex():
            made.normal_(0.0, 0.02)
        elif made.dtype == torch.bool:
            made.fill_(True)
        else:
            made.zero_()
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(made, requires_grad=tensor.requires_grad)
    return made


def materialise(gm: fx.GraphModule, owner: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Real tensors on ``device`` for the parameters and buffers module ``owner`` holds itself.

    Keyed by graph name (``blocks.0.ln_1.weight``).  Meta tensors are replaced by
    a copy of the module (the model is left as it was) emptied onto ``device``
    and re-initialised by its ``reset_parameters()`` when it has one (every
    ``torch.nn`` layer); what that leaves unwritten, or a module without one,
    gets :func:`placeholder` values; real tensors are moved.
    """
    module = gm.get_submodule(owner)
    own = _own(module)
    prefix = f"{owner}." if owner else ""
    if not any(is_meta(t) for t in own.values()):
        return {prefix + name: _moved(t, device) for name, t in own.items()}
    fresh = _reset(module, device)
    made: dict[str, torch.Tensor] = {}
    for name, tensor in own.items():
        value = fresh.get(name)
        if value is None or is_meta(value):
            value = placeholder(tensor, device) if is_meta(tensor) else _moved(tensor, device)
        made[prefix + name] = value
    return made


def _reset(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """``module``'s own tensors after ``to_empty`` and ``reset_parameters()`` on a copy; {} without one."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset) or any(not is_meta(t) for t in module.parameters()):
        return {}  # deep-copying real children would copy real weights
    try:
        clone = copy.deepcopy(module)  # every parameter on meta: no weight is copied
        clone.to_empty(device=device, recurse=False)
        empty = {name: (t, t._version) for name, t in _own(clone).items()}
        with torch.no_grad():
            clone.reset_parameters()  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - an init that needs its children real, an uncopyable module: placeholders
        return {}
    # Only what reset_parameters() wrote (in place, or a new tensor) holds values: the rest is
    # to_empty's uninitialised memory, and an index buffer of it (an `arange` made in
    # __init__) would index anywhere; those get placeholders.
    return {
        name: t for name, t in _own(clone).items()
        if name not in empty or empty[name][0] is not t or t._version != empty[name][1]
    }


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    moved = tensor.detach().to(device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved


def attribute(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` node's dotted ``target`` names, or ``None``."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


# ----------------------------------------------------------------- layers


@dataclasses.dataclass(frozen=True)
class Layer:
    """The compute and constant nodes of one layer, in graph order, and what makes it identical to another."""

    path: str
    nodes: tuple[str, ...]
    signature: str  # equal for layers that run the same ops on the same shapes with the same state shapes


def layers(gm: fx.GraphModule) -> list[Layer]:
    """Group the compute and constant nodes of ``gm`` by :func:`layer_of` their module, in graph order."""
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.meta.get(KIND_KEY) in ("compute", "constant"):
            groups.setdefault(layer_of(module_path(node)), []).append(node)
    return [Layer(path, tuple(n.name for n in nodes), _signature(gm, path, nodes)) for path, nodes in groups.items()]


def _signature(gm: fx.GraphModule, path: str, nodes: list[fx.Node]) -> str:
    """Module class, then per node: op, target and argument descriptions relative to the layer."""
    if not path or not path.split(".")[-1].isdigit():
        return f"unique:{path}"  # only list children repeat; other layers are timed as they are
    index = {n: i for i, n in enumerate(nodes)}
    prefix = path + "."

    def relative(name: str) -> str:
        if name == path:
            return "<self>"
        return name.removeprefix(prefix) if name.startswith(prefix) else f"<outside>{name}"

    def describe(value: Any) -> Any:
        if not isinstance(value, fx.Node):
            return value
        if value in index:
            return f"<local {index[value]}>"
        if value.op == "get_attr":
            return f"<state {relative(str(value.target))} {_shape(attribute(gm, str(value.target)))}>"
        return f"<input {value.meta.get(VALUE_KEY)}>"

    lines = [_module_class(nodes[0], path)]
    for node in nodes:
        target = node.target if node.op == "call_function" else relative(str(node.target))
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            state = [(n, _shape(t)) for n, t in (*module.named_parameters(), *module.named_buffers())]
            target = f"{type(module).__qualname__} {target} {state}"
        elif node.op == "call_method":
            target = str(node.target)
        args = pytree.tree_map(describe, (node.args, node.kwargs))
        lines.append(f"{node.op} {target} {args} -> {node.meta.get(VALUE_KEY)}")
    return "\n".join(lines)


def _module_class(node: fx.Node, path: str) -> str:
    for entry in (node.meta.get("nn_module_stack") or {}).values():
        if entry[0] == path:
            kind = entry[1]
            return str(getattr(kind, "__qualname__", kind))
    return "?"


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} {value.requires_grad}"
    return type(value).__name__
