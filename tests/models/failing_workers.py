"""A training script for the launcher tests (``autopartition run plan/ -- failing_workers.py``).

Each rank writes its pid to ``$AUTOPARTITION_TEST_OUT/pid{RANK}`` and, after every
step, the number of steps done to ``step{RANK}``; it trains ``$AUTOPARTITION_TEST_STEPS``
steps (0: until stopped).  Faults come from ``tests/models/dying.py``'s loss_fn
(``AUTOPARTITION_TEST_DIE_RANK``, ``AUTOPARTITION_TEST_FAULT``); with
``AUTOPARTITION_TEST_FAULT=script`` that rank raises a NameError in this script
itself, after its first step, outside any autopartition call.
"""

import os
import time
from pathlib import Path

import dying
import torch

from runtime.launch.torchrun import plan_from_env
from runtime.pipeline import Pipeline

out = Path(os.environ["AUTOPARTITION_TEST_OUT"])
rank = int(os.environ["RANK"])
(out / f"pid{rank}.tmp").write_text(str(os.getpid()))
(out / f"pid{rank}.tmp").replace(out / f"pid{rank}")  # whole, never read half-written
torch.set_num_threads(1)
plan = plan_from_env()
pipe = Pipeline(plan, dying.build_model(), dying.loss_fn, device=torch.device("cpu"))
opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
inputs, target = dying.example_inputs(plan.batch_size), dying.example_target(plan.batch_size)
steps = int(os.environ.get("AUTOPARTITION_TEST_STEPS", "0"))
script_fault = os.environ.get("AUTOPARTITION_TEST_FAULT") == "script" and \
    os.environ.get("AUTOPARTITION_TEST_DIE_RANK") == str(rank)
done = 0
while steps == 0 or done < steps:
    opt.zero_grad()
    loss = pipe.step(inputs, target)
    opt.step()
    done += 1
    (out / f"step{rank}").write_text(str(done))
    if loss is not None and done == 1:
        print(f"step {done}: loss {loss.item():.4f}", flush=True)  # the script's own output stays visible
    if script_fault:
        undefined_name_in_the_script  # type: ignore[name-defined]  # noqa: B018, F821 - the user's bug
    if steps == 0:
        time.sleep(0.05)  # a long run, stopped by a signal
