"""The tiny MLP, with measured costs that depend on the rank: a stand-in for noisy timings.

On the rank named by ``AUTOPARTITION_TEST_SLOW_RANK`` the first half of the layers
sleeps a little in every forward (a leaf function in the traced graph, so costing
times it), so a plan that rank measures for itself puts the stage boundary
elsewhere.  The values are the MLP's on every rank, and in a process without
``RANK`` nothing sleeps.
"""

import os
import time

import torch
import torch.fx
from mlp import NUM_CLASSES, WIDTH, example_inputs, example_target, loss_fn  # noqa: F401 - the model file's API
from torch import Tensor, nn

DEPTH = 8
SLOW_LAYERS = 4
DELAY_S = 2e-3


def delay(x: Tensor) -> Tensor:
    """``x``, after a pause on the slow rank (opaque to tracing, so it is a node of its own)."""
    if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("AUTOPARTITION_TEST_SLOW_RANK"):
        time.sleep(DELAY_S)
    return x * 1.0


torch.fx.wrap("delay")


class SkewedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))  # (B, W)
            if i < SLOW_LAYERS:
                x = delay(x)
        return self.head(x)  # (B, C)


def build_model() -> SkewedMLP:
    torch.manual_seed(0)
    return SkewedMLP()
