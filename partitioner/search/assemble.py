"""A plan from a solved partition: stages, boundaries, tied parameters, schedule, prediction and stage code.

:func:`build_plan` assembles one solved combination into a
:class:`~partitioner.plan.Plan` (each stage's nodes, boundary tensors, ranks,
links, recomputation and predicted costs), lowers its schedule into action
lists and predicts its step by simulation; :func:`stage_codes` generates the
readable code of each stage, for the chosen plan only.  Ranks are laid out
pipeline-rank-major (:func:`stage_layout`); a schedule with several stages per
pipeline rank places them by :func:`~partitioner.orders.stage_ranks`
(the solved problem's ``stage_rank``), and every link is that of the stages'
ranks.

    >>> stage_layout(2, 3)
    [(0, 1, 2), (3, 4, 5)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import fx

from partitioner.cost.comm import allreduce_crosses_nodes, p2p_crosses_nodes
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.precision import activation_scale, compute_dtype, fp8_peak
from partitioner.defaults import splits_backward
from partitioner.errors import InternalError
from partitioner.graph.capture import CapturedModel
from partitioner.graph.ir import (
    KIND_KEY,
    VALUE_KEY,
    ValueInfo,
    graph_fingerprint,
    module_path,
    node_parameters,
)
from partitioner.layout import Layout
from partitioner.plan import (
    FORMAT_VERSION,
    Boundary,
    CostModelInfo,
    ModelInfo,
    Plan,
    SolverInfo,
    StagePlan,
    StagePrediction,
    StepPrediction,
    TensorSpec,
    TiedParameter,
    stage_topology,
)
from partitioner.schedule.bounds import step_bounds
from partitioner.schedule.lower import compute_order, lower, validate
from partitioner.schedule.simulate import simulate
from partitioner.search.layouts import Solved
from partitioner.search.options import PlanOptions, batch_size_of
from partitioner.solve.formulate import (
    GraphCosts,
    expert_seconds,
    layer_runs,
    mode_parts,
    zero3_costs,
)
from partitioner.solve.problem import (
    StageRecompute,
    allreduce_latencies,
    cheap_blocks,
    choose_recompute,
    recompute_peak,
    recomputed_blocks,
    split_backward,
    stage_costs,
    stage_memory,
    stage_rank_of,
    within_limit,
)
from partitioner.stagegraph import StageSignature, build_stage, closures, stage_signature
from partitioner.units import format_seconds

__all__ = ["build_plan", "check_bounds", "dtype_peaks", "mfu_peak_flops", "model_flops_utilization", "predict", "stage_codes",
           "stage_layout"]


def stage_layout(pp: int, dp: int) -> list[tuple[int, ...]]:
    """Global ranks of each pipeline rank's replicas, rank-major (Megatron's order: replicas are neighbours)."""
    layout = Layout(pp=pp, dp=dp)
    return [layout.stage_groups(s) for s in range(pp)]



def build_plan(
    model: torch.nn.Module,
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    graph: GraphCosts,
    solved: Solved,
    options: PlanOptions,
) -> Plan:
    """The plan for one solved combination, less candidates and stage code: assemble, lower, predict.

    ``graph`` holds the costs at the combination's micro-batch count.  Boundary
    shapes are scaled from the captured micro-batch (``micro``) to the
    combination's (drafts are ranked before the winner is recaptured at its size).
    """
    stages = _stages(captured, graph, solved, options, sizes=(batch_size_of(micro), _microbatch_size(solved, options)))
    partition, spec = solved.partition, options.spec
    model_flops = graph.flops() * solved.microbatches  # one mini-batch over all replicas
    assembled = Plan(
        format_version=FORMAT_VERSION,
        model=_model_info(model, captured, micro),
        gpus=options.gpus, pp=solved.pp, dp=solved.dp, microbatches=solved.microbatches, chunks=solved.chunks,
        schedule=solved.schedule, batch_size=options.batch, device=options.device_name,
        stages=stages,
        actions=(),  # _lower
        tied=_tied(captured, stages),
        predicted=StepPrediction(0.0, 0.0, 0.0, (), model_flops=model_flops or None),  # predict
        solver=SolverInfo(partition.solver, partition.status, partition.objective, partition.lower_bound,
                          partition.wall_s, len(graph.blocks)),
        cost_model=CostModelInfo(
            source=("measured on " if options.measure else "predicted for ") + spec.name,
            link_bandwidth=spec.link_bandwidth, link_latency=spec.link_latency,
            memory_limit=options.memory_limit, optimizer_states=options.optimizer_states,
            inter_node_bandwidth=spec.inter_node_bandwidth, inter_node_latency=spec.inter_node_latency,
            peak_flops=mfu_peak_flops({n: graph.node_flops.get(n, 0.0) for b in graph.blocks for n in b},
                                      graph.node_time_s, graph.node_dtype, spec=spec, precision=options.precision,
                                      fp8=graph.fp8_nodes),
            message_host_s=spec.message_host_s,
            calibration_scale=options.calibration.scale, action_host_s=options.calibration.action_s,
            action_jitter=options.calibration.jitter,
            efficiency=() if options.measure else spec.efficiency,
            calibrated_by=() if options.measure else spec.calibrated_by,
        ),
        candidates=(),  # compile: every combination's row, on the chosen plan
        bucket_cap_mb=options.bucket_cap_mb,
        stage_code=(),  # stage_codes, for the chosen plan only
        precision=options.precision,
        fp8_recipe=options.fp8_recipe,
        optimizer=options.optimizer,
        gpus_per_node=options.gpus_per_node,
        gpus_per_host=options.gpus_per_host,
        ep=solved.ep,
        experts=captured.experts,
    )
    return predict(_lower(assembled))



def _microbatch_size(solved: Solved, options: PlanOptions) -> int:
    return options.batch // (solved.dp * solved.microbatches)



# The last few (model, capture, inputs) described: every plan of a search builds the same ModelInfo (the
# fingerprint walks the whole graph); the objects are held with it, so their ids stay theirs while kept.
_MODEL_INFOS: dict[tuple[int, int, int], tuple[tuple[Any, ...], ModelInfo]] = {}


def _model_info(model: torch.nn.Module, captured: CapturedModel, micro: tuple[torch.Tensor, ...]) -> ModelInfo:
    key = (id(model), id(captured), id(micro))
    found = _MODEL_INFOS.get(key)
    if found is None or any(a is not b for a, b in zip(found[0], (model, captured, micro), strict=True)):
        if len(_MODEL_INFOS) >= 4:
            _MODEL_INFOS.pop(next(iter(_MODEL_INFOS)))
        found = _MODEL_INFOS[key] = ((model, captured, micro), _describe_model(model, captured, micro))
    return found[1]


def _describe_model(model: torch.nn.Module, captured: CapturedModel, micro: tuple[torch.Tensor, ...]) -> ModelInfo:
    return ModelInfo(
        class_name=type(model).__name__,
        fingerprint=graph_fingerprint(captured.graph_module),
        capture=captured.method,
        inputs=tuple(TensorSpec(name, tuple(x.shape), str(x.dtype).removeprefix("torch."))
                     for name, x in zip(captured.input_names, micro)),
        outputs=tuple(captured.output_nodes),
        call=captured.call.to_json(),
        parameters=sum(p.numel() for p in model.parameters()),
        parameter_bytes=sum(p.nbytes for p in model.parameters()),
    )



def _stages(
    captured: CapturedModel, graph: GraphCosts, solved: Solved, options: PlanOptions, *, sizes: tuple[int, int]
) -> tuple[StagePlan, ...]:
    """Each stage's nodes, boundary tensors, ranks, links, recomputation and predicted costs.

    Costs come from the solver's problem, so the plan shows what the solver
    optimised: a recomputing stage's backward includes its blocks' forward again
    (``recompute_s``) and it keeps only its blocks' inputs per micro-batch
    (``recompute_bytes``), plus the largest block's activations during each
    backward (:func:`partitioner.solve.problem.stage_memory`); a stage recomputing
    only its first blocks (selective) keeps the others' activations and records how
    many of its runtime layers recompute (:func:`_recompute_mode`).
    """
    gm = captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    count, dp, problem, partition = solved.stages, solved.dp, solved.problem, solved.partition
    m, kind, per_node = solved.microbatches, solved.schedule, options.gpus_per_node
    rank = stage_rank_of(problem, count)  # the pipeline rank of each of the pp x chunks stages
    peak_of = dtype_peaks(graph.node_flops, graph.node_time_s, graph.node_dtype, spec=options.spec,
                          precision=options.precision, fp8=graph.fp8_nodes)

    fp8_peak_of = fp8_peak(options.spec.peak_flops, options.fp8_recipe) if options.precision == "fp8" else None

    def at_peak(names: list[str]) -> float:
        return sum(graph.node_flops.get(n, 0.0) / (
            fp8_peak_of if fp8_peak_of and n in graph.fp8_nodes else
            peak_of[_runs_at(graph.node_dtype.get(n, "float32"), options.precision)])
                   for n in names if graph.node_flops.get(n, 0.0) > 0) / dp
    stage_of_node = {name: partition.stage_of[b] for b, members in enumerate(graph.blocks) for name in members}
    compute_sets: list[set[str]] = [set() for _ in range(count)]
    for name, s in stage_of_node.items():
        compute_sets[s].add(name)
    blocks_of: list[list[int]] = [[] for _ in range(count)]
    for b, s in enumerate(partition.stage_of):
        blocks_of[s].append(b)
    boundaries = tuple(
        dataclasses.replace(b, link="inter" if rank[b.source] != rank[b.target] and p2p_crosses_nodes(
            rank[b.source], rank[b.target], dp=dp, gpus_per_node=per_node) else "intra")
        for b in _boundaries(gm, stage_of_node, count, sizes=sizes)
    )
    recompute = partition.recompute or choose_recompute(problem, partition.stage_of, count, microbatches=m, schedule=kind)
    ops = partition.recompute_ops or None  # per stage: blocks after the recomputed ones recomputing only cheap ops
    redo = recomputed_blocks(partition.stage_of, count, recompute)
    cheap = cheap_blocks(partition.stage_of, count, recompute, ops)
    _, allreduce = stage_costs(problem, partition.stage_of, count, recompute=recompute, ops=ops)
    latency = list(allreduce_latencies(problem, count))
    memory = stage_memory(problem, partition.stage_of, count, microbatches=m, schedule=kind, recompute=recompute,
                          ops=ops)
    base, zero3, span = mode_parts(solved.shard)
    zero3 = zero3 and dp > 1
    # ZeRO-3 is shard "full" with reshard_after_forward (runtime/parallel/shard.py); its exposed collectives per
    # micro-batch are in the problem's block times (formulate) and here in each stage's F and B.
    shard = [base if dp > 1 else "none"] * count
    reshard = [zero3] * count
    exposed_f, exposed_b = [0.0] * count, [0.0] * count
    if zero3:
        z = zero3_costs(graph, dp=dp, spec=options.spec, precision=options.precision, gpus_per_node=per_node,
                        span=span, unit=options.zero3_unit, ep=solved.ep)
        for b, s in enumerate(partition.stage_of):
            exposed_f[s] += z.forward_s[b]
            exposed_b[s] += z.backward_s[b]
    # The gathered units are a rank's, whatever stages it holds: counted once, on its first stage.
    units = [solved.gathered if zero3 and s == min(t for t in range(count) if rank[t] == rank[s]) else 0.0
             for s in range(count)]
    memory = [x + u for x, u in zip(memory, units, strict=True)]
    if solved.whole is not None and dp > 1:
        # Per stage group, DDP where it fits whole with the same recomputation (its bucketed all-reduce
        # overlaps the last backward); the combination's shard mode elsewhere.
        whole = solved.whole
        kept = stage_memory(whole, partition.stage_of, count, microbatches=m, schedule=kind, recompute=recompute,
                            ops=ops)
        _, reduce = stage_costs(whole, partition.stage_of, count, recompute=recompute, ops=ops)
        wait = allreduce_latencies(whole, count)
        # Every stage holding a tied parameter (any parameter two stages read: aliases, a reused layer, a
        # head reading the embedding's weight) keeps the combination's mode: the runtime sums a tied
        # parameter's copies shard for shard, or whole, never one of each (runtime/parallel/shard.py).
        holders: dict[str, set[int]] = {}
        for b, read in enumerate(graph.block_parameters):
            for name in read:
                holders.setdefault(name, set()).add(partition.stage_of[b])
        pinned = {s for stages in holders.values() if len(stages) > 1 for s in stages}
        for s in range(count):
            if s not in pinned and within_limit(kept[s], whole.memory_limit):
                shard[s], memory[s], allreduce[s], latency[s] = "none", kept[s], reduce[s], wait[s]
                if reshard[s]:  # DDP: none of ZeRO-3's collectives or gathered units (or its host wait per action)
                    reshard[s], exposed_f[s], exposed_b[s] = False, -z.first_gather_s, -z.first_gather_s
    # Expert parallelism: each experts layer's all-to-alls and its busiest member's extra compute (formulate).
    if solved.ep > 1:
        added_f, added_b = expert_seconds(graph, dp=dp, ep=solved.ep, imbalance=options.expert_imbalance,
                                          precision=options.precision, spec=options.spec, gpus_per_node=per_node)
        for b, s in enumerate(partition.stage_of):
            exposed_f[s] += added_f[b]
            exposed_b[s] += added_b[b]
    layout = stage_layout(solved.pp, dp)
    # W per stage, and the host seconds a split backward adds to it (problem.split_backward).
    block_forward = [sum(graph.node_forward_s[n] for n in members) / dp for members in graph.blocks]
    block_forward[-1] += graph.loss_s[0] / dp
    weight, added, in_forward = split_backward(problem, partition.stage_of, count, forward_s=block_forward)
    if not splits_backward(kind):
        added = in_forward = [0.0] * count
    stages: list[StagePlan] = []
    needed = closures(gm, compute_sets)
    for s in range(count):
        names = needed[s]
        model_inputs = tuple(dict.fromkeys(
            a.name for n in names for a in nodes[n].all_input_nodes if a.op == "placeholder"))
        inputs = tuple(b for b in boundaries if b.target == s)
        outputs = tuple(b for b in boundaries if b.source == s)
        params = tuple(sorted({p for n in names for p in _parameters_of(gm, nodes[n])}))
        compute = [n for n in names if n in compute_sets[s]]
        # Name the range by user modules; root-level glue (x.size(1), a residual add) only if nothing else.
        paths = [module_path(nodes[n]) for n in compute if module_path(nodes[n])] or ["(root)"]
        last = s == count - 1
        forward = (sum(graph.node_forward_s[n] for n in compute) + (graph.loss_s[0] if last else 0.0)) / dp
        total = (sum(graph.node_time_s[n] for n in compute) + (sum(graph.loss_s) if last else 0.0)) / dp
        # The runtime's host time per action (a calibration's): once in F, once in B (W's is in added).
        forward, total = forward + problem.action_s + in_forward[s], total + 2 * problem.action_s
        forward, total = forward + exposed_f[s], total + exposed_f[s] + exposed_b[s]
        kept = [problem.activation_bytes[b] for b in blocks_of[s]]
        again, redone = 0.0, [b for b in blocks_of[s] if redo[b]]
        light = [b for b in blocks_of[s] if cheap[b]]
        if redone:
            assert problem.recompute_bytes is not None and problem.recompute_s is not None
            again = sum(problem.recompute_s[b] for b in redone)
        if light:
            assert problem.op_kept_bytes is not None and problem.op_recompute_s is not None
            again += sum(problem.op_recompute_s[b] for b in light)
        if redone or light:
            assert problem.recompute_bytes is not None and (not light or problem.op_kept_bytes is not None)
            kept = [problem.recompute_bytes[b] if redo[b] else problem.op_kept_bytes[b] if cheap[b]  # type: ignore[index]
                    else problem.activation_bytes[b] for b in blocks_of[s]]
        mode, layers, ops_layers = _recompute_mode(recompute[s], len(redone), len(light), blocks_of[s], graph,
                                                   [nodes[n] for n in names])
        stages.append(StagePlan(
            index=s,
            rank=rank[s],
            ranks=layout[rank[s]],
            nodes=tuple(names),
            compute_nodes=len(compute),
            parameters=params,
            model_inputs=model_inputs,
            inputs=inputs,
            outputs=outputs,
            modules=(paths[0], paths[-1]),
            predicted=StagePrediction(
                forward_s=forward,
                backward_s=(backward := total - forward + again + added[s]),  # less F's part of added
                memory_bytes=memory[s],
                parameter_bytes=sum(graph.parameter_bytes[captured.parameter_names[p]] for p in params),
                expert_parameter_bytes=float(sum(graph.parameter_bytes[captured.parameter_names[p]] for p in params
                                           if captured.parameter_names[p] in graph.expert_parameters)),
                fp8_gathered_elements=float(sum(
                    graph.parameter_elements.get(n, graph.parameter_bytes[n] / 4) for n in
                    {captured.parameter_names[p] for p in params} - graph.expert_parameters
                    if n in graph.fp8_gathered)) if options.precision == "fp8" else 0.0,
                activation_bytes=sum(kept),
                send_bytes=round(sum(b.nbytes * activation_scale(options.precision, b.dtype) for b in outputs)),
                allreduce_s=allreduce[s] + latency[s],
                recompute_s=again,
                recompute_peak_bytes=max((recompute_peak(problem)[b] for b in (*redone, *light)), default=0.0),
                weight_s=min(weight[s], backward),  # the same seconds, summed per block or per node
                gathered_bytes=units[s] if reshard[s] else 0.0,
                flops=sum(graph.node_flops.get(n, 0.0) for n in compute) / dp,
                peak_s=at_peak(compute),
            ),
            recompute=mode,
            recompute_layers=layers,
            recompute_ops_layers=ops_layers,
            allreduce_link="inter" if allreduce_crosses_nodes(rank[s], dp=dp, gpus_per_node=per_node) else "intra",
            # The problem was priced for the group's shard mode (formulate); one replica shards nothing.
            # "full": kept gathered across micro-batches, as torch's pipelining keeps FSDP2, or ZeRO-3.
            shard=shard[s],
            reshard_after_forward=reshard[s],
            shard_span=span if shard[s] == "full" else "world",
        ))
    return tuple(stages)



def _recompute_mode(
    choice: StageRecompute, redone: int, cheap: int, blocks: list[int], graph: GraphCosts,
    stage_nodes: list[fx.Node],
) -> tuple[str, int, int]:
    """A stage's ``recompute``, ``recompute_layers`` and ``recompute_ops_layers`` in the plan, from the
    solver's per-stage choice: its first ``redone`` blocks recompute wholly, the next ``cheap`` their cheap ops.

    Selective: the runtime recomputes the stage graph's first layer runs
    (``runtime.execute.recompute.block_nodes``, the rule of :func:`~partitioner.solve.formulate.layer_runs`),
    so each count is that of the runs before the one holding the first block past it
    (the solver cuts only where a layer starts: ``PartitionProblem.layer_start``).
    """
    if redone == 0 and cheap == 0:
        return "none", 0, 0
    if cheap == 0 and (redone >= len(blocks) or choice is True):
        return "full", 0, 0
    runs = layer_runs(stage_nodes)

    def runs_before(position: int) -> int:
        if position >= len(blocks):
            return len(runs)
        first = graph.blocks[blocks[position]][0]
        return next((i for i, run in enumerate(runs) if first in run), len(runs))

    layers = max(1, runs_before(redone)) if redone else 0
    ops_layers = max(1, runs_before(redone + cheap) - layers) if cheap else 0
    if layers >= len(runs):
        return "full", 0, 0
    return "selective", layers, min(ops_layers, len(runs) - layers)


def _lower(plan: Plan) -> Plan:
    """The schedule's action lists for the plan's stages, communication inserted, validated."""
    sends_to, receives_from = stage_topology(plan.stages)
    lowered = lower(compute_order(plan.schedule, ranks=plan.pp, microbatches=plan.microbatches, chunks=plan.chunks),
                    sends_to=sends_to, receives_from=receives_from, stage_rank=plan.stage_ranks(), kind=plan.schedule)
    validate(lowered, sends_to=sends_to, receives_from=receives_from, stage_rank=plan.stage_ranks())
    return plan.with_schedule(lowered)



def predict(plan: Plan) -> Plan:
    """The step prediction, from a discrete-event simulation of the lowered plan, and the MFU it implies.

    Checked against the plan's own bounds (:func:`check_bounds`): no plan leaves here faster than physics.
    """
    sim = simulate(plan, timeline=False)  # the step, busy seconds and peaks: no events needed
    flops, peak = plan.predicted.model_flops, plan.cost_model.peak_flops
    return check_bounds(dataclasses.replace(plan, predicted=StepPrediction(
        step_s=sim.step_s,
        bubble_fraction=sim.bubble_fraction,
        samples_per_s=plan.batch_size / sim.step_s if sim.step_s > 0 else 0.0,
        peak_memory_bytes=tuple(float(m) for m in sim.peak_memory_bytes),
        model_flops=flops,
        mfu=model_flops_utilization(flops, gpus=plan.gpus, peak_flops=peak, step_s=sim.step_s),
    )))


def check_bounds(plan: Plan) -> Plan:
    """``plan``, once its predicted step is seen to be at least its compute and link bounds; else an internal error.

    A shorter step would be a defect of the cost model or the simulator (every node is priced at or
    below its peak, every rank held to its links: :mod:`partitioner.schedule.bounds`), never a plan to ship.
    """
    bounds = step_bounds(plan)
    if plan.predicted.step_s < bounds.lower_s * (1 - 1e-9):
        raise InternalError(
            f"the plan ({plan.pp} x {plan.dp} x tp {plan.tp}, {plan.schedule}) is predicted at "
            f"{format_seconds(plan.predicted.step_s)}, below its own bounds ({bounds.describe()}): a defect "
            "of the cost model; please report it with the command that planned it.")
    return plan



def model_flops_utilization(model_flops: float | None, *, gpus: int, peak_flops: float | None, step_s: float) -> float | None:
    """MFU: model FLOPs per step over what the GPUs could do in the step at peak (Chowdhery et al. 2022, PaLM, App. B).

    ``model_flops`` counts the forward and backward of one mini-batch, not the
    recomputation (which is why it is *model* FLOPs utilisation).

    >>> model_flops_utilization(8e15, gpus=8, peak_flops=1e15, step_s=2.0)
    0.5
    >>> model_flops_utilization(None, gpus=8, peak_flops=1e15, step_s=2.0) is None
    True
    """
    if not model_flops or not peak_flops or step_s <= 0:
        return None
    # mfu_peak_flops makes the plan's peak bound every node's time, so the simulated step (at least
    # the busiest GPU's compute) cannot beat it; the cap only guards that invariant's callers.
    return min(1.0, model_flops / (gpus * peak_flops * step_s))


def mfu_peak_flops(
    flops: Mapping[str, float], seconds: Mapping[str, float], dtypes: Mapping[str, str], *,
    spec: DeviceSpec, precision: str, fp8: Collection[str] = (),
) -> float | None:
    """FLOP/s of one GPU for the MFU: the peak each node's FLOPs run at, weighted by those FLOPs.

    ``flops``, ``seconds`` (forward + backward, as the plan prices them) and
    ``dtypes`` (of each node's value) are per node.  A node runs at the peak of
    its own dtype at ``precision``, as the roofline prices it (a bf16 model
    planned at fp32 runs its matmuls at the bf16 peak, not the fp32 one), and a
    dtype's peak is raised to the fastest node timed at it: a measured node
    that beat ``spec``'s number (CPU ranks against a rough figure, a GPU the
    spec only approximates, a calibration that sped every node up) shows that
    number was no peak.  Every node then takes at least its FLOPs over its
    peak, so the model FLOPs over this peak are at most the GPUs' busy time and
    the MFU is at most 1.  ``None``: no FLOPs counted.

    ``fp8``: the FP8 matmuls of an ``fp8`` plan.  Their FLOPs count at the bf16
    peak, as torchtitan reports the MFU of float8 runs (against the bf16 peak: an
    fp8 plan's MFU can pass what bf16 reaches), and, faster than it by design,
    they raise no peak.

    >>> from partitioner.cost.devices import DEVICES
    >>> flops, dtypes = {"mm": 100e12, "mm_bf16": 10e12}, {"mm": "float32", "mm_bf16": "bfloat16"}
    >>> seconds = {"mm": 2.0, "mm_bf16": 1.0}  # 50 and 10 TFLOP/s
    >>> round(mfu_peak_flops(flops, seconds, dtypes, spec=DEVICES["h100"], precision="fp32") / 1e12, 1)
    73.2
    >>> round(mfu_peak_flops(flops, seconds, dtypes, spec=DEVICES["cpu"], precision="fp32") / 1e12, 1)
    36.7
    """
    flops_at: dict[str, float] = {}
    peak_of = dtype_peaks(flops, seconds, dtypes, spec=spec, precision=precision, fp8=fp8)
    for name, count in flops.items():
        if count > 0:
            dtype = _runs_at(dtypes.get(name, "float32"), precision)
            flops_at[dtype] = flops_at.get(dtype, 0.0) + count
    at_peak_s = sum(count / peak_of[dtype] for dtype, count in flops_at.items() if peak_of[dtype] > 0)
    return sum(flops_at.values()) / at_peak_s if at_peak_s > 0 else None


def dtype_peaks(
    flops: Mapping[str, float], seconds: Mapping[str, float], dtypes: Mapping[str, str], *,
    spec: DeviceSpec, precision: str, fp8: Collection[str] = (),
) -> dict[str, float]:
    """FLOP/s of each dtype's peak: ``spec``'s, raised to the fastest node timed at it (:func:`mfu_peak_flops`).

    >>> from partitioner.cost.devices import DEVICES
    >>> dtype_peaks({"mm": 100e12}, {"mm": 2.0}, {"mm": "float32"}, spec=DEVICES["cpu"], precision="fp32")
    {'float32': 50000000000000.0}
    """
    peak_of: dict[str, float] = {}
    for name, count in flops.items():
        if count <= 0:
            continue
        dtype = _runs_at(dtypes.get(name, "float32"), precision)
        took = seconds.get(name, 0.0) if name not in fp8 else 0.0
        peak_of[dtype] = max(peak_of.get(dtype, spec.peak(dtype)), count / took if took > 0 else 0.0)
    return peak_of


def _runs_at(dtype: str, precision: str) -> str:
    """The dtype a node of ``dtype`` computes in at ``precision`` (at_precision's rule: float32 in the compute dtype)."""
    return compute_dtype(precision) if activation_scale(precision, dtype) != 1.0 else dtype



def stage_codes(captured: CapturedModel, plan: Plan) -> tuple[str, ...]:
    """Readable code per stage, built as the runtime builds each stage module."""
    gm = captured.graph_module
    statics = {n.name: n.meta[VALUE_KEY].static for n in gm.graph.nodes if n.meta[VALUE_KEY].kind == "static"}
    codes = []
    for stage in plan.stages:
        signature = stage_signature(stage, model_outputs=plan.model.outputs, last=stage.index == len(plan.stages) - 1)
        codes.append(_stage_code(stage.index, signature, build_stage(captured, stage.nodes, signature, statics=statics)))
    return tuple(codes)



def _parameters_of(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    if node.op == "get_attr" and node.meta.get(KIND_KEY) == "parameter":
        return [str(node.target)]
    if node.op == "call_module":
        return node_parameters(gm, node)
    return []



def _boundaries(
    gm: fx.GraphModule, stage_of: dict[str, int], pp: int, *, sizes: tuple[int, int] = (1, 1)
) -> tuple[Boundary, ...]:
    """Tensors produced in one stage and read in a later one, once per (producer, reader stage).

    ``sizes``: (captured, real) samples per micro-batch; a leading dimension that
    is a multiple of the captured size is scaled to the real one.
    """
    captured_size, real_size = sizes
    found: dict[tuple[str, int], Boundary] = {}
    for node in gm.graph.nodes:
        if node.name not in stage_of:
            continue
        info: ValueInfo = node.meta[VALUE_KEY]
        source = stage_of[node.name]
        readers = {pp - 1 if u.op == "output" else stage_of.get(u.name, source) for u in node.users}
        for target in sorted(r for r in readers if r != source):
            if target < source:
                raise InternalError(f"{node.format_node()} flows backward {source}->{target}.")
            if info.kind == "static":
                continue
            if info.kind != "tensor":
                raise InternalError(
                    f"Node {node.format_node()} produces a {info.kind} that would cross stages {source}->{target}; "
                    "coarsening should have kept it with its readers."
                )
            shape = info.shape
            if captured_size != real_size and shape and shape[0] % captured_size == 0:
                shape = (shape[0] // captured_size * real_size, *shape[1:])
            found[node.name, target] = Boundary(node.name, shape, info.dtype, source, target)
    return tuple(sorted(found.values(), key=lambda b: (b.target, b.source, list(stage_of).index(b.producer))))



def _tied(captured: CapturedModel, stages: tuple[StagePlan, ...]) -> tuple[TiedParameter, ...]:
    """Every parameter held by several stages, or under several names: the runtime sums its gradients over
    the stages holding it.  Held by several stages under one name is *tied by use* (a layer applied at
    every depth, ``F.linear(h, self.emb.weight)``): its aliases are that name alone."""
    groups = captured.tied_parameters()  # canonical -> graph names, aliases only
    for st in stages:
        for name in st.parameters:
            groups.setdefault(captured.parameter_names.get(name, name), [name])
    tied = []
    held = [set(st.parameters) for st in stages]
    for canonical, aliases in sorted(groups.items()):
        holders = tuple(st.index for st, names in zip(stages, held, strict=True) if set(aliases) & names)
        if len(aliases) > 1 or len(holders) > 1:
            tied.append(TiedParameter(canonical, tuple(sorted(aliases)), holders))
    return tuple(tied)



def _stage_code(index: int, signature: StageSignature, gm: fx.GraphModule) -> str:
    header = [
        f"# Stage {index}: generated by autopartition for reading; nothing imports or runs this file.",
        f"# inputs:  model inputs {list(signature.model_inputs)}, received {list(signature.received)}",
        f"# returns: sent {list(signature.sent)}" + (f", model outputs {list(signature.outputs)}" if signature.outputs else ""),
        f"# parameters: {sorted(n for n, _ in gm.named_parameters())}",
        "",
    ]
    return "\n".join(header) + gm.code.strip() + "\n"
