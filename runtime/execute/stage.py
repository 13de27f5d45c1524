"""Build this rank's stage: recapture the model, check it matches the plan, keep one stage.

The model is captured again at the plan's micro-batch shapes (inputs are zeros
of the recorded shapes and dtypes), its graph fingerprint is compared with the
plan's, boundary tensor shapes are checked, and the stage's nodes are copied
into a module holding only that stage's parameters (original names).

Example::

    stage = build_local_stage(plan, model, stage_index=1)
    outputs = stage.module(*model_inputs, *received)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import fx

from partitioner.errors import PlanMismatchError
from partitioner.graph.capture import CallSpec, CapturedModel, capture
from partitioner.graph.ir import ValueInfo, dtype_from_name, graph_fingerprint
from partitioner.graph.tensorparallel import find_tensor_parallel
from partitioner.graph.values import propagate_values
from partitioner.plan import Plan, StagePlan
from partitioner.stagegraph import StageSignature, build_stage, stage_signature

__all__ = ["LocalStage", "build_local_stage", "build_local_stages", "call_spec", "example_microbatch", "recapture"]


@dataclasses.dataclass
class LocalStage:
    plan: StagePlan
    module: fx.GraphModule
    signature: StageSignature
    captured: CapturedModel
    is_last: bool


def example_microbatch(plan: Plan) -> tuple[torch.Tensor, ...]:
    """Zeros shaped like one micro-batch of the model's inputs, as the plan recorded them."""
    return tuple(torch.zeros(t.shape, dtype=dtype_from_name(t.dtype)) for t in plan.model.inputs)


def call_spec(plan: Plan) -> CallSpec:
    """How the plan's flat inputs become the model's call (keywords, baked constants)."""
    if not plan.model.call:  # plans made before call specs: positional tensors
        return CallSpec.positional_of(len(plan.model.inputs), [t.name for t in plan.model.inputs])
    return CallSpec.from_json(plan.model.call)


def recapture(plan: Plan, model: torch.nn.Module) -> tuple[CapturedModel, dict[str, ValueInfo]]:
    """Capture ``model`` as the plan did and check it is the same graph with the same boundary shapes."""
    if type(model).__name__ != plan.model.class_name:
        raise PlanMismatchError(
            f"The plan was made for a {plan.model.class_name}, but the model is a {type(model).__name__}. "
            "Pass the model the plan was made for, or plan this one."
        )
    micro = example_microbatch(plan)
    captured = capture(model, micro, method=plan.model.capture, call=call_spec(plan))  # type: ignore[arg-type]
    fingerprint = graph_fingerprint(captured.graph_module)
    if fingerprint != plan.model.fingerprint:
        raise PlanMismatchError(
            f"The model's graph (fingerprint {fingerprint}) differs from the one the plan was made for "
            f"({plan.model.fingerprint}): the model changed since planning. Plan it again with "
            "`autopartition model.py --gpus N`."
        )
    infos = propagate_values(captured.graph_module, micro)
    for b in (b for stage in plan.stages for b in stage.outputs):
        info = infos.get(b.producer)
        if info is None or info.shape != b.shape or info.dtype != b.dtype:
            got = "missing" if info is None else f"{info.shape} {info.dtype}"
            raise PlanMismatchError(
                f"Boundary tensor {b.producer} is {got} in the model but {b.shape} {b.dtype} in the plan. "
                "The model or its input shapes changed: plan it again."
            )
    return captured, infos


def build_local_stage(plan: Plan, model: torch.nn.Module, stage_index: int) -> LocalStage:
    """This rank's stage module, after :func:`recapture`'s checks."""
    return build_local_stages(plan, model, (stage_index,))[0]


def build_local_stages(plan: Plan, model: torch.nn.Module, indices: Sequence[int]) -> tuple[LocalStage, ...]:
    """Several stages of one rank from one capture (a parameter two of them use stays one object)."""
    captured, infos = recapture(plan, model)
    if plan.tp > 1:  # the split layers' roles, in node.meta, for runtime.parallel.tensorparallel
        find_tensor_parallel(captured)
    return tuple(_local_stage(plan, captured, infos, i) for i in indices)


def _local_stage(plan: Plan, captured: CapturedModel, infos: dict[str, ValueInfo], stage_index: int) -> LocalStage:
    stage = plan.stages[stage_index]
    statics = {name: info.static for name, info in infos.items() if info.kind == "static"}
    last = stage_index == len(plan.stages) - 1
    signature = stage_signature(stage, model_outputs=plan.model.outputs, last=last)
    module = build_stage(captured, stage.nodes, signature, statics=statics)
    return LocalStage(plan=stage, module=module, signature=signature, captured=captured, is_last=last)
