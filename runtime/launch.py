"""Launch: ``autopartition run plan/ [torchrun options] -- train.py [args]``.

Runs ``python -m torch.distributed.run`` (torchrun) with the plan's rank count
as ``--nproc-per-node`` unless told otherwise, so multi-node jobs use
torchrun's own rendezvous options (``--nnodes``, ``--rdzv-endpoint``, ...).
The training script finds the plan through ``AUTOPARTITION_PLAN``
(:func:`plan_from_env`).

Example::

    autopartition run plan/ -- examples/train_gpt.py --steps 10
    # = AUTOPARTITION_PLAN=plan/ python -m torch.distributed.run --nproc-per-node 4 examples/train_gpt.py --steps 10
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from partitioner.errors import AutopartitionError
from partitioner.plan import Plan
from partitioner.units import plural

__all__ = ["PLAN_ENV", "plan_from_env", "run_plan", "torchrun_command"]

PLAN_ENV = "AUTOPARTITION_PLAN"


def _option(args: Sequence[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def torchrun_command(plan: Plan, torchrun_args: Sequence[str], script: Sequence[str]) -> list[str]:
    """The torchrun command line for ``plan``; checks the rank count when it can."""
    args = list(torchrun_args)
    nproc = _option(args, "--nproc-per-node", "--nproc_per_node")
    nnodes = _option(args, "--nnodes")
    if nproc is None:
        if nnodes not in (None, "1"):
            raise AutopartitionError(
                f"With --nnodes {nnodes}, say how many ranks each node runs: --nproc-per-node K "
                f"with nodes x K = {plan.gpus}."
            )
        args = ["--nproc-per-node", str(plan.gpus)] + args
    elif nnodes in (None, "1") and nproc.isdigit() and int(nproc) != plan.gpus:
        raise AutopartitionError(
            f"The plan needs {plural(plan.gpus, 'rank')} ({plural(plan.pp, 'stage')} x {plural(plan.dp, 'replica')}) but "
            f"--nproc-per-node is {nproc} on one node. Use --nproc-per-node {plan.gpus}, or add --nnodes."
        )
    return [sys.executable, "-m", "torch.distributed.run", *args, *script]


def run_plan(plan_dir: str, torchrun_args: Sequence[str], script: Sequence[str]) -> int:
    """Run the training script under torchrun; returns its exit code."""
    plan = Plan.load(plan_dir)
    if not script:
        raise AutopartitionError("Name the training script after `--`, e.g. `-- train.py`.")
    if script[0].endswith(".py") and not Path(script[0]).exists():
        raise AutopartitionError(f"The training script {script[0]} does not exist (cwd {os.getcwd()}).")
    command = torchrun_command(plan, torchrun_args, script)
    env = dict(os.environ, **{PLAN_ENV: str(Path(plan_dir).resolve())})
    # torchrun sets 1 itself when unset, with a multi-line banner; one thread per rank is what
    # CPU ranks are costed with too.  A value the user set is kept.
    threads = env.setdefault("OMP_NUM_THREADS", "1")
    nproc = _option(command, "--nproc-per-node", "--nproc_per_node")
    print(f"[autopartition] run: starting {nproc} ranks per node with torchrun for {plural(plan.pp, 'stage')} x "
          f"{plural(plan.dp, 'replica')} (OMP_NUM_THREADS={threads}); each rank builds and captures the model "
          "before its first step", file=sys.stderr, flush=True)
    print("[autopartition] " + " ".join(shlex.quote(c) for c in command), file=sys.stderr, flush=True)
    return subprocess.run(command, env=env, check=False).returncode


def plan_from_env(default: str | None = None) -> Plan:
    """The plan ``autopartition run`` launched this script with (or ``default``)."""
    directory = os.environ.get(PLAN_ENV, default)
    if directory is None:
        raise AutopartitionError(
            f"No plan given: launch with `autopartition run plan/ -- script.py` (it sets {PLAN_ENV}) "
            "or pass the plan directory."
        )
    return Plan.load(directory)
