"""``graph.png``: the block graph of a plan, blocks coloured by stage, cut edges with their bytes.

Blocks are laid out by topological generation (``nx.topological_generations``):
one row per generation, read top to bottom, so parallel branches (q/k/v
projections, a shortcut convolution) sit side by side.  Long graphs wrap into
columns like a newspaper.  A block's box area is proportional to its forward +
backward time; edges between consecutive rows are straight lines, longer ones
(skip connections) brackets in the lane left of the column, and an edge that
continues in a later column leaves at the bottom and re-enters at the top of its
lane.  Edges that cross stages are red and labelled with the bytes sent per
micro-batch.  Labels (and byte counts) are dropped when a generation is too wide
to fit them.

matplotlib is imported only when drawing, through its object API (no pyplot).

Example::

    >>> import tempfile, pathlib
    >>> from partitioner.solve.blockgraph import Block, BlockGraph
    >>> bg = BlockGraph(blocks=(Block("a", 1, 1e-3, 2e-3, 8, 4.0, 0), Block("b", 1, 1e-3, 1e-3, 0, 0.0, 1)),
    ...                 edges=((0, 1, 4096.0),))
    >>> path = block_graph_png(bg, pathlib.Path(tempfile.mkdtemp()) / "graph.png", title="example")
    >>> path.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from partitioner.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from partitioner.solve.blockgraph import BlockGraph

__all__ = ["GRAPH_PNG", "block_graph_png", "stage_color"]

GRAPH_PNG = "graph.png"  # the block graph's picture in a plan directory, next to blocks.graphml

_ROW = 0.34  # inches per generation
_BOX = 0.22  # side of the costliest block's box, inches
_MIN_BOX = 0.05  # even a free block (a view) stays visible
_MARGIN = 0.3  # inches around the drawing
_LANE = 0.5  # left of each column: brackets for edges that skip rows
_OUT = 0.02  # an edge leaves a row this far above the middle of the gap below it (more by slot) ...
_IN = 0.025  # ... and enters a row this far below the middle of the gap above it
_CHAR = 0.052  # width of one label character at _FONT points, inches
_FONT = 6.0
_LABEL_CHARS = 30  # longer names keep their end (the most specific part)
_LABELS_UP_TO = 8  # blocks side by side in one generation beyond which labels are dropped
_LEGEND_ENTRY = 2.1  # inches per legend entry
_MAX_PIXELS = 16000  # along the longer side
_CUT = "#C44E52"
_EDGE = "#9A9A9A"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each block sits: centres in inches from the top-left corner."""

    x: dict[int, float]
    y: dict[int, float]
    column: dict[int, int]
    slot: dict[int, int]
    column_left: tuple[float, ...]
    top: float
    bottom: float
    width: float
    labels: bool
    legend_columns: int


def stage_color(stage: int, stages: int) -> Any:
    """The fill colour of ``stage``: tab10, tab20, then evenly spaced hues."""
    from matplotlib import colormaps

    if stages <= 10:
        return colormaps["tab10"](stage)
    if stages <= 20:
        return colormaps["tab20"](stage)
    return colormaps["hsv"](stage / stages)


def block_graph_png(graph: BlockGraph, path: str | Path, *, title: str = "") -> Path:
    """Draw ``graph`` (see the module docstring) and save it to ``path`` (format from the suffix)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    g = graph.to_networkx()
    stages = graph.stages
    layout = _layout(g, legend_entries=stages + 1)
    height = layout.bottom + _MARGIN / 2
    figure = Figure(figsize=(layout.width, height))
    axes = figure.add_axes((0.0, 0.0, 1.0, 1.0))
    axes.set_xlim(0, layout.width)
    axes.set_ylim(height, 0)
    axes.axis("off")
    cost = [b.forward_s + b.backward_s for b in graph.blocks]
    top_cost = max(cost) or 1.0
    side = {v: max(_MIN_BOX, _BOX * math.sqrt(cost[v] / top_cost)) for v in g}
    for u, v, nbytes in graph.edges:
        _draw_edge(axes, layout, u, v, side, cut=graph.blocks[u].stage != graph.blocks[v].stage, nbytes=nbytes)
    for v, block in enumerate(graph.blocks):
        s = side[v]
        axes.add_patch(Rectangle((layout.x[v] - s / 2, layout.y[v] - s / 2), s, s, zorder=3, linewidth=0.4,
                                 facecolor=stage_color(block.stage, stages), edgecolor="black"))
        if layout.labels:
            name = block.name if len(block.name) <= _LABEL_CHARS else "…" + block.name[1 - _LABEL_CHARS :]
            axes.text(layout.x[v] + _BOX / 2 + 0.04, layout.y[v], f"{name} {format_seconds(cost[v])}",
                      fontsize=_FONT, va="center", ha="left", zorder=4)
    totals, counts = [0.0] * stages, [0] * stages
    for v, block in enumerate(graph.blocks):
        totals[block.stage] += cost[v]
        counts[block.stage] += 1
    handles = [
        Patch(facecolor=stage_color(s, stages), edgecolor="black", linewidth=0.4,
              label=f"stage {s}: {counts[s]} blocks, {format_seconds(totals[s])}")
        for s in range(stages)
    ]
    handles.append(Patch(facecolor="white", edgecolor=_CUT, label="cut edge: bytes per micro-batch"))
    heading = (f"{title}: " if title else "") + (
        f"{len(graph.blocks)} blocks by topological generation (top to bottom, then the next column); "
        "box area ~ forward + backward time"
    )
    axes.text(_MARGIN, _MARGIN / 2, heading, fontsize=8, va="top", ha="left")
    # matplotlib fills a legend column by column; order the entries so that it reads row by row.
    ncol, n = layout.legend_columns, len(handles)
    handles = [handles[i] for c in range(ncol) for i in range(c, n, ncol)]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(_MARGIN / layout.width, 1 - 0.4 / height),
                ncol=ncol, fontsize=_FONT + 0.5, frameon=False, handlelength=1.0,
                columnspacing=1.0, borderaxespad=0.0)
    target = Path(path)
    figure.savefig(target, dpi=min(150.0, _MAX_PIXELS / max(layout.width, height)))
    return target


def _layout(g: nx.DiGraph, *, legend_entries: int) -> _Layout:
    """Rows by generation, blocks in a row ordered by their predecessors' mean slot; rows wrap into columns."""
    generations: list[list[int]] = []
    slot: dict[int, int] = {}
    for generation in nx.topological_generations(g):
        def barycentre(v: int) -> tuple[float, int]:
            preds = [slot[u] for u in g.predecessors(v)]
            return (sum(preds) / len(preds) if preds else 0.0, v)

        ordered = sorted(generation, key=barycentre)
        slot.update((v, i) for i, v in enumerate(ordered))
        generations.append(ordered)
    widest = max(len(row) for row in generations)
    labels = widest <= _LABELS_UP_TO
    longest = max(min(len(str(g.nodes[v]["name"])), _LABEL_CHARS) for v in g) + 9  # + " 10.1 µs"
    slot_width = _BOX + 0.12 + (longest * _CHAR if labels else 0.0)
    column_width = _LANE + widest * slot_width
    # As many columns as keep the picture about 1.5 times as wide as tall.
    rows = max(1, min(len(generations), math.ceil(math.sqrt(len(generations) * column_width / (1.5 * _ROW)))))
    columns = max(1, round(len(generations) / rows))
    rows = math.ceil(len(generations) / columns)
    width = 2 * _MARGIN + columns * column_width
    legend_columns = max(1, min(legend_entries, int((width - 2 * _MARGIN) // _LEGEND_ENTRY)))
    top = 0.5 + 0.17 * math.ceil(legend_entries / legend_columns) + 0.1
    column_left = tuple(_MARGIN + c * column_width for c in range(columns))
    x: dict[int, float] = {}
    y: dict[int, float] = {}
    column: dict[int, int] = {}
    for k, row in enumerate(generations):
        c, r = divmod(k, rows)
        for v in row:
            x[v] = column_left[c] + _LANE + slot[v] * slot_width + _BOX / 2
            y[v] = top + (r + 0.5) * _ROW
            column[v] = c
    return _Layout(x=x, y=y, column=column, slot=slot, column_left=column_left, top=top,
                   bottom=top + rows * _ROW, width=width, labels=labels, legend_columns=legend_columns)


def _draw_edge(axes: Any, layout: _Layout, u: int, v: int, side: dict[int, float], *, cut: bool, nbytes: float) -> None:
    """Route ``u -> v`` through the gaps between rows, never across a box or a label.

    Down from u into the gap below it; then across to v (the next row), or to the
    column's lane, down the lane (to the column's bottom, continuing from the top of
    v's column), and across the gap above v; then down into v.  Edges leave a row at
    heights staggered by slot, so lines from different blocks do not merge.
    """
    style = {"color": _CUT if cut else _EDGE, "linewidth": 1.1 if cut else 0.6, "zorder": 2 if cut else 1,
             "solid_joinstyle": "miter"}
    xu, yu, xv, yv = layout.x[u], layout.y[u], layout.x[v], layout.y[v]
    start, end = yu + side[u] / 2, yv - side[v] / 2
    below_u = yu + _ROW / 2 - _OUT - 0.012 * (layout.slot[u] % 3)
    above_v = yv - _ROW / 2 + _IN
    same_column = layout.column[u] == layout.column[v]
    label: dict[str, Any] = {"ha": "right", "va": "center"}
    if same_column and abs(yv - yu - _ROW) < 1e-9:
        axes.plot([xu, xu, xv, xv], [start, below_u, below_u, end], **style)
        at = (xv - 0.03, (below_u + end) / 2)
    else:
        # Longer skips further out in the lane, so nested skips nest as brackets.
        span = (yv - yu) / _ROW if same_column else (layout.bottom - yu + yv - layout.top) / _ROW
        depth = _LANE * min(0.9, 0.2 + 0.05 * span)
        lane_u = layout.column_left[layout.column[u]] + _LANE - depth
        lane_v = layout.column_left[layout.column[v]] + _LANE - depth
        if same_column:
            axes.plot([xu, xu, lane_u, lane_u, xv, xv], [start, below_u, below_u, above_v, above_v, end], **style)
        else:
            axes.plot([xu, xu, lane_u, lane_u], [start, below_u, below_u, layout.bottom], **style)
            axes.plot([lane_v, lane_v, xv, xv], [layout.top, above_v, above_v, end], **style)
        # On the lane, where v's column receives it.
        at = (lane_v, ((below_u if same_column else layout.top) + above_v) / 2)
        label = {"ha": "center", "va": "center", "rotation": 90}
    if cut and layout.labels:  # too crowded for block labels: too crowded for these too
        axes.text(*at, format_bytes(nbytes), fontsize=_FONT - 0.5, color=_CUT, zorder=5, **label,
                  bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.85})
