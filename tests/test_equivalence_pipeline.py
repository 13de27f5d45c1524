"""Pipelined training equals unpartitioned training (really spawned CPU ranks, gloo, fp32).

Each test plans a model file with a fixed shape (``pp``, ``microbatches``, schedule;
predicted h100 costs, so the split is deterministic), saves the plan, and runs
``runtime.verify.verify``: ``plan.gpus`` ranks train 3 SGD steps through ``Pipeline``
and every step's loss, every gradient and the final parameters are compared with the
same training of the whole model in one process (tolerance 1e-5; on failure the
summary names the worst parameter).  Structural assertions make sure each test
exercises what its name says (a skip crossing two boundaries, a tied weight held
by two stages, a model input read by a later stage, ...).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from runtime.verify import VerifyResult, verify

MODELS = Path(__file__).parent / "models"
EXAMPLES = Path(__file__).parent.parent / "examples"
from planning_helpers import make_plan, parameters_covered

pytestmark = pytest.mark.slow  # spawns ranks

STEPS = 3
TOLERANCE = 1e-5
MLP = str(MODELS / "mlp.py")


def run_verify(plan: Plan, plan_dir: Path, spec: str) -> VerifyResult:
    """Verify a saved plan; also check that the plan holds every parameter of the model."""
    names, held = parameters_covered(plan, spec)
    assert names <= held, f"no stage holds {sorted(names - held)}"
    result = verify(plan_dir, spec, steps=STEPS, tolerance=TOLERANCE)
    assert result.ok, result.summary()
    assert result.steps == STEPS and len(result.losses) == STEPS
    return result


def crossing(plan: Plan) -> list[tuple[str, int, int]]:
    """Boundary tensors that skip at least one stage: (producer, from stage, to stage)."""
    return sorted({(b.producer, b.source, b.target) for s in plan.stages for b in s.inputs
                   if b.target >= b.source + 2})


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_whole_model(tmp_path: Path, pp: int, schedule: str) -> None:
    plan = make_plan(MLP, tmp_path, pp=pp, microbatches=4, schedule=schedule)
    # Every stage computes something and each passes its activation to the next.
    assert all(s.compute_nodes > 0 for s in plan.stages)
    for s in plan.stages[1:]:
        assert {b.source for b in s.inputs} == {s.index - 1}
    run_verify(plan, tmp_path, MLP)


def test_single_microbatch(tmp_path: Path) -> None:
    """M=1: naive model parallelism (one micro-batch, the whole mini-batch)."""
    plan = make_plan(MLP, tmp_path, pp=2, microbatches=1, schedule="gpipe")
    assert plan.microbatch_size == 8
    assert all(b.shape[0] == 8 for s in plan.stages for b in s.inputs)
    run_verify(plan, tmp_path, MLP)


def test_two_inputs_and_dict_output(tmp_path: Path) -> None:
    spec = str(EXAMPLES / "two_inputs.py")
    plan = make_plan(spec, tmp_path, pp=2, microbatches=2, schedule="1f1b")
    # Both inputs are planned and read by some stage; the model returns a dict of two tensors.
    assert [t.name for t in plan.model.inputs] == ["features", "tokens"]
    assert {n for s in plan.stages for n in s.model_inputs} == {"features", "tokens"}
    assert len(plan.model.outputs) == 2
    model_file = load_model_file(spec)
    out = model_file.build()(*model_file.example_inputs(2))
    assert isinstance(out, dict) and set(out) == {"logits", "aux"}
    run_verify(plan, tmp_path, spec)


def test_input_read_by_a_later_stage_and_early_dict_entry(tmp_path: Path) -> None:
    """A model input consumed only by the last stage, and an output computed on the first."""
    spec = str(MODELS / "late_input.py")
    plan = make_plan(spec, tmp_path, pp=3, microbatches=2, schedule="1f1b")
    readers = {n: [s.index for s in plan.stages if n in s.model_inputs] for n in ("features", "tokens")}
    assert readers == {"features": [0], "tokens": [2]}, readers
    assert crossing(plan), "the early output should travel from stage 0 straight to stage 2"
    # The loss_fn of late_input.py asserts that it receives a dict.
    run_verify(plan, tmp_path, spec)


def test_skip_connection_crossing_two_boundaries(tmp_path: Path) -> None:
    spec = str(MODELS / "skip_mlp.py")
    plan = make_plan(spec, tmp_path, pp=4, microbatches=4, schedule="1f1b")
    skips = crossing(plan)
    assert skips, f"no boundary tensor skips a stage: {[s.inputs for s in plan.stages]}"
    assert any(target - source >= 3 for _, source, target in skips), skips  # crosses 3 boundaries
    # A tensor sent to several stages (its gradients are summed on the way back).
    targets: dict[tuple[str, int], set[int]] = {}
    for s in plan.stages:
        for b in s.outputs:
            targets.setdefault((b.producer, b.source), set()).add(b.target)
    assert any(len(t) >= 2 for t in targets.values()), targets
    run_verify(plan, tmp_path, spec)


def test_tied_embedding_and_lm_head(tmp_path: Path) -> None:
    spec = str(EXAMPLES / "gpt.py")
    plan = make_plan(spec, tmp_path, pp=4, microbatches=2, schedule="gpipe", batch=4)
    tied = [t for t in plan.tied if {"wte.weight", "lm_head.weight"} <= set(t.aliases)]
    assert len(tied) == 1, plan.tied
    assert tied[0].stages == (0, 3), "the embedding lives on the first stage, the LM head on the last"
    for s in plan.stages:
        holds = bool(set(s.parameters) & set(tied[0].aliases))
        assert holds == (s.index in (0, 3)), f"stage {s.index} parameters {s.parameters}"
    run_verify(plan, tmp_path, spec)


def test_hugging_face_gpt2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    spec = str(EXAMPLES / "hf_gpt2.py")
    plan = make_plan(spec, tmp_path, pp=2, microbatches=2, schedule="1f1b", batch=4)
    assert plan.model.class_name == "GPT2LMHeadModel"
    tied = [t for t in plan.tied if "transformer.wte.weight" in t.aliases]
    assert len(tied) == 1 and len(set(tied[0].stages)) == 2, plan.tied
    run_verify(plan, tmp_path, spec)


def test_verify_notices_a_wrong_pipeline(tmp_path: Path) -> None:
    """The comparison itself can fail: a model file whose pipelined run differs is caught."""
    spec = str(MODELS / "rank_dependent.py")
    make_plan(spec, tmp_path, pp=2, microbatches=2, schedule="gpipe")
    result = verify(tmp_path, spec, steps=STEPS, tolerance=TOLERANCE)
    assert not result.ok, result.summary()
    assert result.summary().startswith("MISMATCH")
    assert TOLERANCE < result.max_loss_diff < 1.0 and TOLERANCE < result.max_grad_diff < 1.0
    assert result.worst_grad != "-" and " on rank " in result.worst_grad  # names the parameter
