"""Models whose column/row pairs run an op DTensor has no sharding rule for (issue 43), as a model file.

``build_model``: a residual MLP block whose up-projection is under ``torch.nn.utils.weight_norm``
(its backward, ``_weight_norm_interface_backward``, has no rule: the pair runs whole), then a
DiT-like block, ``nn.MultiheadAttention`` (CPU's flash attention backward has no rule: it runs on
whole values) and a plain MLP (it splits).  At ``--tp 2`` the planner names both ops and the plan
verifies.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

__all__ = ["build_model", "example_inputs", "example_target", "loss_fn"]

_WIDTH = 32


class _Block(nn.Module):
    def __init__(self, *, weight_norm: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(_WIDTH, 4 * _WIDTH), nn.Linear(4 * _WIDTH, _WIDTH)
        if weight_norm:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the hook-based API people still use
                self.up = torch.nn.utils.weight_norm(self.up)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(x)))  # (B, T, C)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(_WIDTH, 4, batch_first=True)
        self.mlp = _Block(weight_norm=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]  # (B, T, C)
        return self.mlp(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(weight_norm=True), _Attention(), nn.Linear(_WIDTH, 8))


def example_inputs(batch_size: int = 4) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, 6, _WIDTH, generator=g),)  # (B, T, C)


def example_target(batch_size: int = 4) -> Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(batch_size, 6, 8, generator=g)  # (B, T, 8)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)
