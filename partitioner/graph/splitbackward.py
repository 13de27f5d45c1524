"""The backward in two parts for zero-bubble schedules: B (input gradient) now, W (weights) later.

The stage graph is marked once (:func:`partitioner.graph.meetings.mark_meetings`): every
op where a weight-side value meets an activation reads private aliases of its
weight inputs and reports its outputs to the graph's log.  B asks autograd for
the gradients of the stage's received inputs and of those ops' outputs only, so
autograd skips every weight-gradient kernel; W then runs one ``autograd.grad``
per reported op, from its outputs to its aliases, so no gradient is counted
twice through the chain and the forward never runs again.  What the marking
cannot see (a custom ``autograd.Function`` reading a weight it was not passed)
is caught by a walk over B's graph, and the whole backward then runs in B:
exact, warned once.

Example (a split backward on one traced module; runtime.execute.runner does this per stage)::

    >>> from partitioner.graph.meetings import mark_meetings
    >>> torch.manual_seed(0) and None
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()))
    >>> marked = mark_meetings(gm, active=["input_1"])
    >>> x = torch.randn(4, 3, requires_grad=True)      # a received boundary tensor
    >>> split = SplitBackward()
    >>> with split.recording(marked.log):
    ...     y = gm(x)
    >>> (gx,) = split.backward_inputs([y], [torch.ones_like(y)], [x])   # B: no weight gradient yet
    >>> gm.get_submodule("0").weight.grad is None
    True
    >>> split.backward_weights()                                     # W: the parameter gradients
    >>> gm.get_submodule("0").weight.grad.shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch

from partitioner.graph.meetings import Meeting, MeetingLog

__all__ = ["SplitBackward"]


class SplitBackward:
    """A backward in two parts: B (gradient of the inputs) now, W (parameter gradients) later.

    Run the marked stage's forward under :meth:`recording`; :meth:`backward_inputs`
    (B) asks autograd only for the gradients of the received inputs and of the
    outputs of the ops where weights meet activations (autograd then skips every
    weight-gradient kernel), keeping the graph; :meth:`backward_weights` (W) turns
    each such op's output gradient into its weights' gradients, one op at a
    time, and accumulates them into ``.grad``, together with the gradients of
    outputs that depend on parameters alone.  Nothing of the forward runs again.
    If the backward cannot be split (``unsplit`` says why), B runs the whole
    backward and W does nothing.  ``check`` walks B's graph for gradients the
    marking missed (once per stage is enough: a captured graph does not branch).
    """

    def __init__(self, *, check: bool = True, unsplit: str | None = None) -> None:
        self._meetings: list[Meeting] = []
        self._check = check
        self._reason = unsplit  # why not split
        self._meeting_grads: list[tuple[torch.Tensor | None, ...]] = []
        self._weight_roots: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def unsplit(self) -> str | None:
        """Why the backward cannot be split (None: it can)."""
        return self._reason

    def run_whole(self, reason: str) -> None:
        """Run the whole backward in B (W does nothing): another micro-batch of the stage found ``reason``."""
        self._reason = self._reason or reason

    @contextlib.contextmanager
    def recording(self, log: MeetingLog) -> Iterator[None]:
        """Collect the meeting ops of the forward run inside (the marked module's ``log``)."""
        with log.listening(self._meetings):
            yield

    def backward_inputs(
        self, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor], *, weight_only: Collection[int] = (),
    ) -> list[torch.Tensor | None]:
        """B: the gradient of each of ``inputs`` (None where none flows); parameter gradients wait for W.

        ``weight_only``: positions in ``outputs`` of values computed from weights
        alone (their whole backward is W's).
        """
        if not inputs:  # nothing received needs a gradient (a first or only stage): the whole backward is W's
            weight_only = range(len(outputs))
        pairs = [(o, g) for i, (o, g) in enumerate(zip(outputs, grad_outputs)) if i not in weight_only]
        self._weight_roots = [(o, g if g is not None else torch.ones_like(o))
                              for i, (o, g) in enumerate(zip(outputs, grad_outputs)) if i in weight_only]
        if self._reason is None and self._check and inputs:
            self._reason = self._leak([o for o, _ in pairs], inputs)
        if self._reason is not None:
            torch.autograd.backward(list(outputs), list(grad_outputs))
            self._meetings = []
            return [t.grad for t in inputs]
        meetings = self._meetings
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
        """Why B's graph would reach a parameter other than through a reported op (None: it cannot).

        Walks the autograd graph from the activation outputs, stopping at the weight
        aliases: any other leaf than the received inputs is a gradient B would drop
        and W would not compute (an op the marking did not see mixed them).  From
        the weight-only outputs and the aliases, no received input may be reached.
        """
        aliases = [a.grad_fn for m in self._meetings for a in m.aliases if a.grad_fn is not None]
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
                    return (f"{what} of shape {tuple(var.shape)} gets a gradient through an op that does not "
                            "name it as an input (a custom autograd.Function reading a weight it was not passed?)")
                stack.extend(n for n, _ in node.next_functions if n is not None and id(n) not in seen)
        return None

    def backward_weights(self) -> None:
        """W: accumulate the parameter gradients into ``.grad``; frees what B kept."""
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if self._reason is None:
            for m, got in zip(self._meetings, self._meeting_grads):
                flowing = [(e, g) for e, g in zip(m.outputs, got) if g is not None]
                if not flowing:
                    continue
                direct = m.known.weight_grads(flowing[0][1]) if m.known is not None else None
                if direct is not None:  # a linear or layer norm: its weight gradients from (input, dy)
                    roots.extend(a for a, _ in direct)
                    grads.extend(g for _, g in direct)
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
        self._meetings, self._meeting_grads, self._weight_roots = [], [], []  # drops the graph B kept
        if roots:
            torch.autograd.backward(roots, grads)  # the weight-side graphs down to the parameters
