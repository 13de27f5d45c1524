"""Coarsening: consecutive blocks covering every compute node, within max_blocks, split-safe."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from _examples import example as _example
from torch import fx, nn

from partitioner.graph.capture import capture
from partitioner.graph.ir import KIND_KEY, VALUE_KEY, compute_nodes, module_path
from partitioner.graph.values import propagate_values
from partitioner.solve.coarsen import coarsen

ROOT = Path(__file__).resolve().parent.parent




def _graph(model: nn.Module, inputs: tuple[torch.Tensor, ...], method: str = "export") -> fx.GraphModule:
    captured = capture(model, inputs, method=method)  # type: ignore[arg-type]
    propagate_values(captured.graph_module, inputs)
    return captured.graph_module


@pytest.fixture(scope="module")
def graphs() -> dict[str, fx.GraphModule]:
    gpt = _example("gpt")
    cnn = _example("cnn")
    return {
        "gpt-export": _graph(gpt.build_model(), gpt.example_inputs(2)),
        "gpt-trace": _graph(gpt.build_model(gpt.GPTConfig(n_layer=2)), gpt.example_inputs(2), "symbolic_trace"),
        "cnn-export": _graph(cnn.build_model(), cnn.example_inputs(2)),
    }


def _check_blocks(gm: fx.GraphModule, blocks: list[tuple[str, ...]], max_blocks: int) -> None:
    order = [n.name for n in compute_nodes(gm)]
    assert 1 <= len(blocks) <= max_blocks
    assert all(blocks), "empty block"
    flat = [name for block in blocks for name in block]
    assert flat == order  # consecutive runs, graph order, every compute node exactly once
    assert len(set(flat)) == len(flat)


def _boundaries(blocks: list[tuple[str, ...]]) -> set[int]:
    """Positions (in compute order) where a new block starts."""
    starts, position = set(), 0
    for block in blocks:
        starts.add(position)
        position += len(block)
    return starts


def _depth_runs(gm: fx.GraphModule, depth: int) -> int:
    keys = [tuple(module_path(n).split(".")[:depth]) if module_path(n) else () for n in compute_nodes(gm)]
    return 1 + sum(1 for a, b in itertools.pairwise(keys) if a != b)


def test_docstring_example() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    gm = _graph(m, (torch.randn(2, 4),))
    assert [list(b) for b in coarsen(gm, max_blocks=8)] == [["linear"], ["relu"], ["linear_1"]]
    assert [list(b) for b in coarsen(gm, max_blocks=1)] == [["linear", "relu", "linear_1"]]


@pytest.mark.parametrize("name", ["gpt-export", "gpt-trace", "cnn-export"])
def test_blocks_cover_compute_nodes_in_order(graphs: dict[str, fx.GraphModule], name: str) -> None:
    gm = graphs[name]
    n = len(compute_nodes(gm))
    for max_blocks in (1, 2, 3, 5, 8, 9, 16, 33, 64, n - 1, n, n + 1, 256):
        _check_blocks(gm, coarsen(gm, max_blocks=max_blocks), max_blocks)


def test_compute_nodes_are_only_compute(graphs: dict[str, fx.GraphModule]) -> None:
    gm = graphs["gpt-export"]
    names = {n.name for n in compute_nodes(gm)}
    assert "arange" not in names  # a constant, recomputed by every stage
    assert "idx" not in names
    assert all(n.meta[KIND_KEY] == "compute" for n in compute_nodes(gm))
    in_blocks = {name for block in coarsen(gm, max_blocks=256) for name in block}
    assert in_blocks == names


@pytest.mark.parametrize("name", ["gpt-export", "gpt-trace"])
def test_split_stays_with_its_getitems(graphs: dict[str, fx.GraphModule], name: str) -> None:
    gm = graphs[name]
    bundles = [n for n in compute_nodes(gm) if n.meta[VALUE_KEY].kind == "bundle"]
    assert bundles, "the GPT attention splits q, k, v"
    n = len(compute_nodes(gm))
    for max_blocks in (4, 9, 20, 40, 60, n, 256):
        blocks = coarsen(gm, max_blocks=max_blocks)
        block_of = {node: b for b, block in enumerate(blocks) for node in block}
        for bundle in bundles:
            readers = [u.name for u in bundle.users]
            assert readers
            assert {block_of[r] for r in readers} == {block_of[bundle.name]}, (max_blocks, bundle.name)


def test_split_spanning_other_nodes_is_not_cut() -> None:
    class Spread(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = self.a(x).split(4, dim=1)
            h = self.b(parts[0])  # a different module between the two readers
            return self.c(h) + parts[1]

    gm = _graph(Spread(), (torch.randn(2, 4),), "symbolic_trace")
    order = [n.name for n in compute_nodes(gm)]
    assert order.index("getitem") < order.index("b") < order.index("getitem_1")
    for max_blocks in (2, 3, 100):
        blocks = coarsen(gm, max_blocks=max_blocks)
        _check_blocks(gm, blocks, max_blocks)
        block_of = {node: b for b, block in enumerate(blocks) for node in block}
        assert block_of["split"] == block_of["getitem"] == block_of["getitem_1"]
        assert block_of["b"] == block_of["split"]  # b sits between the two readers
    assert coarsen(gm, max_blocks=100) == [
        ("a",), ("split", "getitem", "b", "c", "getitem_1"), ("add",)]


def test_gpt_blocks_refine_whole_layers(graphs: dict[str, fx.GraphModule]) -> None:
    gm = graphs["gpt-export"]
    order = [n for n in compute_nodes(gm)]
    layers = sorted({module_path(n).split(".")[1] for n in order if module_path(n).startswith("blocks.")})
    assert layers == ["0", "1", "2", "3"]
    needed = _depth_runs(gm, 2)  # one run per layer plus the embedding, root and head runs
    assert needed <= 12
    n = len(order)
    for max_blocks in (needed, needed + 1, 2 * needed, 40, n, 256):
        blocks = coarsen(gm, max_blocks=max_blocks)
        _check_blocks(gm, blocks, max_blocks)
        starts = _boundaries(blocks)
        for layer in layers:
            positions = [i for i, node in enumerate(order)
                         if module_path(node).split(".")[:2] == ["blocks", layer]]
            first, last = positions[0], positions[-1]
            assert positions == list(range(first, last + 1))  # a layer is one run of the order
            assert first in starts, (max_blocks, layer)
            assert last + 1 in starts or last + 1 == n, (max_blocks, layer)


def test_finer_blocks_when_allowed(graphs: dict[str, fx.GraphModule]) -> None:
    gm = graphs["gpt-export"]
    n = len(compute_nodes(gm))
    kinds = {node.name: node.meta[VALUE_KEY].kind for node in compute_nodes(gm)}
    for block in coarsen(gm, max_blocks=n):  # every node on its own when it fits, bar bundles
        assert len(block) == 1 or kinds[block[0]] == "bundle", block
    sizes = [len(coarsen(gm, max_blocks=m)) for m in (9, 20, 40, 80, n)]
    assert sizes == sorted(sizes)  # more room never gives fewer blocks
    # Blocks at a coarser limit are unions of blocks at a finer one.
    fine = _boundaries(coarsen(gm, max_blocks=80))
    coarse = _boundaries(coarsen(gm, max_blocks=20))
    assert coarse <= fine


def test_max_blocks_below_the_module_count_still_splits() -> None:
    """20 sibling layers and room for 8 blocks: expect several blocks, not one."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)])
    gm = _graph(model, (torch.randn(2, 8),))
    blocks = coarsen(gm, max_blocks=8)
    _check_blocks(gm, blocks, 8)
    assert len(blocks) >= 4, f"20 layers coarsened into {len(blocks)} block(s) with max_blocks=8"


def test_empty_graph_has_no_blocks() -> None:
    class Nothing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    gm = _graph(Nothing(), (torch.randn(2, 3),), "symbolic_trace")
    assert coarsen(gm, max_blocks=4) == []


class _ShiftRight(torch.nn.Module):
    """Hugging Face's ``shift_tokens_right`` pattern: a base, a write into a view of it, the base read after."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # (B, 8)
        shifted = torch.zeros_like(h)
        shifted[:, 1:].copy_(h[:, :-1])
        return self.b(shifted)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_a_write_into_a_view_stays_with_its_base(method: str) -> None:
    """A view sent to another stage arrives as a tensor of its own: the write would never reach the base."""
    captured = capture(_ShiftRight(), (torch.randn(4, 8),), method=method)
    blocks = coarsen(captured.graph_module, max_blocks=100)
    block_of = {name: b for b, names in enumerate(blocks) for name in names}
    nodes = list(captured.graph_module.graph.nodes)
    base = next(n.name for n in nodes if "zeros_like" in str(n.target))
    write = next(n.name for n in nodes if "setitem" in str(n.target) or "copy_" in str(n.target))
    assert block_of[base] == block_of[write], blocks
    assert len(blocks) > 2  # the rest still splits
