"""Schedules as data: action syntax, GPipe and 1F1B orders, lowering, validation and deadlocks.

The chunked and split-backward kinds (interleaved 1F1B, ZB-H1, ZB-V) are in test_schedule_kinds.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from partitioner.defaults import SCHEDULES
from partitioner.errors import ScheduleError
from partitioner.orders import Action, Schedule, parse_actions
from partitioner.schedule.lower import compute_order, lower, validate

PLAIN = ("gpipe", "1f1b")  # one stage per rank, whole backward: the kinds this file covers
CHAIN2: dict[str, Any] = {"sends_to": ((1,), ()), "receives_from": ((), (0,))}
# Stage 0 feeds stages 1 and 2 (a skip connection); stage 1 feeds stage 2.
SKIP3: dict[str, Any] = {"sends_to": ((1, 2), (2,), ()), "receives_from": ((), (0,), (0, 1))}


def _chain(stages: int) -> dict[str, Any]:
    return {
        "sends_to": tuple((s + 1,) if s + 1 < stages else () for s in range(stages)),
        "receives_from": tuple((s - 1,) if s else () for s in range(stages)),
    }


def _rows(*rows: str) -> tuple[tuple[Action, ...], ...]:
    return tuple(parse_actions(row.split()) for row in rows)


# ----------------------------------------------------------------- actions


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("0F3", Action(0, "F", 3)),
        ("12RB7", Action(12, "RB", 7)),
        ("1B0", Action(1, "B", 0)),
        ("3SF10", Action(3, "SF", 10)),
        ("0RF0", Action(0, "RF", 0)),
        ("7SB2", Action(7, "SB", 2)),
        ("0W3", Action(0, "W", 3)),
        ("11W0", Action(11, "W", 0)),
    ],
)
def test_action_parse_and_format_round_trip(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text
    assert Action.parse(str(action)) == action


def test_action_parse_strips_spaces() -> None:
    assert Action.parse(" 2F1\n") == Action(2, "F", 1)


@pytest.mark.parametrize(
    "text", ["", "F3", "0X3", "0F", "-1F0", "0f3", "0F3a", "0 F3", "0FB3", "a0F3", "0F-1", "0w3", "0WB3", "0SW1"]
)
def test_bad_action_strings(text: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Action.parse(text)
    message = str(info.value)
    assert repr(text) in message
    assert "'0F3'" in message  # shows the expected form
    assert "W" in message  # and lists the weight-gradient kind


def test_schedule_strings_round_trip() -> None:
    rows = [["0F0", "0SF0", "0RB0", "0B0"], ["1RF0", "1F0", "1B0", "1SB0"]]
    schedule = Schedule.from_strings("gpipe", 1, rows)
    assert schedule.ranks == 2
    assert schedule.to_strings() == rows
    assert schedule.format() == "rank 0: 0F0 0SF0 0RB0 0B0\nrank 1: 1RF0 1F0 1B0 1SB0"
    with pytest.raises(ScheduleError):
        Schedule.from_strings("gpipe", 1, [["0F0", "oops"]])


def test_older_spelling_of_the_rank_count() -> None:
    # ``stages=`` (one stage per rank) gives the same order as ``ranks=``.
    assert compute_order("1f1b", stages=3, microbatches=4) == compute_order("1f1b", ranks=3, microbatches=4)
    with pytest.raises(ScheduleError, match="ranks="):
        compute_order("1f1b", microbatches=4)


def test_docstring_example() -> None:
    order = compute_order("1f1b", ranks=2, microbatches=3)
    sched = lower(order, **CHAIN2)
    assert sched.format() == (
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0F2 0SF2 0RB1 0B1 0RB2 0B2\n"
        "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1RF2 1F2 1B2 1SB2"
    )
    validate(sched, **CHAIN2)


# ----------------------------------------------------------------- compute orders


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (1, 4), (3, 1), (4, 4), (4, 8), (5, 3)])
def test_gpipe_order(stages: int, microbatches: int) -> None:
    order = compute_order("gpipe", ranks=stages, microbatches=microbatches)
    assert len(order) == stages
    for s, row in enumerate(order):
        assert [str(a) for a in row] == [f"{s}F{i}" for i in range(microbatches)] + [
            f"{s}B{i}" for i in range(microbatches)
        ]


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (2, 2), (4, 4), (4, 8), (4, 2), (6, 3), (3, 12)])
def test_1f1b_order(stages: int, microbatches: int) -> None:
    order = compute_order("1f1b", ranks=stages, microbatches=microbatches)
    for s, row in enumerate(order):
        forwards = [a.microbatch for a in row if a.kind == "F"]
        backwards = [a.microbatch for a in row if a.kind == "B"]
        assert forwards == list(range(microbatches))
        assert backwards == list(range(microbatches))
        in_flight, peak = 0, 0
        for a in row:
            in_flight += 1 if a.kind == "F" else -1
            assert 0 <= in_flight <= stages - s, (s, [str(x) for x in row])
            peak = max(peak, in_flight)
        assert peak == min(stages - s, microbatches)
        warmup = min(stages - s - 1, microbatches)
        assert [a.kind for a in row[:warmup]] == ["F"] * warmup
        # After the warm-up the stage alternates one forward, one backward.
        steady = row[warmup: warmup + 2 * (microbatches - warmup)]
        assert [a.kind for a in steady] == ["F", "B"] * (microbatches - warmup)


def test_1f1b_last_stage_runs_backward_right_after_forward() -> None:
    order = compute_order("1f1b", ranks=4, microbatches=4)
    assert [str(a) for a in order[3]] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3"]
    assert [str(a) for a in order[0]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"]


def test_bad_orders() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
    with pytest.raises(ScheduleError, match="Unknown schedule 'pipedream'"):
        compute_order("pipedream", ranks=2, microbatches=2)
    with pytest.raises(ScheduleError, match="at least one"):
        compute_order("gpipe", ranks=0, microbatches=2)
    with pytest.raises(ScheduleError, match="at least one"):
        compute_order("1f1b", ranks=2, microbatches=0)


# ----------------------------------------------------------------- lowering


@pytest.mark.parametrize("kind", PLAIN)
def test_lower_skip_topology(kind: str) -> None:
    order = compute_order(kind, ranks=3, microbatches=4)
    sched = lower(order, kind=kind, **SKIP3)
    assert sched.kind == kind and sched.microbatches == 4
    validate(sched, **SKIP3)
    first, middle, last = ([str(a) for a in row] for row in sched.actions)
    for i in range(4):
        # Stage 0 sends once per micro-batch (to stages 1 and 2), receives gradients before backward.
        assert first.index(f"0F{i}") + 1 == first.index(f"0SF{i}")
        assert first.index(f"0RB{i}") + 1 == first.index(f"0B{i}")
        assert f"0RF{i}" not in first and f"0SB{i}" not in first
        # The middle stage both receives and sends.
        assert middle.index(f"1RF{i}") + 1 == middle.index(f"1F{i}") == middle.index(f"1SF{i}") - 1
        assert middle.index(f"1RB{i}") + 1 == middle.index(f"1B{i}") == middle.index(f"1SB{i}") - 1
        # The last stage receives (from 0 and 1), never sends activations.
        assert last.index(f"2RF{i}") + 1 == last.index(f"2F{i}")
        assert last.index(f"2B{i}") + 1 == last.index(f"2SB{i}")
        assert f"2SF{i}" not in last and f"2RB{i}" not in last
    assert len(first) == 4 * 4 and len(middle) == 6 * 4 and len(last) == 4 * 4


def test_lower_keeps_existing_comm_actions() -> None:
    order = [[Action(0, "F", 0), Action(0, "B", 0)]]
    sched = lower(order, sends_to=((),), receives_from=((),))
    assert sched.to_strings() == [["0F0", "0B0"]]


def test_skip_topology_receiver_waits_for_every_sender() -> None:
    # Stage 2 receives micro-batch 0 only after stage 1 has sent it, so a stage-2 list that
    # expects stage 1's send which stage 1 never reaches deadlocks.
    rows = _rows(
        "0F0 0SF0 0RB0 0B0",
        "1RB0 1RF0 1F0 1SF0 1B0 1SB0",  # waits for a gradient before computing the forward
        "2RF0 2F0 2B0 2SB0",
    )
    with pytest.raises(ScheduleError) as info:
        validate(Schedule("gpipe", 1, rows), **SKIP3)
    message = str(info.value)
    assert "deadlock" in message
    assert "1RB0" in message and "2RF0" in message


# ----------------------------------------------------------------- validation


@pytest.mark.parametrize("kind", PLAIN)
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 3), (2, 1), (4, 8), (3, 2)])
def test_generated_schedules_validate(kind: str, stages: int, microbatches: int) -> None:
    topology = _chain(stages)
    sched = lower(compute_order(kind, ranks=stages, microbatches=microbatches), kind=kind, **topology)
    validate(sched, **topology)


def _gpipe2() -> list[list[str]]:
    sched = lower(compute_order("gpipe", ranks=2, microbatches=3), **CHAIN2)
    return sched.to_strings()


def test_validate_catches_missing_action() -> None:
    rows = _gpipe2()
    rows[1].remove("1B2")
    with pytest.raises(ScheduleError, match="Stage 1 never runs 1B2"):
        validate(Schedule.from_strings("gpipe", 3, rows), **CHAIN2)
    rows = _gpipe2()
    rows[0].remove("0SF1")
    with pytest.raises(ScheduleError, match="never runs 0SF1"):
        validate(Schedule.from_strings("gpipe", 3, rows), **CHAIN2)


def test_validate_catches_duplicate() -> None:
    rows = _gpipe2()
    rows[0].insert(3, "0F0")
    with pytest.raises(ScheduleError, match="0F0 appears twice"):
        validate(Schedule.from_strings("gpipe", 3, rows), **CHAIN2)


def test_validate_catches_backward_before_forward() -> None:
    rows = [["0B1", "0F0", "0F1", "0B0"]]
    with pytest.raises(ScheduleError, match="runs 0B1 before 0F1"):
        validate(Schedule.from_strings("gpipe", 2, rows), sends_to=((),), receives_from=((),))
    rows = _gpipe2()
    i, j = rows[1].index("1RF0"), rows[1].index("1F0")
    rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
    with pytest.raises(ScheduleError, match="runs 1F0 before 1RF0"):
        validate(Schedule.from_strings("gpipe", 3, rows), **CHAIN2)


def test_validate_catches_other_mistakes() -> None:
    with pytest.raises(ScheduleError, match="names stage 1"):
        validate(Schedule.from_strings("gpipe", 1, [["0F0", "1B0"]]), sends_to=((),), receives_from=((),))
    with pytest.raises(ScheduleError, match="micro-batch 5"):
        validate(Schedule.from_strings("gpipe", 1, [["0F0", "0B0", "0F5"]]),
                 sends_to=((),), receives_from=((),))
    with pytest.raises(ScheduleError, match="no peer"):
        validate(Schedule.from_strings("gpipe", 1, [["0RF0", "0F0", "0B0"]]),
                 sends_to=((),), receives_from=((),))
    with pytest.raises(ScheduleError, match="1 rank rows but the plan puts its 2 stages on ranks"):
        validate(Schedule.from_strings("gpipe", 1, [["0F0", "0B0"]]), **CHAIN2)


def test_validate_catches_deadlock() -> None:
    # Each list is complete and ordered, but stage 0 waits for a gradient of micro-batch 0
    # before sending micro-batch 1, while stage 1 waits for micro-batch 1 before any backward.
    rows = _rows(
        "0F0 0SF0 0F1 0RB0 0B0 0SF1 0RB1 0B1",
        "1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1",
    )
    with pytest.raises(ScheduleError) as info:
        validate(Schedule("gpipe", 2, rows), **CHAIN2)
    message = str(info.value)
    assert "deadlocks" in message
    assert "rank 0 waits at 0RB0" in message
    assert "rank 1 waits at 1RF1" in message
    assert "0F1" in message  # the actions just before the stuck one, for context
    # The wait-for cycle (nx.find_cycle): each stuck receive, the send it needs, where that peer is.
    cycle = message.split("Wait cycle: ", 1)[1]
    assert "0RB0 needs 1SB0 but rank 1 is stuck at 1RF1" in cycle
    assert "1RF1 needs 0SF1 but rank 0 is stuck at 0RB0" in cycle


def test_validate_catches_three_stage_cycle() -> None:
    rows = _rows(
        "0F0 0SF0 0RB0 0B0",
        "1RF0 1F0 1SF0 1RB0 1B0 1SB0",
        "2RF0 2F0 2B0 2SB0",
    )
    validate(Schedule("gpipe", 1, rows), **_chain(3))  # fine as is
    stuck = _rows(
        "0RB0 0F0 0SF0 0B0",  # waits for a gradient before its first forward
        "1RF0 1F0 1SF0 1RB0 1B0 1SB0",
        "2RF0 2F0 2B0 2SB0",
    )
    with pytest.raises(ScheduleError) as info:
        validate(Schedule("gpipe", 1, stuck), **_chain(3))
    message = str(info.value)
    assert "0RB0" in message and "1RF0" in message and "2RF0" in message
    # Stage 2 waits on stage 1 but is not part of the 0 <-> 1 cycle.
    cycle = message.split("Wait cycle: ", 1)[1]
    assert "0RB0 needs 1SB0 but rank 1 is stuck at 1RF0" in cycle
    assert "1RF0 needs 0SF0 but rank 0 is stuck at 0RB0" in cycle
    assert "2RF0" not in cycle
