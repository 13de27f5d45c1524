"""Fuzzer find: with tensor parallelism, an in-place write through a view of an activation is lost.

Found by ``tools/fuzz_models.py`` (seeds 98, 118, 122, 343, 348, 542, 573: ``inplace_view``
with ``--tp 2``; on some layouts the loss matches and only gradients differ).
``y = self.fc(h); y[:, 0].mul_(2.0)`` doubles the first position of ``y`` through a view.
Planned with ``--tp 2`` (the MLP a column/row pair; ``fc`` replicated) the plan runs but
trains differently from step 1; ``y.mul_(2.0)`` on the whole tensor verifies.  Under
tensor parallelism the stage's activations are DTensors (sequence-sharded between pairs,
``implicit_replication``); indexing a DTensor makes a new DTensor, not a view of the same
storage, so the write never reaches ``y``.

Layout: one stage, tensor-parallel 2 (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_tp_inplace_view.py --gpus 2 --pp 1 --tp 2 --microbatches 2 --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_tp_inplace_view.py

verify: MISMATCH, the loss differs from step 1.  Where: ``runtime/parallel/tensorparallel.py``
(in-place writes through views of DTensor activations: run them on the local tensor, or
refuse ``--tp`` for such a graph when planning).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "TPInplaceViewNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 1, "dp": 1, "tp": 2, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "none"}
VOCAB = 16
WIDTH = 8
SEQ = 4


class TPInplaceViewNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)  # (B, T, W)
        y = self.fc(h)
        y[:, 0].mul_(2.0)  # in place through a view
        h = h + torch.tanh(y)
        h = h + self.down(F.relu(self.up(self.ln(h))))  # a column/row pair
        return self.head(h)  # (B, T, V)


def build_model() -> TPInplaceViewNet:
    torch.manual_seed(98)
    return TPInplaceViewNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(98)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs.reshape(-1, VOCAB), target.reshape(-1))
