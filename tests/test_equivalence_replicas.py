"""Pipeline x data parallel (pp=2 x dp=2) equals unpartitioned training.

Four really spawned CPU ranks (gloo): two stages, each replicated twice with DDP on
its own process group; each replica takes half of every mini-batch.  ``verify``
compares 3 SGD steps (loss, every gradient, final parameters; tolerance 1e-5) with
the whole model trained on the whole mini-batch in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.plan import Plan
from runtime.verify import verify

MODELS = Path(__file__).parent / "models"
EXAMPLES = Path(__file__).parent.parent / "examples"
from planning_helpers import make_plan, parameters_covered

pytestmark = pytest.mark.slow  # spawns ranks

STEPS = 3
TOLERANCE = 1e-5


def check_replica_layout(plan: Plan) -> None:
    """Stage-major ranks: stage s, replica r is rank s * dp + r; replicas take equal halves."""
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    assert plan.rank_layout() == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert plan.microbatch_size * plan.microbatches * plan.dp == plan.batch_size


def run_verify(plan: Plan, plan_dir: Path, spec: str) -> None:
    names, held = parameters_covered(plan, spec)
    assert names <= held, f"no stage holds {sorted(names - held)}"
    result = verify(plan_dir, spec, steps=STEPS, tolerance=TOLERANCE)
    assert result.ok, result.summary()


def test_pp2_dp2_matches_whole_model(tmp_path: Path) -> None:
    spec = str(MODELS / "skip_mlp.py")
    plan = make_plan(spec, tmp_path, pp=2, dp=2, microbatches=2, schedule="1f1b")
    check_replica_layout(plan)
    assert plan.microbatch_size == 2
    run_verify(plan, tmp_path, spec)


def test_pp2_dp2_with_tied_weights(tmp_path: Path) -> None:
    """The tied embedding / LM head gradient is summed across stages within each replica.

    Captured with torch.export (the other tests use the default route), whose graphs are
    specialised to the micro-batch shape that data parallelism halves.
    """
    spec = str(EXAMPLES / "gpt.py")
    plan = make_plan(spec, tmp_path, pp=2, dp=2, microbatches=2, schedule="gpipe", capture_method="export")
    assert plan.model.capture == "export"
    check_replica_layout(plan)
    tied = [t for t in plan.tied if "wte.weight" in t.aliases]
    assert len(tied) == 1 and tied[0].stages == (0, 1), plan.tied
    run_verify(plan, tmp_path, spec)
