"""Figures: the pipeline timeline (GPipe-paper style) and per-stage bars, as PNG or SVG.

matplotlib is imported only when a figure is drawn, through its object API
(``matplotlib.figure.Figure``, rendered by Agg): no pyplot, no global backend
switch, nothing opens a window.  The format follows the file's suffix
(``.png``, ``.svg``, ``.pdf``).

:func:`timeline_png` draws one row per track (stage 0 on top), like Figure 2 of
Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism", NeurIPS 2019: forward boxes in one colour, backward
boxes in another, each labelled with its micro-batch when wide enough; waits
for a peer's data are thin hatched strips, all-reduce buckets a hatched strip
under the row, and idle time (the bubble) is left blank.  Where a rank holds
several stages (interleaved-1f1b, zbv) its boxes say which: the rank's first
stage in full colour, later ones lighter, and the micro-batch carries the
chunk's letter (``3b``: micro-batch 3 of the rank's second stage; the row's
label lists ``a=s0 b=s3``).  With one stage per rank nothing changes.

:func:`stage_bars_png` draws time per micro-batch per stage (``s3 (r0)``:
stage 3 on pipeline rank 0 when ranks hold several) and peak memory per
pipeline rank, i.e. per GPU (:func:`rank_memory_bars`), against the GPU limit.

Example::

    >>> import tempfile, pathlib
    >>> from partitioner.plan import example_plan
    >>> from partitioner.schedule.simulate import simulate
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> timeline_png(simulate(example_plan()).events, out / "timeline.png", title="example").stat().st_size > 0
    True
    >>> stage_bars_png(example_plan(), out / "stages.svg").suffix
    '.svg'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.plan import Plan
from partitioner.report.table import schedule_label
from partitioner.schedule.timeline import ALLREDUCE_KIND, COMPUTE_KINDS, TimelineEvent
from partitioner.units import byte_unit

if TYPE_CHECKING:
    from partitioner.schedule.simulate import Simulation

__all__ = [
    "COLORS",
    "byte_unit",
    "rank_memory_bars",
    "stage_bars_png",
    "timeline_png",
    "track_stages",
]  # byte_unit lives in partitioner.units

COLORS = {
    "F": "#4C72B0",  # forward: blue
    "B": "#DD8452",  # backward: orange (input gradient only, where W is split off)
    "W": "#937860",  # weight gradient (zero-bubble schedules): brown
    "wait": "#B4B4B4",  # RF / RB waiting for a peer
    ALLREDUCE_KIND: "#8172B3",  # gradient all-reduce: purple
    "static": "#64646E",
    "activations": "#55A868",
    "limit": "#C44E52",
}
_DPI = 150
_OFF_SCALE = 5.0  # draw the memory limit only when it is within this factor of the usage
_CHAR_PX = 6.5  # width of one label character at font size 7, in pixels at _DPI
_LIGHTEST = 0.55  # share of white in the shade of a rank's last stage (its first has none)
_STAGE_PREFIX = re.compile(r"^(\d+)")  # the stage an action names: 3F0


def timeline_png(
    events: Iterable[TimelineEvent],
    path: str | Path,
    *,
    title: str,
    track_name: str = "rank",
) -> Path:
    """Draw ``events`` as a pipeline timeline (x in ms, one row per track) and save it to ``path``."""
    from matplotlib.collections import PatchCollection, PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, PathPatch

    listed = list(events)
    tracks = sorted({e.track for e in listed}) or [0]
    row_of = {t: r for r, t in enumerate(tracks)}
    held = track_stages(listed)
    chunks = max((len(stages) for stages in held.values()), default=1)
    end_ms = max((e.end_s for e in listed), default=0.0) * 1e3 or 1.0

    fig = Figure(figsize=(11.0, max(2.4, 1.2 + 0.55 * len(tracks))), dpi=_DPI)
    ax = fig.add_subplot()
    axes_px = fig.get_figwidth() * _DPI * 0.78  # roughly the plotting area's width
    px_per_ms = axes_px / (end_ms * 1.02)

    # One collection per kind of box per track, added without autoscaling (the limits are set below):
    # a large plan has tens of thousands of boxes, and a call per box re-ran the autoscale each time.
    boxes: dict[int, tuple[list[Any], list[str]]] = {}
    waits: dict[int, list[Any]] = {}
    reduces: dict[int, list[Any]] = {}
    for e in listed:
        y = row_of[e.track]
        start, width = e.start_s * 1e3, (e.end_s - e.start_s) * 1e3
        if e.kind in COMPUTE_KINDS:
            # A rank holding several stages: which of them (its chunk) in the shade and as a letter.
            stages = held.get(e.track, ())
            chunk = stages.index(_stage_of(e)) if len(stages) > 1 and _stage_of(e) in stages else 0
            verts, colors = boxes.setdefault(y, ([], []))
            verts.append(_box(start, width, y - 0.35, 0.7))
            colors.append(_lighter(COLORS[e.kind], chunk, chunks))
            text = str(e.microbatch) + (_letter(chunk) if len(stages) > 1 else "")
            if width * px_per_ms >= _CHAR_PX * len(text) + 4:
                ax.text(start + width / 2, y, text, ha="center", va="center", fontsize=7,
                        color="white" if chunk == 0 else "#222222", fontweight="bold")
        elif e.kind in ("RF", "RB") and width > 0:
            waits.setdefault(y, []).append(_box(start, width, y - 0.04, 0.08))
        elif e.kind == ALLREDUCE_KIND and width > 0:
            reduces.setdefault(y, []).append(_box(start, width, y + 0.37, 0.11))
        # Sends are non-blocking and take no time on the sender: nothing to draw.
    for y in range(len(tracks)):
        if y in boxes:
            verts, colors = boxes[y]
            ax.add_collection(PolyCollection(verts, facecolors=colors, edgecolors="white", linewidths=0.6),
                              autolim=False)
        # Hatched strips as one compound path per row: Agg sets a hatch up once per path (5 s for 8,000 strips).
        if y in waits:
            ax.add_collection(PatchCollection([PathPatch(_compound(waits[y]))], facecolors="none",
                                              edgecolors=COLORS["wait"], hatch="////", linewidths=0.3), autolim=False)
        if y in reduces:
            ax.add_collection(PatchCollection([PathPatch(_compound(reduces[y]))], facecolors="none",
                                              edgecolors=COLORS[ALLREDUCE_KIND], hatch="xxxx", linewidths=0.5),
                              autolim=False)

    ax.axvline(end_ms, color="black", linestyle="--", linewidth=0.8)
    ax.text(end_ms, -0.45, f"step {end_ms:.3g} ms ", ha="right", va="center", fontsize=8)
    ax.set_yticks(range(len(tracks)), [_track_label(f"{track_name} {t}", held.get(t, ())) for t in tracks])
    ax.set_ylim(len(tracks) - 0.4, -0.7)  # track 0 on top
    ax.set_xlim(0, end_ms * 1.02)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", color="#E5E5E5", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = {e.kind for e in listed}
    handles: list[Any] = [Patch(facecolor=COLORS["F"], label="forward"),
                          Patch(facecolor=COLORS["B"], label="backward")]
    if "W" in kinds:
        handles.append(Patch(facecolor=COLORS["W"], label="weights (W)"))
    if chunks > 1:
        handles += [Patch(facecolor=_lighter(COLORS["F"], k, chunks),
                          label=f"{_letter(k)}: {_ordinal(k + 1)} stage") for k in range(chunks)]
    if kinds & {"RF", "RB"}:
        handles.append(Patch(facecolor="none", edgecolor=COLORS["wait"], hatch="////", label="waiting for data"))
    if ALLREDUCE_KIND in kinds:
        handles.append(Patch(facecolor="none", edgecolor=COLORS[ALLREDUCE_KIND], hatch="xxxx", label="all-reduce"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.08, right=0.86, top=0.88, bottom=max(0.12, 0.55 / fig.get_figheight()))
    return _save(fig, path)


def stage_bars_png(plan: Plan, path: str | Path, *, simulation: Simulation | None = None) -> Path:
    """Per-stage time per micro-batch (forward, backward, recomputation, transfers; stacked) and peak memory per GPU.

    Transfers are priced on the link each boundary crosses, and static memory at the
    plan's precision, as the simulator does (:func:`partitioner.schedule.simulate.boundary_seconds`,
    :func:`~partitioner.schedule.simulate.stage_static_bytes`).  Memory is per pipeline rank
    (one GPU of each replica: :func:`rank_memory_bars`), so a rank holding several
    stages (``plan.chunks > 1``) shows them together against the GPU limit.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from partitioner.schedule.simulate import boundary_seconds, simulate

    sim = simulation if simulation is not None else simulate(plan)
    chunked = plan.chunks > 1
    stages = [st.index for st in plan.stages]
    fwd = [st.predicted.forward_s * 1e3 for st in plan.stages]
    redo = [st.predicted.recompute_s * 1e3 for st in plan.stages]
    bwd = [st.predicted.backward_s * 1e3 - r for st, r in zip(plan.stages, redo)]
    cm = plan.cost_model
    seconds = boundary_seconds(plan)
    comm = [2e3 * sum(seconds[src][st.index] for src in range(len(plan.stages))) for st in plan.stages]
    static, activations = rank_memory_bars(plan, sim)
    ranks = list(range(len(static)))
    predicted = list(plan.predicted.peak_memory_bytes)
    limit = cm.memory_limit
    used = max([a + b for a, b in zip(static, activations)] + predicted + [1.0])
    on_scale = limit is not None and limit <= _OFF_SCALE * used
    largest = max(used, limit or 0.0) if on_scale else used
    div, unit = byte_unit(largest)

    fig = Figure(figsize=(11.0, 3.8), dpi=_DPI)
    left, right = fig.subplots(1, 2)
    left.bar(stages, fwd, color=COLORS["F"], label="forward")
    left.bar(stages, bwd, bottom=fwd, color=COLORS["B"], label="backward")
    below = [f + b for f, b in zip(fwd, bwd)]
    if any(redo):
        left.bar(stages, redo, bottom=below, color=COLORS["F"], alpha=0.45, hatch="..",
                 label="recomputed forward")
        below = [b + r for b, r in zip(below, redo)]
    if any(comm):
        left.bar(stages, comm, bottom=below, color="white",
                 edgecolor=COLORS["wait"], hatch="////", label="transfers in (fwd + bwd)")
    left.set_title(f"time per micro-batch ({plan.microbatches} micro-batches per step)", fontsize=10)
    left.set_ylabel("ms")
    left.set_ylim(0, 1.3 * max([b + c for b, c in zip(below, comm)] + [1e-9]))
    left.legend(fontsize=8, frameon=False, loc="upper left", ncol=3)

    right.bar(ranks, [s / div for s in static], color=COLORS["static"], label="parameters, grads, optimizer")
    right.bar(ranks, [a / div for a in activations], bottom=[s / div for s in static],
              color=COLORS["activations"], label="activations in flight")
    for x, a, b in zip(ranks, static, activations):
        right.text(x, (a + b) / div, f"{(a + b) / div:.3g}", ha="center", va="bottom", fontsize=8)
    handles: list[Any] = [Patch(color=COLORS["static"], label="parameters, grads, optimizer"),
                          Patch(color=COLORS["activations"], label="activations in flight (simulated)")]
    if predicted:
        handles.append(right.scatter(ranks[:len(predicted)], [p / div for p in predicted[:len(ranks)]], marker="_",
                                     s=400, color="black", zorder=3, label="plan's predicted peak"))
    title = "peak memory per GPU"
    if limit is not None and on_scale:
        handles.append(right.axhline(limit / div, color=COLORS["limit"], linestyle="--",
                                     label=f"GPU limit {limit / div:.3g} {unit}"))
    elif limit is not None:
        limit_div, limit_unit = byte_unit(limit)
        title += f" (GPU limit {limit / limit_div:.3g} {limit_unit}, off the scale)"
    right.set_title(title, fontsize=10)
    right.set_ylabel(unit)
    right.set_ylim(0, 1.35 * largest / div)
    right.legend(handles=handles, fontsize=8, frameon=False, loc="upper left", ncol=2)
    if chunked:
        small = 8 if len(stages) > 8 else None
        left.set_xticks(stages, [f"s{st.index} (r{st.rank})" for st in plan.stages], fontsize=small)
        right.set_xticks(ranks, [f"rank {r}\n" + ", ".join(f"s{s}" for s in plan.stages_of(r)) for r in ranks],
                         fontsize=small)
        shape = f"{_count(plan.pp, 'pipeline rank')} x {plan.chunks} stages each x {_count(plan.dp, 'replica')}"
    else:
        for ax, xs in ((left, stages), (right, ranks)):
            ax.set_xticks(xs, [f"stage {s}" for s in xs])
        shape = f"{_count(plan.pp, 'stage')} x {_count(plan.dp, 'replica')}"
    for ax in (left, right):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(f"{plan.model.class_name}: {shape}, {schedule_label(plan.schedule, plan.chunks)}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def rank_memory_bars(plan: Plan, simulation: Simulation | None = None) -> tuple[list[float], list[float]]:
    """Per pipeline rank (one GPU of each replica): (static bytes, activation bytes at its simulated peak).

    Static bytes are the sum of :func:`~partitioner.schedule.simulate.stage_static_bytes` over
    the stages the rank holds (``plan.stages_of``); the activations are what the
    simulation holds on top at the rank's peak, so the two add up to
    ``Simulation.peak_memory_bytes`` (the plan's ``predicted.peak_memory_bytes``).

    >>> from partitioner.plan import example_plan
    >>> static, activations = rank_memory_bars(example_plan())
    >>> static, activations  # 64 bytes of fp32 weights with Adam; GPipe holds both micro-batches of 32 bytes
    ([256.0, 256.0], [64.0, 64.0])
    """
    from partitioner.schedule.simulate import simulate, stage_static_bytes

    sim = simulation if simulation is not None else simulate(plan)
    per_stage = stage_static_bytes(plan)
    static = [sum(per_stage[s] for s in plan.stages_of(r)) for r in range(len(sim.peak_memory_bytes))]
    return static, [max(0.0, peak - held) for peak, held in zip(sim.peak_memory_bytes, static)]


def track_stages(events: Iterable[TimelineEvent]) -> dict[int, tuple[int, ...]]:
    """The stages each track computes (its F, B and W actions name them), ascending: the rank's chunks in order.

    >>> events = [TimelineEvent(0, "F0", "0F0", 0, "F", 0.0, 1.0), TimelineEvent(1, "F0", "1F0", 0, "F", 1.0, 2.0),
    ...           TimelineEvent(0, "F0", "3F0", 0, "F", 2.0, 3.0), TimelineEvent(0, "SF0", "3SF0", 0, "SF", 3.0, 3.0)]
    >>> track_stages(events)
    {0: (0, 3), 1: (1,)}
    """
    found: dict[int, set[int]] = {}
    for e in events:
        if e.kind in COMPUTE_KINDS:
            found.setdefault(e.track, set()).add(_stage_of(e))
    return {track: tuple(sorted(stages)) for track, stages in sorted(found.items())}


def _stage_of(event: TimelineEvent) -> int:
    match = _STAGE_PREFIX.match(event.action)
    return int(match[1]) if match else event.track


def _box(x: float, width: float, y: float, height: float) -> list[tuple[float, float]]:
    """The corners of a rectangle, as a polygon of a ``PolyCollection``."""
    return [(x, y), (x + width, y), (x + width, y + height), (x, y + height)]


def _compound(boxes: list[list[tuple[float, float]]]) -> Any:
    """One ``matplotlib.path.Path`` of many rectangles (each closed on its own)."""
    from matplotlib.path import Path as MplPath

    verts = [corner for box in boxes for corner in (*box, box[0])]
    codes = [MplPath.MOVETO, MplPath.LINETO, MplPath.LINETO, MplPath.LINETO, MplPath.CLOSEPOLY] * len(boxes)
    return MplPath(verts, codes)


def _lighter(color: str, chunk: int, chunks: int) -> str:
    """``color`` (``#RRGGBB``) mixed with white: chunk 0 as it is, the last chunk :data:`_LIGHTEST` white.

    >>> _lighter("#000000", 0, 2), _lighter("#000000", 1, 2)
    ('#000000', '#8C8C8C')
    """
    if chunk <= 0 or chunks <= 1:
        return color
    share = _LIGHTEST * chunk / (chunks - 1)
    channels = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * share):02X}" for c in channels)


def _letter(chunk: int) -> str:
    """The chunk's marker in box labels: a, b, c, ... (then c26, c27, ...)."""
    return chr(ord("a") + chunk) if chunk < 26 else f"c{chunk}"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _track_label(name: str, stages: tuple[int, ...]) -> str:
    """``rank 0``, or with several stages ``rank 0`` over ``a=s0 b=s3`` (the letters of its boxes)."""
    if len(stages) <= 1:
        return name
    return name + "\n" + " ".join(f"{_letter(k)}=s{s}" for k, s in enumerate(stages))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _save(fig: Any, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=_DPI)
    return target

