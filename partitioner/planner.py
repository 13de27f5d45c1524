"""The compiler driver: capture -> values -> cost -> coarsen -> search (pp x dp x M x schedule) -> Plan.

The search covers what users otherwise tune by hand: every pp x dp over the
divisors of the GPU count (plain data parallelism, pp = 1, included), the
micro-batch count M (``microbatches="auto"``: a geometric ladder of the
divisors of the per-replica batch, :func:`microbatch_choices`) and the schedule
(``schedule="auto"``: GPipe and 1F1B).  Each combination is ranked by the
solver's closed form, cheapest first:

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
   plans and simulated action by action; the fastest simulation wins.

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
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from partitioner.agree import solved_on_rank0
from partitioner.blockgraph import block_graph
from partitioner.capture import CallSpec, CapturedModel, CaptureMethod, capture
from partitioner.coarsen import coarsen
from partitioner.commcost import allreduce_crosses_nodes, p2p_crosses_nodes
from partitioner.cost import NodeCost, profile, time_loss
from partitioner.defaults import DEFAULT_BUCKET_CAP_MB, DEFAULT_SCHEDULE, SCHEDULES
from partitioner.devices import DEVICES, DeviceSpec, device_spec
from partitioner.errors import AutopartitionError, InfeasibleError, InternalError
from partitioner.formulate import GraphCosts, formulate, graph_costs, node_times
from partitioner.ir import (
    KIND_KEY,
    VALUE_KEY,
    ValueInfo,
    compute_nodes,
    graph_fingerprint,
    module_path,
    node_parameters,
)
from partitioner.meta import layer_of
from partitioner.plan import (
    FORMAT_VERSION,
    Boundary,
    Candidate,
    CostModelInfo,
    ModelInfo,
    Plan,
    Refinement,
    SolverInfo,
    StagePlan,
    StagePrediction,
    StepPrediction,
    TensorSpec,
    TiedParameter,
    stage_topology,
)
from partitioner.precision import (
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    OPTIMIZERS,
    Precision,
    activation_scale,
    check_optimizer,
    check_precision,
    compute_dtype,
    static_bytes_per_element,
)
from partitioner.problem import (
    RECOMPUTE_MODES,
    Partition,
    PartitionProblem,
    RecomputeMode,
    ScheduleKind,
    allreduce_latencies,
    choose_recompute,
    stage_costs,
    stage_memory,
)
from partitioner.progress import report_progress
from partitioner.refine import REFINE_SIMULATIONS, StepModel, layer_starts, refine_split
from partitioner.schedule import compute_order, lower, validate
from partitioner.simulate import simulate
from partitioner.solve import is_chain, solve
from partitioner.stagegraph import StageSignature, build_stage, closure, stage_signature
from partitioner.units import format_bytes, plural
from partitioner.values import propagate_values

__all__ = [
    "AUTO",
    "DEFAULT_GPUS_PER_NODE",
    "MAX_MICROBATCH_CHOICES",
    "REFINED_CANDIDATES",
    "SIMULATED_CANDIDATES",
    "PlanOptions",
    "Status",
    "compile",
    "default_gpus_per_node",
    "microbatch_choices",
    "microbatch_inputs",
    "model_flops_utilization",
    "stage_layout",
]

AUTO = "auto"  # microbatches / schedule: search
SIMULATED_CANDIDATES = 3  # best closed-form combinations that are simulated before choosing
REFINED_CANDIDATES = 4  # best screened combinations solved again by the full solver
MAX_MICROBATCH_CHOICES = 8  # micro-batch counts tried per data-parallel degree with "auto"
DEFAULT_GPUS_PER_NODE = 8  # DGX / HGX nodes: 8 GPUs on NVLink

Status = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Every planning choice, checked and resolved once by :func:`compile`, then carried through."""

    gpus: int
    batch: int  # mini-batch size: samples per step over all replicas
    microbatches: int | None  # None: search (:func:`microbatch_choices` of each replica's batch)
    schedules: tuple[ScheduleKind, ...]  # the schedules to try: one, or all ("auto")
    spec: DeviceSpec  # link, memory and roofline numbers of the GPU planned for
    measure: bool  # times measured on ``local``, else predicted for ``spec``
    local: torch.device  # where capture and profiling run
    memory_limit: float | None  # bytes per GPU; None: no limit
    pp: int | None  # a fixed shape, else every pp x dp over the divisors of ``gpus``
    dp: int | None
    capture_method: CaptureMethod
    max_blocks: int
    precision: Precision
    optimizer: str  # a name of partitioner.precision.OPTIMIZERS
    optimizer_states: int  # the optimizer's, or as given to compile()
    recompute: RecomputeMode
    gpus_per_node: int  # divides gpus
    bucket_cap_mb: float
    time_limit: float  # solver seconds per ILP
    refine_simulations: int = REFINE_SIMULATIONS  # simulated steps of local search per candidate (0: none)

    @property
    def device_name(self) -> str:
        """The plan's ``device`` field."""
        return f"{self.spec.name} (measured)" if self.measure else self.spec.name

    def microbatch_choices(self, dp: int) -> tuple[int, ...]:
        """Micro-batch counts to try with ``dp`` replicas (empty: the batch does not split)."""
        if self.batch % dp:
            return ()
        if self.microbatches is not None:
            return (self.microbatches,) if (self.batch // dp) % self.microbatches == 0 else ()
        return microbatch_choices(self.batch // dp)

    @property
    def reference_microbatches(self) -> int:
        """M of the micro-batch that is captured and costed (other sizes are scaled from it)."""
        if self.microbatches is not None:
            return self.microbatches
        # The smallest micro-batch of two samples or more: small micro-batches are where large
        # models end up, and the winner's graph is then the costed one, not captured again
        # (a graph exported at one sample may specialise the batch dimension away).
        size = next((k for k in range(2, self.batch + 1) if self.batch % k == 0), 1)
        return self.batch // size


@dataclasses.dataclass(frozen=True)
class _Solved:
    """One solved pp x dp x M x schedule combination and the problem it was solved for (reused by the plan)."""

    pp: int
    dp: int
    problem: PartitionProblem
    partition: Partition
    microbatches: int
    schedule: ScheduleKind


def microbatch_choices(samples: int, *, most: int = MAX_MICROBATCH_CHOICES) -> tuple[int, ...]:
    """Divisors of ``samples`` (one replica's batch) on a geometric ladder, at most ``most`` of them.

    Always 1 (no pipelining: whole-batch kernels) and ``samples`` (micro-batches of
    one sample: the smallest bubble and activations); in between each kept count
    is at least ``ratio`` times the previous, the ratio growing from 1.5 until
    ``most`` or fewer remain.

    >>> microbatch_choices(1), microbatch_choices(6), microbatch_choices(64)
    ((1,), (1, 2, 3, 6), (1, 2, 4, 8, 16, 32, 64))
    >>> microbatch_choices(1024)
    (1, 4, 16, 64, 256, 1024)
    """
    divisors = [m for m in range(1, samples + 1) if samples % m == 0]
    ratio = 1.5
    while True:
        kept = [1]
        for m in divisors[1:]:
            if m >= ratio * kept[-1]:
                kept.append(m)
        if kept[-1] != samples:  # end on one sample per micro-batch
            if samples < ratio * kept[-1] and len(kept) > 1:
                kept[-1] = samples
            else:
                kept.append(samples)
        if len(kept) <= most:
            return tuple(kept)
        ratio *= 1.5


def default_gpus_per_node(gpus: int) -> int:
    """GPUs per node when not given: the largest divisor of ``gpus`` up to 8 (a DGX/HGX node).

    >>> default_gpus_per_node(64), default_gpus_per_node(4), default_gpus_per_node(12)
    (8, 4, 6)
    """
    return max(k for k in range(1, min(DEFAULT_GPUS_PER_NODE, gpus) + 1) if gpus % k == 0)


@solved_on_rank0  # inside a process group: rank 0 solves, every rank gets its plan
def compile(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    gpus: int,
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
    optimizer: str = DEFAULT_OPTIMIZER,
    recompute: str = "auto",
    gpus_per_node: int | None = None,
) -> Plan:
    """Plan ``model`` for ``gpus`` GPUs; ``example_inputs`` is one mini-batch (batch in dim 0).

    ``microbatches`` and ``schedule`` may be ``"auto"`` (search them).
    ``precision`` (fp32, bf16-mixed, bf16) and ``optimizer`` (adam, sgd) set the
    bytes per parameter (an explicit ``optimizer_states`` overrides the
    optimizer's count); ``recompute`` ("auto", "none", "full") whether stages may
    recompute activations; ``gpus_per_node`` (default: up to 8) the node layout
    that picks each link.  With ``loss_fn`` and ``target`` (one mini-batch of
    targets) the loss's cost is charged to the last stage, which computes it.
    """
    say = status or (lambda _msg: None)
    # A tuple, a dict of keywords or (args, kwargs): from here on, the flat tuple of its tensors.
    call, example_inputs = CallSpec.of(example_inputs)
    batch = _batch_size(example_inputs)
    spec, measure, local = _device(device)
    options = _options(
        gpus=gpus, batch=batch, microbatches=microbatches, schedule=schedule, pp=pp, dp=dp,
        precision=precision, optimizer=optimizer, optimizer_states=optimizer_states, recompute=recompute,
        gpus_per_node=gpus_per_node, spec=spec, measure=measure, local=local,
        memory_limit=memory_per_gpu if memory_per_gpu is not None else _default_memory(device, spec, local),
        capture_method=capture_method, max_blocks=max_blocks, bucket_cap_mb=bucket_cap_mb, time_limit=time_limit,
        refine_simulations=refine_simulations,
    )

    reference = options.reference_microbatches
    micro = microbatch_inputs(example_inputs, batch // reference)
    say(f"capturing {type(model).__name__} ({capture_method})")
    captured = capture(model, micro, method=capture_method, call=call)
    propagate_values(captured.graph_module, micro)
    nodes = len(compute_nodes(captured.graph_module))
    say(f"captured {nodes} compute nodes with {captured.method}")

    def progress(done: int, total: int) -> None:
        # The interpreter ticks every graph node (inputs, parameters too): shown out of the nodes announced.
        phase = f"{'measuring' if measure else 'counting'} costs"
        report_progress(say, phase, nodes if done >= total else nodes * done // total, nodes, unit="nodes")

    costs = _profile(captured, micro, measure=measure, device=local, progress=progress)
    times = node_times(costs, spec, precision=options.precision, measure=measure)
    blocks = coarsen(captured.graph_module, max_blocks=max_blocks, times={k: f + b for k, (f, b) in times.items()})
    if not blocks:
        raise AutopartitionError(f"{type(model).__name__} has no compute to partition.")
    loss_s = (0.0, 0.0)
    if loss_fn is not None and target is not None and measure:
        loss_s = time_loss(captured, micro, loss_fn, microbatch_inputs_any(target, batch // reference), device=local)
    scaled = _ScaledCosts(captured, blocks, costs, options, loss_s=loss_s)

    trials, solved = _search(scaled, options, say=say)
    if not solved:
        raise _infeasible(scaled, options, trials)
    # The closed form ranks every combination; the best few are simulated and the simulation decides.
    ranked = _best(trials)
    drafts = {_key(c): _build_plan(model, captured, micro, scaled.at(c.microbatches), c, options) for c in ranked}
    by_key = {t.key: t for t in trials}
    ranked, refined = _refine_in_simulation(model, captured, micro, scaled, ranked, drafts, by_key, options, say=say)
    for key, draft in drafts.items():
        by_key[key].simulated(draft)
    best, plan, captured = _choose(model, example_inputs, captured, micro, scaled, ranked, drafts, by_key, options)
    say(f"chose {plural(best.pp, 'stage')} x {plural(best.dp, 'replica')}, "
        f"{plural(best.microbatches, 'micro-batch', 'micro-batches')}, {best.schedule}")
    # Stage code is for people to read: generated once, for the chosen plan only.
    graph = scaled.at(best.microbatches)
    return dataclasses.replace(
        plan,
        candidates=_candidates(trials, by_key[_key(best)], options),
        solver=dataclasses.replace(plan.solver, refinement=refined.get(_key(best))),
        stage_code=_stage_codes(captured, plan),
        block_graph=block_graph(graph, best.partition.stage_of, captured.graph_module, dp=best.dp),
    )


def _best(trials: list[_Trial]) -> list[_Solved]:
    """The :data:`SIMULATED_CANDIDATES` best solved trials by closed form (ties: less memory first).

    One stage runs the same actions in the same time under either schedule
    (GPipe only holds more micro-batches): a one-stage twin of a kept trial is skipped.
    """
    kept: list[_Trial] = []
    for t in sorted((t for t in trials if t.partition is not None), key=lambda t: (_objective(t), t.memory or 0.0)):
        if t.pp == 1 and any(k.pp == 1 and (k.dp, k.microbatches) == (t.dp, t.microbatches) for k in kept):
            continue
        kept.append(t)
    return [t.solved() for t in kept[:SIMULATED_CANDIDATES]]


# A combination: (pp, dp, micro-batches, schedule).
_Key = tuple[int, int, int | None, str | None]


def _key(solved: _Solved) -> _Key:
    return (solved.pp, solved.dp, solved.microbatches, solved.schedule)


def _refine_in_simulation(
    model: torch.nn.Module,
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    scaled: _ScaledCosts,
    ranked: list[_Solved],
    drafts: dict[_Key, Plan],
    trials: dict[_Key, _Trial],
    options: PlanOptions,
    *,
    say: Status,
) -> tuple[list[_Solved], dict[_Key, Refinement]]:
    """Each simulated candidate's split improved by local search in simulation (:mod:`partitioner.refine`).

    The closed form charges received transfers on every micro-batch while the
    simulator overlaps them with compute, so the solver's optimum is not always
    the fastest split in simulation.  Each candidate of two stages or more is
    refined for ``options.refine_simulations`` simulated steps; a changed split is built into a
    plan and kept only if that plan simulates faster than the solver's draft
    (so refinement never makes a candidate worse).  ``drafts`` and the trials'
    partitions are updated in place; returns the candidates and what each
    refinement did.
    """
    out: list[_Solved] = []
    done: dict[_Key, Refinement] = {}
    for c in ranked:
        key = _key(c)
        if c.pp < 2 or options.refine_simulations <= 0:
            out.append(c)
            continue
        graph = scaled.at(c.microbatches)
        # A second start: the closed form's optimum with transfers left out of the stage times, which
        # the simulator mostly overlaps with compute (they delay the fill and the drain once).
        free = dataclasses.replace(c.problem, transfer_s=(0.0,) * c.problem.size,
                                   transfer_slow_s=None if c.problem.transfer_slow_s is None else (0.0,) * c.problem.size)
        other = solve(free, stages=c.pp, microbatches=c.microbatches, schedule=c.schedule,
                      time_limit=options.time_limit, use_ilp=False)
        starts = [*([] if other is None else [other.stage_of]), *layer_starts(_block_layers(captured, graph), c.pp)]
        found = refine_split(c.problem, c.partition.stage_of, c.pp, microbatches=c.microbatches, schedule=c.schedule,
                             model=_step_model(graph, c.problem, c.dp, options), budget=options.refine_simulations,
                             alternatives=starts)
        before = drafts[key].predicted.step_s
        after, moves = before, 0
        if found.stage_of != c.partition.stage_of:
            partition = dataclasses.replace(
                c.partition, stage_of=found.stage_of, recompute=found.recompute, objective=found.objective,
                status="feasible", wall_s=c.partition.wall_s + found.wall_s)
            better = dataclasses.replace(c, partition=partition)
            draft = _build_plan(model, captured, micro, graph, better, options)
            if draft.predicted.step_s < before:
                c, after, moves = better, draft.predicted.step_s, found.moves
                drafts[key] = draft
                trials[key].partition, trials[key].status = partition, partition.status
        done[key] = Refinement(before, after, moves, found.simulations, found.wall_s)
        if moves:
            say(f"refined {c.pp} stages x {c.dp} replicas, M {c.microbatches}, {c.schedule} in simulation: "
                f"{_more(after, before)} in {moves} moves")
        out.append(c)
    return out, done


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


def _step_model(graph: GraphCosts, problem: PartitionProblem, dp: int, options: PlanOptions) -> StepModel:
    """Per-block forward seconds and parameter bytes (for DDP buckets), as :func:`_stages` prices a stage."""
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
    return StepModel(forward, parameters, options.bucket_cap_mb)


def _choose(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    scaled: _ScaledCosts,
    ranked: list[_Solved],
    drafts: dict[_Key, Plan],
    trials: dict[_Key, _Trial],
    options: PlanOptions,
) -> tuple[_Solved, Plan, CapturedModel]:
    """The fastest simulated combination whose graph captures at its micro-batch size, built for real.

    A draft whose micro-batch is the costed one is the plan (same graph, shapes as
    captured); another is rebuilt on the graph captured at its own micro-batch
    size.  One whose graph differs at that size is passed over for the next.
    """
    costed = _batch_size(micro)
    failures: dict[int, AutopartitionError] = {}  # micro-batch size -> why its graph cannot be used
    chosen: tuple[_Solved, Plan, CapturedModel] | None = None
    for best in sorted(ranked, key=lambda c: drafts[_key(c)].predicted.step_s):
        size = options.batch // (best.dp * best.microbatches)
        if size == costed:
            chosen = best, drafts[_key(best)], captured
            break
        if size not in failures:
            try:
                recaptured, resized = _recapture(model, example_inputs, captured, size)
            except AutopartitionError as exc:
                failures[size] = exc
            else:
                plan = _build_plan(model, recaptured, resized, scaled.at(best.microbatches), best, options)
                chosen = best, plan, recaptured
                break
    # Every combination at a micro-batch size whose graph differs is unusable, simulated or not.
    for (_, dp, microbatches, _), trial in trials.items():
        size = options.batch // (dp * (microbatches or 1))
        if size in failures and (chosen is None or trial is not trials[_key(chosen[0])]):
            trial.status, trial.reason = "skipped", f"graph differs at {plural(size, 'sample')} per micro-batch"
    if chosen is None:
        raise next(iter(failures.values()))
    return chosen


def _recapture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    captured: CapturedModel,
    size: int,
) -> tuple[CapturedModel, tuple[torch.Tensor, ...]]:
    """The graph and inputs at a micro-batch of ``size`` samples.

    Boundary shapes and baked-in sizes must be those of the real micro-batch: a traced
    graph is shape-generic (propagate again); an exported one is specialised (recapture).
    """
    micro = microbatch_inputs(example_inputs, size)
    recaptured = (capture(model, micro, method=captured.method, call=captured.call)
                  if captured.method == "export" else captured)
    if graph_fingerprint(recaptured.graph_module) != graph_fingerprint(captured.graph_module):
        raise AutopartitionError(
            f"{type(model).__name__} captures to a different graph at micro-batch size "
            f"{size}; fix the data-parallel degree with --dp 1, or the micro-batch count "
            "with --microbatches, so that micro-batches keep the costed size."
        )
    propagate_values(recaptured.graph_module, micro)
    return recaptured, micro


class _ScaledCosts:
    """The costed graph at every micro-batch count: counted once at the reference size, then scaled.

    Node costs scale linearly with the samples per micro-batch
    (:meth:`~partitioner.cost.NodeCost.scaled`: weights are read once whatever
    the size); times are priced again at each size (:func:`~partitioner.formulate.node_times`).
    """

    def __init__(
        self,
        captured: CapturedModel,
        blocks: list[tuple[str, ...]],
        costs: dict[str, NodeCost],
        options: PlanOptions,
        *,
        loss_s: tuple[float, float],
    ) -> None:
        self.captured, self.blocks, self.costs, self.options, self.loss_s = captured, blocks, costs, options, loss_s
        self._graphs: dict[int, GraphCosts] = {}
        self._problems: dict[tuple[int, int], PartitionProblem] = {}  # formulated once per (dp, M)

    def at(self, microbatches: int) -> GraphCosts:
        """Costs of one micro-batch when the mini-batch is split into ``microbatches`` (at dp = 1)."""
        if microbatches not in self._graphs:
            o = self.options
            factor = o.reference_microbatches / microbatches
            costs = self.costs if factor == 1 else {k: _scaled(c, factor) for k, c in self.costs.items()}
            times = node_times(costs, o.spec, precision=o.precision, measure=o.measure)
            loss = (self.loss_s[0] * factor, self.loss_s[1] * factor)
            graph = graph_costs(self.captured, self.blocks, costs, times, loss_s=loss)
            if factor != 1:  # values read across blocks (sent, kept for recomputation): at the captured size
                graph = dataclasses.replace(
                    graph,
                    node_output_bytes={k: round(v * factor) for k, v in graph.node_output_bytes.items()},
                    block_sends=tuple(round(b * factor) for b in graph.block_sends),
                )
            self._graphs[microbatches] = graph
        return self._graphs[microbatches]

    def problem(self, dp: int, microbatches: int, **changes: Any) -> PartitionProblem:
        """The solver's problem for ``dp`` replicas and ``microbatches``, with the options' settings.

        ``changes`` override formulate's keywords (``precision``, ``recompute``, ``memory_limit``...).
        """
        if not changes and (dp, microbatches) in self._problems:
            return self._problems[dp, microbatches]
        o = self.options
        kwargs: dict[str, Any] = {
            "spec": o.spec, "memory_limit": o.memory_limit, "precision": o.precision,
            "optimizer_states": o.optimizer_states, "bucket_cap_mb": o.bucket_cap_mb,
            "gpus_per_node": o.gpus_per_node, "recompute": o.recompute, **changes,
        }
        problem = formulate(self.at(microbatches), dp=dp, **kwargs)
        if not changes:
            self._problems[dp, microbatches] = problem
        return problem


def _scaled(cost: NodeCost, factor: float) -> NodeCost:
    """``cost`` for a micro-batch ``factor`` times as large: linear in the samples, weights read once.

    >>> c = _scaled(NodeCost(1.0, 2.0, 10.0, 20.0, 100, 1000, "float32", weight_bytes=200), 0.5)
    >>> c.forward_s, c.backward_flops, c.saved_bytes, c.io_bytes, c.weight_bytes
    (0.5, 10.0, 50, 600, 200)
    """
    return dataclasses.replace(
        cost,
        forward_s=cost.forward_s * factor,
        backward_s=cost.backward_s * factor,
        forward_flops=cost.forward_flops * factor,
        backward_flops=cost.backward_flops * factor,
        saved_bytes=round(cost.saved_bytes * factor),
        io_bytes=round(cost.weight_bytes + (cost.io_bytes - cost.weight_bytes) * factor),
        saved_float32_bytes=None if cost.saved_float32_bytes is None else round(cost.saved_float32_bytes * factor),
    )


def _profile(
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    *,
    measure: bool,
    device: torch.device,
    progress: Callable[[int, int], None],
) -> dict[str, NodeCost]:
    # Counting (measure=False) runs on fake tensors, so it counts the real micro-batch directly:
    # exact for tensors that do not grow with the batch (positions, masks), and as fast.
    return profile(captured, micro, measure=measure, device=device, progress=progress)


def microbatch_inputs_any(value: Any, size: int) -> Any:
    """The first ``size`` samples of every tensor in a pytree (targets may be nested)."""
    return pytree.tree_map(lambda x: x[:size] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, value)


def microbatch_inputs(inputs: tuple[Any, ...], size: int) -> tuple[torch.Tensor, ...]:
    """The first ``size`` samples of each input: the shapes one micro-batch has."""
    return tuple(x[:size] for x in inputs)


def stage_layout(pp: int, dp: int) -> list[tuple[int, ...]]:
    """Ranks of each stage, stage-major (Megatron's order: a stage's replicas are neighbours)."""
    return [tuple(s * dp + r for r in range(dp)) for s in range(pp)]


# ----------------------------------------------------------------- checks


def _batch_size(inputs: tuple[Any, ...]) -> int:
    sizes = {x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise AutopartitionError(
            f"Every example input needs the batch in dimension 0 with one common size; got sizes {sorted(sizes)}."
        )
    return sizes.pop()


def _options(
    *,
    gpus: int,
    batch: int,
    microbatches: int | str,
    schedule: str,
    pp: int | None,
    dp: int | None,
    precision: str,
    optimizer: str,
    optimizer_states: int | None,
    recompute: str,
    gpus_per_node: int | None,
    **resolved: Any,
) -> PlanOptions:
    """Check every option (an :class:`AutopartitionError` on the first bad one) and resolve the defaults."""
    if gpus < 1:
        raise AutopartitionError(f"--gpus must be at least 1, got {gpus}.")
    micro: int | None = None
    if microbatches != AUTO:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int):
            raise AutopartitionError(f"--microbatches must be a whole number or 'auto', got {microbatches!r}.")
        if microbatches < 1:
            raise AutopartitionError(f"--microbatches must be at least 1, got {microbatches}.")
        if batch % microbatches:
            raise AutopartitionError(
                f"The batch of {batch} does not split into {microbatches} equal micro-batches; "
                f"choose a batch size that is a multiple of {microbatches}, another --microbatches, "
                "or --microbatches auto."
            )
        micro = microbatches
    kinds = SCHEDULES if schedule == AUTO else tuple(k for k in SCHEDULES if k == schedule)
    if not kinds:
        raise AutopartitionError(
            f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}, or auto to try each."
        )
    for name, value in (("pp", pp), ("dp", dp)):
        if value is not None and (value < 1 or gpus % value):
            raise AutopartitionError(f"--{name} {value} must be a positive divisor of --gpus {gpus}.")
    if pp is not None and dp is not None and pp * dp != gpus:
        raise AutopartitionError(f"--pp {pp} x --dp {dp} = {pp * dp}, but --gpus is {gpus}.")
    if recompute not in RECOMPUTE_MODES:
        raise AutopartitionError(
            f"Unknown recomputation {recompute!r}; choose auto (each stage recomputes only if it would "
            "not fit otherwise), none (keep every activation) or full (every stage recomputes)."
        )
    if optimizer_states is not None and optimizer_states < 0:
        raise AutopartitionError(f"optimizer_states must be 0 or more, got {optimizer_states}.")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        divisors = ", ".join(str(k) for k in range(1, gpus + 1) if gpus % k == 0)
        raise AutopartitionError(
            f"--gpus-per-node {gpus_per_node} does not divide --gpus {gpus}: ranks are laid out node by "
            f"node, every node holding the same number of GPUs. Choose one of {divisors} (a job on part "
            "of one node: --gpus-per-node equal to --gpus)."
        )
    return PlanOptions(
        gpus=gpus, batch=batch, microbatches=micro, schedules=kinds, pp=pp, dp=dp,
        precision=check_precision(precision), optimizer=check_optimizer(optimizer),
        optimizer_states=OPTIMIZERS[optimizer] if optimizer_states is None else optimizer_states,
        recompute=next(m for m in RECOMPUTE_MODES if m == recompute),  # narrows str to RecomputeMode
        gpus_per_node=gpus_per_node or default_gpus_per_node(gpus),
        **resolved,
    )


def _device(device: str) -> tuple[DeviceSpec, bool, torch.device]:
    """(spec for communication and limits, measure locally?, local device to run on)."""
    name = device.lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise AutopartitionError("--device cuda was asked for but no CUDA device is visible.")
        gpu = torch.cuda.get_device_name().lower()
        known = next((k for k in ("h200", "h100", "a100") if k in gpu), "a100")
        return DEVICES[known], True, torch.device("cuda")
    if name == "cpu":
        return DEVICES["cpu"], True, torch.device("cpu")
    return device_spec(name), False, torch.device("cpu")


def _default_memory(device: str, spec: DeviceSpec, local: torch.device) -> float | None:
    if local.type == "cuda":
        return float(torch.cuda.get_device_properties(local).total_memory)
    if device.lower() in ("auto", "cpu"):
        return None  # CPU ranks share host memory; no per-rank limit unless given
    return float(spec.memory_bytes)


# ----------------------------------------------------------------- search


@dataclasses.dataclass(eq=False)
class _Trial:
    """One pp x dp x M x schedule combination (M and schedule None: the whole shape) as the search left it."""

    pp: int
    dp: int
    microbatches: int | None = None
    schedule: ScheduleKind | None = None
    status: str = "pending"  # then skipped, infeasible, pruned, or the solver's optimal / feasible
    reason: str = ""  # skipped / infeasible: why
    bound: float = 0.0  # a lower bound on its closed-form step
    problem: PartitionProblem | None = None
    partition: Partition | None = None
    memory: float | None = None  # peak bytes per GPU of its split; infeasible: what its split would need
    simulated_s: float | None = None
    bubble: float | None = None  # closed form
    simulated_bubble: float | None = None

    @property
    def key(self) -> _Key:
        return (self.pp, self.dp, self.microbatches, self.schedule)

    def solved(self) -> _Solved:
        assert self.problem is not None and self.partition is not None
        assert self.microbatches is not None and self.schedule is not None
        return _Solved(self.pp, self.dp, self.problem, self.partition, self.microbatches, self.schedule)

    def simulated(self, draft: Plan) -> None:
        """Record the simulation of its draft plan."""
        self.simulated_s = draft.predicted.step_s
        self.simulated_bubble = draft.predicted.bubble_fraction
        self.memory = max(draft.predicted.peak_memory_bytes, default=0.0)


def _search(scaled: _ScaledCosts, options: PlanOptions, *, say: Status) -> tuple[list[_Trial], list[_Solved]]:
    """Every allowed combination as a trial (bounded, screened, refined: see the module docstring)."""
    gpus, batch, limit = options.gpus, options.batch, options.memory_limit
    blocks = len(scaled.blocks)
    trials: list[_Trial] = []
    pending: list[_Trial] = []
    for d in sorted(k for k in range(1, gpus + 1) if gpus % k == 0):
        p = gpus // d
        if (options.pp is not None and p != options.pp) or (options.dp is not None and d != options.dp):
            continue
        choices = options.microbatch_choices(d)
        single = options.schedules[0] if len(options.schedules) == 1 else None
        if not choices:
            split = f"{d} replicas" + (f" x {options.microbatches} micro-batches" if options.microbatches else "")
            trials.append(_Trial(p, d, options.microbatches, single, "skipped", f"batch {batch} does not split into {split}"))
            continue
        if p > blocks:
            trials.append(_Trial(p, d, options.microbatches, single, "skipped", f"only {blocks} blocks to place"))
            continue
        state = _state_bound(scaled.problem(d, choices[0]), p)
        if limit is not None and state > limit:
            trials.append(_Trial(p, d, options.microbatches, single, "infeasible", "state alone", memory=state))
            continue
        for m in choices:
            problem = scaled.problem(d, m)
            bound = _time_bound(problem, p, m)
            pending += [_Trial(p, d, m, k, bound=bound, problem=problem) for k in options.schedules]
    trials += pending
    if not trials:
        raise AutopartitionError(
            f"No pp x dp shape fits --gpus {gpus} with the given --pp/--dp; check the numbers."
        )
    _screen(pending, options, say=say)
    _refine(pending, options)
    for t in pending:
        _describe(t, options)
    return trials, [t.solved() for t in pending if t.partition is not None]


def _state_bound(problem: PartitionProblem, stages: int) -> float:
    """Least static bytes (weights, gradients, optimizer state) on the fullest of ``stages`` stages.

    At least the total over the stages (a tied parameter counted once), and at
    least the largest block's own (a block sits whole on one stage).
    """
    total = sum(problem.static_bytes) + sum(held for held, _, _ in problem.shared)
    return max(total / stages, max(problem.static_bytes, default=0.0))


def _time_bound(problem: PartitionProblem, stages: int, microbatches: int) -> float:
    """A lower bound on the closed form ``sum t + (M-1) max t + max all-reduce``: ``T (1 + (M-1)/P)``.

    ``T`` is the blocks' compute per micro-batch: the stage times sum to at least
    ``T`` and the slowest is at least their mean (transfers, recomputation and
    all-reduces only add).
    """
    total = sum(problem.time_s)
    return total * (1 + (microbatches - 1) / stages) + problem.allreduce_latency_s


def _screen(pending: list[_Trial], options: PlanOptions, *, say: Status) -> None:
    """Solve each trial with the interval DP, cheapest bound first, until bounds lose to the best found."""
    found: list[float] = []  # closed forms so far, ascending
    announced: set[tuple[int, int]] = set()
    for t in sorted(pending, key=lambda t: t.bound):
        if len(found) >= REFINED_CANDIDATES and t.bound >= found[REFINED_CANDIDATES - 1]:
            t.status = "pruned"
            continue
        if (t.pp, t.dp) not in announced:
            announced.add((t.pp, t.dp))
            say(f"solving {plural(t.pp, 'stage')} x {plural(t.dp, 'replica')}")
        assert t.problem is not None and t.microbatches is not None and t.schedule is not None
        part = solve(t.problem, stages=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                     time_limit=options.time_limit, use_ilp=False)
        if part is None and not is_chain(t.problem):  # another block order may fit: the full solver
            part = solve(t.problem, stages=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                         time_limit=options.time_limit)
        if part is None:
            t.status = "infeasible"
            continue
        t.partition, t.status = part, part.status
        found.append(part.objective)
        found.sort()


def _refine(pending: list[_Trial], options: PlanOptions) -> None:
    """Solve the best few screened trials again with the full solver (down-set DP or ILP)."""
    screened = sorted((t for t in pending if t.partition is not None), key=lambda t: _objective(t))
    for t in screened[:REFINED_CANDIDATES]:
        assert t.problem is not None and t.partition is not None and t.microbatches and t.schedule
        if t.partition.status == "optimal":
            continue
        part = solve(t.problem, stages=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                     time_limit=options.time_limit)
        if part is not None and part.objective <= t.partition.objective * (1 + 1e-12):
            t.partition, t.status = part, part.status


def _objective(t: _Trial) -> float:
    return t.partition.objective if t.partition is not None else math.inf


def _recompute_of(t: _Trial) -> tuple[bool, ...]:
    """The trial's per-stage recomputation: the solver's, else the problem's rule for its split."""
    assert t.problem is not None and t.partition is not None and t.microbatches and t.schedule
    if t.partition.recompute:
        return t.partition.recompute
    return choose_recompute(t.problem, t.partition.stage_of, t.pp, microbatches=t.microbatches, schedule=t.schedule)


def _describe(t: _Trial, options: PlanOptions) -> None:
    """Peak memory (needed, where it does not fit) and closed-form bubble of a trial."""
    if t.problem is None or t.microbatches is None or t.schedule is None:
        return
    m, kind = t.microbatches, t.schedule
    if t.partition is not None:
        recompute = _recompute_of(t)
        stage_of = t.partition.stage_of
        t.memory = max(stage_memory(t.problem, stage_of, t.pp, microbatches=m, schedule=kind, recompute=recompute))
        times, _ = stage_costs(t.problem, stage_of, t.pp, recompute=recompute)
        step = t.partition.objective
        t.bubble = max(0.0, 1 - m * sum(times) / (t.pp * step)) if step > 0 else 0.0
    elif t.status == "infeasible":
        # What its fastest split would need, with every stage recomputing where the options allow it.
        lean = dataclasses.replace(t.problem, memory_limit=None,
                                   recompute="none" if options.recompute == "none" else "full")
        part = solve(lean, stages=t.pp, microbatches=m, schedule=kind, use_ilp=False)
        if part is not None:
            t.memory = max(stage_memory(lean, part.stage_of, t.pp, microbatches=m, schedule=kind,
                                        recompute=part.recompute or None))


def _candidates(trials: list[_Trial], chosen: _Trial, options: PlanOptions) -> tuple[Candidate, ...]:
    """Every trial as a report row, with why it lost to ``chosen`` (or ``chosen``)."""
    rows = []
    order: dict[str | None, int] = {k: i for i, k in enumerate(SCHEDULES)}
    for t in sorted(trials, key=lambda t: (t.dp, t.microbatches or 0, order.get(t.schedule, -1))):
        recomputed = sum(_recompute_of(t)) if t.partition is not None else None
        rows.append(Candidate(
            pp=t.pp, dp=t.dp, step_s=None if t.partition is None else t.partition.objective,
            status=t.status, note=_verdict(t, chosen, options), simulated_s=t.simulated_s,
            microbatches=t.microbatches, schedule=t.schedule, recomputed_stages=recomputed,
            memory_bytes=t.memory, bubble_fraction=t.bubble if t.simulated_bubble is None else t.simulated_bubble,
        ))
    return tuple(rows)


def _verdict(t: _Trial, chosen: _Trial, options: PlanOptions) -> str:
    """Why ``t`` lost to ``chosen``, in a few words."""
    if t is chosen:
        return "chosen"
    if t.status == "skipped":
        return t.reason
    limit = options.memory_limit or 0.0
    if t.status == "infeasible":
        if t.memory is None:
            return "does not fit"
        what = f"{t.reason} " if t.reason else ""
        return f"does not fit: {what}needs {format_bytes(t.memory)} > {format_bytes(limit)}"
    best = _objective(chosen)
    if t.pp == chosen.pp == 1 and (t.dp, t.microbatches) == (chosen.dp, chosen.microbatches) \
            and _objective(t) == best:
        return "same step: one stage runs either schedule alike"
    if t.status == "pruned":
        return f"slower: at least {_more(t.bound, best)} (bound)"
    if t.simulated_s is not None and chosen.simulated_s is not None:
        slower = f"slower: {_more(t.simulated_s, chosen.simulated_s)} (simulated)"
        bubble = t.simulated_bubble
    else:
        slower = f"slower: {_more(_objective(t), best)} (closed form)"
        bubble = t.bubble
    if t.pp > 1 and bubble is not None and bubble >= 0.1:
        slower += f", bubble {bubble:.0%}"  # the pipeline's idle share, a likely reason
    return slower


def _more(value: float, base: float) -> str:
    """``value`` against ``base`` as "+12.3%"."""
    return f"{value / base - 1:+.1%}" if base > 0 else "+inf"


def _infeasible(scaled: _ScaledCosts, options: PlanOptions, trials: list[_Trial]) -> AutopartitionError:
    """Why nothing fits, under which assumptions, and what would: GPUs, memory, precision, recomputation."""
    gpus = options.gpus
    if not any(t.status == "infeasible" for t in trials):
        reasons = "; ".join(f"{t.pp}x{t.dp}: {t.reason or t.status}" for t in trials)
        most = len(scaled.blocks)
        return AutopartitionError(
            f"No pp x dp shape can be planned for {gpus} GPUs ({reasons}). The model can be split into at "
            f"most {most} pipeline stages here; use --pp {min(most, gpus)} or fewer (the rest of the GPUs "
            "become data-parallel replicas), and a batch size divisible by replicas x micro-batches."
        )
    # The least memory the options allow: pipeline stages only, the smallest micro-batches, 1F1B.
    m = max(options.microbatch_choices(1) or (options.reference_microbatches,))
    kind: ScheduleKind = "1f1b" if "1f1b" in options.schedules else options.schedules[0]
    most, limit = len(scaled.blocks), options.memory_limit
    stages = min(gpus, most)
    may = "none" if options.recompute == "none" else "auto"  # fits if it fits either way

    def fits(precision: str, recompute: str, p: int = stages) -> bool:
        problem = scaled.problem(1, m, precision=precision, recompute=recompute, gpus_per_node=None)
        return solve(problem, stages=p, microbatches=m, schedule=kind, use_ilp=False) is not None

    lean = scaled.problem(1, m, memory_limit=None, gpus_per_node=None,
                          recompute="none" if options.recompute == "none" else "full")
    relaxed = solve(lean, stages=stages, microbatches=m, schedule=kind, use_ilp=False)
    need_memory = float("nan") if relaxed is None else max(stage_memory(
        lean, relaxed.stage_of, stages, microbatches=m, schedule=kind, recompute=relaxed.recompute or None))
    need_gpus = next((p for p in range(gpus + 1, most + 1) if fits(options.precision, may, p)), None)
    if need_gpus:
        more = f"It would fit on {need_gpus} GPUs as pipeline stages"
    else:
        state = _state_bound(lean, 1)
        more = (f"Even {most} stages (the most this model splits into) do not fit; its weights, gradients and "
                f"optimizer state alone take {format_bytes(state)}, at least "
                f"{math.ceil(state / limit) if limit else 1} GPUs' worth")
    assumed = _assumptions(options, m, kind)
    hints = []
    cheaper = [p for p in ("bf16-mixed", "bf16") if _cheaper(p, options.precision)]
    precision_fix = next((p for p in cheaper if fits(p, may)), None)
    if precision_fix:
        hints.append(f"--precision {precision_fix} it would fit on {gpus} GPUs")
    if options.recompute == "none" and fits(options.precision, "auto"):
        hints.append(f"--recompute auto (or full) it would fit on {gpus} GPUs")
    elif options.recompute == "none" and not precision_fix:
        both = next((p for p in cheaper if fits(p, "auto")), None)
        if both:
            hints.append(f"--precision {both} --recompute auto it would fit on {gpus} GPUs")
    fix = "".join(f" With {hint}." for hint in hints)
    one_f_one_b = "" if "1f1b" in options.schedules else ", use --schedule 1f1b (fewer micro-batches in flight)"
    return InfeasibleError(
        f"No split of the model over {gpus} GPUs fits in {format_bytes(limit or 0)} per GPU "
        f"(parameters, gradients, optimizer state and activations of the micro-batches in flight; {assumed}). "
        f"{more}; with {stages} stages each GPU would need about {format_bytes(need_memory)}.{fix} "
        f"Otherwise add GPUs, raise --memory-per-gpu{one_f_one_b}, or shrink the batch."
    )


def _cheaper(precision: str, than: str) -> bool:
    """True when ``precision`` needs less memory than ``than`` (fp32 > bf16-mixed > bf16)."""
    rank = {"fp32": 2, "bf16-mixed": 1, "bf16": 0}
    return rank[precision] < rank[than]


def _assumptions(options: PlanOptions, microbatches: int, schedule: str) -> str:
    """The settings a memory estimate assumed, in words."""
    per_parameter = static_bytes_per_element(options.precision, options.optimizer_states)
    recompute = {"auto": "recomputation where it helps", "full": "every stage recomputing",
                 "none": "no recomputation"}[options.recompute]
    return (f"{options.precision} with {options.optimizer}, {per_parameter} bytes per parameter; {recompute}; "
            f"{schedule} with {microbatches} micro-batches, the least memory the options allow")


# ----------------------------------------------------------------- plan


def _build_plan(
    model: torch.nn.Module,
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    graph: GraphCosts,
    solved: _Solved,
    options: PlanOptions,
) -> Plan:
    """The plan for one solved combination, less candidates and stage code: assemble, lower, predict.

    ``graph`` holds the costs at the combination's micro-batch count.  Boundary
    shapes are scaled from the captured micro-batch (``micro``) to the
    combination's (drafts are ranked before the winner is recaptured at its size).
    """
    stages = _stages(captured, graph, solved, options, sizes=(_batch_size(micro), _microbatch_size(solved, options)))
    partition, spec = solved.partition, options.spec
    model_flops = graph.flops() * solved.microbatches  # one mini-batch over all replicas
    assembled = Plan(
        format_version=FORMAT_VERSION,
        model=_model_info(model, captured, micro),
        gpus=options.gpus, pp=solved.pp, dp=solved.dp, microbatches=solved.microbatches,
        schedule=solved.schedule, batch_size=options.batch, device=options.device_name,
        stages=stages,
        actions=(),  # _lower
        tied=_tied(captured, stages),
        predicted=StepPrediction(0.0, 0.0, 0.0, (), model_flops=model_flops or None),  # _predict
        solver=SolverInfo(partition.solver, partition.status, partition.objective, partition.lower_bound,
                          partition.wall_s, len(graph.blocks)),
        cost_model=CostModelInfo(
            source=("measured on " if options.measure else "predicted for ") + spec.name,
            link_bandwidth=spec.link_bandwidth, link_latency=spec.link_latency,
            memory_limit=options.memory_limit, optimizer_states=options.optimizer_states,
            inter_node_bandwidth=spec.inter_node_bandwidth, inter_node_latency=spec.inter_node_latency,
            peak_flops=spec.peak(compute_dtype(options.precision)),
        ),
        candidates=(),  # compile: every combination's row, on the chosen plan
        bucket_cap_mb=options.bucket_cap_mb,
        stage_code=(),  # _stage_codes, for the chosen plan only
        precision=options.precision,
        optimizer=options.optimizer,
        gpus_per_node=options.gpus_per_node,
    )
    return _predict(_lower(assembled))


def _microbatch_size(solved: _Solved, options: PlanOptions) -> int:
    return options.batch // (solved.dp * solved.microbatches)


def _model_info(model: torch.nn.Module, captured: CapturedModel, micro: tuple[torch.Tensor, ...]) -> ModelInfo:
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
    captured: CapturedModel, graph: GraphCosts, solved: _Solved, options: PlanOptions, *, sizes: tuple[int, int]
) -> tuple[StagePlan, ...]:
    """Each stage's nodes, boundary tensors, ranks, links, recomputation and predicted costs.

    Costs come from the solver's problem, so the plan shows what the solver
    optimised: a recomputing stage's backward includes its blocks' forward again
    (``recompute_s``) and it keeps only its blocks' inputs per micro-batch
    (``recompute_bytes``), plus the largest block's activations during each
    backward (:func:`partitioner.problem.stage_memory`).
    """
    gm = captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    pp, dp, problem, partition = solved.pp, solved.dp, solved.problem, solved.partition
    m, kind, per_node = solved.microbatches, solved.schedule, options.gpus_per_node
    stage_of_node = {name: partition.stage_of[b] for b, members in enumerate(graph.blocks) for name in members}
    compute_sets: list[set[str]] = [set() for _ in range(pp)]
    for name, s in stage_of_node.items():
        compute_sets[s].add(name)
    blocks_of: list[list[int]] = [[] for _ in range(pp)]
    for b, s in enumerate(partition.stage_of):
        blocks_of[s].append(b)
    boundaries = tuple(
        dataclasses.replace(b, link="inter" if p2p_crosses_nodes(b.source, b.target, dp=dp, gpus_per_node=per_node)
                            else "intra")
        for b in _boundaries(gm, stage_of_node, pp, sizes=sizes)
    )
    recompute = partition.recompute or choose_recompute(problem, partition.stage_of, pp, microbatches=m, schedule=kind)
    _, allreduce = stage_costs(problem, partition.stage_of, pp, recompute=recompute)
    latency = allreduce_latencies(problem, pp)
    memory = stage_memory(problem, partition.stage_of, pp, microbatches=m, schedule=kind, recompute=recompute)
    layout = stage_layout(pp, dp)
    stages: list[StagePlan] = []
    for s in range(pp):
        names = closure(gm, compute_sets[s])
        model_inputs = tuple(dict.fromkeys(
            a.name for n in names for a in nodes[n].all_input_nodes if a.op == "placeholder"))
        inputs = tuple(b for b in boundaries if b.target == s)
        outputs = tuple(b for b in boundaries if b.source == s)
        params = tuple(sorted({p for n in names for p in _parameters_of(gm, nodes[n])}))
        compute = [n for n in names if n in compute_sets[s]]
        # Name the range by user modules; root-level glue (x.size(1), a residual add) only if nothing else.
        paths = [module_path(nodes[n]) for n in compute if module_path(nodes[n])] or ["(root)"]
        last = s == pp - 1
        forward = (sum(graph.node_forward_s[n] for n in compute) + (graph.loss_s[0] if last else 0.0)) / dp
        total = (sum(graph.node_time_s[n] for n in compute) + (sum(graph.loss_s) if last else 0.0)) / dp
        kept = [problem.activation_bytes[b] for b in blocks_of[s]]
        again = 0.0
        if recompute[s]:
            assert problem.recompute_bytes is not None and problem.recompute_s is not None
            again = sum(problem.recompute_s[b] for b in blocks_of[s])
            kept = [problem.recompute_bytes[b] for b in blocks_of[s]]
        stages.append(StagePlan(
            index=s,
            ranks=layout[s],
            nodes=tuple(names),
            compute_nodes=len(compute),
            parameters=params,
            model_inputs=model_inputs,
            inputs=inputs,
            outputs=outputs,
            modules=(paths[0], paths[-1]),
            predicted=StagePrediction(
                forward_s=forward,
                backward_s=total - forward + again,
                memory_bytes=memory[s],
                parameter_bytes=sum(graph.parameter_bytes[captured.parameter_names[p]] for p in params),
                activation_bytes=sum(kept),
                send_bytes=round(sum(b.nbytes * activation_scale(options.precision, b.dtype) for b in outputs)),
                allreduce_s=allreduce[s] + latency[s],
                recompute_s=again,
                recompute_peak_bytes=max((problem.activation_bytes[b] for b in blocks_of[s]), default=0.0)
                if recompute[s] else 0.0,
            ),
            recompute="full" if recompute[s] else "none",
            allreduce_link="inter" if allreduce_crosses_nodes(s, dp=dp, gpus_per_node=per_node) else "intra",
        ))
    return tuple(stages)


def _lower(plan: Plan) -> Plan:
    """The schedule's action lists for the plan's stages, communication inserted, validated."""
    sends_to, receives_from = stage_topology(plan.stages)
    lowered = lower(compute_order(plan.schedule, stages=plan.pp, microbatches=plan.microbatches),
                    sends_to=sends_to, receives_from=receives_from, kind=plan.schedule)
    validate(lowered, sends_to=sends_to, receives_from=receives_from)
    return dataclasses.replace(plan, actions=tuple(tuple(str(a) for a in row) for row in lowered.actions))


def _predict(plan: Plan) -> Plan:
    """The step prediction, from a discrete-event simulation of the lowered plan, and the MFU it implies."""
    sim = simulate(plan)
    flops, peak = plan.predicted.model_flops, plan.cost_model.peak_flops
    return dataclasses.replace(plan, predicted=StepPrediction(
        step_s=sim.step_s,
        bubble_fraction=sim.bubble_fraction,
        samples_per_s=plan.batch_size / sim.step_s if sim.step_s > 0 else 0.0,
        peak_memory_bytes=tuple(float(m) for m in sim.peak_memory_bytes),
        model_flops=flops,
        mfu=model_flops_utilization(flops, gpus=plan.gpus, peak_flops=peak, step_s=sim.step_s),
    ))


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
    return model_flops / (gpus * peak_flops * step_s)


def _stage_codes(captured: CapturedModel, plan: Plan) -> tuple[str, ...]:
    """Readable code per stage, built as the runtime builds each stage module."""
    gm = captured.graph_module
    statics = {n.name: n.meta[VALUE_KEY].static for n in gm.graph.nodes if n.meta[VALUE_KEY].kind == "static"}
    codes = []
    for stage in plan.stages:
        signature = stage_signature(stage, model_outputs=plan.model.outputs, last=stage.index == plan.pp - 1)
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
    tied = []
    for canonical, aliases in sorted(captured.tied_parameters().items()):
        holders = tuple(st.index for st in stages if set(aliases) & set(st.parameters))
        tied.append(TiedParameter(canonical, tuple(aliases), holders))
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


