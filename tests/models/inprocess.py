"""Run every stage of a plan in one process (a thread each, in-memory channels); for fast tests.

Inputs take the planned structure (tuple, dict of keywords or ``(args, kwargs)``) and are
flattened by the plan's call spec exactly as :meth:`runtime.Pipeline.step` does.
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

from partitioner.ir import dtype_from_name
from partitioner.plan import Plan
from runtime.comm import RecvSpec, Work
from runtime.execute import StepRunner
from runtime.stage import build_local_stage, call_spec

__all__ = ["run_stages"]

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
    def __init__(self, rank: int, channels: dict[_Key, queue.Queue[torch.Tensor]], lock: threading.Lock):
        self._rank, self._channels, self._lock = rank, channels, lock

    def _channel(self, key: _Key) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._channels[key]

    def send_tensors(self, tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]:
        channel = self._channel((self._rank, peer, tag))
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of every stage (dp = 1): (mini-batch loss, gradient by parameter name).

    Only the last stage returns the loss and every sent tensor is received.  With
    ``every_parameter``, each parameter is held by one stage only and gets a gradient.
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
    for index in range(plan.pp):
        stage = build_local_stage(plan, build(), index)
        rank = plan.stages[index].ranks[0]
        runners.append(StepRunner(
            plan, stage, stage.module, replica=0, rank=rank, loss_fn=loss_fn,
            device=torch.device("cpu"), timeout=_TIMEOUT, comm=_MemoryComm(rank, channels, lock),
        ))
    with ThreadPoolExecutor(max_workers=plan.pp) as pool:
        results = [f.result() for f in [pool.submit(r.run, micro, record=False) for r in runners]]
    for index, result in enumerate(results):
        assert (result is None) == (index != plan.pp - 1), "only the last stage returns the loss"
    assert all(q.empty() for q in channels.values()), "a tensor was sent but never received"
    grads: dict[str, torch.Tensor] = {}
    for runner in runners:
        for name, p in runner.stage.module.named_parameters():
            if every_parameter:
                assert name not in grads, f"{name} is held by two stages"
                assert p.grad is not None, f"{name} got no gradient"
            if p.grad is not None:
                grads[name] = p.grad
    loss = results[-1]
    assert loss is not None
    return loss, grads
