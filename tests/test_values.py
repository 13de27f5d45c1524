"""Value propagation: tensor shapes and dtypes, static Python values, bundles, byte counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner.errors import CaptureError
from partitioner.graph.capture import capture
from partitioner.graph.ir import VALUE_KEY, ValueInfo, dtype_name
from partitioner.graph.values import propagate_values


class Net(nn.Module):
    """Reads a size, splits a tensor, embeds int64 ids and mixes dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 12)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = ids.size(1)
        h = self.emb(ids) + x  # (B, T, 6)
        a, b, c = self.lin(h).split(4, dim=2)  # 3 x (B, T, 4)
        y = (a * b + c).to(torch.float64)
        return y.view(-1, T * 4)  # (B, T*4) float64


def _inputs(batch: int = 3, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 10, (batch, seq), generator=g), torch.randn(batch, seq, 6, generator=g)


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_tensor_shapes_and_dtypes(method: str) -> None:
    inputs = _inputs()
    captured = capture(Net(), inputs, method=method)  # type: ignore[arg-type]
    infos = propagate_values(captured.graph_module, inputs)
    nodes = captured.nodes()
    assert set(infos) == set(nodes)
    for name, node in nodes.items():
        assert node.meta[VALUE_KEY] is infos[name]
    ids, x = captured.input_names
    assert infos[ids] == ValueInfo("tensor", (3, 5), "int64")
    assert infos[x] == ValueInfo("tensor", (3, 5, 6), "float32")
    (out,) = captured.output_nodes
    assert infos[out].kind == "tensor"
    assert infos[out].shape == (3, 20)
    assert infos[out].dtype == "float64"
    # Every tensor node's shape and dtype agree with a real run.
    real = dict(zip(captured.input_names, inputs))
    for node in captured.graph_module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: real[n.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: real[n.name])
        if node.op == "get_attr":
            value = captured.graph_module.get_parameter(str(node.target)) if "." in str(node.target) \
                else getattr(captured.graph_module, str(node.target))
        elif node.op == "call_module":
            value = captured.graph_module.get_submodule(str(node.target))(*args, **kwargs)
        elif node.op == "call_method":
            value = getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)  # type: ignore[operator]
        real[node.name] = value
        if isinstance(value, torch.Tensor):
            info = infos[node.name]
            assert info.kind == "tensor", node.name
            assert info.shape == tuple(value.shape), node.name
            assert info.dtype == dtype_name(value.dtype), node.name


def test_size_is_static_in_symbolic_trace() -> None:
    inputs = _inputs(seq=7)
    captured = capture(Net(), inputs, method="symbolic_trace")
    infos = propagate_values(captured.graph_module, inputs)
    sizes = [n for n in captured.graph_module.graph.nodes if n.op == "call_method" and n.target == "size"]
    assert len(sizes) == 1
    assert infos[sizes[0].name] == ValueInfo("static", static=7)
    assert infos[sizes[0].name].nbytes == 0
    # A whole-shape size() becomes a tuple of ints, not a torch.Size.
    class Shape(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view(x.size())

    captured = capture(Shape(), (torch.randn(2, 3),), method="symbolic_trace")
    infos = propagate_values(captured.graph_module, (torch.randn(2, 3),))
    (size,) = [n for n in captured.graph_module.graph.nodes if n.target == "size"]
    assert infos[size.name].kind == "static"
    assert infos[size.name].static == (2, 3)
    assert type(infos[size.name].static) is tuple


def test_static_values_follow_the_input_shape() -> None:
    captured = capture(Net(), _inputs(seq=5), method="symbolic_trace")
    infos = propagate_values(captured.graph_module, _inputs(seq=9))
    sizes = [n.name for n in captured.graph_module.graph.nodes if n.target == "size"]
    assert infos[sizes[0]].static == 9


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_split_is_a_bundle_and_its_items_are_tensors(method: str) -> None:
    inputs = _inputs()
    captured = capture(Net(), inputs, method=method)  # type: ignore[arg-type]
    infos = propagate_values(captured.graph_module, inputs)
    splits = [n for n in captured.graph_module.graph.nodes if "split" in str(n.target)]
    assert len(splits) == 1
    split = splits[0]
    assert infos[split.name].kind == "bundle"
    assert infos[split.name].nbytes == 0
    readers = list(split.users)
    assert len(readers) == 3
    for reader in readers:
        assert infos[reader.name] == ValueInfo("tensor", (3, 5, 4), "float32")


def test_nbytes_of_captured_nodes_match_real_tensors() -> None:
    inputs = _inputs()
    captured = capture(Net(), inputs, method="export")
    infos = propagate_values(captured.graph_module, inputs)
    ids, x = captured.input_names
    assert infos[ids].nbytes == inputs[0].numel() * 8
    assert infos[x].nbytes == inputs[1].numel() * 4
    (out,) = captured.output_nodes
    assert infos[out].nbytes == 3 * 20 * 8


def test_wrong_input_shapes_raise_capture_error() -> None:
    captured = capture(nn.Linear(4, 2), (torch.randn(3, 4),), method="export")
    with pytest.raises(CaptureError, match="Shape propagation failed"):
        propagate_values(captured.graph_module, (torch.randn(3, 5),))
