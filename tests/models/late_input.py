"""Two inputs, one of them read only at the end, and a dict output with an early entry.

``features`` (B, 16) float feeds a chain of layers; ``tokens`` (B, 4) int64 ids are
embedded and added just before the head, so in a pipeline the last stage reads a
model input directly.  The output dict holds ``logits`` (B, 4), computed last, and
``early`` (B, 1), computed from the first layer, so it travels to the last stage.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 16
DEPTH = 6
VOCAB = 20
NUM_TOKENS = 4
NUM_CLASSES = 4


class LateInputNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.early_head = nn.Linear(WIDTH, 1)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, NUM_CLASSES)

    def forward(self, features: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        h = torch.tanh(self.inp(features))  # (B, W)
        early = self.early_head(h)  # (B, 1)
        for layer in self.layers:
            h = torch.tanh(layer(h))  # (B, W)
        h = h + self.embed(tokens).mean(dim=1)  # (B, W)
        return {"logits": self.head(h), "early": early}  # (B, C), (B, 1)


def build_model() -> LateInputNet:
    torch.manual_seed(0)
    return LateInputNet()


def example_inputs(batch_size: int = 8) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    features = torch.randn(batch_size, WIDTH, generator=g)  # (B, W)
    tokens = torch.randint(0, VOCAB, (batch_size, NUM_TOKENS), generator=g)  # (B, N)
    return features, tokens


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)  # (B,)


def loss_fn(outputs: dict[str, Tensor], target: Tensor) -> Tensor:
    assert isinstance(outputs, dict), f"expected a dict output, got {type(outputs).__name__}"
    ce = F.cross_entropy(outputs["logits"], target)
    aux = F.mse_loss(outputs["early"].squeeze(1), target.to(outputs["early"].dtype) / NUM_CLASSES)
    return ce + 0.1 * aux
