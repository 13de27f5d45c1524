"""A tiny MLP with long skip connections, for the multi-process equivalence tests.

``early`` (the first layer's output) is read by the last layer, so in a pipeline of
three or more stages it crosses at least two stage boundaries; ``mid`` (after
``layers.1``) is added after ``layers.3``, ``layers.5`` and ``layers.7``, so it is
read by several later stages (its gradient is the sum of theirs).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 16
DEPTH = 8
NUM_CLASSES = 4


class SkipMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        early = torch.tanh(self.inp(x))  # (B, W)
        h = early
        mid = h
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))  # (B, W)
            if i == 1:
                mid = h
            if i in (3, 5, 7):
                h = h + mid  # (B, W)
        return self.head(h + early)  # (B, C)


def build_model() -> SkipMLP:
    torch.manual_seed(0)
    return SkipMLP()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, WIDTH, generator=g),)  # (B, W)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)  # (B,)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
