"""An LSTM language model, written as a user would: nobody tuned for it.

Embedding, a two-layer ``nn.LSTM`` (parameters the split backward cannot take apart
op by op), dropout and a linear decoder; next-token cross-entropy.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, SEQ, WIDTH = 40, 8, 24


class LSTMLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.decoder = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        h, _ = self.lstm(self.embed(ids))  # (B, T, C)
        return self.decoder(self.drop(h))  # (B, T, VOCAB)


def build_model() -> LSTMLanguageModel:
    torch.manual_seed(0)
    return LSTMLanguageModel()


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), target.flatten())
