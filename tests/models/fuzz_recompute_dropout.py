"""Fuzzer find: verify crashes on a recomputed stage with dropout (CheckpointError on the ranks).

Found by ``tools/fuzz_models.py`` (seeds 43, 78, 116, 132, 176, 247, 286, 295, 350, 399:
``dropout`` with ``--recompute full``).
Planned with ``--recompute full`` the plan is accepted; ``autopartition verify`` then
fails on the rank of the stage holding the dropout: ``CheckpointError: Recomputed values
for the following tensors have different metadata than during the forward pass`` (one
more tensor saved by the recomputation).  verify neutralises dropout with a torch
function mode (``runtime/verify.py``, ``Derandomised``: p=0 in both runs); the mode is
not in effect when ``torch.utils.checkpoint`` recomputes the layer during the backward,
so the recomputation runs the real dropout and saves its mask.  Training itself is not
affected (checkpoint replays the generator state); verifying is: it crashes instead of
comparing.  Reproduced in one process: a checkpointed ``F.dropout`` + conv under
``Derandomised()`` raises the same error.

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_recompute_dropout.py --gpus 3 --pp 3 --schedule gpipe --microbatches 2 --recompute full --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_recompute_dropout.py

Where: ``runtime/verify.py`` (``Derandomised`` must also cover recomputation, e.g. enter
the mode in checkpoint's recompute context, or swap dropout's p for 0 on the modules and
functionals themselves) with ``runtime/execute/recompute.py``.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "RecomputeDropoutNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 3, "dp": 1, "tp": 1, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "full"}
CHANNELS = 4
SIZE = 6
CLASSES = 4


class RecomputeDropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(CHANNELS)
        self.conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.head = nn.Linear(CHANNELS, CLASSES)

    def forward(self, image: Tensor) -> Tensor:
        h = F.relu(self.stem_bn(self.stem(image)))  # (B, C, H, W)
        h = F.dropout(h, p=0.2, training=self.training)
        h = h + torch.tanh(self.conv(h))
        return self.head(h.mean(dim=(2, 3)))  # (B, CLASSES)


def build_model() -> RecomputeDropoutNet:
    torch.manual_seed(43)
    return RecomputeDropoutNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(43)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(44)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
