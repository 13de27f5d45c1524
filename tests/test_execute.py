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
