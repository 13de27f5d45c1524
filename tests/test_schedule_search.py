"""The planner chooses among the schedules and the stages per pipeline rank (issue 11).

* every schedule plans the example GPT into a valid layout: the lowered rows
  validate, each rank holds ``chunks`` stages where the schedule puts them,
  links follow the stages' ranks (one node per pipeline rank here), W seconds
  are recorded, the per-rank peak memory is the simulator's, and plan.json
  round-trips;
* ``schedule="auto"`` keeps the lowest simulated step among those tried;
* memory is checked per rank: a budget that fits 1F1B but not interleaved's
  extra micro-batches in flight rejects interleaved, saying so;
* bad combinations of options fail with what to do;
* the per-rank memory walk, the links by rank and the closed forms against the
  simulator (exact for equal stages), and the W share of a backward.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from _examples import example
from torch import nn

from partitioner import compile
from partitioner.defaults import splits_backward
from partitioner.errors import AutopartitionError, InfeasibleError
from partitioner.orders import Schedule, stage_ranks
from partitioner.plan import Plan
from partitioner.report.table import format_plan
from partitioner.schedule.lower import compute_order, lower, validate
from partitioner.schedule.refine import SplitSimulator
from partitioner.schedule.simulate import simulate, simulate_schedule
from partitioner.search.layouts import rank_in_flight
from partitioner.solve.formulate import weight_seconds
from partitioner.solve.problem import (
    PartitionProblem,
    in_flight,
    rank_memory,
    split_backward,
    stage_links,
    stage_memory,
    step_time,
)

CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "zbv": 2}


@pytest.fixture(scope="module")
def gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    module = example("gpt")
    return module.build_model(), module.example_inputs(16)


def _plan(gpt: tuple[nn.Module, tuple[torch.Tensor, ...]], **options: object) -> Plan:
    model, inputs = gpt
    settings: dict[str, object] = {"gpus": 4, "pp": 2, "microbatches": 4, "device": "h100", "gpus_per_node": 2}
    return compile(model, inputs, **{**settings, **options})  # type: ignore[arg-type]


# ----------------------------------------------------------------- every schedule, a valid plan


@pytest.mark.parametrize("kind", list(CHUNKS))
def test_each_schedule_plans_a_valid_layout(gpt: tuple[nn.Module, tuple[torch.Tensor, ...]], kind: str,
                                            tmp_path: Path) -> None:
    plan = _plan(gpt, schedule=kind, chunks=2 if kind == "interleaved-1f1b" else None)
    v = CHUNKS[kind]
    assert (plan.schedule, plan.pp, plan.dp, plan.chunks, len(plan.stages)) == (kind, 2, 2, v, 2 * v)
    where = stage_ranks(kind, ranks=2, chunks=v)
    assert plan.stage_ranks() == where
    for rank in range(plan.pp):
        held = plan.stages_of(rank)
        assert len(held) == v and all(where[s] == rank for s in held)
    for st in plan.stages:
        assert st.ranks == (st.rank * 2, st.rank * 2 + 1)
        # 2 GPUs per node and 2 replicas: every pipeline rank is a node of its own.
        assert st.allreduce_link == "intra"
        for b in st.outputs:
            assert b.link == ("intra" if where[b.source] == where[b.target] else "inter"), b
        assert 0 < st.predicted.weight_s < st.predicted.backward_s  # every GPT stage reads parameters
    validate(plan.schedule_data(), sends_to=plan.sends_to(), receives_from=plan.receives_from(),
             stage_rank=plan.stage_ranks())
    assert [a.kind == "W" for row in plan.schedule_data().actions for a in row].count(True) == (
        plan.microbatches * len(plan.stages) if kind in ("zb-h1", "zbv") else 0)
    sim = simulate(plan)
    assert len(plan.predicted.peak_memory_bytes) == plan.pp
    assert plan.predicted.peak_memory_bytes == pytest.approx(sim.peak_memory_bytes)
    assert plan.predicted.step_s == pytest.approx(sim.step_s)
    saved = Plan.load(plan.save(tmp_path / kind))
    assert saved == dataclasses.replace(plan, block_graph=None) and saved.chunks == v
    assert Plan.from_json(plan.to_json()).stage_ranks() == where
    text = format_plan(plan)
    if v > 1:
        assert f"pipeline ranks ({kind if kind == 'zbv' else 'interleaved-1f1b x2'}, 2 stages each):" in text
        assert f"rank 0 (GPUs 0,1): stages {where.index(0)}, {len(where) - 1 - where[::-1].index(0)}" in text


def test_interleaved_four_chunks_and_links_across_the_wrap(gpt: tuple[nn.Module, tuple[torch.Tensor, ...]]) -> None:
    # 4 GPUs per node with 2 replicas: pipeline ranks 0-1 on node 0, 2-3 on node 1; interleaving's
    # boundary from the last rank back to the first crosses nodes although its stages are neighbours.
    plan = _plan(gpt, gpus=8, pp=4, gpus_per_node=4, schedule="interleaved-1f1b", chunks=2)
    assert plan.chunks == 2 and plan.stage_ranks() == (0, 1, 2, 3, 0, 1, 2, 3)
    links = {(b.source, b.target): b.link for st in plan.stages for b in st.outputs}
    assert links[(0, 1)] == "intra" and links[(1, 2)] == "inter" and links[(3, 4)] == "inter"
    four = _plan(gpt, schedule="interleaved-1f1b", chunks=4)
    assert (four.chunks, len(four.stages), four.stages_of(1)) == (4, 8, (1, 3, 5, 7))


# ----------------------------------------------------------------- auto


def test_auto_keeps_the_fastest_simulated_schedule(gpt: tuple[nn.Module, tuple[torch.Tensor, ...]]) -> None:
    plan = _plan(gpt, schedule="auto")
    tried = {c.schedule for c in plan.candidates}
    assert tried == set(CHUNKS)
    simulated = [c for c in plan.candidates if c.simulated_s is not None]
    (chosen,) = [c for c in plan.candidates if c.note == "chosen"]
    assert chosen.simulated_s == min(c.simulated_s for c in simulated) == plan.predicted.step_s  # type: ignore[type-var]
    assert (chosen.schedule, chosen.pp, chosen.microbatches) == (plan.schedule, plan.pp, plan.microbatches)
    # The best of every schedule that was solved is simulated, so the table says what each buys.
    solved = {c.schedule for c in plan.candidates if c.step_s is not None}
    assert solved <= {c.schedule for c in simulated}
    assert len(simulated) >= 3
    for c in simulated:
        if c is not chosen:
            assert c.note.startswith("slower: +") and "(simulated)" in c.note


# ----------------------------------------------------------------- memory per rank


def _chain() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    # Identical layers with much more activation than weight: memory is micro-batches in flight.
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(16, 16), nn.Tanh())])
    return model, torch.randn(4096, 16)


def _least_memory(schedule: str, **options: object) -> float:
    """The smallest budget per GPU (bisected) under which ``schedule`` plans the chain."""
    model, x = _chain()
    lo, hi = 0.0, 4e6
    for _ in range(12):
        mid = (lo + hi) / 2
        try:
            compile(model, (x,), gpus=2, pp=2, microbatches=4, schedule=schedule, device="h100",
                    recompute="none", memory_per_gpu=mid, **options)  # type: ignore[arg-type]
            hi = mid
        except InfeasibleError:
            lo = mid
    return hi


def test_interleaved_rejected_where_its_extra_microbatches_do_not_fit() -> None:
    one = _least_memory("1f1b")
    interleaved = _least_memory("interleaved-1f1b", chunks=2)
    assert interleaved > 1.1 * one  # rank 0 holds 5 half-size stage micro-batches, against 1F1B's 2
    budget = (one + interleaved) / 2
    model, x = _chain()
    plan = compile(model, (x,), gpus=2, pp=2, microbatches=4, schedule="auto", device="h100", recompute="none",
                   memory_per_gpu=budget)
    assert plan.schedule != "interleaved-1f1b" and max(plan.predicted.peak_memory_bytes) <= budget
    rows = [c for c in plan.candidates if c.schedule == "interleaved-1f1b" and getattr(c, "chunks", 2) == 2]
    assert rows and all(c.status == "infeasible" for c in rows)
    assert "does not fit" in rows[0].note and "keeps 2.5, 1.5 micro-batches' activations" in rows[0].note
    assert "1F1B 2, 1" in rows[0].note


def test_rank_memory_is_the_simulators_and_within_the_stage_sums() -> None:
    n = 8
    problem = PartitionProblem(time_s=(1.0,) * n, static_bytes=tuple(float(v) for v in range(n)),
                               activation_bytes=tuple(10.0 + v for v in range(n)), allreduce_s=(0.0,) * n,
                               transfer_s=(0.0,) * n, edges=tuple((v, v + 1) for v in range(n - 1)))
    for kind, ranks, chunks, m in itertools.product(CHUNKS, (2, 4), (1, 2), (4, 8)):
        if chunks != CHUNKS[kind]:
            continue
        stages = ranks * chunks
        where = stage_ranks(kind, ranks=ranks, chunks=chunks)
        placed = dataclasses.replace(problem, stage_rank=where if chunks > 1 else None)
        stage_of = tuple(v * stages // n for v in range(n))
        per_rank = rank_memory(placed, stage_of, stages, microbatches=m, schedule=kind)  # type: ignore[arg-type]
        per_stage = stage_memory(placed, stage_of, stages, microbatches=m, schedule=kind)  # type: ignore[arg-type]
        chain: dict[str, Any] = {"sends_to": tuple((s + 1,) if s + 1 < stages else () for s in range(stages)),
                                 "receives_from": tuple((s - 1,) if s else () for s in range(stages))}
        sched = lower(compute_order(kind, ranks=ranks, microbatches=m, chunks=chunks), stage_rank=where, **chain)
        static = [sum(problem.static_bytes[v] for v in range(n) if stage_of[v] == s) for s in range(stages)]
        act = [sum(problem.activation_bytes[v] for v in range(n) if stage_of[v] == s) for s in range(stages)]
        sim = simulate_schedule(sched, forward_s=[1.0] * stages, backward_s=[2.0] * stages,
                                weight_s=[1.0] * stages, stage_rank=where, static_bytes=static,
                                activation_bytes=act, **chain)
        assert per_rank == pytest.approx(sim.peak_memory_bytes), (kind, ranks, m)
        for r in range(ranks):
            assert per_rank[r] <= sum(per_stage[s] for s in range(stages) if where[s] == r) + 1e-9
        held = [max(in_flight(s, stages, m, kind, chunks=chunks)  # type: ignore[arg-type]
                    for s in range(stages) if where[s] == r)
                for r in range(ranks)]
        assert all(h >= 1 for h in held) and len(rank_in_flight(kind, ranks, m, chunks)) == ranks


# ----------------------------------------------------------------- closed forms and links


def _equal_stages(kind: str, ranks: int, m: int, f: float, b: float, w: float,
                  action_s: float = 0.0) -> tuple[Schedule, PartitionProblem, dict[str, Any]]:
    """``kind``'s lowered schedule on a chain of equal stages, the problem of one block per stage, and the
    keywords (placement, chain) the simulator takes."""
    chunks = CHUNKS[kind]
    stages = ranks * chunks
    where = stage_ranks(kind, ranks=ranks, chunks=chunks)
    chain: dict[str, Any] = {"sends_to": tuple((s + 1,) if s + 1 < stages else () for s in range(stages)),
                             "receives_from": tuple((s - 1,) if s else () for s in range(stages))}
    sched = lower(compute_order(kind, ranks=ranks, microbatches=m, chunks=chunks), stage_rank=where, **chain)
    problem = PartitionProblem(time_s=(f + b,) * stages, static_bytes=(0.0,) * stages,
                               activation_bytes=(0.0,) * stages, allreduce_s=(0.0,) * stages,
                               transfer_s=(0.0,) * stages, edges=tuple((s, s + 1) for s in range(stages - 1)),
                               weight_s=(w,) * stages, stage_rank=where if chunks > 1 else None,
                               recompute_s=(f,) * stages, recompute_bytes=(0.0,) * stages, action_s=action_s)
    return sched, problem, {"stage_rank": where, **chain}


@pytest.mark.parametrize(("kind", "ranks", "m", "f", "b", "w"), [
    (kind, ranks, m, *t) for kind in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
    for ranks, m in ((2, 4), (4, 8)) for t in ((1.0, 2.0, 1.0), (1.0, 3.0, 0.5))
] + [("zbv", ranks, m, 1.0, 2.0, 1.0) for ranks, m in ((2, 4), (4, 8), (4, 16))])
def test_closed_forms_match_the_simulator_on_equal_stages(
    kind: str, ranks: int, m: int, f: float, b: float, w: float
) -> None:
    sched, problem, placed = _equal_stages(kind, ranks, m, f, b, w)
    stages = problem.size
    # The W each stage runs: w, except stage 0's, which receives nothing and is all W (split_backward).
    weight = split_backward(problem, tuple(range(stages)), stages).weight
    assert weight == [b] + [w] * (stages - 1)
    sim = simulate_schedule(sched, forward_s=[f] * stages, backward_s=[b] * stages, weight_s=weight, **placed)
    closed, _ = step_time(problem, tuple(range(stages)), microbatches=m, schedule=kind)  # type: ignore[arg-type]
    assert closed == pytest.approx(sim.step_s)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"])
def test_the_runtime_s_host_time_per_action_is_charged_alike_everywhere(kind: str) -> None:
    """A calibration's ``action_s``: once per F and B (and W, split), in the closed form and both simulators."""
    m, f, b, w, a = 4, 1.0, 2.0, 1.0, 0.25
    sched, problem, placed = _equal_stages(kind, 2, m, f, b, w, action_s=a)
    stages, split = problem.size, splits_backward(kind)
    weight = split_backward(problem, tuple(range(stages)), stages).weight
    assert weight == [b + a] + [w + a] * (stages - 1)
    sim = simulate_schedule(sched, forward_s=[f + a] * stages, backward_s=[b + (2 if split else 1) * a] * stages,
                            weight_s=weight, **placed)
    closed, times = step_time(problem, tuple(range(stages)), microbatches=m, schedule=kind)  # type: ignore[arg-type]
    assert times == pytest.approx([f + b + (3 if split else 2) * a] * stages)
    assert closed == pytest.approx(sim.step_s)
    refined = SplitSimulator(problem, stages, microbatches=m, schedule=kind)  # type: ignore[arg-type]
    assert refined.step(tuple(range(stages))) == pytest.approx(sim.step_s)
    without = dataclasses.replace(problem, action_s=0.0)
    assert closed > step_time(without, tuple(range(stages)), microbatches=m, schedule=kind)[0]  # type: ignore[arg-type]
    if split:  # the split's own cost: half in F, a quarter in W, the rest in B; stage 0 (receives nothing) pays none
        x = 0.2
        costly = dataclasses.replace(problem, split_s=(x,) * stages, split_forward=0.5, split_weight=0.25)
        forward = [f + a] + [f + a + x / 2] * (stages - 1)
        backward = [b + 2 * a] + [b + 2 * a + x / 2] * (stages - 1)  # B + W: the split's cost less F's part
        costly_weight = [weight[0]] + [w + a + x / 4] * (stages - 1)
        assert split_backward(costly, tuple(range(stages)), stages).weight == pytest.approx(costly_weight)
        expected = simulate_schedule(sched, forward_s=forward, backward_s=backward, weight_s=costly_weight,
                                     **placed).step_s
        costly_sim = SplitSimulator(costly, stages, microbatches=m, schedule=kind)  # type: ignore[arg-type]
        assert costly_sim.step(tuple(range(stages))) == pytest.approx(expected)
        assert expected > sim.step_s


def test_links_and_transfers_follow_the_ranks() -> None:
    n = 8
    problem = PartitionProblem(time_s=(1.0,) * n, static_bytes=(0.0,) * n, activation_bytes=(0.0,) * n,
                               allreduce_s=(0.0,) * n, transfer_s=(0.5,) * n,
                               edges=tuple((v, v + 1) for v in range(n - 1)),
                               transfer_slow_s=(4.0,) * n, replicas=1, gpus_per_node=2,
                               stage_rank=stage_ranks("zbv", ranks=4, chunks=2))
    inbound, _ = stage_links(problem, n)
    # V on 4 ranks: 0 1 2 3 3 2 1 0; nodes of 2 ranks: the 1->2 and 5->6 boundaries (ranks 1|2) cross.
    assert inbound == (False, False, True, False, False, False, True, False)
    _, times = step_time(problem, tuple(range(n)), microbatches=8, schedule="zbv")
    # Stage 4 takes stage 3's output on the same rank: no transfer at all.
    assert times == (1.0, 1.5, 5.0, 1.5, 1.0, 1.5, 5.0, 1.5)


def test_weight_share_of_a_backward() -> None:
    assert weight_seconds(4e-3, reads_parameters=True) == pytest.approx(2e-3)
    assert weight_seconds(4e-3, reads_parameters=False) == 0.0


# ----------------------------------------------------------------- bad options


@pytest.mark.parametrize(("options", "pattern"), [
    ({"schedule": "interleaved-1f1b", "microbatches": 3, "pp": 2, "gpus": 2},
     (r"multiple of 2 micro-batches, not 3; micro-batch counts that split the 12 samples per replica and work: "
      r"2, 4, 6, 12")),
    ({"schedule": "gpipe", "chunks": 2}, r"--chunks 2 does not apply to --schedule gpipe"),
    ({"schedule": "zbv", "chunks": 3}, r"zbv always holds 2 stages per pipeline rank"),
    ({"schedule": "interleaved-1f1b", "chunks": 1}, r"needs --chunks 2 or more"),
    ({"schedule": "zb-h1", "recompute": "full"}, r"does not recompute them"),
    ({"schedule": "interleaved-1f1b", "chunks": 8, "pp": 2, "gpus": 2, "microbatches": 2},
     r"at most \d+ stages here \(pp x chunks"),
])
def test_bad_schedule_options(options: dict[str, object], pattern: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    settings: dict[str, object] = {"gpus": 2, "microbatches": 2, "device": "h100", "max_blocks": 4}
    with pytest.raises(AutopartitionError, match=pattern):
        compile(model, (torch.randn(12, 8),), **{**settings, **options})  # type: ignore[arg-type]


# ----------------------------------------------------------------- the benchmark's schedule table


def test_schedule_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.benchplanner.schedules import QUICK, print_schedule_table, schedule_rows

    case = next(c for c in QUICK if c.name == "tiny-gpt")
    rows = schedule_rows(case, lambda _msg: None)
    assert {r.schedule for r in rows} == set(CHUNKS)
    assert sum(r.note == "chosen" for r in rows) == 1
    chosen = next(r for r in rows if r.note == "chosen")
    assert chosen.step_s == chosen.chosen_s and chosen.simulated
    assert all(r.step_s is None or not r.simulated or r.step_s >= chosen.step_s * (1 - 1e-9) for r in rows)
    print_schedule_table(rows)
    out = capsys.readouterr().out
    assert "zbv" in out and "vs chosen" in out


def test_zbv_orders_values_sent_from_stage_0_to_later_stages() -> None:
    """Qwen2 sends values made once in stage 0 (rotary tables, the mask) on to later stages: under ZB-V
    two stages of one rank receive them from the other rank.  That used to be refused for every split
    ("zbv could not order the messages of any split"); now every split is ordered and validated."""
    from partitioner.modelfile import load_model_file

    model_file = load_model_file(str(Path(__file__).parent / "models" / "zoo_qwen2.py"))
    plan = compile(model_file.build(), model_file.example_inputs(4), gpus=2, pp=2, microbatches=2, schedule="zbv",
                   device="h100")
    assert (plan.schedule, plan.chunks, plan.stage_ranks()) == ("zbv", 2, (0, 1, 1, 0))
    skips = {(b.source, b.target) for st in plan.stages for b in st.inputs if b.target - b.source > 1}
    assert skips, "the test needs a skip connection across stages"
    sends_to = tuple(tuple(sorted({b.target for b in st.outputs})) for st in plan.stages)
    receives_from = tuple(tuple(sorted({b.source for b in st.inputs})) for st in plan.stages)
    validate(plan.schedule_data(), sends_to=sends_to, receives_from=receives_from, stage_rank=plan.stage_ranks())
