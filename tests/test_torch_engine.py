"""``Pipeline(..., engine="torch")``: a plan run by torch.distributed.pipelining equals the whole model (issue 23).

Spawned gloo ranks train each plan three SGD steps with torch's schedule classes
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleZBVZeroBubble``; ZB-H1 from the plan's own action rows on torch's
action-list runtime); every step's loss, gradients and updated parameters match
the unpartitioned model run on the same micro-batches (fp32, 1e-5).  Plans come
from the planner with predicted h100 costs (``chunked.plan_schedule``), so the
splits are the same on every run.

Default tier: one spawn of two ranks for a tiny MLP under GPipe, 1F1B and
interleaved 1F1B, a tiny GPT (``examples/gpt.py``) under 1F1B, an MLP whose
skips cross non-adjacent stages (interleaved, four stages on two ranks: the
values are carried through the stages in between), a model whose last stage
reads a model input (int64 tokens) and returns a dict, a tied LM in bf16-mixed
with every stage recomputed under both engines, and a U-Net with BatchNorm under
both engines (the running statistics too must agree).  Slow tier: four ranks, pp=2
x dp=2 (DDP under 1F1B; our replica reducer under interleaved 1F1B and ZB-V,
tied embedding / LM head), the GPT under GPipe and interleaved 1F1B, and fully
sharded (FSDP2) under 1F1B and interleaved 1F1B, ZB-H1 with skips over four
pipeline ranks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from chunked import plan_schedule
from runtime_workers import plan_model
from schedule_workers import compare_with_reference
from torch_engine_workers import train_plans

from partitioner.errors import AutopartitionError
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan, example_plan
from partitioner.search.planner import compile
from runtime.engines.choice import engine_from_env
from runtime.engines.torch_engine import torch_engine_refusal, torch_schedule_name
from runtime.execute.flatstage import carried_values

MODELS = Path(__file__).parent / "models"
GPT = str(Path(__file__).parent.parent / "examples" / "gpt.py")
TIED = str(MODELS / "tied_lm.py")
BN = str(MODELS / "bn_unet.py")
TOLERANCE = 1e-5
STEPS = 3

# name: model file, schedule, pipeline ranks, chunks, dp
_TWO_RANKS = {
    "mlp gpipe": (str(MODELS / "mlp.py"), "gpipe", 2, 1, 1),
    "mlp 1f1b": (str(MODELS / "mlp.py"), "1f1b", 2, 1, 1),
    "mlp interleaved": (str(MODELS / "mlp.py"), "interleaved-1f1b", 2, 2, 1),
    "gpt 1f1b": (GPT, "1f1b", 2, 1, 1),
    "skips interleaved": (str(MODELS / "skip_mlp.py"), "interleaved-1f1b", 2, 2, 1),
    "late input interleaved": (str(MODELS / "late_input.py"), "interleaved-1f1b", 2, 2, 1),
    # Found by hand: a stage whose output is a view (the MoE's reshape) failed torch's in-place detach under zbv.
    "moe zbv": (str(MODELS / "user_moe.py"), "zbv", 2, 2, 1),
}
_FOUR_RANKS = {
    "tied 1f1b 2x2 ddp": (str(MODELS / "tied_lm.py"), "1f1b", 2, 1, 2),
    "tied interleaved 2x2": (str(MODELS / "tied_lm.py"), "interleaved-1f1b", 2, 2, 2),
    "tied zbv 2x2": (str(MODELS / "tied_lm.py"), "zbv", 2, 2, 2),
    "gpt gpipe 2x2": (GPT, "gpipe", 2, 1, 2),
    "gpt interleaved 2x2": (GPT, "interleaved-1f1b", 2, 2, 2),
    "skips zb-h1 P=4": (str(MODELS / "skip_mlp.py"), "zb-h1", 4, 1, 1),
}
_FULLY_SHARDED = {  # name: schedule; the GPT at pp=2 x dp=2, every stage shard="full" (FSDP2)
    "gpt 1f1b 2x2 fsdp2": "1f1b",
    "gpt interleaved 2x2 fsdp2": "interleaved-1f1b",
}


def _train(root: Path, cases: dict[str, tuple[str, str, int, int, int]],
           extra: dict[str, tuple[Plan, Path, str, str]] | None = None) -> dict[str, tuple[Plan, str, Any]]:
    """Plan every case, then train them all (engine torch; ``extra``: planned already, engine given) in one spawn."""
    jobs: dict[str, tuple[Plan, Path, str, str]] = {}
    for k, (name, (spec, schedule, ranks, chunks, dp)) in enumerate(cases.items()):
        directory = root / f"case{k}"
        plan = plan_schedule(spec, directory, ranks=ranks, dp=dp, chunks=chunks, microbatches=4,
                             schedule=schedule, batch=8 if spec == GPT else 16)
        jobs[name] = (plan, directory, spec, "torch")
    jobs.update(extra or {})
    records = train_plans([(d, spec, engine) for _, d, spec, engine in jobs.values()], steps=STEPS)
    return {name: (plan, spec, rec) for (name, (plan, _, spec, _)), rec in zip(jobs.items(), records)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, str, Any]]:
    root = tmp_path_factory.mktemp("torch-engine-2")
    # bf16-mixed with every stage recomputed and a tied weight across the two ranks, under both engines.
    plan = plan_model(TIED, root / "mixed", pp=2, microbatches=4, schedule="1f1b", precision="bf16-mixed",
                      recompute="full")
    extra = {f"mixed {engine}": (plan, root / "mixed", TIED, engine) for engine in ("ours", "torch")}
    # BatchNorm: torch's shape inference runs a forward before the step; its statistics updates must not stay.
    plan = plan_schedule(BN, root / "bn", ranks=2, microbatches=4, schedule="1f1b")
    extra.update({f"bn {engine}": (plan, root / "bn", BN, engine) for engine in ("ours", "torch")})
    return _train(root, _TWO_RANKS, extra)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, str, Any]]:
    root = tmp_path_factory.mktemp("torch-engine-4")
    model_file = load_model_file(GPT)
    sharded: dict[str, tuple[Plan, Path, str, str]] = {}
    for k, (name, schedule) in enumerate(_FULLY_SHARDED.items()):
        torch.manual_seed(0)
        plan = compile(model_file.build(), model_file.example_inputs(8), gpus=4, pp=2, dp=2, microbatches=2,
                       schedule=schedule, device="h100", shard="full")
        assert {s.shard for s in plan.stages} == {"full"}, name
        plan.save(root / f"sharded{k}")
        sharded[name] = (Plan.load(root / f"sharded{k}"), root / f"sharded{k}", GPT, "torch")
    return _train(root, _FOUR_RANKS, sharded)


def _assert_matches(plan: Plan, spec: str, ranks: list[dict[str, Any]]) -> None:
    assert all("refused" not in r for r in ranks), ranks[0].get("refused")
    diff = compare_with_reference(plan, spec, ranks)
    assert diff.largest() <= TOLERANCE, diff
    tied = {a for t in plan.tied for a in t.aliases}
    assert diff.compared >= STEPS * len({n for r in ranks for n in r["grads"][0]} - tied)
    losses = [r["losses"] for r in ranks if r["losses"][0] is not None]
    assert len(losses) == plan.dp, "one loss per replica, on the last stage's ranks"


@pytest.mark.parametrize("case", list(_TWO_RANKS))
def test_torch_engine_matches_whole_model(two_ranks: dict[str, Any], case: str) -> None:
    _assert_matches(*two_ranks[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", [*_FOUR_RANKS, *_FULLY_SHARDED])
def test_torch_engine_with_replicas_matches_whole_model(four_ranks: dict[str, Any], case: str) -> None:
    _assert_matches(*four_ranks[case])


def test_bf16_mixed_and_recomputation_run_as_under_our_engine(two_ranks: dict[str, Any]) -> None:
    """Both engines run the same stage wrappers (autocast, per-layer checkpointing): the same numbers.

    Only the order of float32 additions may differ (the tied weight's two gradients are
    summed after the step under both), so 1e-6 (``test_runtime_precision``'s TIGHT),
    where running any part in float32 instead moves the loss by ~1e-4.
    """
    plan, _, ours = two_ranks["mixed ours"]
    _, _, theirs = two_ranks["mixed torch"]
    assert plan.precision == "bf16-mixed" and {s.recompute for s in plan.stages} == {"full"} and plan.tied
    for mine, other in zip(ours, theirs):
        assert mine["losses"] == pytest.approx(other["losses"], abs=1e-6)
        for step in range(STEPS):
            for key in ("grads", "params"):
                got, want = other[key][step], mine[key][step]
                assert got.keys() == want.keys()
                worst = max(float((got[n] - want[n]).abs().max()) for n in got)
                assert worst <= 1e-6, (key, step, worst)


def test_batchnorm_statistics_are_updated_once_per_microbatch(two_ranks: dict[str, Any]) -> None:
    plan, spec, theirs = two_ranks["bn torch"]
    _, _, ours = two_ranks["bn ours"]
    _assert_matches(plan, spec, theirs)
    for mine, other in zip(ours, theirs):
        assert any("running_mean" in n for n in mine["buffers"])
        assert mine["buffers"].keys() == other["buffers"].keys()
        for name, value in mine["buffers"].items():
            assert torch.equal(other["buffers"][name], value), name


def test_cases_exercise_what_they_claim(two_ranks: dict[str, Any]) -> None:
    """The skip case really skips stages (so values are carried), and every schedule is the one named."""
    plan, _, ranks = two_ranks["skips interleaved"]
    assert any(b.target >= b.source + 2 for s in plan.stages for b in s.inputs), "no boundary skips a stage"
    assert any(len(values) > 1 for values in carried_values(plan))
    assert [r["stages"] for r in ranks] == [(0, 2), (1, 3)]
    assert [torch_schedule_name(two_ranks[c][0]) for c in _TWO_RANKS] == [
        "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "Schedule1F1B", "ScheduleInterleaved1F1B",
        "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"]
    plan, _, _ = two_ranks["late input interleaved"]
    assert any(s.model_inputs for s in plan.stages[1:]), "a later stage reads a model input"


def test_carried_values_cross_every_cut_between_producer_and_reader() -> None:
    plan = example_plan()
    far = dataclasses.replace(plan.stages[0].outputs[0], target=3)
    stages = [dataclasses.replace(plan.stages[0], outputs=(plan.stages[0].outputs[0], far)),
              *[dataclasses.replace(plan.stages[1], index=i, inputs=()) for i in (1, 2, 3)]]
    three = dataclasses.replace(plan, stages=tuple(stages))
    assert carried_values(three) == [("relu",), ("relu",), ("relu",)]  # one value, sent on to stage 3


def test_refusals_say_what_works(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = example_plan()
    assert torch_engine_refusal(plan) is None
    traced = torch_engine_refusal(plan, trace=True)
    assert traced is not None and "--engine ours" in traced
    monkeypatch.delenv("AUTOPARTITION_ENGINE", raising=False)
    assert engine_from_env(None) == "ours" and engine_from_env("torch") == "torch"
    monkeypatch.setenv("AUTOPARTITION_ENGINE", "torch")
    assert engine_from_env(None) == "torch"
    with pytest.raises(AutopartitionError, match="'ours' .* and 'torch'"):
        engine_from_env("megatron")


@pytest.mark.slow
def test_bench_runtime_runs_both_engines_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    from tools import bench_runtime

    tiny = ["--layers", "4", "--embd", "64", "--heads", "2", "--seq", "32", "--batch", "8", "--microbatches", "2"]
    assert bench_runtime.main(["--quick", *tiny, "--rounds", "1", "--steps", "1", "--engines",
                               "--only", "ours_1f1b,engine_1f1b"]) == 0
    text = capsys.readouterr().out
    assert "engine=torch, 1F1B, our plan" in text and "engines [1f1b]: ours" in text and "ours/torch" in text


def test_received_gradients_leave_contiguous() -> None:
    """gloo sends only contiguous tensors: a stage reading its input through a view gets a strided gradient."""
    from runtime.execute.flatstage import _contiguous_grad

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 4)
    (plain,) = torch.autograd.grad((x.t() * w).sum(), x)
    assert not plain.is_contiguous()  # what torch would try to send back
    (guarded,) = torch.autograd.grad((_contiguous_grad(x).t() * w).sum(), x)
    assert guarded.is_contiguous() and torch.equal(guarded, plain)
