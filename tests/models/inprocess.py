"""Run every pipeline rank of a plan in one process (a thread each, in-memory channels); for fast tests.

Inputs take the planned structure (tuple, dict of keywords or ``(args, kwargs)``) and are
flattened by the plan's call spec exactly as :meth:`runtime.Pipeline.step` does.
:func:`whole_model_step` is the reference: the unpartitioned model over the same
micro-batches; :func:`assert_matches_whole_model` compares a run with it.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from partitioner.graph.capture import CallSpec, model_loss
from partitioner.graph.ir import dtype_from_name
from partitioner.plan import Plan
from runtime.execute.comm import RecvSpec, Work
from runtime.execute.runner import StepRunner
from runtime.execute.stage import build_local_stages, call_spec
from runtime.parallel.replicate import share_tied_parameters

__all__ = ["assert_matches_whole_model", "run_stages", "whole_model_step"]

_TIMEOUT = 30.0
_Key = tuple[int, int, int]


class _Done:
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(seconds=_TIMEOUT)) -> bool:
        return True


class _Arrival:
    def __init__(self, channel: queue.Queue[torch.Tensor], buffer: torch.Tensor) -> None:
        self._channel, self._buffer = channel, buffer

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(seconds=_TIMEOUT)) -> bool:
        try:
            got = self._channel.get(timeout=timeout.total_seconds())
        except queue.Empty:
            return False
        assert got.shape == self._buffer.shape and got.dtype == self._buffer.dtype, (got, self._buffer)
        self._buffer.copy_(got)
        return True


class _MemoryComm:
    def __init__(self, rank: int, channels: dict[_Key, queue.Queue[torch.Tensor]], lock: threading.Lock,
                 log: list[tuple[int, int, int, int]] | None = None):
        self._rank, self._channels, self._lock, self._log = rank, channels, lock, log

    def _channel(self, key: _Key) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._channels[key]

    def send_tensors(self, tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]:
        channel = self._channel((self._rank, peer, tag))
        if self._log is not None:
            with self._lock:
                self._log.append((self._rank, peer, tag, len(tensors)))
        for t in tensors:
            channel.put(t.detach().clone())
        return [_Done()]

    def post_recv(
        self, specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[Work]]:
        channel = self._channel((peer, self._rank, tag))
        out = [torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=device) for s in specs]
        return out, [_Arrival(channel, t) for t in out]


def run_stages(
    plan: Plan,
    build: Callable[[], nn.Module],
    inputs: Any,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    every_parameter: bool = False,
    messages: list[tuple[int, int, int, int]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of every pipeline rank (dp = 1): (mini-batch loss, gradient by parameter name).

    Each rank builds its own model and holds all of its stages (several with
    ``plan.chunks > 1``).  Gradients are keyed by the model's own (first) name; a
    parameter tied across ranks gets the sum of its copies' gradients, as
    ``Pipeline.step`` makes it.  Only the rank of the last stage returns the loss
    and every sent tensor is received.  With ``every_parameter``, every parameter
    gets a gradient.  ``messages`` collects every send: (rank, peer, tag, tensors).
    """
    flat = call_spec(plan).flatten(inputs)
    size = plan.microbatch_size
    micro = [
        (tuple(x[mb * size : (mb + 1) * size] for x in flat),
         None if target is None else target[mb * size : (mb + 1) * size])
        for mb in range(plan.microbatches)
    ]
    channels: dict[_Key, queue.Queue[torch.Tensor]] = defaultdict(queue.Queue)
    lock = threading.Lock()
    runners = []
    for pipeline_rank in range(plan.pp):
        stages = build_local_stages(plan, build(), plan.stages_of(pipeline_rank))
        share_tied_parameters(plan, [s.module for s in stages])
        rank = pipeline_rank * plan.dp
        runners.append(StepRunner(
            plan, stages, [s.module for s in stages], replica=0, rank=rank, loss_fn=loss_fn,
            device=torch.device("cpu"), timeout=_TIMEOUT, comm=_MemoryComm(rank, channels, lock, messages),
        ))
    with ThreadPoolExecutor(max_workers=plan.pp) as pool:
        results = [f.result() for f in [pool.submit(r.run, micro, record=False) for r in runners]]
    last = plan.stages[-1].rank
    for pipeline_rank, result in enumerate(results):
        assert (result is None) == (pipeline_rank != last), "only the rank of the last stage returns the loss"
    assert all(q.empty() for q in channels.values()), "a tensor was sent but never received"
    unsplit = [why for r in runners for why in r.unsplit]
    assert not unsplit, f"a split backward ran whole in B: {unsplit}"
    grads: dict[str, torch.Tensor] = {}
    for pipeline_rank in range(plan.pp):
        seen: set[int] = set()  # a tied parameter two stages of one rank share counts once
        for stage in runners[pipeline_rank].local_stages:
            for name, p in stage.module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                canonical = stage.captured.parameter_names.get(name, name)
                if every_parameter:
                    assert p.grad is not None, f"{name} got no gradient"
                if p.grad is not None:
                    grads[canonical] = grads[canonical] + p.grad if canonical in grads else p.grad
    loss = results[last]
    assert loss is not None
    return loss, grads


def whole_model_step(
    build: Callable[[], nn.Module], inputs: Any, target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *, microbatches: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unpartitioned model over the plan's micro-batches (dp = 1): the loss and gradients a pipeline step gives.

    Each micro-batch's loss is divided by ``microbatches`` before its backward and the
    losses are summed, as ``StepRunner`` does; batch statistics are therefore per micro-batch.
    Without ``loss_fn`` the model's output carries the loss.  Gradients by parameter name
    (the parameters that got one).
    """
    call, flat = CallSpec.of(inputs)
    torch.manual_seed(0)
    whole, size, total = build(), flat[0].shape[0] // microbatches, torch.zeros(())
    for mb in range(microbatches):
        part = slice(mb * size, (mb + 1) * size)
        args, kwargs = call.rebuild([x[part] for x in flat])
        outputs = whole(*args, **kwargs)
        if loss_fn is None:
            loss = model_loss(outputs)
        else:
            loss = loss_fn(outputs, pytree.tree_map(lambda t, part=part: t[part] if isinstance(t, torch.Tensor) else t, target))
        assert loss is not None, "the model's output carries no loss"
        (loss / microbatches).backward()
        total += loss.detach() / microbatches
    return total, {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}


def assert_matches_whole_model(
    plan: Plan, build: Callable[[], nn.Module], inputs: Any, target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None, got: tuple[torch.Tensor, dict[str, torch.Tensor]], *,
    tolerance: float, label: str = "",
) -> None:
    """``got`` (loss, gradients of one step, e.g. :func:`run_stages`') equals :func:`whole_model_step`, to ``tolerance``."""
    loss, grads = got
    want, expected = whole_model_step(build, inputs, target, loss_fn, microbatches=plan.microbatches)
    torch.testing.assert_close(loss, want, rtol=0, atol=tolerance, msg=label or None)
    assert grads.keys() == expected.keys(), (label, sorted(grads.keys() ^ expected.keys()))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=tolerance, msg=f"{label}: {name}")
