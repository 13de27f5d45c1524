"""``Pipeline``: one rank's view of a plan: its stage, its replicas, its schedule.

Its ``__init__`` is a recipe: this rank's stage stack (:mod:`runtime.execute.stack`)
built layer by layer, each step a function of the layer's subpackage (values,
tensor split, recomputation, precision, sharding, replication, the schedule runner);
:meth:`Pipeline.step` runs the runner inside the layers' hooks.

Example (in each rank started by ``autopartition run`` / torchrun)::

    plan = Plan.load("plan/")
    pipe = Pipeline(plan, build_model(), loss_fn)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for inputs, target in batches:
        loss = pipe.step(inputs, target)   # mini-batch mean loss on the last stage, else None
        opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from partitioner import errors
from partitioner.agree import plan_digest, plan_sections
from partitioner.errors import AutopartitionError, PlanMismatchError
from partitioner.graph.capture import split_call
from partitioner.orders import Action
from partitioner.plan import Plan
from partitioner.schedule.lower import validate
from partitioner.schedule.timeline import TimelineEvent, write_chrome_trace
from runtime.engines.choice import engine_from_env
from runtime.engines.runners import apply_runner
from runtime.engines.torch_engine import torch_engine_refusal, torch_stage_refusal
from runtime.evaluate import concat_microbatches, evaluate, evaluation_mode
from runtime.execute.comm import (
    PeerFailure,
    RecvSpec,
    Work,
    init_distributed,
    pick_device,
    rank_timeout,
    recv_tensors,
    send_tensors,
    wait_all,
)
from runtime.execute.recompute import apply_recompute
from runtime.execute.stack import LossFn, Runner, StageStack
from runtime.execute.stage import build_local_stages
from runtime.launch.failure import reports_failures
from runtime.parallel.clip import clip_gradients
from runtime.parallel.experts import (
    ExpertsLayer,
    ExpertSplitOptimizer,
    apply_experts,
)
from runtime.parallel.parallelize import (
    ReplicaLayer,
    ShardingLayer,
    TiedLayer,
    apply_fsdp,
    apply_groups,
    apply_replicas,
    apply_tp,
    apply_tp_io,
    shard_while_loading,
    sync_tied_copies,
    tie_parameters,
)
from runtime.parallel.shard import (
    bf16_gathered_parameters,
    check_shard_plan,
    plain_tensor,
    rank_shard_mode,
)
from runtime.parallel.tensorparallel import tensor_parallel_refusal
from runtime.state import checkpoint
from runtime.state.materialise import InitWeights
from runtime.state.values import (
    apply_fp8,
    apply_precision,
    at_precision,
    cast_values,
    load_values,
    values_on_device,
)
from runtime.state.weights import weights_from_env

__all__ = ["Pipeline"]

BATCH_MODES = ("global", "replica")  # what step() receives: the whole mini-batch, or this replica's share


class Pipeline:
    """Holds only this rank's stage; :meth:`step` trains one mini-batch.

    ``loss_fn(outputs, target)`` must return the mean loss over its batch (the
    default reduction of torch's losses): the pipeline averages it over
    micro-batches and replicas, which equals the unpartitioned model's loss.

    Without ``loss_fn`` the model's own loss is used (a scalar output, or a
    ``loss`` key/attribute, as Hugging Face models return with ``labels=``);
    ``step(inputs, target)`` then passes ``target`` as the keyword
    ``target_keyword`` (default: the one planned keyword input that ``inputs``
    lacks), so the target is one more graph input, read by the stage computing
    the loss.  A model's mean over tokens, averaged over micro-batches, is the
    mini-batch mean only when every micro-batch holds as many counted tokens
    (no ``-100`` padding, or the same amount in each).

    A model built on the meta device gets real tensors for this rank's stages only,
    each module initialised under a generator seeded by ``(seed, its name)`` with
    ``init_weights(module, name)`` (the model file's), else the Hugging Face model's
    ``_init_weights``, else ``reset_parameters()`` (:mod:`runtime.state.materialise`); a
    model with real weights is used as it is.  ``weights=`` (default: the
    ``AUTOPARTITION_WEIGHTS`` variable ``autopartition run --weights`` sets) reads
    this rank's tensors from a safetensors or DCP checkpoint (:mod:`runtime.state.weights`);
    :meth:`save_checkpoint` / :meth:`load_checkpoint` resume under any plan
    (:mod:`runtime.state.checkpoint`).

    The plan's ``precision`` is applied to every stage: ``bf16-mixed`` runs forward
    and loss under ``torch.autocast`` (bfloat16) with float32 parameters, ``bf16``
    converts parameters to bfloat16 (and floating model inputs as they enter);
    boundary tensors travel in the dtype they are computed in; ``fp8`` runs as ``bf16-mixed``
    with the linear layers' matmuls in FP8 (:mod:`runtime.state.fp8`; ``fp8=True`` runs them
    whatever the precision, as ``verify`` runs an fp8 plan in float32, ``False`` never).  A stage planned
    with ``recompute="full"`` runs each layer under activation checkpointing; one
    planned ``"selective"`` its first ``recompute_layers`` layers so, and the next
    ``recompute_ops_layers`` under per-op checkpointing (:mod:`runtime.execute.recompute`).

    ``batch="global"`` (default): every rank passes the whole mini-batch and each
    replica takes its slice; ``batch="replica"``: each rank passes only its
    replica's ``batch_size / dp`` samples (e.g. from a ``DistributedSampler`` over
    :attr:`dp_rank` / :attr:`dp_size`).  Either way a rank may pass ``None`` for
    what it does not read (:attr:`needs_inputs`, :attr:`needs_target`).

    Pairing: with ``batch="replica"`` and a ``loss_fn`` the first stage's ranks read
    the target with the inputs and send it to their replica's last stage, so each
    sample's target meets its own inputs whichever data the last stage's ranks were
    given.  On the first :meth:`step` (and the first :meth:`eval_step`) the ranks
    compare a digest of everything they were given: ranks of one replica
    (``batch="global"``: all ranks) given different samples are refused on every
    rank, with the fix (e.g. a ``DistributedSampler`` over the global rank instead
    of :attr:`dp_rank`).

    Stages planned with ``shard`` ``optimizer`` or ``full`` split their state over their
    replicas (:mod:`runtime.parallel.shard`); :meth:`optimizer` builds the optimizer that fits.

    ``timeout``: seconds any wait for a peer may take (default: ``$AUTOPARTITION_TIMEOUT``,
    else 300); past it the rank stops with an error naming the peer and the action.

    ``engine``: ``"ours"`` (default; ``$AUTOPARTITION_ENGINE``, which ``autopartition run
    --engine`` sets) or ``"torch"``: the stages run under torch.distributed.pipelining's
    schedules (:mod:`runtime.engines.torch_engine`); :meth:`step` takes and returns the same.
    """

    @reports_failures  # a rank's error names its stage in the launcher's message (runtime.launch.failure)
    def __init__(
        self,
        plan: Plan,
        model: torch.nn.Module,
        loss_fn: LossFn | None = None,
        *,
        device: torch.device | None = None,
        timeout: float | None = None,
        trace: bool = False,
        target_keyword: str | None = None,
        init_weights: InitWeights | None = None,
        seed: int = 0,
        batch: str = "global",
        weights: str | os.PathLike[str] | None = None,
        engine: str | None = None,
        fp8: bool | None = None,
    ) -> None:
        _check_batch(batch)
        self.plan, self._loss_fn, self._target_keyword, self._batch, self.trace = plan, loss_fn, target_keyword, batch, trace
        self.device = device or pick_device()
        self.timeout = timeout = rank_timeout(timeout)  # None: $AUTOPARTITION_TIMEOUT, else 300 s
        init_distributed(self.device, timeout=timeout)
        self.rank = dist.get_rank()
        self._state_keys = set(model.state_dict().keys())
        # Every check that can fail on one rank alone runs before the ranks compare notes, so that a failure on
        # any rank stops all of them (a lone raise would leave the others waiting in the first collective).
        failure: Exception | None = None
        try:
            stack = self._rank_stack(plan, model, engine=engine)
            weights = weights_from_env(weights)  # `autopartition run --weights PATH` sets the variable
            stack = load_values(stack, model, weights=weights, keys=self._state_keys, seed=seed,
                                init_weights=init_weights, keep=shard_while_loading(stack, weights_given=weights is not None))
        except Exception as exc:  # noqa: BLE001 - shared with every rank below, then raised
            failure = exc
        _agree(plan, failure, device=self.device, timeout=timeout)
        # The stack, layer by layer (runtime.execute.stack), in the order of the ranks' collectives.
        # self.plan stays the plan as given (as saved, and as recapture checks it); the stack runs it at precision.
        stack = at_precision(stack, bf16_parameters=bf16_gathered_parameters(plan))  # FSDP2's bf16 copies
        stack = apply_fp8(stack, on=plan.precision == "fp8" if fp8 is None else fp8)  # linear matmuls in FP8
        stack = apply_groups(stack)  # collective: replica and tied-copy groups, tensor-parallel and FSDP2 meshes
        stack = apply_experts(stack, model)  # ep > 1 (collective): each stage's experts layers hold this member's slice
        stack = tie_parameters(stack)  # a weight two stages of this rank use: one Parameter
        stack = values_on_device(stack)
        stack = sync_tied_copies(stack)  # a tied weight's copies on other ranks: equal now, gradients summed
        stack = cast_values(stack)  # bf16: parameters in bfloat16
        stack = apply_tp(stack)  # tp > 1: each stage's layers split over the tensor-parallel group
        twice = stack.engine == "torch" and plan.schedule_data().splits_backward  # torch's B, then W: two backwards
        stack = apply_recompute(stack, backward_twice=twice)
        stack = apply_precision(stack, loss_fn)
        stack = apply_fsdp(stack)  # shard "full": each stage's runnable one FSDP2 unit over its stage group
        stack = apply_tp_io(stack)  # outermost: tensors enter and leave each stage as DTensors
        stack = apply_replicas(stack)  # DDP, or our reducer (W actions, several stages, DTensors), or neither
        self._stack = apply_runner(stack)
        self._ship = _target_route(self._stack, ships=batch == "replica" and loss_fn is not None)
        self._fed: set[str] = set()  # step / eval_step: whose first feeding the ranks compared
        self._shipping: list[Any] = []  # the target's sends in flight: buffers and works
        dist.barrier()
        self._clock_zero = time.time()  # right after a barrier: a common origin for traces

    def _rank_stack(self, plan: Plan, model: torch.nn.Module, *, engine: str | None) -> StageStack:
        """What one rank can check alone, its place, and its stages (recaptured, checked against the plan)."""
        self.engine = engine_from_env(engine)
        refusal = tensor_parallel_refusal(plan, engine=self.engine)  # before _place counts the ranks
        if refusal is not None:
            raise AutopartitionError(refusal)
        self.pipeline_rank, self.replica = _place(plan, self.rank, dist.get_world_size())
        check_shard_plan(plan)  # a shard mode the runtime cannot run: refused on every rank alike
        if self.engine == "torch":
            refusal = torch_engine_refusal(plan, trace=self.trace)
        if refusal is not None:
            raise AutopartitionError(refusal)
        validate(plan.schedule_data(), sends_to=plan.sends_to(), receives_from=plan.receives_from(),
                 stage_rank=plan.stage_ranks())
        # Every stage this rank holds: one with chunks == 1, several for interleaved and V schedules.
        self._stages = build_local_stages(plan, model, plan.stages_of(self.pipeline_rank))
        if self.engine == "torch" and (refusal := torch_stage_refusal(plan, self._stages)) is not None:
            raise AutopartitionError(refusal)  # every rank raises it (_agree, below)
        # A fully sharded rank keeps only its shard of each value (runtime.parallel.parallelize.shard_while_loading).
        self.shard_mode = rank_shard_mode(plan, self.pipeline_rank)
        return StageStack(plan, self._stages, rank=self.rank, pipeline_rank=self.pipeline_rank, replica=self.replica,
                          device=self.device, timeout=self.timeout, engine=self.engine, shard_mode=self.shard_mode)

    @property
    def _runner(self) -> Runner:
        assert self._stack.runner is not None  # apply_runner made it
        return self._stack.runner

    @property
    def _runnables(self) -> tuple[torch.nn.Module, ...]:
        """What runs each stage's forward: the stage module inside its layers' wrappers."""
        return self._stack.runnables

    @property
    def _run_plan(self) -> Plan:
        """The plan the ranks run: boundary tensors in the dtype the plan's precision computes them in."""
        return self._stack.plan

    @property
    def _sharding(self) -> ShardingLayer:
        return self._stack.layer(ShardingLayer)

    @property
    def _shard_units(self) -> list[torch.nn.Module]:
        """This rank's FSDP2 units (none unless its stages are planned ``full``)."""
        return self._sharding.units

    # ---------------------------------------------------------------- public

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return any(local.is_last for local in self._stages)

    @property
    def stages(self) -> tuple[int, ...]:
        """The stage indices this rank holds, ascending."""
        return tuple(local.plan.index for local in self._stages)

    @property
    def modules(self) -> tuple[torch.nn.Module, ...]:
        """This rank's stages (fx.GraphModules with the original parameter names), by stage index."""
        return tuple(local.module for local in self._stages)

    @property
    def module(self) -> torch.nn.Module:
        """This rank's stage, when it holds one (see :attr:`modules` for several)."""
        if len(self._stages) != 1:
            raise AutopartitionError(
                f"rank {self.rank} holds stages {list(self.stages)}: use Pipeline.modules, not .module"
            )
        return self._stages[0].module

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter this rank trains, once each (a tied one shared by two local stages once)."""
        for _, param in self.named_parameters():
            yield param

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters of every stage this rank holds, under the original model's names, once each."""
        seen: set[int] = set()
        for local in self._stages:
            for name, param in local.module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], **defaults: Any) -> torch.optim.Optimizer:
        """``optimizer_class(pipe.parameters(), **defaults)``, its state split over the replicas as the plan says.

        Under shard ``optimizer`` a ``ZeroRedundancyOptimizer`` (ZeRO-1) over this rank's stage group
        (``opt.step()`` updates this replica's share of the parameters and broadcasts them); under ``full``
        the parameters are already shards, so the plain optimizer is; under ``none`` it is the plain one.
        """
        experts = self._experts_layer()
        if experts is None or self._sharding.mode != "optimizer":
            return self._sharding.optimizer(self.parameters(), optimizer_class, **defaults)
        # ep > 1 under ZeRO-1: the dense parameters' state split over the replicas, the experts' kept whole.
        held = {id(p) for p in experts.parameters}
        dense = [p for p in self.parameters() if id(p) not in held]
        expert = [p for p in self.parameters() if id(p) in held]
        if not expert or not dense:
            return self._sharding.optimizer(dense, optimizer_class, **defaults) if dense else optimizer_class(
                expert, **defaults)
        return ExpertSplitOptimizer(self._sharding.optimizer(dense, optimizer_class, **defaults),
                                    optimizer_class(expert, **defaults))

    @property
    def dp_rank(self) -> int:
        """This rank's replica (0..dp-1): which share of the mini-batch it trains on."""
        return self.replica

    @property
    def dp_size(self) -> int:
        """Replicas of every stage (the plan's ``dp``)."""
        return self.plan.dp

    @property
    def tp_rank(self) -> int:
        """This rank's place (0..tp-1) in its stage's tensor-parallel group; 0 without tensor parallelism."""
        return self.plan.layout.coord(self.rank, "tp")

    @property
    def tp_size(self) -> int:
        """Ranks each stage's layers are split over (the plan's ``tp``)."""
        return self.plan.tp

    @property
    def needs_inputs(self) -> bool:
        """Whether a stage of this rank reads a model input; if not, step() and eval_step() take ``inputs=None``."""
        return any(local.signature.model_inputs for local in self._stages)

    @property
    def needs_target(self) -> bool:
        """Whether this rank reads the target: it computes the loss_fn, or (no loss_fn) it reads the inputs,
        which the target then joins as a keyword.  With ``batch="replica"`` and a loss_fn the first stage's
        ranks read it (with the inputs) and send it to the last stage, whose ranks then need none."""
        if self._loss_fn is None:
            return self.needs_inputs
        if self._batch == "replica":
            return 0 in self.stages
        return self.is_last_stage

    @reports_failures
    def step(self, inputs: Any = None, target: Any = None) -> torch.Tensor | None:
        """Forward and backward one mini-batch; gradients end up in ``.grad``.

        ``inputs`` has the structure the plan was made with: a tensor, a tuple, a
        dict of keywords, or ``(args, kwargs)``.  Every rank passes the same
        mini-batch (``batch="replica"``: its replica's share), or None where it
        reads no input (:attr:`needs_inputs`); ``target`` only where
        :attr:`needs_target` (``batch="replica"``: the first stage, which sends it
        on).  The first call compares what the ranks were given (see the class).
        Returns the mini-batch mean loss on the last stage's ranks, None on the others.
        """
        micro = self._feed(inputs, target, call="step")
        with self._stack.stepping(training=True):  # the layers' hooks: FSDP2's gradient sync off, DTensor's switches
            loss = self._runner.run(micro, record=self.trace)
        self._target_sent()
        self._stack.after_step()  # the replicas' average, then tied copies summed and tp gradients laid out
        return self._stack.layer(ReplicaLayer).mean(loss)

    @reports_failures
    def eval_step(self, inputs: Any = None, target: Any = None, *, return_outputs: bool = False) -> Any:
        """Forward one mini-batch without gradients (stages in eval mode); the mean loss on the last stage.

        Inputs as for :meth:`step`.  Micro-batches run as a simple forward chain
        (:mod:`runtime.evaluate`).  Returns the mini-batch mean loss on the last
        stage's ranks (None elsewhere, or without a target / model loss); with
        ``return_outputs``, ``(loss, outputs)``: the model outputs of this
        replica's samples on the last stage's ranks (micro-batches concatenated).
        Every rank must call it.
        """
        micro = self._feed(inputs, target, call="eval_step")
        with evaluation_mode([local.module for local in self._stages]), self._stack.stepping(training=False):
            loss, outputs = evaluate(
                self._run_plan, self._stack.zipped(self._runnables), micro, replica=self.replica,
                rank=self.rank, loss_fn=self._stack.loss_fn, device=self.device, timeout=self.timeout,
                keep_outputs=return_outputs,
            )
        self._stack.after_eval()  # FSDP2: what the forwards gathered is resharded (an optimizer step needs it so)
        self._target_sent()
        loss = self._stack.layer(ReplicaLayer).mean(loss)
        return (loss, concat_microbatches(outputs)) if return_outputs else loss

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the whole model's gradients as ``torch.nn.utils.clip_grad_norm_`` on the unsplit model would.

        The norm covers every stage once (replicas hold equal gradients after
        :meth:`step`) and a tied weight once; every rank gets the same norm back and
        scales its gradients (all copies and replicas) by the same factor.  Call it
        on every rank, after step() and before the optimizer step.
        """
        experts = self._experts_layer()
        return clip_gradients(
            self.plan, [(local.plan.index, local.module) for local in self._stages], replica=self.replica,
            # Shards count once: HSDP's other nodes hold copies of the first node's shards.
            sharded=self._sharding.counts_shards_once(self.replica, self.pipeline_rank),
            max_norm=max_norm, norm_type=norm_type, device=self.device, error_if_nonfinite=error_if_nonfinite,
            experts=set() if experts is None else {id(p) for p in experts.parameters}, tp_rank=self.plan.layout.coord(self.rank, "tp"),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the original model's names.

        A tied parameter appears under every name the model's own state dict gives
        it, whichever name the captured graph used for it.  Fully sharded stages
        give whole tensors, gathered over their replicas: every rank of such a
        stage must call it.
        """
        own: dict[str, torch.Tensor] = {}
        for local in self._stages:
            own.update({k: plain_tensor(v) for k, v in local.module.state_dict().items()})
        own = self.whole_experts(own)  # ep > 1: each expert slice gathered over the EP group
        state = {k: v for k, v in own.items() if k in self._state_keys}
        for name, aliases in self._aliases().items():
            for alias in aliases:
                if alias in self._state_keys:
                    state.setdefault(alias, own[name])
        return state

    def whole_experts(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` (this rank's, original names) with each expert slice replaced by the whole tensor.

        Without expert parallelism ``values`` as they are; with it a collective over this rank's EP
        group (every member calls it with the same kinds of entries: parameters, or gradients).
        """
        layer = self._experts_layer()
        return dict(values) if layer is None else layer.gather(values)

    def _experts_layer(self) -> ExpertsLayer | None:
        return next((layer for layer in self._stack.layers if isinstance(layer, ExpertsLayer)), None)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this stage's entries from a full (unpartitioned) state dict."""
        experts = self._experts_layer()
        if experts is not None:  # whole experts -> this member's slice
            state = experts.local(state)
        aliases = self._aliases()
        missing: list[str] = []
        loads: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
        for local in self._stages:
            wanted: dict[str, torch.Tensor] = {}
            for key in local.module.state_dict():
                if key not in self._state_keys and key not in aliases:
                    continue  # non-persistent buffers: not part of a checkpoint
                found = next((state[k] for k in (key, *aliases.get(key, ())) if k in state), None)
                if found is None:
                    missing.append(key)
                else:
                    wanted[key] = found
            loads.append((local.module, wanted))
        if missing:
            raise PlanMismatchError(
                f"The state dict lacks {len(missing)} entries this rank's stages need, e.g. {missing[:3]}. "
                "Load a checkpoint of the same model."
            )
        for module, wanted in loads:
            module.load_state_dict(_as_held(module, wanted), strict=False)
        self._stack.layer(TiedLayer).sync([module for module, _ in loads])

    def save_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        step: int = 0,
        keep: int | None = checkpoint.DEFAULT_KEEP,
    ) -> Path:
        """Every rank: write model, optimizer state, step and plan in the original names, atomically into
        ``directory/step-<step>``, keeping the newest ``keep`` steps (:mod:`runtime.state.checkpoint`); returns it."""
        return checkpoint.save_checkpoint(directory, modules=self.modules, plan=self.plan,
                                          keys=self._state_keys, optimizer=optimizer, step=step, keep=keep,
                                          experts=self._experts_layer())

    def load_checkpoint(
        self, directory: str | os.PathLike[str], *, optimizer: torch.optim.Optimizer | None = None
    ) -> int:
        """Every rank: load a checkpoint saved under any plan of this model (``directory``'s newest
        complete step, or one ``step-N`` folder); returns its step."""
        return checkpoint.load_checkpoint(directory, modules=self.modules, plan=self.plan,
                                          keys=self._state_keys, optimizer=optimizer, experts=self._experts_layer())

    def _aliases(self) -> dict[str, tuple[str, ...]]:
        """Each tied parameter this stage holds (by its name here) -> all of its names."""
        own = {p for local in self._stages for p in local.plan.parameters}
        return {name: t.aliases for t in self.plan.tied for name in t.aliases if name in own}

    @property
    def stage(self) -> int:
        """This rank's stage, when it holds one (see :attr:`stages` for several)."""
        if len(self._stages) != 1:
            raise AutopartitionError(f"rank {self.rank} holds stages {list(self.stages)}: use Pipeline.stages")
        return self._stages[0].plan.index

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every stage's state gathered on rank 0 (replica 0 of each stage), in the original names."""
        gathers = self._sharding.sharded is not None or self.plan.ep > 1  # every replica takes part
        state = self.state_dict() if self.replica == 0 or gathers else {}  # gathers shards
        local = {k: v.detach().cpu() for k, v in state.items()} if self.replica == 0 else {}
        gathered: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(local, gathered if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return merged

    def trace_events(self) -> list[TimelineEvent]:
        """This rank's recorded actions (``trace=True``), seconds from the common start."""
        events = []
        several = len(self._stages) > 1
        for record in self._runner.records:
            action = Action.parse(record.action)
            # With several stages per rank the label names the stage too (0F3 and 2F3 share a track).
            label = f"{action.stage}{action.kind}{action.microbatch}" if several else f"{action.kind}{action.microbatch}"
            events.append(TimelineEvent(
                track=self.rank, label=label, action=record.action,
                microbatch=action.microbatch, kind=action.kind,
                start_s=record.start_s - self._clock_zero, end_s=record.end_s - self._clock_zero,
            ))
        return events

    def write_trace(self, path: str | Path) -> Path | None:
        """Gather every rank's actions; rank 0 writes one Chrome trace (one track per rank)."""
        gathered: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(self.trace_events(), gathered if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        events = [e for part in gathered for e in part]
        return write_chrome_trace(Path(path), events, title="measured", pid=1, track_name="rank")

    # --------------------------------------------------------------- helpers

    def _feed(self, inputs: Any, target: Any, *, call: str) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
        """This replica's micro-batches (flat inputs, target), checked and paired (see the class doc)."""
        flat, target = self._flatten(inputs, target)
        micro = self._split(flat, target)  # the checks one rank can make alone first: a refusal sends nothing
        if call not in self._fed:
            self._check_feeds(flat, target, call=call)
            self._fed.add(call)
        if self._ship is None:
            return micro
        sender, receiver = self._ship
        tag = 2 * len(self.plan.stages) * self.plan.microbatches + (2 if call == "eval_step" else 0)
        if self.rank == sender:
            self._send_target(target, receiver, tag=tag, call=call)
            return micro
        shipped = self._split(None, self._recv_target(sender, tag=tag, call=call))
        return [(x, t) for (x, _), (_, t) in zip(micro, shipped)]

    def _check_feeds(self, flat: tuple[torch.Tensor, ...] | None, target: Any, *, call: str) -> None:
        """Every rank: refuse, on every rank, ranks that should share their samples but were given different ones."""
        fed: dict[str, str] = {}
        for spec, x in zip(self.plan.model.inputs, flat or ()):
            if x is not None:
                fed[f"input {spec.name!r}"] = _digest(x)
        if target is not None:
            fed["target"] = _digest(target)
        note = {
            "group": self.replica if self._batch == "replica" else 0,
            "stages": list(self.stages),
            "fed": fed,
            # The rank sending this replica's target to its last stage, and the one receiving it.
            "sends": self._ship is not None and self.rank == self._ship[0],
            "receives_from": self._ship[0] if self._ship is not None and self.rank == self._ship[1] else None,
        }
        notes = _gather_notes(note, device=self.device, timeout=self.timeout,
                              comparing=f"the data of the first {call}()", must=f"call {call}()")
        message = _feeding_message(notes, batch=self._batch, call=call)
        if message:
            raise AutopartitionError(message)

    def _send_target(self, target: Any, peer: int, *, tag: int, call: str) -> None:
        """Start sending this replica's target to its last stage (never blocks; waited for after the step)."""
        buffer = io.BytesIO()
        # Leaves cloned: a view would carry its whole storage.
        torch.save(pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, target),
                   buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        works = send_tensors([size], peer=peer, tag=tag) + send_tensors([data], peer=peer, tag=tag + 1)
        self._shipping = [size, data, *works]
        if target is None and call == "step":  # the last stage raises too, on receiving None
            raise AutopartitionError(_unsent_message(self.rank, self.replica))

    def _recv_target(self, sender: int, *, tag: int, call: str) -> Any:
        """The target this replica's first stage read with the inputs."""
        try:
            (size,) = recv_tensors([RecvSpec((1,), "int64")], peer=sender, tag=tag, device=self.device,
                                   timeout=self.timeout)
            (data,) = recv_tensors([RecvSpec((int(size.item()),), "uint8")], peer=sender, tag=tag + 1,
                                   device=self.device, timeout=self.timeout)
        except PeerFailure as exc:
            raise PeerFailure(
                f"Rank {self.rank} (last stage, replica {self.replica}) waited for the target from rank {sender} "
                f"(first stage), which reads it with the inputs: {exc}"
            ) from exc
        # weights_only: tensors and their containers, never code, even from a rank of this job.
        target = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
        if target is None and call == "step":
            raise AutopartitionError(_unsent_message(sender, self.replica))
        return target

    def _target_sent(self) -> None:
        """Wait for the target's sends of this step (started before it, so long done)."""
        shipping, self._shipping = self._shipping, []
        works: list[Work] = [w for w in shipping if not isinstance(w, torch.Tensor)]
        wait_all(works, timeout=self.timeout)

    def _flatten(self, inputs: Any, target: Any) -> tuple[tuple[torch.Tensor, ...] | None, Any]:
        """The plan's flat input tensors (None: not given); without a loss_fn the target joins them as its keyword."""
        if inputs is None:
            if self.needs_inputs:
                names = sorted({n for local in self._stages for n in local.signature.model_inputs})
                raise AutopartitionError(
                    f"Rank {self.rank} got inputs=None, but its stages {list(self.stages)} read the model "
                    f"inputs {names}. Pass the inputs on every rank where Pipeline.needs_inputs is True."
                )
            return None, target if self._loss_fn is not None else None
        call = self._stages[0].captured.call
        if self._loss_fn is not None or target is None:
            return call.flatten(inputs), target
        keyword = self._target_keyword
        if keyword is None:
            given = split_call(inputs)[1]
            missing = [k for k in call.kwargs if k not in given]
            if len(missing) != 1:
                raise AutopartitionError(
                    "step() got a target but the Pipeline has no loss_fn, and the keyword to pass it as is "
                    f"unclear (planned keywords missing from the inputs: {missing or 'none'}). Pass "
                    "Pipeline(..., target_keyword='labels'), or put the target into the inputs."
                )
            keyword = missing[0]
        return call.flatten(inputs, extra={keyword: target}), None

    def _split(
        self, inputs: tuple[torch.Tensor, ...] | None, target: Any
    ) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
        """Each micro-batch of this replica's share: (flat inputs, target); placeholders where none are read."""
        plan = self.plan
        expected = [t.shape for t in plan.model.inputs]
        batch = plan.batch_size
        per_replica = batch // plan.dp
        if inputs is None:  # this rank's stages read no input: only the count matters
            inputs = tuple(None for _ in expected)  # type: ignore[misc]
        elif len(inputs) != len(expected):
            raise AutopartitionError(f"The plan's model takes {len(expected)} inputs; step() got {len(inputs)}.")
        elif self._batch == "replica":
            for i, x in enumerate(inputs):
                if x.shape[0] != per_replica:
                    raise AutopartitionError(
                        f"Input {i} has batch {x.shape[0]}, but with batch='replica' each rank passes its "
                        f"replica's {per_replica} samples (the plan's mini-batch of {batch} over {plan.dp} "
                        f"replicas). Pass batches of {per_replica}, or batch='global' and the whole mini-batch."
                    )
        else:
            for i, x in enumerate(inputs):
                if x.shape[0] != batch:
                    raise AutopartitionError(
                        f"Input {i} has batch {x.shape[0]}, but the plan was made for batches of {batch} "
                        f"({plan.dp} replicas x {plan.microbatches} micro-batches of {plan.microbatch_size}). "
                        f"Pass batches of {batch}, or re-plan with --batch-size {x.shape[0]}."
                    )
        lo = 0 if self._batch == "replica" else self.replica * per_replica

        def piece(value: Any, mb: int) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            start = lo + mb * plan.microbatch_size
            return value[start : start + plan.microbatch_size].to(self.device)

        return [
            (tuple(piece(x, mb) for x in inputs), pytree.tree_map(lambda v, mb=mb: piece(v, mb), target))
            for mb in range(plan.microbatches)
        ]


def _check_batch(batch: str) -> None:
    if batch not in BATCH_MODES:
        raise AutopartitionError(
            f"batch={batch!r}: pass 'global' (every rank gets the whole mini-batch) or 'replica' (each "
            "rank gets only its replica's batch_size / dp samples)."
        )


def _target_route(stack: StageStack, *, ships: bool) -> tuple[int, int] | None:
    """batch="replica" with a loss_fn: the target travels from the rank that read the inputs (stage 0) to the
    last stage, so that every sample's target meets its own inputs whatever sampler fed the last stage.
    (sender, receiver) where this rank is one of them, else None."""
    plan, rank = stack.plan, stack.rank
    # tp > 1: the target goes to this rank's counterpart (same replica and tensor-parallel rank)
    first, last = (plan.layout.moved(rank, pp=plan.stages[s].rank) for s in (0, -1))
    return (first, last) if ships and first != last and rank in (first, last) else None


def _as_held(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors laid out as ``module`` holds them: this rank's shard where it holds a ``DTensor``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    held = module.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        now = held.get(key)
        if isinstance(now, DTensor) and not isinstance(value, DTensor):
            # Every replica holds the whole tensor: each takes its own shard, nothing is sent.
            value = distribute_tensor(value.to(now.device, now.dtype), now.device_mesh, now.placements,
                                      src_data_rank=None)
        out[key] = value
    return out


def _digest(value: Any) -> str:
    """sha256 of a pytree of tensors (structure, dtypes, shapes and bytes): equal data, equal digests."""
    leaves, spec = pytree.tree_flatten(value)
    h = hashlib.sha256(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            h.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            h.update(leaf.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


_SHARD_FIX = (
    "shard with DistributedSampler(dataset, num_replicas=pipe.dp_size, rank=pipe.dp_rank) (the same seed "
    "on every rank), not over the global rank: every rank of one replica must get the same samples"
)


def _feeding_message(notes: list[dict[str, Any]], *, batch: str, call: str) -> str | None:
    """Why the ranks' first batches cannot train together (None: they can)."""
    def who(ranks: list[int]) -> str:
        stages = sorted({s for r in ranks for s in notes[r]["stages"]})
        return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                f"(stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})")

    problems: list[str] = []
    for group in sorted({n["group"] for n in notes}):
        members = [r for r, n in enumerate(notes) if n["group"] == group]
        where = f"replica {group}" if batch == "replica" else "the job"
        for field in sorted({f for r in members for f in notes[r]["fed"]}):
            holders: dict[str, list[int]] = {}
            for r in members:
                if field in notes[r]["fed"]:
                    holders.setdefault(notes[r]["fed"][field], []).append(r)
            if len(holders) > 1:
                problems.append(f"in {where}, the {field} of {' differs from that of '.join(map(who, holders.values()))}")
    # A target the first stage must send but was not given: always wrong in step(); in eval_step() (where
    # None means no loss) wrong when the last stage was given one (it would be replaced by None).
    given_last = {n["receives_from"] for n in notes if n["receives_from"] is not None and "target" in n["fed"]}
    unsent = [r for r, n in enumerate(notes)
              if n["sends"] and "target" not in n["fed"] and (call == "step" or r in given_last)]
    if problems:
        if batch == "replica":
            fix = (f"With batch='replica' inputs and target would come from different samples: {_SHARD_FIX}.")
        else:
            fix = ("With batch='global' every rank passes the same whole mini-batch (the same data order and "
                   f"seed on every rank); or use batch='replica' and {_SHARD_FIX}.")
        return (f"The ranks were given different data for the first step: {'; '.join(problems)}. {fix} A rank may "
                "pass None for what it does not read (pipe.needs_inputs, pipe.needs_target). No rank has trained.")
    if unsent:
        return _unsent_message(unsent[0], notes[unsent[0]]["group"])
    return None


def _unsent_message(rank: int, replica: int) -> str:
    return (
        f"Rank {rank} (stage 0, replica {replica}) got target=None: with batch='replica' the first stage's ranks "
        "read the target with the inputs and send it to the last stage, so that every sample's target meets its "
        "own inputs. Pass the target on the ranks where pipe.needs_target is True."
    )



# ---------------------------------------------------------- one plan for all

_SAFE_PATTERN = (
    "Every rank must run one plan: compile it once and save it (`plan.save(\"plan/\")`, or "
    "`autopartition model.py --gpus N --out plan/`), then `Plan.load(\"plan/\")` in every rank, or start "
    "the ranks with `autopartition run plan/ -- train.py`. (`partitioner.compile()` called in every rank "
    "after init_process_group solves on rank 0 and sends that plan to the others.)"
)



def _place(plan: Plan, rank: int, world: int) -> tuple[int, int]:
    """This rank's (stage, replica), once the job has the plan's rank count."""
    if world != plan.gpus:
        raise AutopartitionError(
            f"The plan needs {plan.gpus} ranks ({plan.pp} stages x {plan.dp} replicas"
            f"{f' x {plan.tp} tensor-parallel' if plan.tp > 1 else ''}) but "
            f"{world} were started. Launch with --nproc-per-node {plan.gpus} (or nodes x procs = {plan.gpus})."
        )
    return plan.rank_layout()[rank]


def _agree(plan: Plan, failure: Exception | None, *, device: torch.device, timeout: float) -> None:
    """One collective before any step: every rank's plan digest, and whether it could build its stage.

    Raises on every rank (the same message) when the plans differ or any rank failed;
    a rank that failed itself re-raises its own exception.
    """
    replicas = "replica" if plan.dp == 1 else "replicas"
    note = {
        "digest": plan_digest(plan),
        "sections": plan_sections(plan),
        "fingerprint": plan.model.fingerprint,
        "layout": f"{plan.pp} stages x {plan.dp} {replicas}, compute nodes per stage "
                  f"{[s.compute_nodes for s in plan.stages]}",
        "failure": None if failure is None else
                   (type(failure).__name__, str(failure), isinstance(failure, AutopartitionError)),
    }
    notes = _gather_notes(note, device=device, timeout=timeout, comparing="plans", must="build a Pipeline")
    if len({n["digest"] for n in notes}) > 1:
        raise PlanMismatchError(_mismatch_message(notes))
    if failure is not None:
        raise failure
    failed = [(r, n["failure"]) for r, n in enumerate(notes) if n["failure"] is not None]
    if failed:
        rank, (kind, message, user) = failed[0]
        text = f"Rank {rank} cannot run the plan: {message}"
        if not user:  # a bug or a crash there, not bad input
            raise PeerFailure(f"Rank {rank} failed while building its stage ({kind}: {message}); see its traceback.")
        cls = getattr(errors, kind, None)
        raise (cls if isinstance(cls, type) and issubclass(cls, AutopartitionError) else AutopartitionError)(text)


def _mismatch_message(notes: list[dict[str, Any]]) -> str:
    """Who holds which plan (ranks grouped by digest), how they differ, and what to do."""
    groups: dict[str, list[int]] = {}
    for rank, n in enumerate(notes):
        groups.setdefault(n["digest"], []).append(rank)
    holders = []
    for digest, ranks in groups.items():
        n = notes[ranks[0]]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        holders.append(f"{who} {'holds' if len(ranks) == 1 else 'hold'} plan {digest[:12]} "
                       f"({n['layout']}; model fingerprint {n['fingerprint']})")
    sections = [n["sections"] for n in notes]
    fields = sorted({k for s in sections for k in s if len({str(t.get(k)) for t in sections}) > 1})
    models = "" if len({n["fingerprint"] for n in notes}) == 1 else (
        " The ranks also built different models: every rank must build the same one.")
    return (
        f"The ranks hold different plans ({'; '.join(holders)}); they differ in {', '.join(fields)}. "
        f"Running them would compute a wrong loss or hang, so no rank starts.{models} {_SAFE_PATTERN}"
    )


def _gather_notes(note: dict[str, Any], *, device: torch.device, timeout: float, comparing: str,
                  must: str) -> list[Any]:
    """Every rank's ``note`` (an all-gather of JSON-able objects); a rank that does not answer is a PeerFailure."""
    notes: list[Any] = [None] * dist.get_world_size()
    # Objects travel as tensors on the current device: under NCCL that must be this rank's GPU.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    try:
        with on_device:
            dist.all_gather_object(notes, note)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise PeerFailure(
            f"Rank {dist.get_rank()}: not every rank answered while comparing {comparing} (timeout {timeout:g} s): "
            f"{first}. Every rank must {must}."
        ) from exc
    return notes
