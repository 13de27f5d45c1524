"""Every plan the planner picks runs: models nobody tuned for x every schedule.

Each cell (``tools/model_matrix.py``) plans one model for one schedule on 2 pipeline
ranks (``auto``: 4 GPUs as 2 stages x 2 replicas, the schedule and micro-batches chosen
by the planner)
and must then train like the unpartitioned model (fp32, 1e-5), unless the planner
refused it, before any rank started, with the reason in ``REFUSED``.  A refusal nobody
expected, an expected refusal that now plans, and a plan that trains differently all fail.

* Default tier, one row per model (``DEFAULT_SCHEDULE``: every schedule is exercised, on
  models of several kinds): the plan's action lists run through the real
  :class:`runtime.execute.runner.StepRunner`, every pipeline rank a thread of this process over
  in-memory channels (``tests/models/inprocess.py``), against the whole model run on the
  same micro-batches.  Rows with replicas (``auto``) or random ops (two forwards differ:
  dropout's masks would differ between threads) run ``verify`` on spawned CPU ranks instead.
* Exhaustive tier, every other cell: ``verify`` on spawned ranks, 2 steps::

    AUTOPARTITION_EXHAUSTIVE=1 bash scripts/test.sh tests/test_model_matrix.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import assert_matches_whole_model, run_stages  # type: ignore[import-not-found]  # tests/models

from partitioner.errors import AutopartitionError
from partitioner.graph.capture import CallSpec
from partitioner.modelfile import load_model_file
from tools.model_matrix import (
    DEFAULT_SCHEDULE,
    MODELS,
    REFUSED,
    ROOT,
    SCHEDULES,
    plan_cell,
    run_cell,
)

_HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
_TOLERANCE = 1e-5


def _cells(*, default: bool) -> list[tuple[str, str]]:
    return [(m, s) for m in MODELS for s in SCHEDULES if (DEFAULT_SCHEDULE[m] == s) == default]


def _needs(model: str) -> None:
    if MODELS[model].hf and not _HAS_TRANSFORMERS:
        pytest.skip("needs transformers (the dev extra)")


def _check_spawned(model: str, schedule: str, tmp_path: Path) -> None:
    result = run_cell(model, schedule, tmp_path)
    expected = REFUSED.get((model, schedule))
    if expected is None:
        assert result.outcome == "verified", f"{model} x {schedule} ({result.chosen}): {result.detail}"
    else:
        assert result.outcome == "refused", f"{model} x {schedule}: {expected!r} expected, got {result.detail}"
        assert expected in result.detail, result.detail


def _draws_randomly(build: Any, inputs: Any) -> bool:
    """Whether two training-mode forwards of one model on one batch differ (dropout and other random ops)."""
    call, flat = CallSpec.of(inputs)
    model, (args, kwargs) = build(), call.rebuild(flat)
    with torch.no_grad():
        first, second = (torch.utils._pytree.tree_leaves(model(*args, **kwargs)) for _ in range(2))
    return any(isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize(("model", "schedule"), _cells(default=True))
def test_default_row_trains_like_the_whole_model(tmp_path: Path, model: str, schedule: str) -> None:
    _needs(model)
    entry = MODELS[model]
    model_file = load_model_file(str(ROOT / entry.spec))
    try:
        plan = plan_cell(model, schedule)
    except AutopartitionError as exc:
        assert (model, schedule) in REFUSED, f"{model} x {schedule} was refused: {exc}"
        assert REFUSED[model, schedule] in str(exc), str(exc)
        return
    inputs = model_file.example_inputs(entry.batch)
    if plan.dp > 1 or _draws_randomly(model_file.build, inputs):
        _check_spawned(model, schedule, tmp_path)
        return
    target = model_file.example_target(entry.batch) if model_file.loss_fn and model_file.example_target else None
    got = run_stages(plan, model_file.build, inputs, target, model_file.loss_fn)
    label = f"{model} x {plan.schedule} ({plan.pp}x{plan.dp}, M={plan.microbatches})"
    assert_matches_whole_model(plan, model_file.build, inputs, target, model_file.loss_fn, got,
                               tolerance=_TOLERANCE, label=label)


@pytest.mark.slow  # plans, then spawns 2 or 4 ranks
@pytest.mark.exhaustive
@pytest.mark.parametrize(("model", "schedule"), _cells(default=False))
def test_cell_verifies_on_ranks_or_is_refused_with_its_reason(tmp_path: Path, model: str, schedule: str) -> None:
    _needs(model)
    _check_spawned(model, schedule, tmp_path)


def test_every_model_has_one_default_row_and_every_schedule_is_in_the_default_tier() -> None:
    assert set(DEFAULT_SCHEDULE) == set(MODELS)
    assert set(DEFAULT_SCHEDULE.values()) == set(SCHEDULES)
    assert all(cell[0] in MODELS and cell[1] in SCHEDULES for cell in REFUSED)
