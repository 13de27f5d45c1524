"""Simulation-guided refinement (:mod:`partitioner.schedule.refine`) and its use by the planner.

* the fast replay gives the step :func:`~partitioner.schedule.simulate.simulate_schedule`
  gives, on random schedules, topologies and times;
* refinement never makes a split worse in simulation, keeps it valid
  (:func:`~partitioner.solve.problem.check_assignment`) and within memory, on random
  problems (chains and DAGs, replicas, nodes, recomputation);
* on a chain with a heavy cross-node transfer, where the closed form mis-ranks
  splits, the refined split simulates faster than the solver's;
* the planner records the refinement in the plan, and an older version-2 plan
  without that record still loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import _brute
import pytest

from partitioner.defaults import splits_backward
from partitioner.orders import stage_ranks
from partitioner.plan import Plan, Refinement, example_plan
from partitioner.schedule.lower import compute_order, lower
from partitioner.schedule.refine import (
    SplitSimulator,
    StepModel,
    _replay,
    _Stages,
    compile_rows,
    refine_split,
    shift_boundary,
)
from partitioner.schedule.simulate import simulate_schedule
from partitioner.solve.ilp import solve
from partitioner.solve.problem import (
    PartitionProblem,
    check_assignment,
    stage_memory,
    step_time,
    within_limit,
)

SCHEDULES = ("gpipe", "1f1b")


VARIANTS = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", 1), ("zbv", 2))


@pytest.mark.parametrize("seed", range(90))
def test_replay_matches_the_simulator(seed: int) -> None:
    rng = random.Random(seed)
    kind, chunks = VARIANTS[seed % len(VARIANTS)]
    ranks, microbatches = rng.randint(1, 4), rng.randint(1, 7)
    if kind == "interleaved-1f1b":
        microbatches = ranks * rng.randint(1, 3)
    stages = ranks * chunks
    where = stage_ranks(kind, ranks=ranks, chunks=chunks)
    sends = [{s + 1} if s + 1 < stages else set() for s in range(stages)]
    for s in range(stages - 2):
        # Skip connections only with one stage per rank: the chunked orders cannot always place their
        # messages yet (validate finds a deadlock), and the planner then passes such a split over.
        if chunks == 1 and rng.random() < 0.4:
            sends[s].add(rng.randint(s + 2, stages - 1))
    sends_to = tuple(tuple(sorted(x)) for x in sends)
    receives_from = tuple(tuple(a for a in range(stages) if b in sends_to[a]) for b in range(stages))
    schedule = lower(compute_order(kind, ranks=ranks, microbatches=microbatches, chunks=chunks),
                     sends_to=sends_to, receives_from=receives_from, stage_rank=where, kind=kind)
    forward = [rng.uniform(0.0, 2.0) for _ in range(stages)]
    backward = [rng.uniform(0.0, 4.0) for _ in range(stages)]
    weight = [rng.uniform(0.0, b) for b in backward]
    seconds = [[rng.uniform(0.0, 3.0) for _ in range(stages)] for _ in range(stages)]
    allreduce = [rng.choice([0.0, rng.uniform(0.0, 5.0)]) for _ in range(stages)]
    buckets = [rng.randint(1, 4) for _ in range(stages)]
    host = rng.choice([0.0, rng.uniform(0.0, 0.5)])  # the ranks' own seconds per message
    expected = simulate_schedule(schedule, forward_s=forward, backward_s=backward, weight_s=weight,
                                 stage_rank=where, sends_to=sends_to, receives_from=receives_from,
                                 transfer_s=seconds, allreduce_s=allreduce, buckets=buckets,
                                 message_host_s=host).step_s
    split = weight if splits_backward(kind) else [0.0] * stages
    rows = compile_rows(schedule, where, sends_to, receives_from)
    got = _replay(rows, _Stages(where, forward, backward, split, seconds, allreduce, buckets, host))
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


def _case(seed: int) -> tuple[PartitionProblem, int, int, str]:
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    kind = rng.choice(["chain", "chain", "skip", "dag"])
    problem = _brute.random_problem(rng, n, kind=kind, shared=rng.random() < 0.3, replicas=rng.random() < 0.5)
    if rng.random() < 0.5:
        problem = _brute.with_recompute(problem, rng)
    if rng.random() < 0.6:
        problem = _brute.with_topology(problem, rng)
    stages = rng.randint(2, min(4, n))
    microbatches = rng.randint(1, 8)
    schedule = rng.choice(SCHEDULES)
    if rng.random() < 0.5:
        problem = _brute.with_limit(problem, rng, stages=stages, microbatches=microbatches, schedule=schedule,  # type: ignore[arg-type]
                                   intervals=False)
    return problem, stages, microbatches, schedule


@pytest.mark.parametrize("seed", range(80))
def test_refinement_never_worse_valid_and_fits(seed: int) -> None:
    problem, stages, microbatches, schedule = _case(seed)
    start = solve(problem, stages=stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
    if start is None:
        pytest.skip("no split fits")
    found = refine_split(problem, start.stage_of, stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
    sim = SplitSimulator(problem, stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
    assert found.after_s <= found.before_s
    assert found.before_s == pytest.approx(sim.step(start.stage_of, start.recompute or None))
    assert found.after_s == pytest.approx(sim.step(found.stage_of, found.recompute))
    assert check_assignment(problem, found.stage_of, stages) is None
    memory = stage_memory(problem, found.stage_of, stages, microbatches=microbatches,
                          schedule=schedule, recompute=found.recompute)  # type: ignore[arg-type]
    assert all(within_limit(m, problem.memory_limit) for m in memory)
    assert found.recompute == sim.recompute(found.stage_of)
    assert (found.moves == 0) == (found.stage_of == tuple(start.stage_of))
    closed, _ = step_time(problem, found.stage_of, microbatches=microbatches, schedule=schedule,  # type: ignore[arg-type]
                          recompute=found.recompute)
    assert found.objective == pytest.approx(closed)


@pytest.mark.parametrize("seed", range(40))
def test_refinement_of_a_chunked_layout(seed: int) -> None:
    # Several stages per rank: moves keep each stage under its cap and every rank under the GPU's limit
    # (the exact per-rank walk), and the fast replay still judges them.
    from partitioner.search.layouts import schedule_problem
    from partitioner.solve.problem import rank_memory

    rng = random.Random(seed)
    kind, chunks = [("interleaved-1f1b", 2), ("zbv", 2), ("zb-h1", 1), ("interleaved-1f1b", 3)][seed % 4]
    ranks = rng.randint(2, 3)
    stages = ranks * chunks
    n = rng.randint(stages, stages + 6)
    problem = _brute.random_problem(rng, n, kind=rng.choice(["chain", "chain", "skip"]), replicas=rng.random() < 0.5)
    problem = dataclasses.replace(problem, weight_s=tuple(t * rng.uniform(0.0, 0.5) for t in problem.time_s))
    if rng.random() < 0.5:
        problem = _brute.with_topology(problem, rng)
    microbatches = ranks * rng.randint(1, 3)
    start = tuple(v * stages // n for v in range(n))
    if rng.random() < 0.6:  # a GPU limit between the start's per-rank peak and a little more
        placed = schedule_problem(problem, kind, ranks, chunks)  # type: ignore[arg-type]
        peak = max(rank_memory(placed, start, stages, microbatches=microbatches, schedule=kind))  # type: ignore[arg-type]
        problem = dataclasses.replace(problem, memory_limit=peak * rng.uniform(1.0, 1.3))
    placed = schedule_problem(problem, kind, ranks, chunks)  # type: ignore[arg-type]
    if chunks > 1:
        placed = dataclasses.replace(placed, memory_limit=placed.rank_memory_limit)  # the whole GPU per stage
    if check_assignment(placed, start, stages) is not None:
        pytest.skip("the even split breaks an edge")
    sim = SplitSimulator(placed, stages, microbatches=microbatches, schedule=kind)  # type: ignore[arg-type]
    if not sim.fits(start, sim.recompute(start)):
        pytest.skip("the start does not fit")
    found = refine_split(placed, start, stages, microbatches=microbatches, schedule=kind)  # type: ignore[arg-type]
    assert found.after_s <= found.before_s
    assert check_assignment(placed, found.stage_of, stages) is None
    assert sim.fits(found.stage_of, found.recompute)
    if placed.rank_memory_limit is not None:
        assert all(within_limit(m, placed.rank_memory_limit) for m in rank_memory(
            placed, found.stage_of, stages, microbatches=microbatches, schedule=kind))  # type: ignore[arg-type]


def _cross_node_chain() -> PartitionProblem:
    """Eight equal layers on two nodes (one GPU each), one layer sending a large activation."""
    n = 8
    transfer = tuple(4.0 if v == 3 else 0.05 for v in range(n))  # both ways: 2 s each, a layer is 3 s
    return PartitionProblem(
        time_s=(3.0,) * n, static_bytes=(0.0,) * n, activation_bytes=(0.0,) * n, allreduce_s=(0.0,) * n,
        transfer_s=tuple(t / 8 for t in transfer), transfer_slow_s=transfer,
        edges=tuple((v, v + 1) for v in range(n - 1)), gpus_per_node=1,
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_refined_split_beats_the_closed_form_optimum_on_a_heavy_cross_node_transfer(schedule: str) -> None:
    problem, stages, microbatches = _cross_node_chain(), 2, 16
    best = solve(problem, stages=stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
    assert best is not None and best.status == "optimal"
    assert best.stage_of != (0, 0, 0, 0, 1, 1, 1, 1)  # the closed form avoids the heavy boundary...
    found = refine_split(problem, best.stage_of, stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
    assert found.after_s < found.before_s and found.moves >= 1  # ...which the simulator overlaps
    assert found.stage_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert found.objective > best.objective  # the closed form still ranks it worse


def test_refinement_respects_the_budget() -> None:
    problem, stages = _cross_node_chain(), 2
    found = refine_split(problem, (0, 1, 1, 1, 1, 1, 1, 1), stages, microbatches=4, schedule="1f1b", budget=1)
    assert found.moves == 0 and found.simulations == 1 and found.stage_of == (0, 1, 1, 1, 1, 1, 1, 1)


def test_moves_that_break_an_edge_are_not_taken() -> None:
    # Block 0 feeds block 3 directly: block 3 may not move before... block 0's stage; every move is checked.
    problem = dataclasses.replace(_cross_node_chain(), edges=((0, 1), (1, 2), (2, 3), (0, 3), (3, 4), (4, 5),
                                                             (5, 6), (6, 7)))
    found = refine_split(problem, (0, 0, 0, 1, 1, 1, 1, 1), 2, microbatches=8, schedule="gpipe")
    assert check_assignment(problem, found.stage_of, 2) is None
    assert shift_boundary((0, 0, 1, 1), 0, -2) is None


def test_step_model_defaults() -> None:
    problem = _cross_node_chain()
    assert StepModel.default(problem).forward_s == (1.0,) * 8  # a third of the time
    with pytest.raises(ValueError, match="forward_s"):
        SplitSimulator(problem, 2, microbatches=2, schedule="1f1b", model=StepModel((1.0,)))
    with pytest.raises(ValueError, match="invalid split"):
        refine_split(problem, (1, 0, 0, 0, 0, 0, 0, 1), 2, microbatches=2, schedule="1f1b")


def test_plan_records_refinement_and_loads_without_it(tmp_path: object) -> None:
    plan = example_plan()
    refined = dataclasses.replace(plan, solver=dataclasses.replace(plan.solver,
                                                                   refinement=Refinement(2.0, 1.5, 3, 40, 0.1)))
    assert Plan.from_json(refined.to_json()) == refined
    assert refined.solver.refinement is not None and refined.solver.refinement.gain == pytest.approx(0.25)
    data = json.loads(plan.to_json())
    data["solver"].pop("refinement", None)  # saved before the field existed (same format version)
    assert Plan.from_json(json.dumps(data)).solver.refinement is None
    del data["solver"]["blocks"]  # other fields are still required
    with pytest.raises(Exception, match="blocks"):
        Plan.from_json(json.dumps(data))


def test_planner_refines_and_never_loses() -> None:
    torch = pytest.importorskip("torch")
    from partitioner.search.planner import compile

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    x = torch.randn(32, 64)
    kwargs = {"gpus": 4, "microbatches": 8, "schedule": "1f1b", "device": "h100", "pp": 4, "gpus_per_node": 1}
    plain = compile(model, (x,), refine_simulations=0, **kwargs)  # type: ignore[arg-type]
    refined = compile(model, (x,), **kwargs)  # type: ignore[arg-type]
    assert plain.solver.refinement is None
    info = refined.solver.refinement
    assert info is not None and info.after_s <= info.before_s
    assert refined.predicted.step_s <= plain.predicted.step_s * (1 + 1e-12)
    assert info.before_s == pytest.approx(plain.predicted.step_s)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_layer_starts_make_refinement_never_slower_than_hand_splits(stages: int) -> None:
    # Embedding, 8 equal layers of 2 blocks, head; the head is heavy, so the solver's
    # closed form and the hand-made splits disagree. Whatever the solver found, the
    # refined split must simulate no slower than equal layers or first/last lighter.
    from partitioner.schedule.refine import layer_starts

    block_layer: list[int | None] = [None, *[i for i in range(8) for _ in range(2)], None]
    n = len(block_layer)
    times = tuple(3.0 if v == n - 1 else 1.0 for v in range(n))
    problem = PartitionProblem(time_s=times, static_bytes=(0.0,) * n, activation_bytes=(0.0,) * n,
                               allreduce_s=(0.0,) * n, transfer_s=(0.2,) * n,
                               edges=tuple((v, v + 1) for v in range(n - 1)))
    starts = layer_starts(block_layer, stages)
    assert starts and all(check_assignment(problem, s, stages) is None for s in starts)
    sim = SplitSimulator(problem, stages, microbatches=8, schedule="1f1b")
    solved = solve(problem, stages=stages, microbatches=8, schedule="1f1b")
    assert solved is not None
    found = refine_split(problem, solved.stage_of, stages, microbatches=8, schedule="1f1b", alternatives=starts)
    for start in starts:
        assert found.after_s <= sim.step(start, sim.recompute(start)) + 1e-12


@pytest.mark.parametrize("seed", range(60))
def test_a_limit_cuts_off_only_steps_at_or_past_it(seed: int) -> None:
    """``step(limit=)`` (lower bound, early stop, memo) returns the step when it is under the limit, else inf."""
    problem, stages, microbatches, schedule = _case(seed)
    rng = random.Random(seed)
    splits = {tuple(sorted(rng.randrange(stages) for _ in range(problem.size))) for _ in range(12)}
    for split in (s for s in splits if check_assignment(problem, s, stages) is None):
        exact = SplitSimulator(problem, stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
        step = exact.step(split)
        cut = SplitSimulator(problem, stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
        for limit in (step * 0.5, step * (1 - 1e-6), step * (1 + 1e-9), step * 2, step * 0.9, math.inf):
            assert cut.step(split, limit=limit) == (step if step < limit else math.inf)
        assert cut.simulations == 6  # remembered or cut off, each call counts


@pytest.mark.parametrize("seed", range(40))
def test_refinement_with_cut_offs_is_the_refinement_without(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cutting off slower candidates changes nothing the search finds, only how long it takes."""
    problem, stages, microbatches, schedule = _case(seed)
    start = solve(problem, stages=stages, microbatches=microbatches, schedule=schedule)  # type: ignore[arg-type]
    if start is None:
        pytest.skip("no split fits")
    run = lambda: refine_split(problem, start.stage_of, stages, microbatches=microbatches,
                               schedule=schedule, budget=60)  # type: ignore[arg-type]
    fast = run()
    step = SplitSimulator.step
    monkeypatch.setattr(SplitSimulator, "step", lambda self, split, recompute=None, **_: step(self, split, recompute))
    slow = run()
    assert dataclasses.replace(fast, wall_s=0.0) == dataclasses.replace(slow, wall_s=0.0)
