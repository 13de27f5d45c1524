"""Fuzzer find: with tensor parallelism, a buffer updated in place from an activation crashes the forward.

Found by ``tools/fuzz_models.py`` (seed 124: ``buffer_update`` with ``--tp 2``).  A
running mean kept as a buffer, ``self.ema.add_(0.1 * h.detach().mean(dim=(0, 1)))``,
in a model whose MLP is a column/row pair.  Planned with ``--tp 2`` the plan is
accepted; the first forward fails on every tensor-parallel rank with a bare
``AssertionError`` from DTensor's dispatch (``_dispatch_fast_path_python_tail``): the
buffer is a plain tensor written in place with a DTensor activation (``implicit_replication``
makes plain tensors meet DTensors as replicated, but not as the target of an in-place op).

Layout: one stage, tensor-parallel 2 (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_tp_buffer_update.py --gpus 2 --pp 1 --tp 2 --microbatches 2 --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_tp_buffer_update.py

Where: ``runtime/parallel/tensorparallel.py`` (buffers a stage writes: keep them as replicated
DTensors, or write them from the local tensor; else refuse ``--tp`` for the model when
planning, naming the buffer).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "TPBufferNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 1, "dp": 1, "tp": 2, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "none"}
WIDTH = 8
SEQ = 4


class TPBufferNet(nn.Module):
    ema: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # (B, T, W)
        self.ema.add_(0.1 * h.detach().mean(dim=(0, 1)))  # a buffer written from an activation
        h = h - self.ema
        h = h + self.down(F.gelu(self.up(self.ln(h))))  # a column/row pair
        return self.head(h)  # (B, T, 3)


def build_model() -> TPBufferNet:
    torch.manual_seed(124)
    return TPBufferNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(124)
    return (torch.randn(batch_size, SEQ, 5, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(125)
    return torch.randn(batch_size, SEQ, 3, generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(outputs, target)
