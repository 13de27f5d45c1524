"""The large-model example files: ``examples/llama.py``, ``examples/gpt3.py``, ``examples/deepseek_v3.py``,
``tools/bench_large.py``.

* Every large factory builds on the meta device in well under a second (nothing is
  allocated) with the published parameter count, checked against a closed-form count
  from the shapes (Llama 3 paper Table 3; Brown et al. 2020 Table 2.1).
* ``example_inputs`` follows the factory built last (the convention has one per file).
* The tiny defaults have real weights: their plans verify on CPU ranks (slow).
* The hand-made splits of ``tools/bench_large.py`` are the ones Megatron and torchtitan make.
"""

from __future__ import annotations

import doctest
import time
from pathlib import Path

import pytest
import torch

from partitioner.modelfile import load_model_file

pytest.importorskip("transformers")

from planning_helpers import make_plan, parameters_covered

ROOT = Path(__file__).resolve().parent.parent
LLAMA = str(ROOT / "examples" / "llama.py")
GPT3 = str(ROOT / "examples" / "gpt3.py")
DSV3 = str(ROOT / "examples" / "deepseek_v3.py")


def llama_parameters(
    layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int
) -> int:
    """Untied embedding and head, q/k/v/o without bias (GQA: k and v are kv_heads / heads as wide),
    a SwiGLU MLP (gate, up, down), two RMSNorm weights per layer and a final one."""
    kv = hidden * kv_heads // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def gpt_parameters(layers: int, d: int, vocab: int, context: int) -> int:
    """Tied token embedding / head, learned positions; per layer qkv and output projections,
    a 4d MLP, all with biases, and two LayerNorms (weight and bias); a final LayerNorm."""
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 4 * d
    return vocab * d + context * d + layers * per_layer + 2 * d


def deepseek_parameters(layers: int, dense: int, hidden: int, ffn: int, expert_ffn: int, experts: int, shared: int,
                        heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v: int, vocab: int) -> int:
    """Untied embedding and head; per layer Multi-head Latent Attention (q down/norm/up, joint kv down with the
    shared RoPE key, kv norm/up, output), two RMSNorms, and a dense SwiGLU FFN or a mixture of experts (routed
    SwiGLU experts of width expert_ffn, a router weight per expert, shared experts); a final RMSNorm."""
    attention = (hidden * q_rank + q_rank + q_rank * heads * (nope + rope) + hidden * (kv_rank + rope) + kv_rank
                 + kv_rank * heads * (nope + v) + heads * v * hidden)
    dense_layer = attention + 2 * hidden + 3 * hidden * ffn
    moe_layer = attention + 2 * hidden + experts * 3 * hidden * expert_ffn + experts * hidden + shared * 3 * hidden * expert_ffn
    return 2 * vocab * hidden + hidden + dense * dense_layer + (layers - dense) * moe_layer


@pytest.mark.parametrize(
    ("spec", "expected", "published", "rounding"),
    [
        (f"{LLAMA}:llama3_8b", llama_parameters(32, 4096, 14336, 32, 8, 128256), 8.03e9, 0.001),
        (f"{LLAMA}:llama3_70b", llama_parameters(80, 8192, 28672, 64, 8, 128256), 70.6e9, 0.001),
        (
            f"{LLAMA}:llama3_405b",
            llama_parameters(126, 16384, 53248, 128, 8, 128256),
            405.9e9,
            0.001,
        ),
        (f"{GPT3}:gpt3_175b", gpt_parameters(96, 12288, 50257, 2048), 175e9, 0.003),
        (f"{GPT3}:gpt3_xl", gpt_parameters(24, 2048, 50257, 2048), 1.3e9, 0.02),  # "1.3B": 2 digits
        (f"{DSV3}:deepseek_v3_671b",  # DeepSeek-V3 technical report: 671B total parameters
         deepseek_parameters(61, 3, 7168, 18432, 2048, 256, 1, 128, 1536, 512, 128, 64, 128, 129280), 671e9, 0.001),
    ],
)
def test_large_factories_build_on_meta_with_published_sizes(
    spec: str, expected: int, published: float, rounding: float
) -> None:
    model_file = load_model_file(spec)
    start = time.perf_counter()
    model = model_file.build()
    elapsed = time.perf_counter() - start
    params = list(model.parameters())
    assert all(p.is_meta for p in params), "large factories must not allocate weights"
    count = sum(p.numel() for p in params)  # from the meta shapes; tied weights counted once
    assert count == expected
    assert abs(count / published - 1) < rounding, f"{count:,} vs published {published:,.0f}"
    assert elapsed < 5.0, f"building on meta took {elapsed:.1f} s"


@pytest.mark.parametrize(
    ("spec", "seq", "vocab"),
    [
        (LLAMA, 32, 512),
        (f"{LLAMA}:llama_tiny", 32, 512),
        (f"{LLAMA}:llama3_70b", 4096, 128256),
        (GPT3, 32, 512),
        (f"{GPT3}:gpt3_175b", 2048, 50257),
        (DSV3, 32, 512),
        (f"{DSV3}:deepseek_v3_671b", 4096, 129280),
    ],
)
def test_example_inputs_follow_the_factory(spec: str, seq: int, vocab: int) -> None:
    model_file = load_model_file(spec)
    model_file.build()
    (ids,) = model_file.example_inputs(3)
    assert ids.shape == (3, seq) and ids.dtype == torch.int64 and ids.device.type == "cpu"
    assert 0 <= int(ids.min()) and int(ids.max()) < vocab
    assert model_file.example_target is not None
    assert model_file.example_target(3).shape == (3, seq)


def test_sequence_lengths_are_listed_per_factory() -> None:
    from _examples import example

    llama, gpt3 = example("llama"), example("gpt3")
    assert llama.SEQ_LENS == {
        "build_model": 32,
        "llama_tiny": 32,
        "llama3_8b": 4096,
        "llama3_70b": 4096,
        "llama3_405b": 4096,
    }
    assert gpt3.SEQ_LENS == {"build_model": 32, "gpt3_xl": 2048, "gpt3_175b": 2048}
    deepseek = example("deepseek_v3")
    assert deepseek.SEQ_LENS == {"build_model": 32, "deepseek_v3_tiny": 32, "deepseek_v3_671b": 4096}
    assert all(callable(getattr(m, name)) for m in (llama, gpt3, deepseek) for name in m.SEQ_LENS)


def test_tiny_defaults_run_and_lose_like_a_language_model() -> None:
    for spec, vocab in ((LLAMA, 512), (GPT3, 512), (DSV3, 512)):
        model_file = load_model_file(spec)
        model = model_file.build()
        assert all(not p.is_meta for p in model.parameters())
        assert model_file.loss_fn is not None and model_file.example_target is not None
        loss = model_file.loss_fn(
            model(*model_file.example_inputs(2)), model_file.example_target(2)
        )
        # A freshly initialised model is close to uniform over the vocabulary: loss ~ log V.
        assert abs(float(loss.detach()) - torch.log(torch.tensor(float(vocab)))) < 0.5


def test_hand_made_splits_are_megatron_and_torchtitan() -> None:
    from tools import bench_large

    failures, _ = doctest.testmod(bench_large, verbose=False)
    assert failures == 0
    # Llama 3 405B on 16 stages: 126 layers, one fewer on the first and the last stage.
    split = bench_large.first_last_lighter_split(126, 16)
    assert split is not None and bench_large.layers_per_stage(split, 16) == "7|8x14|7"
    assert split[0] == 0 and split[-1] == 15
    equal = bench_large.equal_layer_split(80, 16)
    assert equal is not None and bench_large.layers_per_stage(equal, 16) == "5x16"
    assert bench_large.equal_layer_split(126, 128) is None  # more stages than layers
    assert (
        bench_large.layers_per_stage(bench_large.first_last_lighter_split(126, 128) or (), 128)
        == "0|1x126|0"
    )


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_hand_made_splits_of_a_chunked_plan_use_every_stage(schedule: str) -> None:
    """About 1 s each: 2 ranks x 2 chunks, so the hand-made splits cut 4 stages (not pp = 2) on the same ranks."""
    from partitioner.search.planner import compile
    from tools import bench_large

    model_file = load_model_file(GPT3)
    model = model_file.build()
    recorder = bench_large._Recorder()
    try:
        plan = compile(model, model_file.example_inputs(16), gpus=4, pp=2, dp=2, microbatches=4,
                       schedule=schedule, chunks=2, device="h100", precision="bf16-mixed")
    finally:
        recorder.restore()
    assert (plan.pp, plan.chunks, len(plan.stages)) == (2, 2, 4)
    assert bench_large._shape(plan) in recorder.calls
    n_layers = bench_large._n_layers(model)  # 4
    for split, layers in ((bench_large.equal_layer_split(n_layers, 4), "1x4"),
                          (bench_large.first_last_lighter_split(n_layers, 4), "1|2|1|0")):
        assert split is not None
        result = bench_large._evaluate_split(recorder, plan, split, n_layers)
        assert "error" not in result, result["error"]
        assert result["split"] == layers and len(result["stage_compute_s"]) == 4
        assert result["fits"] and result["peak_bytes"] > 0
        assert result["step_s"] >= plan.predicted.step_s * (1 - 1e-9)  # ours is never slower


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "schedule"), [(LLAMA, "1f1b"), (GPT3, "gpipe")])
def test_tiny_default_plans_and_verifies(tmp_path: Path, spec: str, schedule: str) -> None:
    """About 30 s: plan for 2 stages (h100 costs), then train 2 steps on 2 CPU ranks vs the whole model."""
    from runtime.verify import verify

    plan = make_plan(spec, tmp_path, pp=2, microbatches=2, schedule=schedule, batch=4)
    names, held = parameters_covered(plan, spec)
    assert names <= held
    result = verify(tmp_path, spec, steps=2, tolerance=1e-5)
    assert result.ok, result.summary()


@pytest.mark.slow
def test_bench_large_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """About 45 s: both tiny cases in fresh processes; ours is never slower than a hand-made split."""
    import json

    from tools import bench_large

    out = tmp_path / "large.json"
    code = bench_large.main(["--quick", "--json", str(out)])
    text = capsys.readouterr().out
    assert "| tiny-llama |" in text and "| tiny-gpt |" in text
    results = json.loads(out.read_text())
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["pp"] * r["dp"] == 8 and r["rss_bytes"] > 0 and r["wall_s"] > 0
        for b in r["baselines"].values():
            if "error" not in b and b["fits"]:
                assert r["step_s"] <= b["step_s"] * (1 + 1e-9)
    assert code == 0, text


def test_gpt3_xl_plans_on_meta_in_seconds_with_bf16_mixed() -> None:
    """Issue 8: the 1.3B GPT plans with bf16-mixed for 8 H100s in seconds, and fits."""
    from partitioner.search.planner import compile

    model_file = load_model_file(f"{GPT3}:gpt3_xl")
    model = model_file.build()
    start = time.perf_counter()
    plan = compile(
        model,
        model_file.example_inputs(32),
        gpus=8,
        device="h100",
        precision="bf16-mixed",
        microbatches="auto",
        schedule="auto",
    )
    assert time.perf_counter() - start < 30.0
    assert plan.precision == "bf16-mixed" and plan.pp * plan.dp == 8
    limit = plan.cost_model.memory_limit
    assert limit is not None and max(s.predicted.memory_bytes for s in plan.stages) <= limit
    assert all(p.is_meta for p in model.parameters())  # planning allocated no weights


def test_tiny_deepseek_v3_plans_on_meta() -> None:
    """Issue 32: DeepSeek-V3 on meta counts tokens per expert with integer ``histc``, which torch's meta kernel refuses
    on a fake CPU tensor; it plans now (about 5 s), and its experts are found."""
    from _examples import example

    from partitioner.graph.capture import capture
    from partitioner.graph.experts import find_experts
    from partitioner.graph.values import propagate_values
    from partitioner.search.planner import compile

    deepseek = example("deepseek_v3")
    model = deepseek.build(deepseek.TINY, meta=True)
    inputs = deepseek.example_inputs(4)
    plan = compile(model, inputs, gpus=2, device="h100", microbatches=2, pp=2)
    assert (plan.pp, len(plan.stages)) == (2, 2)
    assert all(p.is_meta for p in model.parameters())  # planning allocated no weights
    captured = capture(model, inputs[0][:2], method="export")
    propagate_values(captured.graph_module, (inputs[0][:2],))
    found = find_experts(model, captured)
    assert [(e.module, e.experts, e.top_k) for e in found.layers] == [
        ("model.layers.1.mlp.experts", 8, 2), ("model.layers.2.mlp.experts", 8, 2)]  # layer 0 is dense


@pytest.mark.exhaustive  # ~20 s: the tiny DeepSeek-V3 on meta covers the same capture path
def test_deepseek_v3_671b_captures_on_meta() -> None:
    """About 25 s: the 671B shape exports on meta at one sample, its values propagate and 58 layers of 256
    experts (top 8) are found."""
    from partitioner.graph.capture import capture
    from partitioner.graph.experts import find_experts
    from partitioner.graph.values import propagate_values

    model_file = load_model_file(f"{DSV3}:deepseek_v3_671b")
    model = model_file.build()
    inputs = model_file.example_inputs(1)
    start = time.perf_counter()
    captured = capture(model, inputs, method="export")
    propagate_values(captured.graph_module, inputs)
    assert time.perf_counter() - start < 60.0
    found = find_experts(model, captured)
    assert len(found.layers) == 58 and {(e.experts, e.top_k, e.hidden) for e in found.layers} == {(256, 8, 7168)}
