"""GPT-style models of any published shape, built on ``meta``, as an autopartition model file.

The published runs of ``tools/published/`` name their model as ``tools/published_models.py:NAME``
(Llama runs name ``examples/llama.py``'s factories).  ``NAME`` is a key of :data:`SHAPES`,
optionally followed by ``_s<seq>`` for another sequence length (MosaicML's learned position
table is as long as the run's sequence, so its parameter count moves with it)::

    autopartition tools/published_models.py:megatron_145b --gpus 1536 --device a100 --batch-size 2304 \\
        --precision bf16-mixed --recompute full --out plan-145b/
    autopartition tools/published_models.py:mpt_30b_s8192 --gpus 8 --device h100 --batch-size 168

The model is the GPT of Megatron-LM (Narayanan et al. 2021, Appendix; Korthikanti et al.
2022, section 3): token embedding (and learned positions, unless the run used ALiBi),
``layers`` pre-LayerNorm blocks (fused q/k/v, each head's three side by side as Megatron-LM lays
them out, and output projection, GELU MLP of width
``ffn``, biases everywhere), a final LayerNorm and an LM head tied to the token embedding.
Its parameters are ``l (12 h^2 + 13 h) + V h + s h + 2 h`` (Narayanan et al. 2021, Eq. 2),
which :func:`parameter_count` gives and the tests check against each published size.

Attention is ``"explicit"`` (``q k^T``, mask, softmax, ``@ v`` as separate ops: Megatron's
fused softmax keeps the ``s x s`` scores for backward, the ``5as/h`` term of Korthikanti et
al.) or ``"sdpa"`` (``scaled_dot_product_attention``: FlashAttention, as MPT and torchtitan
train).  Every factory builds on ``meta``: nothing is allocated.

>>> parameter_count(SHAPES["megatron_145b"]) / 1e9  # Table 1 of Narayanan et al. 2021: 145.6
145.6...
>>> shape_named("mpt_30b_s8192").seq
8192
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "GPT",
    "SHAPES",
    "GPTShape",
    "build",
    "example_inputs",
    "example_target",
    "loss_fn",
    "parameter_count",
    "shape_named",
]


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """The numbers that fix a GPT's size, and the size its source publishes.

    ``published``: parameters as the source states them (``published_source`` says where).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    published: float
    published_source: str
    ffn: int = 0  # 0: 4 x hidden
    positions: bool = True  # learned position embeddings (False: ALiBi, no parameters)
    attention: str = "explicit"  # "explicit" (scores kept for backward) or "sdpa" (flash)

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    def at(self, seq: int) -> GPTShape:
        return dataclasses.replace(self, seq=seq)


_T1 = "Narayanan et al. 2021 (arXiv:2104.04473), Table 1"
_T2 = "Narayanan et al. 2021, Table 2"
_K3 = "Korthikanti et al. 2022 (arXiv:2205.05198), Table 3"
_MS = "Jiang et al. 2024, MegaScale (arXiv:2402.15627), Table 1 and section 6.1"
_BS = "BigScience train/tr11-176B-ml/chronicles-prequel.md (Size column)"
_MPT = "llm-foundry scripts/train/benchmarking/README.md (NumParams column)"


def _megatron(layers: int, hidden: int, heads: int, published: float, source: str = _T1) -> GPTShape:
    return GPTShape(layers, hidden, heads, 51200, 2048, published, source)


def _mpt(layers: int, hidden: int, heads: int, published: float) -> GPTShape:
    return GPTShape(layers, hidden, heads, 50368, 2048, published, _MPT, attention="sdpa")


# Megatron shapes: sc21 scripts of NVIDIA/Megatron-LM (examples/academic_paper_scripts/sc21/run_table_1.sh:
# layers, hidden, heads), vocabulary 51,200 and sequence 2,048 (Narayanan et al. 2021, section 5.1).
SHAPES: dict[str, GPTShape] = {
    "megatron_1_7b": _megatron(24, 2304, 24, 1.7e9),
    "megatron_3_6b": _megatron(30, 3072, 32, 3.6e9),
    "megatron_7_5b": _megatron(36, 4096, 32, 7.5e9),
    "megatron_18b": _megatron(40, 6144, 48, 18.4e9),
    "megatron_39b": _megatron(48, 8192, 64, 39.1e9),
    "megatron_76b": _megatron(60, 10240, 80, 76.1e9),
    "megatron_145b": _megatron(80, 12288, 96, 145.6e9),
    "megatron_310b": _megatron(96, 16384, 128, 310.1e9),
    "megatron_530b": _megatron(105, 20480, 128, 529.6e9),
    "megatron_1t": _megatron(128, 25600, 160, 1008.0e9),
    "megatron_175b": _megatron(96, 12288, 96, 174.6e9, _T2),  # GPT-3's shape (Brown et al. 2020)
    "korthikanti_22b": _megatron(48, 6144, 64, 22e9, _K3),
    # MegaScale: vocabulary 64,000; heads as its Table 1 (128 and 160).
    "megascale_175b": GPTShape(96, 12288, 128, 64000, 2048, 175e9, _MS),
    "megascale_530b": GPTShape(105, 20480, 160, 64000, 2048, 530e9, _MS),
    # BLOOM (BigScience): ALiBi (no position parameters), vocabulary padded to 250,880 (tr11 slurm
    # --pad-vocab-size-to 250880), sequence 2,048; the prequel's experiments vary heads and layers.
    "bloom_176b": GPTShape(70, 14336, 112, 250880, 2048, 176e9, _BS, positions=False),
    "bloom_176b_h64": GPTShape(70, 14336, 64, 250880, 2048, 176e9, _BS, positions=False),
    "bloom_181b_h64": GPTShape(72, 14336, 64, 250880, 2048, 181e9, _BS, positions=False),
    # MPT (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): learned positions as long as the run's
    # sequence, vocabulary 50,368, flash attention; NumParams at sequence 2,048.
    "mpt_1b": _mpt(24, 2048, 16, 1_315_950_592),
    "mpt_3b": _mpt(32, 2560, 20, 2_651_837_440),
    "mpt_7b": _mpt(32, 4096, 32, 6_658_859_008),
    "mpt_13b": _mpt(40, 5120, 40, 12_853_954_560),
    "mpt_30b": _mpt(48, 7168, 56, 29_975_214_080),
    "mpt_70b": _mpt(80, 8192, 64, 64_862_437_376),
}

_SEQ = re.compile(r"^(?P<base>.+)_s(?P<seq>\d+)$")


def shape_named(name: str) -> GPTShape:
    """The shape ``name`` names: a key of :data:`SHAPES`, or one followed by ``_s<seq>``.

    >>> shape_named("megatron_530b").layers, shape_named("mpt_7b_s65536").seq
    (105, 65536)
    """
    if name in SHAPES:
        return SHAPES[name]
    match = _SEQ.match(name)
    if match and match["base"] in SHAPES:
        return SHAPES[match["base"]].at(int(match["seq"]))
    raise AttributeError(f"no published model shape {name!r}; shapes: {', '.join(SHAPES)} (optionally _s<seq>)")


def parameter_count(shape: GPTShape) -> int:
    """Parameters of :class:`GPT` at ``shape`` (Narayanan et al. 2021, Eq. 2, for a 4h MLP).

    >>> parameter_count(SHAPES["mpt_70b"]) == SHAPES["mpt_70b"].published
    True
    """
    h, f = shape.hidden, shape.ffn_width
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # q/k/v + out, MLP, two LayerNorms
    return shape.layers * layer + shape.vocab * h + (shape.seq * h if shape.positions else 0) + 2 * h


class _Attention(nn.Module):
    mask: Tensor

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.heads, self.hidden, self.flash = shape.heads, shape.hidden, shape.attention == "sdpa"
        self.c_attn = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.c_proj = nn.Linear(shape.hidden, shape.hidden)
        if not self.flash:
            causal = torch.tril(torch.ones(shape.seq, shape.seq, dtype=torch.bool))
            self.register_buffer("mask", causal.view(1, 1, shape.seq, shape.seq), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.size()
        d = self.hidden // self.heads
        # Megatron-LM's fused projection: each head's q, k and v side by side (``view(s, b, np, 3 hn)`` in its
        # ParallelAttention), so a column split over heads keeps every head whole on one rank.
        qkv = self.c_attn(x).view(b, t, self.heads, 3 * d)  # (B, T, H, 3 D)
        q, k, v = qkv.split(d, dim=3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D) each
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (B, H, T, T), kept for backward
            mask = self.mask.narrow(2, 0, t).narrow(3, 0, t)
            y = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.hidden)
        self.attn = _Attention(shape)
        self.ln_2 = nn.LayerNorm(shape.hidden)
        self.c_fc = nn.Linear(shape.hidden, shape.ffn_width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(shape.ffn_width, shape.hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """Megatron's GPT at ``shape`` (see the module docstring)."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab, shape.hidden)
        self.wpe = nn.Embedding(shape.seq, shape.hidden) if shape.positions else None
        self.blocks = nn.ModuleList([_Block(shape) for _ in range(shape.layers)])
        self.ln_f = nn.LayerNorm(shape.hidden)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), dtype=torch.long, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


_built: list[GPTShape] = [SHAPES["megatron_1_7b"]]


def build(shape: GPTShape) -> GPT:
    """:class:`GPT` at ``shape`` on the meta device (``example_inputs`` then use its sequence length)."""
    with torch.device("meta"):
        model = GPT(shape)
    _built[0] = shape
    return model


def __getattr__(name: str) -> Callable[[], nn.Module]:
    """``published_models.NAME``: the factory of the shape ``NAME`` names (:func:`shape_named`)."""
    if name.startswith("__"):
        raise AttributeError(name)
    shape = shape_named(name)
    return lambda: build(shape)


def example_inputs(batch_size: int = 2) -> tuple[Tensor]:
    """``(idx,)``: (B, T) zeros, T the sequence length of the model built last."""
    return (torch.zeros(batch_size, _built[0].seq, dtype=torch.long),)


def example_target(batch_size: int = 2) -> Tensor:
    return torch.zeros(batch_size, _built[0].seq, dtype=torch.long)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), target.reshape(-1))
