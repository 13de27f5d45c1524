"""Llama 3 language models (Hugging Face ``LlamaForCausalLM``), as an autopartition model file.

Needs the ``hf`` extra (``pip install transformers`` or ``pip install 'autopartition[hf]'``).
Nothing is downloaded: every factory builds the architecture from a ``LlamaConfig``.

Factories (pick one with ``examples/llama.py:NAME``):

=================  ======================================================  ==========  =======
factory            shape                                                   parameters  seq len
=================  ======================================================  ==========  =======
``build_model``    tiny Llama: 4 layers, hidden 64, 4 heads / 2 KV heads,  0.25 M      32
                   vocabulary 512; real CPU weights, seeded (``verify``)
``llama_tiny``     same as ``build_model``                                 0.25 M      32
``llama3_8b``      32 layers, hidden 4,096, FFN 14,336, 32 / 8 heads       8.03 B      4,096
``llama3_70b``     80 layers, hidden 8,192, FFN 28,672, 64 / 8 heads       70.6 B      4,096
``llama3_405b``    126 layers, hidden 16,384, FFN 53,248, 128 / 8 heads    405.9 B     4,096
=================  ======================================================  ==========  =======

The three large shapes are those of Table 3 of "The Llama 3 Herd of Models"
(Llama Team, AI @ Meta, 2024, arXiv:2407.21783): layers, model dimension, FFN
dimension, attention heads, 8 key/value heads (grouped-query attention), SwiGLU,
RoPE with theta = 500,000.  The table rounds the vocabulary to 128,000; the released
checkpoints have 128,256 entries (128,000 BPE tokens + 256 special tokens), which is
what we use, with untied input embedding and LM head as in the releases.  Their
sequence length here is 4,096: the first stage of Llama 3 405B pre-training used
sequences of 4,096 tokens (section 3.4.1) before moving to 8,192.

The large factories build on the ``meta`` device (``with torch.device("meta")``): no
memory is allocated for the weights, so a 405B model "builds" in well under a
second.  Plan them with a roofline device, which needs only shapes::

    autopartition examples/llama.py:llama3_70b --gpus 64 --device h100 --batch-size 256 \\
        --precision bf16-mixed --recompute auto --microbatches auto --out plan-70b/

The tiny default has real weights, so its plans can be verified on CPU ranks::

    autopartition examples/llama.py --gpus 4 --batch-size 16 --microbatches 4 --out plan/
    autopartition verify plan/ --model examples/llama.py

Attention is ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``, the
transformers default and what Llama training uses: flash-style kernels that keep no
``seq x seq`` matrix for backward); no KV cache; no dropout.

One ``example_inputs`` for several factories: the model-file convention has one
``example_inputs(batch_size)`` per file, and the planner, ``verify`` and every rank
call the factory before it.  So each factory records its configuration in this
module and ``example_inputs`` / ``example_target`` use the one built last (the
tiny model's before any build).  ``SEQ_LENS`` lists the sequence length of each
factory.  Inputs are CPU ``int64`` token ids of shape ``(B, seq_len)``.
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
    "LARGE_SEQ_LEN",
    "LLAMA3_SHAPES",
    "SEQ_LEN",
    "SEQ_LENS",
    "VOCAB_SIZE",
    "LlamaShape",
    "build_model",
    "example_inputs",
    "example_target",
    "llama3_8b",
    "llama3_70b",
    "llama3_405b",
    "llama_config",
    "llama_tiny",
    "loss_fn",
]

SEQ_LEN = 32  # the tiny model's example sequence length (<= its max_position_embeddings)
VOCAB_SIZE = 512  # the tiny model's vocabulary
LARGE_SEQ_LEN = (
    4096  # the large factories' sequence length (Llama 3 405B's first pre-training stage)
)
LLAMA3_VOCAB = 128_256  # released Llama 3 tokenizer: 128,000 BPE + 256 special tokens


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The numbers that fix a Llama's size (Llama 3 paper, Table 3)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = LLAMA3_VOCAB
    seq_len: int = LARGE_SEQ_LEN
    max_positions: int = 8192  # Llama 3 pre-training context
    rope_theta: float = 500_000.0


TINY = LlamaShape(
    layers=4,
    hidden=64,
    ffn=176,
    heads=4,
    kv_heads=2,
    vocab=VOCAB_SIZE,
    seq_len=SEQ_LEN,
    max_positions=128,
)
LLAMA3_SHAPES: dict[str, LlamaShape] = {
    "llama3_8b": LlamaShape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "llama3_70b": LlamaShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8),
    "llama3_405b": LlamaShape(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8),
}
SEQ_LENS: dict[str, int] = {
    "build_model": TINY.seq_len,
    "llama_tiny": TINY.seq_len,
    **{name: shape.seq_len for name, shape in LLAMA3_SHAPES.items()},
}


def _hf_gpt2() -> types.ModuleType:
    """``examples/hf_gpt2.py``, imported by path once per process, as ``examples/gpt3.py`` does."""
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
_built: list[LlamaShape] = [TINY]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "examples/llama.py needs Hugging Face transformers: "
            "pip install transformers (or pip install 'autopartition[hf]')"
        ) from exc
    return transformers


def llama_config(shape: LlamaShape) -> Any:
    """The ``LlamaConfig`` of ``shape``: no KV cache, untied LM head, sdpa attention, no dropout."""
    transformers = _transformers()
    return transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        hidden_act="silu",  # SwiGLU MLP
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=shape.vocab - 1 if shape.vocab < LLAMA3_VOCAB else 128_000,
        eos_token_id=shape.vocab - 1 if shape.vocab < LLAMA3_VOCAB else 128_001,
        attn_implementation="sdpa",
    )


def _build(shape: LlamaShape, *, meta: bool) -> nn.Module:
    transformers = _transformers()
    config = llama_config(shape)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(config)
    model.train()  # no dropout anywhere, so train mode is deterministic
    _built[0] = shape
    return model


def build_model() -> nn.Module:
    """The tiny Llama (4 layers, hidden 64, GQA 4/2, vocabulary 512), real seeded CPU weights."""
    return _build(TINY, meta=False)


def llama_tiny() -> nn.Module:
    """Same as ``build_model()``."""
    return build_model()


def llama3_8b() -> nn.Module:
    """Llama 3 8B shape on the meta device (8.03 B parameters, no memory allocated)."""
    return _build(LLAMA3_SHAPES["llama3_8b"], meta=True)


def llama3_70b() -> nn.Module:
    """Llama 3 70B shape on the meta device (70.6 B parameters, no memory allocated)."""
    return _build(LLAMA3_SHAPES["llama3_70b"], meta=True)


def llama3_405b() -> nn.Module:
    """Llama 3.1 405B shape on the meta device (405.9 B parameters, no memory allocated)."""
    return _build(LLAMA3_SHAPES["llama3_405b"], meta=True)


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
