"""A tiny U-Net with GroupNorm: three resolutions, max-pool down, nearest up-sampling, skip connections.

Every convolution is followed by GroupNorm (per sample, so micro-batching does
not change the result) and ReLU; each decoder level concatenates the encoder's
output of the same resolution.  Per-pixel regression against a fixed target.
Parameter-holding modules other than Linear / LayerNorm (Conv2d, GroupNorm) are
what a split backward's marking rewrites through ``functional_call``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GNUNet", "build_model", "example_inputs", "example_target", "loss_fn"]

CHANNELS = 4
SIZE = 8


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(2, c_out), nn.ReLU())


class GNUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc1 = _block(1, CHANNELS)
        self.enc2 = _block(CHANNELS, 2 * CHANNELS)
        self.bottom = _block(2 * CHANNELS, 2 * CHANNELS)
        self.dec2 = _block(4 * CHANNELS, CHANNELS)
        self.dec1 = _block(2 * CHANNELS, CHANNELS)
        self.head = nn.Conv2d(CHANNELS, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        s1 = self.enc1(x)  # (B, C, S, S)
        s2 = self.enc2(F.max_pool2d(s1, 2))  # (B, 2C, S/2, S/2)
        low = self.bottom(F.max_pool2d(s2, 2))  # (B, 2C, S/4, S/4)
        up2 = F.interpolate(low, scale_factor=2.0, mode="nearest")  # (B, 2C, S/2, S/2)
        d2 = self.dec2(torch.cat([up2, s2], dim=1))  # (B, C, S/2, S/2)
        up1 = F.interpolate(d2, scale_factor=2.0, mode="nearest")  # (B, C, S, S)
        return self.head(self.dec1(torch.cat([up1, s1], dim=1)))  # (B, 1, S, S)


def build_model() -> GNUNet:
    torch.manual_seed(0)
    return GNUNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 1, SIZE, SIZE, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 1, SIZE, SIZE, generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(outputs, target)
