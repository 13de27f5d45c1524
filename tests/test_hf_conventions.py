"""Hugging Face calling conventions: dict and (args, kwargs) inputs, baked None and constants,
keyword-only arguments on both capture routes, and a model that returns its own loss.

All in one process and fast: plans are predicted for an H100 (deterministic splits) and
run with every stage in a thread (``inprocess.run_stages``), against the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import run_stages
from torch import Tensor, nn

from partitioner.errors import AutopartitionError, CaptureError
from partitioner.graph.capture import CallSpec, capture, model_loss, split_call
from partitioner.graph.values import propagate_values
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile

KW_NET = str(Path(__file__).parent / "models" / "kw_net.py")
TOLERANCE = 1e-5
ROUTES = ["symbolic_trace", "export"]


class KwOnly(nn.Module):
    """``forward(x, *, mask=None)``: the keyword-only shape of many Hugging Face modules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        h = torch.relu(self.a(x))
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return self.b(h)


def _eager(model: nn.Module, inputs: Any) -> Any:
    args, kwargs = split_call(inputs)
    return model(*args, **kwargs)


def _check_capture(model: nn.Module, inputs: Any, route: str) -> CallSpec:
    captured = capture(model, inputs, method=route)  # type: ignore[arg-type]
    assert captured.method == route
    flat = captured.call.flatten(inputs)
    assert len(flat) == len(captured.input_names) == len(captured.call.names)
    propagate_values(captured.graph_module, flat)
    got = captured.unflatten_outputs(captured.graph_module(*flat))
    torch.testing.assert_close(got, _eager(model, inputs), rtol=0, atol=0)
    return captured.call


# ------------------------------------------------------------------ inputs


@pytest.mark.parametrize("route", ROUTES)
def test_dict_inputs(route: str) -> None:
    mf = load_model_file(KW_NET)
    model, inputs = mf.build(), mf.example_inputs(4)
    # The model file adds the target as `labels`: (args, kwargs) with labels among the keywords.
    assert split_call(inputs)[1].keys() == {"x", "mask", "scale", "labels"}
    call = _check_capture(model, inputs, route)
    assert call.names == ("x", "mask", "labels")  # scale (0.5) is baked in
    assert call.kwargs["scale"] == 0.5


@pytest.mark.parametrize("route", ROUTES)
def test_args_and_kwargs_with_none(route: str) -> None:
    mf = load_model_file(KW_NET)
    x = mf.example_inputs(3)[1]["x"]
    call = _check_capture(mf.build(), ((x, None), {"scale": 2.0}), route)
    assert call.names == ("args[0]",) and call.args[1] is None


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("with_mask", [True, False])
def test_keyword_only_forward(route: str, with_mask: bool) -> None:
    x = torch.randn(3, 4)
    inputs: Any = {"x": x, "mask": x > 0} if with_mask else (x,)
    call = _check_capture(KwOnly(), inputs, route)
    assert len(call.names) == (2 if with_mask else 1)


def test_keyword_only_forward_auto_plans() -> None:
    """The issue's case: a tuple for ``forward(x, *, mask=None)`` once failed in shape propagation."""
    plan = compile(KwOnly(), (torch.randn(4, 4),), gpus=2, pp=2, microbatches=2, device="h100")
    assert plan.model.capture == "symbolic_trace" and len(plan.model.inputs) == 1


def test_flatten_checks_the_planned_structure() -> None:
    x, mask = torch.randn(2, 4), torch.ones(2, 4)
    call, flat = CallSpec.of(((x,), {"mask": mask, "scale": 0.5, "mode": "sum", "off": None}))
    assert call.names == ("args[0]", "mask") and len(flat) == 2
    assert call.flatten(((x,), {"off": None, "mode": "sum", "scale": 0.5, "mask": mask}))[1] is mask  # any key order
    assert call.flatten((x, mask))[0] is x  # already flat
    with pytest.raises(CaptureError, match=r"baked it into the graph as 0.5"):
        call.flatten(((x,), {"mask": mask, "scale": 0.25, "mode": "sum", "off": None}))
    with pytest.raises(CaptureError, match=r"keywords \['mask', 'mode', 'off', 'scale'\]"):
        call.flatten(((x,), {"mask": mask}))
    with pytest.raises(CaptureError, match="must be a tensor"):
        call.flatten(((x,), {"mask": None, "scale": 0.5, "mode": "sum", "off": None}))
    assert CallSpec.from_json(call.to_json()) == call


def test_model_loss() -> None:
    loss = torch.tensor(2.0)
    assert model_loss({"loss": loss, "logits": torch.ones(2)}) is loss
    assert model_loss(loss) is loss
    assert model_loss(torch.ones(2)) is None and model_loss({"logits": torch.ones(2)}) is None
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=torch.ones(2))
    assert model_loss(out) is loss


def test_target_keyword_needs_example_target(tmp_path: Path) -> None:
    from partitioner.errors import ModelFileError

    path = tmp_path / "m.py"
    path.write_text("import torch\nmodel = torch.nn.Linear(4, 2)\ntarget_keyword = 'labels'\n"
                    "def example_inputs(b):\n    return (torch.randn(b, 4),)\n")
    with pytest.raises(ModelFileError, match="define example_target"):
        load_model_file(str(path))


# ------------------------------------------------------------- plan and run


def _plan(tmp_path: Path, route: str) -> tuple[Plan, Any]:
    mf = load_model_file(KW_NET)
    inputs = mf.example_inputs(8)
    plan = compile(mf.build(), inputs, gpus=2, pp=2, microbatches=4, device="h100",
                   capture_method=route)  # type: ignore[arg-type]
    plan.save(tmp_path)
    return Plan.load(tmp_path), inputs  # through plan.json: the call spec travels with the plan


@pytest.mark.parametrize("route", ROUTES)
def test_model_returned_loss_runs_pipelined(tmp_path: Path, route: str) -> None:
    mf = load_model_file(KW_NET)
    plan, inputs = _plan(tmp_path, route)
    assert [t.name for t in plan.model.inputs][-1] == "labels" and plan.pp == 2
    # labels enter the graph as an input that the stage computing the loss reads.
    readers = [s.index for s in plan.stages if "labels" in s.model_inputs]
    assert readers == [1], readers

    loss, grads = run_stages(plan, mf.build, inputs)  # no loss_fn: the model's own loss

    whole = mf.build()
    want = _eager(whole, inputs)["loss"]  # every micro-batch has as many tokens: means agree
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=TOLERANCE)
    expected = {n: p.grad for n, p in whole.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=TOLERANCE, msg=name)


def test_pipeline_passes_the_target_as_its_keyword(tmp_path: Path) -> None:
    """``step(inputs, target)`` without loss_fn: target becomes the one planned keyword the inputs lack."""
    from runtime.pipeline import Pipeline

    mf = load_model_file(KW_NET)
    _, inputs = _plan(tmp_path, "symbolic_trace")
    kwargs = split_call(inputs)[1]
    labels = kwargs.pop("labels")
    pipe = Pipeline.__new__(Pipeline)  # only the flattening: no process group needed
    pipe._loss_fn, pipe._target_keyword = None, None
    pipe._stages = (type("S", (), {"captured": capture(mf.build(), inputs)})(),)  # type: ignore[assignment]
    flat, target = pipe._flatten(kwargs, labels)
    assert target is None and flat[-1] is labels
    pipe._target_keyword = "labels"
    assert pipe._flatten(kwargs, labels)[0][-1] is labels


def test_a_model_without_a_loss_is_bad_input_not_a_bug() -> None:
    """No loss_fn and an output that is no loss: the step says what to pass, as bad input (exit 2), not as a
    fault of ours."""
    from runtime.execute.runner import StepFailure

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    inputs = (torch.randn(4, 8),)
    plan = compile(model, inputs, gpus=1, microbatches=2, schedule="1f1b", device="h100")
    with pytest.raises(StepFailure, match="carries no loss") as failure:
        run_stages(plan, lambda: model, inputs)
    assert isinstance(failure.value.__cause__, AutopartitionError)
