"""Baseline pipeline splits: what DeepSpeed, PiPPy and torchgpipe would choose.

Pure functions over per-unit numbers (a unit is one layer group: the embeddings,
one transformer block, the head); no torch, no numpy.

>>> equal_layers(5, 2)
(0, 0, 0, 1, 1)
>>> stage_sizes(min_max_split([3, 1, 1, 1], 2))
'1|3'
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "balance_by_time",
    "equal_layers",
    "equal_parameters",
    "format_runs",
    "ideal_step",
    "min_max_split",
    "stage_sizes",
    "units_to_blocks",
]


def equal_layers(n_units: int, stages: int) -> tuple[int, ...]:
    """Stage of each unit when every stage gets the same number of units (extras first).

    DeepSpeed's ``partition_uniform``: ``n // P`` units each, one more for the first
    ``n % P`` stages.

    >>> equal_layers(10, 4)
    (0, 0, 0, 1, 1, 1, 2, 2, 3, 3)
    """
    _check(n_units, stages)
    size, extra = divmod(n_units, stages)
    out: list[int] = []
    for s in range(stages):
        out.extend([s] * (size + (1 if s < extra else 0)))
    return tuple(out)


def min_max_split(weights: Sequence[float], stages: int) -> tuple[int, ...]:
    """Contiguous split of ``weights`` into ``stages`` non-empty parts with the least largest part.

    Exact (the bottleneck is found by a DP over prefix sums); among optimal splits each
    stage takes as many units as the bottleneck allows, from the first stage on, while
    leaving at least one unit for every later stage (DeepSpeed's ``partition_balanced``).

    >>> min_max_split([1, 1, 1, 1, 4], 2)
    (0, 0, 0, 0, 1)
    """
    n = len(weights)
    _check(n, stages)
    w = [float(x) for x in weights]
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    # best[s][j]: least bottleneck splitting the first j units into s parts.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], prefix[j] - prefix[i]) for i in range(s - 1, j))
    bottleneck = best[stages][n]
    tol = 1e-12 * max(1.0, abs(bottleneck))
    # Greedy from the left; a stage may stop early only if the rest still fits.
    # suffix_ok[s][i]: units i.. split into stages s.. with every part <= bottleneck.
    ok = [[False] * (n + 1) for _ in range(stages + 1)]
    ok[stages][n] = True
    for s in range(stages - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            ok[s][i] = any(
                ok[s + 1][j]
                for j in range(i + 1, n + 1)
                if prefix[j] - prefix[i] <= bottleneck + tol
            )
    out: list[int] = []
    i = 0
    for s in range(stages):
        j = max(
            j
            for j in range(i + 1, n + 1)
            if prefix[j] - prefix[i] <= bottleneck + tol and ok[s + 1][j]
        )
        out.extend([s] * (j - i))
        i = j
    return tuple(out)


def equal_parameters(unit_params: Sequence[float], stages: int) -> tuple[int, ...]:
    """Stage of each unit, balancing parameter counts (DeepSpeed ``partition_method="parameters"``)."""
    return min_max_split(unit_params, stages)


def balance_by_time(unit_times: Sequence[float], stages: int) -> tuple[int, ...]:
    """Stage of each unit, balancing compute time (torchgpipe ``balance_by_time``)."""
    return min_max_split(unit_times, stages)


def ideal_step(times: Sequence[float], stages: int, microbatches: int) -> float:
    """Perfect balance, free communication: ``sum t + (M-1) sum t / P``."""
    total = float(sum(times))
    return total + (microbatches - 1) * total / stages


def units_to_blocks(unit_stage: Sequence[int], unit_of_block: Sequence[int]) -> tuple[int, ...]:
    """A layer split as a stage per solver block."""
    return tuple(unit_stage[u] for u in unit_of_block)


def stage_sizes(stage_of: Sequence[int], *, runs_over: int = 12) -> str:
    """``3|3|2|2``: units (or blocks) per stage; ``2x34|1x30`` (runs) beyond ``runs_over`` stages."""
    counts: dict[int, int] = {}
    for s in stage_of:
        counts[s] = counts.get(s, 0) + 1
    sizes = [counts[s] for s in sorted(counts)]
    if len(sizes) <= runs_over:
        return "|".join(str(n) for n in sizes)
    return format_runs(sizes)


def format_runs(sizes: Sequence[int]) -> str:
    """Sizes with equal neighbours as runs.

    >>> format_runs([7, 8, 8, 8, 7])
    '7|8x3|7'
    """
    runs: list[list[int]] = []
    for n in sizes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "|".join(str(n) if k == 1 else f"{n}x{k}" for n, k in runs)


def _check(n: int, stages: int) -> None:
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} units into {stages} non-empty stages")
