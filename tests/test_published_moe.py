"""Published mixture-of-experts runs (tools/published/moe.py, issue 32): their data and how they are priced.

Fast: every run's expert-parallel degree divides its replicas and its model's experts (the
published EP folded where Megatron's exceeds DP, and said so), the model shapes match the
model files, sources and counting rules are present, FP8 rows are listed not priced, the
held-out rows are never fitted, and the validation tool passes ``ep`` and the run's NVLink
domain through to the planner.  Pricing the large plans takes minutes: ``tools/validate_published.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from partitioner.cost.devices import device_spec
from partitioner.search.price import Layout
from tests._examples import example
from tools import validate_published as validate
from tools.published import (
    CALIBRATION_RUNS,
    GENERATIONS,
    RUNS,
    SOURCES,
    figure_from_step,
    run_named,
)
from tools.published.moe import DEEPSEEK_V3, MEGATRON_BRIDGE_MOE, MOE, MOE_MODELZOO, fold_ep
from tools.published.run import PublishedRun


def _experts(spec: str) -> int:
    """Routed experts per layer of ``spec``'s model, read off the model file's published shape."""
    path, _, factory = spec.partition(":")
    if path == "examples/deepseek_v3.py":
        return int(example("deepseek_v3").DEEPSEEK_V3_671B.experts)
    config = example("moe").SHAPES[factory].config
    return int(config.get("num_experts", config.get("num_local_experts", 0)))


def _published_ep(run: PublishedRun) -> int:
    """The EP the source prints, kept in the layout's name ("... EP32")."""
    return int(str(run.layout["name"]).rsplit("EP", 1)[1].split()[0])


@pytest.mark.parametrize("run", MOE, ids=lambda r: r.name)
def test_each_moe_run_has_a_valid_expert_parallel_degree(run: PublishedRun) -> None:
    layout = Layout(gpus=run.gpus, **run.layout)  # ep must divide dp, or ValueError
    assert layout.ep > 1 and layout.dp % layout.ep == 0 and _experts(run.spec) % layout.ep == 0
    published = _published_ep(run)
    assert published % layout.ep == 0
    # Megatron's EP folds over TP x DP; ours groups replicas: where it exceeds DP it is folded, and flagged.
    if published > layout.dp:
        assert layout.ep == fold_ep(published, layout.dp, _experts(run.spec)) and "EP folded over TP" in run.assumed
        assert "assumed" in validate._flags(run, None)
    else:
        assert layout.ep == published and "EP folded" not in run.assumed
    assert run.describe().count(f"EP{layout.ep}") == 1


@pytest.mark.parametrize("run", MOE, ids=lambda r: r.name)
def test_each_moe_run_says_where_it_comes_from_and_what_it_counts(run: PublishedRun) -> None:
    assert run.source.startswith(("Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md",
                                  "Megatron-Bridge docs/performance-summary.md, 25.11",
                                  "DeepSeek-V3 Technical Report (arXiv:2412.19437)"))
    assert run.counting and run.framework and run.device in GENERATIONS and device_spec(run.device).name == run.device
    assert run.shape is not None and run.shape.seq == run.seq == 4096
    # FP8 listed, not priced; everything else held out: never fitted, nor calibrated to.
    assert run.role == "held-out" and bool(run.unpriced) == run.fp8  # FP8 MoE: listed, not priced
    assert run.name not in CALIBRATION_RUNS
    assert run.batch == run.layout["dp"] * run.micro_batch * run.microbatches


def test_moe_sources_are_registered() -> None:
    for runs in (MOE_MODELZOO, MEGATRON_BRIDGE_MOE, DEEPSEEK_V3):
        assert runs in SOURCES.values() and all(run_named(r.name) is r for r in runs)
    assert len(MOE) == len({r.name for r in MOE}) == sum(r in RUNS for r in MOE)
    priced = [r for r in MOE if r.role == "held-out"]
    assert {r.generation for r in priced} == {"hopper", "blackwell"} and len(priced) >= 8
    # Every FP8 MoE row of the 25.11 tables with a device of ours (GB300 has none), and DeepSeek's own run.
    fp8 = {r.name for r in MOE if r.unpriced}
    assert len(fp8) == 9 and "deepseek-v3-2048-h800-fp8" in fp8


def test_the_modelzoo_layouts_are_one_comparison_as_published() -> None:
    zoo = [r for r in MOE if r.group == "modelzoo-qwen3-235b-256"]
    assert zoo == list(MOE_MODELZOO) and len(zoo) == 5
    assert {(r.gpus, r.batch, r.seq, r.device, r.counts) for r in zoo} == {(256, 2048, 4096, "h100", "seconds")}
    assert [r.figure for r in zoo] == [19.7, 17.6, 17.6, 24.2, 29.0]
    # Megatron's EP x EDP = TP x DP (ETP 1) for each row printed; TP folded into DP (the planner cannot split
    # Qwen3-MoE by tensor): TP x DP one-GPU replicas, TP times fewer micro-batches, the EP as published.
    printed = ((2, 16, 128, 1, 32), (2, 16, 128, 1, 32), (2, 128, 4, 32, 8), (2, 4, 512, 1, 8), (4, 8, 256, 4, 8))
    for run, (tp, dp, ga, edp, ep) in zip(zoo, printed):
        assert ep * edp == tp * dp and f"TP{tp} " in run.layout["name"] and f"DP{dp} " in run.layout["name"]
        assert (run.layout["tp"], run.layout["dp"], run.microbatches, run.layout["ep"]) == (1, tp * dp, ga // tp, ep)
        assert f"TP{tp} folded into DP" in run.assumed and run.sequence_parallel
    fsdp = run_named("qwen3-235b-256-zoo-ep8-fsdp")
    assert fsdp.layout["shard"] == "zero3" and fsdp.shard_span == "world" and fsdp.checkpointing == "full"
    assert run_named("qwen3-235b-256-zoo-tp4-ep8").checkpointing == "none"
    assert figure_from_step(zoo[0], 19.7) == 19.7  # seconds: the step itself


def test_deepseek_v3_figure_is_the_gpu_hours_per_trillion_tokens() -> None:
    (run,) = DEEPSEEK_V3
    assert run.figure == pytest.approx(1543.2, abs=0.1) and run.device == "h800" and run.gpus == 2048
    lay = run.layout
    assert (lay["tp"], lay["pp"], lay["dp"], lay["ep"], run.batch) == (1, 16, 128, 64, 15360)
    # 180K GPU hours for 1e12 tokens on 2,048 GPUs: 3.7 days, as the report says.
    assert 180e3 / 2048 / 24 == pytest.approx(3.66, abs=0.01)


def test_validate_passes_ep_and_the_nvlink_domain(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Layout, dict[str, Any]]] = []

    class _Plan:
        class predicted:
            step_s = 2.0
            model_flops = 1.0
            peak_memory_bytes = (1.0,)

    class _Priced:
        plan = _Plan()
        step_s = 2.0
        peak_bytes = 1.0

    def fake_price(model: object, inputs: object, layout: Layout, **kwargs: Any) -> _Priced:
        seen.append((layout, kwargs))
        return _Priced()

    from partitioner.search import price

    monkeypatch.setattr(price, "price_layout", fake_price)
    monkeypatch.setattr(validate, "_model", lambda spec: None)
    gb200 = run_named("gpt-oss-120b-64-bridge-gb200")
    row = validate.price_run(gb200)
    assert row["priced"] and row["predicted"] == pytest.approx(512 * 4096 / 2.0 / 64)
    layout, kwargs = seen[-1]
    assert layout.ep == 64 and kwargs["device"] == "gb200"
    assert (kwargs["gpus_per_node"], kwargs["nvlink_domain"]) == (4, 64)  # trays of 4 in one NVL72 domain
    validate.price_run(run_named("qwen3-235b-256-zoo-ep32-deepep"))  # selective: two plans, both at EP32
    assert [(lay.ep, lay.recompute, kw["gpus_per_node"]) for lay, kw in seen[-2:]] == [(32, "none", 8), (32, "full", 8)]
    assert all("nvlink_domain" not in kw for _, kw in seen[-2:])
    # A run with tensor parallelism kept and its EP folded over DP (FP8 rows only are such; priced here regardless).
    folded = run_named("qwen3-235b-64-bridge-gb200-fp8")
    assert (Layout(gpus=64, **folded.layout).tp, Layout(gpus=64, **folded.layout).ep) == (2, 32)
    fp8 = validate._task((run_named("deepseek-v3-2048-h800-fp8"), None))
    assert not fp8["priced"] and fp8["why"].startswith("FP8 MoE: listed, not priced")
    # A dense FP8 run: priced at --precision fp8 with its recipe, on trays of 4 in its NVLink domain.
    validate.price_run(run_named("70b-64-bridge-gb200-mxfp8"))
    _, kwargs = seen[-1]
    assert (kwargs["precision"], kwargs["fp8_recipe"], kwargs["gpus_per_node"], kwargs["nvlink_domain"]) == (
        "fp8", "mxfp8", 4, 64)
    validate.price_run(run_named("70b-64-megatron"))
    assert (seen[-1][1]["precision"], seen[-1][1]["fp8_recipe"]) == ("fp8", "tensorwise")
    assert seen[-3][1]["precision"] == "bf16-mixed" and "fp8_recipe" not in seen[-3][1]


def test_a_pair_predicted_alike_is_not_ordered_right() -> None:
    # DeepEP against DeepEP with 1F1B overlap: measured 19.7 s against 17.6 s; the cost model prices neither.
    a, b = run_named("qwen3-235b-256-zoo-ep32-deepep"), run_named("qwen3-235b-256-zoo-ep32-overlap")
    rows = [{"run": a.name, "priced": True, "step_s": 26.55}, {"run": b.name, "priced": True, "step_s": 26.55}]
    (pair,) = validate.compare_groups([a, b], rows)
    assert pair["measured"] == pytest.approx(17.6 / 19.7) and pair["agrees"] is False
    assert pair["why"] == "predicted alike"
    rows[1]["step_s"] = 20.0
    assert validate.compare_groups([a, b], rows)[0]["agrees"] is True
