"""Cross-layer parameter sharing (ALBERT, looped transformers): one layer module applied at every depth.

The planner splits the layer's calls across stages, so every stage holding a call
holds ``layer.*`` under the same names (tied by use, issue 29): their gradients
are the sum over all the calls. The shared layer is an MLP pair (a column/row
pair for ``--tp``) with a norm and a read-only buffer (``gain``) each call reads.
``build_batchnorm`` puts a BatchNorm in the shared layer: its running statistics
are written by every call, which the planner refuses to split across stages.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IN, WIDTH, OUT = 8, 32, 4
DEPTH = 8


class SharedLayer(nn.Module):
    gain: Tensor

    def __init__(self, *, batchnorm: bool = False) -> None:
        super().__init__()
        self.norm: nn.Module = nn.BatchNorm1d(WIDTH) if batchnorm else nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.register_buffer("gain", torch.linspace(0.5, 1.0, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x)))) * self.gain  # (B, W)


class SharedDepth(nn.Module):
    def __init__(self, *, batchnorm: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.layer = SharedLayer(batchnorm=batchnorm)
        self.out = nn.Linear(WIDTH, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, W)
        for _ in range(DEPTH):
            h = self.layer(h)  # the same parameters at every depth
        return self.out(h)  # (B, OUT)


def build_model() -> SharedDepth:
    torch.manual_seed(0)
    return SharedDepth()


def build_batchnorm() -> SharedDepth:
    torch.manual_seed(0)
    return SharedDepth(batchnorm=True)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, IN, generator=g),)  # (B, IN)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(batch_size, OUT, generator=g)  # (B, OUT)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(outputs, target)
