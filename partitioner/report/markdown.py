"""Report: a plan directory's ``report.md``, pictures and predicted trace, from the saved plan alone.

:func:`write_report` simulates the plan's own schedule
(:func:`partitioner.schedule.simulate.simulate`), then writes next to ``plan.json``:

* ``report.md``: summary (with the predicted MFU), the assumptions in one place
  (precision, optimizer and bytes per parameter, recomputation per stage, links
  and which of them cross nodes), stage table, simulated vs closed-form step
  time, bubble, busy share and peak memory per pipeline rank (per GPU), every
  pp x dp x M x schedule combination considered and why each lost, the
  solver's status and gap, tied parameters, the rank layout (with the stages
  each pipeline rank holds), and the commands to verify and run it;
* ``timeline.png`` (one row per pipeline rank, GPipe style; a rank holding
  several stages shades and letters each one's boxes) and ``stages.png``
  (time per stage, peak memory per pipeline rank against the GPU limit);
* ``predicted_trace.json``: the simulated step as a Chrome / Perfetto trace.

Example::

    >>> import tempfile
    >>> from partitioner.plan import Plan, example_plan
    >>> directory = Plan.save(example_plan(), tempfile.mkdtemp())
    >>> path = write_report(Plan.load(directory), directory)
    >>> path.name, "## Simulation" in path.read_text()
    ('report.md', True)
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from partitioner.plan import Plan
from partitioner.report.figures import stage_bars_png, timeline_png
from partitioner.report.graphfig import GRAPH_PNG, block_graph_png
from partitioner.report.table import (
    assumptions,
    is_chosen,
    ranked_candidates,
    recompute_label,
    schedule_label,
    shard_label,
)
from partitioner.schedule.simulate import Simulation, simulate
from partitioner.schedule.timeline import write_chrome_trace
from partitioner.units import format_bytes, format_ms

__all__ = [
    "REPORT_FILES",
    "closed_form_bubble",
    "report_markdown",
    "write_report",
]

REPORT_FILES = ("report.md", "timeline.png", "stages.png", "predicted_trace.json")


def write_report(plan: Plan, directory: str | Path) -> Path:
    """Write the report files into ``directory`` (the plan's); return the path of ``report.md``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    sim = simulate(plan)
    title = (f"{plan.model.class_name}: {plan.pp} x {plan.dp}, {schedule_label(plan.schedule, plan.chunks)}, "
             f"M = {plan.microbatches}")
    timeline_png(sim.events, path / "timeline.png", title=f"{title} (simulated step)")
    stage_bars_png(plan, path / "stages.png", simulation=sim)
    if plan.block_graph is not None:  # only in memory, right after planning: plan.json does not hold it
        block_graph_png(plan.block_graph, path / GRAPH_PNG, title=plan.model.class_name)
    write_chrome_trace(path / "predicted_trace.json", sim.events, title=f"predicted: {title}")
    target = path / "report.md"
    target.write_text(report_markdown(plan, simulation=sim, directory=path))
    return target


def report_markdown(plan: Plan, *, simulation: Simulation | None = None, directory: str | Path = "plan") -> str:
    """The text of ``report.md`` (``directory`` appears in the commands)."""
    sim = simulation if simulation is not None else simulate(plan)
    sections = [
        f"# autopartition plan: {plan.model.class_name}",
        _summary(plan, sim),
        _assumptions(plan),
        "## Stages\n\n" + _stage_table(plan) + _block_graph(directory),
        _simulation(plan, sim),
        _candidates(plan),
        _solver(plan),
        _tied(plan),
        _layout(plan),
        _commands(plan, directory),
    ]
    return "\n\n".join(sections) + "\n"


# ------------------------------------------------------------------ sections


def _summary(plan: Plan, sim: Simulation) -> str:
    m = plan.model
    cm = plan.cost_model
    limit = "none given" if cm.memory_limit is None else f"{format_bytes(cm.memory_limit)} per GPU"
    rows = [
        ("model", (f"{m.class_name} ({m.parameters:,} parameters, {format_bytes(m.parameter_bytes)}; "
                  f"captured with {m.capture}, fingerprint `{m.fingerprint}`)")),
        ("GPUs", (f"{plan.gpus} = {plan.pp} pipeline {'stages' if plan.chunks == 1 else 'ranks'} (pp) x "
                  f"{plan.dp} data-parallel replicas (dp)"
                  + (f" x {plan.tp} tensor-parallel (tp)" if plan.tp > 1 else "")
                  + f", {plan.gpus_per_node or plan.gpus} per node")),
        ("schedule", f"{plan.schedule}, {plan.microbatches} micro-batches per step" + (
            "" if plan.chunks == 1 else
            f"; {len(plan.stages)} stages, {plan.chunks} per pipeline rank (see the rank layout)")),
        ("batch", (f"{plan.batch_size} samples per step = {plan.dp} replicas x {plan.microbatches} "
                  f"micro-batches x {plan.microbatch_size} sample{'' if plan.microbatch_size == 1 else 's'}")),
        ("device", f"{plan.device}; costs {cm.source}; {plan.precision}, {plan.optimizer}"),
        ("memory limit", limit),
        ("predicted step", (f"{format_ms(plan.solver.objective)} (closed form), {format_ms(sim.step_s)} (simulated); "
                           f"{plan.predicted.samples_per_s:,.1f} samples/s")),
        ("bubble", f"{_pct(closed_form_bubble(plan))} (closed form), {_pct(sim.bubble_fraction)} (simulated)"),
        ("MFU", "not known" if plan.predicted.mfu is None else (
            f"{_pct(plan.predicted.mfu)} predicted ({plan.predicted.model_flops or 0:.3g} model FLOPs per step)")),
    ]
    return "## Summary\n\n" + _table(("", ""), rows)


def _assumptions(plan: Plan) -> str:
    """Every assumption behind the prediction, in one place."""
    rows = [(topic, text) for topic, text in assumptions(plan)]
    rows.insert(3, ("recomputation per stage", ", ".join(f"{s.index}: {recompute_label(s)}" for s in plan.stages)))
    links = [f"{b.source}->{b.target} `{b.producer}`: {b.link}" for s in plan.stages for b in s.outputs]
    rows.insert(5, ("boundary links", "; ".join(links) or "none (one stage)"))
    if plan.dp > 1:
        rows.insert(6, ("all-reduce links", ", ".join(f"stage {s.index}: {s.allreduce_link}" for s in plan.stages)))
    note = ("Costs were taken in the model's own dtype and converted to the precision (bytes of float32 "
            "activations halve under bf16; times use the compute dtype's peak). A recomputing stage keeps only "
            "each layer's inputs per micro-batch in flight, holds one layer's activations again during each "
            "backward, and runs each layer's forward twice (Korthikanti et al. 2022, full recomputation). "
            "Ranks are laid out pipeline-rank-major (rank = pipeline rank x dp + replica), node = rank // GPUs "
            "per node; links follow the ranks of the two stages. A sharded stage group (ZeRO, Rajbhandari et al. "
            "2020) holds its optimizer state (optimizer) or everything (full, FSDP2) over its replicas; under a "
            "pipeline the gradients accumulate whole over the step, and a fully sharded stage keeps its weights "
            "gathered across micro-batches (as torch's pipelining keeps FSDP2), so both are counted with it. Its "
            "reduce-scatter and all-gather run once per step after the last backward, not overlapped; DDP's "
            "bucketed all-reduce overlaps the last backward. A zero3 stage (full with reshard_after_forward) holds "
            "only its shards plus two layers gathered (with one layer's gradients and the previous one's reduce-scatter "
            "input); its all-gathers (before each forward and backward) and "
            "reduce-scatters (after each backward) run every micro-batch, and only what its compute does not "
            "hide, plus the first layer's all-gather, counts.")
    if any(s.predicted.weight_s for s in plan.stages) and plan.schedule in ("zb-h1", "zbv"):
        note += (" The backward is split: B (input gradients) and W (weight gradients, half the backward of "
                 "every node that reads parameters; Qi et al. 2024), W deferred to fill the pipeline's idle time.")
    return "## Assumptions\n\n" + _table(("", ""), rows) + "\n\n" + note


def _stage_table(plan: Plan) -> str:
    rows = []
    for st in plan.stages:
        p = st.predicted
        first, last = st.modules
        rows.append((
            str(st.index),
            ", ".join(str(r) for r in st.ranks),
            f"`{first}`" if first == last else f"`{first}` … `{last}`",
            str(st.compute_nodes),
            f"{len(st.parameters)} ({format_bytes(p.parameter_bytes)})",
            format_ms(p.forward_s),
            format_ms(p.backward_s) + (f" (recompute {format_ms(p.recompute_s)})" if p.recompute_s else ""),
            recompute_label(st),
            format_bytes(p.send_bytes) if st.outputs else "-",
            f"{format_ms(p.allreduce_s)} ({st.allreduce_link})" if plan.dp > 1 else "-",
            shard_label(st) if plan.dp > 1 else "-",
            format_bytes(_at(plan.predicted.peak_memory_bytes, st.rank, p.memory_bytes)),
        ))
    head = ("stage", "ranks", "modules", "compute nodes", "parameters", "forward / mb", "backward / mb",
            "recompute", "sends / mb", "all-reduce (or shard collectives) / step", "shard",
            "peak memory (its GPU)" if plan.chunks > 1 else "peak memory")
    return _table(head, rows)


def _simulation(plan: Plan, sim: Simulation) -> str:
    closed = plan.solver.objective
    diff = (sim.step_s / closed - 1) if closed > 0 else 0.0
    limit = plan.cost_model.memory_limit
    lines = [
        "## Simulation",
        "",
        (f"Replaying the plan's own schedule action by action gives a step of **{format_ms(sim.step_s)}**, "
        f"against **{format_ms(closed)}** from the solver's closed form (`{_CLOSED_FORMS.get(plan.schedule, '?')}`), "
        f"a difference of {diff:+.1%}. The simulation overlaps transfers with compute where the schedule "
        "allows, all-reduces gradients in DDP buckets during the last backward (a sharded group's "
        "reduce-scatter and all-gather run whole after it), and times forwards and "
        "backwards separately; the closed form charges transfers and the all-reduce in full and treats "
        "forward + backward as one block per stage."),
        "",
        (f"Bubble (idle share of the pipeline): {_pct(sim.bubble_fraction)} simulated, "
        f"{_pct(closed_form_bubble(plan))} closed form."),
        "",
    ]
    rows = []
    rows_of = len(sim.peak_memory_bytes)  # one per pipeline rank (a GPU of each replica)
    for s in range(rows_of):
        peak = sim.peak_memory_bytes[s]
        planned = _at(plan.predicted.peak_memory_bytes, s, peak)
        rows.append((
            str(s) if plan.chunks == 1 else f"{s} (stages {', '.join(map(str, plan.stages_of(s)))})",
            _pct(sim.busy_fraction[s]),
            str(sim.peak_in_flight[s]),
            format_bytes(peak),
            format_bytes(planned),
            "-" if limit is None else _pct(peak / limit),
        ))
    what = "stage" if plan.chunks == 1 else "pipeline rank"
    held = "micro-batches in flight" if plan.chunks == 1 else "stage micro-batches in flight"
    lines.append(_table((what, "busy", held, "peak memory (simulated)",
                         "peak memory (plan)", "of the GPU limit"), rows))
    mismatched = [s for s in range(rows_of)
                  if abs(sim.peak_memory_bytes[s] - _at(plan.predicted.peak_memory_bytes, s, 0.0))
                  > 0.01 * max(sim.peak_memory_bytes[s], 1.0)]
    if mismatched:
        lines += ["", (f"The simulated peak memory differs from the plan's by more than 1% on {what}(s) "
                      f"{', '.join(map(str, mismatched))}: the simulation counts parameters x "
                      f"(2 + {plan.cost_model.optimizer_states} optimizer states) plus the activations in flight.")]
    lines += [
        "",
        (f"![timeline: one row per {what}, forward (blue) and backward (orange) per micro-batch"
         + ("" if plan.chunks == 1 else "; a rank's later stages lighter, lettered (3b: micro-batch 3 of its 2nd)")
         + "](timeline.png)"),
        "",
        ("![time per micro-batch per stage and peak memory per GPU](stages.png)" if plan.chunks > 1
         else "![time per micro-batch and peak memory per stage](stages.png)"),
        "",
        ("The simulated step as a trace: `predicted_trace.json` (open it in https://ui.perfetto.dev "
        "or chrome://tracing)."),
    ]
    return "\n".join(lines)


def _block_graph(directory: str | Path) -> str:
    """A pointer to ``graph.png`` when it was drawn (a plan reported right after planning, with its block graph)."""
    if not (Path(directory) / GRAPH_PNG).exists():
        return ""
    return (
        "\n\n![the block graph: blocks by topological generation, coloured by stage; cut edges in red with "
        "their bytes](graph.png)\n\nEvery block with its costs and stage, and the bytes on every edge: "
        "`blocks.graphml` (`networkx.read_graphml`)."
    )


def closed_form_bubble(plan: Plan) -> float:
    """Idle share of ``pp`` GPUs over the closed-form step: ``1 - sum_s M (f_s + b_s) / (pp * step)``."""
    step = plan.solver.objective
    if step <= 0:
        return 0.0
    busy = sum(plan.microbatches * (s.predicted.forward_s + s.predicted.backward_s) for s in plan.stages)
    return max(0.0, 1 - busy / (plan.pp * step))


def _candidates(plan: Plan) -> str:
    """Every combination considered, best first, and why each lost."""
    ranked = ranked_candidates(plan)
    rows = []
    for c in ranked:
        chosen = is_chosen(c, plan)
        shape = f"{c.pp} x {c.dp}" + (f" (ep {c.ep})" if getattr(c, "ep", 1) > 1 else "")
        chunks = getattr(c, "chunks", None)
        rows.append((
            f"**{shape}**" if chosen else shape,
            "-" if c.microbatches is None else str(c.microbatches),
            schedule_label(c.schedule, chunks),
            getattr(c, "shard", None) or "-",
            "-" if c.recomputed_stages is None else f"{c.recomputed_stages} of {c.pp * (chunks or 1)}",
            "-" if c.step_s is None else format_ms(c.step_s),
            "-" if c.simulated_s is None else format_ms(c.simulated_s),
            "-" if c.bubble_fraction is None else _pct(c.bubble_fraction),
            "-" if c.memory_bytes is None else format_bytes(c.memory_bytes),
            c.status,
            c.note,
        ))
    runner = next((c for c in ranked if not is_chosen(c, plan) and c.step_s is not None), None)
    if not plan.candidates:
        why = "The combination was fixed; no other was considered."
    elif runner is None:
        why = f"{_combination(plan)} was the only combination that could be planned; the others' reasons are above."
    else:
        runner_s = runner.simulated_s if runner.simulated_s is not None else runner.step_s
        assert runner_s is not None
        how = "simulated" if runner.simulated_s is not None else "closed form"
        why = (f"{_combination(plan)} won with the lowest predicted step time, {format_ms(plan.predicted.step_s)} "
               "(every combination is ranked by the solver's closed form, after a lower bound prunes the hopeless "
               "ones; the best few, and the best of each schedule, are then simulated and the simulation "
               "decides); the next best, "
               f"{runner.pp} x {runner.dp}, M = {runner.microbatches}, "
               f"{schedule_label(runner.schedule, getattr(runner, 'chunks', None))}"
               f"{_shard_words(getattr(runner, 'shard', None))}, predicts "
               f"{format_ms(runner_s)} ({how}, {runner_s / plan.predicted.step_s - 1:+.1%}).")
    head = ("pp x dp", "M", "schedule", "shard", "recomputes", "closed form", "simulated", "bubble", "peak memory",
            "status", "why not chosen")
    return ("## Combinations considered (pp x dp x micro-batches x schedule x shard)\n\n"
            "Peak memory is per GPU; for a combination that does not fit, what its fastest split would need "
            "(with every stage recomputing where recomputation is allowed). `interleaved-1f1b xV` holds V "
            "stages per pipeline rank; zbv holds 2 in a V.\n\n"
            + _table(head, rows) + "\n\n" + why)


def _combination(plan: Plan) -> str:
    modes = list(dict.fromkeys(s.shard for s in plan.stages))
    shard = _shard_words(modes[0]) if len(modes) == 1 else f", shard {'/'.join(modes)}"
    return f"{plan.pp} x {plan.dp}, M = {plan.microbatches}, {schedule_label(plan.schedule, plan.chunks)}{shard}"


def _shard_words(shard: str | None) -> str:
    """", shard full" for a sharded combination ("" for DDP or an older plan's unrecorded mode)."""
    return "" if shard in (None, "none") else f", shard {shard}"


def _solver(plan: Plan) -> str:
    s = plan.solver
    return (
        "## Solver\n\n"
        f"`{s.name}` over {s.blocks} blocks: **{s.status}** in {s.wall_s:.3g} s; objective {format_ms(s.objective)}, "
        f"lower bound {format_ms(s.lower_bound)}, gap {s.gap:.2%}."
    )


def _tied(plan: Plan) -> str:
    if not plan.tied:
        return "## Tied parameters\n\nNone: every parameter lives in exactly one place."
    rows = [(f"`{t.name}`", ", ".join(f"`{a}`" for a in t.aliases), ", ".join(map(str, t.stages)))
            for t in plan.tied]
    note = "A parameter used in several stages has a copy in each stage listed."
    return "## Tied parameters\n\n" + _table(("parameter", "names", "stages"), rows) + "\n\n" + note


def _layout(plan: Plan) -> str:
    if plan.chunks == 1:
        single = [(str(rank), str(stage), str(replica))
                  for rank, (stage, replica) in sorted(plan.rank_layout().items())]
        return ("## Rank layout\n\nGlobal rank -> (stage, replica); a stage's replicas are consecutive ranks.\n\n"
                + _table(("rank", "stage", "replica"), single))
    rows = [(str(rank), str(pipeline), ", ".join(map(str, plan.stages_of(pipeline))), str(replica))
            for rank, (pipeline, replica) in sorted(plan.rank_layout().items())]
    return ("## Rank layout\n\nGlobal rank -> (pipeline rank, the stages it holds, replica); a pipeline rank's "
            f"replicas are consecutive ranks. {schedule_label(plan.schedule, plan.chunks)} places "
            f"{plan.chunks} stages on each pipeline rank"
            + (" (stage s on rank s mod pp)" if plan.schedule == "interleaved-1f1b" else
               " (rank r holds stages r and 2 pp - 1 - r: a V)" if plan.schedule == "zbv" else "")
            + ".\n\n" + _table(("rank", "pipeline rank", "stages", "replica"), rows))


_CLOSED_FORMS = {  # partitioner.solve.problem.step_time, per schedule
    "gpipe": "sum t + (M - 1) max t + max all-reduce",
    "1f1b": "sum t + (M - 1) max t + max all-reduce",
    "interleaved-1f1b": "M max T + (P - 1)/(P v) sum t + max all-reduce, T a rank's stages",
    "zb-h1": "M max t + sum u - max u, u = t - 2 W, + max all-reduce",
    "zbv": "M max T + (P - 1)/(2 P) sum max(t - 2 W, t / 3) + max all-reduce, T a rank's stages",
}


def _commands(plan: Plan, directory: str | Path) -> str:
    where = shlex.quote(str(directory))
    return (
        "## Commands\n\n"
        "Check the plan against the unpartitioned model on CPU ranks, then train with it:\n\n"
        "```\n"
        f"autopartition verify {where} --model model.py\n"
        f"autopartition run {where} --nproc-per-node {plan.gpus} -- train.py\n"
        "```"
    )


# ------------------------------------------------------------------ formatting


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def _at(values: Sequence[float], index: int, default: float) -> float:
    return values[index] if 0 <= index < len(values) else default
