"""The compiler driver: capture -> values -> cost -> coarsen -> search (pp x dp x M x schedule) -> Plan.

The search covers what users otherwise tune by hand: every pp x dp over the
divisors of the GPU count (plain data parallelism, pp = 1, included), for each
tensor-parallel degree (``tp="auto"``: each degree's groups priced by costs scaled for it,
and every degree's combinations searched, screened and simulated together, one axis of the
same search as ``ep``; the trial's ``layout`` says which), the
micro-batch count M (``microbatches="auto"``: a geometric ladder of the
divisors of the per-replica batch, :func:`microbatch_choices`) and the schedule
(``schedule="auto"``: GPipe, 1F1B, interleaved 1F1B with 2 or 4 stages per
pipeline rank (``chunks``), ZB-H1 and ZB-V; :mod:`partitioner.search.layouts` says how
the chunked ones are solved).  Each combination is ranked by its schedule's
closed form (:func:`partitioner.solve.problem.step_time`), cheapest first:

1. *bound*: a combination whose lower bound ``T (1 + (M-1)/pp)`` (``T`` the
   compute seconds of one micro-batch over all blocks; every stage waits at
   least for the slowest, which is at least the mean) is no better than the
   ``REFINED_CANDIDATES``-th best closed form found so far is pruned unsolved;
   a shape whose weights, gradients and optimizer state alone cannot fit is
   not solved either;
2. *screen*: the others are solved by the exact interval DP over the block order
   (fast; optimal for chains without replicas);
3. *refine*: the best ``REFINED_CANDIDATES`` that the DP did not prove optimal
   are solved again with the full solver (down-set DP or ILP);
4. *simulate*: the best ``SIMULATED_CANDIDATES`` by closed form are built into
   plans, refined and simulated action by action, and so is the best of each
   other schedule tried (a chunked schedule's closed form can be far from its
   simulation), so the report can say what each schedule buys; each then
   recomputes less where its ranks' exact peaks allow
   (:mod:`partitioner.solve.headroom`); the fastest simulation wins.  The winner is built on the graph captured
   at its own micro-batch size (an exported graph is shape-specialised; at one
   sample export folds the batch dimension away, and the graph is used where its
   nodes map onto the costed blocks).  A size whose graph cannot be captured or
   mapped is skipped, with the reason in the candidate table, and the next best
   candidates are drafted: it never ends the search.

Costs are counted (or measured) once, for one micro-batch of a reference size,
and scaled linearly to every other micro-batch size (FLOPs, bytes and measured
times grow with the batch; weights are read once); predicted times are priced
again at each size, so small micro-batches pay their per-op overheads.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> plan = compile(model, (torch.randn(8, 16),), gpus=2, microbatches=2, device="h100")
    >>> (plan.pp * plan.dp, len(plan.stages))  # doctest: +SKIP
    (2, 2)
    >>> microbatch_choices(32), microbatch_choices(12), len(microbatch_choices(5040))
    ((1, 2, 4, 8, 16, 32), (1, 2, 3, 6, 12), 7)
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partitioner.agree import solved_on_rank0
from partitioner.cost.calibration import Calibration, load_calibration
from partitioner.cost.experts import DEFAULT_IMBALANCE
from partitioner.cost.measured import Measured, measurement_key, recall, remember
from partitioner.cost.nodecost import NodeCost, SplitOverhead
from partitioner.cost.nodes import profile, time_loss
from partitioner.cost.precision import DEFAULT_FP8_RECIPE, DEFAULT_OPTIMIZER, DEFAULT_PRECISION
from partitioner.cost.splitcost import split_overhead
from partitioner.defaults import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_SCHEDULE,
    layout_refusal,
    splits_backward,
)
from partitioner.errors import (
    AutopartitionError,
    CaptureError,
    InfeasibleError,
    PropagationError,
    ScheduleError,
)
from partitioner.graph.capture import CallSpec, CapturedModel, CaptureMethod, capture, source_of
from partitioner.graph.experts import find_experts
from partitioner.graph.fp8 import fp8_matmuls
from partitioner.graph.ir import KIND_KEY, compute_nodes, graph_fingerprint, layer_of, module_path
from partitioner.graph.tensorparallel import find_tensor_parallel
from partitioner.graph.values import propagate_values
from partitioner.layout import Layout
from partitioner.modelfile import forward_failure
from partitioner.plan import Plan, Refinement
from partitioner.report.progress import report_progress
from partitioner.report.table import schedule_label
from partitioner.schedule.refine import REFINE_SIMULATIONS, StepModel, layer_starts, refine_split
from partitioner.search import assemble
from partitioner.search.assemble import model_flops_utilization, stage_codes, stage_layout
from partitioner.search.layouts import (
    REFINED_CANDIDATES,
    SIMULATED_CANDIDATES,
    TP_SIMULATION_MARGIN,
    CombinationKey,
    Pricing,
    Solved,
    Trial,
    best_candidates,
    candidate_rows,
    combination_key,
    infeasible_error,
    percent_more,
    priced,
    search,
)
from partitioner.search.options import (
    AUTO,
    DEFAULT_GPUS_PER_NODE,
    MAX_MICROBATCH_CHOICES,
    PlanOptions,
    Status,
    batch_size_of,
    check_options,
    default_gpus_per_node,
    default_memory_limit,
    microbatch_choices,
    resolve_device,
)
from partitioner.search.settings import (
    GROUP_OF,
    Cluster,
    Numerics,
    Parallelism,
    Solver,
    settings_of,
)
from partitioner.solve.blockgraph import block_graph
from partitioner.solve.coarsen import coarsen
from partitioner.solve.formulate import GraphCosts, node_times
from partitioner.solve.headroom import same_recompute, spend_rank_headroom
from partitioner.solve.ilp import solve
from partitioner.solve.problem import PartitionProblem, choose_recompute, step_time
from partitioner.solve.scaledcosts import ScaledCosts
from partitioner.solve.tensorparallel import TensorParallelCosts
from partitioner.units import format_seconds, plural

__all__ = [
    "AUTO",
    "DEFAULT_GPUS_PER_NODE",
    "MAX_MICROBATCH_CHOICES",
    "REFINED_CANDIDATES",
    "SIMULATED_CANDIDATES",
    "PlanOptions",
    "Status",
    "as_tensor_parallel",
    "check_tp",
    "compile",
    "default_gpus_per_node",
    "microbatch_choices",
    "microbatch_inputs",
    "model_flops_utilization",
    "nvlink_nodes",
    "stage_layout",
]


@solved_on_rank0  # inside a process group: rank 0 solves, every rank gets its plan
def compile(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    cluster: Cluster | None = None,
    parallelism: Parallelism | None = None,
    numerics: Numerics | None = None,
    solver: Solver | None = None,
    gpus: int | None = None,
    microbatches: int | str = 8,
    schedule: str = DEFAULT_SCHEDULE,
    device: str = "auto",
    memory_per_gpu: float | None = None,
    pp: int | None = None,
    dp: int | None = None,
    capture_method: CaptureMethod = "auto",
    max_blocks: int = 256,
    optimizer_states: int | None = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    time_limit: float = 10.0,
    refine_simulations: int = REFINE_SIMULATIONS,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    status: Status | None = None,
    precision: str = DEFAULT_PRECISION,
    fp8_recipe: str = DEFAULT_FP8_RECIPE,
    optimizer: str = DEFAULT_OPTIMIZER,
    recompute: str = "auto",
    gpus_per_node: int | None = None,
    chunks: int | None = None,
    shard: str = "auto",
    shard_span: str = "auto",
    zero3_unit: str = "layer",
    calibration: Calibration | str | Path | None = None,
    remeasure: bool = False,
    tp: int | str = 1,
    priced_only: bool = False,
    ep: int | str = AUTO,
    expert_imbalance: float = DEFAULT_IMBALANCE,
    nvlink_domain: int | None = None,
) -> Plan:
    """Plan ``model`` for ``gpus`` GPUs; ``example_inputs`` is one mini-batch (batch in dim 0).

    The options come grouped, ``cluster=Cluster(gpus=8, device="h100")``, ``parallelism=``,
    ``numerics=`` and ``solver=`` (:mod:`partitioner.search.settings`), or as the flat keywords
    below, each the field of one group; a group given replaces its defaults, and a flat keyword
    given beside the group that holds it is refused.  The GPU count is required: ``gpus`` or
    ``cluster``.
    ``microbatches`` and ``schedule`` may be ``"auto"`` (search them).
    ``precision`` (fp32, bf16-mixed, bf16, fp8; ``fp8_recipe`` the FP8 scaling: tensorwise,
    rowwise, mxfp8) and ``optimizer`` (adam, sgd) set the
    bytes per parameter (an explicit ``optimizer_states`` overrides the
    optimizer's count); ``recompute`` ("auto", "none", "full") whether stages may
    recompute activations; ``gpus_per_node`` (default: up to 8) the node layout
    that picks each link; ``chunks`` the stages per pipeline rank of
    ``interleaved-1f1b`` (default: 2 and 4 are tried); ``shard`` ("auto", "none", "optimizer",
    "full") how each stage group's replicas hold their state (auto: searched with the rest); ``shard_span``
    ("auto", "world", "node") over which replicas a fully sharded group spanning nodes shards: every one, or
    one node's (HSDP; auto: both weighed); ``zero3_unit`` what one ZeRO-3 gather holds ("layer": FSDP2's,
    what the runtime runs; "module": DeepSpeed's, for pricing published runs).  With ``loss_fn`` and ``target`` (one mini-batch of
    targets) the loss's cost is charged to the last stage, which computes it.
    ``calibration`` (a :class:`~partitioner.cost.calibration.Calibration` or its
    file, from ``autopartition calibrate``) scales every node time and charges
    the runtime's host time per action, as fitted on a traced run.  Measured
    costs are kept per process (:mod:`partitioner.cost.measured`): planning the same
    model again reuses them unless ``remeasure``.  ``tp``: GPUs per tensor-parallel group
    (``"auto"``: every degree the model's pairs allow inside a node, searched with the
    rest; :mod:`partitioner.graph.tensorparallel`).  ``priced_only``: plan and price a layout
    the runtime does not run (tensor parallelism over optimizer-sharded groups), as
    :func:`partitioner.search.price.price_layout` does for published layouts; such a plan is
    a prediction, not something to run.  ``ep``: the expert-parallel degree of a model
    with experts (:mod:`partitioner.graph.experts`; ``"auto"``: searched, see
    :func:`~partitioner.cost.experts.ep_choices`), its experts sharded over groups of ``ep``
    replicas; ``expert_imbalance`` the busiest member's tokens over the mean
    (:mod:`partitioner.cost.experts`).  ``nvlink_domain``: GPUs one NVLink domain joins when it spans
    several hosts of ``gpus_per_node`` (GB200 NVL72: 72 over hosts of 4); links, tensor- and
    expert-parallel groups and HSDP then follow the domain, and the plan records the hosts.
    """
    # Every option from here on is the groups' (settings_of merges into them the flat keywords, the parameters
    # named as the groups' fields); the local names below keep the rest of the body as it was.
    cluster, parallelism, numerics, solver = settings_of(
        {k: v for k, v in locals().items() if k in GROUP_OF},
        cluster=cluster, parallelism=parallelism, numerics=numerics, solver=solver)
    gpus, device, memory_per_gpu = cluster.gpus, cluster.device, cluster.memory_per_gpu
    gpus_per_node, nvlink_domain = cluster.gpus_per_node, cluster.nvlink_domain
    pp, dp, tp, ep = parallelism.pp, parallelism.dp, parallelism.tp, parallelism.ep
    microbatches, schedule, chunks = parallelism.microbatches, parallelism.schedule, parallelism.chunks
    shard, shard_span, zero3_unit = parallelism.shard, parallelism.shard_span, parallelism.zero3_unit
    recompute, expert_imbalance = parallelism.recompute, parallelism.expert_imbalance
    precision, fp8_recipe, optimizer = numerics.precision, numerics.fp8_recipe, numerics.optimizer
    optimizer_states, bucket_cap_mb = numerics.optimizer_states, numerics.bucket_cap_mb
    capture_method, max_blocks, time_limit = solver.capture_method, solver.max_blocks, solver.time_limit
    refine_simulations, calibration = solver.refine_simulations, solver.calibration
    remeasure, priced_only = solver.remeasure, solver.priced_only
    say = status or (lambda _msg: None)
    gpus_per_node, gpus_per_host = nvlink_nodes(gpus, gpus_per_node, nvlink_domain)
    fixed_ep = _check_ep(ep, expert_imbalance)
    # A tuple, a dict of keywords or (args, kwargs): from here on, the flat tuple of its tensors.
    call, example_inputs = CallSpec.of(example_inputs)
    batch = batch_size_of(example_inputs)
    spec, measure, local = resolve_device(device)
    fixed_tp = check_tp(tp, gpus=gpus, gpus_per_node=gpus_per_node, pp=pp, dp=dp)
    why = layout_refusal(tp=fixed_tp, dp=dp or (gpus // fixed_tp // pp if pp else 1), shard=shard)
    if why is not None and not priced_only:
        raise AutopartitionError(f"--tp {fixed_tp} with --shard {shard}: {why}; plan with --shard none, full or auto "
                                 "(or --tp 1).")
    per_node = gpus_per_node or (default_gpus_per_node(gpus) if gpus >= 1 else 1)  # gpus < 1: check_options says
    options = check_options(
        gpus=gpus // fixed_tp, batch=batch, microbatches=microbatches, schedule=schedule, pp=pp, dp=dp,
        precision=precision, fp8_recipe=fp8_recipe, optimizer=optimizer, optimizer_states=optimizer_states,
        recompute=recompute,
        gpus_per_node=None if gpus_per_node is None and fixed_tp == 1 else per_node // fixed_tp, chunks=chunks, shard=shard, shard_span=shard_span, zero3_unit=zero3_unit, spec=spec, measure=measure, local=local,
        memory_limit=memory_per_gpu if memory_per_gpu is not None else default_memory_limit(device, spec, local),
        capture_method=capture_method, max_blocks=max_blocks, bucket_cap_mb=bucket_cap_mb, time_limit=time_limit,
        refine_simulations=refine_simulations, priced_only=priced_only,
        calibration=_calibration(calibration), expert_imbalance=expert_imbalance, gpus_per_host=gpus_per_host,
    )

    reference = options.reference_microbatches
    micro = microbatch_inputs(example_inputs, batch // reference)
    say(f"capturing {type(model).__name__} ({capture_method})")
    try:
        captured, micro = _capture(model, example_inputs, micro, call, options)
    except CaptureError as exc:  # the model may fail on its own inputs: then no capture advice applies
        failure = forward_failure(model, micro, call=call)
        if failure is not None:
            raise failure from exc
        if isinstance(exc, PropagationError) and exc.where is None and exc.method in ("export", "symbolic_trace"):
            say("finding the line of the model's code that failed")  # capturing records no source lines: again
            route: CaptureMethod = "export" if exc.method == "export" else "symbolic_trace"
            where = source_of(model, micro, exc.node, method=route, call=call)
            if where is not None:
                raise exc.at(where) from exc.__cause__
        raise
    if batch_size_of(micro) != batch // reference:  # costed at one sample: every size scales from it
        options = dataclasses.replace(options, costed_size=batch_size_of(micro))
        reference = options.reference_microbatches
    nodes = len(compute_nodes(captured.graph_module))
    say(f"captured {nodes} compute nodes with {captured.method}")

    def progress(done: int, total: int) -> None:
        # The interpreter ticks every graph node (inputs, parameters too): shown out of the nodes announced.
        phase = f"{'measuring' if measure else 'counting'} costs"
        report_progress(say, phase, nodes if done >= total else nodes * done // total, nodes, unit="nodes")

    target = microbatch_inputs_any(target, batch // reference) if loss_fn is not None and target is not None else None
    found = _costs(captured, micro, loss_fn, target, measure=measure, device=local, progress=progress,
                   weight_share=_may_split(schedule), remeasure=remeasure, say=say)
    costs = found.costs
    if options.precision == "fp8":  # the linear layers' matmuls, priced at the FP8 peak (partitioner.graph.fp8)
        fp8 = fp8_matmuls(captured.graph_module)
        costs = {k: dataclasses.replace(c, fp8_matmul=True) if k in fp8 else c for k, c in costs.items()}
        say(f"fp8: {plural(len(fp8), 'linear matmul')} in FP8 ({options.fp8_recipe} scaling), the rest bf16-mixed")
    experts = find_experts(model, captured)  # after value propagation: it reads the shapes
    captured = dataclasses.replace(captured, experts=experts.layers, expert_notes=experts.notes)
    for note in experts.notes:
        say(note)
    if fixed_ep is not None and fixed_ep > 1:
        _check_fixed_ep(fixed_ep, captured, type(model).__name__)
    options = dataclasses.replace(options, ep_fixed=fixed_ep,
                                  expert_counts=tuple(layer.experts for layer in captured.experts))
    times = node_times(costs, spec, precision=options.precision, measure=measure, fp8_recipe=options.fp8_recipe)
    blocks = coarsen(captured.graph_module, max_blocks=max_blocks, times={k: f + b for k, (f, b) in times.items()},
                     whole=[layer.nodes for layer in captured.experts])  # an experts layer is one exchange
    if not blocks:
        raise AutopartitionError(f"{type(model).__name__} has no compute to partition.")
    scaled = ScaledCosts(captured, blocks, costs, options, loss_s=found.loss_s,
                         split=found.split if _may_split(schedule) else None,
                         calibration=options.calibration)

    tp_layout = find_tensor_parallel(captured) if tp != 1 else None
    tp_degrees = [fixed_tp]
    if tp_layout is not None and fixed_tp > 1:
        allowed = tp_layout.degrees(per_node)
        if fixed_tp not in allowed:
            raise AutopartitionError(
                f"--tp {fixed_tp} cannot split {type(model).__name__}: "
                f"{tp_layout.why_not(per_node) or f'its pairs allow tp {allowed} on nodes of {per_node} GPUs'}; "
                f"use --tp {' or '.join(map(str, allowed))} or --tp auto.")
        say(tp_layout.summary())
        options = dataclasses.replace(options, gpus=gpus, gpus_per_node=per_node)
    elif tp_layout is not None and tp == AUTO:
        # only the degrees a fixed --pp / --dp leaves room for (pp x dp x tp = gpus)
        tp_degrees = [d for d in tp_layout.degrees(per_node)
                      if (pp is None or (gpus // d) % pp == 0) and (dp is None or (gpus // d) % dp == 0)
                      and (pp is None or dp is None or gpus // d == pp * dp)]
        why = tp_layout.why_not(per_node)
        say(f"{tp_layout.summary()}; tensor-parallel degrees to try: {', '.join(map(str, tp_degrees))}"
            + (f" (tp stays 1: {why})" if why else ""))
    sized = _SizedGraphs(model, example_inputs, captured, micro)
    # Every tensor-parallel degree is an axis of the one search: each prices its groups with costs scaled per
    # degree (solve/tensorparallel.py); the trials of all of them are screened, simulated and chosen together.
    pricings: dict[Layout, Pricing] = {}
    for degree in tp_degrees:
        if degree == 1:
            pricings[Layout()] = Pricing(scaled, options)
        else:
            settings = dataclasses.replace(options, gpus=options.gpus // degree,
                                           gpus_per_node=options.gpus_per_node // degree, tp=degree)
            if (settings.pp is not None and settings.gpus % settings.pp) or \
                    (settings.dp is not None and settings.gpus % settings.dp):
                continue
            assert tp_layout is not None
            pricings[Layout(tp=degree)] = Pricing(TensorParallelCosts(scaled, tp_layout, degree, settings), settings)
        if tp_degrees != [1]:
            said = pricings[Layout(tp=degree)].options
            say(f"tensor parallel {degree}: searching {plural(said.gpus, 'group')} of {plural(degree, 'GPU')}")
    return _plan_layout(model, captured, micro, pricings, sized, gpus=options.gpus,
                        gpus_per_node=options.gpus_per_node, say=say)


def nvlink_nodes(gpus: int, gpus_per_node: int | None, nvlink_domain: int | None) -> tuple[int | None, int | None]:
    """``(gpus_per_node, gpus_per_host)`` as the planner prices them: the NVLink domain is the planner's node.

    >>> nvlink_nodes(144, 4, 72), nvlink_nodes(64, 8, None)
    ((72, 4), (8, None))
    >>> nvlink_nodes(144, 8, 36)
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: --nvlink-domain 36 must be a whole number of hosts of --gpus-per-node 8 and divide --gpus 144 (GB200 NVL72: --gpus-per-node 4 --nvlink-domain 72, --gpus a multiple of 72).
    """
    if nvlink_domain is None or gpus < 1:
        return gpus_per_node, None
    host = gpus_per_node or default_gpus_per_node(gpus)
    if nvlink_domain < 1 or nvlink_domain % host or gpus % nvlink_domain:
        raise AutopartitionError(
            f"--nvlink-domain {nvlink_domain} must be a whole number of hosts of --gpus-per-node {host} and divide "
            f"--gpus {gpus} (GB200 NVL72: --gpus-per-node 4 --nvlink-domain 72, --gpus a multiple of 72).")
    return nvlink_domain, (host if host < nvlink_domain else None)


def _check_ep(ep: int | str, imbalance: float) -> int | None:
    """The fixed expert-parallel degree (None: ``"auto"``), or an error saying what to pass."""
    if not imbalance >= 1.0:
        raise AutopartitionError(f"--expert-imbalance must be at least 1 (the busiest member's tokens over the "
                                 f"mean; 1 is a perfectly balanced router), got {imbalance!r}.")
    if ep == AUTO:
        return None
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise AutopartitionError(f"--ep must be a whole number of replicas or 'auto', got {ep!r}.")
    return ep


def _check_fixed_ep(ep: int, captured: CapturedModel, model: str) -> None:
    """``--ep N`` > 1 needs experts, and N must divide every layer's."""
    if not captured.experts:
        why = " ".join(captured.expert_notes) or (
            "no submodule is called as experts(tokens (N, H), top_k_index (N, k), top_k_weights (N, k)) -> (N, H) "
            "with its experts stacked on dim 0 or held in a ModuleList (partitioner/graph/experts.py).")
        raise AutopartitionError(f"--ep {ep}: {model} has no experts to shard: {why} Use --ep 1 (or auto).")
    counts = sorted({layer.experts for layer in captured.experts})
    if any(count % ep for count in counts):
        fits = [e for e in range(1, min(counts) + 1) if all(c % e == 0 for c in counts)]
        raise AutopartitionError(
            f"--ep {ep} does not divide {model}'s {' / '.join(map(str, counts))} experts per layer; "
            f"use one of {', '.join(map(str, fits))} (or auto).")


def _plan_layout(
    model: torch.nn.Module,
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    pricings: dict[Layout, Pricing],
    sized: _SizedGraphs,
    *,
    gpus: int,
    gpus_per_node: int | None,
    say: Status,
) -> Plan:
    """Search every combination of every degree, simulate the best, build the winner (with its stage code) for
    ``gpus`` GPUs: a tensor-parallel winner, searched as groups, is recorded as tensor parallel."""
    trials, solved = search(pricings, say=say)
    if not solved:
        raise _nothing_fits(pricings, trials)
    # The closed form ranks every combination; the best few are simulated and the simulation decides.
    by_key = {t.key: t for t in trials}
    refined: dict[CombinationKey, Refinement] = {}
    chosen: tuple[Solved, Plan, CapturedModel, GraphCosts] | None = None
    while chosen is None:
        work = _Drafting(model, captured, micro, pricings, by_key, gpus=gpus, gpus_per_node=gpus_per_node)
        ranked = _drafts(work, trials)
        if not ranked:
            raise _nothing_fits(pricings, trials) from sized.last_failure
        ranked, done = _refine_in_simulation(work, ranked, say=say)
        refined.update(done)
        ranked = _spend_headroom(work, ranked, say=say)
        for key, draft in work.drafts.items():
            by_key[key].simulated(draft)
        # None when every simulated candidate sits at a micro-batch size that cannot be planned: those
        # are skipped, with the reason, and the next best are drafted instead.
        chosen = _choose(model, sized, ranked, work, say=say)
    best, plan, captured, graph = chosen
    scaled, options = pricings[priced(best.layout)]
    ranks = plural(best.pp, 'stage') if best.chunks == 1 else \
        f"{plural(best.pp, 'pipeline rank')} ({best.pp * best.chunks} stages)"
    say(f"chose {ranks} x {plural(best.dp, 'replica')}, "
        f"{plural(best.microbatches, 'micro-batch', 'micro-batches')}, {schedule_label(best.schedule, best.chunks)}")
    if len(pricings) > 1 or best.layout.tp > 1:
        _say_degrees(pricings, trials, work, say=say)
    # Stage code is for people to read: generated once, for the chosen plan only.
    plan = dataclasses.replace(
        plan,
        candidates=candidate_rows([t for t in trials if priced(t.layout) == priced(best.layout)],
                                  by_key[combination_key(best)], options),
        solver=dataclasses.replace(plan.solver, refinement=refined.get(combination_key(best))),
        stage_code=stage_codes(captured, plan),
        block_graph=block_graph(graph, best.partition.stage_of, captured.graph_module, dp=best.dp),
    )
    if isinstance(scaled, TensorParallelCosts):
        plan = as_tensor_parallel(plan, scaled, gpus=gpus, gpus_per_node=gpus_per_node or gpus)
    if len(pricings) > 1 or best.layout.tp > 1:
        say(f"chose tensor parallel {plan.tp}: {plural(plan.pp, 'pipeline rank')} x {plural(plan.dp, 'replica')} x "
            f"tp {plan.tp}, step {format_seconds(plan.predicted.step_s)}")
    return plan


def _nothing_fits(pricings: dict[Layout, Pricing], trials: list[Trial]) -> AutopartitionError:
    """Why no degree has a plan: the first degree's that is about memory, else the first degree's."""
    errors = [infeasible_error(scaled, options, mine) for key, (scaled, options) in pricings.items()
              if (mine := [t for t in trials if priced(t.layout) == key])]
    return next((e for e in errors if isinstance(e, InfeasibleError)), errors[0])


def _say_degrees(pricings: dict[Layout, Pricing], trials: list[Trial], work: _Drafting, *, say: Status) -> None:
    """Each degree's outcome: its best simulated step, or why none of its combinations was simulated."""
    best = min((c.objective for t in trials if (c := t.partition) is not None), default=0.0)
    for key, pricing in pricings.items():
        tp, mine = key.tp, [t for t in trials if priced(t.layout) == key]
        drafts = [k for k in work.drafts if priced(k[0]) == key]
        simulated = [work.final_s(min(drafts, key=lambda k: work.drafts[k].predicted.step_s))] if drafts else []
        closed = [c.objective for t in mine if (c := t.partition) is not None]
        if simulated:
            say(f"tensor parallel {tp}: best step {format_seconds(min(simulated))}")
        elif closed:
            say(f"tensor parallel {tp}: its best closed form, {format_seconds(min(closed))}, loses by more than "
                f"{TP_SIMULATION_MARGIN:.0%} to the best, {format_seconds(best)}: not simulated")
        elif any(t.status == "pruned" for t in mine):
            say(f"tensor parallel {tp}: every combination's bound loses to the best closed forms found: not simulated")
        else:
            why = infeasible_error(pricing.scaled, pricing.options, mine) if mine else None
            say(f"tensor parallel {tp}: " + ("nothing fits" if isinstance(why, InfeasibleError) or why is None
                                             else f"cannot be planned: {why}"))


def check_tp(tp: int | str, *, gpus: int, gpus_per_node: int | None, pp: int | None, dp: int | None) -> int:
    """The tensor-parallel degree fixed by ``tp`` (1 for ``"auto"``, which searches), checked against the GPUs.

    With ``"auto"`` and both ``pp`` and ``dp`` given, the degree is what they leave.

    >>> check_tp(4, gpus=64, gpus_per_node=8, pp=None, dp=None), check_tp("auto", gpus=64, gpus_per_node=8, pp=8, dp=2)
    (4, 4)
    >>> check_tp(16, gpus=64, gpus_per_node=8, pp=None, dp=None)
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: --tp 16 must divide --gpus-per-node 8: a tensor-parallel group stays inside a node (NVLink); choose 1, 2, 4 or 8, or --tp auto.
    """
    if gpus < 1 or (gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node)):
        return 1  # check_options says what is wrong with the GPUs
    per_node = gpus_per_node or default_gpus_per_node(gpus)
    if tp == AUTO:
        if pp is not None and dp is not None and pp * dp <= gpus and gpus % (pp * dp) == 0 \
                and per_node % (gpus // (pp * dp)) == 0:
            return gpus // (pp * dp)
        return 1
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise AutopartitionError(f"--tp must be a whole number of GPUs or 'auto', got {tp!r}.")
    if per_node % tp or gpus % tp:
        choices = [d for d in range(1, per_node + 1) if per_node % d == 0 and gpus % d == 0]
        raise AutopartitionError(
            f"--tp {tp} must divide --gpus-per-node {per_node}: a tensor-parallel group stays inside a node "
            f"(NVLink); choose {', '.join(map(str, choices[:-1]))} or {choices[-1]}, or --tp auto."
            if len(choices) > 1 else f"--tp {tp} must divide --gpus-per-node {per_node}; use --tp 1.")
    return tp


def as_tensor_parallel(plan: Plan, scaled: TensorParallelCosts, *, gpus: int, gpus_per_node: int) -> Plan:
    """A plan searched for ``gpus / tp`` groups as the plan for ``gpus`` GPUs: tp recorded, TP traffic per stage.

    Each stage's ``tp_comm_s`` is the collective seconds inside its forward and
    backward per micro-batch and its ``send_bytes`` what one GPU sends (``1 / tp``
    with sequence parallelism); the step is simulated again and the MFU taken over every GPU.
    """
    comm = scaled.comm_s(plan.microbatches)
    # Sequence parallel: each GPU of a group sends its 1/tp of a boundary (the simulator prices it so too).
    stages = tuple(dataclasses.replace(st, predicted=dataclasses.replace(
        st.predicted, tp_comm_s=sum(sum(comm.get(n, (0.0, 0.0))) for n in st.nodes) / plan.dp,
        send_bytes=st.predicted.send_bytes // scaled.tp))
        for st in plan.stages)
    flops = plan.predicted.model_flops
    converted = dataclasses.replace(
        plan, stages=stages, tp=scaled.tp, gpus=gpus, gpus_per_node=gpus_per_node,
        predicted=dataclasses.replace(plan.predicted, model_flops=None if flops is None else flops * scaled.tp))
    return assemble.predict(converted)


def _capture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    micro: tuple[torch.Tensor, ...],
    call: CallSpec,
    options: PlanOptions,
) -> tuple[CapturedModel, tuple[torch.Tensor, ...]]:
    """The graph costs are counted on, its values propagated, and the inputs it was captured at.

    An exported graph is specialised to its micro-batch size, and a plan for
    another size needs that size's graph: a second export, as long as the first
    (20 s for Llama 3 405B here).  Models built on ``meta`` (too large to run
    here, planned for many GPUs) end up at one sample per micro-batch, so where
    those are among the candidates (``microbatches="auto"``) and costs are counted
    (FLOPs and bytes, linear in the samples), such a model that only export
    captures is exported at one sample and costed there: the likely winner's
    graph is the costed one, its costs exact, and other sizes scale from it.
    (Measured costs stay at two samples or more: one sample's times are mostly
    per-op overhead, which does not scale; and a model with real weights is
    small enough to export again.)  A model that cannot be exported at one
    sample is captured at ``micro`` as before.
    """
    large = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if large and options.microbatches is None and not options.measure \
            and options.capture_method != "symbolic_trace" and batch_size_of(micro) > 1:
        traced: CapturedModel | None = None
        if options.capture_method == "auto":  # the route auto takes first, shape-generic: keep it where it works
            try:
                traced = capture(model, micro, method="symbolic_trace", call=call)
            except CaptureError:
                traced = None
        if traced is not None:
            propagate_values(traced.graph_module, micro)
            return traced, micro
        one = microbatch_inputs(example_inputs, 1)
        try:
            captured = capture(model, one, method="export", call=call)
            propagate_values(captured.graph_module, one)
            return captured, one
        except AutopartitionError:
            pass  # e.g. a BatchNorm that needs two samples to train: at ``micro`` below, as before
    captured = capture(model, micro, method=options.capture_method, call=call)
    propagate_values(captured.graph_module, micro)
    return captured, micro



def _costs(
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
    *,
    measure: bool,
    device: torch.device,
    progress: Callable[[int, int], None],
    weight_share: bool,
    remeasure: bool,
    say: Status,
) -> Measured:
    """Node, loss and split costs: measured (or kept from an earlier compile of this model), or counted."""
    key = measurement_key(captured, micro, device=device, loss_fn=loss_fn, target=target) if measure else None
    if key is not None and not remeasure:
        kept = recall(key, weight_share=weight_share)
        if kept is not None:
            say("costs: as measured earlier in this process (remeasure=True measures again)")
            return kept
    # W shares and the split's host cost matter only to schedules that split the backward.
    costs = _profile(captured, micro, measure=measure, device=device, progress=progress, weight_share=weight_share)
    loss_s = (0.0, 0.0)
    if loss_fn is not None and target is not None and measure:
        loss_s = time_loss(captured, micro, loss_fn, target, device=device)
    # The split's host cost is measured with the runtime's code (predicted devices: not modelled).
    split = split_overhead(device) if measure and weight_share else SplitOverhead(0.0, 0.0)
    found = Measured(costs, loss_s, split, weight_share)
    if key is not None:
        remember(key, found)
    return found


def _calibration(value: Calibration | str | Path | None) -> Calibration:
    if value is None:
        return Calibration()
    return value if isinstance(value, Calibration) else load_calibration(value)


def _may_split(schedule: str) -> bool:
    """Whether a schedule the search may try splits its backward (``auto`` tries them all)."""
    return schedule == "auto" or splits_backward(schedule)


@dataclasses.dataclass
class _Drafting:
    """What drafting, refining and spending headroom share: the model, its costs, and each candidate's plan so far."""

    model: torch.nn.Module
    captured: CapturedModel
    micro: tuple[torch.Tensor, ...]
    pricings: dict[Layout, Pricing]  # by tensor-parallel degree: each candidate is priced by its own
    trials: dict[CombinationKey, Trial]
    drafts: dict[CombinationKey, Plan] = dataclasses.field(default_factory=dict)
    gpus: int = 0  # the whole job's GPUs and node (a tensor-parallel draft is searched as groups)
    gpus_per_node: int | None = None
    _final: dict[CombinationKey, tuple[Plan, float]] = dataclasses.field(default_factory=dict)

    def build(self, candidate: Solved) -> Plan:
        """``candidate`` built into a plan (lowered, validated, simulated); ScheduleError where it cannot be."""
        scaled, options = self.pricings[priced(candidate.layout)]
        return assemble.build_plan(self.model, self.captured, self.micro, scaled.at(candidate.microbatches),
                                   candidate, options)

    def final_s(self, key: CombinationKey) -> float:
        """A draft's step as the job runs it: a tensor-parallel draft, searched as groups, recorded as tensor
        parallel (its boundaries sent a ``1 / tp`` slice each) and simulated again (once per draft)."""
        draft, (scaled, _) = self.drafts[key], self.pricings[priced(key[0])]
        if not isinstance(scaled, TensorParallelCosts):
            return draft.predicted.step_s
        found = self._final.get(key)
        if found is None or found[0] is not draft:
            step = as_tensor_parallel(draft, scaled, gpus=self.gpus, gpus_per_node=self.gpus_per_node or self.gpus
                                      ).predicted.step_s
            found = self._final[key] = (draft, step)
        return found[1]

    def order(self, candidates: list[Solved]) -> list[Solved]:
        """``candidates``, fastest first as the job runs them: the degrees by their fastest draft's step as run
        (simulated again: :meth:`final_s`), each degree's drafts by their own simulation."""
        def step(c: Solved) -> float:
            return self.drafts[combination_key(c)].predicted.step_s

        fastest: dict[Layout, Solved] = {}
        for c in sorted(candidates, key=step):
            fastest.setdefault(priced(c.layout), c)
        degree = {k: self.final_s(combination_key(c)) for k, c in fastest.items()}
        return sorted(candidates, key=lambda c: (degree[priced(c.layout)], step(c), c.layout.tp))

    def keep_if_faster(self, better: Solved) -> Plan | None:
        """``better``'s plan, kept as its combination's draft (and trial) where it simulates faster; else None."""
        key = combination_key(better)
        try:
            draft = self.build(better)
        except ScheduleError:  # a chunked order that cannot place this split's messages: keep the draft
            return None
        if draft.predicted.step_s >= self.drafts[key].predicted.step_s:
            return None
        self.drafts[key] = draft
        self.trials[key].partition, self.trials[key].status = better.partition, better.partition.status
        return draft


def _drafts(work: _Drafting, trials: list[Trial]) -> list[Solved]:
    """The best candidates by closed form, each built into a plan (lowered, validated, simulated) in ``work.drafts``.

    Should a schedule's plan fail validation (none should: every kind lowers
    any DAG of stages, :func:`partitioner.schedule.lower.lower`), that combination is
    marked skipped with the reason, and the next best takes its place.
    """
    drafts = work.drafts
    while True:
        ranked = best_candidates(trials)
        for c in ranked:
            key = combination_key(c)
            if key in drafts:
                continue
            try:
                drafts[key] = work.build(c)
            except ScheduleError as exc:
                if c.chunks == 1 and c.schedule in ("gpipe", "1f1b"):
                    raise  # these always order their messages: a bug, not this split
                trial = work.trials[key]
                trial.status, trial.partition = "skipped", None
                trial.reason = f"{schedule_label(c.schedule, c.chunks)} cannot order this split's messages ({exc})"
                break
        else:
            work.drafts = {combination_key(c): drafts[combination_key(c)] for c in ranked}
            return ranked



def _refine_in_simulation(
    work: _Drafting, ranked: list[Solved], *, say: Status,
) -> tuple[list[Solved], dict[CombinationKey, Refinement]]:
    """Each simulated candidate's split improved by local search in simulation (:mod:`partitioner.schedule.refine`).

    The closed form charges received transfers on every micro-batch while the
    simulator overlaps them with compute, so the solver's optimum is not always
    the fastest split in simulation.  Each candidate of two stages or more is
    refined for ``options.refine_simulations`` simulated steps; a changed split is built into a
    plan and kept only if that plan simulates faster than the solver's draft
    (so refinement never makes a candidate worse).  ``work``'s drafts and trials'
    partitions are updated in place; returns the candidates and what each
    refinement did.
    """
    captured = work.captured
    out: list[Solved] = []
    done: dict[CombinationKey, Refinement] = {}
    for c in ranked:
        key = combination_key(c)
        scaled, options = work.pricings[priced(c.layout)]
        # Every simulated candidate is refined, the best of each other schedule too: a chunked schedule's closed
        # form is far from its simulation (GPT-3 175B/512: 28.6 s closed, 23.3 s once refined).
        if c.stages < 2 or options.refine_simulations <= 0:
            out.append(c)
            continue
        graph = scaled.at(c.microbatches)
        # A second start: the closed form's optimum with transfers left out of the stage times, which
        # the simulator mostly overlaps with compute (they delay the fill and the drain once).
        free = dataclasses.replace(c.problem, transfer_s=(0.0,) * c.problem.size,
                                   transfer_slow_s=None if c.problem.transfer_slow_s is None else (0.0,) * c.problem.size)
        other = solve(free, stages=c.stages, microbatches=c.microbatches, schedule=c.schedule,
                      time_limit=options.time_limit, use_ilp=False)
        starts = [*([] if other is None else [other.stage_of]), *layer_starts(_block_layers(captured, graph), c.stages)]
        found = refine_split(c.problem, c.partition.stage_of, c.stages, microbatches=c.microbatches,
                             schedule=c.schedule, model=_step_model(graph, c.problem, c.dp, options, shard=c.shard),
                             budget=options.refine_simulations, alternatives=starts)
        before = work.drafts[key].predicted.step_s
        after, moves = before, 0
        if found.stage_of != c.partition.stage_of:
            partition = dataclasses.replace(
                c.partition, stage_of=found.stage_of, recompute=found.recompute, objective=found.objective,
                status="feasible", wall_s=c.partition.wall_s + found.wall_s)
            better = dataclasses.replace(c, partition=partition)
            if (draft := work.keep_if_faster(better)) is not None:
                c, after, moves = better, draft.predicted.step_s, found.moves
        done[key] = Refinement(before, after, moves, found.simulations, found.wall_s)
        if moves:
            say(f"refined {c.pp} {'stages' if c.chunks == 1 else 'pipeline ranks'} x {c.dp} replicas, M {c.microbatches}, {schedule_label(c.schedule, c.chunks)} in simulation: "
                f"{percent_more(after, before)} in {moves} moves")
        out.append(c)
    return out, done



def _spend_headroom(work: _Drafting, ranked: list[Solved], *, say: Status) -> list[Solved]:
    """Each simulated candidate recomputing less where its ranks' exact peaks leave room, or only cheap ops
    (:mod:`partitioner.solve.headroom`); kept where its plan simulates faster.  ``work``'s drafts and
    trials' partitions are updated in place."""
    out: list[Solved] = []
    for c in ranked:
        key = combination_key(c)
        start = c.partition.recompute or choose_recompute(c.problem, c.partition.stage_of, c.stages,
                                                          microbatches=c.microbatches, schedule=c.schedule)
        recompute, ops = spend_rank_headroom(c.problem, c.partition.stage_of, c.stages, recompute=start,
                                             microbatches=c.microbatches, schedule=c.schedule)
        if same_recompute(recompute, start) and not any(ops):
            out.append(c)
            continue
        objective, _ = step_time(c.problem, c.partition.stage_of, microbatches=c.microbatches, schedule=c.schedule,
                                 recompute=recompute, ops=ops)
        partition = dataclasses.replace(c.partition, recompute=recompute, recompute_ops=ops, objective=objective,
                                        status="feasible")
        better = dataclasses.replace(c, partition=partition)
        before = work.drafts[key].predicted.step_s
        if (draft := work.keep_if_faster(better)) is not None:
            c = better
            cheap = sum(s.recompute_ops_layers for s in draft.stages)
            say(f"recomputing less within each rank's exact peak{f' ({cheap} layers only their cheap ops)' if cheap else ''}: "
                f"{plural(c.pp, 'pipeline rank')} x {plural(c.dp, 'replica')}, M {c.microbatches}, "
                f"{schedule_label(c.schedule, c.chunks)}: {percent_more(draft.predicted.step_s, before)}")
        out.append(c)
    return out



def _block_layers(captured: CapturedModel, graph: GraphCosts) -> list[int | None]:
    """Per block, the index of the repeated layer it belongs to (the largest ``ModuleList``), else None."""
    nodes = {n.name: n for n in captured.graph_module.graph.nodes}
    paths = [layer_of(module_path(nodes[members[0]])) if members else "" for members in graph.blocks]
    containers: dict[str, set[str]] = {}
    for path in paths:
        head, _, index = path.rpartition(".")
        if index.isdigit():
            containers.setdefault(head, set()).add(path)
    if not containers:
        return [None] * len(paths)
    head = max(containers, key=lambda k: len(containers[k]))
    order = {path: i for i, path in enumerate(sorted(containers[head], key=lambda p: int(p.rpartition(".")[2])))}
    return [order.get(path) for path in paths]



def _step_model(graph: GraphCosts, problem: PartitionProblem, dp: int, options: PlanOptions, *,
                shard: str = "none") -> StepModel:
    """Per-block forward seconds and parameter bytes (for DDP buckets), as :func:`partitioner.search.assemble._stages` prices a stage.

    A sharded group's collectives are one piece after its last backward (no buckets: cost/comm.py).
    """
    last = len(graph.blocks) - 1
    forward = tuple(
        (sum(graph.node_forward_s[n] for n in members) + (graph.loss_s[0] if b == last else 0.0)) / dp
        for b, members in enumerate(graph.blocks)
    )
    readers: dict[str, list[int]] = {}
    for b, names in enumerate(graph.block_parameters):
        for name in names:
            readers.setdefault(name, []).append(b)
    parameters = tuple((float(graph.parameter_bytes[name]), tuple(blocks)) for name, blocks in readers.items())
    return StepModel(forward, parameters, options.bucket_cap_mb if shard == "none" or dp <= 1 else 0.0)



def _choose(
    model: torch.nn.Module,
    sized: _SizedGraphs,
    ranked: list[Solved],
    work: _Drafting,
    *,
    say: Status,
) -> tuple[Solved, Plan, CapturedModel, GraphCosts] | None:
    """The fastest simulated combination whose graph captures at its micro-batch size, built for real.

    Candidates are ranked by their step as the job runs them (:meth:`_Drafting.order`). A draft
    whose micro-batch is the costed one is the plan (same graph, shapes as captured); another is
    rebuilt on the graph captured at its own micro-batch size (:class:`_SizedGraphs`).  A size
    whose graph cannot be captured, or does not map onto the costed blocks, makes every
    combination at that size skipped (with the reason, in the candidate table); None when no
    simulated candidate is left, so the caller drafts the next best.
    """
    drafts, trials = work.drafts, work.trials
    for best in work.order(ranked):
        scaled, options = work.pricings[priced(best.layout)]
        size = options.batch // (best.dp * best.microbatches)
        if size == sized.costed:
            return best, drafts[combination_key(best)], sized.captured, scaled.at(best.microbatches)
        try:
            recaptured, resized, costs = sized.at(size, scaled)
            costs = _RenamedCosts(scaled, costs.mapping)  # kept per size, priced by this candidate's costs (tp)
        except AutopartitionError as exc:
            why = f"cannot be planned at {plural(size, 'sample')} per micro-batch: {exc}"
            say(f"skipping every combination of {plural(size, 'sample')} per micro-batch: {exc}")
            for (layout, microbatches, *_), trial in trials.items():
                if microbatches is not None and options.batch // (layout.dp * microbatches) == size \
                        and trial.status not in ("skipped", "infeasible", "pruned"):
                    trial.status, trial.reason, trial.partition = "skipped", why, None
            continue
        graph = costs.at(best.microbatches)
        return best, assemble.build_plan(model, recaptured, resized, graph, best, options), recaptured, graph
    return None



class _SizedGraphs:
    """The captured graph at each micro-batch size, captured once per size and kept.

    A traced graph is shape-generic (its values are propagated again); an exported
    one is specialised and captured again.  Where export specialises the batch
    dimension away (one sample: an ``expand`` to the batch folds, so nodes are
    renamed and a few appear or vanish), the graph is used if its nodes map onto
    the costed graph's blocks (:func:`_map_blocks`).
    """

    def __init__(self, model: torch.nn.Module, example_inputs: tuple[Any, ...], captured: CapturedModel,
                 micro: tuple[torch.Tensor, ...]) -> None:
        self.model, self.example_inputs, self.captured, self.micro = model, example_inputs, captured, micro
        self.costed = batch_size_of(micro)
        self._found: dict[int, tuple[CapturedModel, tuple[torch.Tensor, ...], _RenamedCosts]] = {}
        self._failed: dict[int, AutopartitionError] = {}
        self.last_failure: AutopartitionError | None = None

    def at(self, size: int, scaled: ScaledCosts) -> tuple[CapturedModel, tuple[torch.Tensor, ...], _RenamedCosts]:
        """The graph, inputs and costs at ``size`` samples per micro-batch; AutopartitionError if unusable."""
        if size in self._failed:
            raise self._failed[size]
        if size not in self._found:
            try:
                self._found[size] = self._capture(size, scaled)
            except AutopartitionError as exc:
                self._failed[size] = self.last_failure = exc
                raise
        return self._found[size]

    def _capture(self, size: int, scaled: ScaledCosts) -> tuple[CapturedModel, tuple[torch.Tensor, ...], _RenamedCosts]:
        captured, model = self.captured, self.model
        micro = microbatch_inputs(self.example_inputs, size)
        if captured.method != "export":  # shape-generic: the same graph, its values at this size
            propagate_values(captured.graph_module, micro)
            return captured, micro, _RenamedCosts(scaled, None)
        recaptured = capture(model, micro, method="export", call=captured.call)
        propagate_values(recaptured.graph_module, micro)
        if captured.experts:  # the plan names the experts' nodes in the graph its stages run
            found = find_experts(model, recaptured)
            recaptured = dataclasses.replace(recaptured, experts=found.layers, expert_notes=found.notes)
        if graph_fingerprint(recaptured.graph_module) == graph_fingerprint(captured.graph_module):
            return recaptured, micro, _RenamedCosts(scaled, None)
        mapping = _map_blocks(captured.graph_module, recaptured.graph_module, scaled.blocks)
        if mapping is None:
            raise AutopartitionError(
                f"{type(model).__name__} captures to a different graph at micro-batch size {size}, and its "
                "nodes do not map onto the costed blocks; fix the data-parallel degree with --dp, or the "
                "micro-batch count with --microbatches, so that micro-batches have another size."
            )
        return recaptured, micro, _RenamedCosts(scaled, mapping)



class _RenamedCosts:
    """``scaled.at(M)`` in another capture's node names (``mapping``: its blocks, and old -> new names)."""

    def __init__(self, scaled: ScaledCosts, mapping: tuple[list[tuple[str, ...]], dict[str, str]] | None) -> None:
        self.scaled, self.mapping = scaled, mapping

    def at(self, microbatches: int) -> GraphCosts:
        graph = self.scaled.at(microbatches)
        if self.mapping is None:
            return graph
        blocks, names = self.mapping
        new = [n for members in blocks for n in members]

        def rename(values: dict[str, Any], fill: Any = None) -> dict[str, Any]:
            out = {names[k]: v for k, v in values.items() if k in names}
            if fill is not None:
                for n in new:
                    out.setdefault(n, fill)  # a node only this capture has costs nothing (an expand, a view)
            return out

        def keep(group: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(names[n] for n in group if n in names)

        return dataclasses.replace(
            graph, blocks=tuple(blocks),
            node_time_s=rename(graph.node_time_s, 0.0), node_forward_s=rename(graph.node_forward_s, 0.0),
            node_saved_bytes=rename(graph.node_saved_bytes, 0), node_output_bytes=rename(graph.node_output_bytes, 0),
            node_dtype=rename(graph.node_dtype), node_flops=rename(graph.node_flops),
            node_saved_float32_bytes=rename(graph.node_saved_float32_bytes),
            node_weight_s=rename(graph.node_weight_s),
            block_senders=tuple(keep(g) for g in graph.block_senders),
            block_inputs=tuple(keep(g) for g in graph.block_inputs),
            layer_runs=tuple(keep(g) for g in graph.layer_runs),
            expert_layers=tuple(layer._replace(nodes=keep(layer.nodes)) for layer in graph.expert_layers),
        )



def _node_key(node: torch.fx.Node) -> tuple[str, str, str]:
    return node.op, str(getattr(node.target, "__name__", node.target)), module_path(node)



def _map_blocks(
    old: torch.fx.GraphModule, new: torch.fx.GraphModule, blocks: list[tuple[str, ...]]
) -> tuple[list[tuple[str, ...]], dict[str, str]] | None:
    """``blocks`` (of ``old``'s nodes) in ``new``'s node names, and old -> new names; None if they do not map.

    Nodes are paired by aligning the two graphs' node sequences on (op, target,
    module path).  A compute node only ``new`` has joins the block of the node
    before it; one only ``old`` had leaves its block.  None when a block is left
    empty or ``new`` has an edge between blocks that ``old`` has not (a split
    valid for ``old`` might then send a value backward in ``new``).
    """
    a, b = list(old.graph.nodes), list(new.graph.nodes)
    ka, kb = [_node_key(n) for n in a], [_node_key(n) for n in b]
    names: dict[str, str] = {}
    if ka == kb:
        names = {x.name: y.name for x, y in zip(a, b)}
    else:
        matcher = difflib.SequenceMatcher(None, ka, kb, autojunk=False)
        for i, j, k in matcher.get_matching_blocks():
            names.update((a[i + d].name, b[j + d].name) for d in range(k))
    block_of_old = {n: i for i, members in enumerate(blocks) for n in members}
    block_of = {names[n]: i for n, i in block_of_old.items() if n in names}
    current = 0
    for node in b:  # compute nodes only the new graph has: with the block before them
        if node.name in block_of:
            current = block_of[node.name]
        elif node.meta.get(KIND_KEY) == "compute":
            block_of[node.name] = current
    mapped: list[list[str]] = [[] for _ in blocks]
    for node in b:
        if node.name in block_of:
            mapped[block_of[node.name]].append(node.name)
    if any(not members for members in mapped):
        return None
    old_edges = {(block_of_old[u.name], block_of_old[v.name]) for v in a if v.name in block_of_old
                 for u in v.all_input_nodes if u.name in block_of_old}
    for v in b:
        for u in v.all_input_nodes:
            edge = (block_of.get(u.name), block_of.get(v.name))
            if edge[0] is not None and edge[1] is not None and edge[0] != edge[1] and edge not in old_edges:
                return None
    return [tuple(members) for members in mapped], names



def _profile(
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    *,
    measure: bool,
    device: torch.device,
    progress: Callable[[int, int], None],
    weight_share: bool = True,
) -> dict[str, NodeCost]:
    # Counting (measure=False) runs on fake tensors, so it counts the real micro-batch directly:
    # exact for tensors that do not grow with the batch (positions, masks), and as fast.
    return profile(captured, micro, measure=measure, device=device, progress=progress, weight_share=weight_share)



def microbatch_inputs_any(value: Any, size: int) -> Any:
    """The first ``size`` samples of every tensor in a pytree (targets may be nested)."""
    return pytree.tree_map(lambda x: x[:size] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, value)



def microbatch_inputs(inputs: tuple[Any, ...], size: int) -> tuple[torch.Tensor, ...]:
    """The first ``size`` samples of each input: the shapes one micro-batch has."""
    return tuple(x[:size] for x in inputs)
