"""An MLP with random ops: dropout modules, functional dropout and injected noise.

``verify`` must find them in the captured graph, list them and neutralise them in
both runs (dropout at p=0, the noise drawn from one fixed seed).
"""

import torch
import torch.nn.functional as F
from mlp import NUM_CLASSES, WIDTH, example_inputs, example_target, loss_fn  # noqa: F401 - the model file's API
from torch import Tensor, nn


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
