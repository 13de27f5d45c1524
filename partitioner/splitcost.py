"""What splitting the backward costs: host seconds per op where weights meet activations, and a share of the op.

Zero-bubble schedules (``zb-h1``, ``zbv``) run a stage's backward as two calls,
B and W, and during the forward every op where weights meet activations reports
itself (:mod:`runtime.meetings`); W then takes each such op's weight gradients
on its own (:mod:`runtime.splitbackward`).  That costs a fixed host time per op
(the bookkeeping) and a part that grows with the op (W recomputes a layer norm's
normalised input; the gradients B hands W are kept and read again).  Both are
measured here with the runtime's own code on chains of linear and layer-norm
layers at two sizes, plain step against split step, side by side:

    extra seconds per op = per_op_s + share x (the op's forward + backward seconds)

On this 2-core CPU: about 40 us and 0.25-0.45 (a 96-wide layer on 256 rows, the
benchmark GPT's: about 90 us; 384-wide: about 470 us, a third of the op).  The
planner charges it to every parameter-reading node of a stage that splits its
backward (:func:`partitioner.problem.split_backward`), in F (``forward_part``, the
share measured in the listening forward) and B; W's direct weight gradients cost
what the plain backward spent on them.

Example::

    >>> import torch
    >>> found = split_overhead(torch.device("cpu"), repeats=3)
    >>> found.per_op_s >= 0 and found.share >= 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import fx, nn

__all__ = ["SplitOverhead", "split_overhead"]

_SMALL = (32, 8)  # (width, rows): the fixed host time dominates
_LARGE = (256, 256)  # the part that grows with the op shows


class SplitOverhead(NamedTuple):
    per_op_s: float  # host seconds per meeting op, whatever its size
    share: float  # and this share of the op's own forward + backward seconds
    forward_part: float = 0.0  # the part of it spent in F (the rest in B; W costs what it saves)

    def seconds(self, op_s: float) -> float:
        """Extra seconds a split backward costs an op whose forward + backward take ``op_s``.

        >>> SplitOverhead(5e-5, 0.25).seconds(4e-4)
        0.00015000000000000001
        """
        return self.per_op_s + self.share * op_s


def split_overhead(device: torch.device, *, layers: int = 12, repeats: int = 15) -> SplitOverhead:
    """The fixed and the size-proportional extra of a split backward per meeting op, on ``device`` (>= 0)."""
    small_extra, small_plain, small_forward = _extra_per_op(device, *_SMALL, layers=layers, repeats=repeats)
    large_extra, large_plain, large_forward = _extra_per_op(device, *_LARGE, layers=layers, repeats=repeats)
    share = max(0.0, (large_extra - small_extra) / (large_plain - small_plain)) if large_plain > small_plain else 0.0
    extra = small_extra + large_extra
    forward_part = min(1.0, max(0.0, (small_forward + large_forward) / extra)) if extra > 0 else 0.0
    return SplitOverhead(max(0.0, small_extra - share * small_plain), share, forward_part)


def _extra_per_op(device: torch.device, width: int, rows: int, *, layers: int,
                  repeats: int) -> tuple[float, float, float]:
    """Median (extra seconds of a split step, seconds of a plain step, extra seconds of the split's forward)
    per meeting op of a chain."""
    # The runtime's own marking and split: what is measured is what runs.
    from runtime.meetings import mark_meetings
    from runtime.splitbackward import SplitBackward

    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(0)
        chain = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.LayerNorm(width))))
        x = torch.randn(rows, width, device=device)
    plain = fx.symbolic_trace(chain).to(device)
    split = fx.symbolic_trace(chain).to(device)
    marked = mark_meetings(split, active=[next(iter(split.graph.nodes)).name])
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def now() -> float:
        sync()
        return time.perf_counter()

    def plain_step() -> tuple[float, float]:  # (forward, whole) seconds
        leaf = x.clone().requires_grad_()
        start = now()
        y = plain(leaf)
        middle = now()
        torch.autograd.backward([y], [torch.ones_like(y)])
        return middle - start, now() - start

    def split_step() -> tuple[float, float]:
        leaf = x.clone().requires_grad_()
        backward = SplitBackward(check=False)
        start = now()
        with backward.recording(marked.log):
            y = split(leaf)
        middle = now()
        backward.backward_inputs([y], [torch.ones_like(y)], [leaf])
        backward.backward_weights()
        return middle - start, now() - start

    for _ in range(2):  # warm-up
        plain_step()
        split_step()
    extra, base, forward = [], [], []
    for _ in range(repeats):  # side by side, so machine noise hits both
        plain_forward, took = plain_step()
        split_forward, split_took = split_step()
        extra.append(split_took - took)
        base.append(took)
        forward.append(split_forward - plain_forward)
    ops = max(1, marked.meetings)
    return (max(0.0, statistics.median(extra) / ops), statistics.median(base) / ops,
            max(0.0, statistics.median(forward) / ops))
