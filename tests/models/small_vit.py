"""A small ViT built from ``nn.MultiheadAttention``: patch convolution, class token, pre-norm encoder blocks.

``nn.MultiheadAttention`` is a leaf of symbolic tracing holding parameters
(and a tuple output): a split backward's marking runs it through
``functional_call``, as it does convolutions and norms.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Block", "SmallViT", "build_model", "example_inputs", "example_target", "loss_fn"]

DIM = 16
HEADS = 2
PATCH = 4
SIZE = 8
LAYERS = 2
NUM_CLASSES = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]  # (B, T, D)
        return x + self.mlp(self.norm2(x))  # (B, T, D)


class SmallViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tokens = (SIZE // PATCH) ** 2 + 1
        self.patch = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens, DIM) * 0.02)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, T-1, D)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (B, T, D)
        x = self.blocks(x)  # (B, T, D)
        return self.head(self.norm(x[:, 0]))  # (B, NUM_CLASSES)


def build_model() -> SmallViT:
    torch.manual_seed(0)
    return SmallViT()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
