"""Spend each pipeline rank's memory headroom on recomputing less, by its exact peak.

The solvers choose each stage's recomputation by a rule
(:func:`~partitioner.solve.problem.choose_recompute`: keep everything if that fits,
else recompute the fewest leading layers that fit, else all) against a per-stage
cap.  Two things are left on the table:

* **Headroom.**  With several stages per rank (``interleaved-1f1b``) the cap is a
  share of the GPU (:func:`~partitioner.solve.problem.chunk_memory_limit`): safe,
  but a rank's stages do not hold their most micro-batches at the same moment,
  so its exact peak (:func:`~partitioner.solve.problem.rank_memory`, its own
  order walked action by action) often leaves gigabytes unused.
* **Per-op recomputation** (``op_kept_bytes``, ``op_recompute_s``): a layer that
  keeps the outputs of its matrix multiplications and attention and recomputes
  only the cheap ops between them (norms, activations, rotary embeddings,
  residual adds) keeps about two fifths of its activations for a few percent of
  its forward (torchtitan's per-op selective activation checkpointing).  Per
  byte it saves far more time than keeping a whole layer, so where memory is
  short many layers recomputing their cheap ops beat a few keeping everything.

:func:`spend_rank_headroom` takes a split and the rule's choice and, rank by rank,
moves layers down the tiers *recompute wholly* -> *recompute cheap ops* -> *keep*
(the last wholly recomputed layer of a stage becomes its first cheap one; the
last cheap one becomes kept), greedily by seconds saved per byte added to the
rank's exact peak, while the peak fits ``rank_memory_limit`` (else
``memory_limit``, the GPU's when each rank holds one stage).  Ranks share no
memory and every closed form grows with each rank's time (``sum t + (M-1) max
t``, ``M max T + ...``), so each rank is spent alone.  It starts twice, from the
rule's choice and from every layer recomputed wholly (the rule may keep a whole
layer where two or three cheap ones would save more), and keeps, per rank, the
faster.  Moves only ever remove recomputation from the start, so a rank is
never slower than the rule made it, and memory is checked exactly.

Example: two ranks, two one-layer stages each, 10 bytes of activations per
micro-batch and layer (2 when recomputed), 4 micro-batches; every stage
recomputes, and each rank may hold 40 bytes; without per-op costs the first
stage still recomputes, the others keep everything::

    >>> from partitioner.solve.problem import PartitionProblem, rank_memory
    >>> p = PartitionProblem(time_s=(1.0,) * 4, static_bytes=(0.0,) * 4, activation_bytes=(10.0,) * 4,
    ...     allreduce_s=(0.0,) * 4, transfer_s=(0.0,) * 4, edges=((0, 1), (1, 2), (2, 3)),
    ...     recompute_bytes=(2.0,) * 4, recompute_s=(0.3,) * 4, recompute="auto", memory_limit=20.0,
    ...     stage_rank=(0, 1, 0, 1), rank_memory_limit=40.0, layer_start=(True,) * 4)
    >>> kwargs = dict(microbatches=4, schedule="interleaved-1f1b")
    >>> spend_rank_headroom(p, (0, 1, 2, 3), 4, recompute=(True,) * 4, **kwargs)
    ((True, False, False, False), (0, 0, 0, 0))

Where a layer recomputing its cheap ops keeps 5 bytes and spends 0.05 s, rank 0's
two stages both do that (0.1 s) rather than one recomputing wholly and one
keeping everything (0.3 s)::

    >>> q = dataclasses.replace(p, op_kept_bytes=(5.0,) * 4, op_recompute_s=(0.05,) * 4)
    >>> relaxed, ops = spend_rank_headroom(q, (0, 1, 2, 3), 4, recompute=(True,) * 4, **kwargs)
    >>> relaxed, ops
    ((False, False, False, False), (1, 0, 1, 0))
    >>> [round(m) for m in rank_memory(q, (0, 1, 2, 3), 4, recompute=relaxed, ops=ops, **kwargs)]
    [35, 30]
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from partitioner.defaults import splits_backward
from partitioner.solve.problem import (
    PartitionProblem,
    RankPeaks,
    ScheduleKind,
    StageRecompute,
    stage_rank_of,
    within_limit,
)

__all__ = ["same_recompute", "spend_rank_headroom"]


@dataclasses.dataclass
class _Stage:
    """One stage's layers (as block index ranges) and how many recompute wholly, then their cheap ops."""

    units: list[tuple[int, int]]  # [start, end) within the stage's blocks, one per layer
    whole: int  # the first ``whole`` units recompute wholly
    cheap: int  # the next ``cheap`` recompute their cheap ops

    def choice(self) -> tuple[StageRecompute, int]:
        """(:data:`StageRecompute`, blocks recomputing their cheap ops) of this state."""
        blocks = self.units[-1][1]
        redo = self.units[self.whole - 1][1] if self.whole else 0
        ops = (self.units[self.whole + self.cheap - 1][1] - redo) if self.cheap else 0
        recompute: StageRecompute = True if redo == blocks else redo if redo else False
        return recompute, ops


def spend_rank_headroom(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    recompute: Sequence[StageRecompute],
    microbatches: int,
    schedule: ScheduleKind,
) -> tuple[tuple[StageRecompute, ...], tuple[int, ...]]:
    """(per-stage recomputation, per-stage blocks recomputing only their cheap ops) within each rank's exact peak.

    ``recompute`` (the rule's choice) comes back unchanged, with no cheap blocks,
    unless the problem decides recomputation by memory (``recompute="auto"`` with
    a limit) and the schedule recomputes at all (a split backward never does).
    See the module docstring.
    """
    start = tuple(recompute)
    limit = problem.rank_memory_limit if problem.rank_memory_limit is not None else problem.memory_limit
    if limit is None or problem.recompute != "auto" or problem.recompute_s is None or splits_backward(schedule):
        return start, (0,) * stages
    blocks: list[list[int]] = [[] for _ in range(stages)]
    for v, s in enumerate(stage_of):
        blocks[s].append(v)
    rank = stage_rank_of(problem, stages)
    cheap_ok = problem.op_kept_bytes is not None and problem.op_recompute_s is not None
    runs = {"rule": [_state(problem, blocks[s], start[s]) for s in range(stages)],
            "whole": [_state(problem, blocks[s], True) for s in range(stages)]}
    peaks = RankPeaks(problem, stage_of, stages, microbatches=microbatches, schedule=schedule)
    for states in runs.values():
        for r in sorted(set(rank)):
            _spend(problem, peaks, blocks, states, [s for s in range(stages) if rank[s] == r], r, limit,
                   cheap_ok=cheap_ok)
    out: list[tuple[StageRecompute, int]] = []
    for s in range(stages):
        mine = [t for t in range(stages) if rank[t] == rank[s]]
        best = min(runs.values(), key=lambda states: sum(_seconds(problem, blocks[t], states[t]) for t in mine))
        out.append(best[s].choice())
    chosen = tuple(c for c, _ in out)
    if all(ops == 0 for _, ops in out) and same_recompute(chosen, start):
        return start, (0,) * stages
    return chosen, tuple(ops for _, ops in out)


def same_recompute(a: Sequence[StageRecompute], b: Sequence[StageRecompute]) -> bool:
    """Whether two per-stage choices are the same (``True``, every block, is not the count ``1`` it equals).

    >>> same_recompute((True, False), (1, 0)), same_recompute((True, 2), (True, 2))
    (False, True)
    """
    return len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b, strict=True))


def _state(problem: PartitionProblem, blocks: Sequence[int], choice: StageRecompute) -> _Stage:
    """The stage's layers, the first of them recomputing wholly as ``choice`` says (a cut at a layer start)."""
    starts = [i for i in range(1, len(blocks)) if problem.layer_start is not None and problem.layer_start[blocks[i]]]
    edges = [0, *starts, len(blocks)]
    units = list(itertools.pairwise(edges))
    count = len(blocks) if choice is True else 0 if choice is False else int(choice)
    whole = sum(1 for _, end in units if end <= count)
    return _Stage(units, whole, 0)


def _seconds(problem: PartitionProblem, blocks: Sequence[int], state: _Stage) -> float:
    """The recomputation seconds a stage spends in this state."""
    assert problem.recompute_s is not None
    total = 0.0
    for u, (lo, hi) in enumerate(state.units):
        if u < state.whole:
            total += sum(problem.recompute_s[v] for v in blocks[lo:hi])
        elif u < state.whole + state.cheap:
            assert problem.op_recompute_s is not None
            total += sum(problem.op_recompute_s[v] for v in blocks[lo:hi])
    return total


def _spend(
    problem: PartitionProblem, peaks: RankPeaks, blocks: Sequence[Sequence[int]], states: list[_Stage],
    mine: list[int], r: int, limit: float, *, cheap_ok: bool,
) -> None:
    """Move rank ``r``'s layers down the tiers, best seconds per byte first, while its exact peak fits."""
    recompute: list[StageRecompute] = [False] * len(blocks)  # rank r's stages filled in: only they are read
    ops = [0] * len(blocks)

    def peak() -> float:
        for s in mine:
            recompute[s], ops[s] = states[s].choice()
        return peaks.rank(r, recompute, ops if cheap_ok else None)

    held = peak()
    if not within_limit(held, limit):
        return  # the rule's choice does not fit this rank: nothing to spend
    while True:
        best: tuple[float, int, _Stage, float] | None = None
        for s in mine:
            before = states[s]
            for after in _moves(before, cheap_ok):
                saved = _seconds(problem, blocks[s], before) - _seconds(problem, blocks[s], after)
                if saved <= 0:
                    continue
                states[s] = after
                memory = peak()
                states[s] = before
                if not within_limit(memory, limit):
                    continue
                per_byte = saved / max(memory - held, 1.0)
                if best is None or per_byte > best[0]:
                    best = (per_byte, s, after, memory)
        if best is None:
            return
        _, s, states[s], held = best


def _moves(state: _Stage, cheap_ok: bool) -> list[_Stage]:
    """One layer one tier down: the last wholly recomputed one to cheap ops, or kept where no layer recomputes
    only cheap ops after it; the last cheap one kept."""
    out = []
    if state.whole and cheap_ok:
        out.append(_Stage(state.units, state.whole - 1, state.cheap + 1))
    if state.whole and not state.cheap:
        out.append(_Stage(state.units, state.whole - 1, 0))
    if state.cheap:
        out.append(_Stage(state.units, state.whole, state.cheap - 1))
    return out
