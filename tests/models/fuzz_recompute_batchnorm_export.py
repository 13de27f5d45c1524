"""Fuzzer find: a recomputed stage of an exported graph updates BatchNorm's running statistics twice.

Found by ``tools/fuzz_models.py`` (seeds 4, 36, 43, 54, 96, once models with a running mean
written by ``self.ema.mul_(0.9)`` were captured by ``torch.export``, as symbolic tracing cannot
record an op that reads a buffer alone).  An exported graph calls ``aten.batch_norm``, whose
schema does not mark the running statistics written; ``partitioner.graph.meetings.written_state`` read
only schemas and module calls, so a recomputing stage (``--recompute full``) did not restore
the statistics around the recomputation, and the backward updated them a second time
(verify: "loss and gradients match but buffer bn.running_var differs").  Fixed there: the
running-statistics ops are found by name and training flag, as the capture finds them
(``partitioner.graph.capture.buffers_written``).

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_recompute_batchnorm_export.py --gpus 2 --pp 2 --schedule gpipe --microbatches 2 --recompute full --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_recompute_batchnorm_export.py
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "RecomputeBatchNormNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 2, "dp": 1, "tp": 1, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "full"}
C = 4
SIZE = 6
CLASSES = 4


class RecomputeBatchNormNet(nn.Module):
    ema: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(C)
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(C)
        self.head = nn.Linear(C, CLASSES)
        self.register_buffer("ema", torch.zeros(C))

    def forward(self, image: Tensor) -> Tensor:
        h = F.relu(self.stem_bn(self.stem(image)))  # (B, C, H, W)
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(dim=(0, 2, 3)))  # only torch.export records mul_
        h = h - self.ema.view(1, -1, 1, 1)
        h = h + F.relu(self.bn(self.conv(h)))
        return self.head(h.mean(dim=(2, 3)))  # (B, CLASSES)


def build_model() -> RecomputeBatchNormNet:
    torch.manual_seed(4)
    return RecomputeBatchNormNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(4)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
