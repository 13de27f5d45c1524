"""Which engine runs a rank's stages: ours (:class:`~runtime.execute.runner.StepRunner`) or torch's.

Imports no torch: ``autopartition run`` (:mod:`runtime.launch.torchrun`) sets
:data:`ENGINE_ENV` for every rank before any of them starts, and each rank's
``Pipeline`` reads it back through :func:`engine_from_env`.

    >>> engine_from_env("torch")
    'torch'
"""

from __future__ import annotations

import os

from partitioner.errors import AutopartitionError

__all__ = ["ENGINES", "ENGINE_ENV", "engine_from_env"]

ENGINES = ("ours", "torch")
ENGINE_ENV = "AUTOPARTITION_ENGINE"  # `autopartition run --engine torch` sets it for every rank


def engine_from_env(engine: str | None) -> str:
    """``engine``, else ``$AUTOPARTITION_ENGINE``, else ``"ours"``; an unknown name is refused."""
    chosen = engine if engine is not None else os.environ.get(ENGINE_ENV, "") or "ours"
    if chosen not in ENGINES:
        source = "engine=" if engine is not None else f"${ENGINE_ENV}="
        raise AutopartitionError(f"{source}{chosen!r}: the engines are 'ours' (default) and 'torch' "
                                 "(torch.distributed.pipelining's schedules).")
    return chosen
