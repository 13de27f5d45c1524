"""cost/experts.py and its use by formulate and the search: what expert parallelism costs and saves."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import partitioner
from partitioner.cost.comm import Link
from partitioner.cost.devices import DEVICES
from partitioner.cost.experts import (
    all_to_all_seconds,
    dispatch_bytes,
    ep_choices,
    expert_layer_seconds,
)
from partitioner.errors import AutopartitionError
from partitioner.solve.formulate import ExpertBlock, GraphCosts, expert_seconds, formulate

sys.path.insert(0, str(Path(__file__).parent / "models"))

FAST, PORT = Link(400e9, 1e-5), Link(50e9, 1e-5)


def test_an_all_to_all_inside_a_node_is_cheaper_than_one_across_nodes_and_grows_with_the_group():
    sent = dispatch_bytes(4096, top_k=8, hidden=4096, element_bytes=2)
    inside = [all_to_all_seconds(sent, g, members_per_node=8, intra=FAST, inter=PORT) for g in (2, 4, 8)]
    across = [all_to_all_seconds(sent, g, members_per_node=8, intra=FAST, inter=PORT) for g in (16, 32, 64)]
    assert inside == sorted(inside) and across == sorted(across)
    assert max(inside) * 4 < min(across)  # the port is 8x slower than NVLink: 1/2 there vs 7/8 here
    # Half of a 16-member group's rows leave the node through the port: bytes / 2 / 50 GB/s, plus latencies.
    assert across[0] == pytest.approx(sent / 2 / 50e9 + 8 * 1e-5)
    assert all_to_all_seconds(sent, 1, members_per_node=8, intra=FAST, inter=PORT) == 0.0


def test_a_layer_pays_four_all_to_alls_per_micro_batch():
    forward, backward = expert_layer_seconds(1024, top_k=2, hidden=1024, element_bytes=2, ep=8, members_per_node=8,
                                             intra=FAST, inter=PORT)
    one = all_to_all_seconds(dispatch_bytes(1024, top_k=2, hidden=1024, element_bytes=2), 8, members_per_node=8,
                             intra=FAST, inter=PORT)
    assert forward == backward == pytest.approx(2 * one)


def test_degrees_tried_divide_experts_and_replicas():
    assert ep_choices(256, 2048, fixed=None, per_node=8) == (1, 8, 16, 32, 64)
    assert ep_choices(8, 8, fixed=None, per_node=8) == (1, 8)
    assert ep_choices(6, 12, fixed=None, per_node=8) == (1, 6)
    assert ep_choices(8, 4, fixed=8, per_node=8) == ()


def _graph(expert_share: float = 0.5) -> GraphCosts:
    """Two blocks: a dense one and an experts layer whose parameters are ``expert_share`` of the bytes."""
    return GraphCosts(
        blocks=(("a",), ("b",)), node_time_s={"a": 1e-3, "b": 2e-3}, node_forward_s={"a": 3e-4, "b": 6e-4},
        node_saved_bytes={"a": 100, "b": 100}, node_output_bytes={"a": 8, "b": 8},
        parameter_bytes={"dense": round(4e9 * (1 - expert_share)), "experts": round(4e9 * expert_share)},
        block_parameters=(("dense",), ("experts",)), edges=((0, 1),), block_sends=(8, 8),
        expert_parameters=frozenset({"experts"}),
        expert_layers=(ExpertBlock(1, 8192.0, 2, 1024, ("b",)),),
    )


def test_formulate_divides_the_experts_state_and_reduces_their_gradients_over_fewer_replicas():
    spec = DEVICES["h100"]
    dense = formulate(_graph(), dp=8, spec=spec, memory_limit=None, gpus_per_node=8)
    split = formulate(_graph(), dp=8, spec=spec, memory_limit=None, gpus_per_node=8, ep=4)
    assert split.static_bytes[0] == dense.static_bytes[0]
    assert split.static_bytes[1] == pytest.approx(dense.static_bytes[1] / 4)
    assert split.allreduce_s[1] < dense.allreduce_s[1] / 4  # a quarter of the bytes over 2 replicas, not 8
    added_f, added_b = expert_seconds(_graph(), dp=8, ep=4, imbalance=1.25, precision="fp32", spec=spec,
                                      gpus_per_node=8)
    assert split.time_s[0] == dense.time_s[0] and added_f[0] == added_b[0] == 0.0
    assert split.time_s[1] == pytest.approx(dense.time_s[1] + added_f[1] + added_b[1])
    # The busiest member's extra quarter of the experts' compute is in it, with the all-to-alls.
    sent = expert_layer_seconds(8192 / 8, top_k=2, hidden=1024, element_bytes=4, ep=4, members_per_node=4,
                                intra=Link(spec.link_bandwidth, spec.link_latency),
                                inter=Link(spec.link_bandwidth, spec.link_latency))
    assert added_f[1] + added_b[1] == pytest.approx(sum(sent) + 0.25 * 2e-3 / 8)
    with pytest.raises(ValueError, match="must divide dp"):
        formulate(_graph(), dp=6, spec=spec, memory_limit=None, ep=4)


def _mixtral() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config), {"input_ids": torch.randint(0, 64, (8, 8))}


def test_a_plan_with_fixed_ep_records_it_and_prices_the_all_to_alls():
    model, inputs = _mixtral()
    common = {"gpus": 4, "device": "h100", "pp": 1, "microbatches": 1, "schedule": "1f1b", "tp": 1, "shard": "none"}
    without = partitioner.compile(model, inputs, ep=1, **common)
    with_ep = partitioner.compile(model, inputs, ep=4, **common)
    assert (without.ep, with_ep.ep) == (1, 4)
    assert [layer.module for layer in with_ep.experts] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    # Four all-to-alls per layer on NVLink, each at least a latency: in the forward and the backward.
    latency = DEVICES["h100"].link_latency
    assert with_ep.stages[0].predicted.forward_s >= without.stages[0].predicted.forward_s + 2 * 2 * 3 * latency
    assert with_ep.stages[0].predicted.parameter_bytes == without.stages[0].predicted.parameter_bytes
    assert with_ep.stages[0].predicted.memory_bytes < without.stages[0].predicted.memory_bytes
    again = partitioner.Plan.from_json(with_ep.to_json())
    assert again.ep == 4 and again.experts == with_ep.experts


def test_ep_that_does_not_divide_the_experts_or_a_model_without_experts_is_refused_with_the_choices():
    model, inputs = _mixtral()
    with pytest.raises(AutopartitionError, match=r"--ep 3 does not divide .* 4 experts per layer; use one of 1, 2, 4"):
        partitioner.compile(model, inputs, gpus=6, device="h100", ep=3, tp=1)
    import mlp

    with pytest.raises(AutopartitionError, match="has no experts to shard"):
        partitioner.compile(mlp.build_model(), mlp.example_inputs(8), gpus=2, device="h100", ep=2)


def test_auto_shards_the_experts_where_their_state_does_not_fit_otherwise():
    """Experts hold most of the weights: under a cap that only their quarter fits, auto picks ep 4."""
    model, inputs = _mixtral()
    common = {"gpus": 4, "device": "h100", "pp": 1, "tp": 1, "shard": "none", "recompute": "none", "microbatches": 1, "schedule": "1f1b"}
    free = partitioner.compile(model, inputs, ep=1, **common)
    sharded = partitioner.compile(model, inputs, ep=4, **common)
    cap = (free.stages[0].predicted.memory_bytes + sharded.stages[0].predicted.memory_bytes) / 2
    chosen = partitioner.compile(model, inputs, ep="auto", memory_per_gpu=cap, **common)
    assert chosen.ep in (2, 4) and chosen.stages[0].predicted.memory_bytes <= cap
    assert dataclasses.replace(chosen, candidates=()).dp == 4


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_no_stage_boundary_falls_inside_an_experts_layer(schedule: str):
    """Expert parallelism runs a layer as one exchange: the planner never cuts through one (coarsen's ``whole``)."""
    import user_moe_routed as user

    plan = partitioner.compile(user.build_model(), user.example_inputs(16), gpus=4, pp=2, ep=2, schedule=schedule,
                               chunks=2, microbatches=4, device="h100", tp=1)
    assert plan.ep == 2 and len(plan.stages) == 4
    for layer in plan.experts:
        holders = {s.index for s in plan.stages if set(layer.nodes) & set(s.nodes)}
        assert len(holders) == 1, (layer.module, holders)


def test_sharded_stage_groups_keep_their_experts_whole_as_the_runtime_does():
    """ZeRO-1 and FSDP2 shard the dense parameters; each member's experts stay whole (runtime/parallel/experts.py)."""
    from partitioner.cost.precision import state_bytes

    spec = DEVICES["h100"]
    for shard in ("optimizer", "full", "zero3"):
        plain = formulate(_graph(), dp=8, spec=spec, memory_limit=None, gpus_per_node=8, ep=4)
        sharded = formulate(_graph(), dp=8, spec=spec, memory_limit=None, gpus_per_node=8, ep=4, shard=shard)
        whole = state_bytes("fp32", 2, elements=2e9 / 4 / 4, model_bytes=2e9 / 4)  # a quarter of 2 GB of fp32
        assert plain.static_bytes[1] == sharded.static_bytes[1] == pytest.approx(whole), shard
        assert sharded.static_bytes[0] < plain.static_bytes[0], shard  # the dense parameters are sharded
    model, inputs = _mixtral()
    plan = partitioner.compile(model, inputs, ep=2, gpus=4, device="h100", pp=1, tp=1, microbatches=1,
                               schedule="1f1b", shard="full")
    assert plan.ep == 2 and plan.stages[0].shard == "full" and plan.stages[0].predicted.expert_parameter_bytes > 0
