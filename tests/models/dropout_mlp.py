"""An MLP with random ops: dropout modules, functional dropout and injected noise.

``verify`` must find them in the captured graph, list them and neutralise them in
both runs (dropout at p=0, the noise drawn from one fixed seed).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 16
NUM_CLASSES = 4


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.drop1 = nn.Dropout(0.1)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.fc3 = nn.Linear(WIDTH, WIDTH)
        self.drop3 = nn.Dropout(0.3)
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.drop1(torch.tanh(self.fc1(x)))  # (B, W)
        x = F.dropout(torch.tanh(self.fc2(x)), p=0.2, training=self.training)
        x = x + 0.01 * torch.randn_like(x)  # noise injection: a random op that is not dropout
        x = self.drop3(torch.tanh(self.fc3(x)))
        return self.head(x)  # (B, C)


def build_model() -> DropoutMLP:
    torch.manual_seed(0)
    return DropoutMLP()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, WIDTH, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
