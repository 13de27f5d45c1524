"""The plan as a fixed-width text report: a header, one row per stage, then a summary.

Example::

    >>> from partitioner.plan import example_plan
    >>> print(format_plan(example_plan()).splitlines()[0])
    Sequential: 2 parameters (export) | 2 GPUs = 2 stages x 1 replica | gpipe, 2 micro-batches of 2, batch 4 | costs measured on cpu
    >>> format_bytes(3 * 1024**2), format_seconds(0.0123)
    ('3.00 MiB', '12.3 ms')
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.plan import Plan, StagePlan
from partitioner.units import format_bytes, format_count, format_seconds

__all__ = ["format_bytes", "format_plan", "format_seconds"]  # the formatters live in partitioner.units


def format_plan(plan: Plan) -> str:
    """The whole report: header line, stage table, predictions, solver, tied parameters, candidates."""
    lines = [_header(plan), ""]
    lines += _stage_table(plan)
    lines.append("")
    lines += _summary(plan)
    if plan.tied:
        lines.append("")
        lines.append("tied parameters (one tensor under several names):")
        for tied in plan.tied:
            others = [a for a in tied.aliases if a != tied.name]
            where = "stage" if len(tied.stages) == 1 else "stages"
            note = "; gradients summed across stages" if len(tied.stages) > 1 else ""
            lines.append(
                f"  {tied.name} = {', '.join(others) or tied.name}"
                f" on {where} {', '.join(map(str, tied.stages))}{note}"
            )
    if plan.candidates:
        lines.append("")
        lines += _candidates(plan)
    return "\n".join(lines)


# ----------------------------------------------------------------- parts


def _header(plan: Plan) -> str:
    model = plan.model
    replicas = "replica" if plan.dp == 1 else "replicas"
    stages = "stage" if plan.pp == 1 else "stages"
    micro = "micro-batch" if plan.microbatches == 1 else "micro-batches"
    memory = plan.cost_model.memory_limit
    limit = f", limit {format_bytes(memory)} per GPU" if memory is not None else ""
    return (
        f"{model.class_name}: {format_count(model.parameters)} parameters ({model.capture})"
        f" | {plan.gpus} GPUs = {plan.pp} {stages} x {plan.dp} {replicas}"
        f" | {plan.schedule}, {plan.microbatches} {micro} of {plan.microbatch_size}, batch {plan.batch_size}"
        f" | costs {plan.cost_model.source}{limit}"
    )


def _stage_table(plan: Plan) -> list[str]:
    headers = ["stage", "ranks", "modules", "nodes", "params", "peak memory", "fwd ms", "bwd ms", "sends"]
    right = {0, 3, 4, 5, 6, 7, 8}
    replicated = plan.dp > 1
    if replicated:
        headers.append("allreduce ms")
        right.add(len(headers) - 1)
    rows = []
    for stage in plan.stages:
        p = stage.predicted
        row = [
            str(stage.index),
            _ranks(stage.ranks),
            _modules(stage),
            str(stage.compute_nodes),
            format_bytes(p.parameter_bytes),
            _memory(p.memory_bytes, plan.cost_model.memory_limit),
            _ms(p.forward_s),
            _ms(p.backward_s),
            format_bytes(p.send_bytes) if p.send_bytes else "-",
        ]
        if replicated:
            row.append(_ms(p.allreduce_s))
        rows.append(row)
    table = _render(headers, rows, right)
    table.append("fwd/bwd ms and sends are per micro-batch; peak memory is per GPU for the whole step.")
    return table


def _summary(plan: Plan) -> list[str]:
    step = plan.predicted
    peak = max(step.peak_memory_bytes, default=0.0)
    solver = plan.solver
    prediction = (
        f"predicted step {format_seconds(step.step_s)} | bubble {100 * step.bubble_fraction:.1f}%"
        f" | {step.samples_per_s:,.0f} samples/s | peak memory {format_bytes(peak)} per GPU"
    )
    solved = (
        f"solver {solver.name}: {solver.status}, gap {100 * solver.gap:.1f}% to the lower bound,"
        f" {solver.blocks} blocks, {format_seconds(solver.wall_s)}"
    )
    return [prediction, solved]


def _candidates(plan: Plan) -> list[str]:
    rows = []
    for c in plan.candidates:
        chosen = c.pp == plan.pp and c.dp == plan.dp
        rows.append([
            "*" if chosen else "",
            str(c.pp),
            str(c.dp),
            format_seconds(c.step_s) if c.step_s is not None else "-",
            format_seconds(c.simulated_s) if c.simulated_s is not None else "-",
            c.status,
            c.note,
        ])
    body = _render(["", "pp", "dp", "closed form", "simulated", "status", "note"], rows, {1, 2, 3, 4})
    return ["pp x dp candidates (* = chosen):"] + ["  " + line for line in body]


# ----------------------------------------------------------------- helpers


def _render(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    rule = ["-" * w if h else " " * w for h, w in zip(headers, widths)]
    return [line(headers), line(rule)] + [line(r) for r in rows]


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms == 0:
        return "0"
    if ms < 0.001:
        return f"{ms:.1e}"
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _modules(stage: StagePlan) -> str:
    if not stage.modules:
        return "-"
    first, last = stage.modules[0], stage.modules[-1]
    return first if first == last else f"{first} … {last}"


def _memory(used: float, limit: float | None) -> str:
    text = format_bytes(used)
    if limit:
        share = 100 * used / limit
        text += f" ({'<0.1' if 0 < share < 0.1 else f'{share:.1f}' if share < 10 else f'{share:.0f}'}%)"
    return text
