"""A mixture-of-experts MLP stack with top-2 routing, written as a user would: nobody tuned for it.

Each layer: LayerNorm, a router (linear, softmax, top-2), every expert run densely and
the outputs gathered by the chosen indices (no data-dependent shapes, so it exports),
and a residual.  GELU experts; the router's probabilities weight the two chosen experts.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEATURES, WIDTH, EXPERTS, LAYERS, CLASSES = 12, 24, 4, 3, 3


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(EXPERTS)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)  # (B, C)
        weights, chosen = torch.topk(torch.softmax(self.router(h), dim=-1), 2, dim=-1)  # (B, 2)
        every = torch.stack([expert(h) for expert in self.experts], dim=1)  # (B, E, C)
        picked = torch.gather(every, 1, chosen.unsqueeze(-1).expand(-1, -1, WIDTH))  # (B, 2, C)
        return x + (weights.unsqueeze(-1) * picked).sum(dim=1)  # (B, C)


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.layers = nn.Sequential(*(MoELayer() for _ in range(LAYERS)))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.layers(self.inp(x)))  # (B, CLASSES)


def build_model() -> MoENet:
    torch.manual_seed(0)
    return MoENet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, FEATURES, generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
