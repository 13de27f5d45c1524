"""The communication cost model, and that the solver and the simulator both price with it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from partitioner import cli
from partitioner.cost.comm import (
    Link,
    allreduce_crosses_nodes,
    bucket_count,
    bucket_share,
    link,
    message_seconds,
    node_of,
    p2p_crosses_nodes,
    ring_allreduce_seconds,
    ring_latency_seconds,
)
from partitioner.cost.devices import DEVICES
from partitioner.defaults import DEFAULT_BUCKET_CAP_MB, DEFAULT_SCHEDULE, SCHEDULES, schedule_chunks
from partitioner.plan import example_plan
from partitioner.schedule import lower as schedule
from partitioner.schedule import simulate
from partitioner.solve import formulate

MIB = 2**20
LINK = {"bandwidth": 100e9, "latency": 10e-6}  # 100 GB/s, 10 µs per message


def test_message_hand_computed() -> None:
    # 1 MB at 100 GB/s is 10 µs, plus 10 µs latency.
    assert message_seconds(1e6, **LINK) == pytest.approx(20e-6)
    assert message_seconds(0, **LINK) == 0.0
    assert message_seconds(-5, **LINK) == 0.0


def test_ring_allreduce_hand_computed() -> None:
    # 8 ranks, 1 GB: 2 * 7 / 8 = 1.75 GB over 100 GB/s = 17.5 ms; 14 latency steps per message.
    assert ring_allreduce_seconds(1e9, 8, **LINK) == pytest.approx(17.5e-3 + 14 * 10e-6)
    assert ring_allreduce_seconds(1e9, 8, **LINK, messages=4) == pytest.approx(17.5e-3 + 4 * 14 * 10e-6)
    assert ring_allreduce_seconds(1e9, 8, **LINK, messages=0) == pytest.approx(17.5e-3)
    # Two ranks: each sends half and receives half, twice: the whole buffer's worth.
    assert ring_allreduce_seconds(1e9, 2, **LINK, messages=0) == pytest.approx(1e9 / 100e9)


@pytest.mark.parametrize(("nbytes", "replicas"), [(0, 8), (1e9, 1), (1e9, 0), (-1, 4)])
def test_nothing_to_reduce_costs_nothing(nbytes: float, replicas: int) -> None:
    assert ring_allreduce_seconds(nbytes, replicas, **LINK) == 0.0


def test_bandwidth_term_approaches_twice_the_buffer() -> None:
    big = ring_allreduce_seconds(1e9, 1024, **LINK, messages=0)
    assert big < 2 * 1e9 / 100e9 and big == pytest.approx(2 * 1e9 / 100e9, rel=1e-3)


def test_ring_latency() -> None:
    assert ring_latency_seconds(1, latency=1e-5) == 0.0
    assert ring_latency_seconds(4, latency=0.5) == 3.0
    # One message's latency is what ring_allreduce_seconds charges per message.
    with_latency = ring_allreduce_seconds(1e6, 4, **LINK, messages=1)
    without = ring_allreduce_seconds(1e6, 4, **LINK, messages=0)
    assert with_latency - without == pytest.approx(ring_latency_seconds(4, latency=LINK["latency"]))


@pytest.mark.parametrize(
    ("nbytes", "cap", "count"),
    [(0, 25.0, 1), (1, 25.0, 1), (25 * MIB, 25.0, 1), (25 * MIB + 1, 25.0, 2), (60 * MIB, 25.0, 3),
     (100 * MIB, 1.0, 100), (100 * MIB, 0.0, 1), (100 * MIB, -1.0, 1)],
)
def test_bucket_count(nbytes: float, cap: float, count: int) -> None:
    assert bucket_count(nbytes, bucket_cap_mb=cap) == count


def test_bucket_share_is_the_count_before_rounding_up() -> None:
    for nbytes in (1, 25 * MIB, 60 * MIB, 123_456_789):
        share = bucket_share(nbytes, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB)
        assert bucket_count(nbytes, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB) == max(1, math.ceil(share))
    # Additive over parameters: what lets the solver charge latency block by block.
    parts = [3 * MIB, 40 * MIB, 7 * MIB]
    total = sum(bucket_share(p, bucket_cap_mb=25.0) for p in parts)
    assert total == pytest.approx(bucket_share(sum(parts), bucket_cap_mb=25.0)) == pytest.approx(2.0)
    assert bucket_share(100 * MIB, bucket_cap_mb=0.0) == 0.0


def test_formulate_prices_with_the_same_model() -> None:
    spec = DEVICES["h100"]
    link = {"bandwidth": spec.link_bandwidth, "latency": spec.link_latency}
    assert formulate.transfer_seconds(3e6, spec) == message_seconds(3e6, **link)
    share = bucket_share(60 * MIB, bucket_cap_mb=25.0)
    assert formulate.allreduce_seconds(60 * MIB, 4, spec, messages=share) == ring_allreduce_seconds(
        60 * MIB, 4, **link, messages=share
    )


def test_simulator_prices_with_the_same_model() -> None:
    assert simulate.message_seconds is message_seconds
    assert simulate.bucket_count is bucket_count
    plan = example_plan()  # GPipe, 2 stages x 2 micro-batches, forward 1 ms, backward 2 ms, 32-byte boundary
    slow = dataclasses.replace(plan, cost_model=dataclasses.replace(plan.cost_model, link_latency=1.0))
    m = message_seconds(32, bandwidth=slow.cost_model.link_bandwidth, latency=1.0)
    # By hand: messages dominate and queue on each link, two forward then two back, so the
    # step is the 6 ms of compute on the critical path plus four messages.
    assert simulate.simulate(slow).step_s == pytest.approx(6e-3 + 4 * m)


def test_schedule_names_and_defaults_have_one_home() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv") and DEFAULT_SCHEDULE in SCHEDULES
    # The schedule builder knows every name (and reads them from defaults, not a list of its own).
    assert all(schedule.compute_order(k, ranks=2, microbatches=4, chunks=schedule_chunks(k)) for k in SCHEDULES)
    assert DEFAULT_BUCKET_CAP_MB == 25.0 == example_plan().bucket_cap_mb
    args = cli._plan_parser().parse_args(["model.py", "--gpus", "2"])
    assert args.schedule == "auto"  # the command line searches; compile() keeps DEFAULT_SCHEDULE (issue 8)


# ----------------------------------------------------------------- topology: which link a message uses


def test_dp4_on_8_gpu_nodes_crosses_between_stages_1_and_2() -> None:
    # pp = 4, dp = 4, 8 GPUs per node: stages own ranks 0-3, 4-7 | 8-11, 12-15.
    crosses = [p2p_crosses_nodes(s, s + 1, dp=4, gpus_per_node=8) for s in range(3)]
    assert crosses == [False, True, False]
    assert not any(allreduce_crosses_nodes(s, dp=4, gpus_per_node=8) for s in range(4))
    assert p2p_crosses_nodes(0, 3, dp=4, gpus_per_node=8)  # a skip edge from node 0 to node 1


def test_dp16_on_8_gpu_nodes_every_allreduce_crosses() -> None:
    assert all(allreduce_crosses_nodes(s, dp=16, gpus_per_node=8) for s in range(4))
    # Replica r of every stage sits on node 2s + r // 8: stage s -> s+1 always changes node.
    assert all(p2p_crosses_nodes(s, s + 1, dp=16, gpus_per_node=8) for s in range(3))


def test_unaligned_groups_and_one_node() -> None:
    # dp = 3, 8 GPUs per node: stage 2 owns ranks 6, 7 | 8; stage 1 (3-5) -> 2 (6-8) crosses for r = 2.
    assert [allreduce_crosses_nodes(s, dp=3, gpus_per_node=8) for s in range(4)] == [False, False, True, False]
    assert p2p_crosses_nodes(1, 2, dp=3, gpus_per_node=8)
    assert not p2p_crosses_nodes(0, 1, dp=3, gpus_per_node=8)
    # One node (gpus_per_node None) or one GPU per node (every message crosses).
    assert not p2p_crosses_nodes(0, 5, dp=8, gpus_per_node=None)
    assert not allreduce_crosses_nodes(3, dp=8, gpus_per_node=None)
    assert p2p_crosses_nodes(0, 1, dp=1, gpus_per_node=1)
    assert not allreduce_crosses_nodes(0, dp=1, gpus_per_node=1)
    assert [node_of(r, 8) for r in (0, 7, 8, 15, 16)] == [0, 0, 1, 1, 2]


def test_links_of_a_device() -> None:
    h100 = DEVICES["h100"]
    assert link(h100) == Link(450e9, 10e-6)
    assert link(h100, inter_node=True) == Link(50e9, 15e-6)
    assert link(DEVICES["a100"], inter_node=True) == Link(25e9, 15e-6)
    cpu = dataclasses.replace(DEVICES["cpu"], link_bandwidth=2e9, link_latency=1e-4)
    assert link(cpu, inter_node=True) == link(cpu) == Link(2e9, 1e-4)  # one kind of link
    # 1 MB between nodes: 15 µs + 1e6 / 50e9 s = 35 µs; the ring prices with the same numbers.
    slow = link(h100, inter_node=True)
    assert slow.message_seconds(1e6) == pytest.approx(35e-6)
    assert slow.allreduce_seconds(1e9, 16, messages=2) == pytest.approx(2 * 15 / 16 * 1e9 / 50e9 + 2 * 30 * 15e-6)
    assert slow.latency_seconds(16) == pytest.approx(30 * 15e-6)
