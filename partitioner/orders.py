"""Schedules as plain data: actions, per-rank action lists, and every kind's compute order.

Below every pass (torch-free, no partitioner import but ``defaults`` and ``errors``),
because the solver reads the orders for in-flight activations, the plan stores
action rows, and the simulator and the runtime replay them.

An :class:`Action` prints as ``{stage}{kind}{microbatch}`` (``0F3``, ``1RB0``) and
parses back; a :class:`Schedule` holds one tuple of actions per pipeline rank.
The orders are plain ``(stage, kind, micro-batch)`` triples, one list per
pipeline rank; :func:`partitioner.schedule.lower.compute_order` wraps them in
:class:`Action` objects and :func:`~partitioner.schedule.lower.lower` adds the
communication.  Each order is
written as a *program* of ``(chunk, kind)`` tokens per rank: a rank's chunk c
is the c-th stage it holds; the k-th ``F`` (or ``B``) token of a chunk runs
that chunk's k-th micro-batch in its order, and a ``W`` token runs the oldest
backward of the chunk still without its W.

* ``gpipe``: all forwards, then all backwards.
* ``1f1b``: ``P - s - 1`` warm-up forwards, then one forward / one backward.
* ``interleaved-1f1b`` (Narayanan et al., "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2):
  v chunks per rank, stage ``c x P + r`` on rank r.  Micro-batches go in
  rounds of P: forwards run a round through chunk 0, then chunk 1, ...;
  backwards the same with the chunks reversed.  Rank r warms up with
  ``(v - 1) x P + 2 (P - 1 - r)`` forwards (Megatron-LM's count), then
  alternates one forward, one backward.  Needs M to be a multiple of P.
* ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
  section 3.1, Figure 3 top): 1F1B's warm-up and its forward-to-backward
  limit (``P - s`` micro-batches between F and B), B is the input gradient
  only, and stage s starts its W's s micro-batches late, so the W's it owes
  fill the cool-down, where 1F1B idles.  Every rank then holds at most
  ``min(M, P)`` micro-batches between F and W: 1F1B's peak (stage 0's).
* ``zbv`` (same paper, section 6, ZB-V): two chunks per rank in a V, stage r
  and stage ``2P - 1 - r`` on rank r.  Rank r runs ``2 (P - r) - 1`` chunk-0
  forwards (until its first chunk-1 forward can arrive), then ``r`` pairs of
  chunk-1 and chunk-0 forwards, then ``P - r`` chunk-1 ``F B W`` (until its
  first chunk-0 backward can arrive), then ``F B W`` of chunk 0 and of chunk
  1 in turn, then the remaining B's with the W's after them.  With equal F,
  B and W every rank is busy from its first action to the step's end, holding
  at most 2P chunk activations (P stage activations of twice the size:
  1F1B's peak).  Built for ``max(M, 2P - 1)`` micro-batches; those beyond M
  are left out (their slots become idle time).

Example (2 ranks, 4 micro-batches)::

    >>> for row in rank_orders("zbv", ranks=2, microbatches=4, chunks=2):
    ...     print(" ".join(f"{s}{k}{i}" for s, k, i in row))
    0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3
    1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3
    >>> stage_ranks("interleaved-1f1b", ranks=2, chunks=2), stage_ranks("zbv", ranks=2, chunks=2)
    ((0, 1, 0, 1), (0, 1, 1, 0))
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Sequence
from typing import Literal

from partitioner.defaults import SCHEDULES, schedule_chunks, splits_backward
from partitioner.errors import ScheduleError

__all__ = ["Action", "ActionKind", "Schedule", "Step", "parse_actions", "peak_activations", "rank_orders", "stage_ranks"]

ActionKind = Literal["F", "B", "W", "SF", "RF", "SB", "RB"]
_PATTERN = re.compile(r"^(\d+)(F|B|W|SF|RF|SB|RB)(\d+)$")

# (stage, kind, micro-batch): one compute action, kind "F", "B" or "W".
Step = tuple[int, str, int]
# (chunk, kind): one slot of a rank's program, before micro-batches are assigned.
_Token = tuple[int, str]


def stage_ranks(kind: str, *, ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """The pipeline rank of every stage (``ranks x chunks`` stages) under schedule ``kind``.

    >>> stage_ranks("1f1b", ranks=3, chunks=1), stage_ranks("zbv", ranks=3, chunks=2)
    ((0, 1, 2), (0, 1, 2, 2, 1, 0))
    """
    chunks = schedule_chunks(kind, chunks)
    if ranks < 1:
        raise ScheduleError(f"Need at least one pipeline rank, got {ranks}.")
    if kind == "zbv":
        return tuple(range(ranks)) + tuple(reversed(range(ranks)))
    return tuple(s % ranks for s in range(ranks * chunks))


def rank_orders(kind: str, *, ranks: int, microbatches: int, chunks: int = 1) -> list[list[Step]]:
    """Each pipeline rank's F/B/W order under schedule ``kind`` (see the module docstring)."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"Unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}.")
    if ranks < 1 or microbatches < 1:
        raise ScheduleError(f"Need at least one stage and one micro-batch, got {ranks} and {microbatches}.")
    placed = stage_ranks(kind, ranks=ranks, chunks=chunks)
    held = [[s for s, r in enumerate(placed) if r == rank] for rank in range(ranks)]
    P, M = ranks, microbatches
    if kind == "interleaved-1f1b":
        if M % P:
            fits = ", ".join(str(P * k) for k in range(1, 4))
            raise ScheduleError(
                f"Schedule 'interleaved-1f1b' runs micro-batches in rounds of one per pipeline rank, so it "
                f"needs a multiple of {P} micro-batches, not {M}: use {fits}, ..."
            )
        return [_assign(_interleaved(r, P, M, len(held[r])), held[r]) for r in range(P)]
    if kind == "zbv":
        padded = max(M, 2 * P - 1)
        rows = [_assign(_zbv(r, P, padded), held[r]) for r in range(P)]
        return [[step for step in row if step[2] < M] for row in rows]
    program = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1}[kind]
    return [_assign(program(r, P, M), held[r]) for r in range(P)]


def peak_activations(
    kind: str, *, ranks: int, microbatches: int, chunks: int = 1, activation_bytes: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Per pipeline rank, the most activations it holds at once under ``kind``: the solver's memory term.

    A forward adds its stage's ``activation_bytes`` (default 1 per stage: the
    count of stage micro-batches in flight); the backward frees them, or the
    W when the kind splits the backward.  A rank's memory changes only at its
    own actions, so its order alone fixes the peak, whatever the timing
    (:func:`partitioner.schedule.simulate.simulate_schedule` gives the same numbers).

    >>> peak_activations("1f1b", ranks=4, microbatches=8), peak_activations("zb-h1", ranks=4, microbatches=8)
    ((4.0, 3.0, 2.0, 1.0), (4.0, 4.0, 4.0, 4.0))
    >>> peak_activations("zbv", ranks=2, microbatches=8, chunks=2, activation_bytes=[0.5] * 4)
    (2.0, 2.0)
    """
    stages = ranks * chunks
    nbytes = [1.0] * stages if activation_bytes is None else [float(b) for b in activation_bytes]
    if len(nbytes) != stages:
        raise ScheduleError(f"activation_bytes has {len(nbytes)} entries for {stages} stages.")
    frees = "W" if splits_backward(kind) else "B"
    peaks = []
    for row in rank_orders(kind, ranks=ranks, microbatches=microbatches, chunks=chunks):
        held = peak = 0.0
        for s, k, _ in row:
            held += nbytes[s] if k == "F" else -nbytes[s] if k == frees else 0.0
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


# ------------------------------------------------------------------ programs


def _gpipe(r: int, P: int, M: int) -> list[_Token]:
    return [(0, "F")] * M + [(0, "B")] * M


def _one_f_one_b(r: int, P: int, M: int) -> list[_Token]:
    warmup = min(P - 1 - r, M)
    return [(0, "F")] * warmup + [(0, "F"), (0, "B")] * (M - warmup) + [(0, "B")] * warmup


def _zb_h1(r: int, P: int, M: int) -> list[_Token]:
    """1F1B's F/B pattern; W's start r micro-batches late and trail the cool-down's B's."""
    warmup = min(P - 1 - r, M)
    tokens: list[_Token] = [(0, "F")] * warmup
    owed = 0  # B's run whose W has not
    for _ in range(M - warmup):
        tokens += [(0, "F"), (0, "B")]
        owed += 1
        if owed > r:
            tokens.append((0, "W"))
            owed -= 1
    for _ in range(warmup):
        tokens.append((0, "B"))
        tokens.append((0, "W"))  # one W per cool-down B keeps r owed until the end
    return tokens + [(0, "W")] * owed


def _interleaved(r: int, P: int, M: int, v: int) -> list[_Token]:
    total = M * v
    forwards = [((k % (P * v)) // P, "F") for k in range(total)]
    backwards = [(v - 1 - c, "B") for c, _ in forwards]
    warmup = min((v - 1) * P + 2 * (P - 1 - r), total)
    tokens = forwards[:warmup]
    for k in range(total - warmup):
        tokens += [forwards[warmup + k], backwards[k]]
    return tokens + backwards[total - warmup:]


def _zbv(r: int, P: int, M: int) -> list[_Token]:
    """The ZB-V program of rank r for M >= 2P - 1 micro-batches (chunk 0 = stage r, chunk 1 = 2P - 1 - r)."""
    f0, f1, b0, b1, w0, w1 = (0, "F"), (1, "F"), (0, "B"), (1, "B"), (0, "W"), (1, "W")
    tokens = [f0] * (2 * (P - r) - 1) + [f1, f0] * r + [f1, b1, w1] * (P - r)
    forwards0 = 2 * P - r - 1
    for _ in range(M - P):  # one chunk-1 forward per round; chunk-0 forwards run out first
        if forwards0 < M:
            tokens.append(f0)
            forwards0 += 1
        tokens += [b0, w0, f1, b1, w1]
    tokens += [b0, b1] * r + [b0, w0] * (P - r)
    return tokens + [w1] * r + [w0] * r


# ------------------------------------------------------------------ micro-batches


def _assign(tokens: list[_Token], stages: list[int]) -> list[Step]:
    """Number the tokens: k-th F / B of a chunk -> micro-batch k; W -> the oldest B of the chunk without a W.

    Every kind runs each chunk's forwards (and backwards) in ascending
    micro-batch order; interleaving only changes how chunks alternate.
    """
    taken = {(c, k): 0 for c in range(len(stages)) for k in ("F", "B")}
    owed: list[deque[int]] = [deque() for _ in stages]
    steps: list[Step] = []
    for c, k in tokens:
        if k == "W":
            i = owed[c].popleft()
        else:
            i = taken[c, k]
            taken[c, k] += 1
            if k == "B":
                owed[c].append(i)
        steps.append((stages[c], k, i))
    return steps


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one stage."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"Cannot parse schedule action {text!r}: expected stage, kind (F, B, W, SF, RF, SB, RB) "
                "and micro-batch, like '0F3' or '1RB0'."
            )
        return Action(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-pipeline-rank action lists (every replica of a rank runs the same list)."""

    kind: str
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def ranks(self) -> int:
        """Pipeline ranks: one row each."""
        return len(self.actions)

    @property
    def splits_backward(self) -> bool:
        """Does the schedule run W actions (B is then the input gradient only)?"""
        return any(a.kind == "W" for row in self.actions for a in row)

    def format(self) -> str:
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)
        )

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in acts] for acts in self.actions]

    @staticmethod
    def from_strings(kind: str, microbatches: int, rows: Sequence[Sequence[str]]) -> Schedule:
        return Schedule(kind, microbatches, tuple(parse_actions(row) for row in rows))


def parse_actions(row: Sequence[str]) -> tuple[Action, ...]:
    return tuple(Action.parse(text) for text in row)
