"""Rank entry point and one-process reference for the sharded-replica tests (tests/test_shard_runtime.py).

``shard_worker`` runs several cases in one job (one spawn of the ranks): for each,
a :class:`runtime.Pipeline` over a saved plan whose stages carry a shard mode,
``STEPS`` AdamW steps (the optimizer built with ``pipe.optimizer`` or, the old
way, over ``pipe.parameters()``; or SGD), optionally ``clip_grad_norm_`` and an
``eval_step`` before each optimizer step; it records losses, norms, the whole trained state and how the state was
held (optimizer class, parameter types, local sizes) into ``<out>/<case>-rank<R>.pt``; with ``grads`` each
step's gradients (gathered whole), with ``probe`` what the FSDP2 units compute with and hold (:class:`_FsdpProbe`).
A case may save a checkpoint after training (``save``) or resume from one before
(``load``: then it trains ``steps``, by default 1).  ``reference`` trains the whole model in this process the way the pipeline
computes it: the same micro-batches, each loss scaled by ``1 / (M x dp)``.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile

__all__ = ["LR", "SGD_LR", "STEPS", "plan_sharded", "reference", "shard_worker"]

STEPS = 3
LR = 1e-3
SGD_LR = 0.1


def plan_sharded(
    spec: str, directory: Path, *, schedule: str, shard: str | tuple[str, ...], reshard_after_forward: bool = False,
    pp: int = 2, dp: int = 2, microbatches: int = 2, batch: int = 8, recompute: str = "none",
    gpus_per_node: int | None = None, precision: str = "fp32", shard_span: str = "world",
) -> Plan:
    """Plan ``spec`` (predicted h100 costs: deterministic) at ``precision``, give every stage ``shard`` (a tuple:
    one per stage, fully sharded ones over ``shard_span``) and ``recompute`` (``gpus_per_node``: nodes of that
    many ranks), save it into ``directory``."""
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    plan = compile(model_file.build(), model_file.example_inputs(batch), gpus=pp * dp, pp=pp, dp=dp,
                   microbatches=microbatches, schedule=schedule, device="h100", precision=precision)
    modes = shard if isinstance(shard, tuple) else (shard,) * len(plan.stages)
    assert len(modes) == len(plan.stages), (modes, len(plan.stages))
    stages = tuple(dataclasses.replace(s, shard=m, reshard_after_forward=reshard_after_forward and m == "full",
                                       recompute=recompute, shard_span=shard_span if m == "full" else "world")
                   for s, m in zip(plan.stages, modes))
    plan = dataclasses.replace(plan, stages=stages)
    if gpus_per_node is not None:
        plan = dataclasses.replace(plan, gpus_per_node=gpus_per_node)
    plan.save(directory)
    return plan


def shard_worker(rank: int, world: int, port: int, spec: str, out_dir: str, cases: list[dict[str, Any]]) -> None:
    """Run every case in turn (see the module docstring); a case that raises records its error."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from runtime.parallel.shard import LayeredStage
    from runtime.pipeline import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    for case in cases:
        started = time.monotonic()
        result: dict[str, Any] = {"losses": [], "norms": [], "error": None}
        try:
            model_file = load_model_file(case.get("spec", spec))
            plan = Plan.load(case["plan"])
            torch.manual_seed(0)
            probe: _FsdpProbe | None = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"),
                                timeout=60)
                if case.get("probe"):
                    probe = _FsdpProbe(pipe)
                opt: torch.optim.Optimizer
                if case.get("optimizer") == "sgd":  # gradients compared as they are (Adam magnifies tiny ones' noise)
                    opt = torch.optim.SGD(pipe.parameters(), lr=SGD_LR)
                else:
                    opt = (pipe.optimizer(torch.optim.AdamW, lr=LR) if case.get("optimizer") == "pipe"
                           else torch.optim.AdamW(pipe.parameters(), lr=LR))
                if case.get("load"):  # resume: model and optimizer state saved under another plan
                    result["loaded_step"] = pipe.load_checkpoint(case["load"], optimizer=opt)
                inputs = model_file.example_inputs(plan.batch_size)
                target = model_file.example_target(plan.batch_size)  # type: ignore[misc]
                for _ in range(case.get("steps", STEPS)):
                    opt.zero_grad()
                    loss = pipe.step(inputs, target)
                    result["losses"].append(None if loss is None else float(loss))
                    if case.get("grads"):  # the step's averaged gradients, gathered whole (before clipping moves them)
                        result.setdefault("grads", []).append(
                            {n: _whole(p.grad).float().clone() for n, p in pipe.named_parameters()
                             if p.grad is not None})
                        result["grad_dtypes"] = sorted({str(p.grad.dtype) for p in pipe.parameters()
                                                        if p.grad is not None})
                    if case.get("clip") is not None:
                        result["norms"].append(float(pipe.clip_grad_norm_(case["clip"])))
                    if case.get("eval"):  # between backward and optimizer step: the next forward must see the step
                        evaluated = pipe.eval_step(inputs, target)
                        result.setdefault("eval_losses", []).append(None if evaluated is None else float(evaluated))
                    opt.step()
            if probe is not None:
                result["probe"] = probe.close()
            if case.get("save"):
                pipe.save_checkpoint(case["save"], optimizer=opt, step=STEPS)
            result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            result["optimizer"] = type(opt).__name__
            result["runtime_modules"] = sorted({type(x).__name__ for m in pipe._runnables for x in m.modules()})
            result["fsdp_units"] = sum(isinstance(x, FSDPModule) for m in pipe._runnables for x in m.modules())
            result["layered_recompute"] = [x.recompute for m in pipe._runnables for x in m.modules()
                                           if isinstance(x, LayeredStage)]
            result["parameter_types"] = sorted({type(p).__name__ for p in pipe.parameters()})
            result["graph_calls"] = sorted({getattr(n.target, "__name__", "") for m in pipe.modules
                                            for n in m.graph.nodes  # type: ignore[union-attr]
                                            if n.op == "call_function"})
            result["local_numel"] = sum(_local(p).numel() for p in pipe.parameters())
            result["whole_numel"] = sum(p.numel() for p in pipe.parameters())
            if case.get("mesh"):  # the FSDP2 mesh's dimensions: name -> size
                mesh = next(p.device_mesh for p in pipe.parameters())  # type: ignore[attr-defined]
                result["mesh"] = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
            result["state"] = {k: v.detach().float().clone() for k, v in pipe.state_dict().items()}
            if case.get("optimizer") == "pipe" and hasattr(opt, "consolidate_state_dict"):
                # ZeRO-1: this replica holds Adam state for its share of the parameters only.
                result["optimizer_states"] = len(opt.optim.state)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()
        result["seconds"] = time.monotonic() - started
        torch.save(result, Path(out_dir) / f"{case['name']}-rank{rank}.pt")
        if result["error"] is not None and not case.get("expect_error"):
            break  # the others would wait for this rank in a collective: stop the job
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


class _FsdpProbe:
    """What this rank's FSDP2 units compute with and hold beyond their shards, as the step runs (case "probe").

    ``weight_dtypes``: the dtypes of the weights every parametrised leaf module of the stages saw in its
    forward.  ``policies``: each unit's (param_dtype, reduce_dtype).  ``moments``: bytes held at each unit's
    post-backward entry (the end of its backward: the most a unit holds) and at each forward of a leaf
    module, summed over the rank's units: gathered weights (FSDP2's all-gather outputs), unsharded
    gradients (the backward's, in the compute dtype), the unsharded accumulator (reduce dtype) and the
    reduce-scatter input buffers still held; with the elements of the unit in its backward.  Reads FSDP2's
    private state (torch 2.13): a probe for this test, nothing the runtime relies on.
    """

    def __init__(self, pipe: Any) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.weight_dtypes: set[str] = set()
        self.moments: list[dict[str, Any]] = []
        states = [fully_shard.state(m) for unit in pipe._shard_units for m in unit.modules()  # type: ignore[attr-defined]
                  if isinstance(m, FSDPModule)]
        self.policies = sorted({(str(st._mp_policy.param_dtype), str(st._mp_policy.reduce_dtype)) for st in states})
        self._groups = [g for st in states for g in st._fsdp_param_groups]
        self._handles = []
        for stage in pipe.modules:
            for module in stage.modules():
                if any(True for _ in module.parameters(recurse=False)):
                    self._handles.append(module.register_forward_pre_hook(self._forward))
        self._original = FSDPParamGroup.post_backward
        probe = self

        def post_backward(group: Any, *args: Any) -> Any:
            if group in probe._groups and getattr(group, "_training_state", None) is not None:
                probe.moments.append(probe._held("backward", group))
            return probe._original(group, *args)

        FSDPParamGroup.post_backward = post_backward  # type: ignore[method-assign,assignment]

    def _forward(self, module: nn.Module, args: Any) -> None:
        self.weight_dtypes.update(str(p.dtype) for p in module.parameters(recurse=False))
        if torch.is_grad_enabled():
            self.moments.append(self._held("forward", None))

    def _held(self, when: str, group: Any) -> dict[str, Any]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()

        params = [fp for g in self._groups for fp in g.fsdp_params]
        buffers = {id(st.reduce_scatter_input): nbytes(st.reduce_scatter_input)
                   for g in self._groups for st in g.comm_ctx.reduce_scatter_states}
        return {
            "when": when,
            "elements": 0 if group is None else sum(fp._orig_size.numel() for fp in group.fsdp_params),
            # A prefetched unit's all-gather lands in one flat buffer, copied out when the unit is used.
            "gathered": sum(nbytes(t) for fp in params for t in fp.all_gather_outputs)
            + sum(nbytes(g._all_gather_result.all_gather_output) for g in self._groups
                  if getattr(g, "_all_gather_result", None) is not None),
            "grads": sum(nbytes(fp._unsharded_param.grad) for fp in params if hasattr(fp, "_unsharded_param")),
            "accumulated": sum(nbytes(fp.unsharded_accumulated_grad) for fp in params),
            "reduce_scatter_input": sum(buffers.values()),
        }

    def close(self) -> dict[str, Any]:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        FSDPParamGroup.post_backward = self._original  # type: ignore[method-assign]
        for handle in self._handles:
            handle.remove()
        return {"weight_dtypes": sorted(self.weight_dtypes), "policies": self.policies, "moments": self.moments,
                "unit_elements": [sum(fp._orig_size.numel() for fp in g.fsdp_params) for g in self._groups]}


def _whole(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def reference(
    spec: str, *, dp: int, microbatches: int, batch: int = 8, clip: float | None = None, steps: int = STEPS,
    optimizer: str = "adamw", precision: str = "fp32",
) -> dict[str, Any]:
    """The pipeline's training on the whole model in one process: losses, norms, each step's gradients and the
    trained state (``bf16-mixed``: forward and loss under CPU autocast, as runtime.state.precision runs them)."""
    import contextlib

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a reduction split over threads sums in another order
    try:
        model_file = load_model_file(spec)
        torch.manual_seed(0)
        model: nn.Module = model_file.build()
        inputs = model_file.example_inputs(batch)
        target = model_file.example_target(batch)  # type: ignore[misc]
        opt: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=SGD_LR) if optimizer == "sgd"
                                      else torch.optim.AdamW(model.parameters(), lr=LR))
        size = batch // (dp * microbatches)
        losses: list[float] = []
        norms: list[float] = []
        grads: list[dict[str, torch.Tensor]] = []
        for _ in range(steps):
            opt.zero_grad()
            total = []
            for lo in range(0, batch, size):
                loss_fn = model_file.loss_fn
                assert loss_fn is not None, f"{spec} has no loss_fn"
                with (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed"
                      else contextlib.nullcontext()):
                    loss = loss_fn(model(*(x[lo : lo + size] for x in inputs)), target[lo : lo + size])
                (loss / (dp * microbatches)).backward()
                total.append(loss.detach() / (dp * microbatches))
            losses.append(float(torch.stack(total).sum()))
            grads.append({n: p.grad.detach().float().clone()  # a tied parameter under each of its names
                          for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None})
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
        return {"losses": losses, "norms": norms, "grads": grads,
                "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()}}
    finally:
        torch.set_num_threads(threads)
