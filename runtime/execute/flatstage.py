"""A plan's stage as torch.distributed.pipelining wants it: flat tuples in and out, adjacent stages only.

Our stage modules (:mod:`partitioner.stagegraph`) take named boundary values
from any earlier stage and send each to the stages that read it, however far
ahead (a U-Net skip goes from stage 0 to stage 3).  torch's ``PipelineStage``
passes one tuple of positional tensors from stage k to stage k + 1 only.
:class:`FlatStage` bridges the two: across the cut after stage k travel the
values produced at or before k and read after k (:func:`carried_values`), so a
value skipping stages is received, copied and sent on by every stage in between
(per micro-batch, one extra message and one copy per stage crossed: the cost of
the adjacency torch's schedules assume).  Its gradient comes back the same way, summed with the gradient of
any stage in between that reads it.

Model inputs never travel: every stage gets the micro-batch's index as the
keyword ``microbatch`` (torch's schedules split keywords and pass them to every
stage) and looks its inputs up in a :class:`Feed`, filled with this step's
micro-batches before the schedule runs.  The target travels the same way: the
schedule's ``target`` is the index tensor, and :class:`IndexedLoss` looks the
micro-batch's target up.

Example (the values crossing each cut of a two-stage plan)::

    >>> from partitioner.plan import example_plan
    >>> carried_values(example_plan())
    [('relu',)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from partitioner.graph.capture import model_loss
from partitioner.graph.meetings import inputs_written_in_place
from partitioner.plan import Plan
from runtime.execute.stage import LocalStage

__all__ = ["MICROBATCH", "ContiguousGrad", "Feed", "FlatStage", "IndexedLoss", "carried_values"]

MICROBATCH = "microbatch"  # the keyword every stage gets: this micro-batch's index, as a 1-element tensor


def carried_values(plan: Plan) -> list[tuple[str, ...]]:
    """Per cut (after stage k, k = 0 .. S-2): the boundary values crossing it, in a fixed order.

    A value produced by stage s and read by stage t crosses cuts s .. t-1.  Order:
    by producing stage, then as that stage sends them.
    """
    cuts = len(plan.stages) - 1
    crossing: list[dict[tuple[int, int], str]] = [{} for _ in range(cuts)]
    for stage in plan.stages:
        sent = list(dict.fromkeys(b.producer for b in stage.outputs))
        for b in stage.outputs:
            for cut in range(b.source, b.target):
                crossing[cut][b.source, sent.index(b.producer)] = b.producer
    return [tuple(values[k] for k in sorted(values)) for values in crossing]


@dataclasses.dataclass
class Feed:
    """This step's micro-batches (flat model inputs, target), indexed by micro-batch."""

    micro: list[tuple[tuple[torch.Tensor, ...], Any]] = dataclasses.field(default_factory=list)

    def get(self, index: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
        if not self.micro:
            raise RuntimeError("a torch-engine stage ran outside Pipeline.step (no micro-batches fed)")
        return self.micro[int(index.reshape(-1)[0].item())]


class FlatStage(nn.Module):
    """Stage ``local`` as ``forward(*crossing the cut before it, microbatch=i) -> crossing the cut after it``.

    The last stage returns the model's flat outputs.  ``runnable`` runs the stage
    graph (precision and recomputation wrappers included).  The first forward is
    torch's shape inference (a real forward and input backward on micro-batch 0
    before the step): buffers it changes (BatchNorm's running statistics) are put
    back when the first real forward starts (not earlier: the probe's backward may
    still read them), so the step updates them once per micro-batch, as the whole
    model does.
    """

    def __init__(self, local: LocalStage, runnable: nn.Module, *, plan: Plan, feed: Feed,
                 incoming: Sequence[str], outgoing: Sequence[str]) -> None:
        super().__init__()
        self.stage = runnable
        self._feed = feed
        self._signature = local.signature
        self._last = local.is_last
        self._incoming = tuple(incoming)
        self._outgoing = tuple(outgoing)
        names = [t.name for t in plan.model.inputs]
        self._input_index = tuple(names.index(n) for n in local.signature.model_inputs)
        placeholders = [n.name for n in local.module.graph.nodes if n.op == "placeholder"]
        written = inputs_written_in_place(local.module)
        self._written = frozenset(i for i, n in enumerate(placeholders) if n in written)
        self._probing = True
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # buffers before the probe

    def forward(self, *carried: torch.Tensor, **keywords: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._saved is not None:  # the probe's backward is done by now: its buffer changes can go
            with torch.no_grad():
                for buffer, value in self._saved:
                    # Only what the probe changed: a buffer another stage of this rank shares (tied by use) may
                    # be saved for that stage's backward, which a write (a new version) would break.
                    if not torch.equal(buffer, value):
                        buffer.copy_(value)
            self._saved = None
        if self._probing:
            self._probing = False
            self._saved = [(b, b.detach().clone()) for b in self.buffers()]
            # torch's shape inference feeds a later stage uninitialised tensors of the received shapes: integer
            # ones (an MoE's chosen experts) would index out of bounds; zeros index the first row.
            carried = tuple(t if t.is_floating_point() else torch.zeros_like(t) for t in carried)
        return self._run(carried, keywords[MICROBATCH])

    def _run(self, carried: Sequence[torch.Tensor], index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs, _ = self._feed.get(index)
        values = dict(zip(self._incoming, (_contiguous_grad(t) for t in carried)))
        sig = self._signature
        args = [inputs[i] for i in self._input_index] + [values[n] for n in sig.received]
        # A graph writing into a received tensor writes into a copy (autograd refuses writes into a leaf).
        args = [a.clone() if i in self._written else a for i, a in enumerate(args)]
        outputs = self.stage(*args)
        if self._last:
            return tuple(outputs[len(sig.sent):])
        # Copies, contiguous (_owned): torch sizes receive buffers from what it sees, gloo receives only into
        # contiguous tensors (a cut inside attention sends q/k/v slices), and a split backward detaches in place.
        sent = {n: _owned(t) for n, t in zip(sig.sent, outputs[: len(sig.sent)])}
        # A value only passing through leaves as a copy: torch's split backward detaches a stage's outputs in
        # place, which a view (or the received leaf itself) refuses; its gradient flows back unchanged.
        return tuple(sent[n] if n in sent else values[n].clone() for n in self._outgoing)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied, contiguous: torch's split backward detaches stage outputs in place, which a view refuses and
    which breaks the stage's own backward where autograd saved the output (an MoE layer's sum feeding the next
    layer); gloo sends only contiguous tensors.  One copy per sent value per micro-batch."""
    return t.clone(memory_format=torch.contiguous_format)


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient torch sends back for a received
    tensor the stage reads through a view is strided, and gloo sends only contiguous tensors."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    return ContiguousGrad.apply(t) if t.requires_grad else t  # type: ignore[no-any-return]


class IndexedLoss:
    """torch's ``loss_fn(outputs, target)`` where ``target`` is the micro-batch's index: our loss, / M.

    ``loss_fn`` is the Pipeline's (under the plan's precision), or None for a model
    returning its own loss.  Scaling by ``1 / M`` here (with the schedule's
    ``scale_grads=False``) rather than dividing gradients afterwards keeps a
    parameter shared by two stages of one rank from being divided twice.
    """

    def __init__(self, local: LocalStage, loss_fn: Callable[[Any, Any], torch.Tensor] | None, *,
                 feed: Feed, microbatches: int) -> None:
        self._local = local
        self._loss_fn = loss_fn
        self._feed = feed
        self._microbatches = microbatches

    def __call__(self, outputs: Any, index: torch.Tensor) -> torch.Tensor:
        flat = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)  # torch unwraps one output
        model_out = self._local.captured.unflatten_outputs(flat)
        _, target = self._feed.get(index)
        loss = model_loss(model_out) if self._loss_fn is None else self._loss_fn(model_out, target)
        if loss is None:
            raise RuntimeError(
                "the model's output carries no loss (no scalar `loss` key or attribute, and it is not a scalar): "
                "pass Pipeline(plan, model, loss_fn), or plan the model with its target as an input"
            )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise RuntimeError(f"loss_fn must return a scalar tensor (the batch mean), got {loss!r:.80}")
        return loss / self._microbatches
