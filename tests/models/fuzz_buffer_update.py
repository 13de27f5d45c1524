"""Fuzzer find: a buffer updated in forward by ops that read only the buffer is lost at capture.

Found by ``tools/fuzz_models.py`` (seeds 12, 15, 23, ...; the pattern ``buffer_update``).
``self.ema.mul_(0.9).add_(0.1 * h.detach().mean(...))`` is an exponential moving average
kept as a buffer, and ``self.calls.add_(1)`` counts forwards.  ``fx.symbolic_trace`` (the
capture's first route) records an op only when a traced value flows into it:
``self.ema.mul_(0.9)`` and ``self.calls.add_(1)`` touch the real buffers alone, so they
run once, eagerly, on the user's model while tracing (after ``compile()`` the model's
``calls`` is 1; the decay ran once on the real buffer) and are missing from the graph
every stage is cut from (only ``add_``, which reads a traced value, is recorded).

Layout: any; one rank is enough (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_buffer_update.py --gpus 1 --pp 1 --microbatches 2 --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_buffer_update.py

verify: MISMATCH, the loss differs from step 1 (the pipeline's EMA never decays).  The
counter's loss is silent: no stage holds ``calls``, and verify compares only the buffers
some rank holds.  Where: ``partitioner/graph/capture.py`` (symbolic_trace route: a
model whose buffers change while tracing must fall back to export, or be refused) and
``runtime/verify.py`` (a buffer of the model that no rank holds is not compared).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "EmaNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 1, "dp": 1, "tp": 1, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "none"}
WIDTH = 8
SEQ = 4
CLASSES = 4


class EmaNet(nn.Module):
    ema: Tensor
    calls: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.register_buffer("ema", torch.zeros(WIDTH))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(self.proj(x)))  # (B, T, W)
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(dim=(0, 1)))  # mul_ reads the buffer alone
        h = h - self.ema
        self.calls.add_(1)  # reads the buffer alone
        return self.head(h.mean(dim=1))  # (B, C)


def build_model() -> EmaNet:
    torch.manual_seed(0)
    return EmaNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, SEQ, 5, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
