"""The compiler driver: capture -> values -> cost -> coarsen -> solve (every pp x dp) -> Plan.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> plan = compile(model, (torch.randn(8, 16),), gpus=2, microbatches=2, device="h100")
    >>> (plan.pp * plan.dp, len(plan.stages))  # doctest: +SKIP
    (2, 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from partitioner.blockgraph import block_graph
from partitioner.capture import CapturedModel, CaptureMethod, capture
from partitioner.coarsen import coarsen
from partitioner.cost import NodeCost, predicted_times, profile, time_loss
from partitioner.defaults import DEFAULT_BUCKET_CAP_MB, DEFAULT_SCHEDULE, SCHEDULES
from partitioner.devices import DEVICES, DeviceSpec, device_spec
from partitioner.errors import AutopartitionError, InfeasibleError, InternalError
from partitioner.formulate import GraphCosts, formulate, graph_costs
from partitioner.ir import (
    KIND_KEY,
    VALUE_KEY,
    ValueInfo,
    compute_nodes,
    graph_fingerprint,
    module_path,
    node_parameters,
)
from partitioner.plan import (
    FORMAT_VERSION,
    Boundary,
    Candidate,
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
from partitioner.problem import Partition, PartitionProblem, ScheduleKind, stage_costs, stage_memory
from partitioner.schedule import compute_order, lower, validate
from partitioner.simulate import simulate
from partitioner.solve import solve
from partitioner.stagegraph import StageSignature, build_stage, closure, stage_signature
from partitioner.units import format_bytes
from partitioner.values import propagate_values

__all__ = ["SIMULATED_CANDIDATES", "PlanOptions", "Status", "compile", "microbatch_inputs", "stage_layout"]

SIMULATED_CANDIDATES = 3  # best closed-form shapes that are simulated before choosing

Status = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Every planning choice, checked and resolved once by :func:`compile`, then carried through."""

    gpus: int
    batch: int  # mini-batch size: samples per step over all replicas
    microbatches: int
    schedule: ScheduleKind
    spec: DeviceSpec  # link, memory and roofline numbers of the GPU planned for
    measure: bool  # times measured on ``local``, else predicted for ``spec``
    local: torch.device  # where capture and profiling run
    memory_limit: float | None  # bytes per GPU; None: no limit
    pp: int | None  # a fixed shape, else every pp x dp over the divisors of ``gpus``
    dp: int | None
    capture_method: CaptureMethod
    max_blocks: int
    optimizer_states: int
    bucket_cap_mb: float
    time_limit: float  # solver seconds per pp x dp shape

    @property
    def device_name(self) -> str:
        """The plan's ``device`` field."""
        return f"{self.spec.name} (measured)" if self.measure else self.spec.name


@dataclasses.dataclass(frozen=True)
class _Solved:
    """One solved pp x dp shape and the problem it was solved for (formulated once, reused by the plan)."""

    pp: int
    dp: int
    problem: PartitionProblem
    partition: Partition


def compile(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    gpus: int,
    microbatches: int = 8,
    schedule: str = DEFAULT_SCHEDULE,
    device: str = "auto",
    memory_per_gpu: float | None = None,
    pp: int | None = None,
    dp: int | None = None,
    capture_method: CaptureMethod = "auto",
    max_blocks: int = 256,
    optimizer_states: int = 2,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    time_limit: float = 10.0,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    status: Status | None = None,
) -> Plan:
    """Plan ``model`` for ``gpus`` GPUs; ``example_inputs`` is one mini-batch (batch in dim 0).

    With ``loss_fn`` and ``target`` (one mini-batch of targets) the loss's cost is
    charged to the last stage, which computes it.
    """
    say = status or (lambda _msg: None)
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    batch = _batch_size(example_inputs)
    kind = _check_options(gpus=gpus, microbatches=microbatches, schedule=schedule, batch=batch, pp=pp, dp=dp)
    spec, measure, local = _device(device)
    options = PlanOptions(
        gpus=gpus, batch=batch, microbatches=microbatches, schedule=kind, spec=spec, measure=measure, local=local,
        memory_limit=memory_per_gpu if memory_per_gpu is not None else _default_memory(device, spec, local),
        pp=pp, dp=dp, capture_method=capture_method, max_blocks=max_blocks, optimizer_states=optimizer_states,
        bucket_cap_mb=bucket_cap_mb, time_limit=time_limit,
    )

    micro = microbatch_inputs(example_inputs, batch // microbatches)
    say(f"capturing {type(model).__name__} ({capture_method})")
    captured = capture(model, micro, method=capture_method)
    propagate_values(captured.graph_module, micro)
    say(f"captured {len(compute_nodes(captured.graph_module))} compute nodes with {captured.method}")

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            say(f"{'measuring' if measure else 'counting'} costs: node {done}/{total}")

    costs = _profile(captured, micro, measure=measure, device=local, progress=progress)
    times = {
        name: (c.forward_s, c.backward_s) if measure else predicted_times(c, spec) for name, c in costs.items()
    }
    blocks = coarsen(captured.graph_module, max_blocks=max_blocks, times={k: f + b for k, (f, b) in times.items()})
    if not blocks:
        raise AutopartitionError(f"{type(model).__name__} has no compute to partition.")
    loss_s = (0.0, 0.0)
    if loss_fn is not None and target is not None and measure:
        loss_s = time_loss(captured, micro, loss_fn, microbatch_inputs_any(target, batch // microbatches), device=local)
    graph = graph_costs(captured, blocks, costs, times, loss_s=loss_s)

    candidates, solved = _search(graph, options, say=say)
    if not solved:
        raise _infeasible(graph, options, candidates)
    # The closed form ranks every shape; the best few are simulated and the simulation decides.
    ranked = sorted(solved, key=lambda shape: shape.partition.objective)[:SIMULATED_CANDIDATES]
    drafts = {(s.pp, s.dp): _build_plan(model, captured, micro, graph, s, options, batch_divisor=s.dp) for s in ranked}
    simulated = {shape: draft.predicted.step_s for shape, draft in drafts.items()}
    candidates = [dataclasses.replace(c, simulated_s=simulated.get((c.pp, c.dp))) for c in candidates]
    best = min(ranked, key=lambda shape: simulated[shape.pp, shape.dp])
    plan = drafts[best.pp, best.dp]  # with dp = 1 the draft is the plan: same graph, shapes unscaled
    if best.dp > 1:
        captured, micro = _recapture(model, example_inputs, captured, options, dp=best.dp)
        plan = _build_plan(model, captured, micro, graph, best, options)
    say(f"chose {best.pp} stages x {best.dp} replicas")
    # Stage code is for people to read: generated once, for the chosen plan only.
    return dataclasses.replace(plan, candidates=tuple(candidates), stage_code=_stage_codes(captured, plan),
                               block_graph=block_graph(graph, best.partition.stage_of, captured.graph_module, dp=best.dp))


def _recapture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    captured: CapturedModel,
    options: PlanOptions,
    *,
    dp: int,
) -> tuple[CapturedModel, tuple[torch.Tensor, ...]]:
    """The graph and inputs at the real micro-batch of ``dp`` replicas.

    Boundary shapes and baked-in sizes must be those of the real micro-batch: a traced
    graph is shape-generic (propagate again); an exported one is specialised (recapture).
    """
    size = options.batch // (options.microbatches * dp)
    micro = microbatch_inputs(example_inputs, size)
    recaptured = capture(model, micro, method=captured.method) if captured.method == "export" else captured
    if graph_fingerprint(recaptured.graph_module) != graph_fingerprint(captured.graph_module):
        raise AutopartitionError(
            f"{type(model).__name__} captures to a different graph at micro-batch size "
            f"{size}; fix the data-parallel degree with --dp 1."
        )
    propagate_values(recaptured.graph_module, micro)
    return recaptured, micro


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


def _check_options(
    *, gpus: int, microbatches: int, schedule: str, batch: int, pp: int | None, dp: int | None
) -> ScheduleKind:
    """Raise on bad options; return the schedule as the solver's kind."""
    kind = next((k for k in SCHEDULES if k == schedule), None)  # narrows str to ScheduleKind
    if gpus < 1:
        raise AutopartitionError(f"--gpus must be at least 1, got {gpus}.")
    if microbatches < 1:
        raise AutopartitionError(f"--microbatches must be at least 1, got {microbatches}.")
    if kind is None:
        raise AutopartitionError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    if batch % microbatches:
        raise AutopartitionError(
            f"The batch of {batch} does not split into {microbatches} equal micro-batches; "
            f"choose a batch size that is a multiple of {microbatches} or another --microbatches."
        )
    for name, value in (("pp", pp), ("dp", dp)):
        if value is not None and (value < 1 or gpus % value):
            raise AutopartitionError(f"--{name} {value} must be a positive divisor of --gpus {gpus}.")
    if pp is not None and dp is not None and pp * dp != gpus:
        raise AutopartitionError(f"--pp {pp} x --dp {dp} = {pp * dp}, but --gpus is {gpus}.")
    return kind


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


def _search(
    graph: GraphCosts, options: PlanOptions, *, say: Status
) -> tuple[list[Candidate], list[_Solved]]:
    """Solve every allowed pp x dp shape: a report row for each, and the shapes that fit."""
    gpus, batch, microbatches = options.gpus, options.batch, options.microbatches
    candidates: list[Candidate] = []
    solved: list[_Solved] = []
    for d in sorted(k for k in range(1, gpus + 1) if gpus % k == 0):
        p = gpus // d
        if (options.pp is not None and p != options.pp) or (options.dp is not None and d != options.dp):
            continue
        if batch % (d * microbatches):
            candidates.append(Candidate(p, d, None, "skipped",
                                        f"batch {batch} does not split into {d} replicas x {microbatches} micro-batches"))
            continue
        if p > len(graph.blocks):
            candidates.append(Candidate(p, d, None, "skipped", f"only {len(graph.blocks)} blocks to place"))
            continue
        say(f"solving {p} stages x {d} replicas")
        problem = formulate(graph, dp=d, spec=options.spec, memory_limit=options.memory_limit,
                            optimizer_states=options.optimizer_states, bucket_cap_mb=options.bucket_cap_mb)
        found = solve(problem, stages=p, microbatches=microbatches, schedule=options.schedule,
                      time_limit=options.time_limit)
        if found is None:
            candidates.append(Candidate(p, d, None, "infeasible", "no split fits in memory"))
            continue
        candidates.append(Candidate(p, d, found.objective, found.status,
                                    f"{found.solver}, gap {100 * found.gap:.1f}%"))
        solved.append(_Solved(p, d, problem, found))
    if not candidates:
        raise AutopartitionError(
            f"No pp x dp shape fits --gpus {gpus} with the given --pp/--dp; check the numbers."
        )
    return candidates, solved


def _infeasible(graph: GraphCosts, options: PlanOptions, candidates: list[Candidate]) -> AutopartitionError:
    """Why nothing fits, and what would: more GPUs as stages, or how much memory."""
    gpus, microbatches, schedule = options.gpus, options.microbatches, options.schedule
    if not any(c.status == "infeasible" for c in candidates):
        reasons = "; ".join(f"{c.pp}x{c.dp}: {c.note}" for c in candidates)
        most = len(graph.blocks)
        return AutopartitionError(
            f"No pp x dp shape can be planned for {gpus} GPUs ({reasons}). The model can be split into at "
            f"most {most} pipeline stages here; use --pp {min(most, gpus)} or fewer (the rest of the GPUs "
            "become data-parallel replicas), and a batch size divisible by replicas x micro-batches."
        )
    unlimited = formulate(graph, dp=1, spec=options.spec, memory_limit=None, optimizer_states=options.optimizer_states)
    stages = min(gpus, len(graph.blocks))
    relaxed = solve(unlimited, stages=stages, microbatches=microbatches, schedule=schedule, use_ilp=False)
    need_memory = max(stage_memory(unlimited, relaxed.stage_of, stages, microbatches=microbatches,
                                   schedule=schedule)) if relaxed else float("nan")
    need_gpus = None
    bounded = dataclasses.replace(unlimited, memory_limit=options.memory_limit)
    for p in range(gpus + 1, len(graph.blocks) + 1):
        if solve(bounded, stages=p, microbatches=microbatches, schedule=schedule, use_ilp=False) is not None:
            need_gpus = p
            break
    more = (f"It would fit on {need_gpus} GPUs as pipeline stages" if need_gpus
            else f"Even {len(graph.blocks)} stages (the most this model splits into) do not fit")
    return InfeasibleError(
        f"No split of the model over {gpus} GPUs fits in {format_bytes(options.memory_limit or 0)} per GPU "
        f"(parameters, gradients, optimizer state and activations of the micro-batches in flight). "
        f"{more}; with {stages} stages each GPU would need about {format_bytes(need_memory)}. "
        "Add GPUs, raise --memory-per-gpu, use --schedule 1f1b (fewer micro-batches in flight), or shrink the batch."
    )


# ----------------------------------------------------------------- plan


def _build_plan(
    model: torch.nn.Module,
    captured: CapturedModel,
    micro: tuple[torch.Tensor, ...],
    graph: GraphCosts,
    solved: _Solved,
    options: PlanOptions,
    *,
    batch_divisor: int = 1,
) -> Plan:
    """The plan for one solved shape, less candidates and stage code: assemble, lower, predict.

    ``batch_divisor`` scales boundary shapes (drafts ranked before the chosen shape is recaptured).
    """
    stages = _stages(captured, graph, solved, options, batch_divisor=batch_divisor)
    partition, spec = solved.partition, options.spec
    assembled = Plan(
        format_version=FORMAT_VERSION,
        model=_model_info(model, captured, micro),
        gpus=options.gpus, pp=solved.pp, dp=solved.dp, microbatches=options.microbatches,
        schedule=options.schedule, batch_size=options.batch, device=options.device_name,
        stages=stages,
        actions=(),  # _lower
        tied=_tied(captured, stages),
        predicted=StepPrediction(0.0, 0.0, 0.0, ()),  # _predict
        solver=SolverInfo(partition.solver, partition.status, partition.objective, partition.lower_bound,
                          partition.wall_s, len(graph.blocks)),
        cost_model=CostModelInfo(
            source=("measured on " if options.measure else "predicted for ") + spec.name,
            link_bandwidth=spec.link_bandwidth, link_latency=spec.link_latency,
            memory_limit=options.memory_limit, optimizer_states=options.optimizer_states,
        ),
        candidates=(),  # compile: every shape's row, on the chosen plan
        bucket_cap_mb=options.bucket_cap_mb,
        stage_code=(),  # _stage_codes, for the chosen plan only
    )
    return _predict(_lower(assembled))


def _model_info(model: torch.nn.Module, captured: CapturedModel, micro: tuple[torch.Tensor, ...]) -> ModelInfo:
    return ModelInfo(
        class_name=type(model).__name__,
        fingerprint=graph_fingerprint(captured.graph_module),
        capture=captured.method,
        inputs=tuple(TensorSpec(name, tuple(x.shape), str(x.dtype).removeprefix("torch."))
                     for name, x in zip(captured.input_names, micro)),
        outputs=tuple(captured.output_nodes),
        parameters=sum(p.numel() for p in model.parameters()),
        parameter_bytes=sum(p.nbytes for p in model.parameters()),
    )


def _stages(
    captured: CapturedModel, graph: GraphCosts, solved: _Solved, options: PlanOptions, *, batch_divisor: int
) -> tuple[StagePlan, ...]:
    """Each stage's nodes, boundary tensors, ranks and predicted costs."""
    gm = captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    pp, dp, problem, partition = solved.pp, solved.dp, solved.problem, solved.partition
    stage_of_node = {name: partition.stage_of[b] for b, members in enumerate(graph.blocks) for name in members}
    compute_sets: list[set[str]] = [set() for _ in range(pp)]
    for name, s in stage_of_node.items():
        compute_sets[s].add(name)
    boundaries = _boundaries(gm, stage_of_node, pp, batch_divisor=batch_divisor)
    _, allreduce = stage_costs(problem, partition.stage_of, pp)
    memory = stage_memory(problem, partition.stage_of, pp, microbatches=options.microbatches,
                          schedule=options.schedule)
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
                backward_s=total - forward,
                memory_bytes=memory[s],
                parameter_bytes=sum(graph.parameter_bytes[captured.parameter_names[p]] for p in params),
                activation_bytes=sum(graph.node_saved_bytes.get(n, 0) for n in compute) / dp,
                send_bytes=sum(b.nbytes for b in outputs),
                allreduce_s=allreduce[s] + problem.allreduce_latency_s,
            ),
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
    """The step prediction, from a discrete-event simulation of the lowered plan."""
    sim = simulate(plan)
    return dataclasses.replace(plan, predicted=StepPrediction(
        step_s=sim.step_s,
        bubble_fraction=sim.bubble_fraction,
        samples_per_s=plan.batch_size / sim.step_s if sim.step_s > 0 else 0.0,
        peak_memory_bytes=tuple(float(m) for m in sim.peak_memory_bytes),
    ))


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
    gm: fx.GraphModule, stage_of: dict[str, int], pp: int, *, batch_divisor: int = 1
) -> tuple[Boundary, ...]:
    """Tensors produced in one stage and read in a later one, once per (producer, reader stage)."""
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
            if batch_divisor > 1 and shape and shape[0] % batch_divisor == 0:
                shape = (shape[0] // batch_divisor, *shape[1:])
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


