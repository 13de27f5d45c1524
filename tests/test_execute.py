"""``StepRunner`` in one process: every stage of a plan, one thread each, over an in-memory communicator.

The multi-process tests (``test_equivalence_pipeline.py``) spawn gloo ranks; these run
the same action lists with the real ``StepRunner`` but move tensors through queues
(``tests/models/inprocess.py``, injected through ``StepRunner(comm=...)``), so a schedule bug
shows up in a second, with a readable traceback.  Each stage runs in its own thread
because a stage blocks on its receives, as a rank would.  Loss and every gradient must
equal one unpartitioned forward and backward of the whole mini-batch (fp32, 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import assert_matches_whole_model, run_stages
from planning_helpers import make_plan

from partitioner.graph.meetings import inputs_written_in_place
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from runtime.execute.stage import build_local_stages

_MODELS = Path(__file__).parent / "models"
_TOLERANCE = 1e-5


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

    loss, grads = run_stages(
        plan, model_file.build, inputs, target, model_file.loss_fn, every_parameter=True
    )

    whole = model_file.build()
    want = model_file.loss_fn(whole(*inputs), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=_TOLERANCE)
    expected = {n: p.grad for n, p in whole.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=_TOLERANCE, msg=name)


def test_two_stages_per_rank_message_only_across_ranks(tmp_path: Path) -> None:
    """zbv on 2 ranks: stages 1 and 2 share rank 1 (no message), tags name stage, direction and micro-batch."""
    from chunked import plan_schedule

    spec = str(_MODELS / "mlp.py")
    M = 4
    plan = plan_schedule(spec, tmp_path, ranks=2, microbatches=M, schedule="zbv")
    assert plan.stage_ranks() == (0, 1, 1, 0) and plan.sends_to() == ((1,), (2,), (3,), ())
    model_file = load_model_file(spec)
    assert model_file.loss_fn is not None and model_file.example_target is not None
    messages: list[tuple[int, int, int, int]] = []

    run_stages(plan, model_file.build, model_file.example_inputs(16), model_file.example_target(16),
               model_file.loss_fn, every_parameter=True, messages=messages)

    def tag(stage: int, direction: str, mb: int) -> int:  # into `stage`: activations 2t, gradients 2s + 1
        return (2 * stage + (direction == "B")) * M + mb

    expected = sorted(
        [(0, 1, tag(1, "F", m), 1) for m in range(M)]      # 0 -> 1 activations
        + [(1, 0, tag(3, "F", m), 1) for m in range(M)]    # 2 -> 3 activations
        + [(0, 1, tag(2, "B", m), 1) for m in range(M)]    # 3 -> 2 gradients
        + [(1, 0, tag(0, "B", m), 1) for m in range(M)]    # 1 -> 0 gradients
    )
    assert sorted(messages) == expected


# ------------------------------------------- issue 18: convolutions split, inputs written in place

_EXAMPLES = _MODELS.parent.parent / "examples"
_SPECS = {"cnn": _EXAMPLES / "cnn.py", "unet_groupnorm": _MODELS / "unet_groupnorm.py",
          "resnet_inplace": _MODELS / "resnet_inplace.py"}
# (model, schedule, micro-batches, batch), 3 pipeline ranks.  The ResNet's plans cut right before a block's
# in-place ReLU (asserted below), which then writes into the tensor its stage received.
_CASES = {
    "resnet gpipe": ("resnet_inplace", "gpipe", 4, 12),
    "resnet 1f1b": ("resnet_inplace", "1f1b", 6, 12),
    "resnet zb-h1": ("resnet_inplace", "zb-h1", 6, 12),
    "unet zb-h1": ("unet_groupnorm", "zb-h1", 3, 6),
    "unet zbv": ("unet_groupnorm", "zbv", 3, 6),
    "cnn zb-h1": ("cnn", "zb-h1", 3, 6),
    "cnn zbv": ("cnn", "zbv", 3, 6),
}
_IN_PROCESS = ["resnet gpipe", "resnet 1f1b", "resnet zb-h1", "unet zbv"]  # the rest: spawned (slow)


def _plan_case(case: str, directory: Path) -> tuple[Plan, str]:
    from chunked import plan_schedule

    model, schedule, microbatches, batch = _CASES[case]
    spec = str(_SPECS[model])
    plan = plan_schedule(spec, directory, ranks=3, microbatches=microbatches, schedule=schedule, batch=batch)
    if model == "resnet_inplace":
        stages = build_local_stages(plan, load_model_file(spec).build(), range(len(plan.stages)))
        written = {s.plan.index: inputs_written_in_place(s.module) & {f"recv_{n}" for n in s.signature.received}
                   for s in stages}
        assert any(written.values()), f"{case}: no stage writes a received tensor in place: the test tests nothing"
    return plan, spec


@pytest.mark.parametrize("case", _IN_PROCESS)
def test_in_place_writes_and_split_convolutions_in_one_process(tmp_path: Path, case: str) -> None:
    """One step of every rank equals the whole model run on the same micro-batches (BatchNorm: per micro-batch)."""
    plan, spec = _plan_case(case, tmp_path)
    mf = load_model_file(spec)
    assert mf.loss_fn is not None and mf.example_target is not None
    inputs, target = mf.example_inputs(plan.batch_size), mf.example_target(plan.batch_size)

    got = run_stages(plan, mf.build, inputs, target, mf.loss_fn, every_parameter=True)

    assert_matches_whole_model(plan, mf.build, inputs, target, mf.loss_fn, got, tolerance=_TOLERANCE, label=case)


_STEPS = 3


@pytest.fixture(scope="module")
def spawned_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, str, list[dict[str, Any]]]]:
    """Every case trained for three SGD steps in one spawn of three gloo ranks."""
    from schedule_workers import train_plans

    root = tmp_path_factory.mktemp("issue18")
    jobs = {case: (*_plan_case(case, root / f"case{k}"), root / f"case{k}") for k, case in enumerate(_CASES)}
    records = train_plans([(d, spec) for _, spec, d in jobs.values()], steps=_STEPS)
    return {case: (plan, spec, rec) for (case, (plan, spec, _)), rec in zip(jobs.items(), records)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_CASES))
def test_spawned_ranks_match_whole_model(spawned_cases: dict[str, Any], case: str) -> None:
    """Loss, gradients and parameters of three steps on spawned ranks equal the whole model's (fp32, 1e-5)."""
    from schedule_workers import compare_with_reference

    plan, spec, ranks = spawned_cases[case]
    diff = compare_with_reference(plan, spec, ranks)
    print(f"{case}: max difference {diff.largest():.3g} (loss {diff.loss:.3g}, grad {diff.grad:.3g}, "
          f"param {diff.param:.3g}, {diff.compared} gradients compared)")
    assert diff.largest() <= _TOLERANCE, diff
    names = {n for n, _ in load_model_file(spec).build().named_parameters()}
    assert diff.compared >= len(names) * _STEPS


def test_an_only_stage_defers_its_whole_backward_to_w(tmp_path: Path) -> None:
    """zb-h1 with one stage (pp = 1): nothing received needs a gradient, so B has nothing to do and W all."""
    from chunked import plan_schedule

    spec = str(_SPECS["unet_groupnorm"])
    plan = plan_schedule(spec, tmp_path, ranks=1, microbatches=2, schedule="zb-h1", batch=4)
    assert any(a.kind == "W" for row in plan.schedule_data().actions for a in row)
    mf = load_model_file(spec)
    assert mf.loss_fn is not None and mf.example_target is not None
    inputs, target = mf.example_inputs(4), mf.example_target(4)

    loss, grads = run_stages(plan, mf.build, inputs, target, mf.loss_fn, every_parameter=True)

    whole = mf.build()
    want = mf.loss_fn(whole(*inputs), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=_TOLERANCE)
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=_TOLERANCE, msg=name)


def test_a_stage_found_unsplittable_runs_whole_on_every_micro_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph check runs on a stage's first micro-batch only; what it finds holds for the later ones."""
    from chunked import plan_schedule

    from partitioner.graph.splitbackward import SplitBackward
    from runtime.execute.runner import StepRunner

    spec = str(_MODELS / "mlp.py")
    plan = plan_schedule(spec, tmp_path, ranks=2, microbatches=4, schedule="zb-h1")
    monkeypatch.setattr(SplitBackward, "_leak", lambda self, active, inputs: "a hidden weight")
    noted: list[tuple[int, str]] = []
    monkeypatch.setattr(StepRunner, "_note_unsplit", lambda self, stage, why: noted.append((stage, why)))
    ran: list[tuple[int, str | None]] = []  # (stage marked by its parameter count, why whole) per W
    weights = SplitBackward.backward_weights

    def backward_weights(self: SplitBackward) -> None:
        ran.append((len(self._meetings), self.unsplit))
        weights(self)

    monkeypatch.setattr(SplitBackward, "backward_weights", backward_weights)
    mf = load_model_file(spec)
    assert mf.loss_fn is not None and mf.example_target is not None

    _, grads = run_stages(plan, mf.build, mf.example_inputs(16), mf.example_target(16), mf.loss_fn,
                          every_parameter=True)

    assert noted == [(1, "a hidden weight")]  # stage 0 receives nothing: no check, nothing to find
    assert len(ran) == 2 * 4
    assert sum(why == "a hidden weight" for _, why in ran) == 4, ran
    whole = mf.build()
    mf.loss_fn(whole(*mf.example_inputs(16)), mf.example_target(16)).backward()
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=_TOLERANCE, msg=name)
