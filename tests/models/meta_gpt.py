"""examples/gpt.py's GPT built on the meta device, with the init_weights a meta model file needs.

No memory is allocated by ``build_model()``; every rank materialises its stage's
tensors (``runtime.state.materialise``), each module under a generator seeded by its name.
``init_weights(module, name)`` gives linear layers and embeddings GPT-2's N(0, 0.02)
(biases zero) and recomputes the causal mask buffer; LayerNorms fall through to
their ``reset_parameters()``.  The LM head is tied to the token embedding.
"""

import importlib.util
import sys
from pathlib import Path

import torch
from torch import Tensor, nn


def _gpt():  # examples/gpt.py by path, under the key tests/_examples.py uses: one module per process
    key = "_autopartition_example_gpt"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
        spec = importlib.util.spec_from_file_location(key, path)
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


gpt = _gpt()
CONFIG = gpt.GPTConfig(vocab_size=96, block_size=16, n_layer=4, n_head=2, n_embd=32)
SEQ_LEN = 8


def build_model() -> nn.Module:
    with torch.device("meta"):
        return gpt.GPT(CONFIG)


def init_weights(module: nn.Module, name: str) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, gpt.CausalSelfAttention):
        n = module.mask.shape[-1]
        module.mask = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)


def _tokens(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN + 1), generator=g)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    return (_tokens(batch_size)[:, :-1].contiguous(),)


def example_target(batch_size: int = 8) -> Tensor:
    return _tokens(batch_size)[:, 1:].contiguous()


loss_fn = gpt.loss_fn
