"""examples/llama.py's tiny Llama (Hugging Face LlamaForCausalLM) built on the meta device.

No ``init_weights``: the model's own ``_init_weights(module)`` initialises every
module, the rotary embedding's ``inv_freq`` included (recomputed from the config).
"""

import importlib.util
import sys
from pathlib import Path

from torch import nn


def _llama():  # examples/llama.py by path, under the key tests/_examples.py uses
    key = "_autopartition_example_llama"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "examples" / "llama.py"
        spec = importlib.util.spec_from_file_location(key, path)
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


llama = _llama()


def build_model() -> nn.Module:
    return llama._build(llama.TINY, meta=True)


example_inputs = llama.example_inputs
example_target = llama.example_target
loss_fn = llama.loss_fn
