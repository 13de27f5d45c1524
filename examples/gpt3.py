"""GPT-3 shapes (nanoGPT-style GPT of ``examples/gpt.py``), as an autopartition model file.

Factories (pick one with ``examples/gpt3.py:NAME``):

================  ===========================================================  ==========  =======
factory           shape                                                        parameters  seq len
================  ===========================================================  ==========  =======
``build_model``   the tiny GPT of ``examples/gpt.py`` (4 layers, 64 wide,      0.23 M      32
                  vocabulary 512); real seeded CPU weights (``verify``)
``gpt3_xl``       GPT-3 XL: 24 layers, d_model 2,048, 16 heads (see below)     1.3 B       2,048
``gpt3_175b``     GPT-3 175B: 96 layers, d_model 12,288, 96 heads               175 B       2,048
================  ===========================================================  ==========  =======

The shapes are Table 2.1 of Brown et al., "Language Models are Few-Shot Learners"
(NeurIPS 2020): n_layers, d_model, n_heads, context window n_ctx = 2,048, and the
GPT-2 BPE vocabulary of 50,257 tokens; feed-forward width 4 x d_model, learned
position embeddings, LM head tied to the token embedding.  (GPT-3 alternates dense
and locally banded sparse attention layers; this model, like nanoGPT, uses dense
attention in every layer, which has the same parameters and at most the FLOPs.  Table
2.1 gives GPT-3 XL 24 heads of width 128, an attention width of 3,072 that does not
match its d_model of 2,048; ``gpt3_xl`` uses 16 heads of 128, which changes no
parameter count.)

The model class is ``examples/gpt.py``'s ``GPT`` (imported, not copied): pre-LayerNorm
blocks, attention written with explicit matmuls (so each layer keeps the
``seq x seq`` attention matrices for backward, as GPT-3-era training without fused
attention did: the ``5as/h`` term of Korthikanti et al. 2022).  The large factories
build on the ``meta`` device: no memory is allocated for the weights.  Plan one with a
roofline device, which needs only shapes::

    autopartition examples/gpt3.py:gpt3_175b --gpus 512 --device h100 --batch-size 1536 \\
        --precision bf16-mixed --recompute auto --microbatches auto --out plan-175b/

(1,536 sequences of 2,048 tokens is GPT-3 175B's batch of 3.2 M tokens, Table 2.1.)

As in ``examples/llama.py``, each factory records its configuration in this module
and ``example_inputs`` / ``example_target`` use the one built last (the tiny one
before any build): the planner, ``verify`` and every rank call the factory first.
``SEQ_LENS`` lists each factory's sequence length.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = [
    "GPT3_SHAPES",
    "SEQ_LEN",
    "SEQ_LENS",
    "build_model",
    "example_inputs",
    "example_target",
    "gpt3_175b",
    "gpt3_config",
    "gpt3_xl",
    "loss_fn",
]


def _sibling(name: str) -> types.ModuleType:
    """``examples/<name>.py``, imported by path once per process (examples is not a package)."""
    key = f"_autopartition_example_{name}"  # the key tests/_examples.py uses: one module for both
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # before exec_module: dataclasses look the module up
    spec.loader.exec_module(module)
    return module


_gpt = _sibling("gpt")
GPT = _gpt.GPT
GPTConfig = _gpt.GPTConfig
loss_fn = _gpt.loss_fn  # mean next-token cross-entropy; target is (B, T), the inputs shifted by one

SEQ_LEN: int = _gpt.SEQ_LEN  # the tiny model's sequence length

# (n_layer, n_embd, n_head) of Brown et al. 2020, Table 2.1; vocabulary 50,257, n_ctx 2,048.
GPT3_SHAPES: dict[str, tuple[int, int, int]] = {
    "gpt3_xl": (24, 2048, 16),  # Table 2.1 says 24 heads x 128 (= 3,072 != d_model); 16 x 128 here
    "gpt3_175b": (96, 12288, 96),
}
GPT3_VOCAB = 50257
GPT3_CONTEXT = 2048

SEQ_LENS: dict[str, int] = {"build_model": SEQ_LEN, **{name: GPT3_CONTEXT for name in GPT3_SHAPES}}

# The configuration and sequence length of the model built last in this process.
_built: list[tuple[object, int]] = [(GPTConfig(), SEQ_LEN)]


def gpt3_config(name: str) -> object:
    """The ``GPTConfig`` of a GPT-3 shape (``"gpt3_xl"`` or ``"gpt3_175b"``)."""
    n_layer, n_embd, n_head = GPT3_SHAPES[name]
    return GPTConfig(
        vocab_size=GPT3_VOCAB,
        block_size=GPT3_CONTEXT,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
    )


def build_model() -> nn.Module:
    """The tiny GPT of ``examples/gpt.py`` (real seeded weights)."""
    config = GPTConfig()
    _built[0] = (config, SEQ_LEN)
    return _gpt.build_model(config)


def _meta(name: str) -> nn.Module:
    config = gpt3_config(name)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    _built[0] = (config, GPT3_CONTEXT)
    return model


def gpt3_xl() -> nn.Module:
    """GPT-3 XL shape (1.3 B parameters) on the meta device."""
    return _meta("gpt3_xl")


def gpt3_175b() -> nn.Module:
    """GPT-3 175B shape (174.6 B parameters with the tied head) on the meta device."""
    return _meta("gpt3_175b")


def _tokens(batch_size: int) -> Tensor:
    """(B, T + 1) token ids; inputs and targets are two views of the same draw."""
    config, seq = _built[0]
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (batch_size, seq + 1), generator=g)  # type: ignore[attr-defined]


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    """``(idx,)``: (B, T) int64 on the CPU, T the sequence length of the last-built factory."""
    return (_tokens(batch_size)[:, :-1].contiguous(),)  # (B, T)


def example_target(batch_size: int = 8) -> Tensor:
    """Next-token targets (B, T), int64: ``example_inputs`` shifted left by one."""
    return _tokens(batch_size)[:, 1:].contiguous()  # (B, T)
