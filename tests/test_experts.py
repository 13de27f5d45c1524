"""graph/experts.py: experts modules found by their contract in captured graphs, dense models left alone."""

import sys
from pathlib import Path

import pytest
import torch

from partitioner.graph.capture import capture
from partitioner.graph.experts import find_experts
from partitioner.graph.values import propagate_values

sys.path.insert(0, str(Path(__file__).parent / "models"))


def _found(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...] | dict[str, torch.Tensor]):
    captured = capture(model, inputs)
    flat = tuple(inputs.values()) if isinstance(inputs, dict) else inputs
    propagate_values(captured.graph_module, flat)
    return captured, find_experts(model, captured)


def test_user_experts_in_a_module_list_are_found_with_their_feeds():
    import user_moe_routed as user

    captured, found = _found(user.build_model(), user.example_inputs(8))
    assert found.notes == ()
    assert [layer.module for layer in found.layers] == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]
    layer = found.layers[1]
    assert (layer.layout, layer.experts, layer.top_k, layer.hidden, layer.tokens_per_batch) == ("list", 4, 2, 16, 8)
    assert len(layer.parameters) == 12 and all(p.startswith("layers.1.moe.experts.") for p in layer.parameters)
    nodes = captured.nodes()
    # The feeds are the router's outputs and the normed tokens; the output is what the residual adds.
    assert nodes[layer.index].target is torch.topk or "getitem" in layer.index
    assert any(u.name not in layer.nodes for u in nodes[layer.output].users)
    shapes = {n: p.shape for n, p in user.build_model().named_parameters()}
    assert layer.expert_parameter_count(shapes) == 3 * 16 * 32


def test_hugging_face_mixtral_experts_are_stacked():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    _, found = _found(model, {"input_ids": torch.randint(0, 64, (2, 8))})
    assert [(l.module, l.layout, l.experts, l.top_k, l.tokens_per_batch) for l in found.layers] == [
        (f"model.layers.{i}.mlp.experts", "stacked", 4, 2, 16) for i in range(2)]
    assert found.layers[0].parameters == ("model.layers.0.mlp.experts.down_proj",
                                          "model.layers.0.mlp.experts.gate_up_proj")


def test_a_router_whose_experts_break_the_contract_plans_dense_with_a_note():
    import user_moe

    _, found = _found(user_moe.build_model(), user_moe.example_inputs(8))
    assert found.layers == ()
    assert len(found.notes) == 1 and "plans as a dense graph" in found.notes[0]


def test_a_dense_model_has_no_experts_and_no_note():
    import mlp

    _, found = _found(mlp.build_model(), mlp.example_inputs(4))
    assert found == type(found)((), ())
