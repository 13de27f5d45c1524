"""A tiny MLP whose ``loss_fn`` fails on one rank mid-step, for the rank-failure and launcher tests.

When the environment variable ``AUTOPARTITION_TEST_DIE_RANK`` equals this process's
``RANK``, ``loss_fn`` fails on micro-batch ``DIE_AT_MICROBATCH`` of step
``DIE_AT_STEP`` (both counted from 0: the second micro-batch of the second step), so
the first step completes and the failure comes in the middle of a step, with the
rank's peers blocked on it.  ``AUTOPARTITION_TEST_FAULT`` says how:

* ``exit`` (default): ``os._exit(17)``, no cleanup, no exception: the process just
  disappears, as a crashed GPU process would;
* ``hang`` (or ``AUTOPARTITION_TEST_HANG=1``): sleeps (a hung rank: its connections stay
  open, so only the peers' timeouts can stop them);
* ``stop``: stops itself with SIGSTOP (a rank that no signal but SIGKILL/SIGCONT moves);
* ``raise``: a TypeError from this file (an error in the user's code);
* ``bad_input``: an AutopartitionError (bad input: the launcher exits 2).
"""

import os
import signal
import time

import torch.nn.functional as F
from mlp import build_model, example_inputs, example_target  # noqa: F401 - the model file's API
from torch import Tensor

from partitioner.errors import AutopartitionError

MICROBATCHES = 4  # the test plans with this many micro-batches
DIE_AT_STEP = 1
DIE_AT_MICROBATCH = 1
EXIT_CODE = 17
TYPE_ERROR = "the loss got a str where a tensor belongs"
BAD_INPUT = "The target has 5 classes but the model predicts 4: give targets in 0..3."

_calls = 0  # loss_fn calls in this process: one per micro-batch on the last stage


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    global _calls
    step, microbatch = divmod(_calls, MICROBATCHES)
    _calls += 1
    die_rank = os.environ.get("AUTOPARTITION_TEST_DIE_RANK")
    mine = die_rank is not None and os.environ.get("RANK") == die_rank
    if mine and (step, microbatch) == (DIE_AT_STEP, DIE_AT_MICROBATCH):
        fault = "hang" if os.environ.get("AUTOPARTITION_TEST_HANG") == "1" else \
            os.environ.get("AUTOPARTITION_TEST_FAULT", "exit")
        if fault == "hang":
            time.sleep(3600)  # the test kills this process
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "raise":
            raise TypeError(TYPE_ERROR)
        elif fault == "bad_input":
            raise AutopartitionError(BAD_INPUT)
        elif fault == "exit":
            os._exit(EXIT_CODE)  # no cleanup, no exception: the process just disappears
    return F.cross_entropy(outputs, target)
