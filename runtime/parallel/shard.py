"""Sharded replicas: a stage group's state split over its replicas, by torch's own engines.

The plan gives every stage a shard mode (``StagePlan.shard``,
:data:`partitioner.defaults.SHARD_MODES`); ZeRO's stages (Rajbhandari et al.,
SC 2020, section 5) name them:

* ``none``: every replica holds the whole state; DDP or the
  :class:`runtime.parallel.replicate.ReplicaReducer` averages the gradients.
* ``optimizer`` (ZeRO-1, P_os): gradients are averaged exactly as under
  ``none``; the optimizer state is split over the group by
  ``torch.distributed.optim.ZeroRedundancyOptimizer``, which steps only the
  parameters this replica owns and broadcasts them to the others after the
  step.  Built by :meth:`runtime.Pipeline.optimizer`.  Chosen over FSDP2 for this
  mode because it leaves parameters and gradients whole: every schedule (a split
  backward, several stages per rank), tied weights and clipping run unchanged,
  and the memory is ZeRO-1's (weights and gradients whole, Adam's state / d:
  ``8 + 8/d`` bytes per parameter under bf16-mixed, whose weights are fp32), not
  FSDP2's (which would also shard the parameters between steps).
* ``full`` (ZeRO-3, P_os+g+p): the stage module is wrapped by FSDP2's
  ``fully_shard`` over a 1-D ``DeviceMesh`` of the stage group; its parameters
  become ``DTensor`` shards, so any torch optimizer over
  :meth:`runtime.Pipeline.parameters` holds sharded state.
  Replicas spanning several nodes shard inside a node and replicate across
  (HSDP, a 2-D mesh: :func:`shard_layout`; under ZeRO-3 each micro-batch's
  reduce-scatter is followed by FSDP2's all-reduce across the nodes).
  Two policies, per stage (``StagePlan.reshard_after_forward``):

  - kept gathered (False): one FSDP unit per stage, gathered from the first
    forward of a step to the end of its last backward; gradients accumulated
    unsharded over the micro-batches and reduce-scattered once, after the
    step's last backward, as torch's own pipelining drives FSDP2
    (``torch/distributed/pipelining/stage.py``: ``backward_maybe_with_nosync``
    and ``perform_reduce_grad``); torchtitan under pipeline parallelism.
  - ZeRO-3 (True; Rajbhandari et al. 2020, section 5.3; Zhao et al., "PyTorch
    FSDP", VLDB 2023): one FSDP unit per layer of the stage
    (:class:`LayeredStage`: the stage graph's nodes in runs of one layer,
    :func:`runtime.execute.recompute.block_nodes`, each run a :class:`LayerUnit` that
    owns the parameters only it reads; the rest stay with the stage's root
    unit), each gathered before its forward and again before its backward
    and freed after each, and gradients reduce-scattered after every
    micro-batch's backward into sharded accumulation (FSDP2 with gradient sync
    on every backward): a rank holds its shard of everything plus about one
    or two layers gathered.  Not under a split backward (``zb-h1``, ``zbv``):
    W computes weight gradients after B, outside FSDP2's backward hooks, so
    they cannot be reduce-scattered per backward (:func:`shard_refusal`).

  Precision (:func:`fsdp_policy`): under ``bf16-mixed`` every unit (layers and
  the stage's root) has FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``, as torchtitan's ``mixed_precision_param`` /
  ``mixed_precision_reduce``: the float32 shards are all-gathered as bfloat16
  copies (half the bytes), the backward's bfloat16 gradients are
  reduce-scattered in float32, and under gradient accumulation (kept gathered,
  ``set_requires_gradient_sync(False)``) FSDP2 upcasts each micro-batch's
  bfloat16 gradients into a float32 unsharded accumulator
  (``FSDPParam.to_accumulated_grad_if_needed`` /
  ``accumulate_unsharded_grad_if_needed`` in
  ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``), whose sum the step's
  one reduce-scatter reads (its input buffer in the reduce dtype,
  ``foreach_reduce`` in ``_fsdp_collectives.py``).  The sharded parameters, their
  gradients and the optimizer state stay float32 (what clipping, the optimizer
  and checkpoints see).  Autocast stays on around the stage, so ops on its
  float32 list (norms, softmax, the loss) still run in float32 and matmuls in
  bfloat16, as in a DDP stage; inputs are not cast (``cast_forward_inputs``
  False: autocast decides per op).  What differs from a DDP stage: ops outside
  autocast's lists that read a weight (an embedding lookup, a norm's ``weight *
  x``) read its bfloat16 copy, so an embedding's output is bfloat16 rather than
  float32 and a residual stream started from it stays bfloat16, as in
  torchtitan; the boundary tensors' dtypes are found with those weights in
  bfloat16 (:func:`bf16_gathered_parameters`,
  :func:`runtime.state.precision.plan_at_precision`).  fp32 and bf16: no policy, the
  units gathered in the parameters' dtype.

  A model built on meta is materialised straight into
  shards (:func:`fill_shards`): each module is initialised whole, one at a
  time, and only this replica's part of its parameters is kept, so a fully
  sharded rank never holds its whole stage at start-up.

One pipeline rank runs one mode on all of its stages (one process group serves
them).  A tied parameter's copies on several pipeline ranks (aliases, or one name
read by several stages) are summed shard for
shard when every stage holding it is ``full`` (:mod:`runtime.parallel.replicate`); a
``full`` copy beside a whole one, or two ``full`` stages of one rank holding it
(one parameter, two FSDP units), are refused.  :func:`shard_refusal` says why a plan
cannot run, before any rank builds anything.

Example (which mode a rank runs)::

    >>> from partitioner.plan import example_plan
    >>> rank_shard_mode(example_plan(), 0)
    'none'
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from partitioner.cost.precision import runs_autocast
from partitioner.defaults import shard_refusal as _schedule_refusal
from partitioner.defaults import splits_backward
from partitioner.errors import AutopartitionError, InternalError, ScheduleError
from partitioner.graph.meetings import inputs_written_in_place, written_state
from partitioner.plan import Plan
from runtime.execute.recompute import (
    Recomputed,
    RunKind,
    block_nodes,
    block_run,
    run_block,
    stage_run_kinds,
    written_inputs,
)
from runtime.state.precision import PrecisionForward

__all__ = [
    "LayerUnit",
    "LayeredStage",
    "ShardUnit",
    "ShardedStep",
    "bf16_gathered_parameters",
    "build_optimizer",
    "check_shard_plan",
    "fill_shards",
    "fsdp_policy",
    "plain_tensor",
    "rank_shard_mode",
    "shard_layout",
    "shard_modules",
    "shard_of",
    "shard_refusal",
    "shardable_on_meta",
    "stage_meshes",
]


def rank_shard_mode(plan: Plan, pipeline_rank: int) -> str:
    """The shard mode pipeline rank ``pipeline_rank`` runs (``none`` without replicas: nothing to split)."""
    modes = {plan.stages[s].shard for s in plan.stages_of(pipeline_rank)}
    if plan.dp == 1 or not modes:
        return "none"
    return min(modes) if len(modes) == 1 else "mixed"


def shard_refusal(plan: Plan) -> str | None:
    """Why the runtime cannot run ``plan``'s shard modes (None: it can), with what works instead."""
    kind = plan.schedule
    for st in plan.stages:
        why = _schedule_refusal(kind, st.shard)
        if why is not None:
            return (f"stage {st.index} is planned with shard={st.shard!r} under schedule {kind!r}, which {why}. "
                    "Re-plan with shard 'none' for that schedule, or with a schedule that runs it "
                    "(1f1b, gpipe).")
    if splits_backward(kind) and plan.dp > 1:
        for st in plan.stages:
            if st.shard == "full" and st.reshard_after_forward:
                return (f"stage {st.index} is planned fully sharded with reshard_after_forward (ZeRO-3: gradients "
                        f"reduce-scattered after every micro-batch's backward) under schedule {kind!r}, whose W "
                        "computes the weight gradients after B, outside FSDP2's backward hooks. Re-plan that stage "
                        "with reshard_after_forward false (gathered through the step, one reduce-scatter), or "
                        "with 1f1b, gpipe or interleaved-1f1b.")
    for p in range(plan.pp):
        modes = {plan.stages[s].shard for s in plan.stages_of(p)}
        if len(modes) > 1:
            return (f"pipeline rank {p} holds stages {list(plan.stages_of(p))} with different shard modes "
                    f"{sorted(modes)}: one process group serves all stages of a rank, so give them one mode.")
    if plan.dp > 1:
        for t in plan.tied:
            full = [s for s in t.stages if plan.stages[s].shard == "full"]
            if full and len(full) < len(t.stages):
                other = next(s for s in t.stages if s not in full)
                return (f"the tied parameter {t.name} lives in fully sharded stage {full[0]} and in stage {other}, "
                        f"planned {plan.stages[other].shard!r}: its copies are summed shard for shard, so every "
                        "stage holding it must be 'full', or none of them.")
            ranks = [plan.stages[s].rank for s in full]
            shared = [s for s in full if ranks.count(plan.stages[s].rank) > 1]
            if shared:
                return (f"the tied parameter {t.name} is held by fully sharded stages {shared} on one pipeline rank: "
                        "one parameter cannot be two FSDP units. Plan those stages 'optimizer' or 'none', or "
                        "a schedule with one stage per rank.")
    return None


def check_shard_plan(plan: Plan) -> None:
    """Raise :class:`ScheduleError` (bad input) when the runtime cannot run ``plan``'s shard modes."""
    why = shard_refusal(plan)
    if why is not None:
        raise ScheduleError(f"The plan cannot run: {why}")


class ShardUnit(nn.Module):
    """One stage's runnable as one FSDP2 unit.

    ``fully_shard`` swaps the class of the module it wraps; wrapping this holder
    rather than the stage's ``fx.GraphModule`` keeps the graph module's own class,
    which the split backward recompiles (:func:`partitioner.graph.meetings.mark_meetings`).
    The stage's parameters stay registered under their names in the graph module,
    as ``DTensor`` shards between steps.
    """

    def __init__(self, runnable: nn.Module) -> None:
        super().__init__()
        self.runnable = runnable
        self._written = _written_positions(runnable)

    def forward(self, *args: Any) -> Any:
        # FSDP2's pre-forward hook hands the stage its inputs as views made by a custom autograd Function
        # (RegisterPostBackwardFunction), which autograd refuses to let an op write in place; an input the
        # stage writes (``nn.ReLU(inplace=True)`` opening it) is copied here, after the hook.
        if self._written:
            args = tuple(a.clone() if i in self._written and isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))
        return self.runnable(*args)


def _written_positions(runnable: nn.Module) -> frozenset[int]:
    """Positions of the stage forward's arguments that its graph writes in place (the stage graph in ``runnable``)."""
    stage = next((m for m in runnable.modules() if isinstance(m, fx.GraphModule)), None)
    if stage is None:
        return frozenset()
    names = [n.name for n in stage.graph.nodes if n.op == "placeholder"]
    written = inputs_written_in_place(stage)
    return frozenset(i for i, name in enumerate(names) if name in written)


def shard_layout(plan: Plan, pipeline_rank: int) -> tuple[int, int]:
    """(replicate, shard): how pipeline rank ``pipeline_rank``'s ``full`` replicas split their state.

    As its stages' ``shard_span`` says (:meth:`~partitioner.plan.Plan.shard_degree`, the
    planner's rule, so its memory is ours): ``"world"`` (or one node holding them all)
    ``(1, dp)``, every replica a shard (FSDP); ``"node"`` where they span whole nodes
    of ``gpus_per_node`` (``dp`` a multiple of it; replicas are consecutive ranks,
    so each node holds ``gpus_per_node`` of them): ``(dp / gpus_per_node,
    gpus_per_node)``, HSDP: sharded inside a node, the nodes replicas of each other
    (gradients all-reduced across them after the reduce-scatter inside), as
    torchtitan's ``dp_replicate x dp_shard`` mesh.

    >>> from partitioner.plan import example_plan
    >>> shard_layout(example_plan(), 0)
    (1, 1)
    """
    shards = plan.shard_degree(plan.stages[plan.stages_of(pipeline_rank)[0]])
    return plan.dp // shards, shards


def stage_meshes(plan: Plan, rank: int, group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """This rank's FSDP2 mesh (None unless its stages are ``full``); every rank must call it (groups).

    1-D over the stage group, or 2-D ``(replicate, shard)`` (:func:`shard_layout`), whose
    process groups every rank creates in one order, as torch.distributed requires.
    """
    from torch.distributed.device_mesh import DeviceMesh

    pipeline_rank = plan.layout.coord(rank, "pp")
    mine: Any = None
    for p in range(plan.pp):
        replicate, shard = shard_layout(plan, p)
        if rank_shard_mode(plan, p) != "full" or replicate == 1:
            continue
        layout = dataclasses.replace(plan.layout, dp_shard=shard)
        for grid in layout.meshes(("dp_replicate", "dp_shard")):
            if layout.coord(grid[0][0], "pp") != p:
                continue
            rows = [dist.new_group(row) for row in grid]
            columns = [dist.new_group([row[j] for row in grid]) for j in range(shard)]
            if p == pipeline_rank and any(rank in row for row in grid):
                k, j = layout.coord(rank, "dp_replicate"), layout.coord(rank, "dp_shard")
                mine = DeviceMesh.from_group([columns[j], rows[k]], device.type, mesh=grid,
                                             mesh_dim_names=("replicate", "shard"))
    if mine is None and group is not None and rank_shard_mode(plan, pipeline_rank) == "full":
        mine = DeviceMesh.from_group(group, device.type, mesh_dim_names=("shard",))
    return mine


class LayerUnit(nn.Module):
    """One layer's run of a stage graph, as the FSDP2 unit owning the parameters only that run reads.

    Its registered children are those parameters' owning modules (the stage
    module's own objects, so FSDP2's swaps between shards and gathered
    parameters are seen by the stage module too); the run's graph reads the
    whole stage through ``stage`` and is kept in a plain list, outside this
    unit's module tree (else the unit would own every parameter of the stage).
    """

    def __init__(self, run: fx.GraphModule, owners: Sequence[nn.Module], written: Sequence[int] = ()) -> None:
        super().__init__()
        self.owners = nn.ModuleList(owners)
        self._run = [run]
        self._written = frozenset(written)  # inputs the run writes in place: copied after FSDP2's hook (ShardUnit)

    def forward(self, *args: Any) -> Any:
        if self._written:
            args = tuple(a.clone() if i in self._written and isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))
        return self._run[0](*args)


class LayeredStage(nn.Module):
    """A stage graph run layer by layer (:func:`runtime.execute.recompute.block_nodes`), for ZeRO-3's finer FSDP2 units.

    Each run that owns parameters alone (read by no other run, their owning
    modules holding nothing else) is a :class:`LayerUnit`; the others read the
    stage's parameters through the stage module (the root unit's).  With
    ``recompute`` each run (an ``int``: the first ``recompute`` runs, selective
    recomputation, then the next ``ops_layers`` under per-op checkpointing) goes
    under non-reentrant ``torch.utils.checkpoint`` while gradients are on, as
    :class:`runtime.execute.recompute.Recomputed` does (the same blocks and kinds, so the
    same numbers and memory): FSDP2 then gathers a unit again for its
    recomputation inside the backward (its pre-backward state).
    """

    def __init__(self, stage: fx.GraphModule, *, recompute: bool | int, ops_layers: int = 0) -> None:
        super().__init__()
        self.stage = stage
        self.recompute = recompute
        graph = stage.graph
        nodes = {n.name: n for n in graph.nodes}
        blocks = block_nodes(stage)
        # How each run recomputes: all wholly, none, or the plan's selective counts (first wholly, next ops).
        self.kinds: tuple[RunKind, ...]
        if recompute is True:
            self.kinds = stage_run_kinds(stage, blocks)
        elif recompute is False and not ops_layers:
            self.kinds = tuple("keep" for _ in blocks)
        else:
            self.kinds = stage_run_kinds(stage, blocks, layers=int(recompute), ops_layers=ops_layers)
        self.recomputed = self.kinds.count("whole")
        readers: dict[nn.Parameter, set[int]] = {}
        reads: list[dict[str, nn.Parameter]] = []
        for i, block in enumerate(blocks):
            mine: dict[str, nn.Parameter] = {}
            for name in block:
                node = nodes[name]
                if node.op == "call_module":
                    prefix = f"{node.target}."
                    mine.update({prefix + k: v for k, v in stage.get_submodule(str(node.target)).named_parameters()})
                for arg in node.all_input_nodes:
                    if arg.op == "get_attr":
                        value = _attribute(stage, str(arg.target))
                        if isinstance(value, nn.Parameter):
                            mine[str(arg.target)] = value
            for param in mine.values():
                readers.setdefault(param, set()).add(i)
            reads.append(mine)
        aliased = _aliased(stage)
        # Plain lists: the runs read the whole stage (registered once, as self.stage); the units are in self.units.
        self._runs: list[nn.Module] = []
        self._steps: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        layered = nn.ModuleList()
        self._written: list[tuple[int, ...]] = []  # inputs each run writes in place (a recomputed one on copies)
        for i in range(len(blocks)):
            run, inputs, outputs = block_run(stage, blocks, i)
            self._written.append(written_inputs(run, inputs))
            owned = {name: p for name, p in reads[i].items() if readers[p] == {i} and p not in aliased}
            owners: dict[str, nn.Module] = {}
            for name in owned:
                path = name.rpartition(".")[0]
                owners.setdefault(path, stage.get_submodule(path) if path else stage)
            # A unit owns every parameter under its owners: keep only owners holding nothing else.
            mine_params = set(owned.values())
            owners = {path: m for path, m in owners.items() if m is not stage and set(m.parameters()) <= mine_params}
            if owners:
                unit = LayerUnit(run, list(owners.values()), self._written[-1])
                layered.append(unit)
                self._runs.append(unit)
            else:
                self._runs.append(run)
            self._steps.append((tuple(inputs), outputs))
        # The buffers each run writes (a BatchNorm's statistics): a recomputation restores them around itself.
        self._state = [tuple(written_state(stage, [nodes[name] for name in block])) for block in blocks]
        self.units = layered
        self._inputs = tuple(n.name for n in graph.nodes if n.op == "placeholder")
        output = next(n for n in graph.nodes if n.op == "output")
        self._template = output.args[0]

    def layer_parameters(self) -> set[nn.Parameter]:
        """The parameters the layer units own (the stage's root unit leaves them to those)."""
        return {p for unit in self.units for p in unit.parameters()}

    def forward(self, *args: Any) -> Any:
        env: dict[str, Any] = dict(zip(self._inputs, args, strict=True))
        for run, (inputs, outputs), kind, state, written in zip(self._runs, self._steps, self.kinds, self._state,
                                                                self._written, strict=True):
            result = run_block(run, [env[name] for name in inputs], kind, [self.stage.get_buffer(n) for n in state],
                               written)
            env.update(zip(outputs, result, strict=True))
        return fx.node.map_aggregate(self._template, lambda v: env[v.name] if isinstance(v, fx.Node) else v)


def _attribute(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _aliased(stage: nn.Module) -> set[nn.Parameter]:
    """Parameters registered under several names in ``stage`` (tied): left to the stage's root unit."""
    seen: dict[nn.Parameter, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        seen[p] = seen.get(p, 0) + 1
    return {p for p, count in seen.items() if count > 1}


def _layered(runnable: nn.Module) -> tuple[nn.Module, LayeredStage | None]:
    """``runnable`` with its stage graph run layer by layer (:class:`LayeredStage`), or as it is where it has none.

    A runnable is the stage module, optionally under :class:`~runtime.execute.recompute.Recomputed`, optionally
    under :class:`~runtime.state.precision.PrecisionForward` (``runtime.pipeline``'s ``_runnable``).
    """
    outer = runnable if isinstance(runnable, PrecisionForward) else None
    inner = outer.module if outer is not None else runnable
    recompute: bool | int
    ops_layers = 0
    if isinstance(inner, Recomputed):  # every layer, or the planned ones (selective): the same runs here
        stage, recompute, ops_layers = inner.stage, True if inner.layers is None else inner.layers, inner.ops_layers
    elif isinstance(inner, fx.GraphModule):
        stage, recompute = inner, False
    else:
        return runnable, None
    layered = LayeredStage(stage, recompute=recompute, ops_layers=ops_layers)
    if outer is None:
        return layered, layered
    outer.module = layered
    return outer, layered


def fsdp_policy(precision: str) -> Any:
    """FSDP2's mixed-precision policy for a ``full`` stage under ``precision`` (module docstring).

    ``bf16-mixed``: gathered and computed in bfloat16, gradients reduced (and,
    without gradient sync, accumulated) in float32, as torchtitan's defaults;
    inputs left to autocast.  Otherwise the default policy: no casting.

    >>> fsdp_policy("bf16-mixed").param_dtype, fsdp_policy("bf16-mixed").reduce_dtype, fsdp_policy("fp32").param_dtype
    (torch.bfloat16, torch.float32, None)
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not runs_autocast(precision):  # bf16-mixed and fp8
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def bf16_gathered_parameters(plan: Plan) -> tuple[str, ...]:
    """The graph names of the parameters FSDP2 gathers in bfloat16 for ``plan`` (:func:`fsdp_policy`).

    Those of the stages on pipeline ranks that run ``full`` (:func:`rank_shard_mode`)
    under ``bf16-mixed``; none otherwise.  Every rank finds the same names, so
    every rank finds the same boundary dtypes (:func:`runtime.state.precision.plan_at_precision`).

    >>> from partitioner.plan import example_plan
    >>> bf16_gathered_parameters(example_plan())
    ()
    """
    if not runs_autocast(plan.precision):
        return ()
    return tuple(name for p in range(plan.pp) if rank_shard_mode(plan, p) == "full"
                 for s in plan.stages_of(p) for name in plan.stages[s].parameters)


def shard_modules(
    runnables: Sequence[nn.Module], reshard_after_forward: Sequence[bool], mesh: Any, *, precision: str = "fp32",
) -> tuple[nn.Module, ...]:
    """Each stage's runnable as a :class:`ShardUnit` under FSDP2's ``fully_shard`` over ``mesh``.

    ``reshard_after_forward`` (per stage) True: ZeRO-3, one unit per layer
    (:class:`LayeredStage`) under the stage's root unit, every unit resharded
    after each forward and backward; False: the stage is one unit, kept
    gathered through the step (:class:`ShardedStep`).  Every unit gets
    ``precision``'s :func:`fsdp_policy`.  The replicas must hold equal
    parameters first (each keeps only its shard of its own copy).
    """
    from torch.distributed.fsdp import fully_shard

    _refuse_parameter_hooks(runnables)
    policy = fsdp_policy(precision)
    units = []
    for runnable, reshard in zip(runnables, reshard_after_forward):
        # Expert parallelism's slices stay whole and plain (runtime.parallel.experts reduces them).
        whole = {p for m in runnable.modules() if getattr(m, "keeps_whole_parameters", False) for p in m.parameters()}
        ignored: set[nn.Parameter] = set(whole)
        if reshard:
            runnable, layered = _layered(runnable)
            if layered is not None:
                for layer in layered.units:  # bottom-up: each layer's unit before the stage's root
                    fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy,
                                ignored_params={p for p in layer.parameters() if p in whole} or None)
                # The stage module still registers the layers' parameters (one object each): the root leaves them.
                ignored |= layered.layer_parameters()
        unit = ShardUnit(runnable)
        fully_shard(unit, mesh=mesh, reshard_after_forward=bool(reshard), ignored_params=ignored or None,
                    mp_policy=policy)
        units.append(unit)
    return tuple(units)


def _refuse_parameter_hooks(runnables: Sequence[nn.Module]) -> None:
    """Refuse a fully sharded stage whose model registered gradient hooks on its parameters: FSDP2 replaces
    them with shards and computes gradients on gathered copies, so the hooks would never run (silently)."""
    hooked = sorted({name for runnable in runnables for name, p in runnable.named_parameters()
                     if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)})
    if hooked:
        shown = ", ".join(hooked[:3]) + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")
        raise AutopartitionError(
            f"The model registers gradient hooks on {shown}, which a fully sharded stage group (--shard full, "
            "FSDP2) would drop: it replaces the parameters with shards and computes their gradients on gathered "
            "copies. Plan with --shard none or optimizer, or remove the hooks.")


def shardable_on_meta(modules: Sequence[nn.Module]) -> bool:
    """Whether ``modules`` can be materialised straight into shards: every parameter on meta, none a scalar."""
    params = [p for m in modules for p in m.parameters()]
    return bool(params) and all(p.is_meta and p.dim() >= 1 for p in params)


def shard_of(value: torch.Tensor, *, dp: int, replica: int) -> torch.Tensor:
    """Replica ``replica``'s part of a whole parameter, as FSDP2's ``Shard(0)`` over ``dp`` cuts it (a copy)."""
    pieces = torch.chunk(value.detach(), dp, dim=0)  # detached: a view of a Parameter would keep it alive
    if replica < len(pieces):
        return pieces[replica].clone()
    return value.new_empty((0, *value.shape[1:]))


def fill_shards(units: Sequence[nn.Module], modules: Sequence[nn.Module], values: dict[str, torch.Tensor],
                device: torch.device) -> None:
    """Give FSDP2 units built on meta their storage and this rank's values.

    ``values``: name in the stage modules -> this replica's shard of a parameter,
    or a whole buffer (:func:`runtime.state.materialise.materialised_values`); each is
    taken out of it once copied in, so the rank never holds a parameter's shard
    twice (start-up peak memory: its shards once, plus the largest module while
    it was initialised whole).  Buffers that were real already are kept
    (``to_empty`` would drop them).
    """
    from torch.distributed.tensor import DTensor

    from partitioner.errors import InternalError

    real = [{n: b.detach().clone() for n, b in m.named_buffers() if not b.is_meta} for m in modules]
    for unit in units:
        unit.to_empty(device=device)
    filled: set[str] = set()
    with torch.no_grad():
        for module, kept in zip(modules, real):
            for name, param in module.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                if name in filled:  # one parameter under this name in two stages of this rank: filled once
                    continue
                filled.add(name)
                value = values.pop(name)
                if tuple(local.shape) != tuple(value.shape):
                    raise InternalError(f"{name}: FSDP2 holds a shard of shape {tuple(local.shape)} here, the "
                                        f"materialised one is {tuple(value.shape)}")
                local.copy_(value)
            for name, buffer in module.named_buffers():  # a buffer may be every stage's (a constant): kept
                buffer.copy_(kept[name] if name in kept else values[name])


class ShardedStep:
    """Drives this rank's fully sharded stages through a step.

    :meth:`begin` before the step's first action.  A stage kept gathered
    (``reshard_after_forward`` False) accumulates unreduced gradients, as
    torch's pipelining drives FSDP2 (no reduce-scatter per micro-batch); a
    ZeRO-3 stage (True) reduce-scatters after every backward into its sharded
    gradients and frees its gathered layers after each forward and backward.
    :meth:`end` after its last: the kept-gathered stages' one reduce-scatter,
    averaged over the replicas, every stage resharded for the optimizer.
    """

    def __init__(self, modules: Sequence[nn.Module], reshard_after_forward: Sequence[bool], *,
                 splits_backward: bool) -> None:
        if splits_backward and any(reshard_after_forward):
            raise InternalError("ZeRO-3 (reshard_after_forward) under a split backward: shard_refusal refuses it")
        self._modules = list(modules)
        self._zero3 = [bool(r) for r in reshard_after_forward]

    def begin(self) -> None:
        for module, zero3 in zip(self._modules, self._zero3):
            module.set_is_last_backward(False)  # type: ignore[operator]
            module.set_reshard_after_backward(zero3)  # type: ignore[operator]
            module.set_requires_gradient_sync(zero3)  # type: ignore[operator]

    def end(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for module in self._modules:
            module.set_is_last_backward(True)  # type: ignore[operator]
            module.set_reshard_after_backward(True)  # type: ignore[operator]
            module.set_requires_gradient_sync(True)  # type: ignore[operator]
            # Our actions call autograd themselves (B and W apart, or one backward per micro-batch), so the
            # step's post-backward runs here, once: FSDP2's per-group post_backward reduce-scatters what is
            # still accumulated unsharded (nothing under ZeRO-3), and the root's final callback waits for
            # the reductions and reshards (torch/distributed/pipelining/stage.py, perform_reduce_grad).
            state = fully_shard.state(module)  # type: ignore[attr-defined]
            for inner in state._state_ctx.all_states:
                for group in inner._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()


def build_optimizer(
    params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer], *, mode: str,
    group: dist.ProcessGroup | None, **defaults: Any,
) -> torch.optim.Optimizer:
    """``optimizer_class`` over ``params``; under ``optimizer`` mode its state split over ``group`` (ZeRO-1)."""
    params = list(params)
    if mode != "optimizer" or group is None:
        return optimizer_class(params, **defaults)
    with warnings.catch_warnings():  # torch.distributed.optim warns on import (torch.jit.interface) about itself
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group, **defaults)


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """A sharded ``DTensor`` gathered whole (collective over its mesh); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
