"""Fuzzer find: under a split backward (zb-h1, zbv) a linear whose output is then written in place gets no gradient.

Found by ``tools/fuzz_models.py`` (seeds 20, 56, 143, 285 and 17 of seeds 300-599; the
patterns ``inplace_op`` and ``inplace_view`` under zb-h1 and zbv; with a tied alias of that
linear's weight the tied gradient misses its share instead, seed 491).  ``h = h + torch.relu_(self.fc(h))``: the
linear's output is written in place right away (the same with ``y.mul_(0.5)`` or
``y[:, 0].mul_(2.0)``).  The stage's backward is split into B (input gradients) and W
(weight gradients, ``partitioner/graph/meetings.py`` marks where weights meet activations and
``partitioner/graph/splitbackward.py`` computes ``dW`` from the output's gradient); the in-place
write replaces the output tensor's autograd history after the meeting was logged, and W
finds no gradient for ``fc.weight`` and ``fc.bias``: they stay ``None`` on the ranks and
the optimizer skips them.  gpipe and 1f1b train it exactly.

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_split_backward_inplace.py --gpus 3 --pp 3 --schedule zb-h1 --microbatches 1 --recompute none --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_split_backward_inplace.py

verify: MISMATCH, "gradients match but parameter fc.weight differs after the optimizer
step": verify compares only the gradients a rank has, so a gradient missing on the ranks
reads as a match (``runtime/verify.py``: a parameter with a reference gradient and none
on its rank should count as a gradient difference).  Where: ``partitioner/graph/meetings.py`` /
``partitioner/graph/splitbackward.py`` (an op whose output is written in place afterwards is not a
safe meeting point: take the gradient at the in-place op's output, or run that stage's
backward whole).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "SplitInplaceNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 3, "dp": 1, "tp": 1, "schedule": "zb-h1", "microbatches": 1, "shard": "none",
                               "recompute": "none"}
WIDTH = 8
SEQ = 4


class SplitInplaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # (B, T, W)
        h = h + torch.relu_(self.fc(h))  # the linear's output written in place
        return self.head(h)  # (B, T, 3)


def build_model() -> SplitInplaceNet:
    torch.manual_seed(1)
    return SplitInplaceNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, SEQ, 5, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(batch_size, SEQ, 3, generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(outputs, target)
