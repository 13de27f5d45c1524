"""Chunked and split-backward schedules: interleaved 1F1B, ZB-H1 and ZB-V.

Orders, placement, lowering, validation (deadlocks, receive order, in-memory
handoffs) and the simulator against hand-computed step times and memory.
"""

from __future__ import annotations

from typing import Any

import pytest

from partitioner.defaults import SCHEDULES, schedule_chunks, splits_backward
from partitioner.errors import ScheduleError
from partitioner.orders import Action, Schedule, parse_actions, peak_activations, stage_ranks
from partitioner.schedule.lower import compute_order, lower, validate
from partitioner.schedule.simulate import Simulation, simulate_schedule

# (kind, chunks) for every kind and the chunk counts it takes.
VARIANTS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", 1), ("zbv", 2)]


def _chain(stages: int) -> dict[str, Any]:
    return {
        "sends_to": tuple((s + 1,) if s + 1 < stages else () for s in range(stages)),
        "receives_from": tuple((s - 1,) if s else () for s in range(stages)),
    }


def _lowered(kind: str, ranks: int, microbatches: int, chunks: int) -> tuple[Schedule, dict[str, Any]]:
    """The schedule on a chain of ``ranks x chunks`` stages, and the keywords that describe its topology."""
    topology = dict(_chain(ranks * chunks), stage_rank=stage_ranks(kind, ranks=ranks, chunks=chunks))
    order = compute_order(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    return lower(order, kind=kind, **topology), topology


def _simulate(kind: str, ranks: int, microbatches: int, chunks: int, *, f: float, b: float, w: float = 0.0,
              transfer: float = 0.0) -> Simulation:
    """Equal stages: a model whose whole stage (on one rank of 1F1B) takes f, b (w of it the weight gradient).

    With v chunks, each chunk holds 1/v of that: f/v, b/v, w/v, and 1/v of its activations.
    """
    sched, topology = _lowered(kind, ranks, microbatches, chunks)
    n = ranks * chunks
    return simulate_schedule(
        sched, forward_s=[f / chunks] * n, backward_s=[b / chunks] * n, weight_s=[w / chunks] * n,
        activation_bytes=[1.0 / chunks] * n, transfer_s=transfer, **topology,
    )


def _rows(*rows: str) -> tuple[tuple[Action, ...], ...]:
    return tuple(parse_actions(row.split()) for row in rows)


def _strings(order: list[list[Action]]) -> list[str]:
    return [" ".join(map(str, row)) for row in order]


# ----------------------------------------------------------------- names, chunks, placement


def test_kinds_and_what_they_need() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
    assert [k for k in SCHEDULES if splits_backward(k)] == ["zb-h1", "zbv"]
    assert [schedule_chunks(k) for k in SCHEDULES] == [1, 1, 2, 1, 2]
    assert schedule_chunks("interleaved-1f1b", 5) == 5
    with pytest.raises(ScheduleError, match="at least 2 stages per pipeline rank, not chunks=1"):
        schedule_chunks("interleaved-1f1b", 1)
    with pytest.raises(ScheduleError, match="exactly 2 stages per pipeline rank"):
        schedule_chunks("zbv", 4)
    with pytest.raises(ScheduleError, match="exactly 1 stage per pipeline rank, not chunks=2"):
        schedule_chunks("zb-h1", 2)
    with pytest.raises(ScheduleError, match="Unknown schedule 'dualpipe'"):
        schedule_chunks("dualpipe")


def test_stage_ranks() -> None:
    assert stage_ranks("gpipe", ranks=3, chunks=1) == (0, 1, 2)
    assert stage_ranks("zb-h1", ranks=2, chunks=1) == (0, 1)
    assert stage_ranks("interleaved-1f1b", ranks=2, chunks=3) == (0, 1, 0, 1, 0, 1)
    assert stage_ranks("zbv", ranks=4, chunks=2) == (0, 1, 2, 3, 3, 2, 1, 0)  # rank r: r and 2P - 1 - r
    with pytest.raises(ScheduleError, match="at least one pipeline rank"):
        stage_ranks("1f1b", ranks=0, chunks=1)


def test_interleaved_needs_whole_rounds() -> None:
    with pytest.raises(ScheduleError, match=r"multiple of 4 micro-batches, not 6: use 4, 8, 12"):
        compute_order("interleaved-1f1b", ranks=4, microbatches=6, chunks=2)
    with pytest.raises(ScheduleError, match="at least 2 stages"):
        compute_order("interleaved-1f1b", ranks=2, microbatches=4, chunks=1)


# ----------------------------------------------------------------- orders (printed for P = 2 and 4)


def test_interleaved_order_p2() -> None:
    # Rank r holds stages r and r + 2.  Rounds of 2 micro-batches go through chunk 0, then chunk 1;
    # rank 0 warms up with (v - 1) P + 2 (P - 1) = 4 forwards, rank 1 with 2, then one F, one B.
    assert _strings(compute_order("interleaved-1f1b", ranks=2, microbatches=4, chunks=2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_zb_h1_order_p4() -> None:
    # 1F1B's F/B pattern; stage s runs its first W s micro-batches late, the rest trail the cool-down.
    assert _strings(compute_order("zb-h1", ranks=4, microbatches=6)) == [
        "0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0B3 0W3 0B4 0W4 0B5 0W5",
        "1F0 1F1 1F2 1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1B4 1W3 1B5 1W4 1W5",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2B5 2W3 2W4 2W5",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3W3 3W4 3W5",
    ]


def test_zbv_order_p2() -> None:
    # Rank 0: stages 0 and 3; rank 1: stages 1 and 2 (the bottom of the V).
    assert _strings(compute_order("zbv", ranks=2, microbatches=4, chunks=2)) == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3",
        "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3",
    ]


def test_zbv_with_few_microbatches_leaves_the_missing_ones_out() -> None:
    # Built for 2P - 1 = 3 micro-batches; with 1, only micro-batch 0's actions remain, in the same order.
    full = compute_order("zbv", ranks=2, microbatches=3, chunks=2)
    one = compute_order("zbv", ranks=2, microbatches=1, chunks=2)
    assert one == [[a for a in row if a.microbatch == 0] for row in full]


@pytest.mark.parametrize(("kind", "chunks"), VARIANTS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_stage_runs_everything_once_in_order(kind: str, chunks: int, ranks: int) -> None:
    microbatches = 2 * ranks
    where = stage_ranks(kind, ranks=ranks, chunks=chunks)
    order = compute_order(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    kinds = ("F", "B", "W") if splits_backward(kind) else ("F", "B")
    for r, row in enumerate(order):
        assert {a.stage for a in row} == {s for s, x in enumerate(where) if x == r}
        for s in {a.stage for a in row}:
            for k in kinds:  # each stage runs its micro-batches in ascending order
                assert [a.microbatch for a in row if a.stage == s and a.kind == k] == list(range(microbatches))


# ----------------------------------------------------------------- lowering and validation


@pytest.mark.parametrize(("kind", "chunks"), VARIANTS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_kind_validates(kind: str, chunks: int, ranks: int) -> None:
    for microbatches in range(1, 9):
        if kind == "interleaved-1f1b" and microbatches % ranks:
            continue
        sched, topology = _lowered(kind, ranks, microbatches, chunks)
        validate(sched, **topology)
        assert sched.splits_backward == splits_backward(kind)
        assert Schedule.from_strings(kind, microbatches, sched.to_strings()) == sched  # prints and parses back


def test_same_rank_boundaries_need_no_messages() -> None:
    sched, _ = _lowered("zbv", 2, 3, 2)
    rows = sched.to_strings()
    # Stage 1 feeds stage 2 on rank 1: no 1SF / 2RF, no 2SB / 1RB; stage 3 (rank 0) takes 2's output.
    assert not any(a.startswith(("1SF", "2RF", "2SB", "1RB")) for a in rows[1])
    assert "3RF0" in rows[0] and "2SF0" in rows[1]
    # The input gradient leaves with B, before the W.
    assert rows[0].index("3B0") + 1 == rows[0].index("3SB0") < rows[0].index("3W0")
    assert not any("W" in a and a[a.index("W") - 1] in "SR" for row in rows for a in row)


def test_same_rank_skip_connection_is_handed_over() -> None:
    # Stage 0 also feeds stage 3: both on rank 0 in the V, so in memory.
    topology: dict[str, Any] = {"sends_to": ((1, 3), (2,), (3,), ()), "receives_from": ((), (0,), (1,), (0, 2)),
                "stage_rank": stage_ranks("zbv", ranks=2, chunks=2)}
    sched = lower(compute_order("zbv", ranks=2, microbatches=4, chunks=2), **topology)
    validate(sched, **topology)
    assert sched.to_strings() == _lowered("zbv", 2, 4, 2)[0].to_strings()


def test_receives_follow_the_peers_send_order() -> None:
    # In the V, rank 0 sends rank 1 both activations (0 -> 1) and gradients (3 -> 2); rank 1
    # receives each pair's messages in the order they were sent.
    sched, _ = _lowered("zbv", 2, 3, 2)
    rows = sched.to_strings()
    sent = [a for a in rows[0] if a.startswith(("0SF", "3SB"))]
    received = [a for a in rows[1] if a.startswith(("1RF", "2RB"))]
    assert [a[1:].replace("SF", "F").replace("SB", "B") for a in sent] == [
        a[1:].replace("RF", "F").replace("RB", "B") for a in received]
    assert rows[1].index("1RF2") < rows[1].index("2RB0")  # moved up: 0SF2 is sent before 3SB0


def test_broken_interleaved_schedule_deadlocks() -> None:
    # Rank 0 waits for stage 1's activations (stage 2's input) before sending its own first one.
    sched, topology = _lowered("interleaved-1f1b", 2, 2, 2)
    rows = sched.to_strings()
    rows[0] = ["2RF0", "2F0", "2SF0"] + [a for a in rows[0] if a not in ("2RF0", "2F0", "2SF0")]
    with pytest.raises(ScheduleError) as info:
        validate(Schedule.from_strings("interleaved-1f1b", 2, rows), **topology)
    message = str(info.value)
    assert "deadlocks" in message
    assert "rank 0 waits at 2RF0 (after nothing)" in message and "rank 1 waits at 1RF0" in message
    cycle = message.split("Wait cycle: ", 1)[1]
    assert "2RF0 needs 1SF0 but rank 1 is stuck at 1RF0" in cycle
    assert "1RF0 needs 0SF0 but rank 0 is stuck at 2RF0" in cycle


def test_receives_in_another_order_than_sent_are_valid() -> None:
    # Two stages: rank 1 takes micro-batch 1's activations before micro-batch 0's.  NCCL pairs
    # messages by order, and the runtime posts rank 1's receives in rank 0's send order (it waits
    # for 1RF1's message at 1RF1): nothing is paired wrongly and nothing waits forever.
    rows = _rows("0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1", "1RF1 1RF0 1F0 1F1 1B0 1SB0 1B1 1SB1")
    validate(Schedule("gpipe", 2, rows), **_chain(2))


def test_v_receive_left_in_place_is_valid() -> None:
    # The V with 1RF2 left before its forward (after 2RB0, whose message rank 0 sends later): valid.
    sched, topology = _lowered("zbv", 2, 3, 2)
    rows = sched.to_strings()
    rows[1].remove("1RF2")
    rows[1].insert(rows[1].index("1F2"), "1RF2")
    validate(Schedule.from_strings("zbv", 3, rows), **topology)


def test_validate_checks_placement_and_weight_gradients() -> None:
    sched, topology = _lowered("zbv", 2, 2, 2)
    rows = sched.to_strings()

    def check(changed: list[list[str]]) -> None:
        validate(Schedule.from_strings("zbv", 2, changed), **topology)

    with pytest.raises(ScheduleError, match="Stage 0 never runs 0W1"):
        check([[a for a in rows[0] if a != "0W1"], rows[1]])
    with pytest.raises(ScheduleError, match="Stage 3 runs 3W0 before 3B0"):
        early = [a for a in rows[0] if a != "3W0"]
        early.insert(early.index("3B0"), "3W0")
        check([early, rows[1]])
    with pytest.raises(ScheduleError, match="Action 1W0 is in rank 0's list but stage 1 is on rank 1"):
        check([rows[0] + ["1W0"], [a for a in rows[1] if a != "1W0"]])
    with pytest.raises(ScheduleError, match=r"Rank 1 runs 2F0 before 1F0, whose output it takes in memory"):
        early = [a for a in rows[1] if a != "2F0"]
        check([rows[0], ["2F0"] + early])
    with pytest.raises(ScheduleError, match=r"Rank 1 runs 1B0 before 2B0, whose input gradient it needs"):
        check([rows[0], [a for a in rows[1] if a != "2B0"] + ["2B0"]])
    with pytest.raises(ScheduleError, match=r"3 rank rows but the plan puts its 4 stages on ranks \[0, 1\]"):
        check([rows[0], rows[1], []])


# ----------------------------------------------------------------- simulated step times


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 4])
@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_bubble(ranks: int, rounds: int, chunks: int) -> None:
    # Narayanan et al. 2021: the bubble shrinks from (P - 1)(f + b) to (P - 1)(f + b) / v.
    f, b, M = 1.0, 2.0, rounds * ranks
    sim = _simulate("interleaved-1f1b", ranks, M, chunks, f=f, b=b)
    assert sim.step_s == pytest.approx(M * (f + b) + (ranks - 1) * (f + b) / chunks)
    assert sim.busy_s == pytest.approx([M * (f + b)] * ranks)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
@pytest.mark.parametrize(("f", "b", "w"), [(1.0, 2.0, 1.0), (1.0, 3.0, 1.0), (1.0, 2.0, 0.5), (2.0, 3.0, 1.0)])
def test_zb_h1_bubble_is_the_papers(ranks: int, f: float, b: float, w: float) -> None:
    # Qi et al. 2024, ZB-H1: bubble (P - 1)(F + B_input - W) = (P - 1)(f + b - 2w), b the whole backward.
    # With F = B_input = W = 1 (f = 1, b = 2, w = 1): P - 1 against 1F1B's 3(P - 1).
    M = 3 * ranks
    sim = _simulate("zb-h1", ranks, M, 1, f=f, b=b, w=w)
    assert sim.step_s == pytest.approx(M * (f + b) + (ranks - 1) * (f + b - 2 * w))
    plain = _simulate("1f1b", ranks, M, 1, f=f, b=b)
    assert plain.step_s == pytest.approx((M + ranks - 1) * (f + b))


@pytest.mark.parametrize("ranks", [2, 4])
def test_zb_h1_bubble_when_w_outlasts_the_forward(ranks: int) -> None:
    # A deferred W only fills the slot a forward leaves: with W > F the bubble is
    # (P - 1)(F + B_input - min(F, W)) = (P - 1) B_input, above the paper's formula (which assumes W <= F).
    f, b, w, M = 1.0, 4.0, 2.0, 3 * ranks
    sim = _simulate("zb-h1", ranks, M, 1, f=f, b=b, w=w)
    assert sim.step_s == pytest.approx(M * (f + b) + (ranks - 1) * (b - w))


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zbv_is_nearly_bubble_free(ranks: int, extra: int) -> None:
    # F = B_input = W on every chunk (f = 1, b = 2, w = 1 per rank; each of the 2 chunks half of it).
    # From M = 2P - 1 on, no rank idles between its first action and the step's end: the only bubble is
    # rank P - 1 starting (P - 1) chunk forwards late, (P - 1) f / 2, against 1F1B's 3 (P - 1) f.
    M = 2 * ranks - 1 + extra
    sim = _simulate("zbv", ranks, M, 2, f=1.0, b=2.0, w=1.0)
    assert sim.busy_s == pytest.approx([3.0 * M] * ranks)
    assert sim.step_s == pytest.approx(3.0 * M + (ranks - 1) * 0.5)
    assert sim.bubble_fraction < 0.1


def test_transfers_delay_but_never_deadlock() -> None:
    for kind, chunks in VARIANTS:
        slow = _simulate(kind, 3, 6, chunks, f=1.0, b=2.0, w=1.0 if splits_backward(kind) else 0.0, transfer=0.3)
        fast = _simulate(kind, 3, 6, chunks, f=1.0, b=2.0, w=1.0 if splits_backward(kind) else 0.0)
        assert slow.step_s > fast.step_s


# ----------------------------------------------------------------- memory


def _in_flight_before_backward(row: list[Action]) -> int:
    """Most micro-batches a rank has run F but not yet B for."""
    count = peak = 0
    for a in row:
        count += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, count)
    return peak


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8])
def test_zb_h1_memory_is_1f1bs(ranks: int, microbatches: int) -> None:
    zb = _simulate("zb-h1", ranks, microbatches, 1, f=1.0, b=2.0, w=1.0)
    plain = _simulate("1f1b", ranks, microbatches, 1, f=1.0, b=2.0)
    assert list(plain.peak_in_flight) == [min(microbatches, ranks - s) for s in range(ranks)]
    # Activations are held until W: every rank holds up to 1F1B's peak (stage 0's), never more.
    assert list(zb.peak_in_flight) == [min(microbatches, ranks)] * ranks
    assert max(zb.peak_memory_bytes) == pytest.approx(max(plain.peak_memory_bytes))
    # Between F and B, 1F1B's own limit: P - s micro-batches.
    order = compute_order("zb-h1", ranks=ranks, microbatches=microbatches)
    assert [_in_flight_before_backward(row) for row in order] == list(plain.peak_in_flight)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_memory(ranks: int, chunks: int, rounds: int) -> None:
    # Rank r holds its warm-up forwards plus one: (v - 1) P + 2 (P - 1 - r) + 1 chunk micro-batches
    # (Narayanan et al. 2021; Megatron-LM's warm-up), each 1/v of a stage's activations.
    M = rounds * ranks
    sim = _simulate("interleaved-1f1b", ranks, M, chunks, f=1.0, b=2.0)
    expected = [min(M * chunks, (chunks - 1) * ranks + 2 * (ranks - 1 - r) + 1) for r in range(ranks)]
    assert list(sim.peak_in_flight) == expected
    assert list(sim.peak_memory_bytes) == pytest.approx([n / chunks for n in expected])


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7, 8])
def test_zbv_memory_at_most_1f1bs(ranks: int, microbatches: int) -> None:
    # At most 2P chunk activations, each half a 1F1B stage's: 1F1B's peak of P stage activations.
    sim = _simulate("zbv", ranks, microbatches, 2, f=1.0, b=2.0, w=1.0)
    plain = _simulate("1f1b", ranks, microbatches, 1, f=1.0, b=2.0)
    assert max(sim.peak_in_flight) <= 2 * ranks
    assert max(sim.peak_memory_bytes) <= max(plain.peak_memory_bytes) + 1e-12
    if microbatches >= 2 * ranks - 1:
        assert list(sim.peak_in_flight) == [2 * ranks] * ranks
    for points in sim.memory:  # everything freed by the end
        assert points[-1][1] == pytest.approx(0.0)


@pytest.mark.parametrize(("kind", "chunks"), VARIANTS)
def test_peak_activations_from_the_order_match_the_simulation(kind: str, chunks: int) -> None:
    # The solver's memory term, from the order alone, equals the simulated peak for any stage sizes.
    for ranks, microbatches in [(1, 3), (2, 4), (3, 6), (4, 8), (4, 4)]:
        nbytes = [1.0 + 0.37 * s for s in range(ranks * chunks)]
        sched, topology = _lowered(kind, ranks, microbatches, chunks)
        n = ranks * chunks
        sim = simulate_schedule(sched, forward_s=[1.0] * n, backward_s=[2.0] * n, weight_s=[0.5] * n,
                                activation_bytes=nbytes, **topology)
        expected = peak_activations(kind, ranks=ranks, microbatches=microbatches, chunks=chunks,
                                    activation_bytes=nbytes)
        assert sim.peak_memory_bytes == pytest.approx(expected)
        counts = peak_activations(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
        assert sim.peak_in_flight == pytest.approx(counts)


# ----------------------------------------------------------------- the simulator's W


def test_w_takes_its_share_of_the_backward() -> None:
    sched, topology = _lowered("zb-h1", 1, 2, 1)
    sim = simulate_schedule(sched, forward_s=[1.0], backward_s=[3.0], weight_s=[1.0], static_bytes=[10.0],
                            activation_bytes=[5.0], allreduce_s=[2.0], **topology)
    spans = {e.action: (e.start_s, e.end_s) for e in sim.events}
    # 0F0 0B0 0W0 0F1 0B1 0W1: B is 2 s (input gradient), W 1 s.
    assert spans["0B0"] == (1.0, 3.0) and spans["0W0"] == (3.0, 4.0)
    assert spans["0AR0"] == (8.0, 10.0)  # after the last W, which makes the last weight gradients
    assert sim.step_s == 10.0
    # Activations held from F to W: 10 + 5 while one micro-batch is in flight.
    assert sim.memory[0][:3] == ((0.0, 10.0), (0.0, 15.0), (4.0, 10.0))
    with pytest.raises(ValueError, match="weight_s"):
        simulate_schedule(sched, forward_s=[1.0], backward_s=[1.0], weight_s=[2.0], **topology)


def test_a_rank_holds_both_its_stages() -> None:
    # Two stages per rank: static bytes add up; the in-memory handoff between stages 1 and 2
    # costs nothing however slow the (unused) transfer between them is priced.
    sched, topology = _lowered("zbv", 2, 3, 2)
    seconds = [[0.0, 0.25, 0.0, 0.0], [0.0, 0.0, 100.0, 0.0], [0.0, 0.0, 0.0, 0.25], [0.0] * 4]
    sim = simulate_schedule(sched, forward_s=[1.0] * 4, backward_s=[2.0] * 4, weight_s=[1.0] * 4,
                            static_bytes=[1.0, 2.0, 4.0, 8.0], transfer_s=seconds, **topology)
    assert [points[0][1] for points in sim.memory] == [9.0, 6.0]
    assert sim.step_s < 30.0
    assert {e.track for e in sim.events} == {0, 1}
    assert sim.ranks == sim.stages == 2
