"""Schedules as data: for every pipeline rank, the ordered actions it runs in one step.

An :class:`Action` prints as ``{stage}{kind}{microbatch}``: ``0F3`` is stage 0's
forward of micro-batch 3, ``1B0`` a backward, ``0W3`` the weight gradient of a
backward split in two (then ``B`` computes only the gradient of the stage's
inputs), and the communication actions are ``SF`` / ``RF`` (send / receive
activations) and ``SB`` / ``RB`` (send / receive gradients), e.g. ``1RF3``.
Each communication action moves every boundary tensor of that stage and
micro-batch to or from all its peers on *other* ranks, in ascending order of
the peer stage; a boundary between two stages of one rank is handed over in
memory.  A row belongs to a pipeline rank, which may hold several stages
(``chunks``, :func:`stage_ranks`); with one stage per rank, row s is stage s.

* :func:`compute_order` gives the F/B/W order of a schedule kind per rank:
  ``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``zb-h1`` and ``zbv``
  (:mod:`partitioner.orders` says how each is built).
* :func:`lower` inserts the communication actions a rank needs.
* :func:`validate` checks a schedule and dry-runs it: sends never block,
  receives wait for every peer's matching send, and a schedule whose ranks
  would wait on each other forever raises :class:`ScheduleError` with the grid
  around the stuck actions and the cycle of waits (``nx.find_cycle`` over which
  stuck receive needs which peer's send).

NCCL pairs point-to-point messages by their order alone, so a rank's receive
actions need not take one peer's messages in the order it sends them: the
runtime (:mod:`runtime.execute.runner`) *posts* every receive from a peer in that
peer's send order, read from the peer's row, and waits for it at its own
action.  Only deadlocks can stop a lowered schedule, and with sends posted
right after their compute and receives right before theirs there are none
whenever the compute orders are consistent, whatever the graph of stages
(skip connections to any later stage included).

Example::

    >>> order = compute_order("1f1b", ranks=2, microbatches=3)
    >>> sched = lower(order, sends_to=((1,), ()), receives_from=((), (0,)))
    >>> print(sched.format())
    rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0F2 0SF2 0RB1 0B1 0RB2 0B2
    rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1RF2 1F2 1B2 1SB2
    >>> validate(sched, sends_to=((1,), ()), receives_from=((), (0,)))

Two stages per rank in a V (``zbv``): stages 1 and 2 share rank 1, so their
boundary needs no message; rank 0 sends ``0SF2`` before ``3SB0``, and rank 1
takes them in that order (``1RF2`` moved up before ``2RB0``: it waited there
for a later message anyway)::

    >>> chain = {"sends_to": ((1,), (2,), (3,), ()), "receives_from": ((), (0,), (1,), (2,))}
    >>> from partitioner.orders import stage_ranks
    >>> where = stage_ranks("zbv", ranks=2, chunks=2)
    >>> sched = lower(compute_order("zbv", ranks=2, microbatches=3, chunks=2), stage_rank=where, **chain)
    >>> print(sched.format())
    rank 0: 0F0 0SF0 0F1 0SF1 0F2 0SF2 3RF0 3F0 3B0 3SB0 3W0 3RF1 3F1 3B1 3SB1 3W1 0RB0 0B0 0W0 3RF2 3F2 3B2 3SB2 3W2 0RB1 0B1 0W1 0RB2 0B2 0W2
    rank 1: 1RF0 1F0 2F0 2SF0 1RF1 1F1 2F1 2SF1 1RF2 2RB0 2B0 2W0 1F2 1B0 1SB0 1W0 2F2 2SF2 2RB1 2B1 2W1 1B1 1SB1 2RB2 2B2 1B2 1SB2 1W1 2W2 1W2
    >>> validate(sched, stage_rank=where, **chain)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import networkx as nx

from partitioner.errors import ScheduleError
from partitioner.orders import Action, Schedule, rank_orders

__all__ = [
    "compute_order",
    "lower",
    "validate",
]

# Message: (direction F | B, sending stage, receiving stage, micro-batch).
_Message = tuple[str, int, int, int]
# Within one stage and micro-batch, the first action of each pair runs before the second.
_BEFORE = (("RF", "F"), ("F", "SF"), ("F", "B"), ("RB", "B"), ("B", "SB"), ("B", "W"))


def compute_order(
    kind: str,
    *,
    ranks: int | None = None,
    microbatches: int,
    chunks: int = 1,
    stages: int | None = None,
) -> list[list[Action]]:
    """Forward / backward / weight-gradient order per pipeline rank for schedule ``kind``.

    ``chunks``: stages per rank (:func:`partitioner.defaults.schedule_chunks`
    says which each kind takes).  ``stages`` is the older spelling for one
    stage per rank (``ranks = stages // chunks``); pass ``ranks``.

    >>> [" ".join(map(str, row)) for row in compute_order("zb-h1", ranks=2, microbatches=3)]
    ['0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2', '1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2']
    """
    if ranks is None:
        if stages is None:
            raise ScheduleError("compute_order needs the number of pipeline ranks: pass ranks=.")
        ranks = stages // max(chunks, 1)
    rows = rank_orders(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    return [[Action(s, k, i) for s, k, i in row] for row in rows]  # type: ignore[arg-type]


def lower(
    order: Sequence[Sequence[Action]],
    *,
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
    stage_rank: Sequence[int] | None = None,
    kind: str = "",
) -> Schedule:
    """Insert communication: ``RF`` before and ``SF`` after a forward, ``RB`` before and ``SB`` after a backward.

    ``sends_to`` / ``receives_from``: per stage, its consumer / producer stages;
    ``stage_rank``: the rank of every stage (default: stage s on rank s).  Only
    peers on other ranks take messages.  A ``W`` needs none: the input gradient
    leaves with its ``B``.

    Sends never block and each receive waits only for its own messages, so
    this placement cannot deadlock where the compute orders do not (every
    kind's order runs any DAG of stages numbered in topological order: a skip
    edge's data is ready before the chain's).  The runtime posts receives in
    each peer's send order, so no order of receives pairs messages wrongly.

    Where a rank takes two messages from one peer in another order than the
    peer sends them (a V, where one pair of ranks carries activations one way
    and gradients of the other chunk the same way), the receive of the message
    sent first moves up to just before the other: the rank waited there for a
    message sent after it anyway, so this delays nothing.  With several stages
    per rank and skip connections, one receive may bundle messages that its
    peers send far apart, and moving it up could make ranks wait on each
    other; the receives then stay where their compute needs them.
    """
    # The planner lowers one (order, topology) many times over (drafts, refinement, the chosen plan):
    # each is worked out once (:data:`_CACHE_SIZE` kept); a Schedule is immutable, so it is shared.
    key = (tuple(tuple(row) for row in order), _tupled(sends_to), _tupled(receives_from),
           None if stage_rank is None else tuple(stage_rank), kind)
    found = _LOWERED.get(key)
    if found is None:
        found = _lower(order, sends_to=sends_to, receives_from=receives_from, stage_rank=stage_rank, kind=kind)
        _remember(_LOWERED, key, found)
    return found


def _lower(
    order: Sequence[Sequence[Action]],
    *,
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
    stage_rank: Sequence[int] | None,
    kind: str,
) -> Schedule:
    """:func:`lower`, worked out."""
    where = _placement(stage_rank, len(sends_to), len(order))
    topology = _Topology(where, sends_to, receives_from)
    rows: list[list[Action]] = []
    microbatches = 0
    for row in order:
        lowered: list[Action] = []
        for a in row:
            microbatches = max(microbatches, a.microbatch + 1)
            s, i = a.stage, a.microbatch
            if a.kind == "F":
                lowered += [Action(s, "RF", i)] if topology.remote_in[s] else []
                lowered.append(a)
                lowered += [Action(s, "SF", i)] if topology.remote_out[s] else []
            elif a.kind == "B":
                lowered += [Action(s, "RB", i)] if topology.remote_out[s] else []
                lowered.append(a)
                lowered += [Action(s, "SB", i)] if topology.remote_in[s] else []
            else:
                lowered.append(a)
        rows.append(lowered)
    plain = Schedule(kind, microbatches, tuple(tuple(row) for row in rows))
    send_order = _send_order(rows, topology)
    moved = Schedule(kind, microbatches, tuple(_receive_in_send_order(row, rows, topology, send_order) for row in rows))
    if moved == plain:
        return plain
    if _deadlock(moved, topology) is not None:
        return plain
    # validate() need not run it again for this topology.
    _remember(_RAN, _run_key(moved, sends_to, receives_from, stage_rank), moved)
    return moved


def validate(
    schedule: Schedule,
    *,
    sends_to: Sequence[Sequence[int]],
    receives_from: Sequence[Sequence[int]],
    stage_rank: Sequence[int] | None = None,
) -> None:
    """Raise :class:`ScheduleError` unless every rank's list is complete, ordered and deadlock-free.

    A schedule object validated once for a topology is not checked again (it is immutable).
    """
    key = _run_key(schedule, sends_to, receives_from, stage_rank)
    if key in _VALID and _VALID[key] is schedule:
        return
    if len(sends_to) != len(receives_from):
        raise ScheduleError(f"sends_to has {len(sends_to)} stages but receives_from has {len(receives_from)}.")
    where = _placement(stage_rank, len(sends_to), schedule.ranks)
    topology = _Topology(where, sends_to, receives_from)
    split = schedule.splits_backward
    for r, row in enumerate(schedule.actions):
        _check_row(r, row, schedule.microbatches, topology, split)
    if not (key in _RAN and _RAN[key] is schedule):  # lower() dry-ran the receives it moved
        _dry_run(schedule, topology)
    _remember(_VALID, key, schedule)  # the schedule is held, so its id names it while it is kept


# ------------------------------------------------------------------ internals


_CACHE_SIZE = 16  # lowered schedules kept (one is a few MB at 128 ranks x 128 micro-batches)
_LOWERED: dict[Any, Schedule] = {}
_VALID: dict[Any, Schedule] = {}
_RAN: dict[Any, Schedule] = {}  # schedules dry-run without a deadlock, by topology


def _run_key(schedule: Schedule, sends_to: Sequence[Sequence[int]], receives_from: Sequence[Sequence[int]],
             stage_rank: Sequence[int] | None) -> tuple[Any, ...]:
    """A schedule object and a topology (the schedule is held where this keys it, so its id names it)."""
    return id(schedule), _tupled(sends_to), _tupled(receives_from), None if stage_rank is None else tuple(stage_rank)


def _tupled(rows: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in rows)


def _remember(cache: dict[Any, Schedule], key: Any, value: Schedule) -> None:
    """Keep ``value`` under ``key``, dropping the oldest entry beyond :data:`_CACHE_SIZE`."""
    if len(cache) >= _CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _placement(stage_rank: Sequence[int] | None, stages: int, ranks: int) -> tuple[int, ...]:
    """The rank of every stage, checked against the schedule's rows."""
    where = tuple(range(stages)) if stage_rank is None else tuple(stage_rank)
    if len(where) != stages:
        raise ScheduleError(f"stage_rank names {len(where)} stages but the plan has {stages}.")
    used = max(where, default=-1) + 1
    if used != ranks or any(r < 0 for r in where):
        raise ScheduleError(
            f"The schedule has {ranks} rank rows but the plan puts its {stages} stages on ranks "
            f"{sorted(set(where))}; give one row per pipeline rank 0 .. {max(used, 1) - 1}."
        )
    return where


class _Topology:
    """Which peers of every stage sit on other ranks (messages) or on its own (handed over in memory)."""

    def __init__(self, where: tuple[int, ...], sends_to: Sequence[Sequence[int]],
                 receives_from: Sequence[Sequence[int]]) -> None:
        self.where = where
        n = len(where)
        self.remote_out = [sorted(t for t in sends_to[s] if where[t] != where[s]) for s in range(n)]
        self.remote_in = [sorted(p for p in receives_from[s] if where[p] != where[s]) for s in range(n)]
        self.local_out = [sorted(t for t in sends_to[s] if where[t] == where[s]) for s in range(n)]

    def messages(self, a: Action) -> list[tuple[tuple[int, int], _Message]]:
        """((sending rank, receiving rank), message) of each message communication action ``a`` moves."""
        s, i, w = a.stage, a.microbatch, self.where
        if a.kind == "SF":
            return [((w[s], w[t]), ("F", s, t, i)) for t in self.remote_out[s]]
        if a.kind == "RF":
            return [((w[p], w[s]), ("F", p, s, i)) for p in self.remote_in[s]]
        if a.kind == "SB":
            return [((w[s], w[p]), ("B", s, p, i)) for p in self.remote_in[s]]
        if a.kind == "RB":
            return [((w[t], w[s]), ("B", t, s, i)) for t in self.remote_out[s]]
        return []


# Per (sending rank, receiving rank), the messages in the order the sender posts them; and each
# message's place in its pair's order.
_SendOrder = tuple[dict[tuple[int, int], list[_Message]], dict[_Message, int]]


def _send_order(rows: list[list[Action]], topo: _Topology) -> _SendOrder:
    """Every rank's messages in the order it posts them (:data:`_SendOrder`)."""
    sent: dict[tuple[int, int], list[_Message]] = {}
    for other in rows:
        for a in other:
            if a.kind in ("SF", "SB"):
                for pair, message in topo.messages(a):
                    sent.setdefault(pair, []).append(message)
    position = {message: k for messages in sent.values() for k, message in enumerate(messages)}
    return sent, position


def _receive_in_send_order(
    row: list[Action], rows: list[list[Action]], topo: _Topology, order: _SendOrder | None = None,
) -> tuple[Action, ...]:
    """``row`` with each receive moved up, if needed, behind the receives of the messages its peer sends first.

    ``order``: :func:`_send_order` of ``rows``, when the caller has it for every row.
    """
    sent, position = order if order is not None else _send_order(rows, topo)
    holder = {message: a for a in row if a.kind in ("RF", "RB") for _, message in topo.messages(a)}
    out: list[Action] = []
    placed: set[Action] = set()
    # Per peer pair, how many of its first messages are settled: not received in this row, or received
    # by an action already placed.  place() on those does nothing, so the scans below start after them
    # (without this, each receive rescanned every earlier message: quadratic in the micro-batches).
    settled: dict[tuple[int, int], int] = {}

    def place(a: Action, pending: set[Action]) -> None:
        if a in placed or a in pending:  # a cycle of orders: validate names it
            return
        pending.add(a)
        for pair, message in topo.messages(a):
            queue = sent.get(pair, [])
            stop = position.get(message, 0)
            for k in range(settled.get(pair, 0), stop):
                earlier = queue[k]
                if earlier in holder:
                    place(holder[earlier], pending)
            k = settled.get(pair, 0)
            while k < stop and (queue[k] not in holder or holder[queue[k]] in placed):
                k += 1
            settled[pair] = k
        pending.discard(a)
        out.append(a)
        placed.add(a)

    for a in row:
        if a.kind in ("RF", "RB"):
            place(a, set())
        else:
            out.append(a)
    return tuple(out)


def _deadlock(schedule: Schedule, topo: _Topology) -> str | None:
    """Why ``schedule``'s ranks would wait on each other forever, or None."""
    try:
        _dry_run(schedule, topo)
    except ScheduleError as exc:
        return str(exc)
    return None


def _check_row(r: int, row: Sequence[Action], M: int, topo: _Topology, split: bool) -> None:
    seen: dict[tuple[int, str, int], int] = {}
    n = len(topo.where)
    for position, a in enumerate(row):
        if not 0 <= a.stage < n:
            raise ScheduleError(f"Action {a} in rank {r}'s list names stage {a.stage}; the plan has {n} stages.")
        if topo.where[a.stage] != r:
            raise ScheduleError(f"Action {a} is in rank {r}'s list but stage {a.stage} is on rank {topo.where[a.stage]}.")
        if not 0 <= a.microbatch < M:
            raise ScheduleError(f"Action {a} names micro-batch {a.microbatch}; there are {M}.")
        if (a.stage, a.kind, a.microbatch) in seen:
            raise ScheduleError(f"Action {a} appears twice in rank {r}'s list.")
        seen[a.stage, a.kind, a.microbatch] = position
    held = [s for s in range(n) if topo.where[s] == r]
    present = {(t, k) for t, k, _ in seen}
    for s in held:
        sends, receives = bool(topo.remote_out[s]), bool(topo.remote_in[s])
        needed = ["F", "B"] + (["W"] if split else []) + (["SF", "RB"] if sends else []) + (
            ["RF", "SB"] if receives else [])
        for kind in ("SF", "RB", "RF", "SB"):
            if kind not in needed and (s, kind) in present:
                raise ScheduleError(f"Stage {s} has a {kind} action but no peer on another rank for it.")
        for i in range(M):
            for kind in needed:
                if (s, kind, i) not in seen:
                    raise ScheduleError(f"Stage {s} never runs {s}{kind}{i}.")
    for s in held:
        for i in range(M):
            for first, then in _BEFORE:
                if (s, first, i) in seen and (s, then, i) in seen and seen[s, first, i] > seen[s, then, i]:
                    raise ScheduleError(f"Stage {s} runs {s}{then}{i} before {s}{first}{i}.")
            for t in topo.local_out[s]:  # handed over in memory: the order in the row is the dependency
                if seen[s, "F", i] > seen[t, "F", i]:
                    raise ScheduleError(
                        f"Rank {r} runs {t}F{i} before {s}F{i}, whose output it takes in memory; "
                        f"put {s}F{i} first.")
                if seen[t, "B", i] > seen[s, "B", i]:
                    raise ScheduleError(
                        f"Rank {r} runs {s}B{i} before {t}B{i}, whose input gradient it needs; "
                        f"put {t}B{i} first.")


def _dry_run(schedule: Schedule, topo: _Topology) -> None:
    """Execute the lists with blocking receives and non-blocking sends; fail on a deadlock."""
    done: set[tuple[int, str, int]] = set()  # the sends posted (all a receive waits for: _waiting_for)
    cursor = [0] * schedule.ranks
    rows = schedule.actions
    remote_in, remote_out = topo.remote_in, topo.remote_out
    while True:
        progressed = False
        for r, row in enumerate(rows):
            c, end = cursor[r], len(row)
            while c < end:
                a = row[c]
                kind = a.kind
                if kind == "RF":
                    if any((p, "SF", a.microbatch) not in done for p in remote_in[a.stage]):
                        break
                elif kind == "RB":
                    if any((t, "SB", a.microbatch) not in done for t in remote_out[a.stage]):
                        break
                elif kind in ("SF", "SB"):
                    done.add((a.stage, kind, a.microbatch))
                c += 1
            if c != cursor[r]:
                cursor[r] = c
                progressed = True
        if all(cursor[r] == len(rows[r]) for r in range(len(rows))):
            return
        if not progressed:
            stuck = "; ".join(
                f"rank {r} waits at {rows[r][cursor[r]]} (after {' '.join(str(a) for a in rows[r][max(0, cursor[r] - 3):cursor[r]]) or 'nothing'})"
                for r in range(len(rows))
                if cursor[r] < len(rows[r])
            )
            raise ScheduleError(f"The schedule deadlocks: {stuck}.{_wait_cycle(rows, cursor, done, topo)}")


def _waiting_for(a: Action, topo: _Topology, done: set[tuple[int, str, int]]) -> list[Action]:
    """The peer sends receive ``a`` still needs (empty for any other action)."""
    if a.kind == "RF":
        return [Action(p, "SF", a.microbatch) for p in topo.remote_in[a.stage] if (p, "SF", a.microbatch) not in done]
    if a.kind == "RB":
        return [Action(t, "SB", a.microbatch) for t in topo.remote_out[a.stage] if (t, "SB", a.microbatch) not in done]
    return []


def _wait_cycle(
    rows: Sequence[Sequence[Action]],
    cursor: Sequence[int],
    done: set[tuple[int, str, int]],
    topo: _Topology,
) -> str:
    """The cycle in the wait-for graph of stuck receives, as a sentence (empty if there is none).

    An edge joins a stuck receive to the action its peer's rank is stuck at,
    labelled with the send the receive needs from that peer.
    """
    waits = nx.DiGraph()
    for r, row in enumerate(rows):
        if cursor[r] == len(row):
            continue
        a = row[cursor[r]]  # a receive: nothing else blocks
        for send in _waiting_for(a, topo, done):
            peer = topo.where[send.stage]
            if cursor[peer] < len(rows[peer]):
                waits.add_edge(a, rows[peer][cursor[peer]], needs=send)
    try:
        cycle = nx.find_cycle(waits)
    except nx.NetworkXNoCycle:
        return ""
    steps = ", ".join(
        f"{u} needs {waits.edges[u, v]['needs']} but rank {topo.where[v.stage]} is stuck at {v}" for u, v in cycle
    )
    return f" Wait cycle: {steps}."
