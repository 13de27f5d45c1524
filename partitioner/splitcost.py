"""What splitting the backward costs the host: seconds per op where weights meet activations.

Zero-bubble schedules (``zb-h1``, ``zbv``) run a stage's backward as two calls,
B and W, and during the forward every op where weights meet activations reports
itself (:mod:`runtime.meetings`); W then takes each such op's weight gradients
on its own (:mod:`runtime.splitbackward`).  That bookkeeping costs host time
per op, whatever the op's size: on a small model on CPU it is a sizeable part
of the step, on large GPU kernels it hides behind them.  It is measured here
with the runtime's own code on a chain of small linear and layer-norm layers,
plain step against split step, side by side; the planner charges it to every
parameter-reading node of a stage that splits its backward
(:func:`partitioner.problem.split_backward`).

Example::

    >>> import torch
    >>> 0.0 <= split_overhead_s(torch.device("cpu"), layers=2, repeats=3) < 0.01
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import fx, nn

__all__ = ["split_overhead_s"]


def split_overhead_s(device: torch.device, *, layers: int = 12, repeats: int = 15) -> float:
    """Median extra seconds per meeting op of a split backward over a plain one, on ``device`` (>= 0)."""
    # The runtime's own marking and split: what is measured is what runs.
    from runtime.meetings import mark_meetings
    from runtime.splitbackward import SplitBackward

    width = 32
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(0)
        chain = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.LayerNorm(width))))
        x = torch.randn(8, width, device=device)
    plain = fx.symbolic_trace(chain).to(device)
    split = fx.symbolic_trace(chain).to(device)
    marked = mark_meetings(split, active=[next(iter(split.graph.nodes)).name])
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def plain_step() -> None:
        leaf = x.clone().requires_grad_()
        y = plain(leaf)
        torch.autograd.backward([y], [torch.ones_like(y)])

    def split_step() -> None:
        leaf = x.clone().requires_grad_()
        backward = SplitBackward(check=False)
        with backward.recording(marked.log):
            y = split(leaf)
        backward.backward_inputs([y], [torch.ones_like(y)], [leaf])
        backward.backward_weights()

    def seconds(step: Callable[[], None]) -> float:
        sync()
        start = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up
        plain_step()
        split_step()
    extra = []
    for _ in range(repeats):  # side by side, so machine noise hits both
        extra.append(seconds(split_step) - seconds(plain_step))
    return max(0.0, statistics.median(extra) / max(1, marked.meetings))
