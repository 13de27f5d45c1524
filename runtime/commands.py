"""What the ``autopartition`` command line calls in the runtime: the one runtime module the partitioner imports.

``partitioner/cli.py`` reaches the runtime only through this module, inside the
commands that need it (``plan``'s and ``run``'s tensor-parallel check, ``verify``,
``run``), so ``autopartition --help`` and planning load neither the runtime nor torch:

* :func:`tensor_parallel_refusal` (:mod:`runtime.parallel.tensorparallel`): why the
  runtime cannot run a plan's tensor parallelism, asked before any rank starts;
* :func:`verify_plan` (:mod:`runtime.verify`): ``autopartition verify``;
* :class:`RankFailure` (:mod:`runtime.launch.failure`): a rank's first cause, as
  ``verify`` reports it;
* :func:`run_plan` (:mod:`runtime.launch.torchrun`): ``autopartition run``.

Each name is looked up in its home module on every use, as :mod:`runtime` does for
``Pipeline``: importing this module imports nothing else (no torch), a name imports
only its own module (``run`` loads no verifier), and an ``ImportError`` names the
module that is missing.  Nothing is kept here, so a test that replaces a home module
in ``sys.modules`` is seen.  The flat top of the runtime's floors: it may import any
runtime module, and no runtime module imports it.

Example::

    >>> from runtime import commands
    >>> commands.RankFailure.__module__
    'runtime.launch.failure'
    >>> commands.nonexistent
    Traceback (most recent call last):
    ...
    AttributeError: module 'runtime.commands' has no attribute 'nonexistent'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real names for type checkers; at run time module __getattr__ below
    from runtime.launch.failure import RankFailure
    from runtime.launch.torchrun import run_plan
    from runtime.parallel.tensorparallel import tensor_parallel_refusal
    from runtime.verify import verify_plan

__all__ = ["RankFailure", "run_plan", "tensor_parallel_refusal", "verify_plan"]

# Each command's name -> the runtime module that defines it.
_HOMES: dict[str, str] = {
    "RankFailure": "runtime.launch.failure",
    "run_plan": "runtime.launch.torchrun",
    "tensor_parallel_refusal": "runtime.parallel.tensorparallel",
    "verify_plan": "runtime.verify",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'runtime.commands' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
