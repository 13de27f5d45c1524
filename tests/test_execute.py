"""``StepRunner`` in one process: every stage of a plan, one thread each, over an in-memory communicator.

The multi-process tests (``test_equivalence_pipeline.py``) spawn gloo ranks; these run
the same action lists with the real ``StepRunner`` but move tensors through queues
(:class:`_MemoryComm`, injected through ``StepRunner(comm=...)``), so a schedule bug
shows up in a second, with a readable traceback.  Each stage runs in its own thread
because a stage blocks on its receives, as a rank would.  Loss and every gradient must
equal one unpartitioned forward and backward of the whole mini-batch (fp32, 1e-5).
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from planning_helpers import make_plan

from partitioner.ir import dtype_from_name
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from runtime.comm import RecvSpec, Work
from runtime.execute import StepRunner
from runtime.stage import build_local_stage

_MODELS = Path(__file__).parent / "models"
_TOLERANCE = 1e-5
_TIMEOUT = 30.0  # seconds a receive waits before the runner reports its peer as failed
_Key = tuple[int, int, int]  # (source rank, destination rank, tag)


class _Done:
    """A send: the tensor is already in its queue."""

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(seconds=_TIMEOUT)) -> bool:
        return True


class _Arrival:
    """A posted receive: takes the next tensor of its queue into the buffer on ``wait``."""

    def __init__(self, channel: queue.Queue[torch.Tensor], buffer: torch.Tensor) -> None:
        self._channel = channel
        self._buffer = buffer

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(seconds=_TIMEOUT)) -> bool:
        try:
            got = self._channel.get(timeout=timeout.total_seconds())
        except queue.Empty:
            return False
        assert got.shape == self._buffer.shape and got.dtype == self._buffer.dtype, (
            got,
            self._buffer,
        )
        self._buffer.copy_(got)
        return True


class _MemoryComm:
    """One rank's end of in-memory point-to-point channels, FIFO per (source, destination, tag)."""

    def __init__(
        self, rank: int, channels: dict[_Key, queue.Queue[torch.Tensor]], lock: threading.Lock
    ):
        self._rank = rank
        self._channels = channels
        self._lock = lock

    def _channel(self, key: _Key) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._channels[key]

    def send_tensors(self, tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]:
        channel = self._channel((self._rank, peer, tag))
        for t in tensors:  # copies, as real sends: no autograd link between stages
            channel.put(t.detach().clone())
        return [_Done()]

    def post_recv(
        self, specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[Work]]:
        channel = self._channel((peer, self._rank, tag))
        out = [torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=device) for s in specs]
        return out, [_Arrival(channel, t) for t in out]


def _run_all_stages(
    plan: Plan, spec: str, inputs: tuple[torch.Tensor, ...], target: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of every stage; (loss, gradient by parameter name)."""
    model_file = load_model_file(spec)
    channels: dict[_Key, queue.Queue[torch.Tensor]] = defaultdict(queue.Queue)
    lock = threading.Lock()
    size = plan.microbatch_size
    micro = [
        (tuple(x[mb * size : (mb + 1) * size] for x in inputs), target[mb * size : (mb + 1) * size])
        for mb in range(plan.microbatches)
    ]
    runners = []
    for index in range(plan.pp):
        stage = build_local_stage(plan, model_file.build(), index)  # own copy of the weights
        rank = plan.stages[index].ranks[0]
        runners.append(
            StepRunner(
                plan,
                stage,
                stage.module,
                replica=0,
                rank=rank,
                loss_fn=model_file.loss_fn,
                device=torch.device("cpu"),
                timeout=_TIMEOUT,
                comm=_MemoryComm(rank, channels, lock),
            )
        )
    # A stage blocks on its receives, as a rank would: one thread each.  A stage that
    # raises (or times out waiting) re-raises here, from result().
    with ThreadPoolExecutor(max_workers=plan.pp) as pool:
        futures = [pool.submit(runner.run, micro, record=False) for runner in runners]
        results = [f.result() for f in futures]
    for index, result in enumerate(results):
        assert (result is None) == (index != plan.pp - 1), "only the last stage returns the loss"
    assert all(q.empty() for q in channels.values()), "a tensor was sent but never received"
    grads: dict[str, torch.Tensor] = {}
    for runner in runners:
        for name, p in runner.stage.module.named_parameters():
            assert name not in grads, f"{name} is held by two stages"
            assert p.grad is not None, f"{name} got no gradient"
            grads[name] = p.grad
    loss = results[-1]
    assert loss is not None
    return loss, grads


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("model", "pp"), [("mlp", 2), ("mlp", 4), ("skip_mlp", 4)])
def test_stages_in_one_process_match_whole_model(
    tmp_path: Path, model: str, pp: int, schedule: str
) -> None:
    spec = str(_MODELS / f"{model}.py")
    batch, microbatches = 16, 8  # more micro-batches than stages: 1F1B reaches its steady state
    plan = make_plan(
        spec, tmp_path, pp=pp, microbatches=microbatches, schedule=schedule, batch=batch
    )
    model_file = load_model_file(spec)
    assert model_file.loss_fn is not None and model_file.example_target is not None
    inputs, target = model_file.example_inputs(batch), model_file.example_target(batch)

    loss, grads = _run_all_stages(plan, spec, inputs, target)

    whole = model_file.build()
    want = model_file.loss_fn(whole(*inputs), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=_TOLERANCE)
    expected = {n: p.grad for n, p in whole.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=_TOLERANCE, msg=name)
