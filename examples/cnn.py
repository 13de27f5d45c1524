"""A small ResNet-like CNN for 32x32 images and 10 classes, as an autopartition model file.

Plan it and check the plan on CPU ranks::

    autopartition examples/cnn.py --gpus 4 --batch-size 32 --microbatches 4 --out plan/
    autopartition verify plan/ --model examples/cnn.py

The network: a stem convolution, six residual blocks (``block1`` .. ``block6``; two of
them halve the resolution), a global average pool and a linear classifier.  A long
skip connection carries ``block1``'s output, through a strided 1x1 convolution
(``long_skip``), to the sum after ``block6``: that (B, 32, 32, 32) tensor is produced
early and consumed late, so in a pipeline plan it crosses several stage boundaries.

Normalisation is GroupNorm, not BatchNorm: BatchNorm's batch statistics depend on how
the mini-batch is split into micro-batches, so a pipelined run would not match the
unpartitioned model; GroupNorm normalises each sample on its own.  No dropout; weights
and example data are seeded.  Captures with both ``torch.export.export(..., strict=False)``
and ``torch.fx.symbolic_trace``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "NUM_CLASSES",
    "ResidualBlock",
    "SkipCNN",
    "build_model",
    "example_inputs",
    "example_target",
    "loss_fn",
]

NUM_CLASSES = 10
_GROUPS = 8  # GroupNorm groups; every channel count below is a multiple of 8


class ResidualBlock(nn.Module):
    """conv3x3 -> GN -> ReLU -> conv3x3 -> GN, plus a (projected) shortcut, then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(_GROUPS, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(_GROUPS, out_channels)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.GroupNorm(_GROUPS, out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.norm1(self.conv1(x)))  # (B, C_out, H/s, W/s)
        h = self.norm2(self.conv2(h))  # (B, C_out, H/s, W/s)
        return F.relu(h + self.shortcut(x))  # (B, C_out, H/s, W/s)


class SkipCNN(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False),
            nn.GroupNorm(_GROUPS, 32),
            nn.ReLU(),
        )
        self.block1 = ResidualBlock(32, 32)
        self.block2 = ResidualBlock(32, 64, stride=2)
        self.block3 = ResidualBlock(64, 64)
        self.block4 = ResidualBlock(64, 128, stride=2)
        self.block5 = ResidualBlock(128, 128)
        self.block6 = ResidualBlock(128, 128)
        # Long skip: block1's (B, 32, 32, 32) output -> (B, 128, 8, 8), added after block6.
        self.long_skip = nn.Conv2d(32, 128, 1, stride=4, bias=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)  # (B, 32, 32, 32)
        early = self.block1(x)  # (B, 32, 32, 32)
        x = self.block2(early)  # (B, 64, 16, 16)
        x = self.block3(x)  # (B, 64, 16, 16)
        x = self.block4(x)  # (B, 128, 8, 8)
        x = self.block5(x)  # (B, 128, 8, 8)
        x = self.block6(x)  # (B, 128, 8, 8)
        # Computed here, late, so the early activation itself travels down the pipeline.
        x = F.relu(x + self.long_skip(early))  # (B, 128, 8, 8)
        x = torch.flatten(self.pool(x), 1)  # (B, 128)
        return self.fc(x)  # (B, num_classes)


def build_model() -> SkipCNN:
    """The CNN with seeded initialisation (same weights in every process)."""
    torch.manual_seed(0)
    return SkipCNN()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    """``(images,)``: (B, 3, 32, 32) float32."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, 32, 32, generator=g),)  # (B, 3, 32, 32)


def example_target(batch_size: int = 8) -> Tensor:
    """Class labels (B,), int64 in [0, NUM_CLASSES)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)  # (B,)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy over the batch (a scalar)."""
    return F.cross_entropy(outputs, target)  # logits (B, num_classes), target (B,)
