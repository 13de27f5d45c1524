"""Residual MLP blocks (layer norm, 4x wider hidden layer, GELU, dropout): a model worth recomputing.

Each block keeps a hidden activation four times wider than its input, so running
it under checkpoint saves memory; ``DROPOUT`` (0 by default, so that pipelined runs
can be compared with one process) makes the recomputation tests check that
dropout masks are drawn again identically.
"""

import torch
import torch.nn.functional as F
from mlp import example_inputs, example_target, loss_fn  # noqa: F401 - the model file's API
from torch import Tensor, nn

WIDTH = 16
HIDDEN = 4 * WIDTH
DEPTH = 4
NUM_CLASSES = 4


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))  # (B, W)


class BlockMLP(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block(dropout) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)  # (B, W)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, C)


def build_model(dropout: float = 0.0) -> BlockMLP:
    torch.manual_seed(0)
    return BlockMLP(dropout)
