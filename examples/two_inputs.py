"""A model with two inputs and a dict output, as an autopartition model file.

Plan it and check the plan on CPU ranks::

    autopartition examples/two_inputs.py --gpus 2 --batch-size 16 --microbatches 4 --out plan/
    autopartition verify plan/ --model examples/two_inputs.py

Inputs: ``features`` (B, 16) float32 and ``tokens`` (B, 8) int64 ids.  A dense branch
encodes the features, an embedding branch mean-pools the tokens, a trunk mixes both,
and two heads return ``{"logits": (B, 10), "aux": (B, 1)}``.  ``loss_fn`` adds a
classification loss on ``logits`` and a small regression loss on ``aux``, both computed
from a single (B,) label tensor.  No dropout; weights and example data are seeded.
Captures with both ``torch.export.export(..., strict=False)`` and ``torch.fx.symbolic_trace``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "AUX_WEIGHT",
    "NUM_CLASSES",
    "NUM_FEATURES",
    "NUM_TOKENS",
    "VOCAB_SIZE",
    "TwoInputNet",
    "build_model",
    "example_inputs",
    "example_target",
    "loss_fn",
]

NUM_FEATURES = 16
NUM_TOKENS = 8
VOCAB_SIZE = 100
NUM_CLASSES = 10
AUX_WEIGHT = 0.1  # weight of the auxiliary regression loss
_HIDDEN = 64


class TwoInputNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(NUM_FEATURES, _HIDDEN), nn.GELU())
        self.embed = nn.Embedding(VOCAB_SIZE, _HIDDEN)
        self.trunk = nn.Sequential(
            nn.Linear(2 * _HIDDEN, _HIDDEN),
            nn.GELU(),
            nn.Linear(_HIDDEN, _HIDDEN),
            nn.GELU(),
        )
        self.head = nn.Linear(_HIDDEN, NUM_CLASSES)
        self.aux_head = nn.Linear(_HIDDEN, 1)

    def forward(self, features: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        f = self.dense(features)  # (B, H)
        t = self.embed(tokens).mean(dim=1)  # (B, N, H) -> (B, H)
        h = self.trunk(torch.cat([f, t], dim=1))  # (B, 2H) -> (B, H)
        return {"logits": self.head(h), "aux": self.aux_head(h)}  # (B, C), (B, 1)


def build_model() -> TwoInputNet:
    """The two-input model with seeded initialisation (same weights in every process)."""
    torch.manual_seed(0)
    return TwoInputNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor, Tensor]:
    """``(features, tokens)``: (B, 16) float32 and (B, 8) int64 in [0, VOCAB_SIZE)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(batch_size, NUM_FEATURES, generator=g)  # (B, 16)
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, NUM_TOKENS), generator=g)  # (B, 8)
    return features, tokens


def example_target(batch_size: int = 8) -> Tensor:
    """Class labels (B,), int64 in [0, NUM_CLASSES)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)  # (B,)


def loss_fn(outputs: dict[str, Tensor], target: Tensor) -> Tensor:
    """Mean cross-entropy on ``logits`` + AUX_WEIGHT * mean squared error of ``aux``
    against the label scaled to [0, 1] (a scalar)."""
    ce = F.cross_entropy(outputs["logits"], target)  # (B, C), (B,) -> ()
    aux_target = (target.to(outputs["aux"].dtype) / (NUM_CLASSES - 1)).unsqueeze(1)  # (B, 1)
    mse = F.mse_loss(outputs["aux"], aux_target)  # (B, 1), (B, 1) -> ()
    return ce + AUX_WEIGHT * mse
