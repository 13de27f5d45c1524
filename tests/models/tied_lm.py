"""A tiny language model with a tied embedding / LM head and a persistent buffer.

For the Pipeline API tests: ``wte.weight`` is also ``lm_head.weight`` (one Parameter,
two names in the state dict), and ``scale`` is a persistent buffer, so a full state
dict has entries of every kind a stage can hold.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 32
WIDTH = 16
DEPTH = 4
SEQ_LEN = 6


class TiedLM(nn.Module):
    scale: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        nn.init.normal_(self.wte.weight, std=0.2)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)  # (B, T, W)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))  # (B, T, W)
        x = self.ln_f(x) * self.scale  # (B, T, W)
        return self.lm_head(x)  # (B, T, V)


def build_model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def _tokens(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)  # (B, T + 1)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    return (_tokens(batch_size)[:, :-1].contiguous(),)  # (B, T)


def example_target(batch_size: int = 8) -> Tensor:
    return _tokens(batch_size)[:, 1:].contiguous()  # (B, T)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), target.reshape(-1))
