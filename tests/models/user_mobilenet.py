"""A MobileNetV3-like CNN, written as a user would: nobody tuned for it.

Inverted residual blocks: a 1x1 expansion, a depthwise 3x3 convolution, a
squeeze-and-excitation gate (adaptive average pool, two 1x1 convolutions,
``Hardsigmoid``) and a 1x1 projection, each convolution followed by BatchNorm and an
in-place ``Hardswish``; the residual is added in place (``out += x``), as torchvision's
blocks do.  BatchNorm keeps running statistics; ``verify`` models them per micro-batch.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SIZE, CLASSES = 16, 6


def _conv_bn(c_in: int, c_out: int, kernel: int = 1, stride: int = 1, groups: int = 1,
             act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
    ]
    if act:
        layers.append(nn.Hardswish(inplace=True))
    return nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // 4, 1)
        self.expand = nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        s = F.adaptive_avg_pool2d(x, 1)  # (B, C, 1, 1)
        s = self.expand(F.relu(self.reduce(s), inplace=True))
        return x * F.hardsigmoid(s, inplace=True)  # (B, C, H, W)


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        hidden = 3 * c_in
        self.expand = _conv_bn(c_in, hidden)
        self.depthwise = _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        self.se = SqueezeExcite(hidden)
        self.project = _conv_bn(hidden, c_out, act=False)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: Tensor) -> Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))  # (B, C_out, H/s, W/s)
        if self.residual:
            out += x
        return out


class MobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = _conv_bn(3, 8, 3, 2)
        self.blocks = nn.Sequential(
            InvertedResidual(8, 8, 1), InvertedResidual(8, 16, 2),
            InvertedResidual(16, 16, 1), InvertedResidual(16, 16, 1),
        )
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.stem(x))  # (B, 16, S/4, S/4)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))  # (B, CLASSES)


def build_model() -> MobileNet:
    torch.manual_seed(0)
    return MobileNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
