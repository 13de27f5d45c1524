"""A tiny MLP whose ``loss_fn`` kills its own process mid-step, for the rank-failure test.

When the environment variable ``AUTOPARTITION_TEST_DIE_RANK`` equals this process's
``RANK``, ``loss_fn`` calls ``os._exit(17)`` on micro-batch ``DIE_AT_MICROBATCH`` of
step ``DIE_AT_STEP`` (both counted from 0: the second micro-batch of the second
step), so the first step completes and the process then vanishes in the middle of a
step, with its peers blocked on it, as a crashed GPU process would.  With
``AUTOPARTITION_TEST_HANG=1`` it sleeps there instead (a hung rank: its connections
stay open, so only the peers' timeouts can stop them).
"""

import os
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 16
DEPTH = 6
NUM_CLASSES = 4
MICROBATCHES = 4  # the test plans with this many micro-batches
DIE_AT_STEP = 1
DIE_AT_MICROBATCH = 1
EXIT_CODE = 17

_calls = 0  # loss_fn calls in this process: one per micro-batch on the last stage


class DyingMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))  # (B, W)
        return self.head(x)  # (B, C)


def build_model() -> DyingMLP:
    torch.manual_seed(0)
    return DyingMLP()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, WIDTH, generator=g),)  # (B, W)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)  # (B,)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    global _calls
    step, microbatch = divmod(_calls, MICROBATCHES)
    _calls += 1
    die_rank = os.environ.get("AUTOPARTITION_TEST_DIE_RANK")
    mine = die_rank is not None and os.environ.get("RANK") == die_rank
    if mine and (step, microbatch) == (DIE_AT_STEP, DIE_AT_MICROBATCH):
        if os.environ.get("AUTOPARTITION_TEST_HANG") == "1":
            time.sleep(3600)  # the test kills this process
        os._exit(EXIT_CODE)  # no cleanup, no exception: the process just disappears
    return F.cross_entropy(outputs, target)
