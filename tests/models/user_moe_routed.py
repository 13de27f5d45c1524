"""A user's own mixture of experts, written to the experts contract autopartition recognises.

Each layer: RMS-style norm, a router (linear, softmax, top-2, weights renormalised), a
``RoutedExperts`` module called as ``experts(tokens, top_k_index, top_k_weights)`` that
holds its four SwiGLU experts in a ``ModuleList``, and a residual.  The experts run
densely on every token and the chosen ones are gathered (no data-dependent shapes, so it
exports); under expert parallelism each rank runs only its experts on the tokens sent to it.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEATURES, WIDTH, EXPERTS, TOP_K, LAYERS, CLASSES = 12, 16, 4, 2, 3, 3


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class RoutedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(SwiGLU() for _ in range(EXPERTS))

    def forward(self, tokens: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        every = torch.stack([expert(tokens) for expert in self.experts], dim=1)  # (N, E, C)
        picked = torch.gather(every, 1, top_k_index.unsqueeze(-1).expand(-1, -1, WIDTH))  # (N, k, C)
        return (top_k_weights.unsqueeze(-1) * picked).sum(dim=1)  # (N, C)


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.moe = RoutedExperts()

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)  # (N, C)
        weights, chosen = torch.topk(torch.softmax(self.router(h), dim=-1), TOP_K, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.moe(h, chosen, weights)


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.layers = nn.Sequential(*(MoELayer() for _ in range(LAYERS)))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.layers(self.inp(x)))  # (N, CLASSES)


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
