"""Fuzzer find: a fully sharded stage (FSDP2) whose first op writes its received input in place crashes.

Found by ``tools/fuzz_models.py`` (seeds 81, 183: ``--shard full`` with ``nn.ReLU(inplace=True)``).
A small CNN of conv-BatchNorm-ReLU blocks, the ReLUs in place.  Planned on 2 stages x 2
replicas with ``--shard full``, the split falls between ``b2_bn`` and the in-place ``b2_act``,
so stage 1 opens by writing the activation it received.  The first forward of stage 1
fails: ``RuntimeError: Output 0 of RegisterPostBackwardFunction is a view and is being
modified inplace``: FSDP2's pre-forward hook passes the stage's inputs through a custom
autograd Function (to run its post-backward), and the in-place ReLU then writes that
Function's output.  The same plan with ``--shard none`` (DDP) verifies: there the runtime
clones a received tensor that the stage writes in place (``execute.py``,
``meetings.inputs_written_in_place``); under FSDP2 the clone is taken before the hook
(or not at all), so the hook's view is what the ReLU writes.

Layout (``FUZZ_LAYOUT``)::

    .venv/bin/autopartition tests/models/fuzz_fsdp_inplace_input.py --gpus 4 --pp 2 --dp 2 --shard full --schedule gpipe --microbatches 2 --recompute none --device h100 --batch-size 8 --out plan
    .venv/bin/autopartition verify plan --model tests/models/fuzz_fsdp_inplace_input.py

Where: ``runtime/parallel/shard.py`` (FSDP2 stages) with ``runtime/execute/runner.py``: clone a received
tensor the stage writes in place after FSDP2's pre-forward hook, i.e. inside the wrapped
module (or clone it whenever the stage is fully sharded).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUZZ_LAYOUT", "FsdpInplaceNet", "build_model", "example_inputs", "example_target", "loss_fn"]

FUZZ_LAYOUT: dict[str, Any] = {"pp": 2, "dp": 2, "tp": 1, "schedule": "gpipe", "microbatches": 2, "shard": "full",
                               "recompute": "none"}
C = 4
SIZE = 6
CLASSES = 4


def _conv() -> nn.Conv2d:
    return nn.Conv2d(C, C, 3, padding=1, bias=False)


class FsdpInplaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(C)
        self.b1_conv, self.b1_bn, self.b1_act = _conv(), nn.BatchNorm2d(C), nn.ReLU(inplace=True)
        self.b2_conv, self.b2_bn, self.b2_act = _conv(), nn.BatchNorm2d(C), nn.ReLU(inplace=True)
        self.b3 = _conv()
        self.b4_conv, self.b4_bn, self.b4_act = _conv(), nn.BatchNorm2d(C), nn.ReLU(inplace=True)
        self.head = nn.Linear(C, CLASSES)

    def forward(self, image: Tensor) -> Tensor:
        h = F.relu(self.stem_bn(self.stem(image)))  # (B, C, H, W)
        h = self.b1_act(self.b1_bn(self.b1_conv(h)))
        h = self.b2_act(self.b2_bn(self.b2_conv(h)))  # the split falls before b2_act
        h = h + torch.tanh(self.b3(h))
        h = self.b4_act(self.b4_bn(self.b4_conv(h)))
        return self.head(h.mean(dim=(2, 3)))  # (B, CLASSES)


def build_model() -> FsdpInplaceNet:
    torch.manual_seed(183)
    return FsdpInplaceNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(183)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(184)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
