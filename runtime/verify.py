"""Verify a plan: run it on CPU ranks and compare with the unpartitioned model run the same way.

``verify(plan_dir, model_spec)`` starts ``plan.gpus`` CPU processes (gloo, :func:`start_ranks`),
trains ``steps`` optimizer steps (SGD with momentum) through
:class:`~runtime.Pipeline`, and checks every step against a reference that
runs the whole model in this process *the way the pipeline runs it*, so that
only a partitioning error can make the two differ:

* **Same micro-batches.** The batch is split into ``dp`` replicas x ``M``
  micro-batches exactly as :meth:`Pipeline.step` slices it; the reference
  runs them in that order, backpropagates ``loss / M`` per micro-batch and
  averages the replicas' gradients (as DDP does).  Batch statistics
  (BatchNorm) are therefore per micro-batch in both runs, and running
  statistics are kept per replica (the runtime's DDP does not re-broadcast
  buffers), so they are compared too.
* **Same start every step.** Before each step the reference takes the
  pipeline's parameters and buffers, so a rounding difference cannot grow
  over steps (a max-pool or ReLU tie flipped by 1e-7 would otherwise look
  like a wrong gradient); each step's differences are reported.
* **No randomness.** Dropout (modules, functional, inside attention) runs
  with ``p=0`` in both runs; any other random draw (``rand*``,
  ``bernoulli``, ``multinomial``, ...) reseeds the generator to one fixed
  seed at every call, so both runs draw the same values.  Both are done by
  torch modes around the forward and backward, which see the eager model,
  symbolic-trace graphs and exported (aten) graphs alike.  The random ops
  of the captured graph are listed in the report.

``dtype="float64"`` runs both sides in double precision (model, inputs and
the plan's boundary tensors), for a tolerance of 1e-10 instead of 1e-5.
Differences are absolute, after scaling by the reference's largest magnitude
when that exceeds 1.

Example::

    result = verify("plan/", "examples/gpt.py", steps=3)
    print(result.report())
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner.errors import AutopartitionError
from partitioner.graph.capture import CallSpec, model_loss
from partitioner.graph.ir import dtype_name
from partitioner.plan import Plan
from runtime.execute.stage import call_spec, recapture
from runtime.launch.failure import (
    FAILURE_DIR_ENV,
    RankFailure,
    RankInputError,
    describe_exit,
    read_records,
    record_failure,
    summarise,
    write_log,
)
from runtime.parallel.shard import plain_tensor
from runtime.parallel.tensorparallel import refuse_unrunnable_tp
from runtime.state.materialise import InitWeights, materialise_model

__all__ = [
    "DTYPES",
    "RANK_PRELOAD",
    "Derandomised",
    "ModelTraits",
    "RandomOp",
    "StepComparison",
    "VerifyResult",
    "Worst",
    "free_port",
    "model_traits",
    "plan_in_dtype",
    "reference_microbatches",
    "start_ranks",
    "verify",
    "verify_plan",
]

DTYPES = {"float32": 1e-5, "float64": 1e-10}  # dtype -> default tolerance
_SEED = 1234  # every random draw in either run starts from this seed


# ------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True)
class Worst:
    """The largest difference of one kind in one step, where it is, and how many exceed the tolerance."""

    value: float = 0.0
    where: str = "-"
    name: str = ""
    rank: int = -1
    over: int = 0
    total: int = 0


@dataclasses.dataclass(frozen=True)
class StepComparison:
    """One step, both runs started from the pipeline's parameters and buffers."""

    step: int  # 1-based
    loss: float  # the reference's mini-batch loss
    loss_diff: float
    grad: Worst
    buffer: Worst
    param: Worst  # after the optimizer step

    def largest(self) -> float:
        return max(self.loss_diff, self.grad.value, self.buffer.value, self.param.value)


@dataclasses.dataclass(frozen=True)
class RandomOp:
    """A random op of the captured graph: its node, what it calls, and its drop probability if dropout."""

    node: str
    op: str  # "Dropout" (a module), "dropout", "randn_like", ...
    p: float | None = None  # dropout only (None when not a constant)
    dropout: bool = False

    def __str__(self) -> str:
        if self.dropout:
            return f"{self.node} ({self.op}" + (f", p={self.p:g})" if self.p is not None else ")")
        return self.node if self.node == self.op else f"{self.node} ({self.op})"


@dataclasses.dataclass(frozen=True)
class ModelTraits:
    """What can make a model's runs differ besides the partition: random ops and batch statistics."""

    random_ops: tuple[RandomOp, ...] = ()
    batch_stats: tuple[str, ...] = ()  # "BatchNorm2d down.1 (running statistics)"

    @property
    def has_running_stats(self) -> bool:
        return any("running" in s for s in self.batch_stats)

    def random_text(self) -> str:
        """What verify did about the random ops, listing them."""
        dropout = [str(r) for r in self.random_ops if r.dropout]
        other = [str(r) for r in self.random_ops if not r.dropout]
        parts = []
        if dropout:
            parts.append(
                f"{_plural(len(dropout), 'dropout op')} neutralised (p=0) in both runs: {', '.join(dropout)}"
            )
        if other:
            parts.append(f"{_plural(len(other), 'other random op')} given the same draws in both runs "
                         f"(generator reseeded to one seed at every call): {', '.join(other)}")
        return "; ".join(parts) or "no random ops"

    def facts(self) -> str:
        """Random ops and batch statistics, for a MISMATCH: whether either could explain it."""
        random = (f"random ops ({', '.join(map(str, self.random_ops))}), neutralised in both runs"
                  if self.random_ops else "no random ops")
        stats = (f"batch statistics ({', '.join(self.batch_stats)}), per micro-batch in both runs"
                 if self.batch_stats else "no batch statistics")
        return f"The model has {random}, and {stats}"


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Every step's comparison, the largest differences over all steps, and what the runs had in common.

    ``summary()`` is the verdict (one paragraph, ``OK: ...`` or ``MISMATCH: ...``);
    ``report()`` adds one line per step before it.
    """

    steps: int
    max_loss_diff: float
    max_grad_diff: float
    worst_grad: str
    max_param_diff: float
    worst_param: str
    tolerance: float
    losses: tuple[float, ...]  # the reference's
    max_buffer_diff: float = 0.0
    worst_buffer: str = "-"
    per_step: tuple[StepComparison, ...] = ()
    start_diff: Worst = Worst()  # the ranks' initial state against the model file's
    dtype: str = "float32"
    layout: str = ""  # "1 replica x 2 micro-batches of 4"
    traits: ModelTraits = ModelTraits()
    neutralised: tuple[dict[str, int], dict[str, int]] = ({}, {})  # (reference, pipeline) changed calls by op
    rank_places: tuple[str, ...] = ()  # "stage 0, replica 1" per rank
    pp: int = 1
    unread: tuple[str, ...] = ()  # parameters the forward never reads (no gradient, held by no rank)

    @property
    def ok(self) -> bool:
        return max(self.max_loss_diff, self.max_grad_diff, self.max_param_diff, self.max_buffer_diff,
                   self.start_diff.value) <= self.tolerance

    def summary(self) -> str:
        """The verdict, one paragraph starting with OK or MISMATCH, with its reason."""
        return self._ok_verdict() if self.ok else self._mismatch_verdict()

    def report(self) -> str:
        """One line per step, then the verdict (what ``autopartition verify`` prints)."""
        lines = [self._step_line(s) for s in self.per_step]
        return "\n".join([*lines, self.summary()])

    # --------------------------------------------------------------- text

    def _step_line(self, s: StepComparison) -> str:
        verdict = "OK      " if s.largest() <= self.tolerance else "MISMATCH"
        parts = [f"loss {s.loss:.6f} (diff {_num(s.loss_diff)})", f"gradients {_num(s.grad.value, s.grad.name)}"]
        if s.buffer.total:
            parts.append(f"buffers {_num(s.buffer.value, s.buffer.name)}")
        parts.append(f"parameters after the update {_num(s.param.value, s.param.name)}")
        return f"step {s.step}: {verdict} " + ", ".join(parts)

    def _how(self) -> str:
        stats = ""
        if self.traits.batch_stats:
            per_replica = self.traits.has_running_stats and "replicas" in self.layout
            kinds = sorted({s.split()[0] for s in self.traits.batch_stats})
            stats = f"; {'/'.join(kinds)} statistics per micro-batch" + (
                ", running statistics per replica" if per_replica else "")
        return f"reference micro-batched as the pipeline ({self.layout}{stats})"

    def _calls(self) -> str:
        reference, pipeline = (sum(c.values()) for c in self.neutralised)
        if reference == pipeline:
            return f"; {_plural(reference, 'random call')} changed in each run" if reference else ""
        return f"; random calls changed: {reference} in the reference, {pipeline} in the pipeline"

    def _ok_verdict(self) -> str:
        match = max(self.max_loss_diff, self.max_grad_diff)
        matched = "exactly" if match == 0 else f"to {match:.0e}"
        extra = ""
        if any(s.buffer.total for s in self.per_step):
            extra = ", buffers " + ("exactly" if self.max_buffer_diff == 0 else f"to {self.max_buffer_diff:.0e}")
        unread = ""
        if self.unread:
            shown = ", ".join(self.unread[:3]) + (f" and {len(self.unread) - 3} more" if len(self.unread) > 3 else "")
            unread = (f" {_plural(len(self.unread), 'parameter')} the forward never reads ({shown}): no gradient, "
                      "held by no rank, unchanged in both runs.")
        return (
            f"OK: loss and gradients match {matched} over {_plural(self.steps, 'step')}{extra} "
            f"(tolerance {self.tolerance:.0e}, {self.dtype}; each step from the pipeline's parameters); "
            f"{self._how()}; {self.traits.random_text()}{self._calls()}.{unread}"
        )

    def _mismatch_verdict(self) -> str:
        facts = self.traits.facts()
        reference, pipeline = (sum(c.values()) for c in self.neutralised)
        if reference != pipeline:
            facts += (f"; but the runs changed different numbers of random calls (reference {reference}, "
                      f"pipeline {pipeline}): a random op that runs differently once partitioned")
        return (
            f"MISMATCH: {self._first_difference()}. {facts}. Tolerance {self.tolerance:.0e} ({self.dtype}); "
            f"{self._how()}."
        )

    def _first_difference(self) -> str:
        if self.start_diff.value > self.tolerance:
            return (
                f"the ranks start from other parameters or buffers than the model file builds "
                f"({self._look(self.start_diff)} differs by {self.start_diff.value:.1e}): build_model() must be "
                "deterministic (seeded) and must not depend on the rank"
            )
        for s in self.per_step:
            if s.largest() <= self.tolerance:
                continue
            at = f"first at step {s.step} of {self.steps}"
            grads = (f"{s.grad.over} of {s.grad.total} gradients differ, the most {self._look(s.grad)} "
                     f"by {s.grad.value:.1e}")
            if s.loss_diff > self.tolerance:
                return (f"{at}: the loss differs by {s.loss_diff:.1e} ({s.loss:.6f} in the reference) "
                        f"and {grads}; look at the forward, from the stage that computes the loss "
                        f"(stage {self.pp - 1}) back")
            if s.grad.value > self.tolerance:
                return (f"{at}: the loss matches but {grads}; look at the backward of the stage holding "
                        f"{s.grad.name} and the gradients sent into it")
            if s.buffer.value > self.tolerance:
                return (f"{at}: loss and gradients match but buffer {self._look(s.buffer)} differs by "
                        f"{s.buffer.value:.1e} ({s.buffer.over} of {s.buffer.total} buffers differ); look at how "
                        "that stage updates its running statistics")
            return (f"{at}: gradients match but parameter {self._look(s.param)} differs after the optimizer step "
                    f"by {s.param.value:.1e}; look at tied weights and replica synchronisation")
        return "no difference found"

    def _look(self, w: Worst) -> str:
        if w.rank < 0:
            return w.name or "-"
        place = self.rank_places[w.rank] if w.rank < len(self.rank_places) else ""
        return f"{w.name} on rank {w.rank} ({place})"


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _num(value: float, name: str = "") -> str:
    """A difference for the step lines: ``0``, or ``3.1e-08 (fc.weight)``."""
    if value == 0:
        return "0"
    return f"{value:.1e}" + (f" ({name})" if name else "")


# --------------------------------------------------------------- entry points


def free_port() -> int:
    """A TCP port free on this host now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What every rank imports anyway (torch._dynamo: fake tensors, for the stage's recapture; the
# distributed packages: replicas and checkpoints): the fork server imports it once, each rank is forked from it.
RANK_PRELOAD = [
    "torch", "torch._dynamo", "torch.export", "torch.distributed", "torch.distributed.fsdp",
    "torch.distributed.tensor", "torch.distributed.checkpoint", "partitioner.modelfile", "runtime.pipeline",
    "runtime.state.checkpoint", "runtime.verify",
]


def start_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, *, join: bool = True
) -> mp.ProcessContext | None:
    """Start ``nprocs`` CPU ranks running ``fn(rank, *args)``: fresh processes without re-importing torch.

    Spawning a rank costs a new interpreter importing torch (seconds each, more with
    several ranks on few cores); a fork server (started on the first call, kept for the
    life of this process) imports :data:`RANK_PRELOAD` once and forks every rank from it,
    so each rank is still a new process with its own state.  Each rank gets this
    process's environment as it is at the call (a forked rank would otherwise see the
    server's, from when it started).  Where there is no fork server (Windows), ranks
    are spawned.  ``join`` as :func:`torch.multiprocessing.start_processes`.
    """
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # no effect once the server runs
    return mp.start_processes(_in_environment, args=(dict(os.environ), fn, args), nprocs=nprocs,
                              start_method=method, join=join)


def _in_environment(rank: int, environment: dict[str, str], fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, *args)


def verify(
    plan_dir: str | Path,
    model_spec: str,
    *,
    steps: int = 3,
    lr: float = 0.01,
    timeout: float = 120.0,
    tolerance: float | None = None,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
    engine: str = "ours",
) -> VerifyResult:
    """Train ``steps`` steps with the plan on CPU ranks and with the whole model run the same way; compare.

    ``tolerance`` defaults to 1e-5 for float32 and 1e-10 for float64; ``progress``
    receives a line at each phase.  A model file building on meta is materialised
    with its ``init_weights`` and base ``seed`` (:mod:`runtime.state.materialise`): per
    stage on the ranks, whole for the reference, so both start from the same values.
    ``engine``: the ranks' ``Pipeline(engine=)``: ``"ours"`` or ``"torch"`` (torch.distributed.pipelining).
    """
    from partitioner.modelfile import load_model_file

    if dtype not in DTYPES:
        raise AutopartitionError(f"verify runs in {' or '.join(DTYPES)}, not {dtype!r}.")
    tol = DTYPES[dtype] if tolerance is None else tolerance
    say = progress or (lambda _: None)
    plan = plan_in_dtype(Plan.load(plan_dir), getattr(torch, dtype))
    refuse_unrunnable_tp(plan, engine=engine)  # before any rank starts
    model_file = load_model_file(model_spec)
    if model_file.loss_fn is not None and model_file.example_target is None:
        raise AutopartitionError(
            f"{model_spec} needs example_target(batch_size) next to loss_fn for verification (or no "
            "loss_fn, for a model that returns its own loss)."
        )
    model = _build(model_file, getattr(torch, dtype))
    captured, _ = recapture(plan, model)  # a plan for another model fails here, before any rank starts
    traits = model_traits(model, captured.graph_module)
    chunks = f", {plan.chunks} per rank, {plan.schedule}" if plan.chunks > 1 else ""
    on = "" if engine == "ours" else f", engine {engine}"
    say(f"verify: training {_plural(steps, 'step')} on {plan.gpus} CPU ranks "
        f"({_plural(len(plan.stages), 'stage')}{chunks} x {_plural(plan.dp, 'replica')}"
        f"{f' x {plan.tp} tensor-parallel' if plan.tp > 1 else ''}{on})")
    if plan.precision == "fp8":
        say(f"verify: the plan trains in fp8; verify runs its FP8 matmuls ({plan.fp8_recipe}) with the rest in "
            f"{dtype}, against the whole captured graph with the same FP8 matmuls")
    elif plan.precision != "fp32":
        say(f"verify: the plan trains in {plan.precision}; verify runs it in {dtype} against the whole model "
            "in the same precision (autocast runs are compared by the test suite)")
    with tempfile.TemporaryDirectory(prefix="autopartition-verify-") as out:
        port = free_port()
        try:
            start_ranks(_rank_main, (plan.gpus, port, str(plan_dir), model_spec, steps, lr, out, timeout, dtype, seed,
                                     engine), plan.gpus)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # one rank failed; the others were stopped
            raise _rank_failure(Path(out), plan, exc) from None
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(plan.gpus)]
    say("verify: running the unpartitioned model on the same micro-batches")
    return _compare_steps(plan, model_file, ranks, steps=steps, lr=lr, tolerance=tol, dtype=dtype, traits=traits,
                          seed=seed)


def verify_plan(
    plan_dir: str, model_spec: str, *, steps: int = 3, timeout: float = 120.0, dtype: str = "float32",
    engine: str = "ours",
) -> int:
    """The ``autopartition verify`` command: print each step and the verdict; exit code 0 when OK."""
    result = verify(
        plan_dir, model_spec, steps=steps, timeout=timeout, dtype=dtype, engine=engine,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(result.report())
    return 0 if result.ok else 1


# ------------------------------------------------------------- model traits


# Functions taking a drop probability: name -> (position, keyword, default); training flag after it.
_DROP_PROBABILITY: dict[str, tuple[int, str, float]] = {
    **{name: (1, "p", 0.5) for name in (
        "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
        "feature_dropout", "native_dropout",
    )},
    "scaled_dot_product_attention": (4, "dropout_p", 0.0),
    "multi_head_attention_forward": (10, "dropout_p", 0.0),
}
_TRAINING_FLAG: dict[str, tuple[int, tuple[str, ...]]] = {
    "scaled_dot_product_attention": (-1, ()),
    "multi_head_attention_forward": (13, ("training",)),
}
_DEFAULT_TRAINING_FLAG = (2, ("training", "train"))


def _op_name(target: Any) -> str:
    """An op's bare name: ``aten.dropout.default``, ``F.dropout`` -> ``dropout``; ``bernoulli_`` -> ``bernoulli``."""
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
    else:
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


@functools.cache
def _is_random_name(name: str) -> bool:
    """Whether a torch function of this name draws random numbers (its aten op is tagged seeded)."""
    if name in _DROP_PROBABILITY:
        return True
    for candidate in (name, name + "_"):
        packet = getattr(torch.ops.aten, candidate, None) if candidate.isidentifier() else None
        if packet is not None and any(
            torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads()
        ):
            return True
    return False


def _argument(args: Sequence[Any], kwargs: dict[str, Any], index: int, keys: Sequence[str], default: Any) -> Any:
    if 0 <= index < len(args):
        return args[index]
    return next((kwargs[k] for k in keys if k in kwargs), default)


def _drops(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The drop probability of a dropout-like call (0 when it does not drop: p=0 or not training)."""
    index, key, default = _DROP_PROBABILITY[name]
    t_index, t_keys = _TRAINING_FLAG.get(name, _DEFAULT_TRAINING_FLAG)
    if t_keys and _argument(args, kwargs, t_index, t_keys, True) is False:
        return 0.0
    return _argument(args, kwargs, index, (key,), default)


def _random_nodes(gm: fx.GraphModule) -> list[RandomOp]:
    """The random ops of a captured graph (symbolic trace: modules and torch functions; export: aten ops)."""
    found: list[RandomOp] = []
    for node in gm.graph.nodes:
        if node.op == "call_module":  # a leaf module, possibly holding dropout (TransformerEncoderLayer)
            for sub_name, sub in gm.get_submodule(str(node.target)).named_modules():
                p = sub.p if isinstance(sub, nn.modules.dropout._DropoutNd) else (
                    sub.dropout if isinstance(sub, nn.MultiheadAttention) else 0.0)
                if p and sub.training:
                    path = ".".join(x for x in (str(node.target), sub_name) if x)
                    found.append(RandomOp(path, type(sub).__name__, float(p), dropout=True))
        elif node.op in ("call_function", "call_method"):
            name = _op_name(node.target)
            if name in _DROP_PROBABILITY:
                p = _drops(name, node.args, dict(node.kwargs))
                constant = isinstance(p, (int, float))
                if not (constant and p == 0):
                    found.append(RandomOp(node.name, name, float(p) if constant else None, dropout=True))
            elif _is_random_name(name):
                found.append(RandomOp(node.name, name))
    return found


def model_traits(model: nn.Module, graph_module: fx.GraphModule) -> ModelTraits:
    """Random ops in the captured graph and modules with batch statistics in the model."""
    stats = []
    for name, module in model.named_modules():
        is_bn = isinstance(module, nn.modules.batchnorm._BatchNorm)
        is_in = isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats
        if (is_bn or is_in) and module.training:
            running = " (running statistics)" if module.track_running_stats else ""
            stats.append(f"{type(module).__name__} {name}{running}")
    return ModelTraits(random_ops=tuple(_random_nodes(graph_module)), batch_stats=tuple(stats))


# -------------------------------------------------------- derandomising modes


class _ZeroDropout(TorchFunctionMode):
    """Calls dropout-like functions (torch, functional, aten) with drop probability 0."""

    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = _op_name(func)
        if name in _DROP_PROBABILITY and _drops(name, args, kwargs) != 0:
            self.counts[name] += 1
            index, key, _ = _DROP_PROBABILITY[name]
            if index < len(args):
                args = (*args[:index], 0.0, *args[index + 1 :])
            else:
                kwargs[key] = 0.0
        return func(*args, **kwargs)


class _SameDraws(TorchDispatchMode):
    """Every random aten op draws from a generator reseeded to one seed (restored after the call).

    Works below functions the function mode cannot see into (e.g. dropout inside
    ``multi_head_attention_forward``), for every op torch tags ``nondeterministic_seeded``.
    """

    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = _op_name(func)
        if torch.Tag.nondeterministic_seeded not in func.tags or (
            name in _DROP_PROBABILITY and _drops(name, args, kwargs) == 0  # already set to p=0
        ):
            return func(*args, **kwargs)
        self.counts[name] += 1
        if kwargs.get("generator") is not None:
            kwargs["generator"] = torch.Generator(kwargs["generator"].device).manual_seed(_SEED)
            return func(*args, **kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(_SEED)
            return func(*args, **kwargs)


class Derandomised:
    """Context manager: dropout at p=0 and every other random draw from one fixed seed.

    ``counts`` tells, per op, how many calls were changed (dropout: function
    name; draws: aten op), so two runs can be checked to have done the same.
    """

    def __init__(self) -> None:
        self.dropout: collections.Counter[str] = collections.Counter()
        self.draws: collections.Counter[str] = collections.Counter()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        self._stack = contextlib.ExitStack()  # entered once per step in the ranks
        self._stack.enter_context(_SameDraws(self.draws))
        self._stack.enter_context(_ZeroDropout(self.dropout))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def counts(self) -> dict[str, int]:
        merged = {f"{k} (p=0)": v for k, v in self.dropout.items()}
        merged.update({f"{k} (fixed seed)": v for k, v in self.draws.items()})
        return merged


# ------------------------------------------------------------------ dtypes


def plan_in_dtype(plan: Plan, dtype: torch.dtype) -> Plan:
    """The plan with every floating input and boundary tensor in ``dtype`` (float64 verification)."""
    name = dtype_name(dtype)

    def cast(spec: Any) -> Any:
        floating = spec.dtype.startswith(("float", "bfloat"))
        return dataclasses.replace(spec, dtype=name) if floating and spec.dtype != name else spec

    if all(t.dtype == name or not t.dtype.startswith(("float", "bfloat")) for t in plan.model.inputs) and all(
        cast(b) is b for s in plan.stages for b in (*s.inputs, *s.outputs)
    ):
        return plan
    stages = tuple(
        dataclasses.replace(s, inputs=tuple(map(cast, s.inputs)), outputs=tuple(map(cast, s.outputs)))
        for s in plan.stages
    )
    model = dataclasses.replace(plan.model, inputs=tuple(map(cast, plan.model.inputs)))
    return dataclasses.replace(plan, model=model, stages=stages)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    def one(v: Any) -> Any:
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    return pytree.tree_map(one, value)


def _build(model_file: Any, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = model_file.build()
    return model.to(dtype) if dtype != torch.float32 else model


def _init_weights(model_file: Any) -> InitWeights | None:
    """The model file's ``init_weights(module, name)``, if it defines one."""
    return model_file.init_weights  # type: ignore[no-any-return]


# --------------------------------------------------------------------- ranks


def _rank_main(
    rank: int, world: int, port: int, plan_dir: str, model_spec: str, steps: int, lr: float, out: str,
    timeout: float, dtype_text: str, seed: int = 0, engine: str = "ours",
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), **{FAILURE_DIR_ENV: out})
    torch.set_num_threads(1)
    try:
        _train_rank(rank, plan_dir, model_spec, steps, lr, out, timeout, dtype_text, seed, engine)
    except Exception as exc:  # noqa: BLE001 - recorded; the verifying process prints the first cause
        record_failure(exc, rank=rank, directory=out)
        sys.exit(2 if isinstance(exc, AutopartitionError) else 1)


def _train_rank(
    rank: int, plan_dir: str, model_spec: str, steps: int, lr: float, out: str, timeout: float, dtype_text: str,
    seed: int, engine: str = "ours",
) -> None:
    from partitioner.modelfile import load_model_file
    from runtime.pipeline import Pipeline

    dtype = getattr(torch, dtype_text)
    # verify checks the split in full precision against an fp32/fp64 reference; the plan's
    # training precision (bf16-mixed, bf16) is checked by tests against autocast runs.
    # An fp8 plan keeps its FP8 matmuls (runtime/state/fp8.py), the rest in the verify dtype: the reference
    # runs the whole graph with the same ones (_compare_steps).
    loaded = plan_in_dtype(Plan.load(plan_dir), dtype)
    plan = dataclasses.replace(loaded, precision="fp32")
    model_file = load_model_file(model_spec)
    model = _build(model_file, dtype)
    pipe = Pipeline(plan, model, model_file.loss_fn, device=torch.device("cpu"), timeout=timeout,
                    init_weights=_init_weights(model_file), seed=seed, engine=engine,
                    fp8=loaded.precision == "fp8")
    inputs, target = _batch(model_file, plan, dtype)
    # A rank whose stages hold no parameter (a stage of shape ops only) has nothing to step.
    # pipe.optimizer: under shard "optimizer" its state is split over the replicas (ZeRO-1), as the plan says.
    opt = pipe.optimizer(torch.optim.SGD, lr=lr, momentum=0.9) if list(pipe.parameters()) else None
    # whole_experts: an expert-parallel rank's expert slices gathered over its EP group, under the model's names
    # (every member calls it, in one order); so its parameters are every expert's.
    params = set(pipe.whole_experts({n: p.detach() for n, p in pipe.named_parameters()}))

    def snapshot() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # plain_tensor: a fully sharded stage's DTensor gathered whole (every replica calls it, in one order).
        state = {n: plain_tensor(t).detach().clone() for m in pipe.modules for n, t in m.state_dict().items()}
        state = pipe.whole_experts(state)
        return {n: t for n, t in state.items() if n in params}, {n: t for n, t in state.items() if n not in params}

    record: dict[str, Any] = {"stage": pipe.stages[0], "stages": pipe.stages, "replica": plan.rank_layout()[rank][1],
                              "losses": [], "grads": [], "params": [], "buffers": []}
    derandomised = Derandomised()
    for _ in range(steps):
        p, b = snapshot()
        record["params"].append(p)
        record["buffers"].append(b)
        if opt is not None:
            opt.zero_grad()
        with derandomised:  # a fresh copy of the batch each step, as the reference takes (a model may write it)
            loss = pipe.step(*_fresh((inputs, target)))
        if loss is not None:
            record["losses"].append(loss.item())
        record["grads"].append(pipe.whole_experts(
            {n: plain_tensor(q.grad).detach().clone() for n, q in pipe.named_parameters() if q.grad is not None}
        ))
        if opt is not None:
            opt.step()
    p, b = snapshot()
    record["params"].append(p)
    record["buffers"].append(b)
    record["random"] = derandomised.counts
    torch.save(record, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _rank_failure(
    out: Path, plan: Plan, exc: mp.ProcessRaisedException | mp.ProcessExitedException
) -> RankFailure:
    """The first cause among the ranks' records (or the rank that died without one), as one paragraph.

    Every rank's traceback goes to a log that outlives the run, named in the message.
    """
    records = read_records(out)
    died: dict[int, str] = {}
    if isinstance(exc, mp.ProcessExitedException):
        died[exc.error_index] = describe_exit(exc.exit_code)  # negative: killed by that signal
    elif isinstance(exc, mp.ProcessRaisedException) and all(r.rank != exc.error_index for r in records):
        died[exc.error_index] = f"an exception outside the recorded part: {str(exc).strip().splitlines()[-1]}"
    log = None
    if records:
        handle, name = tempfile.mkstemp(prefix="autopartition-verify-", suffix=".log")
        os.close(handle)
        write_log(records, name)
        log = Path(name)
    summary = summarise(records, died=died, log=log, what="verify's ranks", log_holds="Every rank's traceback")
    text = summary.text.removeprefix("autopartition: error: ")  # the CLI adds it
    if summary.cause is not None and summary.cause.stage is None and 0 <= summary.cause.rank < plan.gpus:
        pipeline_rank, replica = plan.rank_layout()[summary.cause.rank]
        text = text.replace(f"rank {summary.cause.rank}:", f"rank {summary.cause.rank} "
                            f"({_stage_names(plan.stages_of(pipeline_rank))}, replica {replica}):", 1)
    return (RankInputError if summary.exit_code == 2 else RankFailure)(text)


def _stage_names(stages: Sequence[int]) -> str:
    """``stage 2``, or ``stages 0, 3`` for a rank holding several."""
    return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def _fresh(value: Any) -> Any:
    """``value`` with every tensor copied: a step's batch, which the model may write in place (``x.mul_``)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), value)


def _batch(model_file: Any, plan: Plan, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model file's mini-batch; without a loss_fn the model computes its loss (target among the inputs)."""
    inputs = _cast(model_file.example_inputs(plan.batch_size), dtype)
    if model_file.loss_fn is None:
        return inputs, None
    return inputs, _cast(model_file.example_target(plan.batch_size), dtype)


# ----------------------------------------------------------------- reference


class _WholeGraph(nn.Module):
    """The whole captured graph called like the model it was captured from (flat inputs in, its outputs out)."""

    def __init__(self, captured: Any) -> None:
        super().__init__()
        self.gm, self.captured = captured.graph_module, captured

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.captured.call.flatten((args, kwargs))
        return self.captured.unflatten_outputs(self.gm(*flat))


def _fp8_reference(plan: Plan, model: nn.Module) -> tuple[nn.Module, contextlib.AbstractContextManager[Any]]:
    """The whole model as an fp8 plan's ranks run it: its captured graph with the same FP8 matmuls, and a
    context to hold around its forward and backward (the loss, vocabulary-parallel under ``tp > 1``).

    Under ``tp > 1`` the split layers and the loss also add their float32 partial sums in the ranks' order
    (:mod:`runtime.parallel.splitorder`): a last-bit difference would otherwise move some FP8 cast a whole
    FP8 step, and the gradients below it by ~1e-3.  The graph reads the model's own parameters (capture keeps
    them), so loading the model's state loads it.
    """
    from partitioner.graph.fp8 import fp8_matmuls
    from partitioner.graph.tensorparallel import find_tensor_parallel
    from runtime.parallel.splitorder import VocabularyParallelLoss, split_order
    from runtime.state.fp8 import convert_graph

    captured, _ = recapture(plan, model)
    if plan.tp > 1:  # the split layers' roles, as the ranks find them (runtime.execute.stage)
        find_tensor_parallel(captured)
    gm = captured.graph_module
    convert_graph(gm, fp8_matmuls(gm), recipe=plan.fp8_recipe)
    if plan.tp == 1:
        return _WholeGraph(captured), contextlib.nullcontext()
    return _WholeGraph(captured), VocabularyParallelLoss(split_order(gm, plan.tp), plan.tp)


def _reference_loss(
    model: nn.Module, call: CallSpec, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    flat: tuple[torch.Tensor, ...], target: Any,
) -> torch.Tensor:
    """One micro-batch's loss from the whole model, called as planned (keywords, constants)."""
    args, kwargs = call.rebuild(flat)
    outputs = model(*args, **kwargs)
    if loss_fn is not None:
        return loss_fn(outputs, target)
    loss = model_loss(outputs)
    if loss is None:
        raise AutopartitionError(
            "The model file has no loss_fn and the model's output carries no loss (a scalar, or a `loss` "
            "key or attribute). Define loss_fn(outputs, target), or give the target as the model's keyword "
            "(`target_keyword = \"labels\"` with example_target)."
        )
    return loss


def reference_microbatches(
    plan: Plan, inputs: tuple[Any, ...], target: Any, replica: int
) -> list[tuple[Any, Any]]:
    """Replica ``replica``'s micro-batches, sliced as :meth:`Pipeline.step` slices them."""
    per_replica = plan.batch_size // plan.dp
    size = plan.microbatch_size

    def piece(value: Any, mb: int) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        start = replica * per_replica + mb * size
        return value[start : start + size]

    return [
        (tuple(piece(x, mb) for x in inputs), pytree.tree_map(lambda v, mb=mb: piece(v, mb), target))
        for mb in range(plan.microbatches)
    ]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run as the ranks do (one thread), so that kernels reduce in the same order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pick(ranks: Sequence[dict[str, Any]], key: str, step: int, *, replica: int | None,
          aliases: dict[str, set[str]]) -> dict[str, torch.Tensor]:
    """Every rank's ``key`` entries at ``step`` merged (replica 0 first), aliases filled in."""
    order = sorted(range(len(ranks)), key=lambda r: (ranks[r]["replica"], ranks[r]["stage"]))
    merged: dict[str, torch.Tensor] = {}
    for r in order:
        if replica is not None and ranks[r]["replica"] != replica:
            continue
        for name, value in ranks[r][key][step].items():
            for alias in {name} | aliases.get(name, set()):
                merged.setdefault(alias, value)
    return merged


def _compare_steps(
    plan: Plan, model_file: Any, ranks: list[dict[str, Any]], *, steps: int, lr: float, tolerance: float,
    dtype: str, traits: ModelTraits, seed: int = 0,
) -> VerifyResult:
    """Run the reference one step at a time from the pipeline's state and compare every step."""
    torch_dtype = getattr(torch, dtype)
    aliases = {name: set(t.aliases) for t in plan.tied for name in t.aliases}
    model = materialise_model(_build(model_file, torch_dtype), seed=seed, init_weights=_init_weights(model_file))
    inputs, target = _batch(model_file, plan, torch_dtype)
    call = call_spec(plan)
    inputs = call.flatten(inputs)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    places = tuple(f"{_stage_names(r['stages'])}, replica {r['replica']}" for r in ranks)
    start = _compare_state(ranks, {**{n: p.detach() for n, p in params.items()}, **dict(buffers)},
                           ("params", "buffers"), 0, tolerance)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    runs, split_loss = (model, contextlib.nullcontext()) if plan.precision != "fp8" else _fp8_reference(plan, model)
    derandomised = Derandomised()
    per_step: list[StepComparison] = []
    losses: list[float] = []
    read: set[str] = set()  # parameters the reference gave a gradient in some step
    held_buffers = {alias for r in ranks for name in r["buffers"][0] for alias in {name} | aliases.get(name, set())}
    unheld = {n: b.detach().clone() for n, b in buffers.items() if n not in held_buffers}
    with _one_thread(), derandomised, split_loss:
        for step in range(steps):
            _load(params, _pick(ranks, "params", step, replica=None, aliases=aliases))
            # Each step from a fresh copy of the batch, as the ranks take it: a model may write its inputs.
            step_inputs, step_target = _fresh((inputs, target))
            opt.zero_grad()
            replica_grads: list[dict[str, torch.Tensor]] = []
            replica_buffers: list[dict[str, torch.Tensor]] = []
            replica_losses: list[torch.Tensor] = []
            for replica in range(plan.dp):
                _load(buffers, _pick(ranks, "buffers", step, replica=replica, aliases=aliases))
                for p in params.values():
                    p.grad = None
                mb_losses = []
                for x, y in reference_microbatches(plan, step_inputs, step_target, replica):
                    mb_loss = _reference_loss(runs, call, model_file.loss_fn, x, y) / plan.microbatches
                    mb_loss.backward()
                    mb_losses.append(mb_loss.detach())
                replica_losses.append(torch.stack(mb_losses).sum())  # as StepRunner.run, then averaged as Pipeline
                replica_grads.append({n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None})
                replica_buffers.append({n: b.detach().clone() for n, b in buffers.items()})
            # DDP averages replicas: the sum of their gradients over dp.
            for name, p in params.items():
                grads = [g[name] for g in replica_grads if name in g]
                p.grad = torch.stack(grads).sum(0) / plan.dp if grads else None
            grads_now = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
            read |= set(grads_now)
            opt.step()
            after = {n: p.detach().clone() for n, p in params.items()}
            loss = float(torch.stack(replica_losses).sum() / plan.dp)
            losses.append(loss)
            per_step.append(_compare_step(step, ranks, loss, grads_now, replica_buffers, after, tolerance))
    pipeline_calls: collections.Counter[str] = collections.Counter()
    for r in ranks:
        pipeline_calls.update(r.get("random", {}))
    orphans = sorted(n for n in params if not ({n} | aliases.get(n, set())) & _held_params(ranks))
    # A parameter the forward never reads gets no gradient and never changes, held by a rank or not.
    unread = tuple(n for n in orphans if n not in read)
    # A buffer no rank holds must not change in the reference either: its update would be lost on the ranks.
    lost = sorted(n for n, before in unheld.items() if _diff(buffers[n].detach(), before) > tolerance)
    return _result(per_step, start, [n for n in orphans if n in read], steps=steps, tolerance=tolerance,
                   dtype=dtype, plan=plan, traits=traits, losses=losses, places=places,
                   neutralised=(derandomised.counts, dict(pipeline_calls)), unread=unread, lost_buffers=lost)


def _held_params(ranks: Sequence[dict[str, Any]]) -> set[str]:
    return {name for r in ranks for name in r["params"][0]}


def _load(target: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in target.items():
            if name in values:
                tensor.copy_(values[name])


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if not want.numel():
        return 0.0
    if got.shape != want.shape:
        return float("inf")
    want_d, got_d = want.double(), got.double()
    scale = max(1.0, float(want_d.abs().max()))
    return float((got_d - want_d).abs().max()) / scale


def _worst(items: Iterator[tuple[str, int, torch.Tensor, torch.Tensor | None]], tolerance: float) -> Worst:
    worst = Worst()
    over = total = 0
    for name, rank, got, want in items:
        d = float("inf") if want is None else _diff(got, want)
        total += 1
        over += d > tolerance
        if d > worst.value or worst.rank < 0:
            worst = Worst(d, f"{name} on rank {rank}", name, rank)
    return dataclasses.replace(worst, over=over, total=total) if total else Worst()


def _compare_state(ranks: Sequence[dict[str, Any]], want: dict[str, torch.Tensor], keys: Sequence[str],
                   step: int, tolerance: float) -> Worst:
    return _worst(((name, r, value, want.get(name)) for r, rank in enumerate(ranks) for key in keys
                   for name, value in rank[key][step].items() if name in want), tolerance)


def _compare_step(
    step: int, ranks: list[dict[str, Any]], loss: float, grads: dict[str, torch.Tensor],
    replica_buffers: list[dict[str, torch.Tensor]], after: dict[str, torch.Tensor], tolerance: float,
) -> StepComparison:
    got_losses = [r["losses"][step] for r in ranks if r["losses"]]
    loss_diff = max((abs(g - loss) / max(1.0, abs(loss)) for g in got_losses), default=float("inf"))
    grad = _worst(_gradient_pairs(ranks, step, grads), tolerance)
    buffer = _worst(((n, i, b, replica_buffers[r["replica"]].get(n)) for i, r in enumerate(ranks)
                     for n, b in r["buffers"][step + 1].items() if n in replica_buffers[r["replica"]]), tolerance)
    param = _compare_state(ranks, after, ("params",), step + 1, tolerance)
    return StepComparison(step + 1, loss, loss_diff, grad, buffer, param)


def _gradient_pairs(ranks: Sequence[dict[str, Any]], step: int, grads: dict[str, torch.Tensor]
                    ) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor | None]]:
    """(name, rank, the rank's gradient, the reference's) of every parameter a rank holds at ``step``.

    A parameter whose rank has no gradient where the reference has one (a gradient
    the ranks lost) counts as a zero gradient against the reference's.
    """
    for i, r in enumerate(ranks):
        got = r["grads"][step]
        for name, g in got.items():
            yield name, i, g, grads.get(name)
        for name in r["params"][step]:
            want = grads.get(name)
            if name not in got and want is not None:
                yield name, i, torch.zeros_like(want), want


def _result(
    per_step: list[StepComparison], start: Worst, orphans: list[str], *, steps: int, tolerance: float,
    dtype: str, plan: Plan, traits: ModelTraits, losses: list[float], places: tuple[str, ...],
    neutralised: tuple[dict[str, int], dict[str, int]], unread: tuple[str, ...] = (),
    lost_buffers: Sequence[str] = (),
) -> VerifyResult:
    def worst_of(kind: str) -> tuple[float, str]:
        best = max(per_step, key=lambda s: getattr(s, kind).value, default=None)
        if best is None:
            return 0.0, "-"
        w: Worst = getattr(best, kind)
        return w.value, (f"{w.where}, step {best.step}" if w.rank >= 0 else "-")

    grad_diff, worst_grad = worst_of("grad")
    param_diff, worst_param = worst_of("param")
    buffer_diff, worst_buffer = worst_of("buffer")
    if orphans:  # a parameter no stage holds would never train
        param_diff, worst_param = float("inf"), f"{orphans[0]} is held by no rank"
        orphan = Worst(float("inf"), worst_param, f"{orphans[0]} (held by no rank)", -1, 1, 1)
        per_step = [dataclasses.replace(s, param=orphan) if s.step == 1 else s for s in per_step]
    if lost_buffers:  # a buffer the model writes that no stage holds: its updates are lost
        buffer_diff, worst_buffer = float("inf"), f"{lost_buffers[0]} is written by the model but held by no rank"
        lost = Worst(float("inf"), worst_buffer, f"{lost_buffers[0]} (written, held by no rank)", -1,
                     len(lost_buffers), len(lost_buffers))
        per_step = [dataclasses.replace(s, buffer=lost) if s.step == 1 else s for s in per_step]
    layout = (f"{_plural(plan.dp, 'replica')} x {_plural(plan.microbatches, 'micro-batch', 'micro-batches')} "
              f"of {plan.microbatch_size}")
    return VerifyResult(
        steps=steps,
        max_loss_diff=max((s.loss_diff for s in per_step), default=float("inf")),
        max_grad_diff=grad_diff, worst_grad=worst_grad,
        max_param_diff=param_diff, worst_param=worst_param,
        tolerance=tolerance, losses=tuple(losses),
        max_buffer_diff=buffer_diff, worst_buffer=worst_buffer,
        per_step=tuple(per_step), start_diff=start, dtype=dtype, layout=layout, traits=traits,
        neutralised=neutralised, rank_places=places, pp=plan.pp, unread=unread,
    )

