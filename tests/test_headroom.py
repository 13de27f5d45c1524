"""Spending a pipeline rank's exact memory headroom on recomputing less (partitioner/solve/headroom.py).

Checked: on random interleaved problems the pass only removes recomputation, never
lengthens the closed-form step, keeps every rank's exact peak within the GPU and
leaves no single further layer that would still fit (it stops only when stuck);
it changes nothing where the per-stage rule is already exact (one stage per rank)
or where a schedule never recomputes; and the planner's interleaved plan on a
real model recomputes less, fits its GPU by the simulator's own peak and is
faster than the same search without the pass.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import partitioner.search.planner as planner_module
from partitioner.modelfile import load_model_file
from partitioner.orders import stage_ranks
from partitioner.plan import Plan
from partitioner.search.planner import compile
from partitioner.solve.headroom import spend_rank_headroom
from partitioner.solve.problem import (
    PartitionProblem,
    StageRecompute,
    choose_recompute,
    rank_memory,
    recomputed_blocks,
    stage_rank_of,
    step_time,
    within_limit,
)

SPEC = str(Path(__file__).parent / "models" / "block_mlp.py")
INTERLEAVED = "interleaved-1f1b"


def _problem(rng: random.Random, *, ranks: int = 2, chunks: int = 2, layers_per_stage: int = 2,
             schedule: str = INTERLEAVED, cheap: bool = False) -> PartitionProblem:
    """One block per layer, random costs; with ``cheap``, per-op recomputation keeps about a third for a tenth."""
    n = ranks * chunks * layers_per_stage
    activation = tuple(rng.uniform(5.0, 15.0) for _ in range(n))
    kept = tuple(a / 5 for a in activation)
    again = tuple(rng.uniform(0.1, 0.4) for _ in range(n))
    return PartitionProblem(
        time_s=tuple(rng.uniform(0.5, 1.5) for _ in range(n)), static_bytes=(1.0,) * n, activation_bytes=activation,
        allreduce_s=(0.0,) * n, transfer_s=(0.0,) * n, edges=tuple((v, v + 1) for v in range(n - 1)),
        recompute_bytes=kept, recompute_s=again, recompute="auto", layer_start=(True,) * n,
        stage_rank=stage_ranks(schedule, ranks=ranks, chunks=chunks) if chunks > 1 else None,
        op_kept_bytes=tuple(k + 0.3 * a for k, a in zip(kept, activation)) if cheap else None,
        op_recompute_s=tuple(0.1 * t for t in again) if cheap else None)


def _with_limits(problem: PartitionProblem, stage_of: tuple[int, ...], stages: int, *, fraction: float,
                 microbatches: int, schedule: str) -> PartitionProblem:
    """The GPU's limit ``fraction`` of the way from recomputing everything to keeping everything (exact peaks),
    each stage capped at the GPU's share or, where the rule's choice under it does not fit, a larger cap."""
    kwargs = {"microbatches": microbatches, "schedule": schedule}
    full = max(rank_memory(problem, stage_of, stages, recompute=(True,) * stages, **kwargs))
    kept = max(rank_memory(problem, stage_of, stages, recompute=(False,) * stages, **kwargs))
    gpu = full + fraction * (kept - full)
    chunked = problem.stage_rank is not None
    share = gpu / problem.chunks
    # As the search does (layouts._solve_larger_caps): the least cap from the share up whose rule's choice fits.
    for cap in (share + i / 8 * (gpu - share) for i in range(9)):
        capped = PartitionProblem(**{**problem.__dict__, "memory_limit": cap,
                                     "rank_memory_limit": gpu if chunked else None})
        chosen = choose_recompute(capped, stage_of, stages, **kwargs)
        if all(within_limit(m, gpu) for m in rank_memory(capped, stage_of, stages, recompute=chosen, **kwargs)):
            return capped
    return capped


def _counts(recompute: tuple[StageRecompute, ...], stage_of: tuple[int, ...], stages: int) -> list[int]:
    redo = recomputed_blocks(stage_of, stages, recompute)
    return [sum(r for r, s in zip(redo, stage_of) if s == t) for t in range(stages)]


def _case(seed: int, *, cheap: bool) -> tuple[PartitionProblem, tuple[int, ...], int, dict[str, Any]]:
    rng = random.Random(seed)
    ranks, chunks, per = rng.choice([(2, 2, 2), (2, 3, 1), (3, 2, 2), (3, 1, 3)])
    schedule = INTERLEAVED if chunks > 1 else "1f1b"
    problem = _problem(rng, ranks=ranks, chunks=chunks, layers_per_stage=per, schedule=schedule, cheap=cheap)
    stages = ranks * chunks
    stage_of = tuple(v // per for v in range(problem.size))
    kwargs: dict[str, Any] = {"microbatches": ranks * rng.choice([2, 3]), "schedule": schedule}
    return _with_limits(problem, stage_of, stages, fraction=rng.uniform(0.1, 0.7), **kwargs), stage_of, stages, kwargs


@pytest.mark.parametrize("cheap", [False, True], ids=["layers", "cheap-ops"])
@pytest.mark.parametrize("seed", range(10))
def test_the_pass_never_slows_a_rank_fits_exactly_and_stops_only_when_stuck(seed: int, cheap: bool) -> None:
    problem, stage_of, stages, kwargs = _case(seed, cheap=cheap)
    limit = problem.rank_memory_limit if problem.rank_memory_limit is not None else problem.memory_limit
    start = choose_recompute(problem, stage_of, stages, **kwargs)
    recompute, ops = spend_rank_headroom(problem, stage_of, stages, recompute=start, **kwargs)

    def peaks(choice: tuple[StageRecompute, ...], cheap_blocks: tuple[int, ...]) -> list[float]:
        return rank_memory(problem, stage_of, stages, recompute=choice, ops=cheap_blocks, **kwargs)

    before = peaks(start, (0,) * stages)
    after = peaks(recompute, ops)
    times_before = step_time(problem, stage_of, recompute=start, **kwargs)[1]
    times_after = step_time(problem, stage_of, recompute=recompute, ops=ops, **kwargs)[1]
    assert cheap or not any(ops)
    for r, (b, a) in enumerate(zip(before, after)):
        if within_limit(b, limit):
            assert within_limit(a, limit), (r, a, limit)
    rank = stage_rank_of(problem, stages)
    for r in set(rank):  # every rank as fast as the rule made it, or faster (its time: its stages' sum)
        if within_limit(before[r], limit):
            assert sum(times_after[s] for s in range(stages) if rank[s] == r) <= \
                sum(times_before[s] for s in range(stages) if rank[s] == r) + 1e-12
    # Stuck: one layer (one block here) one tier further down does not fit its rank.
    counts = _counts(recompute, stage_of, stages)
    for s in range(stages):
        moves = []
        if counts[s]:
            moves.append((counts[s] - 1 or False, ops[s] + 1 if cheap else 0))
        if ops[s]:
            moves.append((counts[s] or False, ops[s] - 1))
        for whole, light in moves:
            trial_r = (*recompute[:s], whole, *recompute[s + 1:])
            trial_o = (*ops[:s], light, *ops[s + 1:])
            assert not within_limit(peaks(trial_r, trial_o)[rank[s]], limit) \
                or not within_limit(before[rank[s]], limit), (s, recompute, ops)


def test_headroom_and_cheap_ops_are_found_where_the_rule_leaves_them() -> None:
    """Across these problems the pass finds room the rule left (both tiers), and uses per-op recomputation."""
    relaxed = cheap_used = 0
    for seed in range(10):
        problem, stage_of, stages, kwargs = _case(seed, cheap=True)
        start = choose_recompute(problem, stage_of, stages, **kwargs)
        recompute, ops = spend_rank_headroom(problem, stage_of, stages, recompute=start, **kwargs)
        relaxed += recompute != start
        cheap_used += any(ops)
    assert relaxed >= 5 and cheap_used >= 5, (relaxed, cheap_used)


def test_one_stage_per_rank_without_cheap_ops_is_the_rule_exactly() -> None:
    """The rule (fewest leading layers that fit) is exact for one stage per rank: the pass agrees with it."""
    for seed in range(6):
        problem = _problem(random.Random(seed), ranks=2, chunks=1, layers_per_stage=4, schedule="1f1b")
        stage_of = tuple(v // 4 for v in range(problem.size))
        kwargs: dict[str, Any] = {"microbatches": 4, "schedule": "1f1b"}
        problem = _with_limits(problem, stage_of, 2, fraction=0.3, **kwargs)
        start = choose_recompute(problem, stage_of, 2, **kwargs)
        assert spend_rank_headroom(problem, stage_of, 2, recompute=start, **kwargs) == (start, (0, 0))


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_schedules_that_never_recompute_and_full_recomputation_asked_for_are_kept(schedule: str) -> None:
    problem, stage_of, _, kwargs = _case(1, cheap=True)
    asked = PartitionProblem(**{**problem.__dict__, "recompute": "full"})
    stages = max(stage_of) + 1
    assert spend_rank_headroom(asked, stage_of, stages, recompute=(True,) * stages, **kwargs) == \
        ((True,) * stages, (0,) * stages)
    split = spend_rank_headroom(problem, stage_of, stages, recompute=(False,) * stages,
                                microbatches=kwargs["microbatches"], schedule=schedule)  # type: ignore[arg-type]
    assert split == ((False,) * stages, (0,) * stages)


# ------------------------------------------------------------------ planner


def _plan(**kwargs: object) -> Plan:
    model_file = load_model_file(SPEC)
    torch.manual_seed(0)
    return compile(model_file.build(), model_file.example_inputs(2048), gpus=2, pp=2, dp=1, microbatches=8,
                   schedule=INTERLEAVED, chunks=2, device="h100", **kwargs)  # type: ignore[arg-type]


def test_the_planner_recomputes_less_within_each_ranks_exact_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    kept, full = (max(_plan(recompute=r).predicted.peak_memory_bytes) for r in ("none", "full"))
    limit = full + 0.2 * (kept - full)
    plan = _plan(recompute="auto", memory_per_gpu=limit)
    monkeypatch.setattr(planner_module, "spend_rank_headroom",
                        lambda p, s, n, *, recompute, **_: (tuple(recompute), (0,) * n))
    without = _plan(recompute="auto", memory_per_gpu=limit)

    def recomputed_s(p: Plan) -> float:
        return sum(s.predicted.recompute_s for s in p.stages)

    assert recomputed_s(plan) < recomputed_s(without)
    assert plan.predicted.step_s < without.predicted.step_s
    assert max(plan.predicted.peak_memory_bytes) <= limit
