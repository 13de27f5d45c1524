"""Cost: forward/backward time, FLOPs and memory of every node.

:class:`_CostInterpreter` runs the captured graph once, node by node, on real
tensors on the local device and writes one key, ``node.meta["autopartition_cost"]``,
a :class:`NodeCost`.  For each compute node it

* counts forward and backward FLOPs with ``torch.utils.flop_counter``;
* counts the activation bytes autograd saves for backward (saved-tensor hooks,
  parameters excluded), which is what a stage keeps per micro-batch in flight;
* times forward and backward (``torch.autograd.grad`` on that node alone),
  warmed up, median of repeats, when ``measure=True``.

Times for a GPU we are not on come from :func:`predicted_times`, a roofline:
``max(FLOPs / peak, bytes / bandwidth) + launch overhead`` (Williams et al.,
"Roofline", CACM 2009), with the peaks in :mod:`partitioner.devices`.

Example::

    >>> import torch
    >>> from partitioner.capture import capture
    >>> x = (torch.randn(8, 16),)
    >>> c = capture(torch.nn.Linear(16, 4), x)
    >>> costs = profile(c, x, measure=False)
    >>> costs["linear"].forward_flops
    1024.0
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from partitioner.capture import KIND_KEY, CapturedModel, node_parameters
from partitioner.devices import DeviceSpec
from partitioner.errors import CaptureError

__all__ = ["COST_KEY", "NodeCost", "Progress", "predicted_times", "profile", "time_loss"]

COST_KEY = "autopartition_cost"
Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """Per-micro-batch cost of one node (times are measured or zero)."""

    forward_s: float
    backward_s: float
    forward_flops: float
    backward_flops: float
    saved_bytes: int  # activations kept for backward
    io_bytes: int  # tensor bytes read and written by the forward, weights included
    dtype: str  # dtype of the output, chooses the peak for predictions
    weight_bytes: int = 0  # parameter bytes read (part of io_bytes; independent of the batch)

    def scaled(self, factor: float) -> NodeCost:
        """Cost for a batch ``factor`` times as large (linear in batch; weights read once)."""
        return NodeCost(
            forward_s=self.forward_s * factor,
            backward_s=self.backward_s * factor,
            forward_flops=self.forward_flops * factor,
            backward_flops=self.backward_flops * factor,
            saved_bytes=int(self.saved_bytes * factor),
            io_bytes=int(self.weight_bytes + (self.io_bytes - self.weight_bytes) * factor),
            dtype=self.dtype,
            weight_bytes=self.weight_bytes,
        )


def predicted_times(cost: NodeCost, spec: DeviceSpec) -> tuple[float, float]:
    """Roofline forward and backward seconds of one node on ``spec``."""
    if cost.forward_flops == 0 and cost.io_bytes == 0:
        return 0.0, 0.0  # views and other metadata-only ops
    peak = spec.peak(cost.dtype)
    bandwidth = spec.memory_bandwidth
    forward = max(cost.forward_flops / peak, cost.io_bytes / bandwidth) + spec.kernel_overhead
    # Backward reads the saved activations and the output gradient, writes input gradients.
    backward = 0.0
    if cost.backward_flops > 0 or cost.saved_bytes > 0:
        backward = max(cost.backward_flops / peak, 2 * cost.io_bytes / bandwidth) + spec.kernel_overhead
    return forward, backward


def profile(
    captured: CapturedModel,
    inputs: tuple[Any, ...],
    *,
    measure: bool = True,
    device: torch.device | None = None,
    warmup: int = 1,
    repeats: int = 5,
    progress: Progress | None = None,
) -> dict[str, NodeCost]:
    """Cost every compute and constant node of ``captured`` on ``inputs`` (one micro-batch)."""
    gm = captured.graph_module
    if _has_mutation(gm):
        gm = copy.deepcopy(gm)  # profiling repeats ops; keep the user's buffers untouched
    device = device or torch.device("cpu")
    gm = gm.to(device)
    inputs = tuple(x.to(device) for x in inputs)
    if measure:  # first calls of an op pay one-time set-up costs; keep them out of the timings
        with torch.no_grad():
            gm(*inputs)
    runner = _CostInterpreter(
        gm, measure=measure, device=device, warmup=warmup, repeats=repeats, progress=progress
    )
    with _rank_threads(device), torch.enable_grad():
        runner.run(*inputs)
        if not measure:
            return runner.costs
        forward, backward = _in_situ(gm, inputs, device=device, repeats=max(3, repeats))
    return _calibrated(runner.costs, forward, backward)


@contextlib.contextmanager
def _rank_threads(device: torch.device) -> Iterator[None]:
    """Measure CPU costs with one thread, as CPU ranks run (torchrun sets OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _in_situ(
    gm: fx.GraphModule, inputs: tuple[Any, ...], *, device: torch.device, repeats: int
) -> tuple[dict[str, float], float]:
    """Per-node forward seconds inside real whole-graph passes, and the whole backward's seconds.

    Ops timed alone run with hot caches and without their neighbours; inside the
    real pass they can be several times slower (seen here: a 64x256 addmm 5x), so
    forward times come from real passes and backward times are rescaled to the
    real backward's total.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {}
    backward: list[float] = []
    params = [p for p in gm.parameters() if p.requires_grad]
    for _ in range(repeats + 1):
        timer = _NodeTimer(gm, sync)
        with torch.enable_grad():
            outputs = timer.run(*inputs)
            leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
            sync()
            start = time.perf_counter()
            if leaves and params:
                # autograd.grad, not backward: the user's .grad stays as it was.
                torch.autograd.grad(leaves, params, [torch.ones_like(t) for t in leaves], allow_unused=True)
            sync()
        backward.append(time.perf_counter() - start)
        for name, seconds in timer.seconds.items():
            samples.setdefault(name, []).append(seconds)
    # The first pass is a warm-up.
    return {k: statistics.median(v[1:]) for k, v in samples.items()}, statistics.median(backward[1:])


def _calibrated(costs: dict[str, NodeCost], forward: dict[str, float], backward_total: float) -> dict[str, NodeCost]:
    isolated = sum(c.backward_s for c in costs.values())
    scale = backward_total / isolated if isolated > 0 else 1.0
    return {
        name: dataclasses.replace(c, forward_s=forward.get(name, c.forward_s), backward_s=c.backward_s * scale)
        for name, c in costs.items()
    }


class _NodeTimer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, sync: Callable[[], None]) -> None:
        super().__init__(gm)
        self.sync = sync
        self.seconds: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.meta.get(KIND_KEY) not in ("compute", "constant"):
            return super().run_node(n)
        self.sync()
        start = time.perf_counter()
        result = super().run_node(n)
        self.sync()
        self.seconds[n.name] = time.perf_counter() - start
        return result


def time_loss(
    captured: CapturedModel,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    target: Any,
    *,
    device: torch.device | None = None,
    repeats: int = 5,
) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``loss_fn`` on the model's outputs for one micro-batch."""
    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        flat = captured.graph_module(*(x.to(device) for x in inputs))
    target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, target)
    forward, backward = [], []
    with _rank_threads(device):
        for _ in range(repeats + 1):
            forward_s, backward_s = _time_loss_once(captured, flat, loss_fn, target, sync)
            forward.append(forward_s)
            backward.append(backward_s)
    return statistics.median(forward[1:]), statistics.median(backward[1:])


def _time_loss_once(
    captured: CapturedModel, flat: Any, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any, sync: Callable[[], None]
) -> tuple[float, float]:
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in flat]
    sync()
    start = time.perf_counter()
    loss = loss_fn(captured.unflatten_outputs(leaves), target)
    sync()
    middle = time.perf_counter()
    if loss.requires_grad:
        loss.backward()
    sync()
    return middle - start, time.perf_counter() - middle



def _has_mutation(gm: fx.GraphModule) -> bool:
    """Could running the graph change model state (in-place aten ops, modules with buffers)?"""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if node.op == "call_module" and any(True for _ in gm.get_submodule(str(node.target)).buffers()):
            return True  # e.g. BatchNorm's running statistics under symbolic tracing
    return False


class _CostInterpreter(fx.Interpreter):
    def __init__(
        self,
        gm: fx.GraphModule,
        *,
        measure: bool,
        device: torch.device,
        warmup: int,
        repeats: int,
        progress: Progress | None,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.measure = measure
        self.device = device
        self.warmup = warmup
        self.repeats = repeats
        self.progress = progress
        self.costs: dict[str, NodeCost] = {}
        self.param_ptrs = {p.data_ptr() for p in gm.parameters()}
        self.total = len(gm.graph.nodes)
        self.done = 0

    def run_node(self, n: fx.Node) -> Any:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        if n.meta.get(KIND_KEY) not in ("compute", "constant"):
            return super().run_node(n)
        try:
            result, cost = self._cost(n)
        except Exception as exc:
            raise CaptureError(
                f"Profiling failed at node {n.format_node()}: {exc}. "
                "Check that example_inputs() returns inputs the model accepts."
            ) from exc
        n.meta[COST_KEY] = cost
        self.costs[n.name] = cost
        return result

    def _cost(self, n: fx.Node) -> tuple[Any, NodeCost]:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        leaves: list[torch.Tensor] = []

        def as_leaf(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.requires_grad and not isinstance(
                value, torch.nn.Parameter
            ):
                value = value.detach().requires_grad_()
                leaves.append(value)
            return value

        args, kwargs = pytree.tree_map(as_leaf, (args, kwargs))
        params = self._parameters(n)
        weight_bytes = sum(_nbytes(p) for p in params)
        io_bytes = weight_bytes + sum(
            _nbytes(v) for v in pytree.tree_leaves((args, kwargs)) if not isinstance(v, torch.nn.Parameter)
        )

        def call() -> Any:
            return getattr(self, n.op)(n.target, args, kwargs)

        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in self.param_ptrs:
                saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FlopCount() as counter:
            out = call()
        forward_flops = float(counter.total)
        io_bytes += sum(_nbytes(v) for v in pytree.tree_leaves(out))
        if _is_view(out, (args, kwargs)):
            io_bytes = weight_bytes = 0  # a view launches no kernel and moves no bytes
        diff_out = [
            t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        wrt = leaves + params
        backward_flops = 0.0
        forward_s = backward_s = 0.0
        if diff_out and wrt:
            grads = [torch.ones_like(t) for t in diff_out]

            def backward() -> Any:
                return torch.autograd.grad(diff_out, wrt, grads, retain_graph=True, allow_unused=True)

            with _FlopCount() as counter:
                backward()
            backward_flops = float(counter.total)
            if self.measure:
                backward_s = self._time(backward)
        if self.measure:
            forward_s = self._time(call)
        dtype = next(
            (str(t.dtype).removeprefix("torch.") for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)),
            "float32",
        )
        cost = NodeCost(
            forward_s=forward_s,
            backward_s=backward_s,
            forward_flops=forward_flops,
            backward_flops=backward_flops,
            saved_bytes=sum(saved),
            io_bytes=io_bytes,
            dtype=dtype,
            weight_bytes=weight_bytes,
        )
        return pytree.tree_map(_detach, out), cost

    def _parameters(self, n: fx.Node) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for name in node_parameters(self.module, n):  # type: ignore[arg-type]
            param = self.module.get_parameter(name)
            if param.requires_grad and all(param is not p for p in found):
                found.append(param)
        return found

    def _time(self, fn: Callable[[], Any]) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


class _FlopCount(TorchDispatchMode):
    """FLOPs of the ops run under it, by ``torch.utils.flop_counter``'s formulas.

    ``FlopCounterMode`` also tracks the module hierarchy with global hooks, which
    made it most of the profiling time; one total per node is all we need.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in flop_registry and not isinstance(func, torch._ops.HigherOrderOperator):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        formula = flop_registry.get(packet)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def _is_view(out: Any, inputs: Any) -> bool:
    if not isinstance(out, torch.Tensor) or out.numel() == 0:
        return False
    storage = out.untyped_storage().data_ptr()
    return any(
        isinstance(t, torch.Tensor) and t.numel() > 0 and t.untyped_storage().data_ptr() == storage
        for t in pytree.tree_leaves(inputs)
    )


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.detach().requires_grad_(value.requires_grad)
    return value
