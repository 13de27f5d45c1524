"""Measured costs kept per process: a model measured once is planned again from the same numbers.

Timing a model takes seconds, and on a machine whose speed drifts two
measurements of one model can differ by 20% (seen on a shared 2-core VM).
Planning the same model again in one process, for another schedule, GPU count
or memory cap, therefore reuses the first measurement: plans compared side by
side rest on one set of costs, so their differences are the plans', not the
machine's.  ``compile(..., remeasure=True)`` measures again (and replaces what
is kept).

What is kept is keyed by everything the numbers depend on: the graph's structure
(:func:`partitioner.graph.ir.graph_fingerprint`), every parameter's, buffer's and
input's shape and dtype, the device, the loss function and its target's shapes.
Counted costs (``--device h100``) are cheap and exact, so they are not kept.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> x = (torch.randn(4, 8),)
    >>> c = capture(torch.nn.Linear(8, 2), x)
    >>> key = measurement_key(c, x, device=torch.device("cpu"), loss_fn=None, target=None)
    >>> recall(key, weight_share=False) is None
    True
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partitioner.cost.nodecost import NodeCost, SplitOverhead
from partitioner.graph.capture import CapturedModel
from partitioner.graph.ir import graph_fingerprint

__all__ = ["Measured", "forget_all", "measurement_key", "recall", "remember"]

_KEPT = 8  # models kept per process (the oldest goes first)
_memory: collections.OrderedDict[Hashable, Measured] = collections.OrderedDict()


@dataclasses.dataclass(frozen=True)
class Measured:
    """One model's measured costs at one micro-batch size: nodes, loss (forward, backward), split host cost."""

    costs: dict[str, NodeCost]
    loss_s: tuple[float, float]
    split: SplitOverhead  # what a split backward adds per parameter-reading node (zeros: not measured)
    weight_share: bool  # whether the costs hold each node's W share (schedules that split the backward)


def measurement_key(
    captured: CapturedModel,
    micro: tuple[Any, ...],
    *,
    device: torch.device,
    loss_fn: Callable[..., Any] | None,
    target: Any,
) -> Hashable:
    """What measured costs depend on: graph, tensor shapes and dtypes, device, loss and target shapes."""
    gm = captured.graph_module

    def shapes(tensors: Any) -> tuple[Any, ...]:
        return tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                     for t in pytree.tree_leaves(tensors))

    state = tuple((name, tuple(t.shape), str(t.dtype)) for name, t in
                  [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)])
    loss = (id(loss_fn), getattr(loss_fn, "__qualname__", "")) if loss_fn is not None else None
    return graph_fingerprint(gm), state, shapes(micro), str(device), loss, shapes(target)


def recall(key: Hashable, *, weight_share: bool) -> Measured | None:
    """The costs kept under ``key``; None if none, or if ``weight_share`` is needed and they lack it."""
    found = _memory.get(key)
    if found is None or (weight_share and not found.weight_share):
        return None
    _memory.move_to_end(key)
    return found


def remember(key: Hashable, measured: Measured) -> None:
    _memory[key] = measured
    _memory.move_to_end(key)
    while len(_memory) > _KEPT:
        _memory.popitem(last=False)


def forget_all() -> None:
    """Drop every kept measurement (tests; a process that wants fresh numbers for every plan)."""
    _memory.clear()
