"""Interleaved and zero-bubble schedules equal unpartitioned training (issue 11).

* In one process (``inprocess.run_stages``, a thread per pipeline rank):
  loss and every gradient of one step equal the whole model's on the same
  micro-batches, for many shapes of ``interleaved-1f1b``, ``zb-h1`` and ``zbv``.
* Spawned gloo ranks (one spawn for every plan, ``schedule_workers``): three
  SGD steps of each schedule with ``pp x dp = 2 x 2`` and a tied embedding / LM
  head (for ``zbv`` both on rank 0: one shared Parameter), and with four
  pipeline ranks; every step's loss, gradients and updated parameters match the
  whole model (fp32, 1e-5).

Plans come from the planner (``chunked.plan_schedule``: ``partitioner.compile``
with the schedule), with predicted h100 costs so the splits are deterministic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chunked import plan_schedule
from inprocess import assert_matches_whole_model, run_stages
from schedule_workers import compare_with_reference, train_plans

from partitioner.defaults import DEFAULT_BUCKET_CAP_MB
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan

MODELS = Path(__file__).parent / "models"
TOLERANCE = 1e-5


def _plan(tmp: Path, model: str, schedule: str, *, ranks: int, chunks: int, dp: int = 1,
          microbatches: int = 4, batch: int = 16, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> Plan:
    plan = plan_schedule(str(MODELS / f"{model}.py"), tmp, ranks=ranks, dp=dp, chunks=chunks,
                         microbatches=microbatches, schedule=schedule, batch=batch, bucket_cap_mb=bucket_cap_mb)
    assert (plan.pp, plan.chunks, plan.dp, plan.schedule) == (ranks, chunks, dp, schedule)
    assert len(plan.stages) == ranks * chunks
    return plan


# ------------------------------------------------------------------ in process

_SHAPES = [  # model, schedule, pipeline ranks, chunks, micro-batches
    ("mlp", "interleaved-1f1b", 2, 2, 4),
    ("mlp", "interleaved-1f1b", 2, 4, 2),
    ("mlp", "interleaved-1f1b", 4, 2, 8),
    ("mlp", "zb-h1", 4, 1, 8),
    ("mlp", "zb-h1", 2, 1, 1),
    ("mlp", "zbv", 2, 2, 4),
    ("mlp", "zbv", 4, 2, 8),
    ("mlp", "zbv", 2, 2, 1),
    ("skip_mlp", "zb-h1", 4, 1, 4),
    ("tied_lm", "interleaved-1f1b", 2, 2, 4),
    ("tied_lm", "zb-h1", 2, 1, 4),
    ("tied_lm", "zbv", 2, 2, 4),
]


@pytest.mark.parametrize(("model", "schedule", "ranks", "chunks", "microbatches"), _SHAPES)
def test_one_step_in_process_matches_whole_model(
    tmp_path: Path, model: str, schedule: str, ranks: int, chunks: int, microbatches: int
) -> None:
    batch = 16 if microbatches > 1 else 4
    plan = _plan(tmp_path, model, schedule, ranks=ranks, chunks=chunks, microbatches=microbatches, batch=batch)
    mf = load_model_file(str(MODELS / f"{model}.py"))
    assert mf.loss_fn is not None and mf.example_target is not None
    inputs, target = mf.example_inputs(batch), mf.example_target(batch)

    got = run_stages(plan, mf.build, inputs, target, mf.loss_fn, every_parameter=True)

    assert_matches_whole_model(plan, mf.build, inputs, target, mf.loss_fn, got, tolerance=TOLERANCE)


# -------------------------------------------------------------- spawned ranks

_DEFAULT = DEFAULT_BUCKET_CAP_MB
_SPAWNED = {  # name: model, schedule, pipeline ranks, chunks, dp, micro-batches, bucket MiB (4 ranks each)
    "interleaved 2x2 tied": ("tied_lm", "interleaved-1f1b", 2, 2, 2, 4, _DEFAULT),
    "zb-h1 2x2 tied": ("tied_lm", "zb-h1", 2, 1, 2, 4, _DEFAULT),
    # ~1 KiB buckets: the replicas' gradients travel in several all-reduces.
    "zbv 2x2 tied on one rank": ("tied_lm", "zbv", 2, 2, 2, 4, 0.001),
    "interleaved P=4": ("mlp", "interleaved-1f1b", 4, 2, 1, 4, _DEFAULT),
    "zb-h1 P=4 skips": ("skip_mlp", "zb-h1", 4, 1, 1, 4, _DEFAULT),
    "zbv P=4": ("mlp", "zbv", 4, 2, 1, 4, _DEFAULT),
}
STEPS = 3


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, str, list[dict[str, Any]]]]:
    """Plan every case, then train them all in one spawn of four ranks (shared by the tests below)."""
    root = tmp_path_factory.mktemp("schedules")
    jobs: dict[str, tuple[Plan, Path, str]] = {}
    for k, (name, (model, schedule, ranks, chunks, dp, mbs, bucket)) in enumerate(_SPAWNED.items()):
        directory = root / f"case{k}"
        plan = _plan(directory, model, schedule, ranks=ranks, chunks=chunks, dp=dp, microbatches=mbs,
                     bucket_cap_mb=bucket)
        jobs[name] = (plan, directory, str(MODELS / f"{model}.py"))
    records = train_plans([(d, spec) for _, d, spec in jobs.values()], steps=STEPS)
    return {name: (plan, spec, rec) for (name, (plan, _, spec)), rec in zip(jobs.items(), records)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_SPAWNED))
def test_spawned_ranks_match_whole_model(spawned: dict[str, Any], case: str) -> None:
    plan, spec, ranks = spawned[case]
    diff = compare_with_reference(plan, spec, ranks)
    assert diff.largest() <= TOLERANCE, diff
    held = {n for r in ranks for n in r["grads"][0]}
    model = load_model_file(spec).build()
    names = set(dict(model.named_parameters(remove_duplicate=False)))
    tied = {a for t in plan.tied for a in t.aliases}
    assert names - tied <= held, f"no rank computed a gradient of {sorted(names - tied - held)}"
    assert diff.compared >= len(names - tied) * STEPS


@pytest.mark.slow
def test_spawned_layouts_are_what_the_cases_claim(spawned: dict[str, Any]) -> None:
    """Each case exercises what its name says: several stages per rank, where the tied weight lives, W actions."""
    plan, _, ranks = spawned["zbv 2x2 tied on one rank"]
    (tie,) = plan.tied
    assert tie.stages == (0, 3) and {plan.stages[s].rank for s in tie.stages} == {0}
    assert [r["stages"] for r in ranks] == [(0, 3), (0, 3), (1, 2), (1, 2)]
    # Rank 0's embedding and LM head are one Parameter: one gradient, under its first name.
    assert "wte.weight" in ranks[0]["grads"][0] and "lm_head.weight" not in ranks[0]["grads"][0]
    plan, _, ranks = spawned["interleaved 2x2 tied"]
    (tie,) = plan.tied
    assert {plan.stages[s].rank for s in tie.stages} == {0, 1}, "tied across ranks"
    assert [r["stages"] for r in ranks] == [(0, 2), (0, 2), (1, 3), (1, 3)]
    for name in ("zb-h1 2x2 tied", "zb-h1 P=4 skips", "zbv P=4"):
        assert any("W" in a for row in spawned[name][0].actions for a in row), name
    plan, _, _ = spawned["zb-h1 P=4 skips"]
    assert any(b.target >= b.source + 2 for s in plan.stages for b in s.inputs), "a boundary skips a stage"
