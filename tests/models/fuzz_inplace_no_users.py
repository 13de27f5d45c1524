"""Fuzzer find: an in-place op whose result nobody reads is cut away from the readers of what it wrote.

Found by ``tools/fuzz_models.py`` (the pattern ``inplace_op``, variant ``mul_``).
``y = self.fc(h); y.mul_(0.5); h = h + torch.tanh(y)``: in the captured graph the node
``mul_`` has no users, and ``tanh`` reads ``fc``'s node, so no edge orders ``mul_``
before ``tanh``.  The solver puts ``proj, fc, tanh, add`` in stage 0 and ``mul_`` alone in
stage 1, which scales a received copy of ``fc``'s output that nobody reads: the scaling
is lost (forward and backward).  The same happens to a model input written in place
(seed 11: ``aux.mul_(0.5)`` first in forward, ``aux`` read near the end; planned 4 x zbv,
stage 0 holds ``mul_`` alone and the stage reading ``aux`` gets the unscaled input).

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_inplace_no_users.py --gpus 3 --pp 3 --schedule 1f1b --microbatches 1 --recompute none --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_inplace_no_users.py

verify: MISMATCH, the loss differs from step 1.  Where: capture (``partitioner/graph``)
or the split (``partitioner/solve``): a node that writes a value in place must come
before, and stay in the stage of, every later reader of that value (an edge from the
write to each later reader, or the write made functional: ``y = y * 0.5``).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "InplaceNoUsersNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 3, "dp": 1, "tp": 1, "schedule": "1f1b", "microbatches": 1, "shard": "none",
                               "recompute": "none"}
WIDTH = 8
SEQ = 4


class InplaceNoUsersNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # (B, T, W)
        y = self.fc(h)
        y.mul_(0.5)  # its result unused: only the write matters
        h = h + torch.tanh(y)
        return self.head(h)  # (B, T, 3)


def build_model() -> InplaceNoUsersNet:
    torch.manual_seed(1)
    return InplaceNoUsersNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, SEQ, 5, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(batch_size, SEQ, 3, generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(outputs, target)
