"""Rank entry points and one-process references for the runtime precision, recomputation, clipping and eval tests.

``train_worker`` builds a :class:`runtime.Pipeline` from a saved plan and trains a
few SGD steps as its ``config`` says (optionally clipping after each step's
backward, then one ``eval_step``), writing what it saw to ``rank{R}.pt``.
``reference_run`` does the same training on the whole model in this process, the
way the pipeline computes it (the same micro-batches, ``loss / M`` per
micro-batch, replicas' gradients averaged), under the same precision.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from rank_workers import error_of
from torch import nn

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile

__all__ = ["plan_model", "reference_run", "train_worker"]


def plan_model(
    spec: str, directory: Path, *, pp: int, dp: int = 1, microbatches: int, schedule: str = "1f1b",
    batch: int = 8, precision: str = "fp32", recompute: str = "none",
) -> Plan:
    """Plan model file ``spec`` with a fixed shape, precision and recomputation (h100 costs: deterministic)."""
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    plan = compile(
        model_file.build(), model_file.example_inputs(batch), gpus=pp * dp, pp=pp, dp=dp,
        microbatches=microbatches, schedule=schedule, device="h100", precision=precision, recompute=recompute,
    )
    plan.save(directory)
    assert (plan.pp, plan.dp, plan.microbatches, plan.precision) == (pp, dp, microbatches, precision)
    return plan



def _rows(value: Any, lo: int, hi: int) -> Any:
    return value[lo:hi] if isinstance(value, torch.Tensor) else tuple(v[lo:hi] for v in value)



def train_worker(rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str, config: dict[str, Any]) -> None:
    """Train ``config["steps"]`` SGD steps through a Pipeline; record losses, state, clipping and eval results.

    ``config``: ``lr``; ``pipeline`` (keyword arguments of Pipeline); ``clip``: one
    ``(max_norm, norm_type)`` per step or None; ``feed``: ``"all"`` (every rank gets
    the inputs and target) or ``"needed"`` (only where ``needs_inputs`` /
    ``needs_target``, None elsewhere); ``eval``: run ``eval_step`` after training;
    ``check_errors``: first record the errors of a step without inputs and of one
    with the whole mini-batch (wrong under ``batch="replica"``) on ranks that read inputs.
    """
    import torch.distributed as dist

    from runtime.pipeline import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    plan = Plan.load(plan_dir)
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60,
                    **config.get("pipeline", {}))
    inputs = model_file.example_inputs(plan.batch_size)
    target = model_file.example_target(plan.batch_size)  # type: ignore[misc]
    if config.get("pipeline", {}).get("batch") == "replica":
        size = plan.batch_size // pipe.dp_size
        lo = pipe.dp_rank * size
        inputs, target = _rows(inputs, lo, lo + size), target[lo : lo + size]
    if config.get("feed") == "needed":
        inputs = inputs if pipe.needs_inputs else None
        target = target if pipe.needs_target else None
    errors: dict[str, str | None] = {}
    if pipe.needs_inputs and config.get("check_errors"):  # both raise before any message is sent
        errors["no_inputs"] = error_of(lambda: pipe.step(None, target))
        errors["global_batch"] = error_of(lambda: pipe.step(model_file.example_inputs(plan.batch_size), target))
    result: dict[str, Any] = {
        "needs_inputs": pipe.needs_inputs, "needs_target": pipe.needs_target,
        "dtypes": {b.producer: b.dtype for s in pipe._run_plan.stages for b in s.outputs},
        "parameter_dtypes": sorted({str(p.dtype) for p in pipe.parameters()}),
        "runtime_modules": sorted({type(x).__name__ for m in pipe._runnables for x in m.modules()}),
        "losses": [], "norms": [], "clipped": [], "errors": errors,
    }
    opt = torch.optim.SGD(pipe.parameters(), lr=config["lr"])
    clips = config.get("clip") or [None] * config["steps"]
    for clip in clips:
        opt.zero_grad()
        loss = pipe.step(inputs, target)
        result["losses"].append(None if loss is None else float(loss))
        if clip is not None:
            norm = pipe.clip_grad_norm_(clip[0], norm_type=clip[1])
            result["norms"].append(float(norm))
            result["clipped"].append({n: p.grad.detach().clone() for n, p in pipe.named_parameters()
                                      if p.grad is not None})
        opt.step()
    result["state"] = {k: v.detach().float().clone() for k, v in pipe.state_dict().items()}
    if config.get("eval"):
        loss, outputs = pipe.eval_step(inputs, target, return_outputs=True)
        result["eval_loss"] = None if loss is None else float(loss)
        result["eval_outputs"] = outputs
        result["grad_enabled_after_eval"] = torch.is_grad_enabled()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def reference_run(
    spec: str, *, dp: int, microbatches: int, batch: int = 8, steps: int, lr: float, precision: str = "fp32",
    whole_batch: bool = False, clip: list[tuple[float, float]] | None = None, evaluate: bool = False,
) -> dict[str, Any]:
    """The pipeline's training on the whole model in one process (see the module docstring).

    ``whole_batch``: one forward of the whole mini-batch instead (what a user
    without a pipeline runs).  Under ``bf16-mixed`` forward and loss run under
    CPU autocast; under ``bf16`` the model and its floating inputs are bfloat16; under ``fp8`` the
    whole captured graph runs with its linear matmuls in FP8 (runtime/state/fp8.py) under autocast.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a reduction split over threads sums in another order
    try:
        return _reference(spec, dp=dp, microbatches=microbatches, batch=batch, steps=steps, lr=lr,
                          precision=precision, whole_batch=whole_batch, clip=clip, evaluate=evaluate)
    finally:
        torch.set_num_threads(threads)


def _reference(
    spec: str, *, dp: int, microbatches: int, batch: int, steps: int, lr: float, precision: str,
    whole_batch: bool, clip: list[tuple[float, float]] | None, evaluate: bool,
) -> dict[str, Any]:
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    model: nn.Module = model_file.build()
    if precision == "bf16":
        model.to(torch.bfloat16)
    inputs = model_file.example_inputs(batch)
    target = model_file.example_target(batch)  # type: ignore[misc]
    if precision == "bf16":
        inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)
    autocast = precision in ("bf16-mixed", "fp8")
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    forward: Any = model
    if precision == "fp8":  # the whole captured graph with the FP8 matmuls the ranks run (it reads model's parameters)
        from partitioner.graph.capture import capture
        from partitioner.graph.fp8 import fp8_matmuls
        from runtime.state.fp8 import convert_graph

        captured = capture(model, tuple(_rows(inputs, 0, batch // (dp * microbatches))))
        convert_graph(captured.graph_module, fp8_matmuls(captured.graph_module))

        def forward(*args: Any) -> Any:
            return captured.unflatten_outputs(captured.graph_module(*args))
    pieces = [(0, batch, 1.0)] if whole_batch else [
        (lo, lo + batch // (dp * microbatches), 1.0 / (microbatches * dp))
        for lo in range(0, batch, batch // (dp * microbatches))
    ]
    losses: list[float] = []
    norms: list[float] = []
    clipped: list[dict[str, torch.Tensor]] = []
    for step in range(steps):
        opt.zero_grad()
        total = []
        for lo, hi, scale in pieces:
            with context():
                loss = model_file.loss_fn(forward(*_rows(inputs, lo, hi)), target[lo:hi])
            (loss * scale if scale != 1.0 else loss).backward()
            total.append(loss.detach() * scale)
        losses.append(float(torch.stack(total).sum()))
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip[step][0], norm_type=clip[step][1])))
            clipped.append({n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
    result: dict[str, Any] = {
        "losses": losses, "norms": norms, "clipped": clipped,
        "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
    }
    if evaluate:
        model.eval()
        with torch.no_grad(), context():
            outputs = model(*inputs)
            result["eval_loss"] = float(model_file.loss_fn(outputs, target))
        result["eval_outputs"] = outputs
    return result
