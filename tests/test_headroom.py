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
    step_time,
    within_limit,
)

SPEC = str(Path(__file__).parent / "models" / "block_mlp.py")
INTERLEAVED = "interleaved-1f1b"


def _problem(rng: random.Random, *, ranks: int = 2, chunks: int = 2, layers_per_stage: int = 2,
             schedule: str = INTERLEAVED) -> PartitionProblem:
    """One block per layer, random costs; each stage capped at half the GPU, the GPU somewhere in between."""
    n = ranks * chunks * layers_per_stage
    activation = tuple(rng.uniform(5.0, 15.0) for _ in range(n))
    problem = PartitionProblem(
        time_s=tuple(rng.uniform(0.5, 1.5) for _ in range(n)), static_bytes=(1.0,) * n, activation_bytes=activation,
        allreduce_s=(0.0,) * n, transfer_s=(0.0,) * n, edges=tuple((v, v + 1) for v in range(n - 1)),
        recompute_bytes=tuple(a / 5 for a in activation), recompute_s=tuple(rng.uniform(0.1, 0.4) for _ in range(n)),
        recompute="auto", layer_start=(True,) * n,
        stage_rank=stage_ranks(schedule, ranks=ranks, chunks=chunks) if chunks > 1 else None)
    return problem


def _with_limits(problem: PartitionProblem, stage_of: tuple[int, ...], stages: int, *, fraction: float,
                 microbatches: int, schedule: str) -> PartitionProblem:
    """The GPU's limit ``fraction`` of the way from recomputing everything to keeping everything (exact peaks),
    each stage capped at the GPU's share or, where the rule's choice under it does not fit, a larger cap."""
    kwargs = {"microbatches": microbatches, "schedule": schedule}
    full = max(rank_memory(problem, stage_of, stages, recompute=(True,) * stages, **kwargs))
    kept = max(rank_memory(problem, stage_of, stages, recompute=(False,) * stages, **kwargs))
    gpu = full + fraction * (kept - full)
    share = gpu / (problem.chunks if problem.stage_rank is not None else 1)
    # As the search does (layouts._solve_larger_caps): the least cap from the share up whose rule's choice fits.
    for cap in (share + i / 8 * (gpu - share) for i in range(9)):
        capped = PartitionProblem(**{**problem.__dict__, "memory_limit": cap, "rank_memory_limit": gpu})
        chosen = choose_recompute(capped, stage_of, stages, **kwargs)
        if all(within_limit(m, gpu) for m in rank_memory(capped, stage_of, stages, recompute=chosen, **kwargs)):
            return capped
    return capped


def _counts(recompute: tuple[StageRecompute, ...], stage_of: tuple[int, ...], stages: int) -> list[int]:
    redo = recomputed_blocks(stage_of, stages, recompute)
    return [sum(r for r, s in zip(redo, stage_of) if s == t) for t in range(stages)]


@pytest.mark.parametrize("seed", range(12))
def test_the_pass_only_removes_recomputation_fits_exactly_and_stops_only_when_stuck(seed: int) -> None:
    rng = random.Random(seed)
    ranks, chunks, per = rng.choice([(2, 2, 2), (2, 3, 1), (3, 2, 2)])
    problem = _problem(rng, ranks=ranks, chunks=chunks, layers_per_stage=per)
    stages = ranks * chunks
    stage_of = tuple(v // per for v in range(problem.size))
    kwargs = {"microbatches": rng.choice([4, 6, 8]) if ranks == 2 else 6, "schedule": INTERLEAVED}
    problem = _with_limits(problem, stage_of, stages, fraction=rng.uniform(0.1, 0.7), **kwargs)
    start = choose_recompute(problem, stage_of, stages, **kwargs)
    relaxed = spend_rank_headroom(problem, stage_of, stages, recompute=start, **kwargs)

    def fits(recompute: tuple[StageRecompute, ...]) -> bool:
        return all(within_limit(m, problem.rank_memory_limit)
                   for m in rank_memory(problem, stage_of, stages, recompute=recompute, **kwargs))

    if not fits(start):  # a stage the share cannot hold even recomputed: nothing to spend
        assert relaxed == start
        return
    assert fits(relaxed)
    assert all(a <= b for a, b in zip(_counts(relaxed, stage_of, stages), _counts(start, stage_of, stages)))
    assert step_time(problem, stage_of, recompute=relaxed, **kwargs)[0] <= \
        step_time(problem, stage_of, recompute=start, **kwargs)[0] + 1e-12
    # Stuck: no stage can keep one more layer (one block each here) and still fit.
    counts = _counts(relaxed, stage_of, stages)
    for s in range(stages):
        if counts[s] == 0:
            continue
        fewer: StageRecompute = counts[s] - 1 or False
        assert not fits((*relaxed[:s], fewer, *relaxed[s + 1:])), (s, relaxed)


def test_headroom_is_spent_where_the_share_is_too_tight() -> None:
    """In 5 of these 12 problems the stage rule recomputes what the rank could keep: the pass finds it."""
    changed = 0
    for seed in range(12):
        rng = random.Random(seed)
        problem = _problem(rng)
        stage_of = tuple(v // 2 for v in range(problem.size))
        kwargs = {"microbatches": 4, "schedule": INTERLEAVED}
        problem = _with_limits(problem, stage_of, 4, fraction=0.4, **kwargs)
        start = choose_recompute(problem, stage_of, 4, **kwargs)
        changed += spend_rank_headroom(problem, stage_of, 4, recompute=start, **kwargs) != start
    assert changed >= 4


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_stage_per_rank_is_left_as_the_rule_chose(schedule: str) -> None:
    problem = _problem(random.Random(0), chunks=1, layers_per_stage=4, schedule=schedule)
    stage_of = tuple(v // 4 for v in range(problem.size))
    kwargs = {"microbatches": 4, "schedule": schedule}
    problem = _with_limits(problem, stage_of, 2, fraction=0.3, **kwargs)
    start = choose_recompute(problem, stage_of, 2, **kwargs)
    assert any(start)
    assert spend_rank_headroom(problem, stage_of, 2, recompute=start, **kwargs) == start


def test_full_recomputation_asked_for_is_kept() -> None:
    problem = _problem(random.Random(1))
    stage_of = tuple(v // 2 for v in range(problem.size))
    kwargs = {"microbatches": 4, "schedule": INTERLEAVED}
    problem = _with_limits(problem, stage_of, 4, fraction=0.9, **kwargs)
    asked = PartitionProblem(**{**problem.__dict__, "recompute": "full"})
    assert spend_rank_headroom(asked, stage_of, 4, recompute=(True,) * 4, **kwargs) == (True,) * 4


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
    monkeypatch.setattr(planner_module, "spend_rank_headroom", lambda p, s, n, *, recompute, **_: tuple(recompute))
    without = _plan(recompute="auto", memory_per_gpu=limit)

    def recomputed_s(p: Plan) -> float:
        return sum(s.predicted.recompute_s for s in p.stages)

    assert recomputed_s(plan) < recomputed_s(without)
    assert plan.predicted.step_s < without.predicted.step_s
    assert max(plan.predicted.peak_memory_bytes) <= limit
