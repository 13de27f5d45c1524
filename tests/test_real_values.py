"""Measured costing runs every node on the values the real forward produces (issue 10, item 2).

Timing re-runs each node; a node that writes in place (T5's relative-position
buckets, ``buckets += ...`` on an ``arange``, a step counter buffer, ``ReLU(inplace=True)``)
must neither compound its write over the re-runs nor leak it into the next pass.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

import partitioner
from partitioner.cost import nodes as cost
from partitioner.graph.capture import CapturedModel, capture
from partitioner.graph.meta import materialise
from partitioner.graph.values import propagate_values
from partitioner.plan import Plan
from partitioner.stagegraph import build_stage, stage_signature

METHODS = ["symbolic_trace", "export"]


def _captured(model: nn.Module, inputs: tuple[torch.Tensor, ...], method: str) -> CapturedModel:
    captured = capture(model, inputs, method=method)  # type: ignore[arg-type]
    propagate_values(captured.graph_module, inputs)
    return captured


class _Buckets(nn.Module):
    """The minimal T5: an index built from ``arange`` arithmetic, added to in place, looked up."""

    def __init__(self, buckets: int = 8) -> None:
        super().__init__()
        self.buckets = buckets
        self.bias = nn.Embedding(buckets, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        position = torch.arange(n, device=x.device)
        relative = position[None, :] - position[:, None]  # (n, n), in [-(n-1), n-1]
        index = (relative > 0).long() * (self.buckets // 2)
        index.add_(relative.abs().clamp(max=self.buckets // 2 - 1))  # in place: re-run, it compounds
        return x @ self.bias(index).sum(-1)


class _Counter(nn.Module):
    """A step counter buffer, advanced in place by forward and used as an index."""

    step: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(2, 8)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)  # 0 -> 1: a valid row only for the real (first) forward
        return x * self.table(self.step)


class _InPlaceReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.act(h)  # writes h: the read below must see the write
        return self.out(h)


class _Recording(fx.Interpreter):
    """Records a detached copy of every node's output in ``values`` (a mixin for interpreters)."""

    def __init__(self, gm: fx.GraphModule, **kwargs: Any) -> None:
        super().__init__(gm, **kwargs)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.values[n.name] = pytree.tree_map(
            lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, result
        )
        return result


class _Values(_Recording, cost._CostInterpreter):
    """The cost interpreter, recording every node's output."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, measure=True, device=torch.device("cpu"), warmup=2, repeats=3, progress=None)


class _Reference(_Recording):
    """The plain interpreter, recording every node's output."""


def _assert_same_values(model: nn.Module, inputs: tuple[torch.Tensor, ...], method: str) -> None:
    """Every node's value in the timing pass is the plain forward's, bit for bit."""
    captured = _captured(model, inputs, method)
    gm = captured.graph_module
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    reference = _Reference(gm)
    reference.run(*inputs)
    gm.load_state_dict(state)  # the plain run advanced any counter; start the timed run where it started
    timed = _Values(gm)
    with torch.enable_grad():
        timed.run(*inputs)
    assert timed.costs  # something was timed
    for name, value in reference.values.items():
        got = timed.values[name]
        for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(value), strict=True):
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b), f"node {name} ran on other values than the real forward's"
            else:
                assert a == b, name


@pytest.mark.parametrize("method", METHODS)
def test_index_from_arange_arithmetic_feeds_embedding_measured(method: str) -> None:
    """The minimal reproduction: "index out of range in self" before the fix."""
    torch.manual_seed(0)
    model, inputs = _Buckets(), (torch.randn(3, 6),)
    costs = cost.profile(_captured(model, inputs, method), inputs, measure=True, warmup=2, repeats=3)
    assert any(c.forward_s > 0 for c in costs.values())
    _assert_same_values(model, inputs, method)


@pytest.mark.parametrize("method", METHODS)
def test_index_from_arange_plans_measured_and_predicted(method: str) -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(4, 6),)
    for device in ("cpu", "h100"):
        plan = partitioner.compile(_Buckets(), inputs, gpus=1, microbatches=2, device=device,
                                   capture_method=method)  # type: ignore[arg-type]
        assert plan.pp == 1 and plan.predicted.step_s > 0


@pytest.mark.parametrize("method", METHODS)
def test_in_place_relu_on_an_activation(method: str) -> None:
    """Autograd refuses in-place writes to a leaf: the node runs on a copy, written back."""
    torch.manual_seed(0)
    model, inputs = _InPlaceReLU(), (torch.randn(4, 8),)
    for measure in (False, True):
        costs = cost.profile(_captured(model, inputs, method), inputs, measure=measure, warmup=1, repeats=2)
        relu = next(c for name, c in costs.items() if "relu" in name or name == "act")
        assert relu.io_bytes > 0  # an in-place op moves bytes, although its output aliases its input
    _assert_same_values(model, inputs, method)


def test_buffer_written_in_forward_is_not_advanced_by_timing() -> None:
    torch.manual_seed(0)
    model, inputs = _Counter(), (torch.randn(4, 8),)
    captured = _captured(model, inputs, "export")
    costs = cost.profile(captured, inputs, measure=True, warmup=2, repeats=3)
    assert any(c.forward_s > 0 for c in costs.values())
    assert int(model.step) == 0  # the user's model is left alone
    _assert_same_values(model, inputs, "export")


# ----------------------------------------------------------------- meta models


class _IndexBuffer(nn.Module):
    """Has ``reset_parameters()`` for its weight, and an index buffer it does not reset."""

    index: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(16, 4))
        self.register_buffer("index", torch.arange(1000) % 16)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight[self.index[: x.size(1)]]


def test_meta_buffer_not_reset_gets_a_placeholder_not_empty_memory() -> None:
    """``to_empty`` memory is garbage: an index buffer of it would index anywhere."""
    with torch.device("meta"):
        model = _IndexBuffer()
    made = materialise(model, "", torch.device("cpu"))  # type: ignore[arg-type]
    assert torch.equal(made["index"], torch.zeros(1000, dtype=torch.long))  # placeholder: index 0
    assert made["weight"].std() > 0.5  # reset_parameters() ran: N(0, 1)
    inputs = (torch.randn(2, 8),)
    plan = partitioner.compile(model, inputs, gpus=1, microbatches=1, device="cpu")
    assert plan.predicted.step_s > 0


# ----------------------------------------------------------------- Hugging Face encoder-decoders


class _Seq2Seq(nn.Module):
    """Positional (input_ids, decoder_input_ids), as the model-file convention passes them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


def _t5(device: str = "cpu") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                                   vocab_size=128, d_kv=16)
    torch.manual_seed(0)
    with torch.device(device):
        return _Seq2Seq(transformers.T5ForConditionalGeneration(config).eval())


def _bart(device: str = "cpu") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                     vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    with torch.device(device):
        return _Seq2Seq(transformers.BartForConditionalGeneration(config).eval())


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (4, 16), generator=generator), torch.randint(0, 128, (4, 8), generator=generator)


def _run_stages(plan: Plan, model: nn.Module, micro: tuple[torch.Tensor, ...]) -> Any:
    """Every stage module built from the plan, fed in order: the split is a valid pipeline."""
    from runtime.execute.stage import recapture

    captured, infos = recapture(plan, model)  # once, as every rank does; it checks boundary shapes
    statics = {name: info.static for name, info in infos.items() if info.kind == "static"}
    env: dict[str, Any] = dict(zip(captured.input_names, micro))
    for stage in plan.stages:
        sig = stage_signature(stage, model_outputs=plan.model.outputs, last=stage.index == plan.pp - 1)
        module = build_stage(captured, stage.nodes, sig, statics=statics)
        results = module(*[env[n] for n in sig.model_inputs], *[env[n] for n in sig.received])
        env.update(zip((*sig.sent, *sig.outputs), results))
    return captured.unflatten_outputs([env[n] for n in plan.model.outputs])


def test_t5_relative_position_buckets_measured_on_real_values() -> None:
    """The issue's report: T5's buckets (`arange`, then `+=`) failed measured costing."""
    model, inputs = _t5(), _ids()
    captured = _captured(model, inputs, "export")
    costs = cost.profile(captured, inputs, measure=True, warmup=1, repeats=2)
    assert costs.keys() == {n for n, c in _kinds(captured).items() if c in ("compute", "constant")}
    assert any(c.forward_s > 0 for c in costs.values())


def _kinds(captured: CapturedModel) -> dict[str, Any]:
    from partitioner.graph.ir import KIND_KEY

    return {n.name: n.meta.get(KIND_KEY) for n in captured.graph_module.graph.nodes}


_T5_SLOW = pytest.mark.slow  # about 4-6 s: T5's export capture twice and its 238-block ILP


@pytest.mark.parametrize("device", ["cpu", "h100"])
@pytest.mark.parametrize("build", [pytest.param(_t5, marks=_T5_SLOW), _bart], ids=["t5", "bart"])
def test_encoder_decoder_plans_in_two_valid_stages(build: Any, device: str) -> None:
    model, inputs = build(), _ids()
    plan = partitioner.compile(model, inputs, gpus=2, pp=2, dp=1, microbatches=2, device=device)
    assert plan.pp == 2 and plan.predicted.step_s > 0
    assert all(stage.compute_nodes > 0 for stage in plan.stages)
    assert all(b.source < b.target for stage in plan.stages for b in stage.inputs)
    micro = tuple(x[:2] for x in inputs)
    torch.testing.assert_close(_run_stages(plan, model, micro), model(*micro))  # (captured with grad on)


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_meta_encoder_decoder_plans_measured(build: Any) -> None:
    """Layer by layer on placeholders: T5's buckets are computed in the graph, from `arange`."""
    plan = partitioner.compile(build("meta"), _ids(), gpus=2, pp=2, dp=1, microbatches=2, device="cpu")
    assert plan.pp == 2 and plan.device.endswith("(measured)")
