"""Fuzzer find: a parameter the forward never reads makes verify report MISMATCH (held by no rank).

Found by ``tools/fuzz_models.py`` (an early grammar read ``F.linear(h, self.fc.weight)``
and left ``fc.bias`` unused).  The unpartitioned model never reads ``fc.bias`` either: it
gets no gradient and never changes.  No stage holds it (the capture sees only parameters
the graph reads), and ``runtime/verify.py`` reports any parameter no rank holds as
"differs after the optimizer step by inf ... held by no rank": a MISMATCH for a model that
trains the same.  A checkpoint of the pipeline also lacks ``fc.bias`` (``load_state_dict``
into the original model needs ``strict=False``).

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_unused_parameter.py --gpus 2 --pp 2 --schedule gpipe --microbatches 2 --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_unused_parameter.py

Where: ``runtime/verify.py`` (an orphan that the reference leaves without a gradient is
not a training difference: say so instead of MISMATCH), and the planner could warn about
(or list in plan.json) parameters the forward never reads.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "UnusedParameterNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 2, "dp": 1, "tp": 1, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "none"}
WIDTH = 8
SEQ = 4
CLASSES = 4


class UnusedParameterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)  # fc.bias is never read
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # (B, T, W)
        h = h + torch.tanh(F.linear(h, self.fc.weight))
        return self.head(h.mean(dim=1))  # (B, C)


def build_model() -> UnusedParameterNet:
    torch.manual_seed(18)
    return UnusedParameterNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(18)
    return (torch.randn(batch_size, SEQ, 5, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(19)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
