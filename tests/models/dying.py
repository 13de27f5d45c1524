"""A tiny MLP whose ``loss_fn`` kills its own process mid-step, for the rank-failure test.

When the environment variable ``AUTOPARTITION_TEST_DIE_RANK`` equals this process's
``RANK``, ``loss_fn`` calls ``os._exit(17)`` on micro-batch ``DIE_AT_MICROBATCH`` of
step ``DIE_AT_STEP`` (both counted from 0: the second micro-batch of the second
step), so the first step completes and the process then vanishes in the middle of a
step, with its peers blocked on it, as a crashed GPU process would.  With
``AUTOPARTITION_TEST_HANG=1`` it sleeps there instead (a hung rank: its connections
stay open, so only the peers' timeouts can stop them).
"""

import os
import time

import torch.nn.functional as F
from mlp import build_model, example_inputs, example_target  # noqa: F401 - the model file's API
from torch import Tensor

MICROBATCHES = 4  # the test plans with this many micro-batches
DIE_AT_STEP = 1
DIE_AT_MICROBATCH = 1
EXIT_CODE = 17

_calls = 0  # loss_fn calls in this process: one per micro-batch on the last stage


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    global _calls
    step, microbatch = divmod(_calls, MICROBATCHES)
    _calls += 1
    die_rank = os.environ.get("AUTOPARTITION_TEST_DIE_RANK")
    mine = die_rank is not None and os.environ.get("RANK") == die_rank
    if mine and (step, microbatch) == (DIE_AT_STEP, DIE_AT_MICROBATCH):
        if os.environ.get("AUTOPARTITION_TEST_HANG") == "1":
            time.sleep(3600)  # the test kills this process
        os._exit(EXIT_CODE)  # no cleanup, no exception: the process just disappears
    return F.cross_entropy(outputs, target)
