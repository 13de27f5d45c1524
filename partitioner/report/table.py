"""The plan as a fixed-width text report: a header, one row per stage, then a summary.

Every line fits :data:`WIDTH` columns (the module column is shortened in the
middle when a table would not).

Example::

    >>> from partitioner.plan import example_plan
    >>> print("\\n".join(format_plan(example_plan()).splitlines()[:2]))
    Sequential: 2 parameters (export) | 2 GPUs = 2 stages x 1 replica, one node of 2
    gpipe, 2 micro-batches of 2, batch 4 | fp32, adam | costs measured on cpu
    >>> format_bytes(3 * 1024**2), format_seconds(0.0123)
    ('3.00 MiB', '12.3 ms')
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from partitioner.plan import Candidate, Plan, StagePlan
from partitioner.schedule.bounds import step_bounds
from partitioner.units import format_bytes, format_count, format_seconds, plural

__all__ = [
    "WIDTH",
    "assumptions",
    "crossing_links",
    "experts_summary",
    "format_bytes",
    "format_plan",
    "format_seconds",
    "is_chosen",
    "rank_layout_lines",
    "ranked_candidates",
    "recompute_label",
    "recompute_summary",
    "schedule_label",
    "shard_label",
    "shard_summary",
    "tensor_parallel_summary",
]  # the formatters live in partitioner.units

WIDTH = 100  # columns every line of the text report fits in
SHOWN_CANDIDATES = 12  # rows of the candidate table in the text report (report.md lists every one)


def format_plan(plan: Plan) -> str:
    """The whole report: header, stage table, chunk layout, predictions and assumptions, solver, tied, candidates."""
    lines = _header(plan) + [""]
    lines += _stage_table(plan)
    if plan.chunks > 1:
        lines.append("")
        lines += rank_layout_lines(plan)
    lines.append("")
    lines += _summary(plan)
    if plan.tied:
        lines.append("")
        lines.append("tied parameters (one tensor under several names, or read by several stages):")
        for tied in plan.tied:
            others = [a for a in tied.aliases if a != tied.name]
            where = "stage" if len(tied.stages) == 1 else "stages"
            note = "; gradients summed across stages" if len(tied.stages) > 1 else ""
            named = f"{tied.name} = {', '.join(others)}" if others else tied.name
            lines += _wrap(f"{named} on {where} {', '.join(map(str, tied.stages))}{note}", indent="  ")
    if plan.candidates:
        lines.append("")
        lines += _candidates(plan)
    return "\n".join(lines)


# ----------------------------------------------------------------- shared with report.md


def schedule_label(schedule: str | None, chunks: int | None = 1) -> str:
    """A schedule as the tables name it, with its stages per rank where it chooses them (interleaved).

    >>> schedule_label("interleaved-1f1b", 4), schedule_label("zbv", 2), schedule_label(None)
    ('interleaved-1f1b x4', 'zbv', '-')
    """
    if schedule is None:
        return "-"
    return f"{schedule} x{chunks}" if schedule == "interleaved-1f1b" and chunks else schedule


def rank_layout_lines(plan: Plan) -> list[str]:
    """Which stages each pipeline rank holds, with the rank's predicted peak memory (the chunk layout).

    >>> from partitioner.plan import example_plan
    >>> for line in rank_layout_lines(example_plan()):
    ...     print(line)
    pipeline ranks (gpipe, one stage each):
      rank 0 (GPUs 0): stage 0, peak 320 B
      rank 1 (GPUs 1): stage 1, peak 320 B
    """
    each = "one stage each" if plan.chunks == 1 else f"{plan.chunks} stages each"
    lines = [f"pipeline ranks ({schedule_label(plan.schedule, plan.chunks)}, {each}):"]
    peaks = plan.predicted.peak_memory_bytes
    for rank in range(plan.pp):
        held = plan.stages_of(rank)
        gpus = _ranks(plan.stages[held[0]].ranks) if held else "-"
        peak = f", peak {format_bytes(peaks[rank])}" if rank < len(peaks) else ""
        what = f"stage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}"
        lines += _wrap(f"rank {rank} (GPUs {gpus}): {what}{peak}", indent="  ", subsequent="    ")
    return lines


def recompute_summary(plan: Plan) -> str:
    """Which stages recompute their activations, in a few words.

    >>> from partitioner.plan import example_plan
    >>> recompute_summary(example_plan())
    'none'
    """
    full = [s.index for s in plan.stages if s.recompute == "full"]
    some = [s for s in plan.stages if s.recompute == "selective"]
    if not full and not some:
        return "none"
    if len(full) == len(plan.stages):
        return "every stage (full)"
    parts = [f"full on stage{'s' if len(full) > 1 else ''} {_ranges(full)}"] if full else []
    whole = [s for s in some if s.recompute_layers]
    if whole:
        counts = sorted({s.recompute_layers for s in whole})
        layers = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        parts.append(f"the first {layers} layer runs on stage{'s' if len(whole) > 1 else ''} "
                     f"{_ranges([s.index for s in whole])} (selective)")
    cheap = [s for s in some if s.recompute_ops_layers]
    if cheap:
        runs = sum(s.recompute_ops_layers for s in cheap)
        parts.append(f"only the cheap ops of {plural(runs, 'more layer run')} on stage{'s' if len(cheap) > 1 else ''} "
                     f"{_ranges([s.index for s in cheap])} (per-op: matmul and attention outputs kept)")
    return "; ".join(parts)


def recompute_label(stage: StagePlan) -> str:
    """A stage's recomputation in a word or two: ``none``, ``full``, ``first N runs`` (selective), ``K ops-only``
    (the next K runs recompute only their cheap ops, keeping matmul and attention outputs), or both.

    A run is what the runtime checkpoints as one: a layer's consecutive ops, or root-level code
    of the model (a mask, rotary tables) a stage computes itself (``runtime.execute.recompute.block_nodes``).

    >>> from partitioner.plan import example_plan
    >>> import dataclasses
    >>> recompute_label(dataclasses.replace(example_plan().stages[0], recompute="selective", recompute_layers=3))
    'first 3 runs'
    >>> recompute_label(dataclasses.replace(example_plan().stages[0], recompute="selective", recompute_layers=1,
    ...                                     recompute_ops_layers=4))
    'first 1 run, 4 ops-only'
    """
    if stage.recompute == "selective":
        parts = [f"first {plural(stage.recompute_layers, 'run')}"] if stage.recompute_layers else []
        if stage.recompute_ops_layers:
            parts.append(f"{stage.recompute_ops_layers} ops-only")
        return ", ".join(parts)
    return stage.recompute


def shard_summary(plan: Plan) -> str:
    """How the stage groups' replicas hold their state, with the bytes per parameter it comes to.

    >>> from partitioner.plan import example_plan
    >>> shard_summary(example_plan())
    'none: one replica per stage'
    """
    from partitioner.cost.precision import fp8_gather_saving, gathered_bytes, shard_state_bytes

    if plan.dp <= 1:
        return "none: one replica per stage"
    words = {"none": "none (DDP: whole on every replica, gradients all-reduced in buckets during the last backward)",
             "optimizer": "optimizer (ZeRO-1: optimizer state sharded; gradients all-reduced and updated weights "
                          "broadcast once per step, not overlapped)",
             "full": "full (FSDP2: weights, gradients and optimizer state sharded; weights all-gathered in the "
                     "compute dtype and kept gathered across micro-batches, gradients reduce-scattered once per step, not "
                     "overlapped)"}
    states = plan.cost_model.optimizer_states
    words["zero3"] = ("full, ZeRO-3 (FSDP2, reshard_after_forward: one unit per layer, all-gathered before "
                      "each forward and backward and freed after, gradients reduce-scattered after every "
                      "micro-batch, behind compute)")
    words["hsdp"] = "full, HSDP (" + words["full"].removeprefix("full (")
    words["hsdp-zero3"] = "full, HSDP " + words["zero3"].removeprefix("full, ")
    parts = []
    for label in dict.fromkeys(shard_label(s) for s in plan.stages):
        stages = [s.index for s in plan.stages if shard_label(s) == label]
        mode = "full" if label in ("zero3", "hsdp", "hsdp-zero3") else label
        shards = plan.shard_degree(plan.stages[stages[0]])
        per = shard_state_bytes(plan.precision, states, mode, shards, elements=1, model_bytes=4)
        extra = gathered_bytes(plan.precision, elements=1, model_bytes=4) if label in ("full", "hsdp") else 0
        where = "every stage" if len(stages) == len(plan.stages) else f"stage{'s' if len(stages) > 1 else ''} " \
            f"{_ranges(stages)}"
        over = f"{plan.dp} replicas" if shards == plan.dp else \
            f"{shards} shards per node ({plan.dp // shards} nodes replicate them: HSDP)"
        held = f"{per:.3g} bytes per parameter over {over}" + (
            f" + {extra:.3g} gathered during the step" if extra else "")
        if label in ("zero3", "hsdp-zero3"):
            units = max(s.predicted.gathered_bytes for s in plan.stages)
            held += (f" + at most {format_bytes(units)} of layers gathered (the largest one's weights and gradients, "
                     "the next one's weights, the previous one's reduce-scatter input)")
        if mode == "full" and plan.precision == "fp8" and plan.fp8_recipe == "tensorwise" and plan.tp == 1:
            kept = f", {extra - fp8_gather_saving(plan.precision, 1):.3g} gathered for them" if extra else ""
            held += (", the FP8 linears' weights all-gathered as their FP8 casts (1 byte per element, sent and held "
                     f"gathered{kept}; scales from one amax all-reduce per step)")
        parts.append(f"{words.get(label, label)} on {where}: {held}")
    return "; ".join(parts)


def shard_label(stage: StagePlan) -> str:
    """A stage's shard mode as the tables show it: ``zero3`` for ``full`` with ``reshard_after_forward``,
    ``hsdp`` (and ``hsdp-zero3``) for ``full`` sharded over one node's replicas."""
    if stage.shard != "full":
        return stage.shard
    label = "zero3" if stage.reshard_after_forward else "full"
    return ("hsdp" if label == "full" else "hsdp-zero3") if stage.shard_span == "node" else label


def crossing_links(plan: Plan) -> tuple[list[str], list[int]]:
    """(boundaries "a->b" whose messages cross nodes, stages whose all-reduce crosses nodes).

    >>> from partitioner.plan import example_plan
    >>> crossing_links(example_plan())
    ([], [])
    """
    pairs = sorted({(b.source, b.target) for s in plan.stages for b in s.outputs if b.link == "inter"})
    stages = [s.index for s in plan.stages if s.allreduce_link == "inter" and plan.dp > 1]
    return [f"{a}->{b}" for a, b in pairs], stages


def assumptions(plan: Plan) -> list[tuple[str, str]]:
    """What the prediction assumes, as (topic, statement) pairs: precision, optimizer, recomputation, links."""
    from partitioner.cost.precision import static_bytes_per_element

    cm = plan.cost_model
    per_parameter = static_bytes_per_element(plan.precision, cm.optimizer_states)
    kind = {
        "fp32": "weights, gradients, optimizer state and activations in float32",
        "bf16-mixed": "bf16 compute and activations under autocast; fp32 weights, gradients, optimizer state",
        "bf16": "weights, gradients, optimizer state and activations in bf16",
        "fp8": (f"bf16-mixed with the linear layers' matmuls in FP8 ({plan.fp8_recipe} scaling; their inputs saved "
                "in FP8, their casts priced; the FP8 peak at the device's FP8 matmul efficiency, checked against "
                "published FP8 runs on H100 and Blackwell: docs/accuracy.md); fp32 "
                "weights, gradients, optimizer state"),
    }.get(plan.precision, plan.precision)
    states = "state tensor" if cm.optimizer_states == 1 else "state tensors"
    nodes = _node_layout(plan)
    intra = f"{cm.link_bandwidth / 1e9:.3g} GB/s, {cm.link_latency * 1e6:.3g} µs per message inside a node"
    if cm.inter_node_bandwidth is not None:
        latency = cm.inter_node_latency if cm.inter_node_latency is not None else cm.link_latency
        inter = f"; {cm.inter_node_bandwidth / 1e9:.3g} GB/s, {latency * 1e6:.3g} µs between nodes"
    else:
        inter = "; the same between nodes"
    boundaries, allreduces = crossing_links(plan)
    if plan.gpus_per_node is None or plan.gpus <= plan.gpus_per_node:
        carried = "everything stays inside one node"
    else:
        sends = f"boundaries {', '.join(boundaries)} cross nodes" if boundaries else "no boundary crosses nodes"
        if plan.dp == 1:
            reduces = "no all-reduce (one replica per stage)"
        elif allreduces:
            reduces = f"the all-reduces of stages {_ranges(allreduces)} cross nodes"
        else:
            reduces = "every all-reduce stays inside a node"
        carried = f"{sends}; {reduces}"
    peak = (f"model FLOPs of a step (forward + backward, recomputation not counted) / ({plural(plan.gpus, 'GPU')} x "
            f"{cm.peak_flops / 1e12:,.4g} TFLOP/s x step)") if cm.peak_flops else "not known (no peak FLOP/s)"
    if cm.peak_flops and plan.precision == "fp8":  # one peak for mixed FP8/bf16 matmuls (torchtitan: ill-defined)
        peak += (": FP8 matmuls counted at the 16-bit peak, as torchtitan counts float8 runs, though they run "
                 "against the FP8 one: an FP8 plan's MFU reads higher than bf16 can reach (shown at most 100%)")
    return [
        ("precision", f"{plan.precision}: {kind}"),
        ("optimizer", (f"{plan.optimizer}, {cm.optimizer_states} {states} per parameter: "
                       f"{per_parameter} bytes per parameter with weights and gradients")),
        ("recomputation", recompute_summary(plan)),
        ("sharding", shard_summary(plan)),
        ("links", f"{nodes}; {intra}{inter}"),
        ("across nodes", carried),
        ("MFU", peak),
        ("device", device_summary(plan)),
        *([("tensor parallel", tensor_parallel_summary(plan))] if plan.tp > 1 else []),
        *([("experts", experts_summary(plan))] if plan.experts else []),
    ]


def experts_summary(plan: Plan) -> str:
    """The experts' line of the assumptions: the layers, and how expert parallelism holds and feeds them.

    >>> import dataclasses
    >>> from partitioner.graph.experts import ExpertLayer
    >>> from partitioner.plan import example_plan
    >>> layer = ExpertLayer("moe", "Experts", 8, 2, 64, 256, "stacked", ("moe.w",), ("n",), "t", "i", "w", "n")
    >>> p = dataclasses.replace(example_plan(), experts=(layer,) * 2)
    >>> experts_summary(p).split(";")[0]
    '2 experts layers (8 experts, top-2)'
    """
    counts = sorted({layer.experts for layer in plan.experts})
    tops = sorted({layer.top_k for layer in plan.experts})
    head = (f"{plural(len(plan.experts), 'experts layer')} ({'/'.join(map(str, counts))} experts, "
            f"top-{'/'.join(map(str, tops))})")
    if plan.ep == 1:
        return f"{head}; every replica holds every expert (ep 1: no all-to-all)"
    per_node = (plan.gpus_per_node or plan.gpus) // plan.tp
    where = _group_place(plan, plan.ep * plan.tp) if per_node % plan.ep == 0 else \
        f"across {plan.ep // math.gcd(plan.ep, per_node)} nodes (each GPU's network port)"
    return (f"{head}; ep {plan.ep}: each group of {plan.ep} consecutive replicas holds {counts[0] // plan.ep} of each "
            f"layer's experts per GPU, its weights, gradients and optimizer state; tokens dispatched and combined "
            f"by four all-to-alls per layer and micro-batch {where}, not overlapped, the busiest member at "
            "--expert-imbalance times the mean; expert gradients all-reduced over dp / ep replicas")


def device_summary(plan: Plan) -> str:
    """Where the device's numbers come from: measured here, or a datasheet roofline calibrated on published runs.

    >>> from partitioner.plan import example_plan
    >>> device_summary(example_plan())
    'cpu: measured here'
    """
    cm = plan.cost_model
    if cm.source.startswith("measured"):
        return f"{plan.device.removesuffix(' (measured)')}: measured here"
    shares = ", ".join(f"{k} {v:.2f}" for k, v in cm.efficiency)
    if cm.calibrated_by:
        runs = ", ".join(cm.calibrated_by)
        return (f"{plan.device}: datasheet peaks at the shares fitted to {plural(len(cm.calibrated_by), 'published run')} "
                f"({shares}; fitted to {runs}; tools/validate_published.py checks the others)")
    if shares:
        return f"{plan.device}: datasheet peaks at the shares {shares}; no published run calibrates it"
    return f"{plan.device}: no published run calibrates it: the bare datasheet roofline (every op at its peak)"


def tensor_parallel_summary(plan: Plan) -> str:
    """Tensor parallelism's line of the assumptions: the group, and its collectives' seconds per step.

    >>> import dataclasses
    >>> from partitioner.plan import example_plan
    >>> p = example_plan()
    >>> p = dataclasses.replace(p, tp=2, gpus=2 * p.gpus, gpus_per_node=4, stages=tuple(dataclasses.replace(
    ...     s, predicted=dataclasses.replace(s.predicted, tp_comm_s=1e-3)) for s in p.stages))
    >>> tensor_parallel_summary(p).split(";")[0]
    '2 GPUs per group inside a node (NVLink), sequence parallel'
    """
    per_rank: dict[int, float] = {}
    for st in plan.stages:
        per_rank[st.rank] = per_rank.get(st.rank, 0.0) + st.predicted.tp_comm_s * plan.microbatches
    busiest = max(per_rank.values(), default=0.0)
    return (f"{plan.tp} GPUs per group {_group_place(plan, plan.tp)}, sequence parallel; column/row pairs all-gather "
            f"and reduce-scatter b x s x h twice per layer each way (Megatron, Korthikanti et al. 2022), not "
            f"overlapped: {format_seconds(busiest)} of the busiest pipeline rank's step "
            f"({100 * busiest / plan.predicted.step_s:.0f}%)" if plan.predicted.step_s > 0 else "")


def ranked_candidates(plan: Plan) -> list[Candidate]:
    """The candidates, best first: chosen, simulated, solved by closed form, pruned, not fitting, skipped."""
    rank = {"pruned": 3, "infeasible": 4, "skipped": 5}

    def key(c: Candidate) -> tuple[float, ...]:
        if is_chosen(c, plan):
            return (0, 0.0, 0.0)
        if c.simulated_s is not None:
            return (1, c.simulated_s, 0.0)
        if c.step_s is not None:
            return (2, c.step_s, 0.0)
        return (rank.get(c.status, 6), c.pp, -(c.microbatches or 0))

    return sorted(plan.candidates, key=key)


def is_chosen(candidate: Candidate, plan: Plan) -> bool:
    """True for the candidate that became ``plan`` (by its note; by its shape for version-1 plans)."""
    if candidate.note == "chosen":
        return True
    return candidate.microbatches is None and (candidate.pp, candidate.dp) == (plan.pp, plan.dp) \
        and not any(c.note == "chosen" for c in plan.candidates)


# ----------------------------------------------------------------- parts


def _header(plan: Plan) -> list[str]:
    model = plan.model
    micro = plural(plan.microbatches, "micro-batch", "micro-batches")
    memory = plan.cost_model.memory_limit
    limit = f" | {format_bytes(memory)} per GPU" if memory is not None else ""
    parameters = "parameter" if model.parameters == 1 else "parameters"
    shape = (f"{plural(plan.pp, 'stage')} x {plural(plan.dp, 'replica')}" if plan.chunks == 1 else
             f"{plural(plan.pp, 'pipeline rank')} x {plural(plan.dp, 'replica')}, {len(plan.stages)} stages")
    shape += f" x tp {plan.tp}" if plan.tp > 1 else ""  # tensor-parallel groups (issue 22)
    first = (f"{model.class_name}: {format_count(model.parameters)} {parameters} ({model.capture})"
             f" | {plural(plan.gpus, 'GPU')} = {shape}, {_node_layout(plan)}")
    cm = plan.cost_model
    jitter = f", jitter {100 * cm.action_jitter:.0f}%" if cm.action_jitter else ""
    calibrated = "" if (cm.calibration_scale, cm.action_host_s, cm.action_jitter) == (1.0, 0.0, 0.0) else \
        f", calibrated (x{cm.calibration_scale:.2f}, +{format_seconds(cm.action_host_s)} per action{jitter})"
    second = (f"{schedule_label(plan.schedule, plan.chunks)}, {micro} of {plan.microbatch_size}, batch {plan.batch_size}"
              f" | {plan.precision}, {plan.optimizer} | costs {cm.source}{calibrated}{limit}")
    return _wrap(first) + _wrap(second)


def _node_layout(plan: Plan) -> str:
    per_node = plan.gpus_per_node or plan.gpus
    host = getattr(plan, "gpus_per_host", None)
    hosts = f" ({per_node // host} hosts of {host} each: one NVLink domain)" if host else ""
    if per_node >= plan.gpus:
        return f"one node of {plan.gpus}{hosts}"
    return f"{plan.gpus // per_node} nodes of {per_node}{hosts}"


def _group_place(plan: Plan, size: int) -> str:
    """Where a group of ``size`` consecutive GPUs sits: inside a host, or across hosts of one NVLink domain."""
    host = getattr(plan, "gpus_per_host", None)
    if host and size > host:
        return (f"inside a {plan.gpus_per_node}-GPU NVLink domain, across {size // host} hosts of {host} "
                "(NVLink joins them: no network hop)")
    return "inside a node (NVLink)"


def _stage_table(plan: Plan) -> list[str]:
    headers = ["stage", "ranks", "modules", "params", "peak memory", "fwd ms", "bwd ms", "recomp", "sends"]
    right = {0, 3, 4, 5, 6, 8}
    replicated = plan.dp > 1
    if replicated:
        headers += ["shard", "allreduce ms"]
        right.add(len(headers) - 1)
    rows = []
    for stage in plan.stages:
        p = stage.predicted
        row = [
            str(stage.index),
            _ranks(stage.ranks),
            _modules(stage),
            format_bytes(p.parameter_bytes),
            _memory(p.memory_bytes, plan.cost_model.memory_limit),
            _ms(p.forward_s),
            _ms(p.backward_s),
            "-" if stage.recompute == "none" else recompute_label(stage),
            format_bytes(p.send_bytes) if p.send_bytes else "-",
        ]
        if replicated:
            row += [shard_label(stage), _ms(p.allreduce_s) + ("*" if stage.allreduce_link == "inter" else "")]
        rows.append(row)
    table = _render(headers, rows, right, shrink=2, indent=0)
    where = "per GPU" if plan.chunks == 1 else "the stage's own share of its GPU (per GPU: below)"
    notes = f"fwd/bwd ms and sends: per micro-batch (bwd with recomputation); peak memory: {where}, whole step"
    if replicated and any(s.shard != "none" for s in plan.stages):
        notes += "; allreduce ms: a sharded group's reduce-scatter and all-gather per step"
        if any(shard_label(s) in ("zero3", "hsdp-zero3") for s in plan.stages):
            notes += " (zero3: per micro-batch, in fwd/bwd ms where compute does not hide them)"
    if any(s.allreduce_link == "inter" for s in plan.stages) and replicated:
        notes += "; *: across nodes"
    return table + _wrap(notes + ".")


def _summary(plan: Plan) -> list[str]:
    step = plan.predicted
    peak = max(step.peak_memory_bytes, default=0.0)
    solver = plan.solver
    mfu = f" | MFU {100 * step.mfu:.1f}%" if step.mfu is not None else ""
    prediction = (
        f"predicted step {format_seconds(step.step_s)} | bubble {100 * step.bubble_fraction:.1f}%"
        f" | {step.samples_per_s:,.0f} samples/s{mfu} | peak memory {format_bytes(peak)} per GPU"
    )
    # Proven optimal has no gap (plans saved before exact solvers reported their own bound may say otherwise).
    gap = 0.0 if solver.status == "optimal" else solver.gap
    solved = (f"solver {solver.name}: {solver.status}, gap {100 * gap:.1f}% to the lower bound,"
              f" {solver.blocks} blocks, {format_seconds(solver.wall_s)}")
    lines = _wrap(prediction)
    lines += _wrap(f"bounds: {step_bounds(plan).describe()} per step: no overlap goes below either")
    lines.append("assumptions:")
    for topic, text in assumptions(plan):
        lines += _wrap(f"{topic}: {text}", indent="  ", subsequent="    ")
    return lines + _wrap(solved)


def _candidates(plan: Plan) -> list[str]:
    ranked = ranked_candidates(plan)
    shown: list[Candidate] = []
    shapes: set[tuple[int, int]] = set()
    for i, c in enumerate(ranked):  # all if few; else the best few, the simulated, the best of every pp x dp
        if len(ranked) <= SHOWN_CANDIDATES or i < SHOWN_CANDIDATES // 2 or c.simulated_s is not None \
                or (c.pp, c.dp) not in shapes:
            shown.append(c)
            shapes.add((c.pp, c.dp))
    shown = shown[:SHOWN_CANDIDATES]
    sharded = any(getattr(c, "shard", None) not in (None, "none") for c in plan.candidates)
    experts = any(getattr(c, "ep", 1) > 1 for c in plan.candidates)
    rows = []
    for c in shown:
        rows.append([
            "*" if is_chosen(c, plan) else "",
            str(c.pp),
            str(c.dp),
            "-" if c.microbatches is None else str(c.microbatches),
            schedule_label(c.schedule, getattr(c, "chunks", None)),
            _recomputed(c),
            format_seconds(c.step_s) if c.step_s is not None else "-",
            format_seconds(c.simulated_s) if c.simulated_s is not None else "-",
            c.note or c.status,
        ])
        if sharded:
            rows[-1].insert(5, getattr(c, "shard", None) or "-")
        if experts:
            rows[-1].insert(3, str(getattr(c, "ep", 1)))
    headers = ["", "pp", "dp", "M", "sched", "recomp", "closed form", "simulated", "why not chosen"]
    right = {1, 2, 3, 6, 7}
    if sharded:
        headers.insert(5, "shard")
        right = {1, 2, 3, 7, 8}
    if experts:  # the expert-parallel degree, after dp
        headers.insert(3, "ep")
        right = {i + (i >= 3) for i in right} | {3}
    body = _render(headers, rows, right, shrink=len(headers) - 1, indent=2, keep_head=True)
    what = (" x ep" if experts else "") + (" x shard" if sharded else "")
    title = (f"candidates: pp x dp x M x schedule{what} (* = chosen; simulated: the best, and the best of each "
             "schedule)")
    lines = _wrap(title) + ["  " + line for line in body]
    hidden = len(plan.candidates) - len(shown)
    if hidden > 0:
        lines.append(f"  (+{hidden} more combination{'s' if hidden > 1 else ''}: report.md and plan.json list every one)")
    return lines


def _recomputed(c: Candidate) -> str:
    if c.recomputed_stages is None:
        return "-"
    if c.recomputed_stages == 0:
        return "none"
    stages = c.pp * (getattr(c, "chunks", None) or 1)
    return "all" if c.recomputed_stages == stages else f"{c.recomputed_stages}/{stages}"


# ----------------------------------------------------------------- helpers


def _render(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int], *, shrink: int | None = None,
    indent: int = 0, keep_head: bool = False,
) -> list[str]:
    """Aligned columns; column ``shrink`` is cut short in the middle (``keep_head``: at its end,
    for sentences) so that lines indented by ``indent`` stay within :data:`WIDTH`."""
    cells = [list(r) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    gap = 2

    def over() -> int:
        return sum(widths) + gap * (len(widths) - 1) + indent - WIDTH

    def cut(least: int) -> None:
        assert shrink is not None
        room = max(len(headers[shrink]), widths[shrink] - over(), least)
        for r in cells:
            r[shrink] = _head(r[shrink], room) if keep_head else _shorten(r[shrink], room)
        widths[shrink] = max([len(headers[shrink])] + [len(r[shrink]) for r in cells])

    # Wide tables (many stages: 4-digit ranks; replicas: one more column) give up, in turn,
    # the shrinkable column's last readable characters and the double spaces between columns.
    if shrink is not None and over() > 0:
        cut(8)
    if over() > 0:
        gap = 1
    if shrink is not None and over() > 0:
        cut(1)

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return (" " * gap).join(parts).rstrip()

    rule = ["-" * w if h else " " * w for h, w in zip(headers, widths)]
    return [line(headers), line(rule)] + [line(r) for r in cells]


def _shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, an ellipsis in the middle where cut.

    >>> _shorten("transformer.h.0 … transformer.h.11", 20)
    'transform…ormer.h.11'
    """
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _head(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut at its end (an ellipsis marks the cut).

    >>> _head("slower: +7.1% (simulated), bubble 22%", 27)
    'slower: +7.1% (simulated),…'
    """
    return text if len(text) <= width else text[: width - 1] + "…"


def _wrap(text: str, *, indent: str = "", subsequent: str | None = None) -> list[str]:
    return textwrap.wrap(text, width=WIDTH, initial_indent=indent,
                         subsequent_indent=indent if subsequent is None else subsequent,
                         break_on_hyphens=False, break_long_words=False) or [indent]


def _ranges(values: Sequence[int]) -> str:
    """Ascending integers as runs.

    >>> _ranges([0, 1, 2, 5, 7, 8])
    '0-2, 5, 7-8'
    """
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


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
