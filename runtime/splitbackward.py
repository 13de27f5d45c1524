"""The backward in two parts for zero-bubble schedules: B (input gradient) now, W (weights) later.

During the forward a torch function mode records each op where a value derived
only from parameters meets an activation (``y = linear(x, W)``): B asks autograd
for the gradients of the stage's received inputs and of those ops' outputs only,
so autograd skips every weight-gradient kernel; W then runs one
``autograd.grad`` per recorded op, from its outputs to aliases of its weights,
so no gradient is counted twice through the chain and the forward never runs
again.  Whatever the recorder cannot follow (a tensor made outside the recorded
ops, a weight-only tensor changed in place, a custom ``autograd.Function`` that
mixes in a weight) falls back to the whole backward in B: exact, warned once.

Example (a split backward on one module; runtime.execute does this per stage)::

    >>> torch.manual_seed(0) and None
    >>> layer = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3, requires_grad=True)      # a received boundary tensor
    >>> split = SplitBackward([x])
    >>> with split.recording():
    ...     y = torch.tanh(layer(x))
    >>> (gx,) = split.backward_inputs([y], [torch.ones_like(y)], [x])   # B: no weight gradient yet
    >>> layer.weight.grad is None
    True
    >>> split.backward_weights()                                     # W: the parameter gradients
    >>> layer.weight.grad.shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["SplitBackward"]


@dataclasses.dataclass(frozen=True)
class _Meeting:
    """One op where parameter-only values meet activations: its outputs, and fresh aliases of its weight inputs."""

    outputs: tuple[GradientEdge, ...]
    aliases: tuple[torch.Tensor, ...]


class _Recorder(TorchFunctionMode):
    """Watches a stage's forward and records where parameter-only values meet activations.

    A tensor is an *activation* when it depends on a received input (``active``),
    *weight-side* when it requires grad without depending on one (parameters, and
    values computed from parameters and constants alone).  At an op reading both,
    each weight-side input is replaced by a fresh view of itself, used by that op
    alone: the op's output gradient then leads to its weight inputs by exactly one
    edge, so W can take that edge alone (never counting a gradient twice through
    the chain of activations).  Anything the mode cannot follow (a tensor requiring
    grad made by an op it did not see, such as a custom autograd.Function, or a
    weight-side tensor changed in place by an activation) makes the record
    ``unsplit``: B then runs the whole backward, which is always right.
    """

    def __init__(self, activations: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.active: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.known: WeakIdKeyDictionary = WeakIdKeyDictionary()  # outputs of ops this mode saw
        for t in activations:
            self.active[t] = True
        self.meetings: list[_Meeting] = []
        self.unsplit: str | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.unsplit is not None:
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        active = any(t in self.active for t in tensors)
        weights = list({id(t): t for t in tensors if t.requires_grad and t not in self.active}.values())
        versions = [(t, t._version) for t in tensors]
        name = getattr(func, "__name__", str(func))
        if any(not t.is_leaf and t not in self.known for t in weights):
            self.unsplit = f"{name} reads a tensor requiring grad that an op outside the recorded forward made"
            return func(*args, **kwargs)
        aliases: dict[int, torch.Tensor] = {}
        if active and weights:
            aliases = {id(t): t.view_as(t) for t in weights}
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: aliases.get(id(t), t), (args, kwargs))
        out = func(*args, **kwargs)
        mutated = [t for t, v in versions if t._version != v]
        if active and any(id(t) in aliases for t in mutated):
            self.unsplit = f"{name} changes a weight-side tensor in place using an activation"
            return out
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        produced = list({id(t): t for t in (*outputs, *mutated)}.values())  # an in-place op returns its target
        for t in produced:
            self.known[t] = True
            if active:
                self.active[t] = True
        if aliases:
            edges = tuple(get_gradient_edge(t) for t in produced if t.requires_grad)
            if edges:
                self.meetings.append(_Meeting(edges, tuple(aliases.values())))
        return out


class SplitBackward:
    """A backward in two parts: B (gradient of the inputs) now, W (parameter gradients) later.

    Record the forward under :meth:`recording`; :meth:`backward_inputs` (B) asks
    autograd only for the gradients of the received inputs and of the outputs of
    the ops where weights meet activations (autograd then skips every
    weight-gradient kernel), keeping the graph; :meth:`backward_weights` (W) turns
    each such op's output gradient into its weights' gradients, one op at a
    time, and accumulates them into ``.grad``, together with the gradients of
    outputs that depend on parameters alone.  Nothing of the forward runs again.
    If the forward could not be followed (``unsplit`` says why), B runs the whole
    backward and W does nothing.
    """

    def __init__(self, activations: Sequence[torch.Tensor], *, check: bool = True) -> None:
        self._recorder = _Recorder(activations)
        self._check = check
        self._reason: str | None = None  # why not split, once B has decided
        self._meeting_grads: list[tuple[torch.Tensor | None, ...]] = []
        self._weight_roots: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def unsplit(self) -> str | None:
        """Why the backward cannot be split (None: it can)."""
        return self._reason or self._recorder.unsplit

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with self._recorder:
            yield

    def backward_inputs(
        self, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """B: the gradient of each of ``inputs`` (None where none flows); parameter gradients wait for W."""
        active = self._recorder.active
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o in active]
        self._weight_roots = [(o, g if g is not None else torch.ones_like(o))
                              for o, g in zip(outputs, grad_outputs) if o not in active]
        if self.unsplit is None and self._check:
            self._reason = self._leak([o for o, _ in pairs], inputs)
        if self.unsplit is not None:
            torch.autograd.backward(list(outputs), list(grad_outputs))
            return [t.grad for t in inputs]
        meetings = self._recorder.meetings
        if not pairs:
            self._meeting_grads = []
            return [None] * len(inputs)
        targets: list[Any] = [*inputs, *(e for m in meetings for e in m.outputs)]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], targets, [g for _, g in pairs], retain_graph=True, allow_unused=True
        )
        rest = list(grads[len(inputs):])
        self._meeting_grads = []
        for m in meetings:
            self._meeting_grads.append(tuple(rest[: len(m.outputs)]))
            rest = rest[len(m.outputs):]
        return list(grads[: len(inputs)])

    def _leak(self, active: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> str | None:
        """Why B's graph would reach a parameter other than through a recorded op (None: it cannot).

        Walks the autograd graph from the activation outputs, stopping at the weight
        aliases: any other leaf than the received inputs is a gradient B would drop
        and W would not compute (an op the recording did not see mixed them).  From
        the weight-only outputs and the aliases, no received input may be reached.
        """
        aliases = [a.grad_fn for m in self._recorder.meetings for a in m.aliases if a.grad_fn is not None]
        received = {id(t) for t in inputs}
        weight_side = [*aliases, *(o.grad_fn for o, _ in self._weight_roots)]
        walks: tuple[tuple[list[Any], list[Any], Callable[[torch.Tensor], bool], str], ...] = (
            ([o.grad_fn for o in active], aliases, lambda var: id(var) not in received, "a parameter"),
            (weight_side, [], lambda var: id(var) in received, "a received input"),
        )
        for roots, stops, bad, what in walks:
            seen = {id(n): n for n in stops}
            stack = [n for n in roots if n is not None and id(n) not in seen]
            while stack:
                node = stack.pop()
                if id(node) in seen:
                    continue
                seen[id(node)] = node
                var = getattr(node, "variable", None)
                if var is not None and bad(var):
                    return (f"{what} of shape {tuple(var.shape)} gets a gradient through an op the recorded "
                            "forward did not see (a custom autograd.Function?)")
                stack.extend(n for n, _ in node.next_functions if n is not None and id(n) not in seen)
        return None

    def backward_weights(self) -> None:
        """W: accumulate the parameter gradients into ``.grad``; frees what B kept."""
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if self.unsplit is None:
            for m, got in zip(self._recorder.meetings, self._meeting_grads):
                flowing = [(e, g) for e, g in zip(m.outputs, got) if g is not None]
                if not flowing:
                    continue
                # One op at a time: its output gradient reaches its weight aliases by one edge each.
                alias_grads = torch.autograd.grad(
                    [e for e, _ in flowing], list(m.aliases), [g for _, g in flowing], allow_unused=True
                )
                for alias, g in zip(m.aliases, alias_grads):
                    if g is not None:
                        roots.append(alias)
                        grads.append(g)
            for o, g in self._weight_roots:
                roots.append(o)
                grads.append(g)
        self._reason = self.unsplit
        self._recorder = _Recorder(())  # drops the graph B kept
        self._meeting_grads, self._weight_roots = [], []
        if roots:
            torch.autograd.backward(roots, grads)  # the weight-side graphs down to the parameters
