"""A model file in Hugging Face style: keyword inputs, an optional mask, a baked scale, its own loss.

``forward(x, mask=None, *, scale=1.0, labels=None)`` returns ``{"logits": ...}``, and
``"loss"`` (mean cross-entropy over every token) when ``labels`` are given.  The model
file passes the inputs as a dict of keywords and the target as ``labels``
(``target_keyword``), so there is no ``loss_fn``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CLASSES", "KwNet", "build_model", "example_inputs", "example_target", "target_keyword"]

CLASSES = 8
_WIDTH = 16
_SEQ = 6

target_keyword = "labels"


class KwNet(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(_WIDTH, _WIDTH) for _ in range(layers))
        self.head = nn.Linear(_WIDTH, CLASSES)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, *, scale: float = 1.0, labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        h = x * scale  # (B, T, W)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if mask is not None:
            h = h * mask.unsqueeze(-1)  # (B, T, W): masked positions contribute zeros
        logits = self.head(h)  # (B, T, C)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, CLASSES), labels.reshape(-1))
        return out


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return KwNet()


def example_inputs(batch_size: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, _SEQ, _WIDTH, generator=g)  # (B, T, W)
    mask = (torch.rand(batch_size, _SEQ, generator=g) > 0.3).float()  # (B, T)
    return {"x": x, "mask": mask, "scale": 0.5}


def example_target(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, CLASSES, (batch_size, _SEQ), generator=g)  # (B, T)
