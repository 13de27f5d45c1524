"""Execute one stage's action list for one training step.

Every action of the plan's schedule maps to one method; the step's state lives
in one :class:`_MicroBatch` record per micro-batch, dropped after its backward.
Sends are non-blocking (waited for at the end of the step); receives are posted
``_LOOKAHEAD`` receive actions ahead (gloo moves data only once the receiver has
posted, so a late post adds milliseconds) and waited for with the configured
timeout when their action comes, so the order the schedule fixes cannot
deadlock (the planner dry-ran it).

On failure the error names this rank, the action, the peer, and shows the
stage's schedule around the failing action.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from partitioner.capture import model_loss
from partitioner.plan import Boundary, Plan
from partitioner.schedule import Action
from runtime.comm import Communicator, DistCommunicator, PeerFailure, RecvSpec, Work, wait_all
from runtime.stage import LocalStage

__all__ = ["ActionRecord", "StepFailure", "StepRunner"]

_LOOKAHEAD = 2  # receive actions posted ahead of the one being executed


class StepFailure(RuntimeError):
    """A step stopped on this rank; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    action: str
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class _Posted:
    """Receives posted for one RF/RB action: per peer, its boundaries, buffers and pending works."""

    parts: tuple[tuple[int, tuple[Boundary, ...], list[torch.Tensor], list[Work]], ...]


@dataclasses.dataclass
class _MicroBatch:
    inputs: tuple[torch.Tensor, ...]
    target: Any
    received: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    sent: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    loss: torch.Tensor | None = None


class StepRunner:
    """Runs the actions of one stage replica; one instance per Pipeline, reused every step.

    ``comm`` moves the boundary tensors: torch.distributed unless given (tests pass an
    in-memory one to run every stage in one process).
    """

    def __init__(
        self,
        plan: Plan,
        stage: LocalStage,
        module: torch.nn.Module,
        *,
        replica: int,
        rank: int,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        device: torch.device,
        timeout: float,
        comm: Communicator | None = None,
    ) -> None:
        self.plan = plan
        self.comm: Communicator = comm if comm is not None else DistCommunicator()
        self.stage = stage
        self.module = module
        self.replica = replica
        self.rank = rank
        self.loss_fn = loss_fn
        self.device = device
        self.timeout = timeout
        self.actions = plan.schedule_data().actions[stage.plan.index]
        self.last_backward = max(i for i, a in enumerate(self.actions) if a.kind == "B")
        names = [t.name for t in plan.model.inputs]
        self.input_index = [names.index(n) for n in stage.signature.model_inputs]
        self.records: list[ActionRecord] = []
        self._receives = [i for i, a in enumerate(self.actions) if a.kind in ("RF", "RB")]
        self._posted: dict[tuple[str, int], _Posted] = {}
        self._pending: list[Work] = []
        self._batches: list[_MicroBatch] = []
        self._handlers: dict[str, Callable[[int], None]] = {
            "F": self._forward,
            "B": self._backward,
            "SF": self._send_forward,
            "RF": self._recv_forward,
            "SB": self._send_backward,
            "RB": self._recv_backward,
        }

    # ------------------------------------------------------------------ step

    def run(
        self, microbatches: Sequence[tuple[tuple[torch.Tensor, ...], Any]], *, record: bool
    ) -> torch.Tensor | None:
        """Run every action; returns the summed (already 1/M-scaled) loss on the last stage."""
        self._batches = [_MicroBatch(inputs=x, target=y) for x, y in microbatches]
        self._pending = []
        self._posted = {}
        losses: list[torch.Tensor] = []
        for position, action in enumerate(self.actions):
            start = time.time()
            try:
                self._post_ahead(position)
                self._handlers[action.kind](action.microbatch)
            except PeerFailure as exc:
                raise StepFailure(self._where(position, action, f"peer failure: {exc}")) from exc
            except StepFailure:
                raise
            except Exception as exc:
                raise StepFailure(self._where(position, action, f"{type(exc).__name__}: {exc}")) from exc
            if record:
                self.records.append(ActionRecord(str(action), start, time.time()))
            if action.kind == "F" and self.stage.is_last:
                loss = self._batches[action.microbatch].loss
                assert loss is not None
                losses.append(loss.detach())
        try:
            wait_all(self._pending, timeout=self.timeout)
        except PeerFailure as exc:
            raise StepFailure(f"rank {self.rank}: a send did not complete: {exc}") from exc
        self._batches = []
        return torch.stack(losses).sum() if losses else None

    # --------------------------------------------------------------- actions

    def _forward(self, mb: int) -> None:
        batch = self._batches[mb]
        sig = self.stage.signature
        args = [batch.inputs[i] for i in self.input_index] + [batch.received[n] for n in sig.received]
        if isinstance(self.module, DistributedDataParallel):
            with self.module.no_sync():  # gradients are reduced once, on the last backward
                outputs = self.module(*args)
        else:
            outputs = self.module(*args)
        batch.sent = dict(zip(sig.sent, outputs[: len(sig.sent)]))
        if self.stage.is_last:
            model_out = self.stage.captured.unflatten_outputs(outputs[len(sig.sent) :])
            if self.loss_fn is None:
                # The model computes its own loss (HF `labels=`): the graph's scalar output.
                loss = model_loss(model_out)
                if loss is None:
                    raise StepFailure(
                        "the model's output carries no loss (no scalar `loss` key or attribute, and it is "
                        "not a scalar): pass Pipeline(plan, model, loss_fn), or plan the model with its "
                        "target as an input (e.g. `labels`) so that it returns its loss"
                    )
            else:
                loss = self.loss_fn(model_out, batch.target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise StepFailure(f"loss_fn must return a scalar tensor (the batch mean), got {loss!r:.80}")
            # Mean over the mini-batch = mean of the equal micro-batch means.
            batch.loss = loss / self.plan.microbatches

    def _backward(self, mb: int) -> None:
        batch = self._batches[mb]
        if self.stage.is_last:
            assert batch.loss is not None
            tensors, grads = [batch.loss], [None]
        else:
            pairs = [(t, batch.grads[n]) for n, t in batch.sent.items() if t.requires_grad and n in batch.grads]
            tensors, grads = [p[0] for p in pairs], [p[1] for p in pairs]  # type: ignore[misc]
        is_last = self.actions.index(Action(self.stage.plan.index, "B", mb)) == self.last_backward
        if isinstance(self.module, DistributedDataParallel):
            if is_last:
                self.module.reducer.prepare_for_backward(list(_find_tensors(tensors)))
                torch.autograd.backward(tensors, grads)
            else:
                with self.module.no_sync():
                    torch.autograd.backward(tensors, grads)
        elif tensors:
            torch.autograd.backward(tensors, grads)
        batch.sent.clear()
        batch.grads.clear()
        if not self.stage.plan.inputs:
            batch.received.clear()

    def _send_forward(self, mb: int) -> None:
        batch = self._batches[mb]
        for peer, boundaries in self._by_peer(self.stage.plan.outputs, "target"):
            tensors = [batch.sent[b.producer] for b in boundaries]
            self._pending += self.comm.send_tensors(tensors, peer=peer, tag=mb)

    def _recv_forward(self, mb: int) -> None:
        batch = self._batches[mb]
        for b, t in self._wait("RF", mb):
            batch.received[b.producer] = t.requires_grad_() if t.is_floating_point() else t

    def _send_backward(self, mb: int) -> None:
        batch = self._batches[mb]
        tag = self.plan.microbatches + mb
        for peer, boundaries in self._by_peer(self.stage.plan.inputs, "source"):
            grads = []
            for b in boundaries:
                if not _is_float(b):
                    continue
                leaf = batch.received[b.producer]
                grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
            self._pending += self.comm.send_tensors(grads, peer=peer, tag=tag)
        batch.received.clear()

    def _recv_backward(self, mb: int) -> None:
        batch = self._batches[mb]
        for b, g in self._wait("RB", mb):
            # A tensor sent to several stages gets the sum of their gradients.
            batch.grads[b.producer] = batch.grads[b.producer] + g if b.producer in batch.grads else g

    # --------------------------------------------------------------- receives

    def _post_ahead(self, position: int) -> None:
        """Post the receives of this and the next ``_LOOKAHEAD`` receive actions, once each."""
        for i in [i for i in self._receives if i >= position][: _LOOKAHEAD + 1]:
            action = self.actions[i]
            key = (action.kind, action.microbatch)
            if key not in self._posted:
                self._posted[key] = self._post(action.kind, action.microbatch)

    def _post(self, kind: str, mb: int) -> _Posted:
        if kind == "RF":
            groups = self._by_peer(self.stage.plan.inputs, "source")
            tag = mb
        else:
            groups = [
                (peer, [b for b in bs if _is_float(b)])
                for peer, bs in self._by_peer(self.stage.plan.outputs, "target")
            ]
            tag = self.plan.microbatches + mb
        parts = []
        for peer, boundaries in groups:
            specs = [RecvSpec(b.shape, b.dtype) for b in boundaries]
            tensors, works = self.comm.post_recv(specs, peer=peer, tag=tag, device=self.device)
            parts.append((peer, tuple(boundaries), tensors, works))
        return _Posted(tuple(parts))

    def _wait(self, kind: str, mb: int) -> list[tuple[Boundary, torch.Tensor]]:
        posted = self._posted.pop((kind, mb), None) or self._post(kind, mb)
        received: list[tuple[Boundary, torch.Tensor]] = []
        for peer, boundaries, tensors, works in posted.parts:
            self._wait_peer(works, peer=peer)
            received.extend(zip(boundaries, tensors))
        return received

    def _wait_peer(self, works: Sequence[Work], *, peer: int) -> None:
        try:
            wait_all(works, timeout=self.timeout)
        except PeerFailure as exc:
            stage, replica = self.plan.rank_layout()[peer]
            raise PeerFailure(
                f"waiting for rank {peer} (stage {stage}, replica {replica}), which died, raised, hung, or "
                f"was itself stopped by another rank's failure: {exc}"
            ) from exc

    # --------------------------------------------------------------- helpers

    def _by_peer(self, boundaries: Sequence[Boundary], side: str) -> list[tuple[int, list[Boundary]]]:
        grouped: dict[int, list[Boundary]] = {}
        for b in boundaries:
            stage = getattr(b, side)
            grouped.setdefault(self.plan.stages[stage].ranks[self.replica], []).append(b)
        return sorted(grouped.items())

    def _where(self, position: int, action: Action, why: str) -> str:
        lo, hi = max(0, position - 4), min(len(self.actions), position + 5)
        grid = " ".join(f"[{a}]" if i == position else str(a) for i, a in enumerate(self.actions[lo:hi], lo))
        return (
            f"rank {self.rank} (stage {self.stage.plan.index}, replica {self.replica}) stopped at action {action}: "
            f"{why}\n  schedule: {'... ' if lo else ''}{grid}{' ...' if hi < len(self.actions) else ''}"
        )


def _is_float(b: Boundary) -> bool:
    return b.dtype.startswith(("float", "bfloat", "complex"))


