"""The block graph: the solver's DiGraph view, the plan's pictures, and plan.json left alone.

A compiled plan carries a :class:`~partitioner.solve.blockgraph.BlockGraph` in memory;
``Plan.save`` writes it as ``graph.png`` and ``blocks.graphml``, never into
``plan.json``, and ``autopartition show`` works from ``plan.json`` alone whether
the pictures are there or not.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import _brute
import networkx as nx
import pytest
import torch
from torch import nn

from partitioner import compile
from partitioner.plan import Plan, example_plan
from partitioner.report.graphfig import GRAPH_PNG, block_graph_png
from partitioner.report.markdown import report_markdown, write_report
from partitioner.solve.blockgraph import GRAPHML_FILE, Block, BlockGraph, problem_graph

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("seed", range(10))
def test_problem_graph_holds_blocks_costs_and_edges(seed: int) -> None:
    rng = random.Random(seed)
    problem = _brute.random_problem(rng, rng.randint(1, 8), kind=rng.choice(["chain", "dag", "sparse"]))
    g = problem_graph(problem)
    assert list(g.nodes) == list(range(problem.size))
    assert sorted(g.edges) == sorted(problem.edges)
    for v in g:
        assert g.nodes[v]["time_s"] == problem.time_s[v]
        assert g.nodes[v]["transfer_s"] == problem.transfer_s[v]
    assert nx.is_directed_acyclic_graph(g)


def small_graph() -> BlockGraph:
    """A diamond with a skip: 0 -> {1, 2} -> 3, stages 0 | 1 | 1 | 1."""
    blocks = (
        Block("stem", 2, 1e-3, 2e-3, 4096, 1024.0, 0),
        Block("left", 1, 2e-3, 4e-3, 0, 512.0, 1),
        Block("right/relu", 1, 0.0, 0.0, 0, 0.0, 1),
        Block("head", 3, 1e-3, 1e-3, 2048, 0.0, 1),
    )
    return BlockGraph(blocks, ((0, 1, 3 * 2**20), (0, 2, 1024.0), (1, 3, 64.0), (2, 3, 64.0)))


def test_block_graph_cut_edges_and_networkx() -> None:
    bg = small_graph()
    assert bg.stages == 2
    assert bg.cut_edges() == ((0, 1, 3 * 2**20), (0, 2, 1024.0))
    g = bg.to_networkx()
    assert g.nodes[1] == dataclasses.asdict(bg.blocks[1])
    assert g.edges[0, 1]["bytes"] == 3 * 2**20


def test_save_writes_png_and_graphml_that_reads_back(tmp_path: Path) -> None:
    bg = small_graph()
    graphml = bg.write_graphml(tmp_path)
    png = block_graph_png(bg, tmp_path / GRAPH_PNG, title="diamond")
    assert graphml.name == GRAPHML_FILE and png.read_bytes()[:8] == PNG
    back = nx.read_graphml(graphml, node_type=int)
    assert sorted(back.edges) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    for v, block in enumerate(bg.blocks):
        assert back.nodes[v]["stage"] == block.stage
        assert back.nodes[v]["name"] == block.name
        assert back.nodes[v]["forward_s"] == pytest.approx(block.forward_s)
        assert back.nodes[v]["parameter_bytes"] == block.parameter_bytes
    assert back.edges[0, 1]["bytes"] == 3 * 2**20


@pytest.mark.parametrize(("n", "wide"), [(1, False), (256, False), (41, True)])
def test_png_for_one_block_long_chains_and_wide_generations(tmp_path: Path, n: int, wide: bool) -> None:
    """One block; 256 blocks (wrapped into columns); 40 side by side (labels dropped)."""
    blocks = tuple(Block(f"layer.{v}", 1, 1e-4 * (v % 7), 1e-4, 0, 0.0, v * 4 // n) for v in range(n))
    if wide:
        edges = tuple((0, v, 8.0) for v in range(1, n - 1)) + tuple((v, n - 1, 8.0) for v in range(1, n - 1))
    else:
        edges = tuple((v, v + 1, 8.0) for v in range(n - 1)) + tuple((v, v + 5, 8.0) for v in range(0, n - 5, 5))
    path = block_graph_png(BlockGraph(blocks, edges), tmp_path / "graph.png")
    assert path.read_bytes()[:8] == PNG


def test_plan_json_does_not_change_and_pictures_are_optional(tmp_path: Path) -> None:
    plain, drawn = example_plan(), dataclasses.replace(example_plan(), block_graph=small_graph())
    assert drawn == plain  # in memory only: not part of the plan's identity
    Plan.save(plain, tmp_path / "plain")
    Plan.save(drawn, tmp_path / "drawn")
    assert (tmp_path / "drawn" / "plan.json").read_text() == (tmp_path / "plain" / "plan.json").read_text()
    assert "block_graph" not in (tmp_path / "drawn" / "plan.json").read_text()
    assert (tmp_path / "drawn" / GRAPHML_FILE).exists() and not (tmp_path / "plain" / GRAPHML_FILE).exists()
    # The picture is the report's: drawn from the block graph the plan carries in memory, pointed to by report.md.
    write_report(drawn, tmp_path / "drawn")
    write_report(plain, tmp_path / "plain")
    assert (tmp_path / "drawn" / GRAPH_PNG).read_bytes()[:8] == PNG and not (tmp_path / "plain" / GRAPH_PNG).exists()
    assert "](graph.png)" in (tmp_path / "drawn" / "report.md").read_text()
    assert "graph.png" not in (tmp_path / "plain" / "report.md").read_text()
    loaded = Plan.load(tmp_path / "drawn")
    assert loaded == plain and loaded.block_graph is None
    # The report mentions graph.png exactly when it is there; regenerating it needs plan.json only.
    assert "graph.png" in write_report(loaded, tmp_path / "drawn").read_text()
    assert "graph.png" not in write_report(Plan.load(tmp_path / "plain"), tmp_path / "plain").read_text()
    assert "graph.png" not in report_markdown(loaded, directory=tmp_path / "elsewhere")


class _Skip(nn.Module):
    """A long skip: the stem's output is added back after three layers."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.layers(h) + h)


def test_compiled_plan_carries_its_block_graph(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plan = compile(_Skip(), (torch.randn(8, 16),), gpus=3, pp=3, microbatches=2, device="h100")
    bg = plan.block_graph
    assert bg is not None and bg.stages == plan.pp == 3
    assert plan.solver.blocks == len(bg.blocks)
    for stage in plan.stages:
        assert sum(b.nodes for b in bg.blocks if b.stage == stage.index) == stage.compute_nodes
        forward = sum(b.forward_s for b in bg.blocks if b.stage == stage.index)
        assert forward == pytest.approx(stage.predicted.forward_s)
    # The skip edge from the stem to the add crosses stages and carries a (micro-batch, 16) float tensor.
    assert any(nbytes == 4 * 16 * 4 for _, _, nbytes in bg.cut_edges())
    directory = plan.save(tmp_path)
    back = nx.read_graphml(directory / "blocks.graphml", node_type=int)
    assert [back.nodes[v]["stage"] for v in sorted(back)] == [b.stage for b in bg.blocks]
    assert Plan.load(directory) == plan
