"""Sharded replicas in the planner: the memory formulas, their collectives, the search's choice, refusals, plan.json."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner import defaults
from partitioner.cli import main
from partitioner.cost.comm import Link, shard_step_seconds, zero3_microbatch_seconds
from partitioner.cost.precision import (
    gathered_bytes,
    shard_state_bytes,
    zero3_transient_bytes,
    zero_bytes_per_parameter,
)
from partitioner.errors import AutopartitionError
from partitioner.orders import Schedule
from partitioner.plan import Plan
from partitioner.report.markdown import report_markdown
from partitioner.report.table import format_plan
from partitioner.schedule.lower import compute_order, lower
from partitioner.schedule.simulate import simulate, simulate_schedule, stage_static_bytes
from partitioner.search.planner import compile
from partitioner.solve.problem import PartitionProblem, step_time

MIB = 2**20


# ----------------------------------------------------------------- memory per parameter


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_zero_paper_bytes_per_parameter(d: int) -> None:
    """Rajbhandari et al. 2020, section 5: 16; 4 + 12/d; 2 + 14/d; 16/d (mixed-precision Adam, K = 12)."""
    assert zero_bytes_per_parameter("none", d) == 16
    assert zero_bytes_per_parameter("optimizer", d) == pytest.approx(4 + 12 / d)
    assert zero_bytes_per_parameter("optimizer+gradients", d) == pytest.approx(2 + 14 / d)
    assert zero_bytes_per_parameter("full", d) == pytest.approx(16 / d)


def test_zero_paper_figure_1() -> None:
    """Figure 1: 7.5B parameters on 64 GPUs take 120, 31.4, 16.6 and 1.9 GB per GPU."""
    got = [7.5e9 * zero_bytes_per_parameter(s, 64) / 1e9 for s in ("none", "optimizer", "optimizer+gradients", "full")]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.875], abs=0.05)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_our_precisions_per_parameter(d: int) -> None:
    """bf16-mixed Adam: our fp32 weights are the master copy (the paper's 4 of K = 12)."""
    per = {m: shard_state_bytes("bf16-mixed", 2, m, d, elements=1, model_bytes=4) for m in ("none", "optimizer", "full")}
    assert per == pytest.approx({"none": 16, "optimizer": 8 + 8 / d, "full": 16 / d})
    # Under a pipeline a fully sharded stage also holds its weights gathered (bf16: FSDP2's param_dtype), its fp32
    # gradients accumulated unsharded (reduce_dtype) and, until each backward ends, that backward's bf16 gradients.
    assert gathered_bytes("bf16-mixed", elements=1, model_bytes=4) == 2 + 4 + 2
    # ZeRO-3 holds nothing beyond its shards through the step: gradients are reduce-scattered every micro-batch.
    assert gathered_bytes("bf16-mixed", elements=1, model_bytes=4, reshard_after_forward=True) == 0
    # Its transient: two units' bf16 weights (in use, prefetched), one's bf16 gradients, one fp32 reduce-scatter input.
    assert zero3_transient_bytes("bf16-mixed", elements=1, model_bytes=4) == 2 + 2 + 2 + 4
    assert zero3_transient_bytes("bf16", elements=1, model_bytes=4) == 2 * (2 + 2)
    assert shard_state_bytes("fp32", 1, "optimizer", d, elements=1, model_bytes=4) == pytest.approx(8 + 4 / d)
    assert shard_state_bytes("bf16", 2, "full", d, elements=1, model_bytes=4) == pytest.approx(8 / d)
    # One replica shards nothing.
    assert shard_state_bytes("bf16-mixed", 2, "full", 1, elements=1, model_bytes=4) == 16


def test_collectives_per_step() -> None:
    """A reduce-scatter and an all-gather move what one all-reduce does.

    ``optimizer`` (ZeRO-1) all-reduces the gradients, then broadcasts the weights; ``full`` reduce-scatters the
    gradients and gathers what it is given (here half the gradients' bytes)."""
    on, d, grads = Link(100e9, 0.0), 8, 1e9
    ring = on.allreduce_seconds(grads, d)
    assert shard_step_seconds("optimizer", d, on, gradient_bytes=grads, weight_bytes=grads,
                              gathered_bytes=grads / 2) == pytest.approx(1.5 * ring)
    assert shard_step_seconds("full", d, on, gradient_bytes=grads, weight_bytes=grads,
                              gathered_bytes=grads / 2) == pytest.approx(0.75 * ring)
    assert shard_step_seconds("full", d, on, gradient_bytes=grads, weight_bytes=grads, gathered_bytes=grads / 2,
                              reshard_after_forward=True) == 0  # ZeRO-3: every collective is per micro-batch


def test_zero3_collectives_per_microbatch_hide_behind_compute() -> None:
    """ZeRO paper section 7.2.2: 3x DDP's volume per micro-batch (gather, gather, scatter); FSDP2 prefetch
    hides each pass's collectives behind that pass's compute, the excess is exposed."""
    on, d, nbytes = Link(100e9, 0.0), 8, 1e9
    one = on.shard_seconds(nbytes, d)  # a ring all-gather or reduce-scatter of the layer
    assert 3 * one == pytest.approx(1.5 * on.allreduce_seconds(nbytes, d))
    assert zero3_microbatch_seconds(d, on, weight_bytes=nbytes, gradient_bytes=nbytes, forward_s=1.0,
                                    backward_s=2.0) == (0.0, 0.0)  # long compute: all hidden
    f, b = zero3_microbatch_seconds(d, on, weight_bytes=nbytes, gradient_bytes=nbytes, forward_s=0.001,
                                    backward_s=0.002, across_s=0.001)
    assert f == pytest.approx(one - 0.001) and b == pytest.approx(2 * one + 0.001 - 0.002)


# ----------------------------------------------------------------- closed form and simulator


def _chain(kind: str, stages: int, m: int) -> Schedule:
    sends = tuple((s + 1,) if s + 1 < stages else () for s in range(stages))
    receives = tuple((s - 1,) if s else () for s in range(stages))
    return lower(compute_order(kind, ranks=stages, microbatches=m), sends_to=sends, receives_from=receives, kind=kind)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_closed_form_matches_the_simulator_with_a_sharded_collective(kind: str, stages: int) -> None:
    """A sharded group's collectives run whole after its last backward (one piece): both add them at the end."""
    f, b, m, collective, latency = 1.0, 2.0, 6, 0.7, 0.05
    problem = PartitionProblem(time_s=(f + b,) * stages, static_bytes=(0.0,) * stages,
                               activation_bytes=(0.0,) * stages, allreduce_s=(collective,) * stages,
                               transfer_s=(0.0,) * stages, edges=tuple((s, s + 1) for s in range(stages - 1)),
                               allreduce_latency_s=latency, replicas=2)
    closed, _ = step_time(problem, tuple(range(stages)), microbatches=m, schedule=kind)  # type: ignore[arg-type]
    sim = simulate_schedule(_chain(kind, stages, m), forward_s=[f] * stages, backward_s=[b] * stages,
                            allreduce_s=[collective + latency] * stages, buckets=1)
    assert closed == pytest.approx(sim.step_s)
    bucketed = simulate_schedule(_chain(kind, stages, m), forward_s=[f] * stages, backward_s=[b] * stages,
                                 allreduce_s=[collective + latency] * stages, buckets=4)
    assert bucketed.step_s < sim.step_s  # DDP's buckets overlap the last backward; the closed form does not credit it


# ----------------------------------------------------------------- the planner

LAYERS, WIDTH = 8, 256


def _mlp(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers), (torch.randn(batch, WIDTH),)


def _plan(batch: int = 8, **options: object) -> Plan:
    model, inputs = _mlp(batch)
    kwargs: dict[str, object] = {"gpus": 4, "pp": 2, "dp": 2, "microbatches": 2, "schedule": "1f1b",
                                 "device": "h100", "precision": "bf16-mixed", "recompute": "none"}
    return compile(model, inputs, **{**kwargs, **options})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def ddp_plan() -> Plan:
    return _plan()


def test_none_where_ddp_fits(ddp_plan: Plan) -> None:
    """Plenty of memory: every stage group stays DDP, and no sharded twin is even solved."""
    assert [s.shard for s in ddp_plan.stages] == ["none", "none"]
    assert not any(s.reshard_after_forward for s in ddp_plan.stages)
    assert {c.shard for c in ddp_plan.candidates} == {"none"}


def test_sharded_where_ddp_cannot_fit(ddp_plan: Plan) -> None:
    """Below DDP's state (16 bytes per parameter) the planner shards; the prediction holds the sharded state."""
    half = sum(s.predicted.parameter_bytes for s in ddp_plan.stages) / 4 / 2  # elements of half the model
    # Every split holds half the model on some stage: at 13 bytes a parameter DDP (16) and full (8 + 6) miss,
    # the optimizer sharded (8 + 4) fits.
    limit = 13 * half
    plan = _plan(memory_per_gpu=limit)
    assert {s.shard for s in plan.stages} == {"optimizer"}
    assert max(plan.predicted.peak_memory_bytes) <= limit
    chosen = next(c for c in plan.candidates if c.note == "chosen")
    assert chosen.shard == "optimizer"
    modes = {c.shard: c for c in plan.candidates}
    assert modes["none"].status == "infeasible" and modes["full"].status == "infeasible"
    # The simulator's memory agrees with the closed form's, stage by stage, and holds the sharded state.
    sim = simulate(plan)
    assert list(sim.peak_memory_bytes) == pytest.approx([s.predicted.memory_bytes for s in plan.stages])
    for s, static in zip(plan.stages, stage_static_bytes(plan), strict=True):
        elements = s.predicted.parameter_bytes / 4
        assert static == pytest.approx(elements * (8 + 8 / 2))
    # Shown in the stage table, the candidate table and the assumptions.
    text = format_plan(plan)
    assert "shard" in text and "optimizer (ZeRO-1: optimizer state sharded" in text
    assert "| shard |" in report_markdown(plan)


def test_each_stage_group_that_fits_whole_stays_ddp() -> None:
    """1F1B: stage 0 holds two micro-batches' activations, stage 1 one; only stage 0 needs sharding."""
    ddp = _plan(batch=512, microbatches=4)
    half = sum(s.predicted.parameter_bytes for s in ddp.stages) / 4 / 2
    plan = _plan(batch=512, microbatches=4, memory_per_gpu=17 * half)  # DDP: 16 bytes + activations
    assert plan.stages[0].shard != "none" and plan.stages[1].shard == "none"
    assert max(plan.predicted.peak_memory_bytes) <= 17 * half
    sim = simulate(plan)
    assert list(sim.peak_memory_bytes) == pytest.approx([s.predicted.memory_bytes for s in plan.stages])
    assert "on stage 1: 16 bytes per parameter" in format_plan(plan).replace("\n    ", " ")


def test_full_shard_holds_gathered_weights_and_gradients(ddp_plan: Plan) -> None:
    plan = _plan(shard="full")
    assert {s.shard for s in plan.stages} == {"full"}
    for s, static in zip(plan.stages, stage_static_bytes(plan), strict=True):
        elements = s.predicted.parameter_bytes / 4
        assert static == pytest.approx(elements * (16 / 2 + 2 + 4 + 2))  # bf16 gathered, fp32 + bf16 gradients
    sim = simulate(plan)
    assert list(sim.peak_memory_bytes) == pytest.approx([s.predicted.memory_bytes for s in plan.stages])
    # One exposed piece per stage after its last backward, not DDP's buckets.
    pieces = [e for e in sim.events if e.label.startswith("AR")]
    assert len(pieces) == len(plan.stages)


def test_plan_json_round_trip_with_shards(tmp_path: Path) -> None:
    plan = _plan(shard="full")
    loaded = Plan.load(plan.save(tmp_path / "plan"))
    assert [s.shard for s in loaded.stages] == ["full", "full"]
    assert [c.shard for c in loaded.candidates] == [c.shard for c in plan.candidates]
    assert loaded.stages == plan.stages


# ----------------------------------------------------------------- refusals


def test_a_refused_schedule_and_mode_is_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(defaults._SHARD_UNSUPPORTED, ("1f1b", "full"), "a reason the runtime gives")
    with pytest.raises(AutopartitionError, match=r"--shard full cannot run with --schedule 1f1b: a reason the "
                                                 r"runtime gives\. --shard full runs with --schedule "):
        _plan(shard="full")
    # --schedule auto keeps to the schedules the mode runs with.
    plan = _plan(shard="full", schedule="auto")
    assert plan.schedule != "1f1b" and {s.shard for s in plan.stages} == {"full"}
    # --shard auto never plans the refused pair.
    limit = max(_plan().predicted.peak_memory_bytes) * 0.6
    for c in _plan(schedule="1f1b", shard="auto", memory_per_gpu=limit).candidates:
        assert (c.schedule, c.shard) != ("1f1b", "full")


def test_cli_refusal_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(defaults._SHARD_UNSUPPORTED, ("gpipe", "optimizer"), "not yet")
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build_model():
            return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 16),)
    """))
    code = main([str(model), "--gpus", "2", "--batch-size", "4", "--device", "h100", "--schedule", "gpipe",
                 "--shard", "optimizer", "--out", str(tmp_path / "plan")])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--shard optimizer cannot run with --schedule gpipe: not yet" in err
    assert "--schedule gpipe runs with --shard none or full" in err
    assert main([str(model), "--shard", "zero3"]) == 2  # not a mode: argparse's own message


def test_unknown_mode_from_python() -> None:
    with pytest.raises(AutopartitionError, match="Unknown --shard 'zero2'"):
        _plan(shard="zero2")


def test_zero3_asked_for_is_planned_resharded() -> None:
    """--shard zero3: "full" with every stage resharded after each forward (ZeRO-3), never kept gathered."""
    plan = _plan(shard="zero3")
    assert all(s.shard == "full" and s.reshard_after_forward for s in plan.stages)
    with pytest.raises(AutopartitionError, match="zero3 reduces each layer's gradients"):
        _plan(shard="zero3", schedule="zb-h1")


def test_one_replica_shards_nothing() -> None:
    plan = _plan(pp=None, dp=1, shard="full")
    assert {s.shard for s in plan.stages} == {"none"}



# ----------------------------------------------------------------- what the runtime cannot shard


def test_tied_parameters_are_not_planned_fully_sharded_in_a_v() -> None:
    """zbv holds the first and last stages on one rank: a tied embedding/head there cannot be two FSDP units."""
    from tests.models.tied_lm import build_model, example_inputs

    with pytest.raises(AutopartitionError, match="a tied parameter held by two fully sharded stages of one rank"):
        compile(build_model(), example_inputs(), gpus=4, pp=2, dp=2, schedule="zbv", shard="full", device="h100",
                microbatches=4)


def test_stages_holding_a_tied_parameter_share_one_mode() -> None:
    """Under auto a stage that fits whole stays DDP, unless it shares a tied parameter with a sharded one."""
    from tests.models.tied_lm import build_model, example_inputs

    free = compile(build_model(), example_inputs(), gpus=4, pp=2, dp=2, schedule="1f1b", device="h100",
                   microbatches=4)
    lighter, heavier = sorted(s.predicted.memory_bytes for s in free.stages)
    assert lighter < heavier and [t.stages for t in free.tied] == [(0, 1)]
    # Between the two: DDP fits one stage whole but not the other; the tied embedding/head pins them together.
    plan = compile(build_model(), example_inputs(), gpus=4, pp=2, dp=2, schedule="1f1b", device="h100",
                   microbatches=4, memory_per_gpu=(lighter + heavier) / 2)
    for t in plan.tied:
        assert len({plan.stages[s].shard for s in t.stages}) == 1, (t, [s.shard for s in plan.stages])
    assert any(s.shard != "none" for s in plan.stages)


# ----------------------------------------------------------------- ZeRO-3 (full with reshard_after_forward)


def test_zero3_where_only_it_fits() -> None:
    """pp=2 x dp=4: per parameter DDP 16, optimizer 8 + 8/4, full kept gathered 16/4 + 8; ZeRO-3 16/4 plus 10 bytes
    of the largest layer (one layer is a quarter of a stage here): 6.5. At 9 only ZeRO-3 fits."""
    ddp = _plan(gpus=8, dp=4)
    half = sum(s.predicted.parameter_bytes for s in ddp.stages) / 4 / 2  # elements of a stage
    layer = WIDTH * WIDTH + WIDTH
    plan = _plan(gpus=8, dp=4, memory_per_gpu=9 * half)
    assert [(s.shard, s.reshard_after_forward) for s in plan.stages] == [("full", True)] * 2
    chosen = next(c for c in plan.candidates if c.note == "chosen")
    assert chosen.shard == "zero3"
    modes = {c.shard: c.status for c in plan.candidates}
    assert all(modes[m] == "infeasible" for m in ("none", "optimizer", "full")), modes
    assert max(plan.predicted.peak_memory_bytes) <= 9 * half
    # Plan and simulator hold the same bytes: the shards, and the two gathered units (no accumulated gradients).
    for s, static in zip(plan.stages, stage_static_bytes(plan), strict=True):
        assert s.predicted.gathered_bytes == (2 + 2 + 2 + 4) * layer  # bf16-mixed: zero3_transient_bytes
        assert static == pytest.approx(s.predicted.parameter_bytes / 4 * 16 / 4 + 10 * layer)
    sim = simulate(plan)
    assert list(sim.peak_memory_bytes) == pytest.approx([s.predicted.memory_bytes for s in plan.stages])
    text = format_plan(plan)
    assert "zero3" in text and "ZeRO-3" in text
    assert "zero3" in report_markdown(plan)
    # The closed form and the simulator price a step alike (one stage per rank, 1F1B, tiny transfers).
    assert plan.solver.objective == pytest.approx(plan.predicted.step_s, rel=0.05)


def test_zero3_is_not_planned_with_a_split_backward() -> None:
    """zb-h1's W runs after B, outside FSDP2's hooks: the runtime refuses ZeRO-3 there, the planner never plans it."""
    ddp = _plan(gpus=8, dp=4)
    half = sum(s.predicted.parameter_bytes for s in ddp.stages) / 4 / 2
    with pytest.raises(AutopartitionError):
        _plan(gpus=8, dp=4, schedule="zb-h1", memory_per_gpu=9 * half)


def test_zero3_plan_json_round_trip(tmp_path: Path) -> None:
    ddp = _plan(gpus=8, dp=4)
    half = sum(s.predicted.parameter_bytes for s in ddp.stages) / 4 / 2
    plan = _plan(gpus=8, dp=4, memory_per_gpu=9 * half)
    loaded = Plan.load(plan.save(tmp_path / "plan"))
    assert loaded.stages == plan.stages and all(s.reshard_after_forward for s in loaded.stages)


def test_zero3_exposed_collectives_are_in_the_stage_times() -> None:
    """A slow link: ZeRO-3's per-micro-batch gathers and scatters exceed the compute, the excess is in F and B."""
    from partitioner.cost.devices import DEVICES
    from partitioner.solve.formulate import GraphCosts, formulate, zero3_costs

    graph = GraphCosts(blocks=(("a",), ("b",)), node_time_s={"a": 3e-4, "b": 3e-4}, node_forward_s={"a": 1e-4, "b": 1e-4},
                       node_saved_bytes={"a": 0, "b": 0}, node_output_bytes={"a": 0, "b": 0},
                       parameter_bytes={"layers.0.w": 4 * 10**8, "layers.1.w": 4 * 10**8},
                       block_parameters=(("layers.0.w",), ("layers.1.w",)), edges=((0, 1),), block_sends=(0, 0))
    spec = DEVICES["h100"]
    z = zero3_costs(graph, dp=2, spec=spec, precision="fp32", gpus_per_node=8)
    assert z.forward_s[0] > 0 and z.backward_s[0] > z.forward_s[0]
    assert z.transient_bytes == 2 * (4 + 4) * 10**8
    full = formulate(graph, dp=2, spec=spec, memory_limit=80e9, shard="full")
    zero3 = formulate(graph, dp=2, spec=spec, memory_limit=80e9, shard="zero3")
    assert zero3.time_s == pytest.approx([t + f + b for t, f, b in zip(full.time_s, z.forward_s, z.backward_s)])
    assert zero3.memory_limit == pytest.approx(80e9 - z.transient_bytes)
    assert zero3.action_s == pytest.approx(z.first_gather_s) and sum(zero3.allreduce_s) == 0
    assert sum(zero3.static_bytes) == pytest.approx(8e8 * 16 / 4 / 2)  # fp32 Adam: 16 bytes / parameter over 2


def test_zero3_gathered_units_count_once_per_rank() -> None:
    """Interleaved: two stages per rank, one set of gathered units per rank (the plan's and the simulator's)."""
    ddp = _plan(gpus=8, dp=4)
    half = sum(s.predicted.parameter_bytes for s in ddp.stages) / 4 / 2
    plan = _plan(gpus=8, dp=4, schedule="interleaved-1f1b", memory_per_gpu=9 * half)
    assert plan.chunks == 2 and all(s.reshard_after_forward for s in plan.stages)
    units = [sum(s.predicted.gathered_bytes for s in plan.stages if s.rank == r) for r in range(plan.pp)]
    assert units == [10 * (WIDTH * WIDTH + WIDTH)] * plan.pp
    assert max(plan.predicted.peak_memory_bytes) <= 9 * half
