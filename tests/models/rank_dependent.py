"""A deliberately wrong model file: a negative control for the equivalence tests.

Its ``loss_fn`` scales the loss by 1.01 when it runs inside a launched rank (``RANK``
set), so a pipelined run's loss and gradients differ by 1% from the unpartitioned
run in the verifying process, and ``verify`` must report a mismatch.
"""

import os

import torch.nn.functional as F
from mlp import build_model, example_inputs, example_target  # noqa: F401 - the model file's API
from torch import Tensor


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    scale = 1.01 if "RANK" in os.environ else 1.0
    return scale * F.cross_entropy(outputs, target)
