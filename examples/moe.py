"""Mixture-of-experts language models people train in 2026 (Hugging Face), as an autopartition model file.

Needs the ``hf`` extra (``pip install transformers`` or ``pip install 'autopartition[hf]'``).
Nothing is downloaded: every factory builds the architecture from its published config with
random weights.  DeepSeek-V3 has its own file, ``examples/deepseek_v3.py``.

Factories (pick one with ``examples/moe.py:NAME``):

=====================  ===========================================================  ==========  =======
factory                shape                                                        parameters  seq len
=====================  ===========================================================  ==========  =======
``build_model``        tiny Qwen3-MoE: 2 layers, hidden 64, 8 experts top-2;         0.2 M       32
                       real seeded CPU weights (``verify``)
``mixtral_8x7b``       32 layers, hidden 4,096, 8 experts (FFN 14,336) top-2, 32/8   46.7 B      4,096
                       heads (Mistral AI's release config)
``qwen3_30b_a3b``      48 layers, hidden 2,048, 128 experts (FFN 768) top-8,         30.5 B      4,096
                       32/4 heads of 128 (Qwen3 technical report, Table 2)
``qwen3_235b_a22b``    94 layers, hidden 4,096, 128 experts (FFN 1,536) top-8,       235 B       4,096
                       64/4 heads of 128
``gpt_oss_120b``       36 layers, hidden 2,880, 128 experts (FFN 2,880) top-4,       117 B       4,096
                       64/8 heads of 64, alternating 128-token sliding windows
=====================  ===========================================================  ==========  =======

The large factories build on ``meta`` (nothing allocated); plan them with a roofline device::

    autopartition examples/moe.py:qwen3_235b_a22b --gpus 256 --device h100 --batch-size 2048 \\
        --precision bf16-mixed --ep auto --out plan-qwen3/

The tiny default has real weights, so its plans verify on CPU ranks::

    autopartition examples/moe.py --gpus 2 --batch-size 8 --out plan/
    autopartition verify plan/ --model examples/moe.py

Each factory records its shape in this module and ``example_inputs`` / ``example_target``
use the one built last (the tiny one before any build), as in ``examples/llama.py``.
Inputs are CPU ``int64`` token ids ``(B, seq_len)``; the loss is next-token cross-entropy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "SHAPES",
    "MoEShape",
    "build_model",
    "example_inputs",
    "example_target",
    "gpt_oss_120b",
    "loss_fn",
    "mixtral_8x7b",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
]


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One published MoE configuration: the Hugging Face class and its config's keywords."""

    family: str  # "qwen3_moe", "mixtral" or "gpt_oss"
    config: dict[str, Any]
    seq_len: int = 4096


SHAPES: dict[str, MoEShape] = {
    "tiny": MoEShape("qwen3_moe", {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "max_position_embeddings": 128}, seq_len=32),
    # Mistral AI's Mixtral-8x7B-v0.1 config.json.
    "mixtral_8x7b": MoEShape("mixtral", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
        "rope_theta": 1e6}),
    # Qwen3 technical report (arXiv:2505.09388) Table 2 and the released config.json files.
    "qwen3_30b_a3b": MoEShape("qwen3_moe", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 40960, "rope_theta": 1e6}),
    "qwen3_235b_a22b": MoEShape("qwen3_moe", {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 40960, "rope_theta": 1e6}),
    # OpenAI's gpt-oss-120b config.json (arXiv:2508.10925).
    "gpt_oss_120b": MoEShape("gpt_oss", {
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
        "max_position_embeddings": 131072}),
}
_CLASSES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
            "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}


def _hf_gpt2() -> types.ModuleType:
    """``examples/hf_gpt2.py`` (its loss), imported by path once per process, as ``examples/llama.py`` does."""
    key = "_autopartition_example_hf_gpt2"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name("hf_gpt2.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


# Mean next-token cross-entropy; target is (B, T), the input ids (shifted inside).
loss_fn = _hf_gpt2().loss_fn
_built: list[MoEShape] = [SHAPES["tiny"]]


def _build(name: str, *, meta: bool) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("examples/moe.py needs Hugging Face transformers: pip install transformers") from exc
    shape = SHAPES[name]
    config_class, model_class = (getattr(transformers, n) for n in _CLASSES[shape.family])
    # gpt-oss's attention sinks have no sdpa path in transformers: its eager attention (scores kept) stands in.
    attention = "eager" if shape.family == "gpt_oss" else "sdpa"
    config = config_class(**shape.config, use_cache=False, tie_word_embeddings=False, attn_implementation=attention)
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = model_class(config)
    model.train()
    _built[0] = shape
    return model


def build_model() -> nn.Module:
    """The tiny Qwen3-MoE (2 layers, hidden 64, 8 experts top-2), real seeded CPU weights."""
    return _build("tiny", meta=False)


def mixtral_8x7b() -> nn.Module:
    return _build("mixtral_8x7b", meta=True)


def qwen3_30b_a3b() -> nn.Module:
    return _build("qwen3_30b_a3b", meta=True)


def qwen3_235b_a22b() -> nn.Module:
    return _build("qwen3_235b_a22b", meta=True)


def gpt_oss_120b() -> nn.Module:
    return _build("gpt_oss_120b", meta=True)


def _tokens(batch_size: int) -> Tensor:
    shape = _built[0]
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, shape.config["vocab_size"], (batch_size, shape.seq_len), generator=generator)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    """``(batch_size, seq_len)`` token ids of the model built last."""
    return (_tokens(batch_size),)


def example_target(batch_size: int = 8) -> Tensor:
    """The same ids: the loss shifts them (next-token prediction)."""
    return _tokens(batch_size)
