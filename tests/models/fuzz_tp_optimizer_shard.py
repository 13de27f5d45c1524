"""Fuzzer find: the planner accepts ``--tp 2 --shard optimizer`` with replicas, a plan the runtime refuses.

Found by ``tools/fuzz_models.py`` (seeds 271, 508, 592).  ``compile(..., tp=2, dp=2, shard="optimizer")``
returns a plan (tp 2, both replicas' stage groups sharded as ZeRO-1); ``verify`` and
``run`` then refuse it before starting ranks: "this plan has tp=2 with optimizer-sharded
replicas (ZeRO-1); the runtime runs tensor parallelism with replicated or fully sharded
(FSDP2) stage groups" (``runtime/parallel/tensorparallel.py``, ``tensor_parallel_refusal``).  The
reason is clear, but it comes after planning: ``--shard auto`` already leaves
``optimizer`` out with tp > 1 (``PlanOptions.shard_modes``), a fixed ``--shard optimizer``
does not.

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_tp_optimizer_shard.py --gpus 4 --pp 1 --dp 2 --tp 2 --shard optimizer --microbatches 2 --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_tp_optimizer_shard.py

Where: ``partitioner/search/options.py`` / ``planner.py`` (``check_tp`` or ``check_options``:
refuse a fixed ``--shard optimizer`` with ``--tp`` > 1 and replicas before solving, with
the runtime's reason).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "TPShardNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 1, "dp": 2, "tp": 2, "schedule": "gpipe", "microbatches": 2,
                               "shard": "optimizer", "recompute": "none"}
WIDTH = 8
SEQ = 4


class TPShardNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # (B, T, W)
        h = h + self.down(F.gelu(self.up(h)))  # a column/row pair
        return self.head(h)  # (B, T, 3)


def build_model() -> TPShardNet:
    torch.manual_seed(271)
    return TPShardNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(271)
    return (torch.randn(batch_size, SEQ, 5, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(272)
    return torch.randn(batch_size, SEQ, 3, generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(outputs, target)
