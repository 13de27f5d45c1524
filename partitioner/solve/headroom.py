"""Spend a pipeline rank's memory headroom on recomputing less, by its exact peak.

With several stages per pipeline rank (``interleaved-1f1b``) the solvers cap each
stage at a share of the GPU (:func:`~partitioner.solve.problem.chunk_memory_limit`)
and choose each stage's recomputation against that cap
(:func:`~partitioner.solve.problem.choose_recompute`).  The cap is safe (a rank's
peak is at most the sum of its stages' peaks) but loose: the stages of one rank
do not hold their most micro-batches at the same moment, so a rank's exact peak
(:func:`~partitioner.solve.problem.rank_memory`, its own order walked action by
action) often leaves gigabytes unused while its stages recompute.

:func:`spend_rank_headroom` takes a split and its per-stage choice and, greedily,
lets a stage recompute one layer fewer (a whole stage recomputing becomes its
first layers only, the first layer becomes none: the units of selective
recomputation, ``layer_start``) wherever every rank's exact peak still fits
``rank_memory_limit``.  Each round takes the move that shortens the closed-form
step (:func:`~partitioner.solve.problem.step_time`) the most per byte it adds to
its rank's peak, so layers whose stage holds few micro-batches in flight (a
rank's later stages under interleaving) keep their activations first; it stops
when no move fits.  Every move only removes recomputation, so the step never
grows and the plan's memory is checked exactly, not by the share.

Example: two ranks, two one-layer stages each, 10 bytes of activations per
micro-batch and layer (2 when recomputed), 4 micro-batches; every stage
recomputes, and each rank may hold 40 bytes::

    >>> from partitioner.solve.problem import PartitionProblem, rank_memory
    >>> p = PartitionProblem(time_s=(1.0,) * 4, static_bytes=(0.0,) * 4, activation_bytes=(10.0,) * 4,
    ...     allreduce_s=(0.0,) * 4, transfer_s=(0.0,) * 4, edges=((0, 1), (1, 2), (2, 3)),
    ...     recompute_bytes=(2.0,) * 4, recompute_s=(0.3,) * 4, recompute="auto", memory_limit=20.0,
    ...     stage_rank=(0, 1, 0, 1), rank_memory_limit=40.0, layer_start=(True,) * 4)
    >>> kwargs = dict(microbatches=4, schedule="interleaved-1f1b")
    >>> relaxed = spend_rank_headroom(p, (0, 1, 2, 3), 4, recompute=(True,) * 4, **kwargs)
    >>> relaxed
    (True, False, False, False)
    >>> [round(m) for m in rank_memory(p, (0, 1, 2, 3), 4, recompute=relaxed, **kwargs)]
    [36, 30]
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.defaults import splits_backward
from partitioner.solve.problem import (
    PartitionProblem,
    ScheduleKind,
    StageRecompute,
    rank_memory,
    stage_rank_of,
    step_time,
    within_limit,
)

__all__ = ["spend_rank_headroom"]


def spend_rank_headroom(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    recompute: Sequence[StageRecompute],
    microbatches: int,
    schedule: ScheduleKind,
) -> tuple[StageRecompute, ...]:
    """``recompute`` with stages recomputing fewer layers wherever every rank's exact peak still fits.

    Unchanged unless the problem places several stages per rank and holds the
    GPU's own limit (``stage_rank`` and ``rank_memory_limit``), decides
    recomputation by memory (``recompute="auto"``) and the schedule recomputes
    at all (a split backward never does).  See the module docstring.
    """
    chosen = tuple(recompute)
    limit = problem.rank_memory_limit
    if (limit is None or problem.stage_rank is None or problem.recompute != "auto" or not any(chosen)
            or splits_backward(schedule)):
        return chosen
    blocks: list[list[int]] = [[] for _ in range(stages)]
    for v, s in enumerate(stage_of):
        blocks[s].append(v)
    rank = stage_rank_of(problem, stages)
    def peaks_of(choice: tuple[StageRecompute, ...]) -> list[float]:
        return rank_memory(problem, stage_of, stages, recompute=choice, microbatches=microbatches, schedule=schedule)

    def step_of(choice: tuple[StageRecompute, ...]) -> float:
        return step_time(problem, stage_of, recompute=choice, microbatches=microbatches, schedule=schedule)[0]

    peaks, step = peaks_of(chosen), step_of(chosen)
    while True:
        best: tuple[float, tuple[StageRecompute, ...], list[float], float] | None = None
        for s in range(stages):
            lighter = _one_layer_fewer(problem, blocks[s], chosen[s])
            if lighter is None:
                continue
            trial = (*chosen[:s], lighter, *chosen[s + 1:])
            memory = peaks_of(trial)
            if not all(within_limit(m, limit) for m in memory):
                continue
            shorter = step_of(trial)
            gain = step - shorter
            if gain <= 0:
                continue
            per_byte = gain / max(memory[rank[s]] - peaks[rank[s]], 1.0)
            if best is None or per_byte > best[0]:
                best = (per_byte, trial, memory, shorter)
        if best is None:
            return chosen
        _, chosen, peaks, step = best


def _one_layer_fewer(problem: PartitionProblem, blocks: Sequence[int], choice: StageRecompute) -> StageRecompute | None:
    """The stage's choice with its last recomputed layer kept instead, or None when it recomputes nothing.

    Without ``layer_start`` a stage recomputes all its blocks or none.
    """
    count = len(blocks) if choice is True else 0 if choice is False else min(int(choice), len(blocks))
    if count == 0:
        return None
    if problem.layer_start is None:
        return False
    fewer = max((i for i in range(1, count) if problem.layer_start[blocks[i]]), default=0)
    return fewer if fewer else False
