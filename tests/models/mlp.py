"""A tiny MLP model file for the multi-process equivalence tests (fast to capture and run)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 16
DEPTH = 8
NUM_CLASSES = 4


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))  # (B, W)
        return self.head(x)  # (B, C)


def build_model() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, WIDTH, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
