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

import pytest
import torch
from inprocess import run_stages
from planning_helpers import make_plan

from partitioner.modelfile import load_model_file

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
