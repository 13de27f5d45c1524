"""Fuzzer find: a model that writes one of its inputs in place trains differently under verify.

Found by ``tools/fuzz_models.py`` (every case with the pattern ``inplace_input``, e.g.
seeds 9, 11, 14).  ``aux.mul_(0.5)`` scales the second input in place, as a user
normalising a batch in place would.  The runtime gives a stage that writes a model input
in place a copy (``meetings.inputs_written_in_place``), so the ranks' batch stays as
given; the reference in ``runtime/verify.py`` slices its micro-batches as views of one
batch built once (``_compare_steps``, ``reference_microbatches``), so each step writes
into the next step's inputs: step 1 agrees, step 2 sees ``aux`` scaled twice.

Layout: any; one rank is enough (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_inplace_input.py --gpus 1 --pp 1 --microbatches 2 --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_inplace_input.py

verify: MISMATCH first at step 2 (the loss).  Where: ``runtime/verify.py``: the
reference should run every step on a fresh copy of the batch (as the ranks in effect do),
or the report should say that the model writes its inputs.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "InplaceInputNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 1, "dp": 1, "tp": 1, "schedule": "gpipe", "microbatches": 2, "shard": "none",
                               "recompute": "none"}
WIDTH = 8
SEQ = 4
CLASSES = 4


class InplaceInputNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.aux_proj = nn.Linear(6, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor, aux: Tensor) -> Tensor:
        aux.mul_(0.5)  # an input written in place
        h = torch.tanh(self.proj(x)) + self.aux_proj(aux)  # (B, T, W)
        return self.head(h.mean(dim=1))  # (B, C)


def build_model() -> InplaceInputNet:
    torch.manual_seed(0)
    return InplaceInputNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, SEQ, 5, generator=g), torch.randn(batch_size, SEQ, 6, generator=g)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
