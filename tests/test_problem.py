"""The closed-form cost model of :mod:`partitioner.solve.problem`, on hand-computed examples.

Every expected number below is worked out by hand in the comments next to it,
not by calling the code under test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from partitioner.solve.problem import (
    Partition,
    PartitionProblem,
    allreduce_latencies,
    check_assignment,
    choose_recompute,
    in_flight,
    split_backward,
    stage_costs,
    stage_links,
    stage_memory,
    step_time,
)


def diamond(**changes: object) -> PartitionProblem:
    """0 -> {1, 2} -> 3, with distinct numbers everywhere so mix-ups show."""
    problem = PartitionProblem(
        time_s=(1.0, 2.0, 3.0, 4.0),
        static_bytes=(10.0, 20.0, 30.0, 40.0),
        activation_bytes=(1.0, 2.0, 3.0, 4.0),
        allreduce_s=(0.1, 0.2, 0.3, 0.4),
        transfer_s=(0.5, 0.25, 0.125, 8.0),
        edges=((0, 1), (0, 2), (1, 3), (2, 3)),
    )
    return dataclasses.replace(problem, **changes)  # type: ignore[arg-type]


def zeros(n: int) -> tuple[float, ...]:
    return (0.0,) * n


# --------------------------------------------------------------------------- stage_costs


def test_stage_costs_diamond() -> None:
    # stage 0 = {0}; stage 1 = {1, 2}; stage 2 = {3}.
    # stage 1: 2 + 3 compute, block 0's output received once although 1 and 2 both read it.
    # stage 2: 4 compute + transfers of block 1 (0.25) and block 2 (0.125).
    times, allreduce = stage_costs(diamond(), (0, 1, 1, 2), 3)
    assert times == pytest.approx([1.0, 5.5, 4.375])
    assert allreduce == pytest.approx([0.1, 0.5, 0.4])


def test_transfer_charged_once_per_receiving_stage() -> None:
    # Block 0 feeds 1 and 2 on two different stages: each stage pays for it once.
    problem = PartitionProblem(
        time_s=(1.0, 1.0, 1.0),
        static_bytes=zeros(3),
        activation_bytes=zeros(3),
        allreduce_s=zeros(3),
        transfer_s=(0.5, 0.0, 0.0),
        edges=((0, 1), (0, 2)),
    )
    times, _ = stage_costs(problem, (0, 1, 2), 3)
    assert times == pytest.approx([1.0, 1.5, 1.5])
    # ... and once in total when both readers share a stage.
    times, _ = stage_costs(problem, (0, 1, 1), 2)
    assert times == pytest.approx([1.0, 2.5])


def test_transfer_not_charged_within_a_stage() -> None:
    times, _ = stage_costs(diamond(), (0, 0, 0, 0), 1)
    assert times == pytest.approx([10.0])  # 1 + 2 + 3 + 4, no transfers
    # Block 3's own transfer_s (8.0) is never charged: nothing reads block 3.
    times, _ = stage_costs(diamond(), (0, 0, 0, 1), 2)
    assert times == pytest.approx([6.0, 4.375])


def test_duplicate_edges_charged_once() -> None:
    problem = PartitionProblem(
        time_s=(1.0, 1.0),
        static_bytes=zeros(2),
        activation_bytes=zeros(2),
        allreduce_s=zeros(2),
        transfer_s=(0.5, 0.0),
        edges=((0, 1), (0, 1)),
    )
    times, _ = stage_costs(problem, (0, 1), 2)
    assert times == pytest.approx([1.0, 1.5])


def test_shared_allreduce_once_per_stage_with_a_reader() -> None:
    # Shared parameter read by blocks 0 and 2 (stages 0 and 1): both stages all-reduce it.
    problem = diamond(shared=((100.0, 0.05, (0, 2)),))
    _, allreduce = stage_costs(problem, (0, 1, 1, 2), 3)
    assert allreduce == pytest.approx([0.15, 0.55, 0.4])
    # Readers 1 and 2 on the same stage: that stage pays once.
    problem = diamond(shared=((100.0, 0.05, (1, 2)),))
    _, allreduce = stage_costs(problem, (0, 1, 1, 2), 3)
    assert allreduce == pytest.approx([0.1, 0.55, 0.4])


# --------------------------------------------------------------------------- step_time


def test_step_time_diamond() -> None:
    # sum t = 1 + 5.5 + 4.375 = 10.875; (M-1) max t = 2 * 5.5 = 11; max all-reduce = 0.5.
    total, times = step_time(diamond(), (0, 1, 1, 2), microbatches=3)
    assert total == pytest.approx(22.375)
    assert times == pytest.approx((1.0, 5.5, 4.375))


def test_step_time_docstring_example() -> None:
    problem = PartitionProblem(
        time_s=(1.0, 2.0),
        static_bytes=(0.0, 0.0),
        activation_bytes=(0.0, 0.0),
        allreduce_s=(0.0, 0.0),
        transfer_s=(0.5, 0.0),
        edges=((0, 1),),
    )
    assert step_time(problem, (0, 1), microbatches=4) == (11.0, (1.0, 2.5))


def test_step_time_single_stage_is_m_times_the_work() -> None:
    # One stage: sum t + (M-1) t = M t, plus the all-reduce (0.1+0.2+0.3+0.4 = 1.0).
    total, times = step_time(diamond(), (0, 0, 0, 0), microbatches=4)
    assert times == pytest.approx((10.0,))
    assert total == pytest.approx(41.0)


def test_step_time_one_microbatch_is_the_sum() -> None:
    total, _ = step_time(diamond(allreduce_s=zeros(4)), (0, 1, 1, 2), microbatches=1)
    assert total == pytest.approx(10.875)


def test_step_time_with_shared_allreduce() -> None:
    # Shared all-reduce 0.05 on stages 0 and 1: max all-reduce 0.55 instead of 0.5.
    problem = diamond(shared=((100.0, 0.05, (0, 2)),))
    total, _ = step_time(problem, (0, 1, 1, 2), microbatches=3)
    assert total == pytest.approx(22.425)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    ("microbatches", "expected"),
    [
        (1, [1, 1, 1]),
        (2, [2, 2, 1]),
        (3, [3, 2, 1]),
        (8, [3, 2, 1]),
    ],
)
def test_in_flight_1f1b(microbatches: int, expected: list[int]) -> None:
    assert [in_flight(s, 3, microbatches, "1f1b") for s in range(3)] == expected


@pytest.mark.parametrize("microbatches", [1, 2, 5])
def test_in_flight_gpipe_holds_every_microbatch(microbatches: int) -> None:
    assert [in_flight(s, 4, microbatches, "gpipe") for s in range(4)] == [microbatches] * 4


def test_stage_memory_gpipe() -> None:
    # static + M * activations: 10 + 4*1; (20+30) + 4*(2+3); 40 + 4*4.
    memory = stage_memory(diamond(), (0, 1, 1, 2), 3, microbatches=4, schedule="gpipe")
    assert memory == pytest.approx([14.0, 70.0, 56.0])


def test_stage_memory_1f1b() -> None:
    # In flight min(4, 3 - s) = 3, 2, 1: 10 + 3*1; 50 + 2*5; 40 + 1*4.
    memory = stage_memory(diamond(), (0, 1, 1, 2), 3, microbatches=4, schedule="1f1b")
    assert memory == pytest.approx([13.0, 60.0, 44.0])
    # With M = 2 the first stage holds only 2: 10 + 2*1.
    memory = stage_memory(diamond(), (0, 1, 1, 2), 3, microbatches=2, schedule="1f1b")
    assert memory == pytest.approx([12.0, 60.0, 44.0])


def test_stage_memory_shared_counted_once_per_stage() -> None:
    # Readers 1, 2 (stage 1) and 3 (stage 2): +100 on stages 1 and 2, once each.
    problem = diamond(shared=((100.0, 0.0, (1, 2, 3)),))
    memory = stage_memory(problem, (0, 1, 1, 2), 3, microbatches=1, schedule="gpipe")
    assert memory == pytest.approx([11.0, 155.0, 144.0])
    # All readers on one stage: held once.
    memory = stage_memory(problem, (0, 0, 0, 0), 1, microbatches=1, schedule="gpipe")
    assert memory == pytest.approx([100.0 + 100.0 + 10.0])


def test_stage_memory_shared_reader_listed_twice() -> None:
    problem = diamond(shared=((100.0, 0.0, (1, 1)),))
    memory = stage_memory(problem, (0, 1, 1, 2), 3, microbatches=1, schedule="gpipe")
    assert memory == pytest.approx([11.0, 155.0, 44.0])


# --------------------------------------------------------------------------- check_assignment


def test_check_assignment_valid() -> None:
    assert check_assignment(diamond(), (0, 1, 1, 2), 3) is None
    assert check_assignment(diamond(), (0, 0, 1, 1), 2) is None
    assert check_assignment(diamond(), (0, 0, 0, 0), 1) is None


def test_check_assignment_order_other_than_given() -> None:
    # 1 and 2 are independent: 2 may go before 1.
    assert check_assignment(diamond(), (0, 1, 0, 1), 2) is None


def test_check_assignment_backward_edge() -> None:
    reason = check_assignment(diamond(), (0, 1, 0, 0), 2)
    assert reason is not None and "1->3" in reason


def test_check_assignment_empty_stage() -> None:
    reason = check_assignment(diamond(), (0, 0, 2, 2), 3)
    assert reason is not None and "stages used" in reason
    # A stage index past the end is as wrong as a missing one.
    assert check_assignment(diamond(), (0, 1, 1, 2), 2) is not None


def test_check_assignment_length_mismatch() -> None:
    reason = check_assignment(diamond(), (0, 1, 1), 2)
    assert reason is not None and "3 stages given for 4 blocks" in reason


# --------------------------------------------------------------------------- validation


def test_problem_size() -> None:
    assert diamond().size == 4


@pytest.mark.parametrize("field", ["static_bytes", "activation_bytes", "allreduce_s", "transfer_s"])
def test_problem_rejects_length_mismatch(field: str) -> None:
    base = dataclasses.asdict(diamond())
    base[field] = base[field][:3]
    with pytest.raises(ValueError, match=field):
        PartitionProblem(**base)


@pytest.mark.parametrize("edge", [(1, 0), (2, 2), (0, 4), (-1, 2)])
def test_problem_rejects_edge_not_forward(edge: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="not forward"):
        diamond(edges=((0, 1), edge))


def test_problem_allows_no_edges() -> None:
    assert diamond(edges=()).edges == ()


# --------------------------------------------------------------------------- Partition


def partition(objective: float, lower_bound: float) -> Partition:
    return Partition(
        stage_of=(0,),
        stages=1,
        objective=objective,
        lower_bound=lower_bound,
        status="feasible",
        solver="test",
        wall_s=0.0,
    )


def test_partition_gap() -> None:
    assert math.isclose(partition(10.0, 9.0).gap, 0.1)
    assert partition(10.0, 10.0).gap == 0.0
    assert partition(0.0, 0.0).gap == 0.0
    assert partition(10.0, 11.0).gap == 0.0  # never negative


# --------------------------------------------------------------------------- topology


def two_nodes(**changes: object) -> PartitionProblem:
    """The diamond on 2 replicas per stage and 3 GPUs per node, inter-node prices 10x.

    Ranks: stage 0 = 0, 1 (node 0); stage 1 = 2, 3 (nodes 0 | 1); stage 2 = 4, 5 (node 1).
    Inbound links: 0 -> 1 replica 1 goes 1 -> 3 (node 0 -> 1): crosses; 1 -> 2 replica 0
    goes 2 -> 4 (node 0 -> 1): crosses.  All-reduce: only stage 1's spans nodes.
    """
    fields: dict[str, object] = {
        "replicas": 2,
        "gpus_per_node": 3,
        "transfer_slow_s": (5.0, 2.5, 1.25, 80.0),
        "allreduce_slow_s": (1.0, 2.0, 3.0, 4.0),
        "allreduce_latency_s": 0.01,
        "allreduce_latency_slow_s": 0.5,
    }
    return diamond(**{**fields, **changes})


def test_stage_links_two_nodes() -> None:
    inbound, allreduce = stage_links(two_nodes(), 3)
    assert inbound == (False, True, True)
    assert allreduce == (False, True, False)
    assert allreduce_latencies(two_nodes(), 3) == (0.01, 0.5, 0.01)


def test_stage_links_one_replica_per_stage() -> None:
    # 2 GPUs per node, one rank per stage: stages 0, 1 | 2, 3 | 4: boundaries 1->2 and 3->4 cross.
    problem = diamond(gpus_per_node=2)
    assert stage_links(problem, 5) == ((False, False, True, False, True), (False,) * 5)


def test_stage_costs_inter_node_prices() -> None:
    # stage 1 = {1, 2} receives block 0 at the slow price 5 (not 0.5): 2 + 3 + 5 = 10.
    # stage 2 = {3} receives blocks 1, 2 at 2.5 + 1.25: 4 + 3.75 = 7.75.
    # All-reduce: stage 0 fast 0.1; stage 1 slow 2 + 3 = 5; stage 2 fast 0.4.
    times, allreduce = stage_costs(two_nodes(), (0, 1, 1, 2), 3)
    assert times == pytest.approx([1.0, 10.0, 7.75])
    assert allreduce == pytest.approx([0.1, 5.0, 0.4])


def test_step_time_latency_per_stage() -> None:
    # sum t = 18.75; (M-1) max t = 2 * 10 = 20; max(a + latency) = max(0.11, 5.5, 0.41) = 5.5.
    total, _ = step_time(two_nodes(), (0, 1, 1, 2), microbatches=3)
    assert total == pytest.approx(44.25)


def test_shared_parameter_slow_where_its_stage_crosses() -> None:
    # Shared (fast 0.05, slow 0.7) read on stages 0 and 1: stage 0 pays 0.05, stage 1 (crossing) 0.7.
    problem = two_nodes(shared=((100.0, 0.05, (0, 2)),), shared_slow_allreduce_s=(0.7,))
    _, allreduce = stage_costs(problem, (0, 1, 1, 2), 3)
    assert allreduce == pytest.approx([0.15, 5.7, 0.4])


def test_slow_prices_unused_on_one_node() -> None:
    """Slow prices without gpus_per_node (one node) change nothing: today's numbers exactly."""
    one_node = two_nodes(gpus_per_node=None)
    for stage_of in [(0, 1, 1, 2), (0, 0, 1, 1), (0, 0, 0, 0)]:
        stages = max(stage_of) + 1
        plain = diamond(allreduce_latency_s=0.01)
        assert stage_costs(one_node, stage_of, stages) == stage_costs(plain, stage_of, stages)
        assert step_time(one_node, stage_of, microbatches=3) == step_time(plain, stage_of, microbatches=3)


def test_one_gpu_per_node_without_slow_prices_changes_nothing() -> None:
    problem = diamond(gpus_per_node=1)  # every link crosses, but no slow prices are given
    assert step_time(problem, (0, 1, 1, 2), microbatches=3) == step_time(diamond(), (0, 1, 1, 2), microbatches=3)


# --------------------------------------------------------------------------- recomputation


def recomputable(**changes: object) -> PartitionProblem:
    """The diamond with recomputation costs: kept bytes 0.5 per block, extra seconds 0.5, 1, 1.5, 2."""
    return diamond(
        recompute_bytes=(0.5, 0.5, 0.5, 0.5),
        recompute_s=(0.5, 1.0, 1.5, 2.0),
        recompute="auto",
        **changes,
    )


def test_stage_memory_recomputed() -> None:
    # 1f1b, M = 4, in flight 3, 2, 1.  Recomputed: static + in flight x kept + largest activation.
    # stage 0: 10 + 3*0.5 + 1 = 12.5; stage 1: 50 + 2*1.0 + 3 = 55; stage 2: 40 + 1*0.5 + 4 = 44.5.
    memory = stage_memory(
        recomputable(), (0, 1, 1, 2), 3, microbatches=4, schedule="1f1b", recompute=(True, True, True)
    )
    assert memory == pytest.approx([12.5, 55.0, 44.5])
    # Mixed: stage 1 only.  Kept stages as before (13, 44).
    memory = stage_memory(
        recomputable(), (0, 1, 1, 2), 3, microbatches=4, schedule="1f1b", recompute=(False, True, False)
    )
    assert memory == pytest.approx([13.0, 55.0, 44.0])


def test_stage_costs_recomputed_adds_a_forward() -> None:
    # Stage 1 recomputes: 5.5 + 1 + 1.5 = 8; the others as before.  All-reduce unchanged.
    times, allreduce = stage_costs(recomputable(), (0, 1, 1, 2), 3, recompute=(False, True, False))
    assert times == pytest.approx([1.0, 8.0, 4.375])
    assert allreduce == pytest.approx([0.1, 0.5, 0.4])
    # sum 13.375 + 2 * 8 + 0.5
    total, _ = step_time(recomputable(), (0, 1, 1, 2), microbatches=3, recompute=(False, True, False))
    assert total == pytest.approx(29.875)


def test_choose_recompute_auto_only_where_keeping_does_not_fit() -> None:
    # Kept (1f1b, M = 4): 13, 60, 44.  Recomputed: 12.5, 55, 44.5.  Limit 58: only stage 1 recomputes.
    problem = recomputable(memory_limit=58.0)
    assert choose_recompute(problem, (0, 1, 1, 2), 3, microbatches=4, schedule="1f1b") == (False, True, False)
    # step_time and stage_memory apply the same rule when no choice is given.
    memory = stage_memory(problem, (0, 1, 1, 2), 3, microbatches=4, schedule="1f1b")
    assert memory == pytest.approx([13.0, 55.0, 44.0])
    total, _ = step_time(problem, (0, 1, 1, 2), microbatches=4, schedule="1f1b")
    assert total == pytest.approx(13.375 + 3 * 8.0 + 0.5)
    # Limit 54: stage 1 fits neither way; it keeps (and the split does not fit).
    problem = recomputable(memory_limit=54.0)
    assert choose_recompute(problem, (0, 1, 1, 2), 3, microbatches=4, schedule="1f1b") == (False, False, False)
    # No limit: keeping always fits.
    assert choose_recompute(recomputable(), (0, 1, 1, 2), 3, microbatches=4, schedule="1f1b") == (False,) * 3


def test_choose_recompute_modes() -> None:
    tight = recomputable(memory_limit=58.0)
    kw: dict[str, object] = {"microbatches": 4, "schedule": "1f1b"}
    assert choose_recompute(dataclasses.replace(tight, recompute="none"), (0, 1, 1, 2), 3, **kw) == (False,) * 3  # type: ignore[arg-type]
    assert choose_recompute(dataclasses.replace(tight, recompute="full"), (0, 1, 1, 2), 3, **kw) == (True,) * 3  # type: ignore[arg-type]
    # Without recomputation costs no stage can recompute, whatever the mode.
    bare = diamond(recompute="full")
    assert choose_recompute(bare, (0, 1, 1, 2), 3, **kw) == (False,) * 3  # type: ignore[arg-type]
    assert step_time(bare, (0, 1, 1, 2), microbatches=3) == step_time(diamond(), (0, 1, 1, 2), microbatches=3)


def test_recompute_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="one per stage"):
        step_time(recomputable(), (0, 1, 1, 2), microbatches=3, recompute=(True, False))
    with pytest.raises(ValueError, match="no recompute_bytes"):
        stage_costs(diamond(), (0, 1, 1, 2), 3, recompute=(True, False, False))
    with pytest.raises(ValueError, match="microbatches"):
        stage_costs(recomputable(memory_limit=58.0), (0, 1, 1, 2), 3)
    # An empty choice (a Partition without one) means the rule.
    assert stage_costs(recomputable(), (0, 1, 1, 2), 3, recompute=()) == stage_costs(diamond(), (0, 1, 1, 2), 3)


def test_partition_recompute_defaults_to_empty() -> None:
    assert partition(1.0, 1.0).recompute == ()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("transfer_slow_s", (1.0,), "transfer_slow_s"),
        ("allreduce_slow_s", (1.0,) * 5, "allreduce_slow_s"),
        ("recompute_bytes", (1.0,) * 3, "recompute_bytes"),
        ("shared_slow_allreduce_s", (1.0,), "one per shared"),
        ("recompute", "sometimes", "recompute"),
        ("replicas", 0, "replicas"),
        ("gpus_per_node", 0, "gpus_per_node"),
    ],
)
def test_problem_rejects_bad_optional_fields(field: str, value: object, match: str) -> None:
    changes: dict[str, object] = {field: value}
    if field == "recompute_bytes":
        changes["recompute_s"] = (1.0,) * 4
    with pytest.raises(ValueError, match=match):
        diamond(**changes)


def test_problem_wants_both_recompute_tuples() -> None:
    with pytest.raises(ValueError, match="both or neither"):
        diamond(recompute_bytes=(1.0,) * 4)


def test_a_split_backward_puts_the_first_stage_in_w_and_its_host_cost_on_the_others() -> None:
    p = PartitionProblem(time_s=(3.0, 3.0, 3.0), static_bytes=(0.0,) * 3, activation_bytes=(0.0,) * 3,
                         allreduce_s=(0.0,) * 3, transfer_s=(0.0,) * 3, edges=((0, 1), (1, 2)),
                         weight_s=(1.0, 1.0, 1.0), split_s=(0.25, 0.25, 0.25), split_forward=0.4, split_weight=0.4)
    # Stage 0 (blocks 0, 1) receives nothing: its whole backward (2 x 2 s) is W, and costs no more;
    # stage 1 pays the split's cost, 40% of it in F, 40% in W, the rest in B.
    assert split_backward(p, (0, 0, 1), 2) == ([4.0, 1.1], [0.0, 0.25], [0.0, pytest.approx(0.1)])
    assert split_backward(p, (0, 0, 1), 2, forward_s=(0.5, 0.5, 1.0)).weight == [5.0, 1.1]
    # Only a schedule that splits its backward pays the host cost.
    assert stage_costs(p, (0, 0, 1), 2, schedule="zb-h1")[0] == [6.0, 3.25]
    assert stage_costs(p, (0, 0, 1), 2, schedule="1f1b")[0] == [6.0, 3.0]
    assert split_backward(dataclasses.replace(p, weight_s=None), (0, 0, 1), 2) == ([0.0] * 2, [0.0] * 2, [0.0] * 2)
