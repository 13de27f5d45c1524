"""Chunked schedules over any DAG of stages: skip connections to non-adjacent later stages (issue 18, 2b).

* Lowering: U-Net-like graphs of stages (stage 0 -> 3 and 1 -> 2 on 2 ranks,
  interleaved and in a V) and random DAGs (fixed seeds) lower and dry-run
  without deadlock for every kind, rank count and many micro-batch counts.
* Runtime: a rank takes a peer's messages in its own order, but posts their
  receives in the order the peer sends them.  An in-memory communicator that
  pairs messages by order alone, as NCCL does, runs examples/cnn.py's plans
  in one process (a thread per rank) and matches the whole model.
* Planner: ``--schedule auto`` weighs every chunked schedule for the CNN, and
  a schedule whose plans cannot run is dropped with its reason (and refused,
  naming schedules that run, when fixed).
* Spawned gloo ranks (slow): examples/cnn.py planned with interleaved-1f1b and
  zbv on 2 ranks passes ``runtime.verify``.
"""

from __future__ import annotations

import datetime
import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from chunked import plan_schedule  # type: ignore[import-not-found]  # tests/models, on sys.path
from inprocess import assert_matches_whole_model  # type: ignore[import-not-found]

import partitioner.search.assemble
from partitioner import compile
from partitioner.errors import AutopartitionError, ScheduleError
from partitioner.graph.ir import dtype_from_name
from partitioner.modelfile import load_model_file
from partitioner.orders import Schedule, stage_ranks
from partitioner.plan import Plan
from partitioner.schedule.lower import compute_order, lower, validate
from runtime.execute.comm import RecvSpec, Work
from runtime.execute.runner import StepRunner
from runtime.execute.stage import build_local_stages, call_spec

CNN = str(Path(__file__).parent.parent / "examples" / "cnn.py")
TOLERANCE = 1e-5
_KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("interleaved-1f1b", 4),
          ("zb-h1", 1), ("zbv", 2)]


def _topology(stages: int, edges: Sequence[tuple[int, int]]) -> dict[str, Any]:
    return {
        "sends_to": tuple(tuple(sorted({b for a, b in edges if a == s})) for s in range(stages)),
        "receives_from": tuple(tuple(sorted({a for a, b in edges if b == s})) for s in range(stages)),
    }


def _lower_and_validate(kind: str, ranks: int, chunks: int, microbatches: int, edges: Sequence[tuple[int, int]]
                        ) -> Schedule:
    topology = dict(_topology(ranks * chunks, edges), stage_rank=stage_ranks(kind, ranks=ranks, chunks=chunks))
    order = compute_order(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    sched = lower(order, kind=kind, **topology)
    validate(sched, **topology)
    return sched


def _unet(stages: int) -> list[tuple[int, int]]:
    """A chain with U-Net skips: stage s also feeds stage ``stages - 1 - s`` (0 -> 3 and 1 -> 2 for 4)."""
    return [(s, s + 1) for s in range(stages - 1)] + [(s, stages - 1 - s) for s in range(stages // 2)]


def _random_dag(stages: int, rng: random.Random) -> list[tuple[int, int]]:
    """Stages in topological order: some chain edges, some skips, every stage after 0 fed."""
    edges = {(s, s + 1) for s in range(stages - 1) if rng.random() < 0.85}
    edges |= {(a, b) for a in range(stages) for b in range(a + 2, stages) if rng.random() < 0.3}
    edges |= {(t - 1, t) for t in range(1, stages) if not any(b == t for _, b in edges)}
    return sorted(edges)


# ------------------------------------------------------------------ lowering


@pytest.mark.parametrize(("kind", "ranks", "chunks"), [
    ("interleaved-1f1b", 2, 2), ("zbv", 2, 2), ("interleaved-1f1b", 3, 2), ("zbv", 3, 2), ("interleaved-1f1b", 2, 4),
    ("interleaved-1f1b", 4, 2), ("zbv", 4, 2),
])
def test_unet_skips_lower_without_deadlock(kind: str, ranks: int, chunks: int) -> None:
    # Interleaved on 2 ranks used to deadlock here ("rank 0 waits at 2RF1"): stage 3 takes stage 0's
    # and stage 2's outputs in one receive, which rank 0 sends around stage 0's next micro-batch.
    edges = _unet(ranks * chunks)
    for microbatches in range(1, 4 * ranks + 1):
        if kind == "interleaved-1f1b" and microbatches % ranks:
            continue
        _lower_and_validate(kind, ranks, chunks, microbatches, edges)


def test_unet_receives_stay_before_their_compute() -> None:
    # Interleaved U-Net, 2 ranks, 4 micro-batches: every receive sits right before the compute that
    # needs it and every send right after the one that makes it.
    sched = _lower_and_validate("interleaved-1f1b", 2, 2, 4, _unet(4))
    for row in sched.to_strings():
        for k, a in enumerate(row):
            if "R" in a:
                assert row[k + 1] == a.replace("RF", "F").replace("RB", "B"), row
            if "S" in a:
                assert row[k - 1] == a.replace("SF", "F").replace("SB", "B"), row


@pytest.mark.parametrize("seed", range(12))
def test_random_dags_of_stages_lower_for_every_kind(seed: int) -> None:
    rng = random.Random(seed)
    for kind, chunks in _KINDS:
        for ranks in (1, 2, 3, 4) if chunks < 4 else (2,):
            edges = _random_dag(ranks * chunks, rng)
            for microbatches in sorted({1, ranks, 2 * ranks, 2 * ranks + 1, 3 * ranks}):
                if kind == "interleaved-1f1b" and microbatches % ranks:
                    continue
                try:
                    _lower_and_validate(kind, ranks, chunks, microbatches, edges)
                except ScheduleError as exc:
                    raise AssertionError(f"{kind} x{chunks}, {ranks} ranks, M={microbatches}, edges {edges}: "
                                         f"{exc}") from exc


def test_chain_lowering_is_unchanged() -> None:
    # A chain in a V still takes rank 0's messages in its send order (1RF2 moved up before 2RB0).
    sched = _lower_and_validate("zbv", 2, 2, 3, [(0, 1), (1, 2), (2, 3)])
    row = sched.to_strings()[1]
    assert row.index("1RF2") < row.index("2RB0") < row.index("1F2")


# ------------------------------------------------------------------ runtime


class _Slot:
    """One posted receive of one tensor: the ``index``-th the pair's receiver posted."""

    def __init__(self, pair: _Pair, index: int, tag: int, buffer: torch.Tensor) -> None:
        self._pair, self._index, self._tag, self._buffer = pair, index, tag, buffer

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> bool:
        with self._pair.ready:
            if not self._pair.ready.wait_for(lambda: len(self._pair.sent) > self._index, timeout.total_seconds()):
                return False
            tag, got = self._pair.sent[self._index]
        if tag != self._tag or got.shape != self._buffer.shape or got.dtype != self._buffer.dtype:
            raise RuntimeError(f"receive #{self._index + 1} (tag {self._tag}, {tuple(self._buffer.shape)}) paired "
                               f"with send #{self._index + 1} (tag {tag}, {tuple(got.shape)}): posted out of order")
        self._buffer.copy_(got)
        return True


class _Done:
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> bool:
        return True


class _Pair:
    def __init__(self) -> None:
        self.ready = threading.Condition()
        self.sent: list[tuple[int, torch.Tensor]] = []
        self.posted = 0


class _OrderComm:
    """Pairs the k-th receive a rank posts from a peer with the k-th tensor that peer sends it, as NCCL does."""

    def __init__(self, rank: int, pairs: dict[tuple[int, int], _Pair], lock: threading.Lock) -> None:
        self._rank, self._pairs, self._lock = rank, pairs, lock

    def _pair(self, src: int, dst: int) -> _Pair:
        with self._lock:
            return self._pairs.setdefault((src, dst), _Pair())

    def send_tensors(self, tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]:
        pair = self._pair(self._rank, peer)
        with pair.ready:
            pair.sent += [(tag, t.detach().clone()) for t in tensors]
            pair.ready.notify_all()
        return [_Done()]

    def post_recv(self, specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device
                  ) -> tuple[list[torch.Tensor], list[Work]]:
        pair = self._pair(peer, self._rank)
        out = [torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device=device) for s in specs]
        works: list[Work] = []
        for t in out:
            with pair.ready:
                works.append(_Slot(pair, pair.posted, tag, t))
                pair.posted += 1
        return out, works


def _run_in_order_comm(plan: Plan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of every pipeline rank in threads over :class:`_OrderComm`: (loss, gradients by name)."""
    mf = load_model_file(CNN)
    assert mf.loss_fn is not None and mf.example_target is not None
    inputs, target = mf.example_inputs(plan.batch_size), mf.example_target(plan.batch_size)
    flat, size = call_spec(plan).flatten(inputs), plan.microbatch_size
    micro = [(tuple(x[m * size:(m + 1) * size] for x in flat), target[m * size:(m + 1) * size])
             for m in range(plan.microbatches)]
    pairs: dict[tuple[int, int], _Pair] = {}
    lock = threading.Lock()
    runners = []
    for rank in range(plan.pp):
        stages = build_local_stages(plan, mf.build(), plan.stages_of(rank))
        runners.append(StepRunner(plan, stages, [s.module for s in stages], replica=0, rank=rank,
                                  loss_fn=mf.loss_fn, device=torch.device("cpu"), timeout=15.0,
                                  comm=_OrderComm(rank, pairs, lock)))
    with ThreadPoolExecutor(max_workers=plan.pp) as pool:
        results = [f.result() for f in [pool.submit(r.run, micro, record=False) for r in runners]]
    assert all(len(p.sent) == p.posted for p in pairs.values()), "a tensor was sent but never received"
    grads: dict[str, torch.Tensor] = {}
    for runner in runners:
        for stage in runner.local_stages:
            for name, p in stage.module.named_parameters():
                if p.grad is not None:
                    grads[stage.captured.parameter_names.get(name, name)] = p.grad
    loss = results[plan.stages[-1].rank]
    assert loss is not None
    return loss, grads


def _receives_out_of_send_order(plan: Plan) -> bool:
    """Does some rank take one peer's messages in another order than the peer sends them?"""
    where, rows = plan.stage_ranks(), plan.schedule_data().actions
    out_to = [sorted({b.target for b in st.outputs if where[b.target] != where[st.index]}) for st in plan.stages]
    in_from = [sorted({b.source for b in st.inputs if where[b.source] != where[st.index]}) for st in plan.stages]
    sent: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    taken: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    for row in rows:
        for a in row:
            s, i = a.stage, a.microbatch
            found = {"SF": [("F", s, t, i) for t in out_to[s]], "SB": [("B", s, p, i) for p in in_from[s]],
                     "RF": [("F", p, s, i) for p in in_from[s]], "RB": [("B", t, s, i) for t in out_to[s]]}
            for m in found.get(a.kind, []):
                into = sent if a.kind in ("SF", "SB") else taken
                into.setdefault((where[m[1]], where[m[2]]), []).append(m)
    return any(taken[pair] != messages for pair, messages in sent.items())


@pytest.mark.parametrize(("schedule", "chunks"), [
    ("interleaved-1f1b", 2),
    pytest.param("zbv", 2, marks=pytest.mark.slow),  # its runtime path is the interleaved one's
])
def test_cnn_runs_in_process_over_order_paired_messages(tmp_path: Path, schedule: str, chunks: int) -> None:
    plan = plan_schedule(CNN, tmp_path, ranks=2, chunks=chunks, microbatches=4, schedule=schedule, batch=8)
    skips = {(b.source, b.target) for st in plan.stages for b in st.inputs if b.target - b.source > 1}
    assert skips, "the CNN's long skip should cross stages"
    if schedule == "interleaved-1f1b":  # stage 3 takes stages 0 and 2's outputs (rank 0) in one receive
        assert _receives_out_of_send_order(plan)

    loss, grads = _run_in_order_comm(plan)

    mf = load_model_file(CNN)
    assert mf.loss_fn is not None and mf.example_target is not None
    inputs, target = mf.example_inputs(plan.batch_size), mf.example_target(plan.batch_size)
    assert_matches_whole_model(plan, mf.build, inputs, target, mf.loss_fn, (loss, grads), tolerance=TOLERANCE)


# ------------------------------------------------------------------ planner


def test_auto_weighs_every_chunked_schedule_for_the_cnn() -> None:
    mf = load_model_file(CNN)
    torch.manual_seed(0)
    plan = compile(mf.build(), mf.example_inputs(8), gpus=2, pp=2, dp=1, microbatches=4, schedule="auto",
                   device="h100")
    fates = {(c.schedule, c.chunks or 1): (c.status, c.note) for c in plan.candidates}
    assert fates[("interleaved-1f1b", 2)][0] in ("optimal", "feasible"), fates  # was skipped: "cannot order"
    assert fates[("zbv", 2)][0] in ("optimal", "feasible"), fates
    assert not any("cannot order" in note for _, note in fates.values()), fates


def test_a_schedule_that_cannot_run_is_dropped_and_refused_naming_ones_that_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Should a chunked schedule's plan ever fail validation, auto drops it with the reason in the
    # candidate table, and a fixed schedule is refused naming the schedules that always run.
    build = partitioner.search.assemble.build_plan

    def refuse_zbv(*args: Any, **kwargs: Any) -> Plan:
        solved = args[4]
        if solved.schedule == "zbv":
            raise ScheduleError("The schedule deadlocks: (injected)")
        return build(*args, **kwargs)

    monkeypatch.setattr(partitioner.search.assemble, "build_plan", refuse_zbv)
    mf = load_model_file(str(Path(__file__).parent / "models" / "mlp.py"))
    torch.manual_seed(0)
    plan = compile(mf.build(), mf.example_inputs(8), gpus=2, pp=2, dp=1, microbatches=4, schedule="auto",
                   device="h100")
    assert plan.schedule != "zbv"
    zbv = [c for c in plan.candidates if c.schedule == "zbv"]
    assert zbv and all(c.status == "skipped" and "cannot order" in c.note and "injected" in c.note for c in zbv)
    with pytest.raises(AutopartitionError, match=r"zbv could not order(.|\n)*--schedule 1f1b or gpipe"):
        compile(mf.build(), mf.example_inputs(8), gpus=2, pp=2, dp=1, microbatches=4, schedule="zbv",
                device="h100")


# ------------------------------------------------------------------ spawned ranks


@pytest.mark.slow
@pytest.mark.exhaustive  # tests/test_model_matrix.py's cnn row and cells on ranks
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_cnn_with_a_long_skip_verifies_on_two_gloo_ranks(tmp_path: Path, schedule: str) -> None:
    from runtime.verify import verify

    plan_schedule(CNN, tmp_path, ranks=2, chunks=2, microbatches=4, schedule=schedule, batch=8)
    result = verify(tmp_path, CNN, steps=2, timeout=120.0)
    assert result.ok, result.report()
