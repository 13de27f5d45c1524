"""Selective (layer) recomputation: a stage recomputes only its first layers and keeps the others' activations.

Checked: the pricing (a partial stage's memory lies between keeping and recomputing
everything, its time adds only the recomputed blocks' forward); the rule picks the
fewest layers that fit; the interval DP reaches the brute-force optimum over every
split and every per-stage amount; the down-set DP and the ILP apply the rule to
their split and no longer claim a proof; the planner chooses a partial amount on a
real model where keeping does not fit and recomputing everything is not needed;
the plan records it (and a plan without the field still loads); the runtime
checkpoints only the planned layers (``Recomputed``, ZeRO-3's ``LayeredStage``) and
refuses a count the stage does not have.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import block_mlp
import pytest
import runtime_workers
import torch
from rank_workers import spawn_and_wait
from runtime_workers import reference_run
from torch import fx

from partitioner.errors import PlanFormatError, PlanMismatchError
from partitioner.graph.capture import capture
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan, example_plan
from partitioner.report.table import format_plan, recompute_summary
from partitioner.search.planner import compile
from partitioner.solve.ilp import solve, solve_ilp
from partitioner.solve.interval import down_sets, solve_down_sets, solve_intervals
from partitioner.solve.problem import (
    PartitionProblem,
    ScheduleKind,
    choose_recompute,
    recomputed_blocks,
    stage_costs,
    stage_memory,
    step_time,
    within_limit,
)
from partitioner.stagegraph import build_stage, stage_signature
from runtime.execute.recompute import Recomputed, block_nodes
from runtime.parallel.shard import LayeredStage
from runtime.verify import free_port

SPEC = str(Path(__file__).parent / "models" / "block_mlp.py")
STEPS = 3
LR = 0.1
TOLERANCE = 1e-5  # fp32, against the whole model in one process


def _layers(limit: float | None = None, *, blocks: int = 4) -> PartitionProblem:
    """``blocks`` layers of one block each: 10 activation bytes, 2 kept when recomputed, 1 s (0.25 s forward)."""
    return PartitionProblem(
        time_s=(1.0,) * blocks, static_bytes=(5.0,) * blocks, activation_bytes=(10.0,) * blocks,
        allreduce_s=(0.0,) * blocks, transfer_s=(0.0,) * blocks,
        edges=tuple((v, v + 1) for v in range(blocks - 1)), memory_limit=limit,
        recompute_bytes=(2.0,) * blocks, recompute_s=(0.25,) * blocks, recompute="auto",
        layer_start=(True,) * blocks)


# ------------------------------------------------------------------ pricing


def test_a_partial_stage_costs_between_keeping_and_recomputing_everything() -> None:
    p = _layers()
    memory = {r: stage_memory(p, (0,) * 4, 1, microbatches=3, schedule="gpipe", recompute=(r,))[0]
              for r in (False, 2, True)}
    # Keep: 20 + 3 x 40.  First two layers: 20 + 3 x (2 + 2 + 10 + 10) + 10 (one layer live again).  All: 20 + 3 x 8 + 10.
    assert memory == {False: 140.0, 2: 102.0, True: 54.0}
    times = {r: stage_costs(p, (0,) * 4, 1, recompute=(r,))[0][0] for r in (False, 2, True)}
    assert times == {False: 4.0, 2: 4.5, True: 5.0}
    assert recomputed_blocks((0, 0, 0, 0), 1, (2,)) == [True, True, False, False]


def test_the_rule_takes_the_fewest_layers_that_fit() -> None:
    # In flight 3 (gpipe): 1 layer 20 + 3 x 32 + 10 = 126, 2 layers 102, 3 layers 78, all 54.
    for limit, want in ((140.0, False), (130.0, 1), (102.0, 2), (90.0, 3), (60.0, True), (50.0, False)):
        assert choose_recompute(_layers(limit), (0,) * 4, 1, microbatches=3, schedule="gpipe") == (want,), limit
    # Only where a layer starts: block 1 continues block 0's layer, so one block alone is no option.
    halves = dataclasses.replace(_layers(130.0), layer_start=(True, False, True, False))
    assert choose_recompute(halves, (0,) * 4, 1, microbatches=3, schedule="gpipe") == (2,)
    # Without layer starts (hand-made costs, the old behaviour): all or nothing.
    whole = dataclasses.replace(_layers(130.0), layer_start=None)
    assert choose_recompute(whole, (0,) * 4, 1, microbatches=3, schedule="gpipe") == (True,)


def test_the_interval_dp_recomputes_part_of_a_stage_when_all_is_not_needed() -> None:
    """Two stages under 1F1B, limit 45: stage 0 holds 2 micro-batches, stage 1 one.

    {0, 1} | {2, 3}: stage 0 keeps 10 + 2 x 20 = 50, recomputes its first layer in 10 + 2 x 12 + 10 = 44
    (2.25 s), stage 1 keeps 30 (2 s): 4.25 + 3 x 2.25 = 11.  All or nothing, the best is 12 (stage 0
    recomputing both layers, 2.5 s); {0} | {1, 2, 3} keeps everywhere in 13.
    """
    p = _layers(45.0)
    part = solve_intervals(p, stages=2, microbatches=4, schedule="1f1b")
    assert part is not None
    assert part.stage_of == (0, 0, 1, 1) and part.recompute == (1, False) and part.objective == 11.0
    before = solve_intervals(dataclasses.replace(p, layer_start=None), stages=2, microbatches=4, schedule="1f1b")
    assert before is not None and before.objective == 12.0 and before.recompute == (True, False)


def _brute(problem: PartitionProblem, stages: int, microbatches: int, schedule: ScheduleKind) -> float:
    """The least step over every contiguous split and every per-stage amount (cut at a layer start) that fits."""
    n, best = problem.size, float("inf")
    assert problem.layer_start is not None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        stage_of = tuple(s for s in range(stages) for _ in range(bounds[s], bounds[s + 1]))
        options = []
        for s in range(stages):
            members = range(bounds[s], bounds[s + 1])
            options.append([False, True, *(i for i, v in enumerate(members) if i and problem.layer_start[v])])
        for choice in itertools.product(*options):
            memory = stage_memory(problem, stage_of, stages, microbatches=microbatches, schedule=schedule,
                                  recompute=choice)
            if all(within_limit(m, problem.memory_limit) for m in memory):
                best = min(best, step_time(problem, stage_of, microbatches=microbatches, schedule=schedule,
                                           recompute=choice)[0])
    return best


@pytest.mark.parametrize("seed", range(12))
def test_interval_dp_matches_brute_force_over_partial_amounts(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(4, 7)
    activation = tuple(float(rng.randint(4, 20)) for _ in range(n))
    problem = PartitionProblem(
        time_s=tuple(float(rng.randint(1, 6)) for _ in range(n)),
        static_bytes=tuple(float(rng.randint(0, 8)) for _ in range(n)),
        activation_bytes=activation, allreduce_s=(0.0,) * n,
        transfer_s=tuple(rng.choice((0.0, 0.5)) for _ in range(n)),
        edges=tuple((v, v + 1) for v in range(n - 1)),
        recompute_bytes=tuple(float(rng.randint(1, 3)) for _ in range(n)),
        recompute_s=tuple(rng.choice((0.25, 0.5, 1.0)) for _ in range(n)),
        recompute_peak_bytes=tuple(a + rng.randint(0, 4) for a in activation),
        recompute="auto", layer_start=(False, *(rng.random() < 0.7 for _ in range(n - 1))))
    kinds: tuple[ScheduleKind, ...] = ("gpipe", "1f1b")
    stages, m, kind = rng.randint(2, 3), rng.choice((2, 4)), rng.choice(kinds)
    keep = max(stage_memory(problem, tuple(min(v * stages // n, stages - 1) for v in range(n)), stages,
                            microbatches=m, schedule=kind, recompute=(False,) * stages))
    problem = dataclasses.replace(problem, memory_limit=keep * rng.uniform(0.45, 0.9))
    want = _brute(problem, stages, m, kind)
    got = solve_intervals(problem, stages=stages, microbatches=m, schedule=kind)
    if want == float("inf"):
        assert got is None
        return
    assert got is not None and got.objective == pytest.approx(want, rel=1e-9), (got, want)
    assert got.recompute == choose_recompute(problem, got.stage_of, stages, microbatches=m, schedule=kind)


def test_down_set_dp_and_ilp_apply_the_rule_and_claim_no_proof() -> None:
    p = _layers(45.0)
    member = down_sets(p, limit=100)
    assert member is not None
    for part in (solve_down_sets(p, member, stages=2, microbatches=4, schedule="1f1b"),
                 solve_ilp(p, stages=2, microbatches=4, schedule="1f1b")):
        assert part is not None
        rule = choose_recompute(p, part.stage_of, 2, microbatches=4, schedule="1f1b")
        assert part.recompute == rule and any(r is not True and r is not False for r in rule)
        assert part.status == "feasible" and part.lower_bound <= part.objective
        assert part.objective == pytest.approx(step_time(p, part.stage_of, microbatches=4, schedule="1f1b")[0])
    assert solve(p, stages=2, microbatches=4, schedule="1f1b", use_ilp=True) is not None


# ------------------------------------------------------------------ planner and plan


def _plan(directory: Path | None = None, **kwargs: object) -> Plan:
    model_file = load_model_file(SPEC)
    torch.manual_seed(0)
    plan = compile(model_file.build(), model_file.example_inputs(8), gpus=2, pp=2, dp=1, microbatches=4,
                   schedule="1f1b", device="h100", **kwargs)  # type: ignore[arg-type]
    if directory is not None:
        plan.save(directory)
    return plan


def selective_plan(directory: Path | None = None) -> Plan:
    """block_mlp on 2 stages with a memory limit that keeping does not meet and full recomputation beats by far."""
    kept, full = (_plan(recompute=r).stages[0].predicted.memory_bytes for r in ("none", "full"))
    return _plan(directory, recompute="auto", memory_per_gpu=full + 0.8 * (kept - full))


def test_planner_chooses_a_partial_amount_when_all_is_not_needed() -> None:
    kept, full = _plan(recompute="none"), _plan(recompute="full")
    plan = selective_plan()
    first = plan.stages[0]
    assert first.recompute == "selective" and first.recompute_layers >= 1, first
    # Fewer than the layers the runtime finds in the stage graph it builds from the plan.
    captured = capture(block_mlp.build_model(), block_mlp.example_inputs(4))
    signature = stage_signature(first, model_outputs=plan.model.outputs, last=False)
    stage = Recomputed(build_stage(captured, first.nodes, signature, statics={}), layers=first.recompute_layers)
    assert 0 < stage.recomputed < stage.blocks
    predicted = first.predicted
    assert full.stages[0].predicted.memory_bytes < predicted.memory_bytes < kept.stages[0].predicted.memory_bytes
    assert 0 < predicted.recompute_s < full.stages[0].predicted.recompute_s
    assert plan.predicted.step_s < full.predicted.step_s
    assert f"first {first.recompute_layers} run" in format_plan(plan) and "selective" in recompute_summary(plan)


def test_plan_records_selective_and_old_plans_load(tmp_path: Path) -> None:
    plan = selective_plan(tmp_path)
    again = Plan.load(tmp_path)
    assert again.stages[0].recompute == "selective" and again.stages[0] == plan.stages[0]
    data = json.loads(example_plan().to_json())
    for st in data["stages"]:
        del st["recompute_layers"]  # saved before selective recomputation existed
    data["stages"][0]["recompute"] = "full"
    old = Plan.from_json(json.dumps(data))
    assert [(s.recompute, s.recompute_layers) for s in old.stages] == [("full", 0), ("none", 0)]
    for recompute, layers in (("selective", 0), ("full", 2), ("none", 1), ("selective", -1)):
        data["stages"][0].update(recompute=recompute, recompute_layers=layers)
        with pytest.raises(PlanFormatError, match="recompute_layers"):
            Plan.from_json(json.dumps(data))


# ------------------------------------------------------------------ runtime


def _saved_bytes(module: torch.nn.Module, gm: fx.GraphModule) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps from forward to backward (parameters excluded), and the gradients."""
    inputs, target = block_mlp.example_inputs(8), block_mlp.example_target(8)
    weights = {p.untyped_storage().data_ptr() for p in gm.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = block_mlp.loss_fn(module(*inputs)[0], target)
    return sum(kept.values()), list(torch.autograd.grad(loss, list(gm.parameters())))


@pytest.mark.parametrize("wrap", [lambda gm, n: Recomputed(gm, layers=n),
                                  lambda gm, n: LayeredStage(gm, recompute=n)], ids=["Recomputed", "LayeredStage"])
def test_runtime_checkpoints_only_the_first_layers(wrap: Callable[[fx.GraphModule, int], torch.nn.Module]) -> None:
    gm = capture(block_mlp.build_model(), block_mlp.example_inputs(8)).graph_module
    count = len(block_nodes(gm))
    plain, grads = _saved_bytes(gm, gm)
    saved = {n: _saved_bytes(wrap(gm, n), gm) for n in (2, 4, count)}  # embed, blocks.0 | blocks.1, 2 | ...
    assert plain > saved[2][0] > saved[4][0] > saved[count][0], (plain, {n: s for n, (s, _) in saved.items()})
    for _, got in saved.values():
        assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))
    with pytest.raises(PlanMismatchError, match="recomputes 9 layers of a stage that has"):
        wrap(gm, count + 2)


@pytest.mark.slow  # spawns ranks; test_runtime_checkpoints_only_the_first_layers checks the numbers in-process
def test_selective_pipeline_trains_like_the_whole_model(tmp_path: Path) -> None:
    """pp=2 under 1F1B, fp32: stage 0 recomputes some of its layers, not all; 3 steps against one process."""
    plan = selective_plan(tmp_path)
    assert plan.stages[0].recompute == "selective" and plan.schedule == "1f1b"
    out = tmp_path / "out"
    out.mkdir()
    codes = spawn_and_wait(
        runtime_workers.train_worker, 2, (2, free_port(), str(tmp_path), SPEC, str(out), {"steps": STEPS, "lr": LR}),
        limit_s=120)
    assert codes == [0, 0], f"rank exit codes {codes}"
    ranks: list[dict[str, Any]] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert "Recomputed" in ranks[0]["runtime_modules"]
    want = reference_run(SPEC, dp=1, microbatches=plan.microbatches, steps=STEPS, lr=LR)
    last = next(r for r in ranks if r["losses"][0] is not None)
    for a, b in zip(last["losses"], want["losses"], strict=True):
        assert abs(a - b) <= TOLERANCE
    for rank, r in enumerate(ranks):
        for name, value in r["state"].items():
            diff = float((value - want["state"][name]).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"
