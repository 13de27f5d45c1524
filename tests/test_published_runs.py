"""Published runs (tools/published_runs.py), their pricing and calibration (issue 23, item 3).

Fast: the runs' data, the calibration's helpers, ZeRO-3 under tensor parallelism
sharded across the replicas, and ``price_layout`` planning a layout once where the
memory limit cannot change it.
"""

from __future__ import annotations

import pytest
import torch

from partitioner.cost.devices import DEVICES, device_spec
from partitioner.cost.nodecost import NodeCost
from partitioner.cost.nodes import profile
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
from tools.bench_large import PUBLISHED
from tools.published_runs import RUNS, run_named


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_each_run_is_a_consistent_layout(run: object) -> None:
    from tools.published_runs import PublishedRun

    assert isinstance(run, PublishedRun)
    layout = Layout(gpus=run.gpus, **run.layout)  # tp x pp x dp = GPUs, or ValueError
    assert run.batch % (layout.dp * layout.microbatches) == 0
    assert device_spec(run.device).name == run.device
    assert run.unit in ("tokens/s/GPU", "TFLOP/s/GPU") and run.figure > 0 and run.source
    assert (run.role == "fp8") == (run.precision == "fp8")  # FP8 is not priced by the cost model: never fitted
    assert run.checkpointing in ("none", "selective", "full", "auto")
    if run.checkpointing in ("none", "full"):
        assert layout.recompute == run.checkpointing


def test_fit_and_held_out_runs_both_exist() -> None:
    roles = [r.role for r in RUNS]
    assert roles.count("fit") >= 3 and roles.count("held-out") >= 2
    with pytest.raises(KeyError, match="no published run 'x'"):
        run_named("x")


def test_bench_large_prices_the_same_layouts() -> None:
    for group in PUBLISHED:
        run = run_named(group.name)
        (layout,) = group.layouts
        assert {k: v for k, v in layout.items() if k != "source"} == run.layout
        assert (group.gpus, group.batch, group.seq, group.spec) == (run.gpus, run.batch, run.seq, run.spec)
        assert layout["source"] == run.cite()


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
