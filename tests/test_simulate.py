"""The simulator against closed forms and hand-computed timelines."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from partitioner.cost.comm import Link
from partitioner.errors import ScheduleError
from partitioner.orders import Schedule, parse_actions
from partitioner.plan import Boundary, Plan, example_plan
from partitioner.schedule.lower import compute_order, lower
from partitioner.schedule.simulate import (
    allreduce_buckets,
    boundary_seconds,
    bucket_count,
    chain_topology,
    message_seconds,
    plan_links,
    simulate,
    simulate_schedule,
    stage_static_bytes,
    transfer_matrix,
)

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 8), (5, 2), (8, 16)]


def _chain(stages: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    sends_to = tuple((s + 1,) if s + 1 < stages else () for s in range(stages))
    receives_from = tuple((s - 1,) if s else () for s in range(stages))
    return sends_to, receives_from


def _schedule(kind: str, stages: int, microbatches: int) -> Schedule:
    sends_to, receives_from = _chain(stages)
    order = compute_order(kind, ranks=stages, microbatches=microbatches)
    return lower(order, sends_to=sends_to, receives_from=receives_from, kind=kind)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
def test_equal_stages_match_the_closed_form(kind: str, stages: int, microbatches: int) -> None:
    f, b = 1.0, 2.5
    sim = simulate_schedule(_schedule(kind, stages, microbatches), forward_s=[f] * stages, backward_s=[b] * stages)
    assert sim.step_s == pytest.approx((microbatches + stages - 1) * (f + b))
    assert sim.busy_s == pytest.approx([microbatches * (f + b)] * stages)
    assert sim.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))


@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
def test_activations_in_flight(stages: int, microbatches: int) -> None:
    static, act = 100.0, 7.0
    for kind in ("gpipe", "1f1b"):
        sim = simulate_schedule(
            _schedule(kind, stages, microbatches), forward_s=[1.0] * stages, backward_s=[2.0] * stages,
            static_bytes=[static] * stages, activation_bytes=[act] * stages,
        )
        expected = [microbatches if kind == "gpipe" else min(microbatches, stages - s) for s in range(stages)]
        assert list(sim.peak_in_flight) == expected
        assert list(sim.peak_memory_bytes) == pytest.approx([static + n * act for n in expected])
        for points in sim.memory:  # starts and ends with only the static bytes
            assert points[0] == (0.0, static)
            assert points[-1][1] == pytest.approx(static)


@pytest.mark.parametrize("microbatches", [1, 2, 5])
def test_transfers_overlap_with_compute_on_two_stages(microbatches: int) -> None:
    # Stage 1 starts c late; gradients come back c later still; every other transfer hides
    # behind compute while c <= min(f, b): step = (M + 1)(f + b) + 2c.
    f, b, c = 1.0, 2.0, 0.25
    sim = simulate_schedule(_schedule("gpipe", 2, microbatches), forward_s=[f, f], backward_s=[b, b], transfer_s=c)
    assert sim.step_s == pytest.approx((microbatches + 1) * (f + b) + 2 * c)
    waits = {e.action: (e.start_s, e.end_s) for e in sim.events if e.kind in ("RF", "RB")}
    assert waits["1RF0"] == pytest.approx((0.0, f + c))
    assert waits["0RB0"] == pytest.approx((microbatches * f, (microbatches + 1) * f + b + 2 * c))


def test_each_message_takes_its_ranks_own_time() -> None:
    # One micro-batch through 2 stages: the activation costs its sender h after posting (the transfer
    # runs meanwhile) and its receiver h after arrival, the gradient likewise on the way back: the two
    # receivers' 2 h are on the critical path.
    f, b, c, h = 1.0, 2.0, 0.25, 0.1
    plain = simulate_schedule(_schedule("gpipe", 2, 1), forward_s=[f, f], backward_s=[b, b], transfer_s=c)
    sim = simulate_schedule(_schedule("gpipe", 2, 1), forward_s=[f, f], backward_s=[b, b], transfer_s=c,
                            message_host_s=h)
    assert plain.step_s == pytest.approx(2 * (f + b) + 2 * c)
    assert sim.step_s == pytest.approx(plain.step_s + 2 * h)
    spans = {e.action: (e.start_s, e.end_s) for e in sim.events}
    assert spans["0SF0"] == pytest.approx((f, f + h))
    assert spans["1RF0"] == pytest.approx((0.0, f + c + h))


def test_a_slow_link_queues_messages() -> None:
    # f = b = 1, c = 3, M = 2: the second activation waits for the first on the link
    # (arrives at 7, not 5), and likewise the second gradient (15, not 13).
    sim = simulate_schedule(_schedule("gpipe", 2, 2), forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], transfer_s=3.0)
    ends = {e.action: e.end_s for e in sim.events}
    assert ends["1RF1"] == pytest.approx(7.0)
    assert ends["0RB1"] == pytest.approx(15.0)
    assert sim.step_s == pytest.approx(16.0)


def test_skip_connection_waits_for_every_peer() -> None:
    # Stage 0 feeds stages 1 and 2; the 0 -> 2 link is slow (5 s), the others free.
    rows = [["0F0", "0SF0", "0RB0", "0B0"],
            ["1RF0", "1F0", "1SF0", "1RB0", "1B0", "1SB0"],
            ["2RF0", "2F0", "2B0", "2SB0"]]
    seconds = [[0.0, 0.0, 5.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    sim = simulate_schedule(
        Schedule.from_strings("gpipe", 1, rows), forward_s=[1.0] * 3, backward_s=[1.0] * 3,
        sends_to=((1, 2), (2,), ()), receives_from=((), (0,), (0, 1)), transfer_s=seconds,
    )
    starts = {e.action: e.start_s for e in sim.events}
    assert starts["2F0"] == pytest.approx(6.0)
    assert starts["1B0"] == pytest.approx(8.0)
    assert starts["0B0"] == pytest.approx(13.0)  # the gradient from stage 2 takes the slow link back
    assert sim.step_s == pytest.approx(14.0)
    as_function = simulate_schedule(
        Schedule.from_strings("gpipe", 1, rows), forward_s=[1.0] * 3, backward_s=[1.0] * 3,
        sends_to=((1, 2), (2,), ()), receives_from=((), (0,), (0, 1)),
        transfer_s=lambda src, dst: seconds[src][dst],
    )
    assert as_function.events == sim.events


def test_allreduce_exposed_versus_overlapped() -> None:
    f, b, a, m = 1.0, 2.0, 2.0, 3
    base = (m + 1) * (f + b)
    sched = _schedule("gpipe", 2, m)
    exposed = simulate_schedule(sched, forward_s=[f, f], backward_s=[b, b], allreduce_s=[a, a], buckets=1)
    assert exposed.step_s == pytest.approx(base + a)
    overlapped = simulate_schedule(sched, forward_s=[f, f], backward_s=[b, b], allreduce_s=[a, a], buckets=4)
    assert overlapped.step_s == pytest.approx(base + a / 4)  # only the last bucket sticks out
    buckets = [e for e in overlapped.events if e.kind == "AR" and e.track == 0]
    assert [e.start_s for e in buckets] == pytest.approx([base - b + k * b / 4 for k in range(1, 5)])
    assert exposed.busy_s == overlapped.busy_s  # all-reduce is not compute


def test_allreduce_longer_than_the_backward_queues() -> None:
    assert allreduce_buckets(0.0, 1.0, allreduce_s=4.0, buckets=2) == [(0.5, 2.5), (2.5, 4.5)]
    assert allreduce_buckets(0.0, 1.0, allreduce_s=0.0, buckets=3) == []


def test_deadlock_names_the_stuck_actions() -> None:
    # Stage 0 waits for a gradient before it has sent the activation stage 1 waits for.
    rows = [["0F0", "0RB0", "0SF0", "0B0"], ["1RF0", "1F0", "1B0", "1SB0"]]
    sched = Schedule.from_strings("gpipe", 1, rows)
    with pytest.raises(ScheduleError, match=r"rank 0 waits at 0RB0.*rank 1 waits at 1RF0"):
        simulate_schedule(sched, forward_s=[1.0, 1.0], backward_s=[1.0, 1.0])


def test_one_event_per_action_in_order() -> None:
    sched = _schedule("1f1b", 3, 4)
    sim = simulate_schedule(sched, forward_s=[1.0, 2.0, 1.5], backward_s=[2.0, 1.0, 3.0], transfer_s=0.1)
    for s, row in enumerate(sched.actions):
        events = [e for e in sim.events if e.track == s]
        assert [e.action for e in events] == [str(a) for a in row]
        assert all(e.end_s >= e.start_s >= 0 for e in events)
        assert all(x.end_s <= y.start_s + 1e-12 for x, y in itertools.pairwise(events))
    assert sim.step_s == pytest.approx(max(e.end_s for e in sim.events))


def test_default_topology_is_the_chain() -> None:
    sched = _schedule("gpipe", 3, 2)
    assert chain_topology(sched) == _chain(3)
    lonely = Schedule("gpipe", 1, (parse_actions(["0F0", "0B0"]),))
    assert chain_topology(lonely) == (((),), ((),))


def test_bad_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="forward_s"):
        simulate_schedule(_schedule("gpipe", 2, 2), forward_s=[1.0], backward_s=[1.0, 1.0])
    with pytest.raises(ValueError, match="2 x 2"):
        transfer_matrix([[0.0]], 2)


def test_small_formulas() -> None:
    assert message_seconds(0, bandwidth=1e9, latency=1e-5) == 0.0
    assert message_seconds(2e9, bandwidth=1e9, latency=1e-5) == pytest.approx(2.00001)
    assert bucket_count(0, bucket_cap_mb=25.0) == 1
    assert bucket_count(25 * 2**20, bucket_cap_mb=25.0) == 1
    assert bucket_count(25 * 2**20 + 1, bucket_cap_mb=25.0) == 2


def test_simulate_example_plan() -> None:
    plan = example_plan()
    sim = simulate(plan)
    c = message_seconds(32, bandwidth=plan.cost_model.link_bandwidth, latency=plan.cost_model.link_latency)
    f, b = plan.stages[0].predicted.forward_s, plan.stages[0].predicted.backward_s
    assert sim.step_s == pytest.approx(3 * (f + b) + 2 * c)  # the P = 2 formula above
    assert len(sim.events) == sum(len(row) for row in plan.actions)
    assert sim.peak_memory_bytes == pytest.approx((64 * 4 + 2 * 32.0,) * 2)
    assert 0 < sim.bubble_fraction < 1


# ----------------------------------------------------------------- topology, precision, recomputation


def _with(obj: Any, **fields: Any) -> Any:
    """``dataclasses.replace`` that also sets the issue-8 fields a plan may not carry yet."""
    names = {f.name for f in dataclasses.fields(obj)}
    out = dataclasses.replace(obj, **{k: v for k, v in fields.items() if k in names})
    for key, value in fields.items():
        if key not in names:
            object.__setattr__(out, key, value)  # read back with getattr defaults by simulate
    return out


def _two_nodes(plan: Plan, *, gpus_per_node: int, precision: str = "fp32") -> Plan:
    # A slow network: 100 kB/s and 100 µs between nodes; 1 GB/s and 60 µs inside one.
    cost_model = _with(plan.cost_model, inter_node_bandwidth=1e5, inter_node_latency=1e-4)
    return _with(plan, cost_model=cost_model, gpus_per_node=gpus_per_node, precision=precision)


def test_a_cross_node_message_is_priced_on_the_inter_node_link() -> None:
    plan = example_plan()  # GPipe, 2 stages x 2 micro-batches, f = 1 ms, b = 2 ms, one 32-byte fp32 boundary
    f, b = 1e-3, 2e-3
    intra, inter = plan_links(_two_nodes(plan, gpus_per_node=1))
    assert inter == Link(1e5, 1e-4) and intra == Link(1e9, 6e-5)
    # One GPU per node: stage 0 (rank 0) and stage 1 (rank 1) are on two nodes.
    c = 1e-4 + 32 / 1e5  # 420 µs, below f and b: every message but the first of each way hides
    assert simulate(_two_nodes(plan, gpus_per_node=1)).step_s == pytest.approx(3 * (f + b) + 2 * c)
    # Both ranks on one node: the NVLink-like link.
    c = 6e-5 + 32 / 1e9
    assert simulate(_two_nodes(plan, gpus_per_node=2)).step_s == pytest.approx(3 * (f + b) + 2 * c)
    # bf16: the float32 boundary travels as 16 bytes.
    c = 1e-4 + 16 / 1e5
    assert simulate(_two_nodes(plan, gpus_per_node=1, precision="bf16-mixed")).step_s == pytest.approx(
        3 * (f + b) + 2 * c)


def test_boundary_seconds_follow_the_ranks() -> None:
    # 4 stages x dp 2 on 4-GPU nodes: ranks 0-1, 2-3 | 4-5, 6-7: only stage 1 -> 2 crosses.
    plan = example_plan()
    spec = Boundary("x", (4,), "float32", 0, 1)
    stages = []
    for s in range(4):
        outputs = (dataclasses.replace(spec, source=s, target=s + 1),) if s < 3 else ()
        inputs = (dataclasses.replace(spec, source=s - 1, target=s),) if s else ()
        stages.append(dataclasses.replace(plan.stages[0], index=s, rank=s, ranks=(2 * s, 2 * s + 1),
                                          inputs=inputs, outputs=outputs))
    wide = _two_nodes(dataclasses.replace(plan, stages=tuple(stages), pp=4, dp=2, gpus=8), gpus_per_node=4)
    seconds = boundary_seconds(wide)
    fast, slow = 6e-5 + 16 / 1e9, 1e-4 + 16 / 1e5
    assert [seconds[s][s + 1] for s in range(3)] == pytest.approx([fast, slow, fast])


def test_static_bytes_follow_the_precision() -> None:
    # 64 bytes of float32 parameters per stage = 16 elements.
    plan = dataclasses.replace(example_plan(), model=dataclasses.replace(example_plan().model, parameters=32))
    assert stage_static_bytes(plan) == [64 * 4] * 2  # fp32, Adam: x (2 + 2)
    assert stage_static_bytes(_with(plan, precision="bf16-mixed")) == [16 * 16] * 2
    assert stage_static_bytes(_with(plan, precision="bf16")) == [16 * 8] * 2
    sgd = dataclasses.replace(plan, cost_model=dataclasses.replace(plan.cost_model, optimizer_states=1))
    assert stage_static_bytes(_with(sgd, precision="bf16")) == [16 * 6] * 2


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_recomputed_activations_live_during_backward(kind: str) -> None:
    # Kept per micro-batch 7 bytes (block inputs); each backward re-makes 50 bytes of activations.
    stages, microbatches, static = 2, 4, 100.0
    sim = simulate_schedule(
        _schedule(kind, stages, microbatches), forward_s=[1.0] * stages, backward_s=[2.0] * stages,
        static_bytes=[static] * stages, activation_bytes=[7.0] * stages, backward_bytes=[50.0] * stages,
    )
    in_flight = [microbatches if kind == "gpipe" else min(microbatches, stages - s) for s in range(stages)]
    assert list(sim.peak_memory_bytes) == pytest.approx([static + n * 7.0 + 50.0 for n in in_flight])
    for points in sim.memory:
        assert points[-1][1] == pytest.approx(static)


# ----------------------------------------------------------------- several stages per rank


def _v_plan(*, gpus_per_node: int | None = None, dp: int = 1) -> Plan:
    """The example plan's chain as 4 stages in a V on 2 pipeline ranks (ZB-V): ranks 0, 1, 1, 0."""
    plan = example_plan()
    spec = Boundary("x", (4,), "float32", 0, 1)
    where = (0, 1, 1, 0)
    pred = dataclasses.replace(plan.stages[0].predicted, forward_s=1e-3, backward_s=2e-3, weight_s=1e-3)
    stages = []
    for s in range(4):
        outputs = (dataclasses.replace(spec, source=s, target=s + 1),) if s < 3 else ()
        inputs = (dataclasses.replace(spec, source=s - 1, target=s),) if s else ()
        stages.append(dataclasses.replace(plan.stages[0], index=s, rank=where[s],
                                          ranks=tuple(where[s] * dp + r for r in range(dp)),
                                          inputs=inputs, outputs=outputs, predicted=pred))
    v = dataclasses.replace(plan, stages=tuple(stages), pp=2, dp=dp, gpus=2 * dp, chunks=2, schedule="zbv",
                            microbatches=4, gpus_per_node=gpus_per_node)
    order = compute_order("zbv", ranks=2, microbatches=4, chunks=2)
    sched = lower(order, sends_to=v.sends_to(), receives_from=v.receives_from(), stage_rank=where, kind="zbv")
    return dataclasses.replace(v, actions=tuple(tuple(row) for row in sched.to_strings()))


def test_boundary_seconds_follow_the_pipeline_ranks() -> None:
    # dp 2, 2 GPUs per node: pipeline rank 0 (global 0-1) on node 0, rank 1 (2-3) on node 1.
    plan = _two_nodes(_v_plan(dp=2), gpus_per_node=2)
    seconds = boundary_seconds(plan)
    slow = 1e-4 + 16 / 1e5
    assert [seconds[s][s + 1] for s in range(3)] == pytest.approx([slow, 0.0, slow])  # 1 -> 2: same rank


def test_simulate_a_plan_with_two_stages_per_rank() -> None:
    plan = _v_plan()
    sim = simulate(plan)
    assert sim.ranks == 2 and len(sim.peak_memory_bytes) == 2
    c = boundary_seconds(plan)
    direct = simulate_schedule(
        plan.schedule_data(), forward_s=[1e-3] * 4, backward_s=[2e-3] * 4, weight_s=[1e-3] * 4,
        stage_rank=(0, 1, 1, 0), sends_to=plan.sends_to(), receives_from=plan.receives_from(), transfer_s=c,
        static_bytes=stage_static_bytes(plan), activation_bytes=[32.0] * 4, buckets=1,
        allreduce_s=[0.0] * 4,
    )
    assert sim.step_s == pytest.approx(direct.step_s)
    b_and_w = {e.kind: e.duration_s for e in sim.events if e.action in ("3B0", "3W0")}
    assert b_and_w == pytest.approx({"B": 1e-3, "W": 1e-3})  # B is the input gradient: backward_s - weight_s
    # Each rank holds two stages' parameters and at most 2P = 4 chunk activations.
    assert sim.peak_memory_bytes == pytest.approx((2 * 256 + 4 * 32.0,) * 2)
    assert {e.track for e in sim.events} == {0, 1}


# ----------------------------------------------------------------- jitter


def _two_stage(kind: str, microbatches: int = 8) -> tuple[Schedule, dict[str, Any]]:
    sched = lower(compute_order(kind, ranks=2, microbatches=microbatches), sends_to=((1,), ()),
                  receives_from=((), (0,)))
    costs: dict[str, Any] = {"forward_s": [1.0, 1.0], "backward_s": [2.0, 2.0]}
    if kind == "zb-h1":
        costs["weight_s"] = [1.0, 1.0]
    return sched, costs


def test_jitter_costs_a_coupled_schedule_more_than_a_zero_bubble_one() -> None:
    """Actions drawn about their times: a late peer makes 1F1B wait; ZB-H1's W actions fill the gap."""
    growth = {}
    for kind in ("1f1b", "zb-h1"):
        sched, costs = _two_stage(kind)
        steady = simulate_schedule(sched, **costs).step_s
        jittered = simulate_schedule(sched, **costs, jitter=0.15)
        assert jittered == simulate_schedule(sched, **costs, jitter=0.15)  # seeded: the same every call
        assert len(jittered.events) == len(simulate_schedule(sched, **costs).events)
        growth[kind] = jittered.step_s / steady
    assert growth["1f1b"] > growth["zb-h1"] > 1.0


def test_without_jitter_or_with_one_sample_the_step_is_as_given() -> None:
    sched, costs = _two_stage("1f1b")
    steady = simulate_schedule(sched, **costs)
    assert simulate_schedule(sched, **costs, jitter=0.0) == steady
    one = simulate_schedule(sched, **costs, jitter=0.3, samples=1)  # one draw: some other step
    assert one.step_s != steady.step_s
