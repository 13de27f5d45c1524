"""A tiny U-Net with BatchNorm: batch statistics per micro-batch (``verify`` must model them).

Two resolutions joined by a skip connection (max-pool down, nearest up-sampling,
concatenation); every convolution is followed by BatchNorm with running
statistics.  Per-pixel regression against a fixed target.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHANNELS = 4
SIZE = 8


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class BNUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = _block(1, CHANNELS)
        self.bottom = _block(CHANNELS, 2 * CHANNELS)
        self.up = _block(3 * CHANNELS, CHANNELS)
        self.head = nn.Conv2d(CHANNELS, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        skip = self.down(x)  # (B, C, S, S)
        low = self.bottom(F.max_pool2d(skip, 2))  # (B, 2C, S/2, S/2)
        up = F.interpolate(low, scale_factor=2.0, mode="nearest")  # (B, 2C, S, S)
        return self.head(self.up(torch.cat([up, skip], dim=1)))  # (B, 1, S, S)


def build_model() -> BNUNet:
    torch.manual_seed(0)
    return BNUNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 1, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 1, SIZE, SIZE, generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(outputs, target)
