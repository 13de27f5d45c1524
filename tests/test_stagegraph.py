"""Stage graphs: stage modules of a compiled plan, composed by hand, reproduce the whole model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _examples import example as _example
from torch import fx, nn

from partitioner import compile
from partitioner.errors import PlanMismatchError
from partitioner.graph.capture import CapturedModel, capture
from partitioner.graph.ir import KIND_KEY, compute_nodes, graph_fingerprint, node_parameters
from partitioner.graph.values import propagate_values
from partitioner.plan import Plan
from partitioner.stagegraph import StageSignature, build_stage, closure, stage_signature

ROOT = Path(__file__).resolve().parent.parent




class Staged:
    """A compiled plan with the model captured at the plan's micro-batch and its stage modules."""

    def __init__(self, model: nn.Module, plan: Plan, micro: tuple[torch.Tensor, ...]) -> None:
        self.model, self.plan, self.micro = model, plan, micro
        self.captured: CapturedModel = capture(model, micro, method=plan.model.capture)  # type: ignore[arg-type]
        assert graph_fingerprint(self.captured.graph_module) == plan.model.fingerprint
        infos = propagate_values(self.captured.graph_module, micro)
        self.statics = {name: info.static for name, info in infos.items() if info.kind == "static"}
        self.signatures: list[StageSignature] = []
        self.modules: list[fx.GraphModule] = []
        for stage in plan.stages:
            sig = stage_signature(stage, model_outputs=plan.model.outputs, last=stage.index == plan.pp - 1)
            self.signatures.append(sig)
            self.modules.append(build_stage(self.captured, stage.nodes, sig, statics=self.statics))

    def run(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        """Feed every stage by name: model inputs, then tensors received from earlier stages."""
        env: dict[str, Any] = dict(zip(self.captured.input_names, inputs))
        for sig, module in zip(self.signatures, self.modules):
            args = [env[n] for n in sig.model_inputs] + [env[n] for n in sig.received]
            results = module(*args)
            assert isinstance(results, tuple)
            assert len(results) == len(sig.sent) + len(sig.outputs)
            for name, value in zip((*sig.sent, *sig.outputs), results):
                env[name] = value
        return self.captured.unflatten_outputs([env[n] for n in self.plan.model.outputs])


@pytest.fixture(scope="module")
def gpt_staged() -> Staged:
    gpt = _example("gpt")
    model = gpt.build_model()
    inputs = gpt.example_inputs(4)
    plan = compile(model, inputs, gpus=3, microbatches=2, device="h100", pp=3, capture_method="export")
    assert plan.pp == 3 and plan.dp == 1
    return Staged(model, plan, tuple(x[:2] for x in inputs))


class LateView(nn.Module):
    """Reads ``x.size(1)`` first and uses it only at the very end: a static across stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.reshape(-1, n * 2)


@pytest.fixture(scope="module")
def traced_staged() -> Staged:
    torch.manual_seed(0)
    model = LateView()
    inputs = (torch.randn(8, 32),)
    plan = compile(model, inputs, gpus=3, microbatches=2, device="h100", pp=3,
                   capture_method="symbolic_trace")
    return Staged(model, plan, tuple(x[:4] for x in inputs))


# ----------------------------------------------------------------- composition


def test_gpt_stages_compose_to_the_whole_model(gpt_staged: Staged) -> None:
    s = gpt_staged
    with torch.no_grad():
        whole = s.captured.unflatten_outputs(s.captured.graph_module(*s.micro))
        composed = s.run(s.micro)
        eager = s.model(*s.micro)
    assert torch.equal(composed, whole)  # exactly: the same ops on the same values
    torch.testing.assert_close(composed, eager, rtol=0, atol=1e-6)
    # Other data of the same shape, too.
    other = (torch.randint(0, 512, s.micro[0].shape, generator=torch.Generator().manual_seed(5)),)
    with torch.no_grad():
        assert torch.equal(s.run(other), s.captured.unflatten_outputs(s.captured.graph_module(*other)))


def test_gpt_gradients_match_when_composed(gpt_staged: Staged) -> None:
    s = gpt_staged
    s.model.zero_grad(set_to_none=True)
    s.run(s.micro).square().mean().backward()
    composed = {n: p.grad.clone() for n, p in s.model.named_parameters() if p.grad is not None}
    s.model.zero_grad(set_to_none=True)
    s.model(*s.micro).square().mean().backward()
    eager = {n: p.grad.clone() for n, p in s.model.named_parameters() if p.grad is not None}
    s.model.zero_grad(set_to_none=True)
    assert composed.keys() == eager.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(composed[name], grad, rtol=1e-5, atol=1e-6)


def test_stage_signatures_chain(gpt_staged: Staged) -> None:
    s = gpt_staged
    produced: set[str] = set()
    for stage, sig in zip(s.plan.stages, s.signatures):
        assert set(sig.received) <= produced  # everything received was sent earlier
        assert sig.received == tuple(dict.fromkeys(b.producer for b in stage.inputs))
        assert sig.sent == tuple(dict.fromkeys(b.producer for b in stage.outputs))
        produced |= set(sig.sent)
        placeholders = [n.name for n in s.modules[stage.index].graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == len(sig.model_inputs) + len(sig.received)
    assert s.signatures[0].model_inputs == ("idx",)
    assert s.signatures[-1].outputs == s.plan.model.outputs
    assert all(sig.outputs == () for sig in s.signatures[:-1])


# ----------------------------------------------------------------- parameters


def test_each_stage_holds_only_its_parameters(gpt_staged: Staged) -> None:
    s = gpt_staged
    original = dict(s.model.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    for stage, module in zip(s.plan.stages, s.modules):
        names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        assert names, stage.index
        assert set(names) <= set(original)  # the user's names, not graph names like blocks_0_...
        assert set(names) == set(stage.parameters)
        for name, param in module.named_parameters(remove_duplicate=False):
            assert param is original[name]  # the model's own tensors, not copies
            seen.add(id(param))
        # No parameter of another layer sneaks in: a stage's parameters are those its nodes read.
        gm = s.captured.graph_module
        read = {str(n.target) for n in gm.graph.nodes if n.name in stage.nodes and n.meta[KIND_KEY] == "parameter"}
        read |= {p for n in gm.graph.nodes if n.name in stage.nodes and n.op == "call_module"
                 for p in node_parameters(gm, n)}
        assert set(names) == read
    assert seen == {id(p) for p in s.model.parameters()}  # together: every parameter
    # Untied parameters live in exactly one stage; the tied embedding in the first and last.
    holders: dict[str, list[int]] = {}
    for stage in s.plan.stages:
        for name in stage.parameters:
            holders.setdefault(name, []).append(stage.index)
    shared = {n: h for n, h in holders.items() if len(h) > 1}
    assert set(shared) <= {"wte.weight", "lm_head.weight"}
    assert all(h == [0, 2] for h in shared.values())
    for stage in s.plan.stages[1:-1]:
        assert not {"wte.weight", "lm_head.weight"} & set(stage.parameters)


def test_stage_buffers_and_constants_are_local(gpt_staged: Staged) -> None:
    s = gpt_staged
    for stage, module in zip(s.plan.stages, s.modules):
        buffers = {n for n, _ in module.named_buffers()}
        masked = {str(n.target) for n in s.captured.graph_module.graph.nodes
                  if n.name in stage.nodes and n.meta[KIND_KEY] == "buffer"}
        assert buffers == masked
        # A stage that runs a layer's attention has that layer's mask.
        for name in stage.nodes:
            if name.startswith("masked_fill"):
                layer = s.captured.nodes()[name].meta["nn_module_stack"]
                path = str(list(layer.values())[-1][0])
                assert f"{path}.mask" in buffers, path
        # The causal mask is recomputed from the buffer in every stage, never sent.
        for b in stage.inputs:
            kind = s.captured.nodes()[b.producer].meta[KIND_KEY]
            assert kind == "compute", b.producer


def test_closure_adds_what_compute_reads(gpt_staged: Staged) -> None:
    gm = gpt_staged.captured.graph_module
    names = closure(gm, {"linear", "masked_fill"})
    order = [n.name for n in gm.graph.nodes]
    assert names == sorted(names, key=order.index)  # graph order
    assert "blocks_0_attn_c_attn_weight" in names and "blocks_0_attn_c_attn_bias" in names
    assert "blocks_0_attn_mask" in names  # via the constant mask slice
    assert "bitwise_not" in names
    assert "layer_norm" not in names  # compute nodes are not pulled in


# ----------------------------------------------------------------- statics


def test_statics_are_baked_in_by_hand() -> None:
    torch.manual_seed(0)
    model = LateView()
    micro = (torch.randn(4, 32),)
    captured = capture(model, micro, method="symbolic_trace")
    infos = propagate_values(captured.graph_module, micro)
    statics = {name: info.static for name, info in infos.items() if info.kind == "static"}
    assert statics == {"size": 32, "mul": 64}
    order = [n.name for n in compute_nodes(captured.graph_module)]
    cut = order.index("layers_3") + 1
    first = set(order[:cut]) | {"size", "mul"}  # the sizes are computed in the first stage
    second = [n for n in order if n not in first]
    sig0 = StageSignature(("x",), (), ("layers_3",), ())
    sig1 = StageSignature((), ("layers_3",), (), tuple(captured.output_nodes))
    gm0 = build_stage(captured, closure(captured.graph_module, first), sig0, statics=statics)
    gm1 = build_stage(captured, closure(captured.graph_module, set(second)), sig1, statics=statics)
    assert [n.name for n in gm1.graph.nodes if n.op == "placeholder"] == ["recv_layers_3"]
    reshape = next(n for n in gm1.graph.nodes if n.name == "reshape")
    assert 64 in reshape.args  # the literal, not a value received from stage 0
    assert "64" in gm1.code
    with torch.no_grad():
        (sent,) = gm0(*micro)
        (out,) = gm1(sent)
        torch.testing.assert_close(out, model(*micro), rtol=0, atol=0)


def test_compiled_statics_are_never_sent(traced_staged: Staged) -> None:
    s = traced_staged
    assert s.plan.model.capture == "symbolic_trace"
    stage_of = {name: st.index for st in s.plan.stages for name in st.nodes}
    for stage, module in zip(s.plan.stages, s.modules):
        assert not {b.producer for b in stage.inputs} & set(s.statics)
        for node in module.graph.nodes:
            original = s.captured.nodes().get(node.name)
            if original is None or node.op == "placeholder":
                continue
            for arg in original.all_input_nodes:
                if arg.name in s.statics and stage_of.get(arg.name) != stage.index:
                    assert s.statics[arg.name] in node.args, (node.name, arg.name)
    with torch.no_grad():
        composed = s.run(s.micro)
        assert torch.equal(composed, s.captured.graph_module(*s.micro)[0])
        torch.testing.assert_close(composed, s.model(*s.micro), rtol=0, atol=0)


def test_missing_value_is_a_plan_mismatch(gpt_staged: Staged) -> None:
    s = gpt_staged
    stage = s.plan.stages[1]
    sig = stage_signature(stage, model_outputs=s.plan.model.outputs, last=False)
    starved = StageSignature(sig.model_inputs, (), sig.sent, sig.outputs)  # receives nothing
    with pytest.raises(PlanMismatchError, match="neither computes"):
        build_stage(s.captured, stage.nodes, starved, statics=s.statics)
    with pytest.raises(PlanMismatchError, match="does not have"):
        build_stage(s.captured, (*stage.nodes, "no_such_node"), sig, statics=s.statics)
