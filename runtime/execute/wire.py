"""What shape travels between pipeline peers under tensor parallelism: plain numbers, torch-free.

Each of a stage's groups of ranks (an entry of its ``ranks``) is ``tp`` ranks, and
tensor-parallel rank ``t`` talks only to rank ``t`` of its peers' groups
(``plan.layout.moved(rank, pp=...)``); the residual stream travels as each rank's ``1 / tp`` slice of
its sequence (:func:`wire_shape`: what the planner prices, and what sequence
parallelism holds anyway), anything else whole.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["sequence_split", "wire_shape"]


def sequence_split(shape: Sequence[int], dtype: str, tp: int) -> bool:
    """Whether a boundary tensor travels split along the sequence: a floating-point value of 3 or more
    dimensions whose dimension -2 ``tp`` divides (the residual stream ``(B, T, C)``); any other whole.

    >>> sequence_split((8, 32, 64), "float32", 2), sequence_split((8, 32), "int64", 2)
    (True, False)
    """
    return tp > 1 and len(shape) >= 3 and shape[-2] % tp == 0 and dtype.startswith(("float", "bfloat"))


def wire_shape(shape: Sequence[int], dtype: str, tp: int) -> tuple[int, ...]:
    """The shape one rank sends and receives of a boundary tensor of ``shape`` (:func:`sequence_split`).

    >>> wire_shape((8, 32, 64), "float32", 4)
    (8, 8, 64)
    """
    if not sequence_split(shape, dtype, tp):
        return tuple(shape)
    return (*shape[:-2], shape[-2] // tp, shape[-1])
