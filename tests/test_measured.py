"""partitioner.cost.measured: a model measured once is planned again from the same numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import partitioner
from partitioner.cost import measured


@pytest.fixture(autouse=True)
def _fresh() -> None:
    measured.forget_all()


def _mlp(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def _compile(model: nn.Module, width: int = 32, **options: object) -> tuple[partitioner.Plan, list[str]]:
    said: list[str] = []
    plan = partitioner.compile(model, (torch.randn(8, width),), gpus=2, microbatches=2, device="cpu",
                               status=said.append, **options)  # type: ignore[arg-type]
    return plan, said


def test_a_second_compile_plans_from_the_first_measurement() -> None:
    _, said = _compile(_mlp(), schedule="zb-h1", pp=2)
    assert not any("measured earlier" in line for line in said)
    # Other schedules, same model: the same costs (they need no W shares; zb-h1's have them).
    # (Not compared with zb-h1's own stages: a split backward adds its cost to F.)
    plans = []
    for schedule in ("1f1b", "gpipe"):
        plan, said = _compile(_mlp(), schedule=schedule, pp=2)
        assert any("as measured earlier in this process" in line for line in said)
        plans.append(plan)
    f1, f2 = (sum(s.predicted.forward_s for s in plan.stages) for plan in plans)
    assert f1 == pytest.approx(f2, rel=1e-9)  # one measurement (a second would differ by far more)


def test_remeasure_or_another_shape_measures_again() -> None:
    _compile(_mlp())
    _, said = _compile(_mlp(), remeasure=True)
    assert not any("measured earlier" in line for line in said)
    _, said = _compile(_mlp(48), width=48)  # same graph, other tensor shapes
    assert not any("measured earlier" in line for line in said)


def test_weight_shares_are_measured_when_first_needed() -> None:
    _compile(_mlp(), schedule="1f1b")  # measured without W shares
    _, said = _compile(_mlp(), schedule="zbv", pp=1)  # needs them: measured again
    assert not any("measured earlier" in line for line in said)
    _, said = _compile(_mlp(), schedule="gpipe")  # has them now
    assert any("measured earlier" in line for line in said)


def test_counted_costs_are_not_kept() -> None:
    said: list[str] = []
    for _ in range(2):
        partitioner.compile(_mlp(), (torch.randn(8, 32),), gpus=2, microbatches=2, device="h100", status=said.append)
    assert not any("measured earlier" in line for line in said)
