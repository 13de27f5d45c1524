"""DeepSeek-V3 language models (Hugging Face ``DeepseekV3ForCausalLM``), as an autopartition model file.

Needs the ``hf`` extra (``pip install transformers`` or ``pip install 'autopartition[hf]'``).
Nothing is downloaded: every factory builds the architecture from a ``DeepseekV3Config``.

Factories (pick one with ``examples/deepseek_v3.py:NAME``):

=======================  ================================================  ==========  =======
factory                  shape                                             parameters  seq len
=======================  ================================================  ==========  =======
``build_model``          tiny DeepSeek-V3: 3 layers (the first dense),     0.24 M      32
                         hidden 64, 8 routed experts top-2 + 1 shared,
                         MLA attention; real seeded CPU weights (``verify``)
``deepseek_v3_tiny``     same as ``build_model``                           0.24 M      32
``deepseek_v3_671b``     61 layers (3 dense), hidden 7,168, 256 routed     671.0 B     4,096
                         experts top-8 + 1 shared, 128 heads (MLA)
=======================  ================================================  ==========  =======

The 671B shape is that of the DeepSeek-V3 Technical Report (DeepSeek-AI, 2024,
arXiv:2412.19437, section 4.2) and the released ``config.json``: 61 layers of hidden
7,168; the first 3 have a dense SwiGLU FFN of 18,432, the other 58 a mixture of
experts: 256 routed experts of width 2,048, 8 chosen per token (sigmoid gating within
4 of 8 expert groups, scaled by 2.5) and 1 shared expert; Multi-head Latent Attention
with 128 heads, query compression 1,536, key-value compression 512, per-head query/key
width 128 + 64 (RoPE) and value width 128; vocabulary 129,280, untied LM head.  That
is 671.0 B parameters, 37.6 B of them active per token.  The multi-token-prediction
module of the release (14 B more) is not part of ``DeepseekV3ForCausalLM`` and not
built.  The sequence length is 4,096, the pre-training context (YaRN extends it
later, which changes no shape; RoPE here is the plain one).

The large factory builds on the ``meta`` device: no memory is allocated for the
weights.  Plan it with a roofline device, which needs only shapes::

    autopartition examples/deepseek_v3.py:deepseek_v3_671b --gpus 2048 --device h100 \\
        --batch-size 4096 --precision bf16-mixed --out plan-dsv3/

The tiny default has real weights, so its plans can be verified on CPU ranks::

    autopartition examples/deepseek_v3.py --gpus 2 --batch-size 8 --microbatches 4 --out plan/
    autopartition verify plan/ --model examples/deepseek_v3.py

Attention is ``sdpa``; no KV cache; no dropout.  The experts run Hugging Face's default
``grouped_mm`` implementation (one grouped matmul per projection over every expert).
As in ``examples/llama.py``, each factory records its shape in this module and
``example_inputs`` / ``example_target`` use the one built last (the tiny one before
any build).  Inputs are CPU ``int64`` token ids of shape ``(B, seq_len)``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "DEEPSEEK_V3_671B",
    "SEQ_LEN",
    "SEQ_LENS",
    "TINY",
    "DeepseekShape",
    "build",
    "build_model",
    "deepseek_config",
    "deepseek_v3_671b",
    "deepseek_v3_tiny",
    "example_inputs",
    "example_target",
    "loss_fn",
]

SEQ_LEN = 32  # the tiny model's example sequence length (<= its max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class DeepseekShape:
    """The numbers that fix a DeepSeek-V3's size (the released ``config.json``)."""

    layers: int
    dense_layers: int  # the first ``dense_layers`` have a dense FFN (first_k_dense_replace)
    hidden: int
    ffn: int  # the dense layers' FFN width
    expert_ffn: int  # each expert's FFN width (moe_intermediate_size)
    experts: int  # routed experts per MoE layer
    top_k: int
    shared_experts: int
    groups: int  # expert groups (n_group): each token's experts come from topk_groups of them
    topk_groups: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab: int
    seq_len: int
    routed_scaling_factor: float = 2.5


TINY = DeepseekShape(
    layers=3, dense_layers=1, hidden=64, ffn=128, expert_ffn=32, experts=8, top_k=2, shared_experts=1,
    groups=2, topk_groups=1, heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, vocab=512, seq_len=SEQ_LEN,
)
DEEPSEEK_V3_671B = DeepseekShape(
    layers=61, dense_layers=3, hidden=7168, ffn=18432, expert_ffn=2048, experts=256, top_k=8, shared_experts=1,
    groups=8, topk_groups=4, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, vocab=129_280, seq_len=4096,
)
SEQ_LENS: dict[str, int] = {
    "build_model": TINY.seq_len,
    "deepseek_v3_tiny": TINY.seq_len,
    "deepseek_v3_671b": DEEPSEEK_V3_671B.seq_len,
}


def _hf_gpt2() -> types.ModuleType:
    """``examples/hf_gpt2.py``, imported by path once per process, as ``examples/llama.py`` does."""
    key = "_autopartition_example_hf_gpt2"  # the key tests/_examples.py uses: one module for all
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name("hf_gpt2.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


# Mean next-token cross-entropy over B * (T - 1) positions; target is (B, T), the input ids
# (shifted inside).  ``outputs`` is a ``ModelOutput``, a mapping with ``"logits"`` or a tuple.
loss_fn = _hf_gpt2().loss_fn

# The shape of the model built last in this process (see the module docstring).
_built: list[DeepseekShape] = [TINY]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "examples/deepseek_v3.py needs Hugging Face transformers: "
            "pip install transformers (or pip install 'autopartition[hf]')"
        ) from exc
    return transformers


def deepseek_config(shape: DeepseekShape) -> Any:
    """The ``DeepseekV3Config`` of ``shape``: no KV cache, untied LM head, sdpa attention, no dropout."""
    return _transformers().DeepseekV3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        moe_intermediate_size=shape.expert_ffn,
        num_hidden_layers=shape.layers,
        first_k_dense_replace=shape.dense_layers,
        n_routed_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        n_shared_experts=shape.shared_experts,
        n_group=shape.groups,
        topk_group=shape.topk_groups,
        routed_scaling_factor=shape.routed_scaling_factor,
        norm_topk_prob=True,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        max_position_embeddings=max(shape.seq_len, 128),
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
    )


def build(shape: DeepseekShape, *, meta: bool) -> nn.Module:
    """A ``DeepseekV3ForCausalLM`` of ``shape`` in train mode: on ``meta`` (no memory), or seeded CPU weights."""
    transformers = _transformers()
    config = deepseek_config(shape)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = transformers.DeepseekV3ForCausalLM(config)
    else:
        model = transformers.DeepseekV3ForCausalLM(config)
    model.train()  # no dropout anywhere, so train mode is deterministic
    _built[0] = shape
    return model


def build_model() -> nn.Module:
    """The tiny DeepSeek-V3 (3 layers, hidden 64, 8 experts top-2 + 1 shared), real seeded CPU weights."""
    return build(TINY, meta=False)


def deepseek_v3_tiny() -> nn.Module:
    """Same as ``build_model()``."""
    return build_model()


def deepseek_v3_671b() -> nn.Module:
    """DeepSeek-V3's 671B shape on the meta device (no memory allocated)."""
    return build(DEEPSEEK_V3_671B, meta=True)


def _tokens(batch_size: int) -> Tensor:
    shape = _built[0]
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, shape.vocab, (batch_size, shape.seq_len), generator=g)  # (B, T)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    """``(input_ids,)``: (B, T) int64 on the CPU, T the sequence length of the last-built factory."""
    return (_tokens(batch_size),)  # (B, T)


def example_target(batch_size: int = 8) -> Tensor:
    """Labels (B, T), int64: the input ids themselves (shifted inside ``loss_fn``)."""
    return _tokens(batch_size)  # (B, T)
