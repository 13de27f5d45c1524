"""Forward-only evaluation of a pipelined model: a simple chain over micro-batches, no gradients.

For each micro-batch in turn, each rank runs the stages it holds in ascending
stage index: receive the stage's boundary tensors, run its forward under
``torch.no_grad()``, send what it produces (non-blocking).  The last stage
computes the loss per micro-batch; :func:`evaluate` returns their mean.

Why it cannot deadlock: every forward needs only values of the same
micro-batch from lower stages, which the chain computes first, and sends never
block.  Receives from one peer are taken in the order that peer sends them
(:func:`send_order`: its stages ascending, then target stage): a tensor that
arrives before it is needed (a skip connection to a later stage of this rank)
is received first and kept, so NCCL, which matches messages between two
ranks by order, pairs every send with its receive.  gloo also gets distinct
tags (the forward tag of the spec: ``2 * target * M + micro-batch``).

Stage modules run in eval mode for the call (dropout off, batch norm on its
running statistics) and get their previous modes back afterwards.  Random ops
that capture baked into the graph as functional calls (``F.dropout(...,
training=True)`` in an exported graph) cannot be switched off this way.

Example::

    >>> from partitioner.plan import example_plan
    >>> [str(b.producer) for b in send_order(example_plan(), replica=0, source=0, target=1)]
    ['relu']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from partitioner.errors import InternalError
from partitioner.graph.capture import model_loss
from partitioner.plan import Boundary, Plan
from runtime.execute.comm import (
    Communicator,
    DistCommunicator,
    PeerFailure,
    RecvSpec,
    Work,
    wait_all,
)
from runtime.execute.runner import StepFailure
from runtime.execute.stage import LocalStage
from runtime.execute.wire import wire_shape
from runtime.parallel.tensorparallel import gathered

__all__ = ["concat_microbatches", "evaluate", "evaluation_mode", "forward_tag", "send_order"]

LossFn = Callable[[Any, Any], torch.Tensor]
Microbatch = tuple[tuple[Any, ...], Any]


def forward_tag(plan: Plan, target: int, microbatch: int) -> int:
    """The message tag of forward activations into stage ``target`` of ``microbatch`` (the spec's rule).

    >>> from partitioner.plan import example_plan
    >>> forward_tag(example_plan(), 1, 1)  # M = 2: 2 * 1 * 2 + 1
    5
    """
    return 2 * target * plan.microbatches + microbatch


def send_order(plan: Plan, *, replica: int, source: int, target: int) -> list[Boundary]:
    """Boundary tensors global rank ``source`` sends to global rank ``target`` in one micro-batch, in order.

    The sender's stages ascending; within a stage by target stage, then as the
    plan lists its outputs.
    """
    order: list[Boundary] = []
    source, target = plan.layout.group(source), plan.layout.group(target)  # tp > 1: a group's ranks pair up
    for stage in plan.stages:
        if stage.ranks[replica] != source:
            continue
        outgoing = [b for b in stage.outputs if plan.stages[b.target].ranks[replica] == target]
        order.extend(sorted(outgoing, key=lambda b: b.target))  # stable: plan order within a target
    return order


@contextlib.contextmanager
def evaluation_mode(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every module (and submodule) in eval mode inside the block; each gets its own mode back after."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def evaluate(
    plan: Plan,
    stages: Sequence[tuple[LocalStage, nn.Module]],
    microbatches: Sequence[Microbatch],
    *,
    replica: int,
    rank: int,
    loss_fn: LossFn | None,
    device: torch.device,
    timeout: float,
    comm: Communicator | None = None,
    keep_outputs: bool = False,
) -> tuple[torch.Tensor | None, list[Any]]:
    """Run the forward chain of this rank's ``stages`` ((stage, module to call), any order).

    Returns (sum over micro-batches of loss / M, the model outputs of each
    micro-batch if ``keep_outputs``) on a rank holding the last stage; the loss
    is None where no loss can be computed (no target for ``loss_fn``, or a model
    without a loss of its own) and on the other ranks.
    """
    chain = _Chain(plan, replica=replica, rank=rank, device=device, timeout=timeout,
                   comm=comm if comm is not None else DistCommunicator())
    names = [t.name for t in plan.model.inputs]
    ordered = sorted(stages, key=lambda pair: pair[0].plan.index)
    losses: list[torch.Tensor] = []
    outputs: list[Any] = []
    with torch.no_grad():
        for mb, (inputs, target) in enumerate(microbatches):
            produced: dict[str, torch.Tensor] = {}
            for stage, module in ordered:
                where = f"rank {rank} (stage {stage.plan.index}, replica {replica}), eval micro-batch {mb}"
                try:
                    out = chain.forward(stage, module, mb, inputs, names, produced)
                    if stage.is_last:
                        model_out = stage.captured.unflatten_outputs(out)
                        loss = _loss(model_out, target, loss_fn)
                        if loss is not None:
                            losses.append(loss.detach() / plan.microbatches)
                        if keep_outputs:  # whole (tp > 1: logits may be split by vocabulary)
                            outputs.append(stage.captured.unflatten_outputs(gathered(out)))
                except PeerFailure as exc:
                    raise StepFailure(f"{where}: peer failure: {exc}") from exc
                except StepFailure:
                    raise
                except Exception as exc:
                    raise StepFailure(f"{where}: {type(exc).__name__}: {exc}") from exc
        try:
            wait_all(chain.pending, timeout=timeout)
        except PeerFailure as exc:
            raise StepFailure(f"rank {rank}: an eval send did not complete: {exc}") from exc
    return (torch.stack(losses).sum() if losses else None), outputs


def concat_microbatches(outputs: Sequence[Any]) -> Any:
    """Per-micro-batch model outputs as one: tensors with a batch dimension concatenated, other leaves listed.

    >>> concat_microbatches([{"y": torch.zeros(2, 3), "n": 1}, {"y": torch.ones(2, 3), "n": 2}])["y"].shape
    torch.Size([4, 3])
    """
    if not outputs:
        return None
    flats = [pytree.tree_flatten(o) for o in outputs]
    spec = flats[0][1]
    if any(s != spec for _, s in flats):
        return list(outputs)
    columns = zip(*(leaves for leaves, _ in flats))
    merged = [
        torch.cat(col) if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in col) else list(col)
        for col in columns
    ]
    return pytree.tree_unflatten(merged, spec)


def _loss(model_out: Any, target: Any, loss_fn: LossFn | None) -> torch.Tensor | None:
    if loss_fn is None:
        return model_loss(model_out)
    if target is None:
        return None
    loss = loss_fn(model_out, target)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise StepFailure(f"loss_fn must return a scalar tensor (the batch mean), got {loss!r:.80}")
    return loss


class _Chain:
    """One rank's side of the forward chain: stage forwards, sends, and receives in each peer's send order."""

    def __init__(
        self, plan: Plan, *, replica: int, rank: int, device: torch.device, timeout: float, comm: Communicator
    ) -> None:
        self.plan, self.replica, self.rank = plan, replica, rank
        self.device, self.timeout, self.comm = device, timeout, comm
        self.pending: list[Work] = []
        self._expected: dict[tuple[int, int], list[Boundary]] = {}  # (peer, mb) -> still to receive, in order
        self._early: dict[tuple[int, int], dict[tuple[str, int], torch.Tensor]] = {}

    def forward(
        self, stage: LocalStage, module: nn.Module, mb: int, inputs: tuple[Any, ...], names: list[str],
        produced: dict[str, torch.Tensor],
    ) -> tuple[Any, ...]:
        """Run ``stage`` on micro-batch ``mb``; sends its outputs and returns the model outputs it computes."""
        sig = stage.signature
        received: dict[str, torch.Tensor] = {}
        for b in stage.plan.inputs:
            if b.producer in received:
                continue
            source = self._rank_of(b.source)
            received[b.producer] = produced[b.producer] if source == self.rank else self._take(source, mb, b)
        args = [inputs[names.index(n)] for n in sig.model_inputs] + [received[n] for n in sig.received]
        out = module(*args)
        sent = dict(zip(sig.sent, out[: len(sig.sent)]))
        produced.update(sent)
        for b in sorted(stage.plan.outputs, key=lambda b: b.target):  # send_order's order
            peer = self._rank_of(b.target)
            if peer != self.rank:
                self.pending += self.comm.send_tensors(
                    [sent[b.producer]], peer=peer, tag=forward_tag(self.plan, b.target, mb))
        return tuple(out[len(sig.sent):])

    def _rank_of(self, stage: int) -> int:
        """The rank of ``stage`` this rank exchanges with: same replica, same tensor-parallel rank."""
        return self.plan.layout.moved(self.rank, pp=self.plan.stages[stage].rank)

    def _take(self, peer: int, mb: int, wanted: Boundary) -> torch.Tensor:
        """``wanted`` from ``peer``; whatever ``peer`` sent before it in this micro-batch is received and kept."""
        key = (peer, mb)
        if key not in self._expected:
            self._expected[key] = send_order(self.plan, replica=self.replica, source=peer, target=self.rank)
            self._early[key] = {}
        early = self._early[key]
        while (wanted.producer, wanted.target) not in early:
            if not self._expected[key]:
                raise InternalError(f"rank {self.rank} expects {wanted.producer} from rank {peer}, which never sends it")
            b = self._expected[key].pop(0)
            buffers, works = self.comm.post_recv(
                [RecvSpec(wire_shape(b.shape, b.dtype, self.plan.tp), b.dtype)], peer=peer, tag=forward_tag(self.plan, b.target, mb), device=self.device)
            try:
                wait_all(works, timeout=self.timeout)
            except PeerFailure as exc:
                raise PeerFailure(f"waiting for {b.producer} from rank {peer} (stage {b.source}): {exc}") from exc
            early[b.producer, b.target] = buffers[0]
        return early.pop((wanted.producer, wanted.target))
