"""Schedules as data: for every stage, the ordered actions it runs in one step.

An :class:`Action` prints as ``{stage}{kind}{microbatch}``: ``0F3`` is stage 0's
forward of micro-batch 3, ``1B0`` a backward, and the communication actions are
``SF`` / ``RF`` (send / receive activations) and ``SB`` / ``RB`` (send /
receive gradients), e.g. ``1RF3``.  Each communication action moves every
boundary tensor of that stage and micro-batch, to or from all its peers.

* :func:`compute_order` gives the F/B order of a schedule kind: GPipe (all
  forwards, then all backwards; with one micro-batch it is naive model
  parallelism) or 1F1B (``P - s - 1`` warm-up forwards, then one forward / one
  backward, so at most ``P - s`` micro-batches are in flight on stage s).
* :func:`lower` inserts the communication actions a stage needs.
* :func:`validate` checks a schedule and dry-runs it: sends never block,
  receives wait for every peer's matching send, and a schedule whose ranks
  would wait on each other forever raises :class:`ScheduleError` with the grid
  around the stuck actions and the cycle of waits (``nx.find_cycle`` over which
  stuck receive needs which peer's send).

Example::

    >>> order = compute_order("1f1b", stages=2, microbatches=3)
    >>> sched = lower(order, sends_to=((1,), ()), receives_from=((), (0,)))
    >>> print(sched.format())
    stage 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0F2 0SF2 0RB1 0B1 0RB2 0B2
    stage 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1RF2 1F2 1B2 1SB2
    >>> validate(sched, sends_to=((1,), ()), receives_from=((), (0,)))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

import networkx as nx

from partitioner.defaults import SCHEDULES
from partitioner.errors import ScheduleError

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Schedule",
    "compute_order",
    "lower",
    "parse_actions",
    "validate",
]

ActionKind = Literal["F", "B", "SF", "RF", "SB", "RB"]
_PATTERN = re.compile(r"^(\d+)(F|B|SF|RF|SB|RB)(\d+)$")


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
                f"Cannot parse schedule action {text!r}: expected stage, kind (F, B, SF, RF, SB, RB) "
                "and micro-batch, like '0F3' or '1RB0'."
            )
        return Action(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-stage action lists (every replica of a stage runs the same list)."""

    kind: str
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return len(self.actions)

    def format(self) -> str:
        return "\n".join(
            f"stage {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(self.actions)
        )

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in acts] for acts in self.actions]

    @staticmethod
    def from_strings(kind: str, microbatches: int, rows: Sequence[Sequence[str]]) -> Schedule:
        return Schedule(kind, microbatches, tuple(parse_actions(row) for row in rows))


def parse_actions(row: Sequence[str]) -> tuple[Action, ...]:
    return tuple(Action.parse(text) for text in row)


def compute_order(kind: str, *, stages: int, microbatches: int) -> list[list[Action]]:
    """Forward/backward order per stage for schedule ``kind`` (``gpipe`` or ``1f1b``)."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"Unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}.")
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"Need at least one stage and one micro-batch, got {stages} and {microbatches}.")
    order: list[list[Action]] = []
    for s in range(stages):
        F = [Action(s, "F", i) for i in range(microbatches)]
        B = [Action(s, "B", i) for i in range(microbatches)]
        if kind == "gpipe":
            order.append(F + B)
            continue
        warmup = min(stages - 1 - s, microbatches)
        row = F[:warmup]
        for i in range(microbatches - warmup):
            row += [F[warmup + i], B[i]]
        row += B[microbatches - warmup :]
        order.append(row)
    return order


def lower(
    order: Sequence[Sequence[Action]],
    *,
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
    kind: str = "",
) -> Schedule:
    """Insert communication: ``RF`` before and ``SF`` after a forward, ``RB`` before and ``SB`` after a backward."""
    rows: list[tuple[Action, ...]] = []
    microbatches = 0
    for s, row in enumerate(order):
        lowered: list[Action] = []
        for a in row:
            microbatches = max(microbatches, a.microbatch + 1)
            if a.kind == "F":
                if receives_from[s]:
                    lowered.append(Action(s, "RF", a.microbatch))
                lowered.append(a)
                if sends_to[s]:
                    lowered.append(Action(s, "SF", a.microbatch))
            elif a.kind == "B":
                if sends_to[s]:
                    lowered.append(Action(s, "RB", a.microbatch))
                lowered.append(a)
                if receives_from[s]:
                    lowered.append(Action(s, "SB", a.microbatch))
            else:
                lowered.append(a)
        rows.append(tuple(lowered))
    return Schedule(kind, microbatches, tuple(rows))


def validate(
    schedule: Schedule,
    *,
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
) -> None:
    """Raise :class:`ScheduleError` unless every stage's list is complete, ordered and deadlock-free."""
    M = schedule.microbatches
    if len(sends_to) != schedule.stages or len(receives_from) != schedule.stages:
        raise ScheduleError(
            f"The schedule has {schedule.stages} stages but the plan has {len(sends_to)}."
        )
    for s, row in enumerate(schedule.actions):
        _check_row(s, row, M, bool(sends_to[s]), bool(receives_from[s]))
    _dry_run(schedule, sends_to, receives_from)


def _check_row(s: int, row: Sequence[Action], M: int, sends: bool, receives: bool) -> None:
    seen: dict[tuple[str, int], int] = {}
    for position, a in enumerate(row):
        if a.stage != s:
            raise ScheduleError(f"Action {a} is in stage {s}'s list but names stage {a.stage}.")
        if not 0 <= a.microbatch < M:
            raise ScheduleError(f"Action {a} names micro-batch {a.microbatch}; there are {M}.")
        if (a.kind, a.microbatch) in seen:
            raise ScheduleError(f"Action {a} appears twice in stage {s}'s list.")
        seen[a.kind, a.microbatch] = position
    needed = ["F", "B"] + (["SF", "RB"] if sends else []) + (["RF", "SB"] if receives else [])
    for kind in ("SF", "RB", "RF", "SB"):
        if kind not in needed and any(k == kind for k, _ in seen):
            raise ScheduleError(f"Stage {s} has a {kind} action but no peer for it.")
    for i in range(M):
        for kind in needed:
            if (kind, i) not in seen:
                raise ScheduleError(f"Stage {s} never runs {s}{kind}{i}.")
        before = [("RF", "F"), ("F", "SF"), ("F", "B"), ("RB", "B"), ("B", "SB")]
        for first, then in before:
            if (first, i) in seen and (then, i) in seen and seen[first, i] > seen[then, i]:
                raise ScheduleError(f"Stage {s} runs {s}{then}{i} before {s}{first}{i}.")


def _dry_run(schedule: Schedule, sends_to: Sequence[Sequence[int]], receives_from: Sequence[Sequence[int]]) -> None:
    """Execute the lists with blocking receives and non-blocking sends; fail on a deadlock."""
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * schedule.stages
    rows = schedule.actions
    while True:
        progressed = False
        for s, row in enumerate(rows):
            while cursor[s] < len(row):
                a = row[cursor[s]]
                if a.kind == "RF" and not all((p, "SF", a.microbatch) in done for p in receives_from[s]):
                    break
                if a.kind == "RB" and not all((p, "SB", a.microbatch) in done for p in sends_to[s]):
                    break
                done.add((s, a.kind, a.microbatch))
                cursor[s] += 1
                progressed = True
        if all(cursor[s] == len(rows[s]) for s in range(len(rows))):
            return
        if not progressed:
            stuck = "; ".join(
                f"stage {s} waits at {rows[s][cursor[s]]} (after {' '.join(str(a) for a in rows[s][max(0, cursor[s] - 3):cursor[s]]) or 'nothing'})"
                for s in range(len(rows))
                if cursor[s] < len(rows[s])
            )
            raise ScheduleError(f"The schedule deadlocks: {stuck}.{_wait_cycle(rows, cursor, done, sends_to, receives_from)}")


def _wait_cycle(
    rows: Sequence[Sequence[Action]],
    cursor: Sequence[int],
    done: set[tuple[int, str, int]],
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
) -> str:
    """The cycle in the wait-for graph of stuck receives, as a sentence (empty if there is none).

    An edge joins a stuck receive to the action its peer is stuck at, labelled with
    the send the receive needs from that peer.
    """
    waits = nx.DiGraph()
    for s, row in enumerate(rows):
        if cursor[s] == len(row):
            continue
        a = row[cursor[s]]  # a receive: nothing else blocks
        send: ActionKind = "SF" if a.kind == "RF" else "SB"
        for p in receives_from[s] if a.kind == "RF" else sends_to[s]:
            if (p, send, a.microbatch) not in done and cursor[p] < len(rows[p]):
                waits.add_edge(a, rows[p][cursor[p]], needs=Action(p, send, a.microbatch))
    try:
        cycle = nx.find_cycle(waits)
    except nx.NetworkXNoCycle:
        return ""
    steps = ", ".join(f"{u} needs {waits.edges[u, v]['needs']} but stage {v.stage} is stuck at {v}" for u, v in cycle)
    return f" Wait cycle: {steps}."
