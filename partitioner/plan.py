"""Plan: the compiler's output as plain data, saved as JSON (never pickle).

A plan directory holds ``plan.json`` (this module's :class:`Plan`), one readable
``stage_K.py`` per stage (generated code, for people: nothing ever imports or
executes it) and the report.  :meth:`Plan.load` validates every field and the
format version; it only parses JSON.

Format versions: 2 (issue 8) added the training precision, the optimizer, GPUs
per node, per-stage recomputation and links, per-boundary links, the predicted
MFU and model FLOPs, and each candidate's micro-batch count and schedule.
Version 3 (issue 11) lets a pipeline rank hold several stages: ``chunks``
(stages per rank), each stage's pipeline ``rank``, action rows per pipeline
rank (each action names its stage), and each stage's weight-gradient seconds
``weight_s`` (the W part of a split backward).  Older plans still load
(:func:`upgrade`): version 1 is read as fp32, Adam (or SGD for one optimizer
state), one node of all its GPUs, no recomputation; versions 1 and 2 as one
stage per rank, stage s on rank s.  Fields added within version 2 (marked
``ADDED_IN_VERSION``: ``solver.refinement``, ``model.call``) may be absent from
a version-2 plan and take their defaults; so may those added within version 3
(among them a stage's ``shard`` and its selective recomputation's
``recompute_layers`` and ``recompute_ops_layers``, read as 0: a stage recomputes
all its layers or none).

Example::

    >>> import tempfile
    >>> plan = Plan.load(Plan.save(example_plan(), tempfile.mkdtemp()))
    >>> plan == example_plan()
    True
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

from partitioner.cost.precision import shard_degree, spans_nodes
from partitioner.defaults import DEFAULT_BUCKET_CAP_MB, MAX_ACTION_JITTER, SHARD_SPANS
from partitioner.errors import PlanFormatError
from partitioner.graph.experts import ExpertLayer
from partitioner.graph.ir import tensor_nbytes
from partitioner.layout import Layout
from partitioner.orders import Schedule
from partitioner.solve.blockgraph import BlockGraph
from partitioner.solve.problem import relative_gap

__all__ = [
    "FORMAT_VERSION",
    "STAGE_SHARD",
    "Boundary",
    "Candidate",
    "CostModelInfo",
    "ModelInfo",
    "Plan",
    "Refinement",
    "SolverInfo",
    "StagePlan",
    "StagePrediction",
    "StepPrediction",
    "TensorSpec",
    "TiedParameter",
    "example_plan",
    "legacy_spans",
    "stage_topology",
    "upgrade",
    "upgrade_v1",
]

FORMAT_VERSION = 3
LINKS = ("intra", "inter")  # a message or all-reduce inside one node, or between nodes
# Field metadata: a field added within the current format version, which a plan saved before it
# may lack (it loads with the field's default).
ADDED_IN_VERSION = "added_in_version"
# Keep activations; recompute the forward of the stage's first ``recompute_layers`` layers in backward (Megatron-LM's
# --recompute-method block --recompute-num-layers), keeping the others'; or recompute every layer's.
STAGE_RECOMPUTE = ("none", "selective", "full")
# How a stage group's replicas hold their state (ZeRO, Rajbhandari et al., SC 2020): "none" whole on every replica
# (DDP); "optimizer" optimizer state sharded (gradients reduce-scattered, parameters all-gathered after the step);
# "full" parameters, gradients and optimizer state sharded (FSDP2 fully_shard).
STAGE_SHARD = ("none", "optimizer", "full")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Boundary:
    """A tensor crossing a stage boundary: produced by ``producer`` in stage ``source``, read in ``target``."""

    producer: str
    shape: tuple[int, ...]
    dtype: str
    source: int
    target: int
    link: str = "intra"  # "inter" when some replica's pair of ranks sits on two nodes

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class StagePrediction:
    """Cost-model numbers for one stage, per micro-batch unless noted."""

    forward_s: float
    backward_s: float
    memory_bytes: float  # peak, for the whole step
    parameter_bytes: int
    activation_bytes: float  # saved per micro-batch
    send_bytes: int  # forward activations sent per micro-batch (at the plan's precision)
    allreduce_s: float  # once per step, on the stage's all-reduce link, latency included
    recompute_s: float = 0.0  # recomputation forward, part of backward_s (recomputing stages)
    recompute_peak_bytes: float = 0.0  # one block's activations, live again during each backward
    weight_s: float = 0.0  # the weight-gradient (W) share of backward_s, for schedules that split it
    # Tensor-parallel collectives inside forward_s + backward_s (plan.tp > 1; partitioner.cost.tensorparallel).
    tp_comm_s: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})
    # shard "full" with reshard_after_forward (ZeRO-3): its gathered FSDP2 units' bytes, part of memory_bytes.
    gathered_bytes: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})
    # FLOPs one GPU of the stage runs per micro-batch (forward + backward, recomputation left out), and those
    # FLOPs at the peak of each op's dtype: the stage's compute bound (partitioner.schedule.bounds).
    flops: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})
    peak_s: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})
    # Of parameter_bytes, the experts' (whole, every expert): each GPU holds 1 / plan.ep of them (graph/experts.py).
    expert_parameter_bytes: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})
    # Of its parameters' elements, those a fully sharded stage gathers as their FP8 casts, 1 byte each (tensorwise
    # fp8 without tensor parallelism: GraphCosts.fp8_gathered): kept gathered, held so (part of memory_bytes).
    fp8_gathered_elements: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})


@dataclasses.dataclass(frozen=True)
class StagePlan:
    index: int
    ranks: tuple[int, ...]  # each replica's tensor-parallel group (Layout.stage_groups: rank x dp + replica)
    nodes: tuple[str, ...]  # everything the stage computes, graph order
    compute_nodes: int
    parameters: tuple[str, ...]  # graph (original model) names
    model_inputs: tuple[str, ...]
    inputs: tuple[Boundary, ...]  # received
    outputs: tuple[Boundary, ...]  # sent
    modules: tuple[str, ...]  # first and last module path of its compute nodes
    predicted: StagePrediction
    recompute: str = "none"  # "full": activations dropped after forward, remade in backward; "selective": some layers'
    allreduce_link: str = "intra"  # the link its replicas' gradient all-reduce crosses
    rank: int = 0  # the pipeline rank (0 .. pp - 1) holding this stage; several with chunks > 1
    shard: str = dataclasses.field(default="none", metadata={ADDED_IN_VERSION: 3})  # one of STAGE_SHARD
    # shard "full" only: ZeRO-3 (one FSDP2 unit per layer, freed after each forward and backward, gradients
    # reduce-scattered after every micro-batch's backward) rather than the stage kept gathered from the first
    # forward to the last backward with its gradients accumulated whole (runtime/parallel/shard.py).
    reshard_after_forward: bool = dataclasses.field(default=False, metadata={ADDED_IN_VERSION: 3})
    # recompute "selective" only: how many of the stage's layer runs (its first ones, as runtime/execute/recompute.py cuts the
    # stage graph: a layer's ops, or root-level code such as a mask the stage computes) recompute; the others keep
    # their activations. 0 otherwise.
    recompute_layers: int = dataclasses.field(default=0, metadata={ADDED_IN_VERSION: 3})
    # recompute "selective" only: how many layer runs after those (the next ones) recompute only their cheap ops,
    # keeping the outputs of their matrix multiplications and attention (per-op selective checkpointing,
    # torch.utils.checkpoint.create_selective_checkpoint_contexts); the rest keep all their activations. 0 otherwise.
    recompute_ops_layers: int = dataclasses.field(default=0, metadata={ADDED_IN_VERSION: 3})
    # shard "full" only: over which replicas the state is sharded (partitioner.defaults.SHARD_SPANS): "world", every
    # replica of the group; "node", the group's replicas on one node, the nodes replicas of each other (HSDP).
    # "" in plans written before it: read as those plans were priced (legacy_span).
    shard_span: str = dataclasses.field(default="", metadata={ADDED_IN_VERSION: 3})


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    step_s: float
    bubble_fraction: float
    samples_per_s: float
    peak_memory_bytes: tuple[float, ...]  # per stage (every replica the same)
    # Forward + backward FLOPs of one mini-batch, recomputation and loss excluded; None: not known.
    model_flops: float | None = None
    mfu: float | None = None  # model_flops / (gpus x cost_model.peak_flops x step_s), at most 1


@dataclasses.dataclass(frozen=True)
class Refinement:
    """The simulation-guided refinement of the solver's split (:mod:`partitioner.schedule.refine`).

    ``before_s``: the simulated step of the solver's split; ``after_s``: of the
    split kept (never more); ``moves``: boundary moves accepted.
    """

    before_s: float
    after_s: float
    moves: int
    simulations: int
    wall_s: float

    @property
    def gain(self) -> float:
        """Share of the solver's simulated step the refinement saved."""
        return 1 - self.after_s / self.before_s if self.before_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class SolverInfo:
    name: str
    status: str
    objective: float
    lower_bound: float
    wall_s: float
    blocks: int
    refinement: Refinement | None = dataclasses.field(default=None, metadata={ADDED_IN_VERSION: 2})

    @property
    def gap(self) -> float:
        """Share the objective may lie above the optimum (:func:`partitioner.solve.problem.relative_gap`)."""
        return relative_gap(self.objective, self.lower_bound)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One pp x dp x micro-batches x schedule combination the planner considered, and its fate.

    ``status``: ``optimal`` / ``feasible`` (solved; the solver's status),
    ``infeasible`` (does not fit), ``pruned`` (a lower bound on its step already
    loses), ``skipped`` (cannot be planned).  ``note`` says why it lost (or
    ``chosen``).
    """

    pp: int
    dp: int
    step_s: float | None  # closed-form objective; None: not solved (see status)
    status: str
    note: str
    simulated_s: float | None = None  # discrete-event simulation of the best candidates
    microbatches: int | None = None  # None: not recorded (format version 1)
    schedule: str | None = None
    recomputed_stages: int | None = None  # stages that recompute in its split
    memory_bytes: float | None = None  # peak per GPU of its split; for "infeasible", what it would need
    bubble_fraction: float | None = None  # simulated where simulated, else closed form
    chunks: int | None = None  # stages per pipeline rank (interleaved-1f1b, zbv); None: one
    # How its stage groups' replicas hold their state (one of STAGE_SHARD; with --shard auto, a stage group that
    # fits whole stays "none"); None: not recorded (older plans).
    shard: str | None = dataclasses.field(default=None, metadata={ADDED_IN_VERSION: 3})
    ep: int = dataclasses.field(default=1, metadata={ADDED_IN_VERSION: 3})  # expert-parallel degree it was priced at


@dataclasses.dataclass(frozen=True)
class TiedParameter:
    name: str  # canonical (first) name
    aliases: tuple[str, ...]  # every graph name of the same tensor
    stages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    class_name: str
    fingerprint: str
    capture: str
    inputs: tuple[TensorSpec, ...]  # one micro-batch, as captured
    outputs: tuple[str, ...]
    parameters: int
    parameter_bytes: int
    # How the flat inputs become the model's call (capture.CallSpec as JSON): keywords, baked
    # constants.  "": a plain tuple of positional tensors.
    call: str = dataclasses.field(default="", metadata={ADDED_IN_VERSION: 2})
    # The model file it was planned from (resolved path, ":FACTORY" if one was named); "": planned from Python.
    source: str = dataclasses.field(default="", metadata={ADDED_IN_VERSION: 3})


@dataclasses.dataclass(frozen=True)
class CostModelInfo:
    """What the simulator needs to replay the plan."""

    source: str  # "measured on cpu" or "predicted for h100"
    link_bandwidth: float
    link_latency: float
    memory_limit: float | None
    optimizer_states: int
    inter_node_bandwidth: float | None = None  # bytes/s per GPU between nodes; None: link_bandwidth
    inter_node_latency: float | None = None  # seconds per message between nodes; None: link_latency
    # FLOP/s of one GPU for the MFU: the peaks the model's FLOPs run at, never below what a node was
    # timed at (partitioner.search.assemble.mfu_peak_flops)
    peak_flops: float | None = None
    message_host_s: float = 0.0  # seconds of a rank's own time per message sent or received
    # A calibration from a traced run (partitioner.cost.calibration): node times x scale, + action_host_s per action.
    calibration_scale: float = dataclasses.field(default=1.0, metadata={ADDED_IN_VERSION: 3})
    action_host_s: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})
    # and each compute action's spread about its time (the simulator's jitter; 0: every action as predicted).
    action_jitter: float = dataclasses.field(default=0.0, metadata={ADDED_IN_VERSION: 3})
    # The predicted device's share of its peaks per op class, and the published runs that share was fitted to
    # (partitioner.cost.devices; () : none calibrates it, the bare roofline where efficiency is empty too).
    efficiency: tuple[tuple[str, float], ...] = dataclasses.field(default=(), metadata={ADDED_IN_VERSION: 3})
    calibrated_by: tuple[str, ...] = dataclasses.field(default=(), metadata={ADDED_IN_VERSION: 3})


# Parsed schedules by their actions table (Plan.schedule_data), and a schedule's actions table by the schedule
# (Plan.with_schedule); each entry holds both, so their ids stay their own while kept.
_SCHEDULES: dict[tuple[int, str, int], tuple[Any, Schedule]] = {}
_STRINGS: dict[tuple[int, str, int], tuple[Any, Schedule]] = {}
_KEPT = 8


def _remember(actions: Any, schedule: Schedule) -> tuple[Any, Schedule]:
    """Keep ``schedule`` as the parse of ``actions`` (the oldest entries beyond :data:`_KEPT` dropped)."""
    for table in (_SCHEDULES, _STRINGS):
        while len(table) >= _KEPT:
            table.pop(next(iter(table)))
    found = _SCHEDULES[(id(actions), schedule.kind, schedule.microbatches)] = (actions, schedule)
    return found


@dataclasses.dataclass(frozen=True)
class Plan:
    format_version: int
    model: ModelInfo
    gpus: int
    pp: int  # pipeline ranks per replica (stages = pp x chunks)
    dp: int
    microbatches: int
    schedule: str
    batch_size: int
    device: str
    stages: tuple[StagePlan, ...]
    actions: tuple[tuple[str, ...], ...]  # per pipeline rank, lowered schedule
    tied: tuple[TiedParameter, ...]
    predicted: StepPrediction
    solver: SolverInfo
    cost_model: CostModelInfo
    candidates: tuple[Candidate, ...]
    bucket_cap_mb: float  # DDP gradient bucket size inside each stage group
    stage_code: tuple[str, ...]  # readable generated code per stage; never executed
    # From the planner, in memory only (never in plan.json): save() draws it as graph.png, blocks.graphml.
    block_graph: BlockGraph | None = dataclasses.field(default=None, compare=False, repr=False)
    precision: str = "fp32"  # partitioner.cost.precision.PRECISIONS
    optimizer: str = "adam"  # partitioner.cost.precision.OPTIMIZERS; its states: cost_model.optimizer_states
    gpus_per_node: int | None = None  # node of rank r: r // gpus_per_node; None: one node
    # GPUs per host where the NVLink domain spans several hosts (GB200 NVL72: 4 per host, gpus_per_node 72);
    # None: a host is an NVLink domain (gpus_per_node).  Where torchrun starts processes; links follow gpus_per_node.
    gpus_per_host: int | None = dataclasses.field(default=None, metadata={ADDED_IN_VERSION: 3})
    chunks: int = 1  # stages per pipeline rank (interleaved-1f1b: v; zbv: 2)
    # GPUs per tensor-parallel group (gpus = pp x dp x tp); with tp > 1 each entry of a stage's ``ranks`` is a
    # group: global ranks ``g x tp .. g x tp + tp - 1``, inside one node (runtime.parallel.tensorparallel).
    tp: int = dataclasses.field(default=1, metadata={ADDED_IN_VERSION: 3})
    # Expert parallelism (issue 32): each stage group's ``dp`` replicas form groups of ``ep`` consecutive
    # replicas (``ranks[g*ep:(g+1)*ep]``); each member holds ``experts/ep`` of every layer in ``experts`` and
    # tokens travel to their expert's member and back. Expert gradients reduce over ``ranks[j::ep]``.
    ep: int = dataclasses.field(default=1, metadata={ADDED_IN_VERSION: 3})
    experts: tuple[ExpertLayer, ...] = dataclasses.field(default=(), metadata={ADDED_IN_VERSION: 3})
    # FP8 scaling under precision "fp8" (partitioner.cost.precision.FP8_RECIPES; issue 33)
    fp8_recipe: str = dataclasses.field(default="tensorwise", metadata={ADDED_IN_VERSION: 3})

    @property
    def group_gpus_per_node(self) -> int | None:
        """Tensor-parallel groups per node (``gpus_per_node`` when tp = 1): what stage ranks are laid out on."""
        return None if self.gpus_per_node is None else max(1, self.gpus_per_node // self.tp)

    def shard_degree(self, stage: StagePlan) -> int:
        """Into how many shards ``stage``'s replica group splits its state (``StagePlan.shard``, ``shard_span``).

        >>> plan = example_plan()
        >>> plan.shard_degree(plan.stages[0])
        1
        """
        return shard_degree(stage.shard, self.dp, self.group_gpus_per_node, span=stage.shard_span or "world")

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // (self.dp * self.microbatches)

    @property
    def layout(self) -> Layout:
        """Every degree of the plan as one :class:`~partitioner.layout.Layout`: the only source of rank groups.

        >>> example_plan().layout.ranks("pp", at=0)
        (0, 1)
        """
        return Layout(pp=self.pp, dp=self.dp, tp=self.tp, ep=self.ep, chunks=self.chunks)

    def rank_layout(self) -> dict[int, tuple[int, int]]:
        """Global rank -> (pipeline rank, replica).  Rank-major: a pipeline rank's replicas are consecutive.

        With one stage per rank (``chunks == 1``) the pipeline rank is the stage index.  With
        ``tp > 1`` the ``tp`` ranks of each group share its position (:class:`~partitioner.layout.Layout`).
        """
        layout = self.layout
        return {rank: (layout.coord(rank, "pp"), layout.coord(rank, "dp")) for rank in range(layout.world)}

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``rank`` holds, ascending.

        >>> example_plan().stages_of(1)
        (1,)
        """
        return tuple(s.index for s in self.stages if s.rank == rank)

    def stage_ranks(self) -> tuple[int, ...]:
        """Pipeline rank of every stage, by stage index."""
        return tuple(s.rank for s in self.stages)

    def schedule_data(self) -> Schedule:
        # Parsed once per actions table: the planner simulates copies of a plan (dataclasses.replace) that share it.
        found = _SCHEDULES.get((id(self.actions), self.schedule, self.microbatches))
        if found is not None and found[0] is self.actions:
            return found[1]
        return _remember(self.actions, Schedule.from_strings(self.schedule, self.microbatches, self.actions))[1]

    def with_schedule(self, schedule: Schedule) -> Plan:
        """The plan running ``schedule`` (its actions as strings), whose :meth:`schedule_data` is ``schedule``
        itself, not parsed again (the planner lowers a schedule and simulates it at once)."""
        if (schedule.kind, schedule.microbatches) != (self.schedule, self.microbatches):
            return dataclasses.replace(self, actions=tuple(tuple(str(a) for a in row) for row in schedule.actions))
        key = (id(schedule), schedule.kind, schedule.microbatches)
        found = _STRINGS.get(key)
        if found is None or found[1] is not schedule:
            found = _remember(tuple(tuple(str(a) for a in row) for row in schedule.actions), schedule)
            _STRINGS[key] = found
        return dataclasses.replace(self, actions=found[0])

    def sends_to(self) -> tuple[tuple[int, ...], ...]:
        return stage_topology(self.stages)[0]

    def receives_from(self) -> tuple[tuple[int, ...], ...]:
        return stage_topology(self.stages)[1]

    # ------------------------------------------------------------------ I/O

    def to_json(self) -> str:
        data = dataclasses.asdict(dataclasses.replace(self, block_graph=None))
        del data["block_graph"]
        return json.dumps(data, indent=1)

    @staticmethod
    def from_json(text: str, *, origin: str = "plan.json") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(
                f"{origin} is not valid JSON ({exc}). The plan is corrupt: make it again with "
                "`autopartition model.py --gpus N --out DIR`."
            ) from exc
        if not isinstance(data, dict) or "format_version" not in data:
            raise PlanFormatError(f"{origin} has no format_version: it is not an autopartition plan.")
        version = data["format_version"]
        if isinstance(version, bool) or version not in (1, 2, FORMAT_VERSION):
            raise PlanFormatError(
                f"{origin} has format version {version!r}; this autopartition reads version "
                f"{FORMAT_VERSION} (and versions 1 and 2). Re-plan the model with this version."
            )
        try:
            # The current version has every field; a version-1 plan takes the defaults of those it lacks.
            plan: Plan = legacy_spans(_decode(Plan, upgrade(data), "plan", strict=version != 1))
            _check_names(plan)
            return plan
        except (TypeError, ValueError, KeyError) as exc:
            raise PlanFormatError(
                f"{origin} is corrupt: {exc}. Make the plan again with `autopartition model.py`."
            ) from exc

    def save(self, directory: str | Path) -> Path:
        """Write ``plan.json`` and ``stage_K.py`` (and ``blocks.graphml``, if any) into ``directory``.

        The pictures (``graph.png`` among them) are the report's: :func:`partitioner.report.markdown.write_report`.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / "plan.json").write_text(self.to_json() + "\n")
        for stale in path.glob("stage_*.py"):  # from an earlier plan with more stages
            stale.unlink()
        for index, code in enumerate(self.stage_code):
            (path / f"stage_{index}.py").write_text(code)
        if self.block_graph is not None:
            self.block_graph.write_graphml(path)
        return path

    @staticmethod
    def load(directory: str | Path) -> Plan:
        path = Path(directory)
        file = path / "plan.json" if path.is_dir() else path
        if not file.exists():
            raise PlanFormatError(
                f"No plan at {file}. Make one with `autopartition model.py --gpus N --out {path}`."
            )
        return Plan.from_json(file.read_text(), origin=str(file))


def stage_topology(
    stages: Sequence[StagePlan],
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(sends_to, receives_from) per stage, from the stages' boundary tensors.

    The schedule is lowered from this before a :class:`Plan` exists, and read back
    from the saved plan by the simulator and the runtime: one definition for both.

    >>> stage_topology(example_plan().stages)
    (((1,), ()), ((), (0,)))
    """
    sends_to = tuple(tuple(sorted({b.target for b in s.outputs})) for s in stages)
    receives_from = tuple(tuple(sorted({b.source for b in s.inputs})) for s in stages)
    return sends_to, receives_from


# ---------------------------------------------------------------- decoding


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A plan's JSON object of any readable version in the current layout.

    Versions 1 and 2 held one stage per pipeline rank: stage s on rank s, one
    chunk, no split backward.

    >>> old = json.loads(example_plan().to_json())
    >>> old["format_version"] = 2
    >>> del old["chunks"]
    >>> for st in old["stages"]:
    ...     del st["rank"], st["predicted"]["weight_s"]
    >>> new = upgrade(old)
    >>> new["format_version"], new["chunks"], [st["rank"] for st in new["stages"]]
    (3, 1, [0, 1])
    """
    version = data.get("format_version")
    if version == FORMAT_VERSION:
        return data
    out = upgrade_v1(data) if version == 1 else dict(data)
    out["format_version"] = FORMAT_VERSION
    out.setdefault("chunks", 1)
    stages = out.get("stages")
    if isinstance(stages, list):
        upgraded = []
        for st in stages:
            if isinstance(st, dict):
                st = dict(st)
                st.setdefault("rank", st.get("index"))
                if isinstance(st.get("predicted"), dict):
                    st["predicted"] = dict(st["predicted"])
                    st["predicted"].setdefault("weight_s", 0.0)
            upgraded.append(st)
        out["stages"] = upgraded
    return out


def legacy_spans(plan: Plan) -> Plan:
    """``plan`` with every stage's ``shard_span`` set: a plan written before spans sharded as it was priced then.

    Fully sharded groups at tp = 1 sharded inside a node where they spanned whole nodes (HSDP); at tp > 1,
    over every replica.  Stages that shard nothing read ``"world"`` (the span means nothing there).

    >>> legacy_spans(example_plan()).stages[0].shard_span
    'world'
    """
    if all(st.shard_span for st in plan.stages):
        return plan
    span = "node" if plan.tp == 1 and spans_nodes(plan.dp, plan.gpus_per_node) else "world"
    return dataclasses.replace(plan, stages=tuple(
        st if st.shard_span else dataclasses.replace(st, shard_span=span if st.shard == "full" else "world")
        for st in plan.stages))


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A format-version-1 plan's JSON object in the current layout, with the defaults it implies.

    Version 1 planned fp32 training on one node without recomputation; its
    optimizer is named by its state count (1: SGD, else Adam).  The predicted
    MFU and model FLOPs were not recorded (None).  Fields version 1 lacks keep
    their defaults; anything malformed is left for decoding to report.

    >>> old = json.loads(example_plan().to_json())
    >>> old["format_version"] = 1
    >>> del old["precision"], old["optimizer"], old["gpus_per_node"]
    >>> new = upgrade_v1(old)
    >>> new["format_version"], new["precision"], new["optimizer"], new["gpus_per_node"]
    (2, 'fp32', 'adam', 2)
    """
    out = dict(data, format_version=2)
    cost_model = data.get("cost_model")
    states = cost_model.get("optimizer_states") if isinstance(cost_model, dict) else None
    out.setdefault("precision", "fp32")
    out.setdefault("optimizer", "sgd" if states == 1 else "adam")
    out.setdefault("gpus_per_node", data.get("gpus"))
    candidates = data.get("candidates")
    if isinstance(candidates, list):
        out["candidates"] = [
            dict({"microbatches": data.get("microbatches"), "schedule": data.get("schedule")}, **c)
            if isinstance(c, dict) else c for c in candidates
        ]
    return out


def _check_names(plan: Plan) -> None:
    """Fields that hold one of a few names: a misspelt one is a corrupt plan."""
    from partitioner.cost.precision import FP8_RECIPES, OPTIMIZERS, PRECISIONS

    checks: list[tuple[str, str, Sequence[str]]] = [
        ("plan.precision", plan.precision, PRECISIONS),
        ("plan.fp8_recipe", plan.fp8_recipe, FP8_RECIPES),
        ("plan.optimizer", plan.optimizer, tuple(OPTIMIZERS)),
    ]
    for st in plan.stages:
        where = f"plan.stages[{st.index}]"
        checks += [(f"{where}.shard", st.shard, STAGE_SHARD),
                   (f"{where}.recompute", st.recompute, STAGE_RECOMPUTE),
                   (f"{where}.allreduce_link", st.allreduce_link, LINKS)]
        checks += [(f"{where}.boundary {b.producer}.link", b.link, LINKS) for b in (*st.inputs, *st.outputs)]
    for where, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"{where} is {value!r}, expected one of {', '.join(allowed)}")
    for st in plan.stages:
        selective = st.recompute == "selective"
        counts = st.recompute_layers + st.recompute_ops_layers
        if selective != (counts > 0) or st.recompute_layers < 0 or st.recompute_ops_layers < 0:
            raise ValueError(f"plan.stages[{st.index}].recompute_layers is {st.recompute_layers} and "
                             f"recompute_ops_layers {st.recompute_ops_layers} with recompute {st.recompute!r}: "
                             "counts of at least 1 in all go with (and only with) 'selective'")
        if st.reshard_after_forward and st.shard != "full":
            raise ValueError(f"plan.stages[{st.index}].reshard_after_forward is true, but its shard is "
                             f"{st.shard!r}: only a fully sharded stage reshards")
        if st.shard_span not in SHARD_SPANS:
            raise ValueError(f"plan.stages[{st.index}].shard_span is {st.shard_span!r}, expected one of "
                             f"{', '.join(SHARD_SPANS)}")
    if plan.gpus_per_node is not None and plan.gpus_per_node < 1:
        raise ValueError(f"plan.gpus_per_node is {plan.gpus_per_node}, expected at least 1")
    jitter = plan.cost_model.action_jitter
    if not 0 <= jitter <= MAX_ACTION_JITTER:  # the simulator draws exp(jitter x N(0, 1)) per action
        raise ValueError(f"plan.cost_model.action_jitter is {jitter!r}, expected 0 .. {MAX_ACTION_JITTER}")
    _check_layout(plan)


def _check_layout(plan: Plan) -> None:
    """Stages, ranks and action rows agree: pp x chunks stages, chunks per pipeline rank."""
    if plan.chunks < 1 or plan.pp < 1 or plan.dp < 1:
        raise ValueError(f"plan has pp={plan.pp}, dp={plan.dp}, chunks={plan.chunks}; each must be at least 1")
    if plan.tp < 1 or (plan.tp > 1 and plan.gpus_per_node is not None and plan.gpus_per_node % plan.tp):
        raise ValueError(f"plan.tp is {plan.tp}, expected a divisor of gpus_per_node ({plan.gpus_per_node})")
    if plan.gpus != plan.pp * plan.dp * plan.tp:
        shape = f"pp x dp = {plan.pp} x {plan.dp}" if plan.tp == 1 else \
            f"pp x dp x tp = {plan.pp} x {plan.dp} x {plan.tp}"
        raise ValueError(f"plan.gpus is {plan.gpus}, expected {shape} = {plan.pp * plan.dp * plan.tp}")
    if plan.gpus_per_host is not None and (plan.gpus_per_host < 1 or (plan.gpus_per_node or plan.gpus) % plan.gpus_per_host):
        raise ValueError(f"plan.gpus_per_host is {plan.gpus_per_host}; it must divide gpus_per_node ({plan.gpus_per_node})")
    if plan.gpus_per_node is not None and plan.gpus % plan.gpus_per_node:
        raise ValueError(f"plan.gpus_per_node is {plan.gpus_per_node}, which does not divide plan.gpus ({plan.gpus})")
    if len(plan.stages) != plan.pp * plan.chunks:
        raise ValueError(f"plan has {len(plan.stages)} stages, expected pp x chunks = {plan.pp} x {plan.chunks}")
    if len(plan.actions) != plan.pp:
        raise ValueError(f"plan has {len(plan.actions)} action rows, expected one per pipeline rank ({plan.pp})")
    for st in plan.stages:
        if not 0 <= st.rank < plan.pp:
            raise ValueError(f"plan.stages[{st.index}].rank is {st.rank}, expected 0 .. {plan.pp - 1}")
        if st.ranks != Layout(pp=plan.pp, dp=plan.dp).stage_groups(st.rank):
            raise ValueError(f"plan.stages[{st.index}].ranks is {list(st.ranks)}, expected rank x dp + replica")
    for rank in range(plan.pp):
        if len(plan.stages_of(rank)) != plan.chunks:
            raise ValueError(f"pipeline rank {rank} holds stages {list(plan.stages_of(rank))}, expected {plan.chunks}")
    _check_batch(plan)
    _check_boundaries(plan)
    _check_actions(plan)


# Why a size edited in plan.json cannot work: every shape, cost and action was made for the sizes the
# planner chose (a rank would receive a tensor of another size than it allocated and abort in gloo/NCCL).
_REPLAN = "plan.json's sizes cannot be edited: plan again for other sizes"


def _check_batch(plan: Plan) -> None:
    """Batch size, micro-batches and the recorded micro-batch shapes agree (each a positive whole number)."""
    from partitioner.defaults import SCHEDULES, schedule_chunks

    if plan.schedule not in SCHEDULES:
        raise ValueError(f"plan.schedule is {plan.schedule!r}, expected one of {', '.join(SCHEDULES)}")
    if plan.chunks != schedule_chunks(plan.schedule) and plan.schedule != "interleaved-1f1b":
        raise ValueError(f"plan.chunks is {plan.chunks}, but {plan.schedule} holds "
                         f"{schedule_chunks(plan.schedule)} stage(s) per pipeline rank")
    for field in ("batch_size", "microbatches"):
        if getattr(plan, field) < 1:
            raise ValueError(f"plan.{field} is {getattr(plan, field)}, expected a whole number of at least 1")
    share = plan.dp * plan.microbatches
    if plan.batch_size % share:
        raise ValueError(
            f"plan.batch_size is {plan.batch_size}, not a multiple of dp x microbatches = {plan.dp} x "
            f"{plan.microbatches} = {share} ({_REPLAN}, with --batch-size)")
    size = plan.batch_size // share
    for i, spec in enumerate(plan.model.inputs):
        where = f"plan.model.inputs[{i}] ({spec.name})"
        _check_tensor(where, spec.shape, spec.dtype)
        if spec.shape and spec.shape[0] != size:  # every input has the batch in dimension 0 (planner)
            raise ValueError(
                f"{where} holds micro-batches of {spec.shape[0]} samples, but batch_size / (dp x microbatches) = "
                f"{plan.batch_size} / ({plan.dp} x {plan.microbatches}) = {size}: batch_size, dp or microbatches "
                f"was edited after planning ({_REPLAN}, with --batch-size, --microbatches, --pp/--dp)")


def _check_tensor(where: str, shape: tuple[int, ...], dtype: str) -> None:
    if any(d < 0 for d in shape):
        raise ValueError(f"{where} has shape {list(shape)}; sizes cannot be negative")
    tensor_nbytes(shape, dtype)  # ValueError for a dtype torch does not have


def _check_boundaries(plan: Plan) -> None:
    """Each boundary is listed by both its stages, with one shape and dtype, from an earlier stage to a later."""
    n = len(plan.stages)
    for i, st in enumerate(plan.stages):
        if st.index != i:
            raise ValueError(f"plan.stages[{i}].index is {st.index}, expected {i} (stages in order)")
    sent: dict[tuple[str, int], Boundary] = {}
    for st in plan.stages:
        for b in st.outputs:
            where = f"plan.stages[{st.index}].outputs ({b.producer})"
            _check_tensor(where, b.shape, b.dtype)
            if b.source != st.index or not st.index < b.target < n:
                raise ValueError(f"{where} goes {b.source} -> {b.target}, expected {st.index} -> a later stage < {n}")
            sent[b.producer, b.target] = b
    received = {(b.producer, b.target): b for st in plan.stages for b in st.inputs}
    for key in sent.keys() | received.keys():
        out, into = sent.get(key), received.get(key)
        if out is None or into is None or (out.shape, out.dtype, out.source) != (into.shape, into.dtype, into.source):
            raise ValueError(
                f"boundary {key[0]} into stage {key[1]} is {_described(out)} where sent but {_described(into)} "
                "where received; the stages must agree")
    for t in plan.tied:
        if any(not 0 <= s < n for s in t.stages):
            raise ValueError(f"plan.tied ({t.name}) names stages {list(t.stages)}; the plan has {n}")
    _check_experts(plan)


def _check_experts(plan: Plan) -> None:
    """``ep`` divides the replicas and every layer's experts; layouts are known."""
    from partitioner.graph.experts import EXPERT_LAYOUTS

    if plan.ep < 1 or plan.dp % plan.ep:
        raise ValueError(f"plan.ep is {plan.ep}; it must divide plan.dp ({plan.dp})")
    if plan.ep > 1 and not plan.experts:
        raise ValueError(f"plan.ep is {plan.ep} but plan.experts lists no experts layer")
    for layer in plan.experts:
        if layer.layout not in EXPERT_LAYOUTS:
            raise ValueError(f"plan.experts ({layer.module}) has layout {layer.layout!r}, expected one of "
                             f"{list(EXPERT_LAYOUTS)}")
        if layer.experts % plan.ep:
            raise ValueError(f"plan.experts ({layer.module}) has {layer.experts} experts; ep {plan.ep} must divide them")


def _described(b: Boundary | None) -> str:
    return "missing" if b is None else f"{list(b.shape)} {b.dtype} from stage {b.source}"


def _check_actions(plan: Plan) -> None:
    """Every action parses and names a stage of its row's rank and one of the plan's micro-batches.

    Completeness and order are the runtime's full check (:func:`partitioner.schedule.lower.validate`);
    this catches an edited micro-batch count or a mistyped action before any rank starts.
    """
    from partitioner.errors import ScheduleError
    from partitioner.orders import Action

    forwards: dict[int, set[int]] = {st.index: set() for st in plan.stages}
    for rank, row in enumerate(plan.actions):
        for text in row:
            try:
                action = Action.parse(text)
            except ScheduleError as exc:
                raise ValueError(f"plan.actions[{rank}]: {exc}") from None
            if action.stage not in forwards or plan.stages[action.stage].rank != rank:
                raise ValueError(f"plan.actions[{rank}] holds {text}, but stage {action.stage} is not on "
                                 f"pipeline rank {rank}")
            if not 0 <= action.microbatch < plan.microbatches:
                raise ValueError(
                    f"plan.actions[{rank}] holds {text}, for micro-batch {action.microbatch}, but plan.microbatches "
                    f"is {plan.microbatches} ({_REPLAN}, with --microbatches)")
            if action.kind == "F":
                forwards[action.stage].add(action.microbatch)
    for stage, seen in forwards.items():
        if len(seen) != plan.microbatches:
            raise ValueError(
                f"stage {stage} runs the forward of {len(seen)} micro-batches, but plan.microbatches is "
                f"{plan.microbatches} ({_REPLAN}, with --microbatches)")


def _decode(kind: Any, value: Any, where: str, *, strict: bool = False) -> Any:
    """``value`` (parsed JSON) as ``kind``; ``strict``: every dataclass field must be present.

    Fields that are not in plan.json at all (``Plan.block_graph``) are never required.
    """
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise TypeError(f"{where} should be an object, got {type(value).__name__}")
        hints = typing.get_type_hints(kind)
        fields = {f.name for f in dataclasses.fields(kind) if f.compare}
        unknown = set(value) - fields
        if unknown:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)}")
        optional = {  # strict: only fields added within this version may be missing
            f.name for f in dataclasses.fields(kind) if f.default is not dataclasses.MISSING
            and (not strict or ADDED_IN_VERSION in f.metadata)}
        missing = fields - set(value) - optional
        if missing:
            raise KeyError(f"{where} lacks fields {sorted(missing)}")
        return kind(**{k: _decode(hints[k], value[k], f"{where}.{k}", strict=strict)  # type: ignore[operator]
                       for k in fields if k in value})
    if origin in (Union, types.UnionType):
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], value, where, strict=strict)
    if origin is tuple:
        args = typing.get_args(kind)
        if not isinstance(value, list):
            raise TypeError(f"{where} should be a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]", strict=strict) for i, v in enumerate(value))
        return tuple(_decode(a, v, f"{where}[{i}]", strict=strict) for i, (a, v) in enumerate(zip(args, value)))
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} should be a number, got {value!r}")
        return float(value)
    if kind in (int, str, bool):
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{where} should be {kind.__name__}, got {value!r}")
        return value
    raise TypeError(f"cannot decode {where} as {kind}")


def example_plan() -> Plan:
    """A tiny, hand-made two-stage plan (for docs and tests)."""
    b = Boundary("relu", (2, 4), "float32", 0, 1)
    pred = StagePrediction(1e-3, 2e-3, 320.0, 64, 32.0, 32, 0.0)
    stages = (
        StagePlan(0, (0,), ("w0", "linear", "relu"), 2, ("0.weight",), ("x",), (), (b,), ("0", "1"), pred,
                  shard_span="world"),
        StagePlan(1, (1,), ("w2", "linear_1"), 1, ("2.weight",), (), (b,), (), ("2", "2"), pred, rank=1,
                  shard_span="world"),
    )
    return Plan(
        format_version=FORMAT_VERSION,
        model=ModelInfo("Sequential", "0123456789abcdef", "export", (TensorSpec("x", (2, 4), "float32"),), ("linear_1",), 2, 128),
        gpus=2, pp=2, dp=1, microbatches=2, schedule="gpipe", batch_size=4, device="cpu",
        stages=stages,
        actions=(("0F0", "0SF0", "0F1", "0SF1", "0RB0", "0B0", "0RB1", "0B1"),
                 ("1RF0", "1F0", "1RF1", "1F1", "1B0", "1SB0", "1B1", "1SB1")),
        tied=(),
        predicted=StepPrediction(9e-3, 1 / 3, 444.4, (320.0, 320.0)),
        solver=SolverInfo("interval-dp", "optimal", 9e-3, 9e-3, 0.01, 3),
        cost_model=CostModelInfo("measured on cpu", 1e9, 6e-5, None, 2),
        candidates=(Candidate(2, 1, 9e-3, "optimal", "chosen", microbatches=2, schedule="gpipe"),),
        bucket_cap_mb=DEFAULT_BUCKET_CAP_MB,
        stage_code=("# stage 0\n", "# stage 1\n"),
        gpus_per_node=2,
    )
