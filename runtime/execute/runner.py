"""Execute one pipeline rank's action row for one training step.

A rank holds one stage, or several (``plan.chunks``: interleaved and V
schedules); every action names its stage and maps to one method, and the
step's state lives in one :class:`_MicroBatch` record per (stage, micro-batch),
dropped after the last action that needs it.

* **Boundaries.**  ``SF`` / ``RF`` / ``SB`` / ``RB`` move the tensors of
  boundaries between stages on *different* ranks, one message per pair of
  stages, peers in ascending stage order, tagged (gloo) by receiving stage,
  direction and micro-batch: activations into stage t ``2t x M + m``,
  gradients back into stage s ``(2s + 1) x M + m``.  A boundary between two
  stages of this rank is handed over in memory: the consumer's forward takes
  the producer's output detached (a leaf requiring grad, as a received one),
  and the consumer's backward adds its input gradient to the producer's output
  gradient.  An input the stage graph writes in place (``nn.ReLU(inplace=True)``
  right after a cut; found once per stage,
  :func:`partitioner.graph.meetings.inputs_written_in_place`) is handed to the forward as
  a clone of the leaf: autograd refuses writes into a leaf requiring grad, and
  the gradient sent back is still the one of the received value.
* **Split backward.**  When the schedule has ``W`` actions, ``B`` computes
  only the gradient of the stage's received inputs and ``W`` the parameter
  gradients later, from the same autograd graph
  (:class:`partitioner.graph.splitbackward.SplitBackward`).
* Sends are non-blocking (waited for at the end of the step); receives are
  posted ``_LOOKAHEAD`` receive actions ahead (gloo moves data only once the
  receiver has posted, so a late post adds milliseconds) and waited for with
  the configured timeout when their action comes, so the order the schedule
  fixes cannot deadlock (the planner dry-ran it).  Receives from one peer rank
  are *posted* in the order that peer sends (read from its row of the plan):
  posting a message posts every one the peer sends to this rank before it.
  NCCL pairs messages by order alone, and gloo pairs those of one tag in
  order, so they pair right whatever order this rank's receive actions take
  them in (a rank holding several stages may take them in another order).

On failure the error names this rank, the stage and action, the peer, and
shows the rank's schedule around the failing action.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from partitioner.errors import AutopartitionError
from partitioner.graph.capture import model_loss
from partitioner.graph.meetings import MarkedGraph, inputs_written_in_place, mark_meetings
from partitioner.graph.splitbackward import SplitBackward
from partitioner.orders import Action
from partitioner.plan import Boundary, Plan
from runtime.execute.comm import (
    Communicator,
    DistCommunicator,
    PeerFailure,
    RecvSpec,
    Work,
    wait_all,
)
from runtime.execute.stack import StackLayer, StepHooks
from runtime.execute.stage import LocalStage
from runtime.execute.wire import wire_shape

__all__ = ["ActionRecord", "StepFailure", "StepRunner", "gradient_order"]

_LOOKAHEAD = 2  # receive actions posted ahead of the one being executed


class StepFailure(RuntimeError):
    """A step stopped on this rank; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    action: str
    start_s: float
    end_s: float


# ------------------------------------------------------------------- runner


# One message: (direction F | B, sending stage, receiving stage, micro-batch).
_Message = tuple[str, int, int, int]


@dataclasses.dataclass(frozen=True)
class _Posted:
    """The receive posted for one message: its boundaries, buffers and pending works."""

    boundaries: tuple[Boundary, ...]
    tensors: list[torch.Tensor]
    works: list[Work]


@dataclasses.dataclass
class _MicroBatch:
    """One stage's state for one micro-batch."""

    received: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    sent: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # of sent tensors
    input_grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # of received ones
    loss: torch.Tensor | None = None
    split: SplitBackward | None = None


@dataclasses.dataclass(frozen=True)
class _Held:
    """A stage this rank holds."""

    stage: LocalStage
    module: torch.nn.Module
    input_index: tuple[int, ...]  # positions of its model inputs among the plan's inputs
    written: frozenset[int]  # positions of the forward's arguments it writes in place: handed over as clones


def gradient_order(actions: Sequence[Action]) -> list[int]:
    """The stages of a row in the order their gradients are complete (after their last W, else last B).

    >>> from partitioner.orders import parse_actions
    >>> gradient_order(parse_actions(["0F0", "3F0", "3B0", "0B0", "3W0", "0W0"]))
    [3, 0]
    """
    last: dict[int, int] = {}
    for position, a in enumerate(actions):
        if a.kind in ("B", "W"):
            last[a.stage] = position
    return sorted(last, key=last.__getitem__)


class StepRunner:
    """Runs one pipeline rank's actions over every stage it holds; one per Pipeline, reused every step.

    ``stages`` and ``modules`` (the stage module, or its DDP wrapper) go together,
    by stage index.  ``comm`` moves the boundary tensors: torch.distributed unless
    given (tests pass an in-memory one to run every rank in one process).
    ``hooks`` (the rank's :class:`~runtime.execute.stack.StageStack`) are the layers'
    say in a step, asked without knowing which layers there are: around each forward
    and whole backward (DDP syncs gradients in a stage's last backward only), and once
    a stage's parameter gradients of the step are complete (the explicit replica
    all-reduce starts there).
    """

    def __init__(
        self,
        plan: Plan,
        stages: Sequence[LocalStage],
        modules: Sequence[torch.nn.Module],
        *,
        replica: int,
        rank: int,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        device: torch.device,
        timeout: float,
        comm: Communicator | None = None,
        hooks: StepHooks | None = None,
    ) -> None:
        if not stages or len(stages) != len(modules):
            raise ValueError(f"StepRunner needs one module per stage, got {len(stages)} stages, {len(modules)} modules")
        self.plan = plan
        self.comm: Communicator = comm if comm is not None else DistCommunicator()
        self.replica = replica
        self.rank = rank
        self.loss_fn = loss_fn
        self.device = device
        self.timeout = timeout
        self.hooks: StepHooks = hooks if hooks is not None else StackLayer()  # no layers: nothing to ask
        names = [t.name for t in plan.model.inputs]
        self._held = {
            s.plan.index: _Held(s, m, tuple(names.index(n) for n in s.signature.model_inputs), _written(s))
            for s, m in zip(stages, modules)
        }
        self.pipeline_rank = stages[0].plan.rank
        schedule = plan.schedule_data()
        self.actions = schedule.actions[self.pipeline_rank]
        self.split = schedule.splits_backward
        foreign = sorted({a.stage for a in self.actions} - set(self._held))
        if foreign:
            raise ValueError(f"pipeline rank {self.pipeline_rank}'s actions name stages {foreign} it does not hold")
        self._where = plan.stage_ranks()
        self._last_backwards = {  # each stage's last B of the step (DDP syncs its gradients there)
            self.actions[max(i for i, a in enumerate(self.actions) if a.kind == "B" and a.stage == s)] for s in self._held
        }
        self._gradients_done = {
            max(i for i, a in enumerate(self.actions) if a.kind in ("B", "W") and a.stage == s): s for s in self._held
        }
        last_use: dict[tuple[int, int], int] = {}
        for i, a in enumerate(self.actions):
            last_use[a.stage, a.microbatch] = i
        self._last_use = {i: key for key, i in last_use.items()}
        self.records: list[ActionRecord] = []
        self.unsplit: list[str] = []  # why a stage's split backward ran whole (once per stage)
        self._checked: set[int] = set()  # stages whose split backward's graph was checked
        self._whole: dict[int, str] = {}  # stages whose backward runs whole in B, and why
        self._marked: dict[int, MarkedGraph] = {}  # stage graphs marked for the split backward
        self._receives = [i for i, a in enumerate(self.actions) if a.kind in ("RF", "RB")]
        self._incoming = self._incoming_order(schedule.actions)  # per peer pipeline rank, its sends to me
        self._sent_index = {m: k for order in self._incoming.values() for k, m in enumerate(order)}
        self._posted: dict[_Message, _Posted] = {}  # posted, not yet waited for
        self._posted_upto: dict[int, int] = {}  # per peer pipeline rank: how many of its messages are posted
        self._pending: list[Work] = []
        self._micro: list[tuple[tuple[torch.Tensor, ...], Any]] = []
        self._state: dict[tuple[int, int], _MicroBatch] = {}
        self._handlers: dict[str, Callable[[Action], None]] = {
            "F": self._forward,
            "B": self._backward,
            "W": self._weight,
            "SF": self._send_forward,
            "RF": self._recv_forward,
            "SB": self._send_backward,
            "RB": self._recv_backward,
        }

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this rank holds, ascending."""
        return tuple(sorted(self._held))

    @property
    def local_stages(self) -> tuple[LocalStage, ...]:
        """The stages this rank holds, by stage index."""
        return tuple(self._held[s].stage for s in self.stages)

    # ------------------------------------------------------------------ step

    def run(
        self, microbatches: Sequence[tuple[tuple[torch.Tensor, ...], Any]], *, record: bool
    ) -> torch.Tensor | None:
        """Run every action; returns the summed (already 1/M-scaled) loss where the last stage is held."""
        self._micro = list(microbatches)
        self._state = {}
        self._pending = []
        self._posted, self._posted_upto = {}, {}
        losses: list[torch.Tensor] = []
        for position, action in enumerate(self.actions):
            start = time.time()
            try:
                self._post_ahead(position)
                self._handlers[action.kind](action)
                if action.kind == "F" and self._held[action.stage].stage.is_last:
                    loss = self._state[action.stage, action.microbatch].loss
                    assert loss is not None
                    losses.append(loss.detach())
                if position in self._last_use:
                    del self._state[self._last_use[position]]
                if position in self._gradients_done:
                    self.hooks.gradients_done(self._gradients_done[position])
            except PeerFailure as exc:
                raise StepFailure(self._where_failed(position, action, f"peer failure: {exc}")) from exc
            except StepFailure:
                raise
            except Exception as exc:
                raise StepFailure(self._where_failed(position, action, f"{type(exc).__name__}: {exc}")) from exc
            if record:
                self.records.append(ActionRecord(str(action), start, time.time()))
        try:
            wait_all(self._pending, timeout=self.timeout)
        except PeerFailure as exc:
            raise StepFailure(f"rank {self.rank}: a send did not complete: {exc}") from exc
        self._micro, self._state = [], {}
        return torch.stack(losses).sum() if losses else None

    # --------------------------------------------------------------- compute

    def _batch(self, stage: int, mb: int) -> _MicroBatch:
        return self._state.setdefault((stage, mb), _MicroBatch())

    def _forward(self, a: Action) -> None:
        held = self._held[a.stage]
        batch = self._batch(a.stage, a.microbatch)
        for b in held.stage.plan.inputs:  # boundaries from a stage of this rank: in memory
            if self._where[b.source] == self.pipeline_rank:
                t = self._state[b.source, a.microbatch].sent[b.producer].detach()
                batch.received[b.producer] = t.requires_grad_() if t.is_floating_point() else t
        inputs, target = self._micro[a.microbatch]
        sig = held.stage.signature
        args = [inputs[i] for i in held.input_index] + [batch.received[n] for n in sig.received]
        # An op writing into an input (``nn.ReLU(inplace=True)`` on a received leaf, which autograd refuses)
        # writes into a copy, as the whole model writes into its own tensor; the gradient still reaches the leaf.
        if held.written:
            args = [a.clone() if i in held.written else a for i, a in enumerate(args)]
        recording: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.split:
            marked = self._marked_graph(held, batch)
            # The graph check costs a walk over it: once per stage (captured graphs do not branch on data).
            check = a.stage not in self._checked
            self._checked.add(a.stage)
            batch.split = SplitBackward(check=check, unsplit=marked.unsplit)
            recording = batch.split.recording(marked.log)
        with recording:
            with self.hooks.forwarding(a.stage):  # DDP: gradients are reduced once, on the last backward
                outputs = held.module(*args)
            batch.sent = dict(zip(sig.sent, outputs[: len(sig.sent)]))
            if held.stage.is_last:
                batch.loss = self._loss(held.stage, outputs[len(sig.sent) :], target)

    def _marked_graph(self, held: _Held, batch: _MicroBatch) -> MarkedGraph:
        """The stage module marked for the split backward (:mod:`partitioner.graph.meetings`), once per stage."""
        stage = held.stage.plan.index
        if stage not in self._marked:
            sig, module = held.stage.signature, held.stage.module
            placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"][len(sig.model_inputs):]
            active = [p for p, n in zip(placeholders, sig.received) if batch.received[n].requires_grad]
            self._marked[stage] = mark_meetings(module, active=active)
        return self._marked[stage]

    def _loss(self, stage: LocalStage, outputs: Sequence[Any], target: Any) -> torch.Tensor:
        model_out = stage.captured.unflatten_outputs(outputs)
        if self.loss_fn is None:
            # The model computes its own loss (HF `labels=`): the graph's scalar output.
            loss = model_loss(model_out)
            if loss is None:  # the user's input, not a fault of ours: reported as bad input
                raise AutopartitionError(
                    "the model's output carries no loss (no scalar `loss` key or attribute, and it is "
                    "not a scalar): pass Pipeline(plan, model, loss_fn) (a model file's loss_fn), or plan "
                    "the model with its target as an input (e.g. `labels`) so that it returns its loss"
                )
        else:
            loss = self.loss_fn(model_out, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise StepFailure(f"loss_fn must return a scalar tensor (the batch mean), got {loss!r:.80}")
        # Mean over the mini-batch = mean of the equal micro-batch means.
        return loss / self.plan.microbatches

    def _backward(self, a: Action) -> None:
        held = self._held[a.stage]
        batch = self._state[a.stage, a.microbatch]
        named: list[tuple[str, torch.Tensor, Any]]
        if held.stage.is_last:
            assert batch.loss is not None
            named = [("", batch.loss, None)]
        else:
            named = [(n, t, batch.grads[n]) for n, t in batch.sent.items() if t.requires_grad and n in batch.grads]
        tensors, grads = [t for _, t, _ in named], [g for _, _, g in named]
        leaves = [(n, t) for n, t in batch.received.items() if t.requires_grad]
        if batch.split is not None:
            sent = held.stage.signature.sent
            weights = self._marked[a.stage].weight_outputs
            weight_only = {i for i, (n, _, _) in enumerate(named) if n in sent and sent.index(n) in weights}
            if a.stage in self._whole:  # found by the check on an earlier micro-batch (it runs once per stage)
                batch.split.run_whole(self._whole[a.stage])
            got = (batch.split.backward_inputs(tensors, grads, [t for _, t in leaves], weight_only=weight_only)
                   if tensors else [])
            if batch.split.unsplit is not None and a.stage not in self._whole:
                self._whole[a.stage] = batch.split.unsplit
                self._note_unsplit(a.stage, batch.split.unsplit)
        else:
            self._full_backward(a, tensors, grads)
            got = [t.grad for _, t in leaves]
        for (name, leaf), g in zip(leaves, got or [None] * len(leaves)):
            batch.input_grads[name] = g if g is not None else torch.zeros_like(leaf)
        for b in held.stage.plan.inputs:  # a producer on this rank takes its gradient in memory
            if self._where[b.source] == self.pipeline_rank and b.producer in batch.input_grads:
                producer = self._state[b.source, a.microbatch]
                g = batch.input_grads[b.producer]
                producer.grads[b.producer] = producer.grads[b.producer] + g if b.producer in producer.grads else g
        batch.sent.clear()
        batch.grads.clear()
        batch.received.clear()
        batch.loss = None

    def _full_backward(self, a: Action, tensors: list[torch.Tensor], grads: list[Any]) -> None:
        with self.hooks.backwarding(a.stage, tensors, last=a in self._last_backwards):
            if tensors:  # none: nothing to backpropagate (DDP's sync was still set up for the last one)
                torch.autograd.backward(tensors, grads)

    def _weight(self, a: Action) -> None:
        batch = self._state[a.stage, a.microbatch]
        if batch.split is not None:
            batch.split.backward_weights()
            batch.split = None

    def _note_unsplit(self, stage: int, why: str) -> None:
        self.unsplit.append(f"stage {stage}: {why}")
        warnings.warn(
            f"rank {self.rank}: stage {stage}'s backward runs whole in B (its W does nothing), as the "
            f"forward could not be followed: {why}. Gradients are right; the schedule's overlap is lost.",
            RuntimeWarning, stacklevel=2,
        )

    # --------------------------------------------------------- communication

    def _remote_out(self, stage: int) -> list[tuple[int, list[Boundary]]]:
        """(consumer stage, boundaries in the producer's order) per consumer on another rank, ascending."""
        grouped: dict[int, list[Boundary]] = {}
        for b in self.plan.stages[stage].outputs:
            if self._where[b.target] != self.pipeline_rank:
                grouped.setdefault(b.target, []).append(b)
        return sorted(grouped.items())

    def _remote_in(self, stage: int) -> list[tuple[int, list[Boundary]]]:
        """(producer stage, boundaries in the producer's order) per producer on another rank, ascending."""
        producers = sorted({b.source for b in self.plan.stages[stage].inputs
                            if self._where[b.source] != self.pipeline_rank})
        return [(p, [b for b in self.plan.stages[p].outputs if b.target == stage]) for p in producers]

    def _peer_rank(self, stage: int) -> int:
        # tp > 1: this rank's counterpart in the peer's tensor-parallel group (runtime.parallel.tensorparallel)
        return self.plan.layout.moved(self.rank, pp=self.plan.stages[stage].rank)

    def _tag(self, stage: int, direction: str, mb: int) -> int:
        return (2 * stage + (direction == "B")) * self.plan.microbatches + mb

    def _send_forward(self, a: Action) -> None:
        batch = self._state[a.stage, a.microbatch]
        for t, boundaries in self._remote_out(a.stage):
            tensors = [batch.sent[b.producer] for b in boundaries]
            self._pending += self.comm.send_tensors(
                tensors, peer=self._peer_rank(t), tag=self._tag(t, "F", a.microbatch))

    def _recv_forward(self, a: Action) -> None:
        batch = self._batch(a.stage, a.microbatch)
        for b, t in self._wait(a):
            batch.received[b.producer] = t.requires_grad_() if t.is_floating_point() else t

    def _send_backward(self, a: Action) -> None:
        batch = self._state[a.stage, a.microbatch]
        for p, boundaries in self._remote_in(a.stage):
            grads = [batch.input_grads[b.producer] for b in boundaries if _is_float(b)]
            self._pending += self.comm.send_tensors(
                grads, peer=self._peer_rank(p), tag=self._tag(p, "B", a.microbatch))
        batch.input_grads.clear()

    def _recv_backward(self, a: Action) -> None:
        batch = self._state[a.stage, a.microbatch]
        for b, g in self._wait(a):
            # A tensor sent to several stages gets the sum of their gradients.
            batch.grads[b.producer] = batch.grads[b.producer] + g if b.producer in batch.grads else g

    # --------------------------------------------------------------- receives

    def _incoming_order(self, rows: Sequence[Sequence[Action]]) -> dict[int, list[_Message]]:
        """Per peer pipeline rank, the messages it sends this rank, in its order (as its SF / SB send them)."""
        me, where = self.pipeline_rank, self._where
        out: dict[int, list[_Message]] = {}
        for peer, row in enumerate(rows):
            if peer == me:
                continue
            for a in row:
                s, i = a.stage, a.microbatch
                if a.kind == "SF":
                    targets = sorted({b.target for b in self.plan.stages[s].outputs if where[b.target] != peer})
                    out.setdefault(peer, []).extend(("F", s, t, i) for t in targets if where[t] == me)
                elif a.kind == "SB":
                    sources = sorted({b.source for b in self.plan.stages[s].inputs if where[b.source] != peer})
                    out.setdefault(peer, []).extend(("B", s, p, i) for p in sources if where[p] == me)
        return out

    def _messages(self, a: Action) -> list[_Message]:
        """The messages receive ``a`` takes, in the order their senders send them."""
        if a.kind == "RF":
            found = [("F", p, a.stage, a.microbatch) for p, _ in self._remote_in(a.stage)]
        else:
            found = [("B", t, a.stage, a.microbatch) for t, _ in self._remote_out(a.stage)]
        return sorted(found, key=lambda m: self._sent_index.get(m, -1))

    def _post_ahead(self, position: int) -> None:
        """Post the receives of this and the next ``_LOOKAHEAD`` receive actions, once each."""
        for i in [i for i in self._receives if i >= position][: _LOOKAHEAD + 1]:
            for m in self._messages(self.actions[i]):
                self._post(m)

    def _post(self, m: _Message) -> None:
        """Post message ``m``'s receive, after those of every message its sender sends this rank before it."""
        peer = self._where[m[1]]
        order, done = self._incoming.get(peer, []), self._posted_upto.get(peer, 0)
        last = self._sent_index.get(m)
        if last is None:
            raise RuntimeError(f"pipeline rank {peer}'s actions never send message {m} (a plan bug)")
        for k in range(done, last + 1):
            self._posted[order[k]] = self._post_one(order[k])
        self._posted_upto[peer] = max(done, last + 1)

    def _post_one(self, m: _Message) -> _Posted:
        direction, src, dst, mb = m
        if direction == "F":
            boundaries = [b for b in self.plan.stages[src].outputs if b.target == dst]
        else:
            boundaries = [b for b in self.plan.stages[dst].outputs if b.target == src and _is_float(b)]
        specs = [RecvSpec(wire_shape(b.shape, b.dtype, self.plan.tp), b.dtype) for b in boundaries]
        tensors, works = self.comm.post_recv(specs, peer=self._peer_rank(src), tag=self._tag(dst, direction, mb),
                                             device=self.device)
        return _Posted(tuple(boundaries), tensors, works)

    def _wait(self, a: Action) -> list[tuple[Boundary, torch.Tensor]]:
        received: list[tuple[Boundary, torch.Tensor]] = []
        for m in self._messages(a):
            if m not in self._posted:
                self._post(m)
            posted = self._posted.pop(m)
            self._wait_peer(posted.works, peer=self._peer_rank(m[1]), stage=m[1])
            received.extend(zip(posted.boundaries, posted.tensors))
        return received

    def _wait_peer(self, works: Sequence[Work], *, peer: int, stage: int) -> None:
        try:
            wait_all(works, timeout=self.timeout)
        except PeerFailure as exc:
            raise PeerFailure(
                f"waiting for rank {peer} (stage {stage}, replica {self.replica}), which died, raised, hung, or "
                f"was itself stopped by another rank's failure: {exc}"
            ) from exc

    # --------------------------------------------------------------- helpers

    def _where_failed(self, position: int, action: Action, why: str) -> str:
        lo, hi = max(0, position - 4), min(len(self.actions), position + 5)
        grid = " ".join(f"[{a}]" if i == position else str(a) for i, a in enumerate(self.actions[lo:hi], lo))
        held = "" if len(self._held) == 1 else f" of stages {', '.join(map(str, self.stages))}"
        return (
            f"rank {self.rank} (stage {action.stage}{held}, replica {self.replica}) stopped at action {action}: "
            f"{why}\n  schedule: {'... ' if lo else ''}{grid}{' ...' if hi < len(self.actions) else ''}"
        )


def _written(stage: LocalStage) -> frozenset[int]:
    """Positions of the stage forward's arguments (model inputs, then received) that its graph writes in place."""
    names = [n.name for n in stage.module.graph.nodes if n.op == "placeholder"]
    written = inputs_written_in_place(stage.module)
    return frozenset(i for i, n in enumerate(names) if n in written)


def _is_float(b: Boundary) -> bool:
    return b.dtype.startswith(("float", "bfloat", "complex"))
