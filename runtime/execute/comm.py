"""Communication: process groups, point-to-point boundary tensors, timeouts.

Backend by device: NCCL with a CUDA device when one is visible, gloo on CPU.
Every wait has a timeout (:func:`rank_timeout`: ``Pipeline(timeout=...)``, else the
``AUTOPARTITION_TIMEOUT`` variable, else 300 s); it also bounds the process group's
collectives when the Pipeline creates the group.  When a peer dies or times out,
:class:`PeerFailure` names the peer (global rank, stage, replica) and the action
this rank was on.

Example (two CPU ranks)::

    # in each rank, after dist.init_process_group("gloo", ...)
    work = send_tensors([t], peer=1, tag=0)      # non-blocking
    got = recv_tensors([RecvSpec(...)], peer=0, tag=0, timeout=60.0)

``StepRunner`` moves tensors through a :class:`Communicator`: :class:`DistCommunicator`
(the functions here) by default; tests inject an in-memory one to run every stage in
one process.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from partitioner.graph.ir import dtype_from_name
from partitioner.plan import Plan

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "Communicator",
    "DistCommunicator",
    "Groups",
    "PeerFailure",
    "RecvSpec",
    "TiedCopy",
    "Work",
    "backend_for",
    "init_distributed",
    "make_groups",
    "pick_device",
    "post_recv",
    "rank_timeout",
    "recv_tensors",
    "send_tensors",
    "wait_all",
]


TIMEOUT_ENV = "AUTOPARTITION_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def rank_timeout(timeout: float | None = None) -> float:
    """Seconds a rank waits for a peer: ``timeout`` if given, else ``$AUTOPARTITION_TIMEOUT``, else 300."""
    from partitioner.errors import AutopartitionError
    from partitioner.units import env_seconds

    if timeout is None:
        return env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, what="a rank waits for its peers", example=600)
    if not timeout > 0:
        raise AutopartitionError(f"timeout={timeout!r}: give the seconds a rank waits for its peers (> 0).")
    return float(timeout)


class PeerFailure(RuntimeError):
    """A peer died, raised, or did not answer within the timeout."""


@dataclasses.dataclass(frozen=True)
class RecvSpec:
    shape: tuple[int, ...]
    dtype: str


class Work(Protocol):
    """A pending send or receive (``torch.distributed.Work``); False from ``wait`` = timed out."""

    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...


class Communicator(Protocol):
    """Point-to-point transfers of boundary tensors, as :class:`~runtime.execute.runner.StepRunner` uses them."""

    def send_tensors(self, tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]: ...

    def post_recv(
        self, specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[Work]]: ...


class DistCommunicator:
    """The real transfers: :func:`send_tensors` and :func:`post_recv` over torch.distributed."""

    def send_tensors(self, tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]:
        return send_tensors(tensors, peer=peer, tag=tag)

    def post_recv(
        self, specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[Work]]:
        return post_recv(specs, peer=peer, tag=tag, device=device)


def pick_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is visible, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device, *, timeout: float) -> None:
    """Join the job started by torchrun (env:// rendezvous) unless already joined."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        from partitioner.errors import AutopartitionError

        raise AutopartitionError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set. Launch with "
            "`autopartition run plan/ -- train.py` (torchrun underneath) or call "
            "dist.init_process_group yourself before building the Pipeline."
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout))
    # The group we made is ours to end: a process leaving with it alive may abort in the backend's teardown
    # ("terminate called without an active exception", seen on gloo ranks after a finished run).
    atexit.register(_destroy_group)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def send_tensors(tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]:
    """Start sending each tensor to ``peer``; returns the pending works (never blocks)."""
    works: list[Work] = []
    for t in tensors:
        work = dist.isend(t.detach().contiguous(), dst=peer, tag=tag)
        if work is not None:
            works.append(_PeerWork(work, peer))
    return works


def post_recv(
    specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device
) -> tuple[list[torch.Tensor], list[Work]]:
    """Allocate one buffer per spec and post its receive from ``peer`` (never blocks).

    Posting early matters with gloo: data moves only once the receive is posted.
    """
    out = [torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=device) for s in specs]
    works = [dist.irecv(t, src=peer, tag=tag) for t in out]
    return out, [_PeerWork(w, peer) for w in works if w is not None]


def recv_tensors(
    specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device, timeout: float
) -> list[torch.Tensor]:
    """Receive one tensor per spec from ``peer``, waiting at most ``timeout`` seconds in all."""
    out, works = post_recv(specs, peer=peer, tag=tag, device=device)
    wait_all(works, timeout=timeout)
    return out


class _PeerWork:
    """A point-to-point work and the rank at its other end, so that a timeout can name that rank."""

    def __init__(self, work: Work, peer: int) -> None:
        self.work = work
        self.peer = peer

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)) -> bool:
        return self.work.wait(timeout=timeout)


def wait_all(works: Sequence[Work], *, timeout: float) -> None:
    """Wait for every work; a failure or timeout becomes :class:`PeerFailure` (naming the peer when known)."""
    delta = datetime.timedelta(seconds=timeout)
    for work in works:
        peer = getattr(work, "peer", None)
        try:
            finished = work.wait(timeout=delta)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            if peer is not None and _timed_out(first):
                raise PeerFailure(f"no answer from rank {peer} within {timeout:g} s ({TIMEOUT_ENV}): {first}") from exc
            raise PeerFailure(first) from exc
        if finished is False:
            who = f" from rank {peer}" if peer is not None else ""
            raise PeerFailure(f"no answer{who} within {timeout:g} s ({TIMEOUT_ENV} or Pipeline(timeout=...))")


def _timed_out(text: str) -> bool:
    return "timed out" in text.lower() or "timeout" in text.lower()


@dataclasses.dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a tied parameter and the group of ranks holding the other copies."""

    name: str  # canonical name
    local_name: str  # the alias this rank's stages hold
    group: dist.ProcessGroup
    source: int  # global rank whose copy wins at start


@dataclasses.dataclass(frozen=True)
class Groups:
    stage: dist.ProcessGroup | None  # this pipeline rank's replicas (all its stages), when dp > 1
    tied: tuple[TiedCopy, ...]
    replicas: tuple[int, ...] = ()  # global ranks of this pipeline rank's replicas, replica order


def make_groups(plan: Plan, rank: int) -> Groups:
    """This rank's replica group and tied-parameter groups (every rank creates all of them, in one order).

    With ``tp > 1`` tensor-parallel rank ``t`` of a group averages and ties with rank
    ``t`` of the others only (:mod:`runtime.parallel.tensorparallel`): they hold the same shards.
    """
    layout = plan.layout
    stage_group = None
    replicas = layout.ranks("dp", at=rank)
    if plan.dp > 1:
        for ranks in layout.groups("dp"):
            group = dist.new_group(list(ranks))
            if ranks == replicas:
                stage_group = group
    mine = {name for s in plan.stages_of(layout.coord(rank, "pp")) for name in plan.stages[s].parameters}
    tied: list[TiedCopy] = []
    for tie in plan.tied:
        # Pipeline ranks holding a copy, in the order of the stages holding it: one copy per rank.
        holders = list(dict.fromkeys(plan.stages[s].rank for s in tie.stages))
        if len(holders) < 2:
            continue
        for line in layout.groups("pp"):
            copies = [line[h] for h in holders]
            group = dist.new_group(copies)
            if rank in copies:
                tied.append(TiedCopy(tie.name, min(set(tie.aliases) & mine), group, copies[0]))
    return Groups(stage=stage_group, tied=tuple(tied), replicas=replicas)
