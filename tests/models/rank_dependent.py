"""A deliberately wrong model file: a negative control for the equivalence tests.

Its ``loss_fn`` scales the loss by 1.01 when it runs inside a launched rank (``RANK``
set), so a pipelined run's loss and gradients differ by 1% from the unpartitioned
run in the verifying process, and ``verify`` must report a mismatch.
"""

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 16
NUM_CLASSES = 4


class RankDependentMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))  # (B, W)
        return self.head(x)  # (B, C)


def build_model() -> RankDependentMLP:
    torch.manual_seed(0)
    return RankDependentMLP()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, WIDTH, generator=g),)  # (B, W)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)  # (B,)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    scale = 1.01 if "RANK" in os.environ else 1.0
    return scale * F.cross_entropy(outputs, target)
