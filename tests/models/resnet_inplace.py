"""A torchvision-style ResNet written as a user would: BatchNorm, ``out += identity``, ``nn.ReLU(inplace=True)``.

Basic blocks as in torchvision (conv-BN-ReLU-conv-BN, then ``out += identity``
and an in-place ReLU; a strided 1x1 projection where the shape changes).  A
stage cut right before a block's in-place add or ReLU receives the tensor that
op writes into: the runtime must let it write there as the whole model does,
and send back the gradient of what it received.  BatchNorm in training mode:
statistics per micro-batch (the references micro-batch alike).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BasicBlock", "TinyResNet", "build_model", "example_inputs", "example_target", "loss_fn"]

NUM_CLASSES = 5
SIZE = 8


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.layer3 = BasicBlock(16, 16)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))  # (B, 8, S, S)
        x = self.layer1(x)  # (B, 8, S, S)
        x = self.layer2(x)  # (B, 16, S/2, S/2)
        x = self.layer3(x)  # (B, 16, S/2, S/2)
        return self.fc(torch.flatten(self.avgpool(x), 1))  # (B, NUM_CLASSES)


def build_model() -> TinyResNet:
    torch.manual_seed(0)
    return TinyResNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
