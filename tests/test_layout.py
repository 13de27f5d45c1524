"""partitioner/layout.py: the one owner of rank arithmetic.

* Its ranks and groups agree with a brute-force mixed-radix reference and with torch's own
  ``DeviceMesh`` order (a mesh is ``arange(world).view(shape)``), for every axis and part.
* Bad degrees and overlapping axes are refused with the values and the fix.
* No module of ``partitioner/`` or ``runtime/`` but the layout writes rank arithmetic by hand
  (``a * dp + r``, ``(p * dp + r) * tp + t``, ``rank % tp``, ``rank // tp``): read with :mod:`ast`,
  and the reader is shown to catch each pattern on a small source.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from partitioner.layout import AXES, RANK_AXES, Layout

ROOT = Path(__file__).resolve().parent.parent

SHAPES = [
    Layout(),
    Layout(pp=2, dp=4, tp=2, ep=2),
    Layout(pp=3, dp=6, ep=3, dp_shard=2),
    Layout(pp=2, dp=4, cp=2, tp=2, ep=4, dp_shard=2),
    Layout(pp=1, dp=8, ep=2, dp_shard=4),
]


def _reference_coords(layout: Layout, rank: int) -> dict[str, int]:
    """Coordinates by plain division, outermost first (pp, dp, cp, tp); dp's parts from the replica index."""
    sizes = [layout.pp, layout.dp, layout.cp, layout.tp]
    digits = []
    for size in reversed(sizes):
        digits.append(rank % size)
        rank //= size
    pp, dp, cp, tp = reversed(digits)
    shards = layout.dp_shard or layout.dp
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "edp": dp // layout.ep, "ep": dp % layout.ep,
            "dp_replicate": dp // shards, "dp_shard": dp % shards}


@pytest.mark.parametrize("layout", SHAPES, ids=str)
def test_coords_and_rank_invert_each_other(layout: Layout) -> None:
    for rank in range(layout.world):
        coords = layout.coords(rank)
        assert coords == _reference_coords(layout, rank)
        assert layout.rank(**{a: coords[a] for a in RANK_AXES}) == rank
        assert layout.rank(pp=coords["pp"], edp=coords["edp"], ep=coords["ep"], cp=coords["cp"], tp=coords["tp"]) == rank


@pytest.mark.parametrize("layout", SHAPES, ids=str)
@pytest.mark.parametrize("axis", AXES)
def test_groups_partition_the_world_and_vary_one_axis(layout: Layout, axis: str) -> None:
    groups = layout.groups(axis)
    assert sorted(r for g in groups for r in g) == list(range(layout.world))
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # the order every rank creates them in
    for group in groups:
        assert [layout.coord(r, axis) for r in group] == list(range(layout.size(axis)))
        others = {tuple(v for a, v in layout.coords(r).items() if a != axis and not _overlaps(a, axis)) for r in group}
        assert len(others) == 1, f"{axis} group {group} changes another coordinate"
        for r in group:
            assert layout.ranks(axis, at=r) == group
            assert tuple(layout.line(axis, at=r)) == group


def _overlaps(a: str, b: str) -> bool:
    dp_family = {"dp", "edp", "ep", "dp_replicate", "dp_shard"}
    return a in dp_family and b in dp_family


@pytest.mark.parametrize("layout", SHAPES, ids=str)
def test_groups_match_torch_device_mesh_order(layout: Layout) -> None:
    """init_device_mesh lays ranks as arange(world).view(shape): its dim's groups are ours, in our order."""
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    shape = layout.shape(names)
    mesh = torch.arange(layout.world).view(shape)
    for i, name in enumerate(names):
        theirs = mesh.movedim(i, -1).reshape(-1, shape[i]).tolist()
        assert sorted(map(tuple, theirs)) == list(layout.groups(name))


def test_mesh_is_a_grid_of_rows_by_the_first_axis() -> None:
    layout = Layout(pp=2, dp=4, dp_shard=2)
    grids = list(layout.meshes(("dp_replicate", "dp_shard")))
    assert grids == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert layout.mesh(("dp_replicate", "dp_shard"), at=6) == grids[1]


def test_peers_move_one_coordinate() -> None:
    layout = Layout(pp=3, dp=2, tp=2)
    assert [layout.moved(7, pp=p) for p in range(3)] == [3, 7, 11]  # replica 1, tp 1 on every pipeline rank
    assert [layout.group(r) for r in (6, 7)] == [3, 3]
    assert [layout.stage_groups(p) for p in range(3)] == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"pp": 0}, "pp=0"),
    ({"dp": 4, "ep": 3}, "ep=3 must divide dp=4"),
    ({"dp": 4, "dp_shard": 3}, "dp_shard=3 must divide dp=4"),
    ({"tp": 2.0}, "tp=2.0"),
])
def test_bad_degrees_say_what_and_how(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        Layout(**kwargs)


def test_bad_queries_say_what_and_how() -> None:
    layout = Layout(pp=2, dp=4, ep=2)
    with pytest.raises(ValueError, match="outside the layout's 8 ranks"):
        layout.coords(8)
    with pytest.raises(ValueError, match="unknown axis 'sp'"):
        layout.ranks("sp", at=0)
    with pytest.raises(ValueError, match="overlap"):
        layout.ranks(("dp", "ep"), at=0)
    with pytest.raises(ValueError, match="name dp once"):
        layout.rank(ep=1, dp_shard=1)
    with pytest.raises(ValueError, match="do not cover"):
        layout.shape(("tp", "pp"))
    with pytest.raises(ValueError, match=r"ep=2 is outside 0 \.\. 1"):
        layout.moved(0, ep=2)


def test_a_replaced_span_is_checked_again() -> None:
    with pytest.raises(ValueError, match="dp_shard=3"):
        dataclasses.replace(Layout(dp=4), dp_shard=3)


# ------------------------------------------------------------------ no rank arithmetic by hand

_DEGREES = {"pp", "dp", "cp", "tp", "ep"}


def _is_degree(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in _DEGREES


def _names_a_rank(node: ast.AST) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and "rank" in (n.id if isinstance(n, ast.Name) else n.attr)
               for n in ast.walk(node))


def rank_arithmetic(source: str) -> list[int]:
    """Lines of ``source`` that compute a rank from degrees by hand: ``x * <degree> + y`` (either order),
    or ``<a rank> % <degree>`` / ``<a rank> // <degree>``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.BinOp):
            continue
        if isinstance(node.op, ast.Add):
            for side in (node.left, node.right):
                if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult) and (
                        _is_degree(side.left) or _is_degree(side.right)):
                    found.append(node.lineno)
        elif isinstance(node.op, (ast.Mod, ast.FloorDiv)) and _is_degree(node.right) and _names_a_rank(node.left):
            found.append(node.lineno)
    return sorted(set(found))


@pytest.mark.parametrize("source", [
    "x = p * dp + r", "x = (p * plan.dp + r) * plan.tp + t", "x = g * self.tp + t", "x = r + tp * g",
    "x = rank % plan.tp", "x = self.rank // tp", "x = [s * dp + r for r in range(dp)]",
])
def test_the_reader_catches_rank_arithmetic(source: str) -> None:
    assert rank_arithmetic(source) == [1]


@pytest.mark.parametrize("source", ["x = batch // plan.dp", "x = plan.dp * plan.tp", "x = n % plan.ep",
                                    "x = layout.moved(rank, pp=1)"])
def test_the_reader_passes_other_arithmetic(source: str) -> None:
    assert rank_arithmetic(source) == []


def test_no_rank_arithmetic_outside_the_layout() -> None:
    """Every rank and group comes from partitioner/layout.py; a formula elsewhere drifts when an axis is added."""
    found = []
    for path in itertools.chain((ROOT / "partitioner").rglob("*.py"), (ROOT / "runtime").rglob("*.py")):
        if path == ROOT / "partitioner" / "layout.py":
            continue
        for line in rank_arithmetic(path.read_text()):
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert found == [], "rank arithmetic by hand (ask partitioner.layout.Layout instead):\n" + "\n".join(found)
