"""The stage stack's value steps: this rank's stages get their values, at the plan's precision, on the device.

``Pipeline`` applies them in order (around the parallel steps of
:mod:`runtime.parallel.parallelize`, whose collectives come between them):

* :func:`load_values` (before the ranks agree on the plan): ``weights=`` read into
  this rank's stages (:mod:`~runtime.state.weights`), and a meta model's tensors made
  real (:mod:`~runtime.state.materialise`), or kept as shards until its stages are
  sharded (``keep``);
* :func:`at_precision`: the plan the ranks run, boundary tensors in the dtype the
  plan's precision computes them in (:func:`~runtime.state.precision.plan_at_precision`);
* :func:`apply_fp8`: under ``fp8``, each stage graph's linear matmuls rewritten into FP8 ones
  (:mod:`~runtime.state.fp8`);
* :func:`values_on_device`, :func:`cast_values`: the stages on this rank's device,
  their parameters in bfloat16 under ``bf16``;
* :func:`apply_precision`: each stage's forward and the loss under the plan's precision.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection

import torch
from torch import nn

from partitioner.graph.fp8 import fp8_matmuls
from runtime.execute.stack import LossFn, StageStack
from runtime.execute.stage import example_microbatch
from runtime.state.fp8 import convert_graph
from runtime.state.materialise import InitWeights, materialise_modules, materialised_values
from runtime.state.precision import (
    PrecisionForward,
    cast_parameters,
    plan_at_precision,
    precision_loss,
)
from runtime.state.weights import load_weights

__all__ = ["apply_fp8", "apply_precision", "at_precision", "cast_values", "load_values", "values_on_device"]


def load_values(
    stack: StageStack, model: nn.Module, *, weights: str | os.PathLike[str] | None, keys: Collection[str],
    seed: int, init_weights: InitWeights | None, keep: Callable[[torch.Tensor, bool], torch.Tensor] | None,
) -> StageStack:
    """This rank's tensors only: ``weights`` (meta ones are replaced, the rest copied into); then a model built
    on meta gets real tensors for these stages only, initialised per module under seeds from (seed, module
    name), so every partition starts from the same values.  ``keep``: what a rank holds of each value (its
    shard, one module at a time), kept in the stack until the sharding step puts it in."""
    if weights is not None:
        load_weights(stack.held, weights, keys=keys, tied=stack.plan.tied)
    if keep is not None:
        deferred = materialised_values(model, stack.held, seed=seed, init_weights=init_weights, device=stack.device,
                                       keep=keep)
        return stack.replace(deferred=deferred)
    materialise_modules(model, stack.held, seed=seed, init_weights=init_weights, device=stack.device)
    return stack


def at_precision(stack: StageStack, *, bf16_parameters: tuple[str, ...]) -> StageStack:
    """The plan the ranks run: boundary tensors in the dtype the plan's precision computes them in, found by
    fake propagation of the whole graph (every rank finds the same); each stage's plan follows it.

    ``bf16_parameters``: parameters read in bfloat16 anyway (FSDP2's copies under bf16-mixed).
    """
    plan = plan_at_precision(stack.plan, stack.stages[0].captured.graph_module, example_microbatch(stack.plan),
                             device_type=stack.device.type, bf16_parameters=bf16_parameters)
    for local in stack.stages:
        local.plan = plan.stages[local.plan.index]
    return stack.replace(plan=plan)


def apply_fp8(stack: StageStack, *, on: bool) -> StageStack:
    """``on`` (the plan's precision is ``fp8``, or verify's float32 run of one): each stage graph's linear matmuls
    (:func:`partitioner.graph.fp8.fp8_matmuls` of the whole graph, as the planner priced them) made FP8 ones.

    Rewrites the stage graphs in place, before any wrapper: the recomputation and precision steps wrap
    the rewritten graphs, and under ``tp > 1`` the tensor-parallel split (:func:`runtime.parallel.parallelize.apply_tp`)
    places their parameters and rewrites them once more; :func:`~runtime.state.fp8.fp8_linear` then runs on
    each rank's shards.
    """
    if not on:
        return stack
    matmuls = fp8_matmuls(stack.stages[0].captured.graph_module)
    for local in stack.stages:
        convert_graph(local.module, matmuls, recipe=stack.plan.fp8_recipe)
    return stack


def values_on_device(stack: StageStack) -> StageStack:
    """The stages on this rank's device (a meta stage waiting for its shards stays on meta)."""
    if stack.deferred is None:
        for module in stack.held:
            module.to(stack.device)
    return stack


def cast_values(stack: StageStack) -> StageStack:
    """bf16: parameters in bfloat16; else unchanged."""
    for module in stack.held:
        cast_parameters(module, stack.plan.precision)
    return stack


def apply_precision(stack: StageStack, loss_fn: LossFn | None) -> StageStack:
    """Each stage's forward (and ``loss_fn``) under the plan's precision: autocast, or bfloat16 model inputs.

    Made after every ``.to()``: the wrappers read the stage's state through it, never copies.
    """
    precision, device_type = stack.plan.precision, stack.device.type
    runnables = tuple(
        module if precision == "fp32" else
        PrecisionForward(module, precision=precision, device_type=device_type,
                         model_inputs=len(local.signature.model_inputs))
        for local, module in stack.zipped(stack.runnables))
    return stack.replace(runnables=runnables, loss_fn=precision_loss(loss_fn, precision, device_type))
