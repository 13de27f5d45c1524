"""Cost: forward/backward time, FLOPs and memory of every node.

:class:`_CostInterpreter` runs the captured graph once, node by node, and writes
one key, ``node.meta["autopartition_cost"]``, a :class:`NodeCost`.  For each
compute node it

* counts forward and backward FLOPs with ``torch.utils.flop_counter``'s formulas;
* counts the activation bytes autograd saves for backward (saved-tensor hooks,
  parameters excluded), which is what a stage keeps per micro-batch in flight;
* times forward and backward (``torch.autograd.grad`` on that node alone),
  warmed up, median of repeats, when ``measure=True``; for a node reading
  parameters, also the backward to its parameters alone (the W a split
  backward runs later).

Every node runs on the values the real forward gives it: its output comes from one
real call, and what a node writes in place (an index built by ``+=`` on an
``arange``, a counter buffer, ``ReLU(inplace=True)``) is put back before each timing
re-run (:class:`_Writes`), as is model state before each whole-graph pass.

Counting alone (``measure=False``, used for ``--device a100|h100|h200``) runs on
fake tensors (:mod:`partitioner.graph.meta`): every parameter, buffer and input is
replaced by a ``FakeTensor`` of its shape and dtype, so nothing is computed or
allocated and no weight is read or copied, whether the model holds real weights
or was built on ``meta``; a call equal to one counted before (the same op of the
next identical layer, on tensors of the same shapes) takes its cost without being
run again (:class:`_CountInterpreter`: Llama 3 70B's 4,651 nodes in 1 s, not 10).  Timing a model that holds meta tensors materialises
one layer at a time with placeholder values and times a repeated layer once
(:func:`_measure_by_layer`).

Times for a GPU we are not on come from :func:`~partitioner.cost.nodecost.predicted_times`, a roofline:
``max(FLOPs / peak, bytes / bandwidth) + launch overhead`` (Williams et al.,
"Roofline", CACM 2009), with the peaks in :mod:`partitioner.cost.devices`.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
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
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from partitioner.cost.nodecost import NodeCost
from partitioner.errors import AutopartitionError, CaptureError
from partitioner.graph.capture import CapturedModel
from partitioner.graph.ir import KIND_KEY, node_parameters
from partitioner.graph.meta import (
    FakeState,
    Layer,
    StandIns,
    attribute,
    fake_kernels,
    fake_like,
    has_meta,
    home_device,
    is_meta,
    layers,
    materialise,
    placeholder,
)

__all__ = ["COST_KEY", "Progress", "profile", "time_loss"]

COST_KEY = "autopartition_cost"
Progress = Callable[[int, int], None]


def profile(
    captured: CapturedModel,
    inputs: tuple[Any, ...],
    *,
    measure: bool = True,
    device: torch.device | None = None,
    warmup: int = 1,
    repeats: int = 5,
    progress: Progress | None = None,
    weight_share: bool = True,
) -> dict[str, NodeCost]:
    """Cost every compute and constant node of ``captured`` on ``inputs`` (one micro-batch).

    ``measure=False`` counts on fake tensors (no compute, no allocation); times are zero.
    ``weight_share``: also time each parameter node's backward to its parameters alone
    (``NodeCost.weight_backward_s``; only schedules that split the backward use it).
    """
    gm = captured.graph_module
    if not measure:
        return _count(gm, inputs, progress=progress)
    device = device or torch.device("cpu")
    if has_meta(gm, inputs):
        return _measure_by_layer(gm, inputs, device=device, warmup=warmup, repeats=repeats, progress=progress)
    mutates = _has_mutation(gm)
    if mutates:
        gm = copy.deepcopy(gm)  # profiling repeats ops; keep the user's buffers untouched
    gm = gm.to(device)
    inputs = tuple(x.to(device) for x in inputs)
    # Every pass starts from the state the real forward starts from: a pass that writes a
    # buffer (a step counter, running statistics) or an input must not feed the next one.
    start = _Snapshot(_state_tensors(gm, inputs) if mutates else [])
    with torch.no_grad():  # first calls of an op pay one-time set-up costs; keep them out of the timings
        gm(*inputs)
    start.restore()
    runner = _CostInterpreter(gm, measure=True, device=device, warmup=warmup, repeats=repeats, progress=progress,
                              weight_share=weight_share)
    with _rank_threads(device), torch.enable_grad():
        runner.run(*inputs)
        forward, backward_nodes, backward = _in_situ(
            gm, inputs, device=device, repeats=max(3, repeats), reset=start.restore)
    start.restore()
    return _calibrated(runner.costs, forward, backward_nodes, backward)


def _count(gm: fx.GraphModule, inputs: tuple[Any, ...], *, progress: Progress | None) -> dict[str, NodeCost]:
    """FLOPs and bytes of every node, run on fake tensors: shapes only, at the real micro-batch size."""
    home = home_device(gm, inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = FakeState(gm, mode, home)
    runner = _CountInterpreter(gm, device=home, progress=progress, state=state)
    runner.home = home
    with fake_kernels(), mode, torch.enable_grad():
        runner.run(*(fake_like(x, home) if isinstance(x, torch.Tensor) else x for x in inputs))
    return runner.costs


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


# Whole-graph passes run before timing until two in a row are within 10% of the fastest (at least
# 3, at most 20, at most 5 s): a process's first passes run up to 1.6x slower on CPU while the
# allocator maps fresh memory (pipelined steps show the same).
_WARM_PASSES = (3, 20)
_WARM_BUDGET_S = 5.0
# Plain passes (no clocks) that set the scale of the clocked per-node times: this many, or this long.
_PLAIN_PASSES = 20
_PLAIN_BUDGET_S = 1.0
_SETTLED = 1.10


def _settled(passes: list[float]) -> bool:
    """Whether the last two whole passes are within :data:`_SETTLED` of the fastest one.

    >>> _settled([3.0, 2.0, 1.6]), _settled([3.0, 1.6, 1.5, 1.55])
    (False, True)
    """
    return len(passes) >= 2 and max(passes[-2:]) <= _SETTLED * min(passes)


def _in_situ(
    gm: fx.GraphModule,
    inputs: tuple[Any, ...],
    *,
    device: torch.device,
    repeats: int,
    reset: Callable[[], None] = lambda: None,
) -> tuple[dict[str, float], dict[str, float], float]:
    """Per-node forward and backward seconds inside real whole-graph passes, and the whole backward's seconds.

    Ops timed alone run with hot caches and without their neighbours; inside the
    real pass they can be several times slower (seen here: a 64x256 addmm 5x;
    a pipeline stage's backward reads activations its forward wrote long before,
    from memory, not from cache).  So forward times come from real passes, and so
    do backward times: a hook on each node's output gradient marks when
    autograd reaches that node's backward (:class:`_BackwardClock`).

    The clocks cost time themselves (an interpreter step and a hook per node:
    here a stage's forward timed node by node summed to 1.45x its plain run).
    So each timed pass is followed by a plain one, the graph module's own code
    with no hooks, and the per-node times are scaled so that they sum to the
    plain passes' forward and backward: the clocks say how a pass divides among
    nodes, the plain passes how long it takes.  The plain passes' *mean* sets
    the scale (a pipeline runs the pass many times per step, so its slow tail
    counts), over :data:`_PLAIN_PASSES` passes or :data:`_PLAIN_BUDGET_S`.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {}
    back_samples: dict[str, list[float]] = {}
    clocked: list[tuple[float, float]] = []  # per timed pass: (node forwards summed, backward), clocks on
    plain: list[tuple[float, float]] = []  # per timed pass: (forward, backward), no clocks
    params = [p for p in gm.parameters() if p.requires_grad]
    least, most = _WARM_PASSES
    walls: list[float] = []  # every pass's wall time, warm-up included
    warming, timed, began = True, 0, time.perf_counter()
    while timed < repeats:
        if warming and len(walls) >= least and (
                _settled(walls) or len(walls) >= most or time.perf_counter() - began > _WARM_BUDGET_S):
            warming = False  # from here on, passes are timed
        reset()
        pass_start = time.perf_counter()
        clock = _BackwardClock(sync)
        timer = _NodeTimer(gm, sync, clock)
        with torch.enable_grad():
            outputs = timer.run(*inputs)
            leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
            sync()
            start = time.perf_counter()
            if leaves and params:
                # autograd.grad, not backward: the user's .grad stays as it was.
                torch.autograd.grad(leaves, params, [torch.ones_like(t) for t in leaves], allow_unused=True)
            sync()
            end = time.perf_counter()
        walls.append(end - pass_start)
        if warming:
            continue
        timed += 1
        clocked.append((sum(timer.seconds.values()), end - start))
        for name, seconds in timer.seconds.items():
            samples.setdefault(name, []).append(seconds)
        for name, seconds in clock.seconds(end).items():
            back_samples.setdefault(name, []).append(seconds)
        reset()
        plain.append(_plain_pass(gm, inputs, params, sync))
    began = time.perf_counter()
    while len(plain) < _PLAIN_PASSES and time.perf_counter() - began < _PLAIN_BUDGET_S:
        reset()
        plain.append(_plain_pass(gm, inputs, params, sync))
    # Medians against medians: one pass slowed by other work on the machine moves a mean, and a scale
    # from the mean of clocked sums would leave the nodes' medians summing short of the plain pass.
    forward_medians = {k: statistics.median(v) for k, v in samples.items()}
    forward_scale = _ratio(statistics.mean(p[0] for p in plain), sum(forward_medians.values()))
    backward_s = statistics.mean(p[1] for p in plain)
    backward_scale = _ratio(backward_s, statistics.median(c[1] for c in clocked))
    forward = {k: forward_scale * seconds for k, seconds in forward_medians.items()}
    backward_nodes = {k: backward_scale * statistics.median(v) for k, v in back_samples.items()}
    return forward, backward_nodes, backward_s


def _plain_pass(
    gm: fx.GraphModule, inputs: tuple[Any, ...], params: list[torch.nn.Parameter], sync: Callable[[], None]
) -> tuple[float, float]:
    """(forward, backward) seconds of one training pass of ``gm`` as a stage runs it: its own code, no clocks."""
    with torch.enable_grad():
        sync()
        start = time.perf_counter()
        outputs = gm(*inputs)
        sync()
        middle = time.perf_counter()
        leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves and params:
            torch.autograd.grad(leaves, params, [torch.ones_like(t) for t in leaves], allow_unused=True)
        sync()
        return middle - start, time.perf_counter() - middle


def _ratio(plain_s: float, clocked_s: float) -> float:
    """How much faster a plain pass ran than a clocked one (1 where there is nothing to compare).

    >>> _ratio(7.0, 10.0), _ratio(1.0, 0.0)
    (0.7, 1.0)
    """
    return plain_s / clocked_s if clocked_s > 0 else 1.0


def _calibrated(
    costs: dict[str, NodeCost], forward: dict[str, float], backward_nodes: dict[str, float], backward_total: float
) -> dict[str, NodeCost]:
    """Costs with in-situ times: a node's own where its backward was clocked, else its isolated backward
    scaled so that the unclocked ones fill the rest of the real backward."""
    clocked = {k: v for k, v in backward_nodes.items() if k in costs and costs[k].backward_s > 0}
    isolated = sum(c.backward_s for k, c in costs.items() if k not in clocked)
    rest = max(0.0, backward_total - sum(clocked.values()))
    scale = rest / isolated if isolated > 0 else 1.0
    calibrated = {}
    for name, c in costs.items():
        factor = clocked[name] / c.backward_s if name in clocked else scale
        calibrated[name] = dataclasses.replace(
            c, forward_s=forward.get(name, c.forward_s), backward_s=c.backward_s * factor,
            weight_backward_s=c.weight_backward_s * factor)
    return calibrated


class _BackwardClock:
    """Times each node's backward inside a real backward pass.

    A hook on each of a node's output tensors fires when autograd is about to run
    the op that made it (its gradient is complete); the node's backward lasts
    until the next hook fires, or the pass ends.
    """

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.marks: list[tuple[float, str]] = []

    def watch(self, name: str, value: Any) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(functools.partial(self._mark, name))

    def _mark(self, name: str, grad: torch.Tensor) -> None:
        self.sync()
        self.marks.append((time.perf_counter(), name))

    def seconds(self, end: float) -> dict[str, float]:
        """Each marked node's backward seconds (a node marked twice, by two outputs, gets both spans)."""
        spans: dict[str, float] = {}
        for (at, name), (after, _) in zip(self.marks, [*self.marks[1:], (end, "")]):
            spans[name] = spans.get(name, 0.0) + after - at
        return spans


class _NodeTimer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, sync: Callable[[], None], clock: _BackwardClock | None = None) -> None:
        super().__init__(gm)
        self.sync = sync
        self.clock = clock
        self.seconds: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.meta.get(KIND_KEY) not in ("compute", "constant"):
            return super().run_node(n)
        self.sync()
        start = time.perf_counter()
        result = super().run_node(n)
        self.sync()
        self.seconds[n.name] = time.perf_counter() - start
        if self.clock is not None:
            self.clock.watch(n.name, result)
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
    """Median (forward, backward) seconds of ``loss_fn`` on the model's outputs for one micro-batch.

    A model holding meta tensors is not run: the loss is timed on placeholder outputs
    of the propagated shapes (and placeholder targets where they are meta).
    """
    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    nodes = captured.nodes()
    values = [v for name in captured.output_nodes if isinstance(v := nodes[name].meta.get("val"), torch.Tensor)]
    if has_meta(captured.graph_module, inputs) and len(values) == len(captured.output_nodes):
        flat = tuple(placeholder(v, device) for v in values)
    else:
        with torch.no_grad():
            flat = captured.graph_module(*(x.to(device) for x in inputs))
    target = pytree.tree_map(
        lambda t: (placeholder(t, device) if is_meta(t) else t.to(device)) if isinstance(t, torch.Tensor) else t, target
    )
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



class _Snapshot:
    """Copies of tensors' values, to put back in place (newest first, so overlapping views end right)."""

    def __init__(self, tensors: list[torch.Tensor], saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.saved = saved if saved is not None else [(t, t.detach().clone()) for t in tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, value in reversed(self.saved):
                tensor.copy_(value)


def _state_tensors(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    """What a pass may write and a later pass would read: buffers, tensor constants and the inputs."""
    constants = (attribute(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr")
    params = {id(p) for p in gm.parameters()}
    found: dict[int, torch.Tensor] = {}
    for t in (*gm.buffers(), *constants, *pytree.tree_leaves(inputs)):
        if isinstance(t, torch.Tensor) and id(t) not in params:
            found.setdefault(id(t), t)
    return list(found.values())


def _written_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an aten op writes in place (its schema's ``Tensor(a!)`` arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    found: list[torch.Tensor] = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        found.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
    return found


class _Writes(TorchDispatchMode):
    """Keeps a copy of every tensor (or view) an op writes in place, taken before its first write.

    At the dispatch level every node kind (aten op, Python function, method, module)
    is aten ops with schemas, so this sees ``add_``, ``index_put_`` and a module's
    buffer updates alike.
    """

    def __init__(self) -> None:
        super().__init__()
        self.before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen: set[tuple[Any, ...]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in _written_arguments(func, args, kwargs):
            key = (_storage(t), t.storage_offset(), tuple(t.shape), t.stride())
            if key not in self.seen:
                self.seen.add(key)
                self.before.append((t, t.clone()))
        return func(*args, **kwargs)


def _has_mutation(gm: fx.GraphModule) -> bool:
    """Could running the graph change model state (in-place aten ops, modules with buffers)?"""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if node.op == "call_module" and any(True for _ in gm.get_submodule(str(node.target)).buffers()):
            return True  # e.g. BatchNorm's running statistics under symbolic tracing
    return False


class _FirstCall(NamedTuple):
    """A node's real call: what it ran on and produced, and what it wrote in place."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    leaves: list[torch.Tensor]  # inputs that need a gradient, as fresh leaves
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (leaf, the copy the node ran on and may write)
    forward_flops: float
    written: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor, its value before the first write)


class _CostInterpreter(StandIns):
    """Costs node by node.  ``state`` (graph name -> tensor) stands in for the module's own
    parameters, buffers and tensor constants; without it the module's own are used."""

    def __init__(
        self,
        gm: fx.GraphModule,
        *,
        measure: bool,
        device: torch.device,
        warmup: int,
        repeats: int,
        progress: Progress | None,
        state: Callable[[str], Any] | None = None,
        weight_share: bool = True,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False  # our errors are one paragraph; fx would append the graph's traceback
        self.measure = measure
        self.weight_share = weight_share
        self.device = device
        self.warmup = warmup
        self.repeats = repeats
        self.progress = progress
        self.state = state
        self.costs: dict[str, NodeCost] = {}
        # Parameters by storage, not data_ptr (0 for every fake or meta tensor): views of a weight count too.
        self.param_storages = {_storage(p) for p in gm.parameters()} if state is None else set()
        self.total = len(gm.graph.nodes)
        self.done = 0
        self.wrote = False  # whether the node costed last wrote into a tensor in place

    def tick(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)

    def run_node(self, n: fx.Node) -> Any:
        self.tick()
        if n.meta.get(KIND_KEY) not in ("compute", "constant"):
            return super().run_node(n)
        try:
            result, cost = self._cost(n)
        except AutopartitionError:
            raise
        except Exception as exc:
            failed = self.run_node_failed(n, exc)
            if failed is not None:
                raise failed from exc
            raise CaptureError(
                f"Profiling failed at node {n.format_node()}: {exc}. "
                "Check that example_inputs() returns inputs the model accepts."
            ) from exc
        n.meta[COST_KEY] = cost
        self.costs[n.name] = cost
        return result

    def run_node_failed(self, n: fx.Node, exc: Exception) -> AutopartitionError | None:
        """The error to raise when costing ``n`` failed; ``None``: the generic one."""
        return None

    def tensor(self, name: str) -> Any:
        value = super().tensor(name)
        if self.state is not None and isinstance(value, torch.nn.Parameter):
            self.param_storages.add(_storage(value))
        return value

    def _cost(self, n: fx.Node) -> tuple[Any, NodeCost]:
        raw = self.fetch_args_kwargs_from_env(n)
        params = self._parameters(n)
        saved: list[int] = []
        saved_float32: list[int] = []  # what a bf16 precision halves (not integer indices or masks)

        def pack(t: torch.Tensor) -> torch.Tensor:
            if _storage(t) not in self.param_storages:
                saved.append(_nbytes(t))
                saved_float32.append(_nbytes(t) if t.dtype == torch.float32 else 0)
            return t

        def first_call(writable: bool) -> _FirstCall:
            """The real call, once: its output is what later nodes read."""
            leaves: list[torch.Tensor] = []
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []

            def as_leaf(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.requires_grad and not isinstance(
                    value, torch.nn.Parameter
                ):
                    value = value.detach().requires_grad_()
                    leaves.append(value)
                    if writable:  # autograd refuses in-place writes to a leaf; its copy takes them
                        copies.append((value, value.clone()))
                        return copies[-1][1]
                return value

            args, kwargs = pytree.tree_map(as_leaf, raw)
            saved.clear()
            saved_float32.clear()
            writes = _Writes()
            try:
                with writes, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FlopCount() as counter:
                    out = getattr(self, n.op)(n.target, args, kwargs)
            except Exception:
                _Snapshot([], writes.before).restore()  # undo what it wrote before failing
                raise
            return _FirstCall(args, kwargs, out, leaves, copies, float(counter.total), writes.before)

        try:
            real = first_call(writable=False)
        except RuntimeError as exc:
            if "leaf Variable that requires grad" not in str(exc):
                raise
            real = first_call(writable=True)  # an in-place op on an activation: ReLU(inplace=True), `x += y`
        self.wrote = bool(real.written or real.copies)
        args, kwargs, out, leaves = real.args, real.kwargs, real.out, real.leaves

        def call() -> Any:
            return getattr(self, n.op)(n.target, args, kwargs)

        # Timing re-runs the node, and an in-place op re-run on its own result compounds
        # (T5's `buckets += ...` then indexes past its embedding table): what the real call
        # wrote is put back before each re-run and its result after the last.
        before = _Snapshot([], real.written)
        after = _Snapshot([t for t, _ in real.written] if self.measure else [])
        weight_bytes = sum(_nbytes(p) for p in params)
        io_bytes = weight_bytes + sum(
            _nbytes(v) for v in pytree.tree_leaves((args, kwargs)) if not isinstance(v, torch.nn.Parameter)
        )
        forward_flops = real.forward_flops
        io_bytes += sum(_nbytes(v) for v in pytree.tree_leaves(out))
        if not real.written and _is_view(out, (args, kwargs)):
            io_bytes = weight_bytes = 0  # a view launches no kernel and moves no bytes
        diff_out = [
            t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        wrt = leaves + params
        backward_flops = 0.0
        forward_s = backward_s = weight_backward_s = 0.0
        if diff_out and wrt:
            grads = [torch.ones_like(t) for t in diff_out]

            def backward() -> Any:
                return torch.autograd.grad(diff_out, wrt, grads, retain_graph=True, allow_unused=True)

            with _FlopCount() as counter:
                backward()
            backward_flops = float(counter.total)
            if self.measure:
                backward_s = self._time(backward)
                weight_backward_s = backward_s
                if params and leaves and self.weight_share:  # a split backward's W: the parameters' alone

                    def weight_backward() -> Any:
                        return torch.autograd.grad(diff_out, params, grads, retain_graph=True, allow_unused=True)

                    weight_backward_s = self._time(weight_backward)
        if self.measure:
            forward_s = self._time(call, reset=before.restore)
            after.restore()  # the real call's result, whatever the re-runs left
        with torch.no_grad():
            for leaf, written_copy in real.copies:
                leaf.copy_(written_copy)  # the input's own storage: later readers of it see the write
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
            saved_float32_bytes=sum(saved_float32),
            weight_backward_s=weight_backward_s if params else 0.0,
            writes_in_place=self.wrote,
        )
        return pytree.tree_map(_detach, out), cost

    def _parameters(self, n: fx.Node) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for name in node_parameters(self.module, n):  # type: ignore[arg-type]
            param = self.tensor(name)
            if param.requires_grad and all(param is not p for p in found):
                found.append(param)
        return found

    def _time(self, fn: Callable[[], Any], reset: Callable[[], None] = lambda: None) -> float:
        """Median seconds of ``fn``; ``reset`` (untimed) runs before each call."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for _ in range(self.warmup):
            reset()
            fn()
        samples = []
        for _ in range(self.repeats):
            reset()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


class _CountInterpreter(_CostInterpreter):
    """Counting on fake tensors, each distinct call worked out once.

    On fake tensors a node's FLOPs and bytes depend only on the call: the op
    (a module's type, settings and parameter shapes), its arguments other than
    tensors, and of each tensor its shape, strides, offset, dtype, device and
    gradient flag, whether it is a parameter or shares a parameter's storage,
    and which arguments share storage with each other.  A call equal in all
    of these to one counted before (the same op in the next identical
    transformer layer) takes that one's cost, and its outputs are stand-ins of
    the same shapes, sharing storage with the same arguments, so later calls
    see what they would have seen.  Calls that write in place, read tensors
    with values (constants), or return what a stand-in cannot copy are always
    run.  :data:`_REUSE` False runs every call (``tests/test_planner_speed.py``
    checks both ways give equal costs).
    """

    def __init__(self, gm: fx.GraphModule, *, device: torch.device, progress: Progress | None,
                 state: Callable[[str], Any]) -> None:
        super().__init__(gm, measure=False, device=device, warmup=0, repeats=0, progress=progress, state=state)
        self.counted: dict[Any, tuple[NodeCost, tuple[Any, ...], pytree.TreeSpec]] = {}
        self.reused = 0  # calls that took an earlier call's cost

    def _cost(self, n: fx.Node) -> tuple[Any, NodeCost]:
        raw = self.fetch_args_kwargs_from_env(n)
        key = self._call_key(n, raw) if _REUSE else None
        if key is not None and key in self.counted:
            cost, outputs, spec = self.counted[key]
            self._parameters(n)  # registers the parameters' storages, as counting the call would
            self.reused += 1
            return _stand_ins(outputs, spec, pytree.tree_leaves(raw)), cost
        result, cost = super()._cost(n)
        if key is not None and not self.wrote:
            described = self._outputs(result, raw)
            if described is not None:
                self.counted[key] = (cost, *described)
        return result, cost

    def _call_key(self, n: fx.Node, raw: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        """What the cost of calling ``n`` on ``raw`` depends on, hashable; None: not to be reused."""
        target: Any = n.target
        if n.op == "call_module":
            target = _module_key(self.fetch_attr(str(n.target)))
        elif n.op not in ("call_function", "call_method"):
            return None
        leaves, spec = pytree.tree_flatten(raw)
        groups: dict[StorageWeakRef, int] = {}
        parts: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if not isinstance(leaf, FakeTensor) or leaf.constant is not None:
                    return None  # values that ops may read
                storage = _storage(leaf)
                parts.append((tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype, leaf.device,
                              leaf.requires_grad, isinstance(leaf, torch.nn.Parameter),
                              storage in self.param_storages, groups.setdefault(storage, len(groups))))
            else:
                value = _hashable(leaf)
                if value is _UNHASHABLE:
                    return None
                parts.append((type(leaf), value))
        if target is None:
            return None
        return n.op, target, spec, tuple(parts)

    def _outputs(self, result: Any, raw: Any) -> tuple[tuple[Any, ...], pytree.TreeSpec] | None:
        """``result`` as stand-ins can remake it (per output, its metadata and the argument it views), or None."""
        leaves, spec = pytree.tree_flatten(result)
        arguments: dict[StorageWeakRef, int] = {}
        for i, x in enumerate(pytree.tree_leaves(raw)):
            if isinstance(x, torch.Tensor):
                arguments.setdefault(_storage(x), i)
        inputs = pytree.tree_leaves(raw)
        fresh: set[StorageWeakRef] = set()
        out: list[Any] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                value = _hashable(leaf)
                if value is _UNHASHABLE:
                    return None
                out.append(_Value(leaf))
                continue
            if isinstance(leaf, torch.nn.Parameter):
                return None
            storage = _storage(leaf)
            source = arguments.get(storage)
            if source is None:
                # A new tensor: made afresh (at offset 0, sharing nothing: parameters, other outputs).
                if leaf.storage_offset() != 0 or storage in self.param_storages or storage in fresh:
                    return None
                fresh.add(storage)
            elif leaf.dtype != inputs[source].dtype:
                return None
            out.append(_Output(tuple(leaf.shape), leaf.stride(), int(leaf.storage_offset()), leaf.dtype, leaf.device,
                               leaf.requires_grad, source))
        return tuple(out), spec


# Reuse the costs of equal calls when counting (see _CountInterpreter); tests switch it off to compare.
_REUSE = True
_UNHASHABLE = object()


class _Value(NamedTuple):
    """A non-tensor output, returned as it was."""

    value: Any


class _Output(NamedTuple):
    """A tensor output: its metadata, and the flat argument whose storage it views (None: a new tensor)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    source: int | None


def _stand_ins(outputs: tuple[Any, ...], spec: pytree.TreeSpec, inputs: list[Any]) -> Any:
    """Outputs like those :meth:`_CountInterpreter._outputs` described, made under the fake mode."""
    made: list[Any] = []
    for o in outputs:
        if isinstance(o, _Value):
            made.append(o.value)
            continue
        if o.source is None:
            t = torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=o.device)
        else:
            t = inputs[o.source].detach().as_strided(o.shape, o.stride, o.offset)
        made.append(t.requires_grad_(o.requires_grad) if o.requires_grad else t)
    return pytree.tree_unflatten(made, spec)


def _hashable(value: Any) -> Any:
    """``value`` as a dictionary key (slices as tuples), or :data:`_UNHASHABLE`."""
    if isinstance(value, slice):
        parts = tuple(_hashable(v) for v in (value.start, value.stop, value.step))
        return _UNHASHABLE if _UNHASHABLE in parts else ("slice", *parts)
    if isinstance(value, (list, tuple)):
        parts = tuple(_hashable(v) for v in value)
        return _UNHASHABLE if _UNHASHABLE in parts else (type(value).__name__, *parts)
    try:
        hash(value)
    except TypeError:
        return _UNHASHABLE
    return value


def _module_key(module: torch.nn.Module) -> Any:
    """A module call's settings: per submodule its type, public plain attributes and parameter shapes (None: unknown)."""
    parts: list[Any] = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or any(True for _ in sub.buffers(recurse=False)):
            return None  # hooks may do anything; buffers may be updated (running statistics)
        settings: list[Any] = []
        for attr, value in sorted(vars(sub).items()):
            if attr.startswith("_") or isinstance(value, (torch.nn.Module, torch.Tensor)):
                continue
            kept = _hashable(value)
            if kept is _UNHASHABLE:
                return None
            settings.append((attr, type(value), kept))
        params = tuple((p, tuple(t.shape), t.dtype, t.requires_grad) for p, t in sub.named_parameters(recurse=False))
        parts.append((name, type(sub), tuple(settings), params))
    return tuple(parts)


def _measure_by_layer(
    gm: fx.GraphModule,
    inputs: tuple[Any, ...],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: Progress | None,
) -> dict[str, NodeCost]:
    """Time a model holding meta tensors one layer at a time (see :class:`_LayerInterpreter`)."""
    runner = _LayerInterpreter(gm, device=device, warmup=warmup, repeats=repeats, progress=progress)
    real = tuple(_real(x, device) if isinstance(x, torch.Tensor) else x for x in inputs)
    with _rank_threads(device), torch.enable_grad():
        runner.run(*real)
    return runner.costs


class _Lazy:
    """A ``get_attr`` value not made yet: layers materialise their tensors when a node reads them."""

    def __init__(self, name: str) -> None:
        self.name = name


class _LayerInterpreter(_CostInterpreter):
    """Times nodes on real tensors, materialising only the layer being timed.

    Each layer's parameters and buffers are made on ``device`` when one of its nodes
    first reads them (:func:`partitioner.graph.meta.materialise`) and freed after its last
    node; values flowing between nodes are real.  A layer with the signature of a
    layer already timed (identical transformer blocks) is not run: its nodes get
    the costs of the first one's, position by position, and the values other
    layers read from it are placeholders of the propagated shapes.
    """

    def __init__(
        self, gm: fx.GraphModule, *, device: torch.device, warmup: int, repeats: int, progress: Progress | None
    ) -> None:
        super().__init__(gm, measure=True, device=device, warmup=warmup, repeats=repeats, progress=progress,
                         state=self._materialised)
        self.home = device
        self.layer_of = {name: layer for layer in layers(gm) for name in layer.nodes}
        self.reference: dict[str, Layer] = {}  # signature -> the first layer with it, once it is done
        self.reused: dict[str, Layer] = {}  # layer path -> the layer whose costs it takes
        self.live: dict[str, Any] = {}  # graph name -> materialised tensor
        self.owned: dict[str, list[str]] = {}  # layer path -> graph names it materialised
        self.requires_grad: dict[str, list[bool]] = {}  # node -> requires_grad of its output tensors
        self.current = ""

    def run_node(self, n: fx.Node) -> Any:
        layer = self.layer_of.get(n.name)
        if layer is None:
            return super().run_node(n)
        if n.name == layer.nodes[0]:
            self._enter(layer)
        self.current = layer.path
        reference = self.reused.get(layer.path)
        if reference is None:
            result = super().run_node(n)
        else:
            self.tick()
            result = self._reuse(n, layer, reference)
        if n.name == layer.nodes[-1]:
            self._leave(layer)
        return result

    def get_attr(self, target: fx.node.Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _Lazy(str(target))  # made when a node of a layer reads it, not all at the graph's top

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return pytree.tree_map(lambda v: self.tensor(v.name) if isinstance(v, _Lazy) else v, (args, kwargs))

    def _cost(self, n: fx.Node) -> tuple[Any, NodeCost]:
        result, cost = super()._cost(n)
        self.requires_grad[n.name] = [t.requires_grad for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        return result, cost

    def _materialised(self, name: str) -> Any:
        if name not in self.live:
            made: dict[str, Any] = materialise(self.module, name.rpartition(".")[0], self.device)  # type: ignore[arg-type]
            if name not in made:  # a plain tensor attribute (an exported constant), not a parameter or buffer
                value = attribute(self.module, name)  # type: ignore[arg-type]
                made[name] = _real(value, self.device) if isinstance(value, torch.Tensor) else value
            for key, value in made.items():
                if key not in self.live:
                    self.live[key] = value
                    self.owned.setdefault(self.current, []).append(key)
        return self.live[name]

    def _enter(self, layer: Layer) -> None:
        reference = self.reference.get(layer.signature)
        needed = [n for n in layer.nodes if self._read_outside(n, layer)]
        if reference is not None and all("val" in self._node(n).meta for n in needed):
            self.reused[layer.path] = reference

    def _leave(self, layer: Layer) -> None:
        for name in self.owned.pop(layer.path, []):
            value = self.live.pop(name)
            if isinstance(value, torch.nn.Parameter):
                self.param_storages.discard(_storage(value))
        if layer.path not in self.reused and not layer.signature.startswith("unique:"):
            self.reference.setdefault(layer.signature, layer)

    def _reuse(self, n: fx.Node, layer: Layer, reference: Layer) -> Any:
        source = reference.nodes[layer.nodes.index(n.name)]
        cost = self.costs[source]
        n.meta[COST_KEY] = cost
        self.costs[n.name] = cost
        if not self._read_outside(n.name, layer):
            return None  # nothing outside the layer reads it
        flags = iter(self.requires_grad.get(source, []))

        def stand_in(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                made = placeholder(value, self.device)
                return made.requires_grad_(next(flags, False) and made.is_floating_point())
            return self.device if isinstance(value, torch.device) else value

        return pytree.tree_map(stand_in, n.meta["val"])

    def _read_outside(self, name: str, layer: Layer) -> bool:
        return any(self.layer_of.get(u.name) is not layer for u in self._node(name).users)

    def _node(self, name: str) -> fx.Node:
        return self._nodes[name]

    @functools.cached_property
    def _nodes(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.graph.nodes}

    def run_node_failed(self, n: fx.Node, exc: Exception) -> AutopartitionError:
        return _not_materialisable(self.current, n, exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _real(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return placeholder(tensor, device) if is_meta(tensor) else tensor.to(device)


def _not_materialisable(layer: str, node: fx.Node, exc: Exception) -> AutopartitionError:
    return AutopartitionError(
        "The model holds meta tensors (built under torch.device('meta'), or meta example inputs), so measuring "
        "its times (--device cpu or cuda) materialises it one layer at a time with placeholder values: "
        "parameters re-initialised by reset_parameters() or at random, buffers, constants and inputs filled "
        "with random numbers, zeros (integers) or True. Layer "
        f"`{layer or '(root)'}` failed on those values at node {node.format_node()}: {_first_line(exc)}. Its values "
        "matter to the computation (an index table, a divisor or a mask built in __init__), and on meta they "
        "are lost. Plan with a predicted device instead (--device h100, a100 or h200: costs are counted from "
        "shapes alone and nothing is materialised), or build the model with real weights to measure it."
    )


# Metadata queries, as FlopCounterMode skips them (torch/utils/flop_counter.py).
_METADATA_OPS = frozenset({
    torch.ops.aten.sym_is_contiguous.default, torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format, torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default, torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default, torch.ops.aten.stride.default, torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default, torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default, torch.ops.aten.sym_numel.default, torch.ops.aten.dim.default,
    torch.ops.prim.layout.default,
})


def _cpu_sdpa_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_sdpa_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


def _grouped_mm_flops(tokens: Any, weight: Any, *args: Any, **kwargs: Any) -> int:
    """A grouped matmul, tokens ``(S, K)`` sorted by expert against ``(E, K, N)``: each row meets one expert."""
    return 2 * int(tokens.shape[0]) * int(tokens.shape[-1]) * int(weight.shape[-1])


def _grouped_mm_ops() -> dict[Any, Callable[..., int]]:
    """Grouped-matmul ops of mixture-of-experts layers (torch's, and transformers' fallback when registered)."""
    found: dict[Any, Callable[..., int]] = {}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        found[torch.ops.aten._grouped_mm] = _grouped_mm_flops
    try:  # registered when transformers' MoE integration is imported (by an HF MoE model)
        found[torch.ops.transformers.grouped_mm_fallback] = _grouped_mm_flops
        found[torch.ops.transformers.grouped_mm_fallback_backward] = _grouped_mm_backward_flops
    except (AttributeError, RuntimeError):
        pass
    return found


def _grouped_mm_backward_flops(tokens: Any, weight: Any, *args: Any, **kwargs: Any) -> int:
    """Its backward: the input's gradient and the weights', one grouped matmul each."""
    return 2 * _grouped_mm_flops(tokens, weight)


# torch's registry covers the CUDA attention kernels but not the CPU flash kernel that
# ``scaled_dot_product_attention`` picks for CPU (and CPU-device fake) tensors, so the
# attention matmuls of a Hugging Face model would count as 0 FLOPs; same formulas.
_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
    **_grouped_mm_ops(),
}


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
        if func in _METADATA_OPS:
            return NotImplemented  # fake tensors ask for sizes and strides through dispatch: no FLOPs
        packet = func._overloadpacket
        if packet not in _FLOP_FORMULAS and packet.__module__ != "torch._ops.aten" and "grouped_mm" in str(packet):
            _FLOP_FORMULAS.update(_grouped_mm_ops())
        if (packet not in _FLOP_FORMULAS and not isinstance(func, torch._ops.HigherOrderOperator)
                and func is not torch.ops.prim.device.default):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(packet)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def _is_view(out: Any, inputs: Any) -> bool:
    """Does ``out`` share storage with an input?  (``_is_alias_of``: data pointers are 0 on fake tensors.)"""
    if not isinstance(out, torch.Tensor) or out.numel() == 0:
        return False
    return any(
        isinstance(t, torch.Tensor) and t.numel() > 0 and torch._C._is_alias_of(out, t)  # type: ignore[attr-defined]
        for t in pytree.tree_leaves(inputs)
    )


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    """A hashable key of ``tensor``'s storage, shared by its views (works on fake and meta tensors)."""
    return StorageWeakRef(tensor.untyped_storage())


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes  # numel x element size
    return 0


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.detach().requires_grad_(value.requires_grad)
    return value
