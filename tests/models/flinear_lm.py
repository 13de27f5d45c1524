"""A language model whose LM head reads the embedding's weight through a functional (tied by use, issue 29).

``F.linear(h, self.emb.weight)``: one parameter under one name, read by the first
stage (the lookup) and the last (the head). No second attribute aliases it, so only
the stages that read it show the tie. Each layer is an MLP pair (up, GELU, down:
a column/row pair for ``--tp``); ``scale`` is a read-only buffer the first and the
last layer both read. ``build_matmul_head`` writes the head as ``h @ emb.weight.T``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 32
WIDTH = 16
DEPTH = 4
SEQ_LEN = 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))  # (B, T, W)


class FunctionalHeadLM(nn.Module):
    scale: Tensor

    def __init__(self, *, matmul: bool = False) -> None:
        super().__init__()
        self.matmul = matmul
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        nn.init.normal_(self.emb.weight, std=0.2)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx) * self.scale  # (B, T, W)
        for layer in self.layers:
            x = layer(x)
        h = self.ln_f(x) * self.scale  # (B, T, W)
        if self.matmul:
            return h @ self.emb.weight.T  # (B, T, V)
        return F.linear(h, self.emb.weight)  # (B, T, V)


def build_model() -> FunctionalHeadLM:
    torch.manual_seed(0)
    return FunctionalHeadLM()


def build_matmul_head() -> FunctionalHeadLM:
    torch.manual_seed(0)
    return FunctionalHeadLM(matmul=True)


def _tokens(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)  # (B, T + 1)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    return (_tokens(batch_size)[:, :-1].contiguous(),)  # (B, T)


def example_target(batch_size: int = 8) -> Tensor:
    return _tokens(batch_size)[:, 1:].contiguous()  # (B, T)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), target.reshape(-1))
