"""Fuzzer find: with tensor parallelism, a model output that reduces the hidden dimension crashes the backward.

Found by ``tools/fuzz_models.py`` (seeds 33, 50, 87, 186, 319, 513: ``dict_output`` with ``--tp 2``).
The model returns ``{"logits": ..., "early": h.mean(dim=-1)}``, the second output a
``(B, T)`` reduction of a hidden state, and the loss reads both.  Planned with ``--tp 2``
(the MLP a column/row pair), the plan is accepted, and the first backward of the stage
computing ``early`` fails on every tensor-parallel rank: ``RuntimeError: the local_tensor
argument only accepts torch.Tensor but got DTensor`` (inside DTensor's ``to_local``
backward).  The same model returning ``h`` itself (3-D) verifies.

Layout: one stage, tensor-parallel 2 (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_tp_reduced_output.py --gpus 2 --pp 1 --tp 2 --microbatches 2 --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_tp_reduced_output.py

Where: ``runtime/parallel/tensorparallel.py`` (``TensorParallelStage``: model outputs "leave
whole"; an output that is no longer ``(B, T, ...)`` sequence-sharded, here the mean over
the hidden dimension, gets a DTensor gradient handed to a plain-tensor ``to_local``).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "TPReducedOutputNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 1, "dp": 1, "tp": 2, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "none"}
WIDTH = 8
SEQ = 4


class TPReducedOutputNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = self.proj(x)  # (B, T, W)
        h = h + self.down(F.silu(self.up(self.ln(h))))  # a column/row pair
        return {"logits": self.head(h), "early": h.mean(dim=-1)}  # (B, T, 3), (B, T)


def build_model() -> TPReducedOutputNet:
    torch.manual_seed(33)
    return TPReducedOutputNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(33)
    return (torch.randn(batch_size, SEQ, 5, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(34)
    return torch.randn(batch_size, SEQ, 3, generator=g)


def loss_fn(outputs: dict[str, Tensor], target: Tensor) -> Tensor:
    return F.mse_loss(outputs["logits"], target) + 0.01 * outputs["early"].pow(2).mean()
