"""``tied_lm.py`` with a larger vocabulary and one more layer: another model under mostly the same names.

For the checkpoint tests: its checkpoint must not load into ``tied_lm`` (the error names
the extra layer and the embedding's other shape).
"""

from tied_lm import DEPTH, WIDTH, TiedLM, example_inputs, example_target, loss_fn
from torch import nn

VOCAB = 40

__all__ = ["WideTiedLM", "build_model", "example_inputs", "example_target", "loss_fn"]


class WideTiedLM(TiedLM):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.layers.extend(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH, DEPTH + 1))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied


def build_model() -> WideTiedLM:
    return WideTiedLM()
