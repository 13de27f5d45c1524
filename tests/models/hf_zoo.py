"""A zoo of tiny Hugging Face models from configs (random weights, nothing downloaded).

Each entry builds a model that computes its own loss from ``labels`` (the model file
convention's ``target_keyword``), with an attention mask where the model takes one:
GPT-2, BERT, ViT, Qwen2 (RoPE, grouped-query attention), Qwen3 (per-head q/k norms), BART (encoder-decoder with
cross-attention) and Mixtral (mixture of experts).  Dropout is off; attention is eager.
Every micro-batch has as many counted tokens (no ``-100`` padding), so the mean of the
micro-batch losses is the mini-batch loss.

A zoo file (``zoo_gpt2.py``) is ``from hf_zoo import model_file; globals().update(model_file("gpt2"))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "model_file"]

_SEQ = 8
_VOCAB = 96
_HIDDEN = 32


def _tokens(batch: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, _VOCAB, (batch, _SEQ), generator=g)  # (B, T); 0-2 left for special ids


def _mask(batch: int) -> Tensor:
    """(B, T) ones, with the last two positions of every other sample padded out."""
    mask = torch.ones(batch, _SEQ, dtype=torch.long)
    mask[1::2, -2:] = 0
    return mask


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=4, n_embd=_HIDDEN, n_head=4, vocab_size=_VOCAB, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=2,
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=_VOCAB, hidden_size=_HIDDEN, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0,  # type: ignore[call-arg]
    )
    return transformers.BertForSequenceClassification(config)


def _vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=_HIDDEN, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=5,  # type: ignore[call-arg]
    )
    return transformers.ViTForImageClassification(config)


def _qwen2() -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.Qwen2ForCausalLM(config)


def _qwen3() -> nn.Module:
    import transformers

    config = transformers.Qwen3Config(  # per-head q/k RMSNorms (as Gemma 3, OLMo 2), grouped-query attention
        vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.Qwen3ForCausalLM(config)


def _bart() -> nn.Module:
    import transformers

    config = transformers.BartConfig(
        vocab_size=_VOCAB, d_model=_HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )
    return transformers.BartForConditionalGeneration(config)


def _mixtral() -> nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, use_cache=False, attention_dropout=0.0, router_jitter_noise=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.MixtralForCausalLM(config)


def _text(batch: int) -> dict[str, Any]:
    return {"input_ids": _tokens(batch), "attention_mask": _mask(batch)}


def _classes(count: int) -> Callable[[int], Tensor]:
    def target(batch: int) -> Tensor:
        return torch.randint(0, count, (batch,), generator=torch.Generator().manual_seed(3))  # (B,)

    return target


def _images(batch: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(4)
    return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}  # (B, C, H, W)


# name -> (build, example_inputs, example_target); targets go in as `labels`.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], Callable[[int], Tensor]]] = {
    "gpt2": (_gpt2, _text, _tokens),
    "bert": (_bert, _text, _classes(3)),
    "vit": (_vit, _images, _classes(5)),
    "qwen2": (_qwen2, _text, _tokens),
    "qwen3": (_qwen3, _text, _tokens),
    "bart": (_bart, _text, lambda b: _tokens(b, seed=5)),
    "mixtral": (_mixtral, _text, _tokens),
}


def model_file(name: str) -> dict[str, Any]:
    """The model file convention's names for zoo entry ``name``."""
    build, inputs, target = MODELS[name]

    def build_model() -> nn.Module:
        torch.manual_seed(0)
        model = build()
        config: Any = model.config
        config._attn_implementation = "eager"  # explicit matmuls: the same on every route
        model.train()  # every dropout probability is 0
        return model

    return {"build_model": build_model, "example_inputs": inputs, "example_target": target,
            "target_keyword": "labels"}
