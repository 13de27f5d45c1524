"""What splitting the backward costs: host seconds per op where weights meet activations, and a share of the op.

Zero-bubble schedules (``zb-h1``, ``zbv``) run a stage's backward as two calls,
B and W, and during the forward every op where weights meet activations reports
itself (:mod:`partitioner.graph.meetings`); W then takes each such op's weight gradients
on its own (:mod:`partitioner.graph.splitbackward`).  That costs a fixed host time per op
(the bookkeeping) and a part that grows with the op (W makes a layer norm's
normalised input again; the gradients B hands W are kept and read again).  Both
are measured here with the runtime's own code on chains of linear and
layer-norm layers at two sizes, a split step against plain steps, side by side:

    extra seconds per op = per_op_s + share x (the op's forward + backward seconds)

and where the extra is spent: the split's forward against the plain forward
(``forward_part``), its W against what the plain backward spends on weight
gradients, that is the whole backward less one asking only for the input's
gradient (``weight_part``); the rest is B's.

On this 2-core CPU: about 25 us and 0.1-0.4 of the op (a 384-wide layer on 256
rows: 250-470 us, a fifth to a third of the op's own time), about a tenth of it
in F and three quarters in W.  The planner charges it to every parameter-reading
node of a stage that splits its backward
(:func:`partitioner.solve.problem.split_backward`), in F, W and B by those parts.

Example::

    >>> import torch
    >>> found = split_overhead(torch.device("cpu"), repeats=3, trials=1)
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

from partitioner.cost.nodecost import SplitOverhead
from partitioner.graph.meetings import mark_meetings
from partitioner.graph.splitbackward import SplitBackward

__all__ = ["split_overhead"]

_SMALL = (32, 8)  # (width, rows): the fixed host time dominates
_LARGE = (256, 256)  # the part that grows with the op shows


def split_overhead(device: torch.device, *, layers: int = 12, repeats: int = 7, trials: int = 3) -> SplitOverhead:
    """The fixed and the size-proportional extra of a split backward per meeting op, on ``device`` (>= 0).

    The median of ``trials`` estimates, each on freshly built chains: on a shared
    CPU one estimate's share ranges from 0.1 to 0.4 and sometimes far beyond (the
    allocator maps memory for one chain and not for the next), and a plan made
    on an outlier over-prices every schedule that splits its backward.
    """
    found = [_estimate(device, layers=layers, repeats=repeats) for _ in range(max(1, trials))]
    return SplitOverhead(*(statistics.median(f[i] for f in found) for i in range(4)))


class _Extra(NamedTuple):
    """Median seconds per meeting op of a chain: the split step's extra, the plain step, and the extra's parts."""

    extra: float
    plain: float
    forward: float  # the split's forward less the plain forward
    weight: float  # the split's W less the plain backward's weight gradients


def _estimate(device: torch.device, *, layers: int, repeats: int) -> SplitOverhead:
    small = _extra_per_op(device, *_SMALL, layers=layers, repeats=repeats)
    large = _extra_per_op(device, *_LARGE, layers=layers, repeats=repeats)
    share = max(0.0, (large.extra - small.extra) / (large.plain - small.plain)) if large.plain > small.plain else 0.0
    extra = small.extra + large.extra

    def part(seconds: float) -> float:
        return min(1.0, max(0.0, seconds / extra)) if extra > 0 else 0.0

    forward_part = part(small.forward + large.forward)
    weight_part = min(part(small.weight + large.weight), 1.0 - forward_part)
    return SplitOverhead(max(0.0, small.extra - share * small.plain), share, forward_part, weight_part)


def _extra_per_op(device: torch.device, width: int, rows: int, *, layers: int, repeats: int) -> _Extra:
    """A split step against plain steps on a chain of ``layers`` linear + layer norm pairs, side by side."""
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

    def plain_step(*, input_only: bool) -> tuple[float, float]:  # (forward, backward) seconds
        leaf = x.clone().requires_grad_()
        start = now()
        y = plain(leaf)
        middle = now()
        if input_only:  # autograd skips every weight-gradient kernel
            torch.autograd.grad([y], [leaf], [torch.ones_like(y)])
        else:
            torch.autograd.backward([y], [torch.ones_like(y)])
        return middle - start, now() - middle

    def split_step() -> tuple[float, float, float]:  # (forward, B, W) seconds
        leaf = x.clone().requires_grad_()
        backward = SplitBackward(check=False)
        start = now()
        with backward.recording(marked.log):
            y = split(leaf)
        middle = now()
        backward.backward_inputs([y], [torch.ones_like(y)], [leaf])
        inputs_done = now()
        backward.backward_weights()
        return middle - start, inputs_done - middle, now() - inputs_done

    for _ in range(2):  # warm-up
        plain_step(input_only=False)
        plain_step(input_only=True)
        split_step()
    extra, base, forward, weight = [], [], [], []
    for _ in range(repeats):  # side by side, so machine noise hits all three
        plain_forward, plain_backward = plain_step(input_only=False)
        _, input_backward = plain_step(input_only=True)
        split_forward, split_b, split_w = split_step()
        extra.append(split_forward + split_b + split_w - plain_forward - plain_backward)
        base.append(plain_forward + plain_backward)
        forward.append(split_forward - plain_forward)
        weight.append(split_w - (plain_backward - input_backward))
    ops = max(1, marked.meetings)
    return _Extra(max(0.0, statistics.median(extra) / ops), statistics.median(base) / ops,
                  max(0.0, statistics.median(forward) / ops), max(0.0, statistics.median(weight) / ops))
