"""Benchmark the pipeline runtime on 2 CPU ranks against one process and torch.distributed.pipelining.

Commands (from the repository root)::

    .venv/bin/python tools/bench_runtime.py                 # full: 8-layer GPT, n_embd 128, seq 64, batch 32, M=8
    .venv/bin/python tools/bench_runtime.py --quick         # small configuration, < 60 s
    .venv/bin/python tools/bench_runtime.py --rounds 6 --steps 5 --json runtime.json
    .venv/bin/python tools/bench_runtime.py --layers 8 --embd 192 --seq 64 --batch 32 --microbatches 8
    .venv/bin/python tools/bench_runtime.py --only ours_1f1b,torch_1f1b_our_split   # a subset (plus one process)
    .venv/bin/python tools/bench_runtime.py --engines       # both engines on the same plans, side by side
    .venv/bin/python tools/bench_runtime.py --engines --quick --rounds 4 --steps 5  # the same, small (~1 min)

One run measures, on the same machine and in the same two processes (gloo, one
thread per process, ``torch.set_num_threads(1)`` everywhere), the step time of:

* one process with the whole model, forward + backward of the mini-batch in one
  piece (the baseline), and the same with the mini-batch cut into M micro-batches
  (gradient accumulation; shows what micro-batching alone costs), and two such
  processes at once, each with its own whole model and no communication (what
  two cores of this machine give, under whatever else is running on it);
* our :class:`runtime.Pipeline` on our plan (``compile(..., gpus=2, pp=2, dp=1,
  device="cpu")``, measured costs), with the GPipe and the 1F1B schedule;
* torch.distributed.pipelining's ``ScheduleGPipe`` / ``Schedule1F1B`` with
  ``PipelineStage`` on *our* stage modules (``build_local_stage(...).module``), the
  same split;
* torch's schedules on a hand-written middle split (embeddings + first half of the
  blocks | second half + ln_f + lm_head), what a user would write by hand.

``--engines`` runs instead, on the same plans (GPipe, 1F1B, interleaved 1F1B with two
stages per rank), our :class:`runtime.Pipeline` with ``engine="ours"`` and with
``engine="torch"`` (torch.distributed.pipelining's schedule classes driving our
stages, :mod:`runtime.engines.torch_engine`), interleaved in the same rounds; the
``ours/theirs`` column is then the ratio of the two engines' step times measured in
that one run (<= 1: ours faster).

Every step is forward + backward of one mini-batch with ``zero_grad(set_to_none)``
before it and no optimizer step, everywhere.  Configurations are interleaved in
rounds (each round: a barrier, one untimed step, ``--steps`` timed steps, a barrier)
so that load from other work on the machine spreads evenly over them; a pipeline's
step time is rank 0's median over all timed steps.

Other work on a small machine takes cores away from the ranks now and then, and
a pipeline needs both cores at once, so the table has two halves: the median over
all timed steps, and the median over the *uncontended* steps only, those in which
no participating rank spent more than ``CLEAN_WAIT`` of the step runnable but not
running (``/proc/thread-self/schedstat``), with how many steps qualified.
``cpu/rank`` is each rank's CPU time over the wall time of its timed steps;
``cpu wait`` the largest share of wall time a rank waited for a CPU.  The loss of
the first step is printed for every configuration: they all compute the same
mini-batch from the same weights, so the losses agree.

Tied weights: the GPT ties ``lm_head.weight`` to ``wte.weight``; on our split the
two stages each hold a copy.  Our Pipeline sums the copies' gradients after each
step (one all-reduce); for torch's schedules on our split the benchmark does the
same all-reduce (``runtime.parallel.replicate.sum_tied_grads``) so both compute the same
gradients.  torch.distributed.pipelining itself does not keep tied weights in sync
across stages, so the hand-written middle split unties the LM head (its own copy
of the weight, starting equal) and skips that all-reduce.

Two adaptations let torch's schedules run our stage modules on gloo (our runtime
does the equivalent itself): stage 0's outputs are made contiguous, and stage 1's
received tensors pass through an identity whose backward makes their gradients
contiguous.  torch's pipelining sizes its receive buffers from the strides it
sees on the first step, and gloo refuses strided buffers ("input tensor has to
be contiguous") -- our split sends q/k/v slices when it cuts inside attention.

The ideal speedup of a 2-stage pipeline with M micro-batches over one process is
2M/(M+1) (GPipe bubble, equal stages, free communication, micro-batches as
efficient as the whole batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist
from torch import nn

from runtime.execute.flatstage import ContiguousGrad  # gloo sends contiguous tensors only

__all__ = ["BenchConfig", "Row", "engine_ratios", "format_table", "main", "run_benchmark", "timed_steps"]

WORLD = 2
# A step is "uncontended" when no participating rank spent more than this share of
# it runnable but off the CPU (other work on the machine had the core).
CLEAN_WAIT = 0.10


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    layers: int = 8
    embd: int = 128
    heads: int = 4
    seq: int = 64
    batch: int = 32
    vocab: int = 512
    microbatches: int = 8
    rounds: int = 4
    steps: int = 5
    timeout: float = 300.0
    warmup: int = 0  # untimed steps per configuration before the rounds (the allocator settles over ~10)

    @staticmethod
    def quick() -> BenchConfig:
        return BenchConfig(layers=4, embd=64, heads=4, seq=32, batch=16, microbatches=4, rounds=2, steps=3)

    @property
    def ideal(self) -> float:
        return 2 * self.microbatches / (self.microbatches + 1)


@dataclasses.dataclass
class Row:
    key: str
    label: str
    split: str
    step_s: float  # rank 0's median step
    p25_s: float
    p75_s: float
    loss: float | None
    steps: int
    other_rank_s: float | None = None  # rank 1's median step (pipelines)
    clean_s: float | None = None  # rank 0's median over the uncontended steps (see CLEAN_WAIT)
    clean_steps: int = 0
    step_times: tuple[float, ...] = ()  # rank 0, every timed step, in order
    step_wait: tuple[float, ...] = ()  # per timed step: the largest share a participating rank waited for a CPU
    cpu_share: tuple[float, ...] = ()  # per participating rank: CPU time / wall over the timed steps
    wait_share: tuple[float, ...] = ()  # per participating rank: runnable-but-not-running time / wall
    same_split_as: str | None = None  # key of the row this one is compared with (ours vs theirs)


# ------------------------------------------------------------------ model


def gpt_config(cfg: BenchConfig) -> Any:
    from examples.gpt import GPTConfig

    return GPTConfig(vocab_size=cfg.vocab, block_size=cfg.seq, n_layer=cfg.layers, n_head=cfg.heads,
                     n_embd=cfg.embd)


def build_gpt(cfg: BenchConfig) -> nn.Module:
    from examples.gpt import build_model

    return build_model(gpt_config(cfg))  # seeded: every call gives the same weights


def batch_data(cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (B, T), next-token targets (B, T)), seeded."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class _Front(nn.Module):
    """Hand-written stage 0 of the middle split: embeddings and the first blocks."""

    def __init__(self, gpt: Any, cut: int) -> None:  # examples.gpt.GPT
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(list(gpt.blocks)[:cut])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return x


class _Back(nn.Module):
    """Hand-written stage 1 of the middle split: the last blocks, ln_f and an untied LM head."""

    def __init__(self, gpt: Any, cut: int) -> None:  # examples.gpt.GPT
        super().__init__()
        self.blocks = nn.ModuleList(list(gpt.blocks)[cut:])
        self.ln_f = gpt.ln_f
        head = gpt.lm_head
        self.lm_head = nn.Linear(head.in_features, head.out_features, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(head.weight)  # untied copy, starting equal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _ReceiveSide(nn.Module):
    """Stage 1 of our split under torch's pipelining: permute and guard the received tensors.

    * Arguments arrive in stage 0's send order; ``inner`` takes them in its own
      receive order.
    * torch's pipelining infers the gradient buffers stage 0 receives from the
      strides of the input gradients it computes on the first step; a gradient of
      a view (q/k/v slices) is strided, and gloo only receives into contiguous
      tensors ("input tensor has to be contiguous").  Our runtime sends
      ``.contiguous()`` copies; here an identity makes the gradients contiguous.
    """

    def __init__(self, inner: nn.Module, order: list[int]) -> None:
        super().__init__()
        self.inner, self.order = inner, order

    def forward(self, *args: torch.Tensor) -> Any:
        args = tuple(ContiguousGrad.apply(a) if a.is_floating_point() else a for a in args)
        return self.inner(*(args[i] for i in self.order))


class _Contiguous(nn.Module):
    """Returns ``inner``'s outputs made contiguous.

    torch's pipelining allocates receive buffers with the strides it saw on the
    first step, and gloo only receives into contiguous tensors, so a stage that
    sends a view (our split sends q/k/v slices) fails with "input tensor has to
    be contiguous".  Our runtime makes the same copy before sending.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> Any:
        out = self.inner(*args)
        if isinstance(out, (tuple, list)):
            return tuple(self._copy(t) if isinstance(t, torch.Tensor) else t for t in out)
        return self._copy(out)

    @staticmethod
    def _copy(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous()


# ------------------------------------------------------------------ plans


def make_plans(cfg: BenchConfig, out: Path, schedules: Sequence[str] = ("gpipe", "1f1b")) -> dict[str, Path]:
    """Plan the GPT for 2 CPU ranks with each schedule (measured costs); save each plan."""
    from examples.gpt import loss_fn
    from partitioner.search.planner import compile as plan_compile

    x, y = batch_data(cfg)
    dirs = {}
    for schedule in schedules:
        plan = plan_compile(build_gpt(cfg), (x,), gpus=WORLD, pp=2, dp=1, microbatches=cfg.microbatches,
                            schedule=schedule, device="cpu", loss_fn=loss_fn, target=y)
        dirs[schedule] = plan.save(out / f"plan_{schedule}")
    return dirs


def describe_split(plan: Any) -> str:
    """Where the stages meet: ``| blocks.4.attn`` (stage 1 starts there), ``~`` when a module is cut inside."""
    parts = []
    for prev, stage in zip(plan.stages, plan.stages[1:]):
        first = (stage.modules or ("?",))[0]
        inside = bool(prev.modules) and prev.modules[-1] == first
        parts.append(f"{'~' if inside else '|'} {first}")
    return " ".join(parts)


def check_two_stage_chain(plan: Any) -> None:
    """torch's PipelineStage feeds a stage exactly the previous stage's outputs: check our split fits.

    Several boundary tensors are fine (stage 0 returns them as a tuple, stage 1
    takes them as positional arguments, reordered if need be); a model input read
    by stage 1 is not (torch only gives model inputs to the first stage).
    """
    s0, s1 = plan.stages
    problems = []
    if s1.model_inputs:
        problems.append(f"stage 1 reads model inputs {s1.model_inputs}")
    if len(s0.model_inputs) != len(plan.model.inputs):
        problems.append("stage 0 does not read every model input")
    if {b.producer for b in s0.outputs} != {b.producer for b in s1.inputs}:
        problems.append("stage 0 sends something stage 1 does not receive")
    if problems:
        raise SystemExit(
            "Our plan's split does not map onto torch.distributed.pipelining's one-input chain: "
            + "; ".join(problems)
        )


# ------------------------------------------------------------------ ranks


@dataclasses.dataclass
class _Case:
    key: str
    ranks: tuple[int, ...]
    step: Callable[[], float | None]  # returns the mini-batch loss on the rank that has it


def sched_times() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of this thread, from /proc/self/schedstat.

    The second number is the share other work on the machine takes from us:
    it is what makes step times on a busy machine unreliable.
    """
    try:
        run_ns, wait_ns, _ = Path("/proc/thread-self/schedstat").read_text().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return time.process_time(), 0.0


def timed_steps(step: Callable[[], Any], *, steps: int, times: list[float], waits: list[float],
                totals: list[float]) -> None:
    """Run ``step`` ``steps`` times: append each one's wall time and CPU wait (``sched_times``) to
    ``times`` / ``waits``, and add the run's wall, on-CPU and waiting seconds to ``totals``."""
    run0, wait0 = sched_times()
    wall0 = time.perf_counter()
    for _ in range(steps):
        before = sched_times()[1]
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        waits.append(sched_times()[1] - before)
    run1, wait1 = sched_times()
    totals[0] += time.perf_counter() - wall0
    totals[1] += run1 - run0
    totals[2] += wait1 - wait0


def _zero(params: Any) -> None:
    for p in params:
        p.grad = None


def _single_cases(cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor) -> list[_Case]:
    from examples.gpt import loss_fn

    model = build_gpt(cfg)
    m = cfg.microbatches

    def whole() -> float:
        _zero(model.parameters())
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.item()

    def micro() -> float:
        _zero(model.parameters())
        total = 0.0
        for xc, yc in zip(x.chunk(m), y.chunk(m)):
            loss = loss_fn(model(xc), yc) / m
            loss.backward()
            total += loss.item()
        return total

    return [_Case("single", (0,), whole), _Case("single_mb", (0,), micro), _Case("single_x2", (0, 1), whole)]


def _ours_case(key: str, plan_dir: str, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor, *,
               engine: str = "ours") -> _Case:
    from examples.gpt import loss_fn
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    pipe = Pipeline(Plan.load(plan_dir), build_gpt(cfg), loss_fn, device=torch.device("cpu"),
                    timeout=cfg.timeout, engine=engine)

    def step() -> float | None:
        _zero(pipe.parameters())
        loss = pipe.step((x,), y)
        return None if loss is None else float(loss)

    return _Case(key, (0, 1), step)


def _engine_case(schedule: str, plan_dir: str, cfg: BenchConfig, x: torch.Tensor,
                 y: torch.Tensor) -> Callable[[], _Case]:
    """Builds the ``engine_<schedule>`` case: our Pipeline with ``engine="torch"`` on the same plan."""
    return lambda: _ours_case(f"engine_{schedule}", plan_dir, cfg, x, y, engine="torch")


def _theirs_case(key: str, rank: int, module: nn.Module, schedule: str, cfg: BenchConfig,
                 x: torch.Tensor, y: torch.Tensor, loss: Callable[[Any, Any], torch.Tensor],
                 after_step: Callable[[], None] | None = None) -> _Case:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))  # shapes inferred on the first step
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, cfg.microbatches, loss_fn=loss)  # loss_fn on every rank: it turns on backward

    def step() -> float | None:
        _zero(module.parameters())
        if rank == 0:
            sched.step(x)
            result = None
        else:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
            result = torch.stack(losses).mean().item()
        if after_step is not None:
            after_step()
        return result

    return _Case(key, (0, 1), step)


def _theirs_on_plan(key: str, rank: int, plan_dir: str, schedule: str, cfg: BenchConfig,
                    x: torch.Tensor, y: torch.Tensor) -> _Case:
    from examples.gpt import loss_fn
    from partitioner.plan import Plan
    from runtime.execute.comm import make_groups
    from runtime.execute.stage import build_local_stage
    from runtime.parallel.replicate import sum_tied_grads

    plan = Plan.load(plan_dir)
    check_two_stage_chain(plan)
    local = build_local_stage(plan, build_gpt(cfg), rank)
    module: nn.Module = local.module
    n_sent = len(local.signature.sent)
    if rank == 0:
        module = _Contiguous(local.module)
    if rank == 1:
        sent_order = [b.producer for b in plan.stages[0].outputs]
        sent_order = list(dict.fromkeys(sent_order))  # stage 0's signature.sent
        module = _ReceiveSide(local.module, [sent_order.index(n) for n in local.signature.received])

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        flat = out if isinstance(out, (tuple, list)) else (out,)
        return loss_fn(local.captured.unflatten_outputs(tuple(flat)[n_sent:]), target)

    groups = make_groups(plan, rank)  # the tied-weight groups our Pipeline uses
    return _theirs_case(key, rank, module, schedule, cfg, x, y, loss,
                        after_step=lambda: sum_tied_grads(local.module, groups))


def _theirs_middle(key: str, rank: int, schedule: str, cfg: BenchConfig,
                   x: torch.Tensor, y: torch.Tensor) -> _Case:
    from examples.gpt import loss_fn

    gpt = build_gpt(cfg)
    cut = cfg.layers // 2
    module = _Front(gpt, cut) if rank == 0 else _Back(gpt, cut)
    return _theirs_case(key, rank, module, schedule, cfg, x, y, loss_fn)


def _rank_main(rank: int, port: int, cfg_dict: dict[str, Any], plans: dict[str, str], keys: list[str],
               out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = BenchConfig(**cfg_dict)
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout))
    x, y = batch_data(cfg)
    builders: dict[str, Callable[[], _Case]] = {
        "ours_gpipe": lambda: _ours_case("ours_gpipe", plans["gpipe"], cfg, x, y),
        "torch_gpipe_our_split": lambda: _theirs_on_plan("torch_gpipe_our_split", rank, plans["gpipe"], "gpipe",
                                                         cfg, x, y),
        "ours_1f1b": lambda: _ours_case("ours_1f1b", plans["1f1b"], cfg, x, y),
        "torch_1f1b_our_split": lambda: _theirs_on_plan("torch_1f1b_our_split", rank, plans["1f1b"], "1f1b",
                                                        cfg, x, y),
        "torch_gpipe_middle": lambda: _theirs_middle("torch_gpipe_middle", rank, "gpipe", cfg, x, y),
        "torch_1f1b_middle": lambda: _theirs_middle("torch_1f1b_middle", rank, "1f1b", cfg, x, y),
        "ours_interleaved-1f1b": lambda: _ours_case("ours_interleaved-1f1b", plans["interleaved-1f1b"], cfg, x, y),
        **{f"engine_{s}": _engine_case(s, plans[s], cfg, x, y) for s in _SCHEDULES if s in plans},
    }
    singles = _single_cases(cfg, x, y)
    if rank != 0:  # rank 1 only joins the "two processes at once" case
        singles = [c if c.key == "single_x2" else _Case(c.key, (0,), lambda: None) for c in singles]
    cases = [c for c in singles if c.key in keys] + [builders[k]() for k in ALL_LABELS if k in keys and k in builders]
    times: dict[str, list[float]] = {c.key: [] for c in cases}
    waits: dict[str, list[float]] = {c.key: [] for c in cases}  # per step: runnable but not running
    sched: dict[str, list[float]] = {c.key: [0.0, 0.0, 0.0] for c in cases}  # wall, run, wait
    losses: dict[str, float] = {}
    idle_cpu: dict[str, float] = {}
    dist.barrier()
    for round_ in range(cfg.rounds):
        for case in cases:
            dist.barrier()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if rank in case.ranks:
                loss = case.step()  # untimed: warm-up (and torch's shape inference on the first round)
                if loss is not None and case.key not in losses:
                    losses[case.key] = loss
                timed_steps(case.step, steps=cfg.steps, times=times[case.key], waits=waits[case.key],
                            totals=sched[case.key])
            dist.barrier()
            if rank not in case.ranks and round_ == cfg.rounds - 1:
                idle_cpu[case.key] = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "waits": waits, "losses": losses, "idle_cpu": idle_cpu,
                                                           "sched": sched}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


LABELS = {
    "single": "one process, whole batch",
    "single_mb": "one process, M micro-batches",
    "single_x2": "2 processes at once (throughput)",
    "ours_gpipe": "ours, GPipe, our plan",
    "torch_gpipe_our_split": "torch ScheduleGPipe, our split",
    "ours_1f1b": "ours, 1F1B, our plan",
    "torch_1f1b_our_split": "torch Schedule1F1B, our split",
    "torch_gpipe_middle": "torch ScheduleGPipe, middle split",
    "torch_1f1b_middle": "torch Schedule1F1B, middle split",
}
SAME_SPLIT = {"ours_gpipe": "torch_gpipe_our_split", "ours_1f1b": "torch_1f1b_our_split"}
# --engines: Pipeline(engine="ours") against Pipeline(engine="torch") on the same plan.
ENGINE_LABELS = {
    "ours_gpipe": "ours, GPipe, our plan",
    "engine_gpipe": "engine=torch, GPipe, our plan",
    "ours_1f1b": "ours, 1F1B, our plan",
    "engine_1f1b": "engine=torch, 1F1B, our plan",
    "ours_interleaved-1f1b": "ours, interleaved 1F1B, our plan",
    "engine_interleaved-1f1b": "engine=torch, interleaved 1F1B",
}
ENGINE_PAIRS = {f"ours_{s}": f"engine_{s}" for s in ("gpipe", "1f1b", "interleaved-1f1b")}


def _all_labels() -> dict[str, str]:
    """Every configuration, each ``engine_*`` row right after ours on the same plan."""
    out: dict[str, str] = {}
    for key, label in {**LABELS, "ours_interleaved-1f1b": ENGINE_LABELS["ours_interleaved-1f1b"]}.items():
        out[key] = label
        if key in ENGINE_PAIRS:
            out[ENGINE_PAIRS[key]] = ENGINE_LABELS[ENGINE_PAIRS[key]]
    return out


ALL_LABELS = _all_labels()
_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def run_benchmark(cfg: BenchConfig, *, keys: Sequence[str] | None = None, work: Path | None = None,
                  say: Callable[[str], None] = print) -> list[Row]:
    """Run the configurations ``keys`` (default: all of :data:`LABELS`; "single" is always run)."""
    from partitioner.plan import Plan
    from runtime.verify import free_port, start_ranks

    chosen = ["single"] + [k for k in ALL_LABELS if k != "single" and (k in LABELS if keys is None else k in keys)]
    schedules = [s for s in _SCHEDULES
                 if any(k in chosen for k in (f"ours_{s}", f"torch_{s}_our_split", f"engine_{s}"))]

    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        base = work or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        plans = make_plans(cfg, base, schedules)
        say(f"planned in {time.perf_counter() - t0:.1f} s; running {WORLD} ranks "
            f"({cfg.rounds} rounds x {cfg.steps} timed steps per configuration)")
        t0 = time.perf_counter()
        start_ranks(_rank_main, (free_port(), dataclasses.asdict(cfg),
                                 {k: str(v) for k, v in plans.items()}, chosen, str(base)),
                    WORLD)
        say(f"ranks finished in {time.perf_counter() - t0:.1f} s")
        results = [json.loads(Path(base, f"rank{r}.json").read_text()) for r in range(WORLD)]
        loaded = {k: Plan.load(v) for k, v in plans.items()}
    splits = {
        **{f"ours_{s}": describe_split(p) for s, p in loaded.items()},
        **{f"engine_{s}": describe_split(p) for s, p in loaded.items()},
        **{f"torch_{s}_our_split": describe_split(p) for s, p in loaded.items()},
        "torch_gpipe_middle": f"| blocks.{cfg.layers // 2} (by hand)",
        "torch_1f1b_middle": f"| blocks.{cfg.layers // 2} (by hand)",
    }
    rows = []
    for key, label in ALL_LABELS.items():
        if key not in chosen:
            continue
        ts = sorted(results[0]["times"][key])
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        other = results[1]["times"].get(key) or []
        loss = results[0]["losses"].get(key, results[1]["losses"].get(key))
        parts = [res["sched"][key] for res in results if res["sched"][key][0] > 0]
        timed = [res for res in results if res["times"][key]]
        step_wait = [max(res["waits"][key][i] / res["times"][key][i] for res in timed)
                     for i in range(len(results[0]["times"][key]))]
        clean = [t for t, w in zip(results[0]["times"][key], step_wait) if w <= CLEAN_WAIT]
        pair = SAME_SPLIT.get(key)
        if pair not in chosen:
            pair = ENGINE_PAIRS.get(key)
        rows.append(Row(key, label, splits.get(key, "-"), statistics.median(ts), q[0], q[2], loss, len(ts),
                        statistics.median(other) if other else None,
                        same_split_as=pair if pair in chosen else None,
                        clean_s=statistics.median(clean) if len(clean) >= 3 else None, clean_steps=len(clean),
                        step_times=tuple(results[0]["times"][key]), step_wait=tuple(step_wait),
                        cpu_share=tuple(run / wall for wall, run, _ in parts),
                        wait_share=tuple(wait / wall for wall, _, wait in parts)))
    for key, share in results[1]["idle_cpu"].items():
        if share > 0.2:
            say(f"note: rank 1 used {100 * share:.0f}% of a core while idle during {key} (busy-waiting?)")
    return rows


def format_table(rows: Sequence[Row], cfg: BenchConfig) -> str:
    """One line per configuration: all steps (median), and the uncontended steps only."""
    by_key = {r.key: r for r in rows}

    def cols(r: Row, step: float | None, base: float | None, pair: float | None) -> str:
        if step is None or base is None:
            return f"{'-':>8} {'':>8} {'':>8} {'':>11}"
        speed = base / step * (2 if r.key == "single_x2" else 1)  # two mini-batches per step
        pipeline = r.key not in ("single", "single_mb", "single_x2")
        frac = f"{speed / cfg.ideal:.2f}" if pipeline else ""
        ratio = f"{step / pair:.2f}" if pair else ""
        return f"{step * 1e3:8.1f} {speed:7.2f}x {frac:>8} {ratio:>11}"

    base, cbase = by_key["single"].step_s, by_key["single"].clean_s
    head = (f"{'configuration':<34} {'split':<26} | {'step ms':>8} {'speedup':>8} {'of ideal':>8} "
            f"{'ours/theirs':>11} {'p25-p75':>9} | {'step ms':>8} {'speedup':>8} {'of ideal':>8} "
            f"{'ours/theirs':>11} {'steps':>5} | {'loss':>7} {'cpu/rank':>9} {'cpu wait':>8}")
    title = (f"{'':<34} {'':<26} | {'all steps (median)':^50} | "
             f"{'uncontended steps only (median)':^58} |")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        other = by_key.get(r.same_split_as or "")
        lines.append(
            f"{r.label:<34} {r.split[:26]:<26} | "
            f"{cols(r, r.step_s, base, other.step_s if other else None)} "
            f"{f'{r.p25_s * 1e3:.0f}-{r.p75_s * 1e3:.0f}':>9} | "
            f"{cols(r, r.clean_s, cbase, other.clean_s if other else None)} {r.clean_steps:>2}/{r.steps:<2} | "
            f"{(f'{r.loss:.4f}' if r.loss is not None else ''):>7} "
            f"{'/'.join(f'{100 * c:.0f}' for c in r.cpu_share):>8}% {100 * max(r.wait_share, default=0):7.0f}%"
        )
    return "\n".join(lines)


def verdicts(rows: Sequence[Row], cfg: BenchConfig) -> list[str]:
    """Targets, on all steps and on the uncontended ones; and what bounds the speedup here."""
    by_key = {r.key: r for r in rows}
    out = []
    for which, get in (("all steps", lambda r: r.step_s), ("uncontended", lambda r: r.clean_s)):
        base = get(by_key["single"])
        for ours, theirs in SAME_SPLIT.items():
            if ours not in by_key or theirs not in by_key:
                continue
            a, b = get(by_key[ours]), get(by_key[theirs])
            if a is None or b is None:
                out.append(f"n/a  [{which}] {by_key[ours].label} vs {by_key[theirs].label}: too few steps")
                continue
            out.append(f"{'MET ' if a <= b else 'MISS'} [{which}] {by_key[ours].label} vs {by_key[theirs].label}: "
                       f"step ratio {a / b:.2f} (target <= 1.00)")
        for key in SAME_SPLIT:
            if key not in by_key:
                continue
            step = get(by_key[key])
            if step is None or base is None:
                out.append(f"n/a  [{which}] {by_key[key].label}: too few steps")
                continue
            frac = base / step / cfg.ideal
            out.append(f"{'MET ' if frac >= 0.9 else 'MISS'} [{which}] {by_key[key].label}: {frac:.2f} of the "
                       f"ideal {cfg.ideal:.2f}x (target >= 0.90)")
    if "single_mb" not in by_key:
        return out
    base = by_key["single"].clean_s or by_key["single"].step_s
    mb = (by_key["single_mb"].clean_s or by_key["single_mb"].step_s) / base
    out.append(f"note: micro-batching alone costs {100 * (mb - 1):+.0f}% on one process")
    bound = mb
    if "single_x2" in by_key:
        x2 = by_key["single_x2"]
        pair = (x2.clean_s or x2.step_s) / base
        out.append(f"note: two independent processes each run {100 * (pair - 1):+.0f}% slower than one alone "
                   f"({'uncontended' if x2.clean_s else 'all'} steps: 2 cores give {2 / pair:.2f}x the "
                   "throughput of one)")
        bound *= max(1.0, pair)
    out.append(f"note: so a 2-stage pipeline can reach at most about {cfg.ideal / bound:.2f}x here "
               f"({1 / bound:.2f} of the ideal), before communication")
    mb_step = by_key["single_mb"].clean_s or by_key["single_mb"].step_s
    for key in SAME_SPLIT:
        if key in by_key:
            step = by_key[key].clean_s or by_key[key].step_s
            out.append(f"note: against one process running the same M micro-batches, {by_key[key].label} is "
                       f"{mb_step / step:.2f}x = {mb_step / step / cfg.ideal:.2f} of the ideal")
    return out


def engine_ratios(rows: Sequence[Row]) -> list[str]:
    """Per schedule: our engine's step over torch's on the same plan, from the same run (all and uncontended)."""
    by_key = {r.key: r for r in rows}
    out = []
    for ours, theirs in ENGINE_PAIRS.items():
        if ours in by_key and theirs in by_key:
            a, b = by_key[ours], by_key[theirs]
            clean = f"{a.clean_s / b.clean_s:.2f}" if a.clean_s and b.clean_s else "n/a"
            out.append(f"engines [{ours[5:]}]: ours {a.step_s * 1e3:.1f} ms, torch {b.step_s * 1e3:.1f} ms: "
                       f"ours/torch {a.step_s / b.step_s:.2f} (all steps), {clean} (uncontended)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small configuration (< 60 s)")
    for name in ("layers", "embd", "heads", "seq", "batch", "vocab", "microbatches", "rounds", "steps"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--only", default=None,
                        help=f"comma-separated configurations to run (one process is always run): {', '.join(LABELS)}")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--work", type=Path, default=None, help="keep plans and rank results in this directory")
    parser.add_argument("--engines", action="store_true",
                        help="Pipeline(engine='ours') against engine='torch' on the same plans (GPipe, 1F1B, "
                        "interleaved 1F1B), with the step-time ratio of the two from this one run")
    args = parser.parse_args(argv)
    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    cfg = dataclasses.replace(cfg, **{k: v for k, v in vars(args).items()
                                      if k in BenchConfig.__dataclass_fields__ and v is not None})
    if cfg.batch % cfg.microbatches:
        parser.error(f"--batch {cfg.batch} must be a multiple of --microbatches {cfg.microbatches}")
    print(f"GPT: {cfg.layers} layers, n_embd {cfg.embd}, {cfg.heads} heads, seq {cfg.seq}, batch {cfg.batch}, "
          f"vocab {cfg.vocab}; M={cfg.microbatches} micro-batches; {WORLD} CPU ranks x 1 thread (gloo); "
          f"torch {torch.__version__}")
    keys = args.only.split(",") if args.only else (list(ENGINE_LABELS) if args.engines else None)
    unknown = sorted(set(keys or ()) - set(ALL_LABELS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {', '.join(ALL_LABELS)}")
    rows = run_benchmark(cfg, keys=keys, work=args.work)
    print()
    print(format_table(rows, cfg))
    print()
    print(f"ideal speedup 2M/(M+1) = {cfg.ideal:.3f}x; step = rank 0's median over "
          f"{rows[0].steps} timed steps; ours/theirs = step time ratio on the same split (<= 1: ours faster)")
    for line in verdicts(rows, cfg) + engine_ratios(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"config": dataclasses.asdict(cfg),
                                         "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
