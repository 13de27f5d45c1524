"""Published runs (tools/published/), their pricing, validation and calibration (issues 23 and 30).

Fast: the runs' data (consistent layouts, sources, counting rules, comparisons, a third at
most fitted), the model factories' sizes against the published ones, each source's counting
rule on hand-checked rows, the validation tool on one small run, the calibration's helpers,
ZeRO-3 under tensor parallelism sharded across the replicas, and ``price_layout`` planning a
layout once where the memory limit cannot change it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from partitioner.cost.devices import DEVICES, device_spec
from partitioner.cost.nodecost import NodeCost
from partitioner.cost.nodes import profile
from partitioner.cost.precision import FP8_RECIPES, fp8_peak
from partitioner.graph.capture import capture
from partitioner.graph.tensorparallel import find_tensor_parallel
from partitioner.graph.values import propagate_values
from partitioner.search import price
from partitioner.search.options import PlanOptions
from partitioner.search.price import Layout, leaves_no_choice, price_layout
from partitioner.solve.formulate import ZERO3
from partitioner.solve.scaledcosts import ScaledCosts
from partitioner.solve.tensorparallel import TensorParallelCosts
from tests._examples import example
from tools import calibrate_published as calibrate
from tools import published_models
from tools import validate_published as validate
from tools.bench_large import PUBLISHED
from tools.published import (
    COUNTS,
    GENERATIONS,
    SOURCES,
    figure_from_step,
    korthikanti_model_flops,
    megatron_flops,
)
from tools.published_runs import RUNS, run_named
from tools.validate_published import speed_ratio, step_from_figure


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_each_run_is_a_consistent_layout(run: object) -> None:
    from tools.published_runs import PublishedRun

    assert isinstance(run, PublishedRun)
    layout = Layout(gpus=run.gpus, **run.layout)  # tp x pp x dp = GPUs, or ValueError
    assert run.batch % (layout.dp * layout.microbatches) == 0
    assert device_spec(run.device).name == run.device
    assert run.counts in COUNTS and run.unit == COUNTS[run.counts] and run.figure > 0
    assert run.source and run.counting and run.framework  # where it comes from and exactly what it counts
    assert run.role in ("fit", "held-out") and not (run.unpriced and run.role == "fit")  # a listed run is not fitted
    # An FP8 run names its scaling, one the device has (MXFP8: Blackwell only); a bf16 run none.
    assert bool(run.fp8_recipe) == run.fp8 and (not run.fp8 or run.fp8_recipe in FP8_RECIPES)
    assert not run.fp8 or fp8_peak(device_spec(run.device).peak_flops, run.fp8_recipe) is not None
    assert run.precision in ("bf16", "fp16", "fp8") and run.device in GENERATIONS
    assert run.checkpointing in ("none", "selective", "full", "auto")
    if run.checkpointing in ("none", "full"):
        assert layout.recompute == run.checkpointing
    assert (0.0 < run.selective_share < 1.0) == (run.checkpointing == "selective")
    # Micro-batches are integral: the batch is replicas x micro-batch size x micro-batches per replica.
    assert run.micro_batch >= 1 and run.batch == layout.dp * run.micro_batch * layout.microbatches
    assert run.shape is not None and run.shape.seq == run.seq
    # ZeRO-3 reshards after each forward ("zero3"); a stage-3 run that keeps its weights gathered ("full") says so.
    assert layout.shard == {0: "none", 1: "optimizer", 2: "optimizer", 3: "zero3"}[run.zero_stage] or (
        layout.shard == "full" and run.zero_stage == 3 and "gathered" in run.note + str(run.layout.get("name")))
    assert run.zero_stage == 0 or layout.dp % run.zero_ranks == 0
    if run.counts == "model-eq7":
        assert run.peak_tflops > 0
    if layout.schedule == "interleaved-1f1b":  # Megatron's interleaved schedule: whole rounds of pp micro-batches
        assert layout.chunks is not None and layout.chunks >= 2 and layout.microbatches % layout.pp == 0
    if run.spec.startswith("tools/published_models.py:"):
        gpt = published_models.shape_named(run.spec.partition(":")[2])
        assert (gpt.layers, gpt.hidden, gpt.heads, gpt.vocab, gpt.seq) == (
            run.shape.layers, run.shape.hidden, run.shape.heads, run.shape.vocab, run.shape.seq)


def test_fit_and_held_out_runs_both_exist() -> None:
    roles = [r.role for r in RUNS]
    assert roles.count("fit") >= 3 and roles.count("held-out") >= 2
    with pytest.raises(KeyError, match="no published run 'x'"):
        run_named("x")


def test_the_set_is_large_varied_and_mostly_held_out() -> None:
    priced = [r for r in RUNS if not r.unpriced]
    assert len(RUNS) >= 40 and len({r.name for r in RUNS}) == len(RUNS)
    assert sum(any(not r.unpriced for r in runs) for runs in SOURCES.values()) >= 4
    assert {r.generation for r in priced} >= {"ampere", "hopper", "blackwell"}
    fit = [r for r in priced if r.role == "fit"]
    assert 3 * len(fit) <= len(priced)  # at most a third fitted
    for generation in ("ampere", "hopper", "blackwell"):  # and at most a third of each generation's
        assert 3 * sum(r.generation == generation for r in fit) <= sum(r.generation == generation for r in priced)
    # FP8: priced on H100 and Blackwell, mostly held out (Blackwell's fit runs are FP8: its only dense runs).
    fp8 = [r for r in priced if r.fp8]
    assert {r.generation for r in fp8} == {"hopper", "blackwell"} and 3 * sum(r.role == "fit" for r in fp8) <= len(fp8)
    assert {r.fp8_recipe for r in fp8} == {"tensorwise", "mxfp8"}
    for generation in ("ampere", "hopper"):  # a few per generation, of more than one layout kind
        mine = [r for r in fit if r.generation == generation]
        assert len(mine) >= 3 and len({(r.layout["pp"] > 1, r.layout["shard"]) for r in mine}) >= 2
    # Pipeline-heavy, tensor-heavy and sharding-heavy layouts; several schedules and recomputation modes.
    assert any(r.layout["pp"] >= 32 for r in priced) and any(r.layout["tp"] == 8 and r.layout["pp"] == 1 for r in priced)
    assert any(r.zero_stage == 3 and r.layout["tp"] == 1 and r.layout["dp"] >= 512 for r in priced)
    assert {r.layout["schedule"] for r in priced} >= {"1f1b", "interleaved-1f1b"}
    assert {r.checkpointing for r in priced} >= {"full", "selective", "none"}


def test_every_comparison_shares_model_and_gpus() -> None:
    groups: dict[str, list[object]] = {}
    for run in RUNS:
        if run.group:
            groups.setdefault(run.group, []).append(run)
    assert len(groups) >= 10
    for name, members in groups.items():
        assert len(members) >= 2, name
        assert len({(r.spec, r.gpus, r.device, r.seq) for r in members}) == 1, name  # type: ignore[attr-defined]
    # Every ZeRO-3 against tensor + pipeline pair of Narayanan et al.'s Table 2 is a comparison.
    t2 = [g for g, members in groups.items() if g.startswith("megatron2021-")]
    assert len(t2) == 5 and all({r.zero_stage for r in groups[g]} == {0, 3} for g in t2)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(published_models.SHAPES))
def test_factories_have_the_published_sizes(name: str) -> None:
    shape = published_models.SHAPES[name]
    model = published_models.build(shape)
    count = sum(p.numel() for p in model.parameters())  # the tied head counted once
    assert count == published_models.parameter_count(shape)
    # Within 2%, or within the rounding of a size published to one decimal (1.7B is 1.65..1.75B).
    assert abs(count - shape.published) <= max(0.02 * shape.published, 0.05e9), (count, shape.published)
    assert isinstance(published_models.__getattr__(name)(), published_models.GPT)


def test_llama_factories_have_the_published_sizes() -> None:
    llama = example("llama")
    for factory, size in (("llama3_8b", 8e9), ("llama3_70b", 70e9), ("llama3_405b", 405e9)):
        count = sum(p.numel() for p in getattr(llama, factory)().parameters())
        assert abs(count / size - 1) <= 0.02, (factory, count)


def test_figures_by_each_sources_count() -> None:
    # Megatron's Eq. 3 on Table 1's 145B row: 148 TFLOP/s on 1,536 GPUs is a 24.82 s step.
    t1 = run_named("megatron2021-t1-145b")
    assert step_from_figure(t1, 148.0) == pytest.approx(24.82, abs=0.01)
    assert figure_from_step(t1, 24.82) == pytest.approx(148.0, abs=0.05)
    # Without recomputation Eq. 3 counts 3 passes, not 4.
    assert megatron_flops(t1.shape, batch=1, recompute=False) == pytest.approx(  # type: ignore[arg-type]
        0.75 * megatron_flops(t1.shape, batch=1, recompute=True))  # type: ignore[arg-type]
    # Korthikanti et al. Table 5 prints the MFU of its own seconds: 175B 13.75 s -> 51.4%, 1T 71.49 s -> 56.3%.
    assert korthikanti_model_flops(run_named("korthikanti2022-175b-selective").shape, batch=64) / (  # type: ignore[arg-type]
        13.75 * 64 * 312e12) == pytest.approx(0.514, abs=5e-4)
    k = run_named("korthikanti2022-530b-2240-full")  # MFU by Eq. 7: 54.2% at 39.15 s (section 6.3)
    assert figure_from_step(k, 39.15) == pytest.approx(0.542, abs=5e-4)
    # BigScience prints seconds and TFLOP/s side by side: 104.70 s is 149.77 TFLOP/s (Eq. 3, V = 250,880).
    assert figure_from_step(run_named("bloom-176b-training"), 104.70) == pytest.approx(149.77, abs=0.02)
    assert figure_from_step(run_named("bloom-181b-tp8-pp6-m4"), 114.11) == pytest.approx(141.27, abs=0.02)
    # MegaScale Table 2: 40.0 s on 256 GPUs is the 53.0% MFU it prints beside it.
    m = run_named("megascale2024-175b-256")
    assert korthikanti_model_flops(m.shape, batch=768) / (40.0 * 256 * 312e12) == pytest.approx(  # type: ignore[arg-type]
        0.530, abs=1e-3)
    # Tokens per second per GPU and seconds: the step itself.
    titan = run_named("8b-8-torchtitan")
    assert figure_from_step(titan, 16 * 8192 / 8 / 5762.0) == pytest.approx(5762.0)
    assert speed_ratio(run_named("korthikanti2022-22b-full"), 0.71) == pytest.approx(2.0)
    assert speed_ratio(titan, 2 * 5762.0) == pytest.approx(2.0)


def test_the_sharding_span_is_flagged_until_priced() -> None:
    zero3 = run_named("megatron2021-t2-zero3-175b-1536")
    assert zero3.shard_span == "world" and zero3.layout["tp"] == 1
    assert "span not priced" in validate._flags(zero3, None)
    assert "span not priced" not in validate._flags(zero3, ("call", "shard_span"))
    assert "span not priced" not in validate._flags(run_named("megatron2021-t2-ptdp-175b-1536"), None)


def test_comparison_pairs_are_ordered_and_ties_are_not_scored() -> None:
    a, b = run_named("megatron2021-t2-zero3-175b-384"), run_named("megatron2021-t2-ptdp-175b-384")
    steps = {a.name: step_from_figure(a, a.figure), b.name: step_from_figure(b, b.figure)}
    rows = [{"run": r.name, "priced": True, "step_s": s} for r, s in ((a, steps[a.name]), (b, steps[b.name] * 1.5))]
    (pair,) = [p for p in validate.compare_groups([a, b], rows)]
    assert pair["measured"] == pytest.approx(144 / 153) and pair["agrees"] is False  # PTD-P predicted slower
    rows[1]["step_s"] = steps[b.name]
    assert validate.compare_groups([a, b], rows)[0]["agrees"] is True
    rows[1]["priced"] = False
    assert validate.compare_groups([a, b], rows)[0]["why"] == "not priced"


def test_validate_prices_a_small_run(tmp_path: Path) -> None:
    row = validate.price_run(run_named("megatron2021-t1-1.7b"))
    assert row["priced"] and row["predicted"] > 0 and row["step_s"] > 0 and row["fits"]
    assert row["error"] == pytest.approx(row["predicted"] / 137.0 - 1)
    out = tmp_path / "v.json"
    assert validate.main(["--only", "megatron2021-t1-1.7b", "--jobs", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["run"] for r in data["rows"]] == ["megatron2021-t1-1.7b"] and data["summary"]["fit"]["all"]["runs"] == 1
    listed = validate._task((run_named("deepseek-v3-2048-h800-fp8"), None))  # FP8 MoE: listed, not priced
    assert not listed["priced"] and listed["why"].startswith("FP8 MoE: listed, not priced") and listed["fp8"]


def test_bench_large_prices_the_same_layouts() -> None:
    for group in PUBLISHED:
        run = run_named(group.name)
        (layout,) = group.layouts
        assert {k: v for k, v in layout.items() if k != "source"} == run.layout
        assert (group.gpus, group.batch, group.seq, group.spec) == (run.gpus, run.batch, run.seq, run.spec)
        assert layout["source"] == run.cite()
        # A published FP8 run's layout is priced at --precision fp8 with its recipe, a bf16 one at bf16-mixed.
        assert (group.precision, group.fp8_recipe) == (("fp8", run.fp8_recipe) if run.fp8 else ("bf16-mixed", ""))
    assert sum(g.precision == "fp8" for g in PUBLISHED) >= 3


def test_calibration_parameters_are_set_and_restored() -> None:
    saved = calibrate.current_parameters()
    try:
        calibrate.with_parameters({**saved, "memory": 0.5, "peak500": 0.9})
        assert DEVICES["h100"].efficiency_of("memory") == DEVICES["h200"].efficiency_of("memory") == 0.5
        assert DEVICES["h100-500w"].peak("bfloat16") == pytest.approx(0.9 * DEVICES["h100"].peak("bfloat16"))
        assert DEVICES["a100"].efficiency_of("memory") == 1.0
    finally:
        calibrate.with_parameters(saved)
    assert calibrate.current_parameters() == saved


def test_minimax_step() -> None:
    # Two runs moving alike, 0.2 apart: the best is their midpoint, each 0.1 off.
    (d,) = calibrate._minimax([[1.0], [1.0]], [0.3, 0.1], [-1.0], [1.0])
    assert d == pytest.approx(-0.2, abs=1e-3)
    d1, d2 = calibrate._minimax([[2.0, 0.0], [1.0, 1.0]], [-4.0, -5.0], [-5.0, -5.0], [5.0, 5.0])
    assert (d1, d2) == pytest.approx((2.0, 3.0), abs=1e-2)


def test_zero3_under_tensor_parallelism_shards_across_the_replicas() -> None:
    """The 70B TP8 x FSDP32 layout was refused citing its whole state: ZeRO-3 was priced as HSDP within one GPU."""
    gpt = example("gpt")
    inputs = gpt.example_inputs(4)
    captured = capture(gpt.build_model(), inputs)
    propagate_values(captured.graph_module, inputs)
    costs: dict[str, NodeCost] = profile(captured, inputs, measure=False, device=torch.device("cpu"),
                                         progress=lambda *_: None)
    blocks: list[tuple[str, ...]] = [(n.name,) for n in captured.graph_module.graph.nodes if n.name in costs]
    options = PlanOptions(gpus=4, batch=4, microbatches=1, schedules=("1f1b",), spec=DEVICES["h100"], measure=False,
                          local=torch.device("cpu"), memory_limit=None, pp=1, dp=4, capture_method="auto",
                          max_blocks=256, precision="fp32", optimizer="adam", optimizer_states=2, recompute="none",
                          gpus_per_node=1, bucket_cap_mb=25.0, time_limit=1.0, tp=4)
    base = ScaledCosts(captured, blocks, costs, options, loss_s=(0.0, 0.0))
    tp = TensorParallelCosts(base, find_tensor_parallel(captured), 4, options)
    whole, zero3 = (sum(tp.problem(4, 1, mode).static_bytes) for mode in ("none", ZERO3))
    assert zero3 == pytest.approx(whole / 4, rel=1e-6)  # fp32 + Adam, 16 B per parameter over 4 replicas
    assert tp.problem(4, 1, ZERO3).gpus_per_node == 1  # the links stay the layout's


def test_a_layout_the_limit_cannot_change_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float | None] = []
    real = price.compile

    def counting(*args: object, memory_per_gpu: float | None = None, **kwargs: object) -> object:
        calls.append(memory_per_gpu)
        return real(*args, memory_per_gpu=memory_per_gpu, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(price, "compile", counting)
    gpt = example("gpt")
    fixed = Layout("DDP2", gpus=2, tp=1, pp=1, dp=2, microbatches=2, schedule="1f1b", shard="none", recompute="none")
    assert leaves_no_choice(fixed)
    tight = price_layout(gpt.build_model(), gpt.example_inputs(8), fixed, tokens_per_sample=32, device="h100",
                         memory_per_gpu=1024.0)
    assert not tight.fits and len(calls) == 1  # not planned under the limit first and again without it
    roomy = price_layout(gpt.build_model(), gpt.example_inputs(8), fixed, tokens_per_sample=32, device="h100")
    assert roomy.fits and len(calls) == 2 and roomy.step_s == pytest.approx(tight.step_s)
    # A split to choose: planned under the limit, and again without it when nothing fits.
    split = Layout("PP2", gpus=2, tp=1, pp=2, dp=1, microbatches=2, schedule="1f1b", shard="none", recompute="none")
    assert not leaves_no_choice(split)
    assert not price_layout(gpt.build_model(), gpt.example_inputs(8), split, tokens_per_sample=32, device="h100",
                            memory_per_gpu=1024.0).fits
    assert calls[2:] == [1024.0, price.UNLIMITED_MEMORY]
