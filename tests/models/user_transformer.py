"""A text classifier on ``nn.TransformerEncoder``, written as a user would: nobody tuned for it.

Token and learned position embeddings, four pre-norm ``nn.TransformerEncoderLayer``s
(``nn.MultiheadAttention`` inside, a parameter-holding module that is not a Linear),
mean pooling and a linear head.  ``forward`` branches on the layer's fast path, so
``torch.fx.symbolic_trace`` cannot capture it; ``torch.export`` can.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, SEQ, WIDTH, HEADS, LAYERS, CLASSES = 64, 8, 32, 4, 4, 5


class TextClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.zeros(1, SEQ, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=2 * WIDTH, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tokens(ids) + self.positions  # (B, T, C)
        h = self.encoder(h)  # (B, T, C)
        return self.head(h.mean(dim=1))  # (B, CLASSES)


def build_model() -> TextClassifier:
    torch.manual_seed(0)
    model = TextClassifier()
    nn.init.normal_(model.positions, std=0.02)
    return model


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs, target)
