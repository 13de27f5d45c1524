"""A GroupNorm CNN with max-pooling and ReLU: discontinuities that rounding can flip.

Comparing runs whose parameters drift apart over steps lets a 1e-7 difference flip
a max-pool or ReLU tie and grow; ``verify`` compares every step from the same
parameters instead.  No batch statistics, no random ops.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHANNELS = 8
SIZE = 16
NUM_CLASSES = 4


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(2, c_out), nn.ReLU(), nn.MaxPool2d(2))


class MaxPoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_block(1, CHANNELS), _block(CHANNELS, CHANNELS), _block(CHANNELS, CHANNELS))
        self.head = nn.Linear(CHANNELS * (SIZE // 8) ** 2, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x).flatten(1))  # (B, C)


def build_model() -> MaxPoolNet:
    torch.manual_seed(0)
    return MaxPoolNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 1, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
