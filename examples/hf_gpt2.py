"""A tiny Hugging Face GPT-2 (random weights, nothing downloaded), as an autopartition model file.

Needs the ``hf`` extra (``pip install transformers`` or ``pip install 'autopartition[hf]'``).
Plan it and check the plan on CPU ranks::

    autopartition examples/hf_gpt2.py --gpus 4 --batch-size 16 --microbatches 4 --out plan/
    autopartition verify plan/ --model examples/hf_gpt2.py

``GPT2LMHeadModel`` with 4 layers, 4 heads, width 64, vocabulary 512 and 64 positions;
dropout off, no KV cache, eager attention (explicit matmuls, which capture cleanly).
The model returns a ``ModelOutput`` whose ``"logits"`` are (B, T, V); ``loss_fn``
computes next-token cross-entropy with the usual Hugging Face convention that the
target is the input ids themselves (position t predicts token t + 1).  Hugging Face
models capture with ``torch.export.export(..., strict=False)``; ``torch.fx.symbolic_trace``
does not handle them.
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SEQ_LEN",
    "VOCAB_SIZE",
    "build_model",
    "example_inputs",
    "example_target",
    "gpt2_config",
    "loss_fn",
]

SEQ_LEN = 32  # example sequence length (<= n_positions)
VOCAB_SIZE = 512


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "examples/hf_gpt2.py needs Hugging Face transformers: "
            "pip install transformers (or pip install 'autopartition[hf]')"
        ) from exc
    return transformers


def gpt2_config() -> Any:
    """The ``GPT2Config`` of the example: small, dropout-free, cache-free, eager attention."""
    transformers = _transformers()
    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB_SIZE,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=VOCAB_SIZE - 1,  # GPT-2's default (50256) lies outside this vocabulary
        eos_token_id=VOCAB_SIZE - 1,
    )
    config._attn_implementation = "eager"  # explicit matmuls rather than an SDPA kernel
    return config


def build_model() -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` (seeded: same weights in every process)."""
    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    model.train()  # dropout probabilities are 0, so train mode is deterministic too
    return model


def _tokens(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN), generator=g)  # (B, T)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    """``(input_ids,)``: (B, SEQ_LEN) int64."""
    return (_tokens(batch_size),)  # (B, T)


def example_target(batch_size: int = 8) -> Tensor:
    """Labels (B, SEQ_LEN), int64: the input ids themselves (shifted inside ``loss_fn``)."""
    return _tokens(batch_size)  # (B, T)


def loss_fn(outputs: Any, target: Tensor) -> Tensor:
    """Mean next-token cross-entropy over B * (T - 1) positions (a scalar).

    ``outputs`` is the model's ``ModelOutput`` (or any mapping with ``"logits"``, or a
    tuple whose first element is the logits).
    """
    if isinstance(outputs, Mapping):
        logits = outputs["logits"]  # (B, T, V)
    elif isinstance(outputs, (tuple, list)):
        logits = outputs[0]  # (B, T, V)
    else:
        logits = outputs  # (B, T, V)
    shift_logits = logits[:, :-1, :]  # (B, T-1, V): predictions for positions 1..T-1
    shift_labels = target[:, 1:]  # (B, T-1)
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1)
    )
