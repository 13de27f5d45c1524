"""The block graph as a networkx ``DiGraph``: for the solver (numbers) and for people (a picture).

Two views of the same graph, both plain data and free of torch at import time:

* :func:`problem_graph`: a :class:`~partitioner.solve.problem.PartitionProblem`'s blocks
  as nodes ``0..N-1`` with their costs as attributes and its edges, for walks
  that networkx already knows (ancestors, antichains, generations).
* :class:`BlockGraph`: what the planner knew about each block of a plan (name,
  nodes, forward and backward seconds, bytes, chosen stage) and the bytes on each
  edge.  The planner attaches it to the in-memory :class:`~partitioner.plan.Plan`
  (never to ``plan.json``) and :meth:`BlockGraph.save` writes ``blocks.graphml``
  and ``graph.png`` next to the plan.

Example::

    >>> from partitioner.solve.problem import PartitionProblem
    >>> p = PartitionProblem(time_s=(1.0, 2.0, 3.0), static_bytes=(0.0,) * 3,
    ...     activation_bytes=(0.0,) * 3, allreduce_s=(0.0,) * 3, transfer_s=(0.0,) * 3,
    ...     edges=((0, 1), (0, 2)))
    >>> g = problem_graph(p)
    >>> sorted(g.successors(0)), g.nodes[2]["time_s"]
    ([1, 2], 3.0)
    >>> bg = BlockGraph(blocks=(Block("a", 1, 1.0, 2.0, 8, 4.0, 0), Block("b", 2, 1.0, 1.0, 0, 0.0, 1)),
    ...                 edges=((0, 1, 64.0),))
    >>> bg.to_networkx().edges[0, 1]["bytes"], bg.cut_edges()
    (64.0, ((0, 1, 64.0),))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from partitioner.solve.problem import PartitionProblem

if TYPE_CHECKING:
    from torch import fx

    from partitioner.solve.formulate import GraphCosts

__all__ = ["GRAPHML_FILE", "Block", "BlockGraph", "block_graph", "problem_graph"]

GRAPHML_FILE = "blocks.graphml"  # what BlockGraph.write_graphml writes into a plan directory

_PROBLEM_ATTRIBUTES = ("time_s", "static_bytes", "activation_bytes", "allreduce_s", "transfer_s")


def problem_graph(problem: PartitionProblem) -> nx.DiGraph:
    """Blocks ``0..N-1`` as nodes (every cost of :class:`PartitionProblem` as an attribute), its edges."""
    graph = nx.DiGraph()
    graph.add_nodes_from(
        (v, {name: getattr(problem, name)[v] for name in _PROBLEM_ATTRIBUTES}) for v in range(problem.size)
    )
    graph.add_edges_from(problem.edges)
    return graph


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a plan, per micro-batch of one replica (like the stage table)."""

    name: str  # module path, or the node's name for a single function call
    nodes: int  # compute nodes
    forward_s: float
    backward_s: float
    parameter_bytes: int  # parameters it reads (tied ones counted in every reader)
    activation_bytes: float  # saved for backward
    stage: int


@dataclasses.dataclass(frozen=True)
class BlockGraph:
    """The blocks of a plan in their solver order and ``(u, v, bytes)`` edges: block v reads u's output."""

    blocks: tuple[Block, ...]
    edges: tuple[tuple[int, int, float], ...]

    @property
    def stages(self) -> int:
        return 1 + max((b.stage for b in self.blocks), default=-1)

    def cut_edges(self) -> tuple[tuple[int, int, float], ...]:
        """Edges whose ends lie in different stages: tensors sent between GPUs."""
        return tuple(e for e in self.edges if self.blocks[e[0]].stage != self.blocks[e[1]].stage)

    def to_networkx(self) -> nx.DiGraph:
        """Nodes ``0..N-1`` with every :class:`Block` field as an attribute; edges with ``bytes``."""
        graph = nx.DiGraph()
        graph.add_nodes_from((v, dataclasses.asdict(b)) for v, b in enumerate(self.blocks))
        graph.add_edges_from((u, v, {"bytes": float(nbytes)}) for u, v, nbytes in self.edges)
        return graph

    def write_graphml(self, directory: str | Path) -> Path:
        """Write ``blocks.graphml`` into ``directory`` (its picture is drawn by :mod:`partitioner.report.graphfig`)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        target = path / GRAPHML_FILE
        nx.write_graphml(self.to_networkx(), target)
        return target


def block_graph(graph: GraphCosts, stage_of: Sequence[int], gm: fx.GraphModule, *, dp: int = 1) -> BlockGraph:
    """The :class:`BlockGraph` of a partition: ``graph``'s blocks placed by ``stage_of``.

    Times and bytes are scaled by ``1 / dp`` as :func:`partitioner.solve.formulate.formulate`
    scales them; an edge carries the outputs of u's nodes that v reads (the model's
    outputs count as read by the last block, which stays in the last stage).
    """
    from partitioner.graph.ir import module_path

    nodes = {n.name: n for n in gm.graph.nodes}
    block_of = {name: b for b, members in enumerate(graph.blocks) for name in members}
    last = len(graph.blocks) - 1
    nbytes: dict[tuple[int, int], float] = {}
    for b, members in enumerate(graph.blocks):
        for name in members:
            readers = {last if u.op == "output" else block_of.get(u.name, b) for u in nodes[name].users} - {b}
            for r in readers:
                nbytes[b, r] = nbytes.get((b, r), 0.0) + graph.node_output_bytes.get(name, 0) / dp
    blocks = []
    for b, members in enumerate(graph.blocks):
        forward = sum(graph.node_forward_s[n] for n in members) + (graph.loss_s[0] if b == last else 0.0)
        total = sum(graph.node_time_s[n] for n in members) + (sum(graph.loss_s) if b == last else 0.0)
        blocks.append(Block(
            name=_block_name([nodes[n] for n in members], module_path),
            nodes=len(members),
            forward_s=forward / dp,
            backward_s=(total - forward) / dp,
            parameter_bytes=sum(graph.parameter_bytes[p] for p in graph.block_parameters[b]),
            activation_bytes=sum(graph.node_saved_bytes.get(n, 0) for n in members) / dp,
            stage=int(stage_of[b]),
        ))
    edges = tuple((u, v, nbytes.get((u, v), 0.0)) for u, v in graph.edges)
    return BlockGraph(blocks=tuple(blocks), edges=edges)


def _block_name(members: Sequence[Any], module_path: Callable[[Any], str]) -> str:
    """The module the block's nodes share; a lone function call adds its node name (``block1/relu``)."""
    paths = [module_path(n).split(".") if module_path(n) else [] for n in members]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    path = ".".join(common)
    if len(members) == 1 and (members[0].op != "call_module" or str(members[0].target) != path):
        return f"{path}/{members[0].name}" if path else members[0].name
    return path or f"{members[0].name}..{members[-1].name}"
