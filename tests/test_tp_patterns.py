"""Tensor-parallel patterns found in captured graphs (partitioner/graph/tensorparallel.py, issue 22).

Each model's graph is captured as the planner captures it; the pass must find one
attention and one MLP pair per layer (Megatron's column/row pairs), the vocabulary-
parallel embedding and head, the heads that bound the degree (GQA: key/value heads
replicated when fewer than tp), and nothing in a model without pairs (with the reason).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.graph.capture import CallSpec, capture
from partitioner.graph.tensorparallel import NO_PATTERN, TP_KEY, TPLayout, find_tensor_parallel
from partitioner.graph.values import propagate_values
from partitioner.modelfile import load_model_file
from tests._examples import example

MODELS = Path(__file__).parent / "models"


def _layout(model: nn.Module, inputs: Any) -> tuple[TPLayout, Any]:
    call, flat = CallSpec.of(inputs)
    captured = capture(model, flat, call=call)
    propagate_values(captured.graph_module, flat)
    return find_tensor_parallel(captured), captured


def _kinds(layout: TPLayout) -> Counter[str]:
    return Counter(p.kind for p in layout.patterns)


def test_gpt_example_pairs_heads_and_vocabulary() -> None:
    gpt = example("gpt")
    model = gpt.build_model()
    layout, captured = _layout(model, gpt.example_inputs(2))
    layers = len(model.blocks)
    # The fused c_attn's output is cut into q, k and v along the split dimension: not a split that survives
    # (each GPU would hold q and half of k), so the attention stays whole and is priced so (issue 29).
    assert _kinds(layout) == {"mlp": layers, "embedding": 1, "head": 1}
    assert len(layout.dropped) == layers and all("cuts the split dimension" in w for w in layout.dropped.values())
    assert {"blocks_0_attn_c_attn", "blocks_0_attn_c_proj"} <= layout.whole
    assert layout.degrees(8) == (1, 2, 4, 8)  # the MLPs' 256 hidden units
    # The tied embedding/head weight splits by vocabulary; layer norms stay whole.
    assert "wte.weight" in layout.parameters
    assert not any("ln_" in name for name in layout.parameters)
    # The row's bias is replicated (added once after the all-reduce); the column's splits.
    assert "blocks.0.mlp.c_fc.bias" in layout.parameters and "blocks.0.mlp.c_proj.bias" not in layout.parameters
    roles = {n.name: n.meta[TP_KEY].role for n in captured.graph_module.graph.nodes if TP_KEY in n.meta}
    assert roles == {k: v.role for k, v in layout.roles.items()}


def test_llama_tiny_gqa_replicates_kv_heads_beyond_their_count() -> None:
    llama = example("llama")
    layout, _ = _layout(llama.build_model(), llama.example_inputs(2))
    assert _kinds(layout) == {"attention": 4, "mlp": 4, "embedding": 1, "head": 1}
    attention = next(p for p in layout.patterns if p.kind == "attention")
    assert attention.heads == (4, 2) and len(attention.columns) == 3  # q, k, v
    mlp = next(p for p in layout.patterns if p.kind == "mlp")
    assert len(mlp.columns) == 2 and mlp.width == 176  # gate and up; SwiGLU's product joins them
    # tp 4 > 2 key/value heads: each GPU computes the one it reads (replicated), so 4 is allowed.
    assert layout.degrees(8) == (1, 2, 4)
    k = attention.columns[1]
    assert layout.roles[k].units == 2


def test_llama_70b_shape_on_meta() -> None:
    llama = example("llama")
    shape = dataclasses.replace(llama.LLAMA3_SHAPES["llama3_70b"], layers=2, seq_len=16)
    model = llama._build(shape, meta=True)
    layout, _ = _layout(model, (torch.zeros(1, 16, dtype=torch.long),))
    assert _kinds(layout) == {"attention": 2, "mlp": 2, "embedding": 1, "head": 1}
    assert {p.heads for p in layout.patterns if p.kind == "attention"} == {(64, 8)}
    assert {p.width for p in layout.patterns if p.kind == "mlp"} == {28672}
    assert layout.degrees(8) == (1, 2, 4, 8)
    assert layout.why_not(8) == ""


@pytest.mark.parametrize(("name", "heads", "head"), [
    ("gpt2", None, True),       # Conv1D: addmm with the weight as (in, out); fused c_attn cut in thirds: whole
    ("bert", (4, 4), False),    # encoder: q, k, v, output dense; intermediate/output dense
    ("qwen2", (4, 2), True),    # GQA, RoPE, SwiGLU
    ("qwen3", (4, 2), True),    # per-head q/k RMSNorms: a norm over each head's features stays on its GPU
])
def test_hugging_face_zoo(name: str, heads: tuple[int, int] | None, head: bool) -> None:
    pytest.importorskip("transformers")
    model_file = load_model_file(str(MODELS / f"zoo_{name}.py"))
    layout, _ = _layout(model_file.build(), model_file.example_inputs(2))
    kinds = _kinds(layout)
    if heads is None:
        assert kinds["attention"] == 0 and kinds["mlp"] >= 2 and len(layout.dropped) == kinds["mlp"]
    else:
        assert kinds["attention"] == kinds["mlp"] >= 2 and not layout.dropped
        assert {p.heads for p in layout.patterns if p.kind == "attention"} == {heads}
    assert kinds["embedding"] == 1 and kinds["head"] == int(head)


def test_mistral_from_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=None, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).train()
    layout, _ = _layout(model, {"input_ids": torch.randint(0, 128, (2, 8))})
    assert _kinds(layout) == {"attention": 2, "mlp": 2, "embedding": 1, "head": 1}
    assert layout.degrees(8) == (1, 2, 4)


def test_no_pattern_keeps_tp_1_with_the_reason() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    layout, _ = _layout(model, (torch.randn(2, 3, 8, 8),))
    assert layout.pairs == () and layout.reason == NO_PATTERN
    assert layout.degrees(8) == (1,) and layout.why_not(8) == NO_PATTERN
    assert "none" in layout.summary()


def test_a_residual_joining_the_split_value_is_no_pair() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)) + x)  # x (whole) joins the split value: not splittable

    layout, _ = _layout(Residual(), (torch.randn(2, 16),))
    assert layout.pairs == ()


def test_a_value_escaping_the_pair_is_no_pair() -> None:
    class Escape(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.up(x))
            return self.down(h), h  # the hidden value leaves the model: the row's all-reduce cannot hide it

    layout, _ = _layout(Escape(), (torch.randn(2, 8),))
    assert layout.pairs == ()


def test_degrees_respect_the_node_and_the_widths() -> None:
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    layout, _ = _layout(model, (torch.randn(2, 8),))
    assert _kinds(layout) == {"mlp": 1}
    assert layout.degrees(8) == (1, 2, 4) and layout.degrees(6) == (1, 2, 3, 6)


class _NormedAttention(nn.Module):
    """Attention with a q/k norm: over each head's features (Qwen3, Gemma 3) or over the whole width (OLMo 2)."""

    def __init__(self, *, per_head: bool, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.per_head = heads, per_head
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.q_norm = nn.RMSNorm(width // heads if per_head else width)
        self.k_norm = nn.RMSNorm(width // heads if per_head else width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if not self.per_head:
            q, k = self.q_norm(q), self.k_norm(k)  # over C: every head's features at once
        q, k, v = (y.view(b, t, self.heads, c // self.heads) for y in (q, k, v))  # (B, T, H, D)
        if self.per_head:
            q, k = self.q_norm(q), self.k_norm(k)  # over D: each head alone
        y = nn.functional.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_a_norm_over_each_heads_features_keeps_the_attention_split(method: str) -> None:
    """Gemma 3's and Qwen3's q/k norms reduce over a head's features: the pair splits by heads; OLMo 2's
    reduce over the whole width (every head), which a split would make partial: kept whole, with the reason."""
    x = torch.randn(2, 8, 32)
    for per_head in (True, False):
        model = _NormedAttention(per_head=per_head)
        captured = capture(model, (x,), method=method)
        propagate_values(captured.graph_module, (x,))
        layout = find_tensor_parallel(captured)
        if per_head:
            assert [(p.kind, p.heads) for p in layout.pairs] == [("attention", (4, 4))], layout.summary()
            assert not any("norm" in name for name in layout.parameters)  # the norm's weight is whole
        else:
            assert layout.pairs == () and len(layout.dropped) == 1, layout.summary()
            assert "along the split dimension" in next(iter(layout.dropped.values()))


def test_ops_dtensor_cannot_run_keep_their_pair_whole_or_run_whole() -> None:
    """Issue 43: weight_norm's backward and CPU flash attention's backward have no DTensor rule.  The pair whose
    column is weight-normed is kept whole, naming the op; the attention module (in no pair) runs on whole
    values; the plain MLP still splits."""
    model_file = load_model_file(str(MODELS / "tp_unruled_ops.py"))
    layout, _ = _layout(model_file.build(), model_file.example_inputs(2))
    assert [p.kind for p in layout.pairs] == ["mlp"] and len(layout.dropped) == 1, layout.summary()
    assert "_weight_norm_interface_backward" in next(iter(layout.dropped.values()))
    assert any("flash_attention_for_cpu_backward" in op for op in layout.local.values()), layout.local
    assert set(layout.local) <= layout.whole  # priced whole, as they run
    assert "run" in layout.summary() and "DTensor" in layout.summary()
