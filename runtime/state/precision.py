"""Run-time precision: run each stage as the plan's ``precision`` says, and send tensors in their real dtype.

The planner records boundary tensors in the model's own dtype (it costs the graph
once and scales the bytes); at run time a stage sends what it really computes:

* ``fp32``: the model as it is; nothing changes.
* ``bf16-mixed``: each stage's forward (and the loss) runs under
  ``torch.autocast(device_type, dtype=torch.bfloat16)``; parameters, gradients
  and optimizer state stay float32.  A boundary tensor is bfloat16 when the op
  producing it ran in bfloat16 (a matmul) and float32 when autocast keeps it
  there (a layer norm, a softmax, an add of a float32 residual).
* ``fp8``: as ``bf16-mixed``, with the linear layers' matmuls rewritten into FP8 ones
  (:mod:`runtime.state.fp8`, applied to the stage graphs by :func:`runtime.state.values.apply_fp8`).
* ``bf16``: every floating parameter and buffer is converted to bfloat16 and
  floating model inputs are cast to bfloat16 when they enter a stage (what
  ``model.to(torch.bfloat16)(x.to(torch.bfloat16))`` does in one process).

:func:`boundary_dtypes` finds each boundary's dtype by running the whole
captured graph on fake tensors under that precision (no memory, no weights
read; every rank computes the same answer), and :func:`with_boundary_dtypes`
returns the in-memory plan with those dtypes, from which receive buffers are
allocated.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    >>> tokens = torch.zeros(2, 3, dtype=torch.long)
    >>> c = capture(m, (tokens,))
    >>> dtypes = boundary_dtypes(c.graph_module, (tokens,), precision="bf16-mixed")
    >>> dtypes["_0"], dtypes["_1"]  # autocast leaves an embedding lookup in fp32, runs a linear in bf16
    ('float32', 'bfloat16')
    >>> run = PrecisionForward(m, precision="bf16-mixed", device_type="cpu", model_inputs=1)
    >>> run(tokens).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from partitioner.cost.precision import check_precision, runs_autocast
from partitioner.errors import AutopartitionError
from partitioner.graph.ir import dtype_name
from partitioner.graph.meta import (
    FakeState,
    StandIns,
    attribute,
    fake_kernels,
    fake_like,
    home_device,
)
from partitioner.plan import Boundary, Plan

__all__ = [
    "PrecisionForward",
    "boundary_dtypes",
    "cast_parameters",
    "forward_context",
    "plan_at_precision",
    "precision_loss",
    "with_boundary_dtypes",
]

_BF16 = torch.bfloat16


def forward_context(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """What a stage's forward and the loss run under: autocast for ``bf16-mixed``, else nothing.

    >>> with forward_context("bf16-mixed", "cpu"):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    """
    if runs_autocast(precision):  # bf16-mixed, and fp8 (whose FP8 matmuls are graph calls: runtime/state/fp8.py)
        return torch.autocast(device_type, dtype=_BF16)
    return contextlib.nullcontext()


def cast_parameters(module: nn.Module, precision: str) -> nn.Module:
    """``module`` with its floating parameters and buffers in bfloat16 under ``bf16`` (in place), else as is.

    >>> cast_parameters(torch.nn.Linear(2, 2), "bf16").weight.dtype
    torch.bfloat16
    """
    if check_precision(precision) == "bf16":
        module.to(_BF16)  # nn.Module.to converts floating tensors only; integer buffers keep their dtype
    return module


class PrecisionForward(nn.Module):
    """Runs ``module`` (a stage) under the plan's precision.

    ``model_inputs``: how many leading arguments are model inputs (the stage
    signature puts them before the received tensors); under ``bf16`` their
    floating tensors are cast to bfloat16.  Received tensors arrive in the dtype
    the producing stage computed and are left alone.
    """

    def __init__(self, module: nn.Module, *, precision: str, device_type: str, model_inputs: int) -> None:
        super().__init__()
        self.module = module
        self.precision = check_precision(precision)
        self.device_type = device_type
        self.model_inputs = model_inputs

    def forward(self, *args: Any) -> Any:
        if self.precision == "bf16":
            args = tuple(_to_bf16(a) if i < self.model_inputs else a for i, a in enumerate(args))
        with forward_context(self.precision, self.device_type):
            return self.module(*args)


def precision_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor] | None, precision: str, device_type: str
) -> Callable[[Any, Any], torch.Tensor] | None:
    """``loss_fn`` run under autocast for ``bf16-mixed`` (as torch's AMP recipe computes the loss), else itself.

    >>> logits = torch.randn(4, 3, dtype=torch.bfloat16)
    >>> loss = precision_loss(torch.nn.functional.cross_entropy, "bf16-mixed", "cpu")
    >>> loss(logits, torch.tensor([0, 1, 2, 0])).dtype  # cross-entropy is on autocast's float32 list
    torch.float32
    """
    if loss_fn is None or not runs_autocast(precision):
        return loss_fn
    inner = loss_fn

    def under_autocast(outputs: Any, target: Any) -> torch.Tensor:
        with forward_context("bf16-mixed", device_type):
            return inner(outputs, target)

    return under_autocast


def boundary_dtypes(
    gm: fx.GraphModule, inputs: Sequence[Any], *, precision: str, device_type: str | None = None,
    bf16_parameters: Sequence[str] = (),
) -> dict[str, str]:
    """The dtype of every tensor node of ``gm`` when it runs under ``precision``, by node name.

    The graph runs on fake stand-ins (:mod:`partitioner.graph.meta`) of its inputs,
    parameters and buffers: nothing is allocated and no weight is read.
    ``device_type`` picks autocast's op lists (``cuda`` and ``cpu`` differ a
    little); by default the inputs' device.  ``bf16_parameters``: graph names of
    parameters read as bfloat16 copies under ``bf16-mixed`` (FSDP2 gathers a
    fully sharded stage's weights so: :func:`runtime.parallel.shard.fsdp_policy`).
    """
    precision = check_precision(precision)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    home = home_device(gm, inputs)
    if device_type is not None and device_type != home.type:
        home = torch.device(device_type)
    run = _DtypeRun(gm)
    base = FakeState(gm, mode, home)
    held = {id(t) for t in (*gm.parameters(), *gm.buffers())}
    gathered = {id(attribute(gm, name)) for name in bf16_parameters} if runs_autocast(precision) else set()

    def state(name: str) -> Any:
        value = base(name)
        # Under bf16 the stage's parameters and buffers are bf16 (cast_parameters); constants are not.
        if (precision == "bf16" and id(attribute(gm, name)) in held) or id(attribute(gm, name)) in gathered:
            value = _to_bf16(value)
        return value

    run.state = state
    run.home = home
    try:
        with fake_kernels(), mode, forward_context(precision, home.type):
            fakes = [fake_like(x, home) if isinstance(x, torch.Tensor) else x for x in inputs]
            if precision == "bf16":
                fakes = [_to_bf16(x) for x in fakes]
            run.run(*fakes)
    except Exception as exc:
        raise AutopartitionError(
            f"Running the captured graph under precision {precision} on fake tensors failed "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). "
            "The model may not support this precision: plan it with --precision fp32."
        ) from exc
    return run.dtypes


def with_boundary_dtypes(plan: Plan, dtypes: dict[str, str]) -> Plan:
    """``plan`` with each boundary tensor's dtype taken from ``dtypes`` (by producer); the same plan if none change.

    >>> from partitioner.plan import example_plan
    >>> plan = with_boundary_dtypes(example_plan(), {"relu": "bfloat16"})
    >>> plan.stages[0].outputs[0].dtype, plan.stages[1].inputs[0].dtype
    ('bfloat16', 'bfloat16')
    >>> same = example_plan()
    >>> with_boundary_dtypes(same, {"relu": "float32"}) is same
    True
    """

    def real(b: Boundary) -> Boundary:
        dtype = dtypes.get(b.producer, b.dtype)
        return b if dtype == b.dtype else dataclasses.replace(b, dtype=dtype)

    stages = tuple(
        dataclasses.replace(s, inputs=tuple(map(real, s.inputs)), outputs=tuple(map(real, s.outputs)))
        for s in plan.stages
    )
    if all(a == b for a, b in zip(stages, plan.stages)):
        return plan
    return dataclasses.replace(plan, stages=stages)


class _DtypeRun(StandIns, fx.Interpreter):
    """Runs a graph on stand-ins and records each tensor node's dtype (the nodes' meta is left alone)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.dtypes: dict[str, str] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            self.dtypes[n.name] = dtype_name(result.dtype)
        return result


def _to_bf16(value: Any) -> Any:
    def one(v: Any) -> Any:
        return v.to(_BF16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    return pytree.tree_map(one, value)


def plan_at_precision(
    plan: Plan, gm: fx.GraphModule, inputs: Sequence[Any], *, device_type: str, bf16_parameters: Sequence[str] = (),
) -> Plan:
    """The plan the runtime executes: boundary dtypes as ``gm`` (the whole captured graph) computes them.

    ``inputs``: one micro-batch of the model's flat inputs (zeros will do: only
    shapes and dtypes matter); ``bf16_parameters``: as :func:`boundary_dtypes`.
    An ``fp32`` plan is returned as it is.
    """
    if check_precision(plan.precision) == "fp32":
        return plan
    return with_boundary_dtypes(plan, boundary_dtypes(gm, inputs, precision=plan.precision, device_type=device_type,
                                                      bf16_parameters=bf16_parameters))
