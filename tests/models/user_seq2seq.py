"""A translation model on ``nn.Transformer``, written as a user would: nobody tuned for it.

Two inputs (source and target token ids), shared embeddings, an encoder-decoder
``nn.Transformer`` with a causal target mask, said to be causal (``tgt_is_causal=True``: otherwise
``nn.Transformer`` inspects the mask's values, which no capture can follow; cross-attention reads the encoder's
memory in every decoder layer, so the memory crosses stage boundaries) and an output
head.  The loss is next-token cross-entropy over the target.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, SRC, TGT, WIDTH, HEADS = 48, 8, 6, 32, 4


class Translator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(WIDTH, HEADS, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True)
        self.out = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(TGT), persistent=False)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=self.causal,
                             tgt_is_causal=True)  # (B, T, C)
        return self.out(h)  # (B, T, VOCAB)


def build_model() -> Translator:
    torch.manual_seed(0)
    return Translator()


def example_inputs(batch_size: int = 8) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SRC), generator=g),
            torch.randint(0, VOCAB, (batch_size, TGT), generator=g))


def example_target(batch_size: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, TGT), generator=g)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), target.flatten())
