"""A small nanoGPT-style GPT language model, as an autopartition model file.

Plan it for 4 GPUs and check the plan against the unpartitioned model on CPU ranks::

    autopartition examples/gpt.py --gpus 4 --batch-size 16 --microbatches 4 --out plan/
    autopartition verify plan/ --model examples/gpt.py

``examples/gpt.py:gpt_medium`` picks the deeper, wider factory instead of ``build_model``.

The model: token + position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
self-attention written with explicit matmuls and a registered ``torch.tril`` mask
buffer; an MLP with GELU), a final LayerNorm and an LM head whose weight is tied to
the token embedding.  Module names: ``wte``, ``wpe``, ``blocks.{i}.ln_1``,
``blocks.{i}.attn``, ``blocks.{i}.ln_2``, ``blocks.{i}.mlp``, ``ln_f``, ``lm_head``.

There is no dropout, and construction and example data are seeded, so two processes
that call ``build_model()`` get identical weights and training is deterministic.
Captures with both ``torch.export.export(..., strict=False)`` and
``torch.fx.symbolic_trace``.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "GPT",
    "MLP",
    "SEQ_LEN",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "build_model",
    "example_inputs",
    "example_target",
    "gpt_medium",
    "gpt_small",
    "loss_fn",
]

# Sequence length of the example mini-batch (must be <= GPTConfig.block_size).
SEQ_LEN = 32


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64  # longest sequence the position embedding and mask cover
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    mask: Tensor  # registered buffer, declared for type checkers

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        # (1, 1, block_size, block_size): True where query position i may attend to key j <= i.
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer(
            "mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False
        )

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()  # (B, T, C)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, H, T, T)
        # narrow() rather than self.mask[:, :, :T, :T]: symbolic_trace cannot slice a real
        # tensor with a traced size, but can record a narrow() call.
        mask = self.mask.narrow(2, 0, T).narrow(3, 0, T)  # (1, 1, T, T) bool
        att = att.masked_fill(~mask, float("-inf"))  # (B, H, T, T)
        att = F.softmax(att, dim=-1)  # (B, H, T, T)
        y = att @ v  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        h = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.c_proj(h)  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.lm_head.weight = self.wte.weight  # weight tying: one Parameter, two users

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)  # idx: (B, T) int64 token ids
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)


def build_model(config: GPTConfig | None = None) -> GPT:
    """The default GPT (4 layers, 4 heads, 64 wide, vocabulary 512), seeded for reproducibility."""
    torch.manual_seed(0)
    return GPT(config if config is not None else GPTConfig())


def gpt_small() -> GPT:
    """Same as ``build_model()``: 4 layers."""
    return build_model(GPTConfig(n_layer=4))


def gpt_medium() -> GPT:
    """A deeper, wider variant (12 layers, 128 wide) for more interesting plans."""
    return build_model(GPTConfig(n_layer=12, n_embd=128))


def _tokens(batch_size: int) -> Tensor:
    """(B, SEQ_LEN + 1) token ids; inputs and targets are two views of the same draw."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, GPTConfig().vocab_size, (batch_size, SEQ_LEN + 1), generator=g)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    """``(idx,)`` with idx of shape (B, SEQ_LEN), int64."""
    return (_tokens(batch_size)[:, :-1].contiguous(),)  # (B, T)


def example_target(batch_size: int = 8) -> Tensor:
    """Next-token targets (B, SEQ_LEN), int64: ``example_inputs`` shifted left by one."""
    return _tokens(batch_size)[:, 1:].contiguous()  # (B, T)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy over all B * T positions (a scalar)."""
    logits = outputs  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
