"""Capture: export / symbolic_trace routes, module paths, node kinds, ties, outputs, errors."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from _examples import example as _example
from torch import fx, nn

from partitioner.errors import CaptureError
from partitioner.graph import capture as capture_mod
from partitioner.graph.capture import CapturedModel, capture
from partitioner.graph.ir import KIND_KEY, compute_nodes, module_path, node_parameters

ROOT = Path(__file__).resolve().parent.parent




def _run(captured: CapturedModel, inputs: tuple[torch.Tensor, ...]) -> Any:
    flat = captured.graph_module(*inputs)
    assert isinstance(flat, tuple)
    return captured.unflatten_outputs(flat)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _kinds(captured: CapturedModel) -> dict[str, str]:
    return {n.name: n.meta[KIND_KEY] for n in captured.graph_module.graph.nodes}


def _target_name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


@pytest.fixture(scope="module")
def gpt() -> types.ModuleType:
    return _example("gpt")


@pytest.fixture(scope="module")
def gpt_captured(gpt: types.ModuleType) -> tuple[nn.Module, tuple[torch.Tensor, ...], CapturedModel]:
    model = gpt.build_model()
    inputs = gpt.example_inputs(2)
    return model, inputs, capture(model, inputs, method="export")


# ----------------------------------------------------------------- routes


def test_plain_module_via_export() -> None:
    model, x = _mlp(), (torch.randn(3, 8),)
    captured = capture(model, x, method="export")
    assert captured.method == "export"
    ops = [n.op for n in captured.graph_module.graph.nodes]
    assert "call_module" not in ops  # aten-level graph
    assert len(captured.input_names) == 1
    assert len(captured.output_nodes) == 1
    torch.testing.assert_close(_run(captured, x), model(*x), rtol=0, atol=0)


def test_plain_module_via_symbolic_trace() -> None:
    model, x = _mlp(), (torch.randn(3, 8),)
    captured = capture(model, x, method="symbolic_trace")
    assert captured.method == "symbolic_trace"
    modules = [str(n.target) for n in captured.graph_module.graph.nodes if n.op == "call_module"]
    assert modules == ["0", "1", "2"]  # module-level graph
    torch.testing.assert_close(_run(captured, x), model(*x), rtol=0, atol=0)
    # Parameters of call_module nodes are found through the submodule.
    gm = captured.graph_module
    first = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert sorted(node_parameters(gm, first)) == ["0.bias", "0.weight"]


def test_auto_prefers_symbolic_trace() -> None:
    captured = capture(_mlp(), (torch.randn(3, 8),))
    assert captured.method == "symbolic_trace"


def test_auto_falls_back_to_export(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("tracing is unavailable here")

    monkeypatch.setattr(capture_mod, "_trace", broken)
    model, x = _mlp(), (torch.randn(3, 8),)
    captured = capture(model, x, method="auto")
    assert captured.method == "export"
    torch.testing.assert_close(_run(captured, x), model(*x), rtol=0, atol=0)
    with pytest.raises(CaptureError, match="tracing is unavailable here"):
        capture(model, x, method="symbolic_trace")


# ----------------------------------------------------------------- GPT graph


def test_gpt_module_paths_are_user_names(gpt_captured: Any) -> None:
    model, _, captured = gpt_captured
    gm = captured.graph_module
    compute = compute_nodes(gm)
    paths = {module_path(n) for n in compute}
    expected = {"wte", "wpe", "ln_f", "lm_head"}
    for i in range(model.config.n_layer):
        expected |= {f"blocks.{i}.ln_1", f"blocks.{i}.attn", f"blocks.{i}.attn.c_attn",
                     f"blocks.{i}.attn.c_proj", f"blocks.{i}.ln_2", f"blocks.{i}.mlp.c_fc",
                     f"blocks.{i}.mlp.c_proj", f"blocks.{i}"}
    assert expected <= paths
    user_modules = {name for name, _ in model.named_modules()}
    for path in paths:
        assert path in user_modules, path  # "" is the root module's name
    # Specific nodes sit in their module: the attention projections and the softmax.
    by_name = {n.name: n for n in compute}
    assert module_path(by_name["linear"]) == "blocks.0.attn.c_attn"
    assert module_path(by_name["softmax"]) == "blocks.0.attn"
    assert module_path(by_name["embedding"]) == "wte"


def test_guard_and_assert_nodes_are_dropped() -> None:
    class Casts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.to(torch.float32)).double()

    model, x = Casts(), (torch.randn(2, 4, dtype=torch.float64),)
    raw = torch.export.export(model, x, strict=False).module()
    raw_targets = " ".join(str(n.target) for n in raw.graph.nodes)
    # The raw export has both kinds, so the check below is meaningful.
    assert "_guards_fn" in raw_targets and "_assert_tensor_metadata" in raw_targets
    captured = capture(model, x, method="export")
    for node in captured.graph_module.graph.nodes:
        assert "_assert_tensor_metadata" not in str(node.target)
        assert "_guards_fn" not in str(node.target)
        assert "_assert" not in _target_name(node)
    torch.testing.assert_close(_run(captured, x), model(*x))


def test_gpt_has_no_guard_nodes(gpt_captured: Any) -> None:
    _, _, captured = gpt_captured
    for node in captured.graph_module.graph.nodes:
        assert "_assert_tensor_metadata" not in str(node.target)
        assert "_guards_fn" not in str(node.target)


def test_gpt_node_kinds(gpt_captured: Any) -> None:
    model, _, captured = gpt_captured
    gm = captured.graph_module
    kinds = _kinds(captured)
    nodes = captured.nodes()
    assert kinds["idx"] == "input"
    assert kinds["output"] == "output"
    params = {n.name for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) in
              {k for k, _ in gm.named_parameters(remove_duplicate=False)}}
    assert params and all(kinds[p] == "parameter" for p in params)
    masks = [n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).endswith("attn.mask")]
    assert len(masks) == model.config.n_layer
    assert all(kinds[m.name] == "buffer" for m in masks)
    # The mask slice (narrow of a buffer) and arange (of a size) are recomputed in every stage.
    assert kinds["arange"] == "constant"
    for mask in masks:
        for user in mask.users:
            assert kinds[user.name] == "constant", user.format_node()
    assert any(_target_name(n).startswith("narrow") and kinds[n.name] == "constant" for n in nodes.values())
    # Anything that reads the input or a parameter is compute.
    for name in ("embedding", "linear", "softmax", "masked_fill"):
        assert kinds[name] == "compute", name
    compute = [n for n in nodes.values() if kinds[n.name] == "compute"]
    for node in compute:
        assert node.op in ("call_function", "call_method", "call_module")
    for node in nodes.values():
        if kinds[node.name] == "constant":
            assert all(kinds[a.name] in ("buffer", "constant") for a in node.all_input_nodes)


def test_random_ops_are_compute_even_without_inputs() -> None:
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand(4)

    captured = capture(Noisy(), (torch.randn(2, 4),), method="export")
    kinds = _kinds(captured)
    rand = [n for n in captured.nodes().values() if "rand" in _target_name(n)]
    assert rand and all(kinds[n.name] == "compute" for n in rand)


def test_buffers_and_their_slices_in_a_plain_module() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.arange(8.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale: torch.Tensor = self.scale  # type: ignore[assignment]
            return self.lin(x) * scale[:4]

    captured = capture(Scaled(), (torch.randn(2, 4),), method="export")
    kinds = _kinds(captured)
    scale = next(n for n in captured.nodes().values() if n.op == "get_attr" and str(n.target) == "scale")
    assert kinds[scale.name] == "buffer"
    assert [kinds[u.name] for u in scale.users] == ["constant"]
    weight = next(n for n in captured.nodes().values() if str(n.target) == "lin.weight")
    assert kinds[weight.name] == "parameter"


def test_gpt_tied_parameters(gpt_captured: Any) -> None:
    model, _, captured = gpt_captured
    assert model.lm_head.weight is model.wte.weight
    assert captured.tied_parameters() == {"wte.weight": ["lm_head.weight", "wte.weight"]}
    assert captured.parameter_names["lm_head.weight"] == "wte.weight"
    assert captured.parameter_names["wte.weight"] == "wte.weight"
    # Untied parameters map to themselves.
    assert captured.parameter_names["blocks.0.attn.c_attn.weight"] == "blocks.0.attn.c_attn.weight"


def test_no_ties_without_tying() -> None:
    captured = capture(_mlp(), (torch.randn(3, 8),))
    assert captured.tied_parameters() == {}


def test_gpt_outputs_match_eager(gpt_captured: Any) -> None:
    model, inputs, captured = gpt_captured
    with torch.no_grad():
        torch.testing.assert_close(_run(captured, inputs), model(*inputs), rtol=0, atol=1e-6)


def test_gpt_symbolic_trace_matches_eager(gpt: types.ModuleType) -> None:
    model = gpt.build_model(gpt.GPTConfig(n_layer=1))
    inputs = gpt.example_inputs(2)
    captured = capture(model, inputs, method="symbolic_trace")
    assert captured.method == "symbolic_trace"
    paths = {module_path(n) for n in captured.graph_module.graph.nodes}
    assert {"blocks.0.attn.c_attn", "blocks.0.attn", "lm_head"} <= paths
    assert captured.tied_parameters() == {"wte.weight": ["lm_head.weight", "wte.weight"]}
    with torch.no_grad():
        torch.testing.assert_close(_run(captured, inputs), model(*inputs), rtol=0, atol=1e-6)


# ----------------------------------------------------------------- outputs


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_dict_output_unflattens_to_a_dict(method: str) -> None:
    two = _example("two_inputs")
    model = two.build_model()
    inputs = two.example_inputs(4)
    captured = capture(model, inputs, method=method)  # type: ignore[arg-type]
    assert len(captured.input_names) == 2
    assert len(captured.output_nodes) == 2
    out = _run(captured, inputs)
    ref = model(*inputs)
    assert isinstance(out, dict)
    assert list(out) == list(ref) == ["logits", "aux"]
    for key in ref:
        assert out[key].shape == ref[key].shape
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-6)


def test_tuple_output_keeps_its_structure() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            h = self.a(x)
            return h, (h.relu(), h.sigmoid())

    model, x = Pair(), (torch.randn(2, 4),)
    for method in ("export", "symbolic_trace"):
        captured = capture(model, x, method=method)  # type: ignore[arg-type]
        flat = captured.graph_module(*x)
        assert isinstance(flat, tuple) and len(flat) == 3  # the graph returns a flat tuple
        out = captured.unflatten_outputs(flat)
        ref = model(*x)
        assert isinstance(out, tuple) and isinstance(out[1], tuple)
        torch.testing.assert_close(out, ref)


# ----------------------------------------------------------------- Hugging Face


def _assert_hf_matches(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> CapturedModel:
    captured = capture(model, inputs, method="export")
    assert captured.method == "export"
    with torch.no_grad():
        out = _run(captured, inputs)
        ref = model(*inputs)
    assert type(out) is type(ref)
    assert list(out.keys()) == list(ref.keys())
    for key in ref:
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-5)
    paths = {module_path(n) for n in captured.graph_module.graph.nodes}
    assert all("L__self__" not in p for p in paths)
    return captured


def test_hf_gpt2_from_config_captures_with_export() -> None:
    pytest.importorskip("transformers")
    hf = _example("hf_gpt2")
    model = hf.build_model()
    inputs = hf.example_inputs(2)
    captured = _assert_hf_matches(model, inputs)
    paths = {module_path(n) for n in captured.graph_module.graph.nodes}
    assert "transformer.h.0.attn" in paths or "transformer.h.0.attn.c_attn" in paths
    assert captured.tied_parameters()  # lm_head is tied to wte


def test_hf_bert_from_config_captures_with_export() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    captured = _assert_hf_matches(model, (ids,))
    paths = {module_path(n) for n in captured.graph_module.graph.nodes}
    assert any(p.startswith("bert.encoder.layer.1") for p in paths)


# ----------------------------------------------------------------- errors

_UNTRACEABLE = '''\
import torch
from torch import fx, nn


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x
'''
_BAD_LINE = 11


@pytest.fixture
def untraceable(tmp_path: Path) -> tuple[nn.Module, Path]:
    path = tmp_path / "untraceable_model.py"
    path.write_text(_UNTRACEABLE)
    assert path.read_text().splitlines()[_BAD_LINE - 1].strip() == "if x.sum() > 0:"
    spec = importlib.util.spec_from_file_location("untraceable_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DataDependent(), path


@pytest.mark.parametrize("method", ["auto", "export", "symbolic_trace"])
def test_untraceable_model_names_file_line_and_source(
    untraceable: tuple[nn.Module, Path], method: str
) -> None:
    model, path = untraceable
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(2, 4),), method=method)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"{path}:{_BAD_LINE}" in message
    assert "if x.sum() > 0:" in message
    assert "DataDependent" in message
    if method == "auto":
        assert "export:" in message and "symbolic_trace:" in message


@pytest.mark.parametrize("bad", [object(), torch.float32, 1j])
def test_unsupported_example_input(bad: Any) -> None:
    with pytest.raises(CaptureError) as info:
        capture(_mlp(), (torch.randn(2, 8), bad))
    message = str(info.value)
    assert "Example input args[1]" in message
    assert type(bad).__name__ in message
    assert "None, bool, int, float or str" in message


@pytest.mark.parametrize("extra", [3, "text", None])
def test_constant_that_forward_does_not_take(extra: Any) -> None:
    with pytest.raises(CaptureError, match=r"do not fit forward\(input\)"):
        capture(_mlp(), (torch.randn(2, 8), extra))


def test_not_a_module() -> None:
    with pytest.raises(CaptureError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2),))  # type: ignore[arg-type]


def test_constant_output_is_rejected() -> None:
    class WithConstant(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return x * 2, 3

    with pytest.raises(CaptureError, match="constant"):
        capture(WithConstant(), (torch.randn(2, 4),), method="symbolic_trace")


def test_single_tensor_input_need_not_be_a_tuple() -> None:
    model, x = _mlp(), torch.randn(3, 8)
    captured = capture(model, x)  # type: ignore[arg-type]
    torch.testing.assert_close(_run(captured, (x,)), model(x))
