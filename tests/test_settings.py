"""compile()'s options as groups (partitioner/search/settings.py): the same plan as the flat keywords.

A group given replaces its defaults; a flat keyword given beside the group that holds it is
refused, naming both; no GPU count is refused.  compile()'s flat defaults are the groups'
defaults (one owner), and every flat keyword is one group's field.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest
import torch
from torch import nn

import partitioner
from partitioner import compile
from partitioner.errors import AutopartitionError
from partitioner.search import planner
from partitioner.search.options import PlanOptions
from partitioner.search.settings import (
    GROUP_OF,
    Cluster,
    Numerics,
    Parallelism,
    Solver,
    settings_of,
)

# compile()'s arguments that belong to no group: what is planned, and how progress is said.
PLAIN = {"model", "example_inputs", "loss_fn", "target", "status"}
GROUPS = {"cluster": Cluster, "parallelism": Parallelism, "numerics": Numerics, "solver": Solver}

# A value other than the default for every flat keyword that still plans the small model below.
FLAT: dict[str, Any] = {
    "gpus": 4, "device": "h100", "memory_per_gpu": 40e9, "gpus_per_node": 2,
    "pp": 2, "dp": 2, "microbatches": 2, "schedule": "1f1b", "chunks": 1, "shard": "none", "shard_span": "world",
    "zero3_unit": "module", "recompute": "none", "expert_imbalance": 1.5, "ep": 1,
    "precision": "bf16-mixed", "fp8_recipe": "rowwise", "optimizer": "sgd", "optimizer_states": 2,
    "bucket_cap_mb": 50.0,
    "capture_method": "symbolic_trace", "max_blocks": 8, "time_limit": 5.0, "refine_simulations": 0,
    "remeasure": True,
}


def _model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), (torch.randn(8, 16),)


def _timeless(plan_json: str) -> str:
    """A plan's JSON without the solver's wall-clock seconds."""
    return re.sub(r'"wall_s": [-+.0-9eE]+', '"wall_s": 0', plan_json)


def _grouped(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` as compile()'s four group arguments."""
    return {group: cls(**{k: v for k, v in flat.items() if GROUP_OF[k] == group}) for group, cls in GROUPS.items()}


@pytest.fixture
def options(monkeypatch: pytest.MonkeyPatch) -> list[PlanOptions]:
    """The PlanOptions each compile() checked, in call order."""
    seen: list[PlanOptions] = []
    check = planner.check_options

    def recorded(**kwargs: Any) -> PlanOptions:
        seen.append(check(**kwargs))
        return seen[-1]

    monkeypatch.setattr(planner, "check_options", recorded)
    return seen


def test_every_flat_keyword_is_one_groups_field() -> None:
    parameters = inspect.signature(compile).parameters
    assert set(parameters) == PLAIN | set(GROUPS) | set(GROUP_OF)
    assert set(FLAT) | {"nvlink_domain", "tp", "calibration", "priced_only"} == set(GROUP_OF)


def test_compiles_flat_defaults_are_the_groups_defaults() -> None:
    parameters = inspect.signature(compile).parameters
    for name, group in GROUP_OF.items():
        field = next(f for f in dataclasses.fields(GROUPS[group]) if f.name == name)
        default = None if field.default is dataclasses.MISSING else field.default
        assert parameters[name].default == default, f"compile()'s {name} default differs from {GROUPS[group].__name__}'s"
    assert all(parameters[group].default is None for group in GROUPS)


def test_groups_and_flat_keywords_plan_alike(options: list[PlanOptions]) -> None:
    model, inputs = _model()
    flat = compile(model, inputs, **FLAT)
    grouped = compile(model, inputs, **_grouped(FLAT))
    assert len(options) == 2 and options[0] == options[1]
    assert (options[0].gpus, options[0].pp, options[0].microbatches, options[0].precision) == (4, 2, 2, "bf16-mixed")
    assert _timeless(flat.to_json()) == _timeless(grouped.to_json())


def test_some_groups_and_the_other_options_flat(options: list[PlanOptions]) -> None:
    model, inputs = _model()
    compile(model, inputs, gpus=2, device="h100", microbatches=2, precision="bf16")
    compile(model, inputs, cluster=Cluster(gpus=2, device="h100"), microbatches=2, numerics=Numerics(precision="bf16"))
    assert options[0] == options[1]


def test_the_package_exports_the_groups() -> None:
    assert (partitioner.Cluster, partitioner.Parallelism, partitioner.Numerics, partitioner.Solver) == (
        Cluster, Parallelism, Numerics, Solver)
    with pytest.raises(TypeError):
        Cluster(8)  # type: ignore[misc]  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        Cluster(gpus=8).gpus = 4  # type: ignore[misc]


@pytest.mark.parametrize(("flat", "groups", "named"), [
    ({"gpus": 2}, {"cluster": Cluster(gpus=2)}, ("gpus=2", "cluster=", "Cluster(..., gpus=2)")),
    ({"gpus": 2, "pp": 2}, {"parallelism": Parallelism(dp=2)}, ("pp=2", "parallelism=", "Parallelism(..., pp=2)")),
    ({"gpus": 2, "precision": "bf16", "optimizer": "sgd"}, {"numerics": Numerics()},
     ("precision='bf16', optimizer='sgd'", "numerics=")),
    ({"gpus": 2, "time_limit": 1.0}, {"solver": Solver(max_blocks=8)}, ("time_limit=1.0", "solver=")),
])
def test_a_flat_keyword_beside_its_group_is_refused(flat: dict[str, Any], groups: dict[str, Any],
                                                    named: tuple[str, ...]) -> None:
    model, inputs = _model()
    with pytest.raises(AutopartitionError) as caught:
        compile(model, inputs, **flat, **groups)
    for text in named:
        assert text in str(caught.value)
    assert "pass every" in str(caught.value)  # and what to do


def test_a_default_passed_flat_beside_its_group_is_no_conflict() -> None:
    cluster, parallelism, _, _ = settings_of({"gpus": None, "pp": None, "microbatches": 8},
                                             cluster=Cluster(gpus=8), parallelism=Parallelism(pp=2))
    assert (cluster.gpus, parallelism.pp, parallelism.microbatches) == (8, 2, 8)


def test_no_gpu_count_is_refused() -> None:
    model, inputs = _model()
    with pytest.raises(AutopartitionError, match=r"needs the GPU count: gpus=8 or cluster=Cluster\(gpus=8"):
        compile(model, inputs, device="h100")
    with pytest.raises(AutopartitionError, match="needs the GPU count"):
        compile(model, inputs, parallelism=Parallelism(pp=2))


def test_a_group_of_the_wrong_class_is_refused() -> None:
    model, inputs = _model()
    with pytest.raises(AutopartitionError, match="cluster= takes a Cluster"):
        compile(model, inputs, cluster=Parallelism(pp=2))  # type: ignore[arg-type]


def test_an_unknown_flat_keyword_is_a_bug() -> None:
    with pytest.raises(TypeError, match="gpu_count"):
        settings_of({"gpus": 2, "gpu_count": 2})
