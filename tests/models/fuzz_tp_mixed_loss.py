"""Fuzzer find: with tensor parallelism, a loss adding vocabulary-parallel logits' cross-entropy to another output crashes.

Found by ``tools/fuzz_models.py`` (seed 112, reduced; with seed 97's running mean written
by two chained in-place ops).  The model returns ``{"logits": ..., "early": h.mean(-1)}``
and its loss is ``cross_entropy(logits) + 0.01 * early.pow(2).mean()``.  Planned on 2
stages x ``--tp 2`` the LM head is split by vocabulary: its logits leave the last stage as
a DTensor and the cross-entropy runs under ``loss_parallel``, while ``early`` leaves whole
(a plain tensor, ``full_tensor``).  Their sum is a DTensor op on a plain tensor
(``implicit_replication``), so ``early``'s gradient comes back as a DTensor, which
``full_tensor``'s own backward refuses: ``RuntimeError: the local_tensor argument only
accepts torch.Tensor but got DTensor`` in the last stage's backward.  Fixed in
``runtime/parallel/tensorparallel.py`` (``gathered``: a gather whose backward takes either).

The running mean ``self.ema.mul_(0.9).add_(...)`` is captured by ``torch.export`` (its
first op reads the buffer alone, which symbolic tracing cannot record): the second op
writes what the first returned, and under ``--tp 2`` both must run on plain values
(``plain_write``), the first rewrite must not hide the second (seed 97).

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_tp_mixed_loss.py --gpus 4 --pp 2 --tp 2 --schedule gpipe --microbatches 1 --recompute none --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_tp_mixed_loss.py
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "TPMixedLossNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 2, "dp": 1, "tp": 2, "schedule": "gpipe", "microbatches": 1, "shard": "none",
                               "recompute": "none"}
VOCAB = 16
WIDTH = 8
SEQ = 4


class TPMixedLossNet(nn.Module):
    ema: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, tokens: Tensor) -> dict[str, Tensor]:
        h = self.emb(tokens)  # (B, T, W)
        early = h
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(dim=(0, 1)))  # a running mean, two chained writes
        h = h - self.ema
        h = h + self.down(F.gelu(self.up(self.ln(h))))  # a column/row pair
        return {"logits": self.head(h), "early": early.mean(dim=-1)}  # (B, T, V), (B, T)


def build_model() -> TPMixedLossNet:
    torch.manual_seed(112)
    return TPMixedLossNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(112)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(113)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(outputs: dict[str, Tensor], target: Tensor) -> Tensor:
    logits = outputs["logits"]
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)) + 0.01 * outputs["early"].pow(2).mean()
