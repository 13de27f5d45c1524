"""Benchmark the planner: predicted step time against standard pipeline splits; wall time.

Commands (from the repository root)::

    .venv/bin/python tools/bench_planner.py --quick     # smoke run, under a minute
    .venv/bin/python tools/bench_planner.py             # full run: the numbers (a few minutes)
    .venv/bin/python tools/bench_planner.py --no-wall   # only the split tables
    .venv/bin/python tools/bench_planner.py --wall-only # only the wall-time rows
    .venv/bin/python tools/bench_planner.py --cprofile  # + cProfile's top functions per compile

The tables go to stdout, progress to stderr.

**Step time.**  For each GPT (``examples/gpt.py``) and pipeline width P, every split is
evaluated by the same cost function, ``partitioner.problem.step_time(problem, stage_of,
microbatches=M)`` (GPipe: ``sum t + (M-1) max t``, transfers included), on the same
:class:`~partitioner.problem.PartitionProblem`, built as the planner builds it (capture,
propagate_values, profile(measure=False), roofline times for ``--device h100``, coarsen,
graph_costs, formulate at dp = 1):

* ``ours``: ``compile(model, inputs, gpus=P, pp=P, device="h100")``, the real product path;
  its ``plan.solver.objective`` (re-evaluated on our problem as a consistency check).
* Baselines split *layers* (units: the ``wte``+``wpe`` embedding group, each ``blocks.i``, the
  ``ln_f``+``lm_head`` group), mapped onto the solver's blocks (a block belongs to the unit of
  its first node's module path; root-level nodes such as the embedding sum belong to the unit
  before them):

  - ``equal-layer``: the same number of units per stage, extras on the first stages
    (DeepSpeed ``partition_method="uniform"``);
  - ``equal-param``: contiguous, minimise the largest stage parameter count (DeepSpeed
    ``"parameters"``, PiPPy ``split_into_equal_size``); a tied weight counts in every unit
    that uses it, as DeepSpeed counts a tied layer's parameters;
  - ``by-time``: contiguous, minimise the largest stage compute time (torchgpipe
    ``balance_by_time``; its ``blockpartition.solve`` solves the same min-max problem);
  - ``best-layer``: the exact best contiguous whole-layer split under ``step_time``.

  min-max ties are broken as DeepSpeed's ``partition_balanced`` does: each stage takes as
  many units as the bottleneck allows, from the first stage on.
* ``ideal``: perfect balance with free communication, ``sum t + (M-1) sum t / P``; every
  other column is also shown as a ratio to it.

**Exact optimum.**  Where the block graph has few down-sets (every valid assignment is a
chain of down-sets, so a DP over them is exact), the best split over *all* valid
assignments of the solver's blocks is computed, along with the best contiguous split of
the blocks in their given order, and the gap of ``ours`` to it is reported.

**Wall time.**  ``compile`` over every pp x dp of the GPU count, in a fresh process (so the
first ``torch.export`` of the process is included), for a 12-layer GPT on 8 GPUs and a
96-layer GPT on 64 GPUs, with the time of each phase.  Targets (on the 2-core machine):
under 3 s and under 60 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEVICE = "h100"
MICROBATCHES = 8
TARGET_RATIO = 1.01  # "within 1% of the exact optimum"
WALL_TARGETS = {(12, 8): 3.0, (96, 64): 60.0}
MAX_DOWN_SETS = 5000

# --------------------------------------------------------------------------- pure split functions


def equal_layers(n_units: int, stages: int) -> tuple[int, ...]:
    """Stage of each unit when every stage gets the same number of units (extras first).

    DeepSpeed's ``partition_uniform``: ``n // P`` units each, one more for the first
    ``n % P`` stages.

    >>> equal_layers(10, 4)
    (0, 0, 0, 1, 1, 1, 2, 2, 3, 3)
    """
    _check(n_units, stages)
    size, extra = divmod(n_units, stages)
    out: list[int] = []
    for s in range(stages):
        out.extend([s] * (size + (1 if s < extra else 0)))
    return tuple(out)


def min_max_split(weights: Sequence[float], stages: int) -> tuple[int, ...]:
    """Contiguous split of ``weights`` into ``stages`` non-empty parts with the least largest part.

    Exact (the bottleneck is found by a DP over prefix sums); among optimal splits each
    stage takes as many units as the bottleneck allows, from the first stage on, while
    leaving at least one unit for every later stage (DeepSpeed's ``partition_balanced``).

    >>> min_max_split([1, 1, 1, 1, 4], 2)
    (0, 0, 0, 0, 1)
    """
    n = len(weights)
    _check(n, stages)
    w = [float(x) for x in weights]
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    # best[s][j]: least bottleneck splitting the first j units into s parts.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], prefix[j] - prefix[i]) for i in range(s - 1, j))
    bottleneck = best[stages][n]
    tol = 1e-12 * max(1.0, abs(bottleneck))
    # Greedy from the left; a stage may stop early only if the rest still fits.
    # suffix_ok[s][i]: units i.. split into stages s.. with every part <= bottleneck.
    ok = [[False] * (n + 1) for _ in range(stages + 1)]
    ok[stages][n] = True
    for s in range(stages - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            ok[s][i] = any(
                ok[s + 1][j]
                for j in range(i + 1, n + 1)
                if prefix[j] - prefix[i] <= bottleneck + tol
            )
    out: list[int] = []
    i = 0
    for s in range(stages):
        j = max(
            j
            for j in range(i + 1, n + 1)
            if prefix[j] - prefix[i] <= bottleneck + tol and ok[s + 1][j]
        )
        out.extend([s] * (j - i))
        i = j
    return tuple(out)


def equal_parameters(unit_params: Sequence[float], stages: int) -> tuple[int, ...]:
    """Stage of each unit, balancing parameter counts (DeepSpeed ``partition_method="parameters"``)."""
    return min_max_split(unit_params, stages)


def balance_by_time(unit_times: Sequence[float], stages: int) -> tuple[int, ...]:
    """Stage of each unit, balancing compute time (torchgpipe ``balance_by_time``)."""
    return min_max_split(unit_times, stages)


def ideal_step(times: Sequence[float], stages: int, microbatches: int) -> float:
    """Perfect balance, free communication: ``sum t + (M-1) sum t / P``."""
    total = float(sum(times))
    return total + (microbatches - 1) * total / stages


def units_to_blocks(unit_stage: Sequence[int], unit_of_block: Sequence[int]) -> tuple[int, ...]:
    """A layer split as a stage per solver block."""
    return tuple(unit_stage[u] for u in unit_of_block)


def stage_sizes(stage_of: Sequence[int], *, runs_over: int = 12) -> str:
    """``3|3|2|2``: units (or blocks) per stage; ``2x34|1x30`` (runs) beyond ``runs_over`` stages."""
    counts: dict[int, int] = {}
    for s in stage_of:
        counts[s] = counts.get(s, 0) + 1
    sizes = [counts[s] for s in sorted(counts)]
    if len(sizes) <= runs_over:
        return "|".join(str(n) for n in sizes)
    runs: list[list[int]] = []
    for n in sizes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "|".join(str(n) if k == 1 else f"{n}x{k}" for n, k in runs)


def _check(n: int, stages: int) -> None:
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} units into {stages} non-empty stages")


# --------------------------------------------------------------------------- exact splits


def chain_dp(
    cost: np.ndarray,
    stages: int,
    microbatches: int,
    masks: np.ndarray | None = None,
) -> tuple[float, list[int]] | None:
    """Least ``sum + (M-1) max`` over paths ``0 = k_0 -> k_1 -> ... -> k_P = K-1`` of states.

    ``cost[a, b]`` is the time of a stage that goes from state a to state b (``inf`` where
    not allowed); ``masks[s, a, b]`` (optional) whether that stage fits in memory as stage
    s.  Exact: for each cap T the DP finds the least sum with every stage at most T; the
    least sum is a non-increasing step function of T and the optimum sits at the left end
    of a step, which bisection over the sorted caps finds without trying every cap.
    Returns (objective, states on the path) or None when no path exists.
    """
    k = cost.shape[0]
    if masks is None:
        masks = np.ones((stages, k, k), dtype=bool)
    usable = np.where(np.any(masks, axis=0), cost, np.inf)
    caps = np.unique(usable[np.isfinite(usable)])
    if caps.size == 0:
        return None

    def min_sum(cap: float) -> tuple[float, float, list[int]] | None:
        allowed = np.where(cost <= cap, cost, np.inf)
        best = np.full(k, np.inf)
        best[0] = 0.0
        worst = np.full(k, 0.0)  # max stage time along the chosen path
        choice = np.zeros((stages, k), dtype=np.int64)
        for s in range(stages):
            total = best[:, None] + np.where(masks[s], allowed, np.inf)
            choice[s] = np.argmin(total, axis=0)
            rows = choice[s]
            new_best = total[rows, np.arange(k)]
            worst = np.maximum(
                worst[rows], np.where(np.isfinite(new_best), allowed[rows, np.arange(k)], 0.0)
            )
            best = new_best
        if not np.isfinite(best[k - 1]):
            return None
        path = [k - 1]
        for s in range(stages - 1, -1, -1):
            path.append(int(choice[s, path[-1]]))
        path.reverse()
        return float(best[k - 1]), float(worst[k - 1]), path

    unconstrained = min_sum(np.inf)
    if unconstrained is None:
        return None
    floor = unconstrained[0]
    if microbatches == 1:
        return unconstrained[0], unconstrained[2]
    lo, hi = 0, caps.size - 1
    while lo < hi:  # least feasible cap
        mid = (lo + hi) // 2
        if min_sum(float(caps[mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    found: dict[int, tuple[float, float, list[int]]] = {}
    best: list[Any] = [math.inf, None]

    def evaluate(i: int) -> float:
        if i not in found:
            r = min_sum(float(caps[i]))
            assert r is not None
            found[i] = r
            value = r[0] + (microbatches - 1) * r[1]
            if value < best[0]:
                best[0], best[1] = value, r[2]
        return found[i][0]

    evaluate(lo)
    limit = (best[0] - floor) / (microbatches - 1)
    top = int(np.searchsorted(caps, limit, side="right")) - 1
    top = max(lo, min(top, caps.size - 1))
    evaluate(top)
    tol = 1e-12

    def bisect(i: int, j: int) -> None:
        si, sj = evaluate(i), evaluate(j)
        if j - i <= 1 or si - sj <= tol * abs(si):
            return  # the least sum is the same across (i, j]: cap i is at least as good
        if sj + (microbatches - 1) * float(caps[i + 1]) >= best[0]:
            return  # nothing in (i, j] can beat the best found
        mid = (i + j) // 2
        evaluate(mid)
        bisect(i, mid)
        bisect(mid, j)

    bisect(lo, top)
    return float(best[0]), list(best[1])


def interval_cost(problem: Any, cuts: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage time, static and activation bytes of every interval ``[cuts[a], cuts[b])`` of the blocks.

    Written independently of :mod:`partitioner.interval`: compute of the blocks plus,
    once per block u before the interval, u's transfer if any reader of u is inside.
    """
    k = len(cuts)
    t = np.concatenate([[0.0], np.cumsum(problem.time_s)])
    st = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
    ac = np.concatenate([[0.0], np.cumsum(problem.activation_bytes)])
    c = np.asarray(cuts)
    cost = t[c][None, :] - t[c][:, None]
    static = st[c][None, :] - st[c][:, None]
    act = ac[c][None, :] - ac[c][:, None]
    readers: dict[int, list[int]] = {}
    for u, v in problem.edges:
        readers.setdefault(u, []).append(v)

    def add_if_inside(matrix: np.ndarray, inside: Sequence[int], amount: float, after: int) -> None:
        # Intervals [lo, hi) with lo > after that hold one of ``inside``: the first one at or
        # after lo must come before hi.
        rs = np.unique(np.asarray(inside))
        for a in range(k):
            if cuts[a] <= after:
                continue
            pos = int(np.searchsorted(rs, cuts[a]))
            if pos < rs.size:
                matrix[a, c > rs[pos]] += amount

    for u, vs in readers.items():
        if problem.transfer_s[u] > 0:
            add_if_inside(cost, vs, problem.transfer_s[u], after=u)
    for nbytes, _, rs in problem.shared:
        add_if_inside(static, rs, nbytes, after=-1)
    invalid = ~np.triu(np.ones((k, k), dtype=bool), 1)
    cost[invalid] = np.inf
    return cost, static, act


def _masks(
    problem: Any, static: np.ndarray, act: np.ndarray, stages: int, microbatches: int
) -> np.ndarray | None:
    if problem.memory_limit is None:
        return None
    limit = problem.memory_limit * (1 + 1e-12)
    # GPipe: every stage holds all M micro-batches' activations.
    fits = static + microbatches * act <= limit
    return np.broadcast_to(fits, (stages, *fits.shape))


def best_contiguous(
    problem: Any, cuts: Sequence[int], stages: int, microbatches: int
) -> tuple[float, tuple[int, ...]] | None:
    """Exact best split of the blocks into stages that start only at ``cuts`` (0 first, N last)."""
    if stages > len(cuts) - 1:
        return None
    cost, static, act = interval_cost(problem, cuts)
    found = chain_dp(cost, stages, microbatches, _masks(problem, static, act, stages, microbatches))
    if found is None:
        return None
    _, path = found
    stage_of = [0] * problem.size
    for s in range(stages):
        stage_of[cuts[path[s]] : cuts[path[s + 1]]] = [s] * (cuts[path[s + 1]] - cuts[path[s]])
    return _step(problem, stage_of, microbatches), tuple(stage_of)


def best_whole_layer_split(
    problem: Any, unit_of_block: Sequence[int], stages: int, microbatches: int
) -> tuple[float, tuple[int, ...]] | None:
    """Exact least ``step_time`` over contiguous splits of whole units (stage per block)."""
    cuts = (
        [0]
        + [b for b in range(1, problem.size) if unit_of_block[b] != unit_of_block[b - 1]]
        + [problem.size]
    )
    return best_contiguous(problem, cuts, stages, microbatches)


def down_sets(problem: Any, limit: int = MAX_DOWN_SETS) -> list[int] | None:
    """Every set of blocks closed under predecessors (as bit masks, by size), or None if > limit."""
    n = problem.size
    preds = [0] * n
    for u, v in problem.edges:
        preds[v] |= 1 << u
    level = {0}
    out = [0]
    for _ in range(n):
        nxt: set[int] = set()
        for d in level:
            for v in range(n):
                if not (d >> v) & 1 and not preds[v] & ~d:
                    nxt.add(d | (1 << v))
        out.extend(sorted(nxt))
        if len(out) > limit:
            return None
        level = nxt
    return out


def exact_split(
    problem: Any, stages: int, microbatches: int, limit: int = MAX_DOWN_SETS
) -> tuple[float, tuple[int, ...]] | None:
    """Least ``step_time`` over every valid assignment (no edge backward, no stage empty, the
    last block in the last stage, memory within the limit), by a DP over down-sets.

    Exact for any DAG; practical while the number of down-sets is small.  Only for
    problems without all-reduce terms (one replica).  None when there are too many
    down-sets or no valid assignment.
    """
    if any(a > 0 for a in problem.allreduce_s) or any(s[1] > 0 for s in problem.shared):
        raise ValueError("exact_split handles one replica only (no all-reduce terms)")
    sets = down_sets(problem, limit)
    if sets is None:
        return None
    n = problem.size
    full = (1 << n) - 1
    last = 1 << (n - 1)
    # Intermediate boundaries must leave the last block (the model's output) for the last stage.
    sets = [d for d in sets if d == full or not d & last]
    member = np.array([[(d >> v) & 1 for v in range(n)] for d in sets], dtype=bool)
    f = member.astype(np.float64)
    subset = (f @ (~member).astype(np.float64).T) == 0  # subset[a, b]: D_a within D_b
    sizes = member.sum(axis=1)
    strict = subset & (sizes[:, None] < sizes[None, :])
    t = f @ np.asarray(problem.time_s, dtype=float)
    cost = t[None, :] - t[:, None]
    st = f @ np.asarray(problem.static_bytes, dtype=float)
    ac = f @ np.asarray(problem.activation_bytes, dtype=float)
    static = st[None, :] - st[:, None]
    act = ac[None, :] - ac[:, None]
    readers: dict[int, list[int]] = {}
    for u, v in problem.edges:
        readers.setdefault(u, []).append(v)
    for u, vs in readers.items():
        if problem.transfer_s[u] <= 0:
            continue
        count = member[:, sorted(set(vs))].sum(axis=1)
        # u sits before the stage (in D_a) and a reader of u inside it (more readers in D_b).
        cost += problem.transfer_s[u] * (member[:, u][:, None] & (count[None, :] > count[:, None]))
    for nbytes, _, rs in problem.shared:
        count = member[:, sorted(set(rs))].sum(axis=1)
        static += nbytes * (count[None, :] > count[:, None])
    cost[~strict] = np.inf
    found = chain_dp(cost, stages, microbatches, _masks(problem, static, act, stages, microbatches))
    if found is None:
        return None
    _, path = found
    stage_of = [0] * n
    for s in range(stages):
        inside = member[path[s + 1]] & ~member[path[s]]
        for v in np.flatnonzero(inside):
            stage_of[v] = s
    return _step(problem, stage_of, microbatches), tuple(stage_of)


def _step(problem: Any, stage_of: Sequence[int], microbatches: int) -> float:
    from partitioner.problem import step_time

    return step_time(problem, stage_of, microbatches=microbatches)[0]


# --------------------------------------------------------------------------- models and problems


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab: int
    n_embd: int
    n_layer: int
    seq: int
    n_head: int = 4

    def config(self) -> Any:
        from examples.gpt import GPTConfig

        return GPTConfig(
            vocab_size=self.vocab,
            block_size=self.seq,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )

    def build(self) -> Any:
        from examples.gpt import build_model

        return build_model(self.config())

    def inputs(self, batch: int) -> tuple[Any, ...]:
        import torch

        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, self.vocab, (batch, self.seq), generator=g),)

    def describe(self) -> str:
        return f"{self.n_layer}L E{self.n_embd} V{self.vocab // 1024}k T{self.seq}"


QUICK_MODELS = [ModelSpec("gpt-4L", vocab=4096, n_embd=128, n_layer=4, seq=64)]
FULL_MODELS = [
    ModelSpec("gpt-8L", vocab=16384, n_embd=256, n_layer=8, seq=256),
    ModelSpec("gpt-12L", vocab=16384, n_embd=256, n_layer=12, seq=256),
    ModelSpec("gpt-96L", vocab=16384, n_embd=64, n_layer=96, seq=64),
]
QUICK_STAGES = {"gpt-4L": (2, 4)}
FULL_STAGES = {"gpt-8L": (2, 4, 8), "gpt-12L": (2, 4, 8), "gpt-96L": (16, 64)}
WALL_MODELS = {
    (12, 8): ModelSpec("gpt-12L", vocab=16384, n_embd=256, n_layer=12, seq=256),
    (96, 64): ModelSpec("gpt-96L", vocab=16384, n_embd=64, n_layer=96, seq=64),
}


@dataclasses.dataclass
class Built:
    problem: Any
    blocks: tuple[tuple[str, ...], ...]
    unit_of_block: tuple[int, ...]
    unit_params: tuple[int, ...]
    unit_names: tuple[str, ...]


def unit_of_path(path: str, n_layer: int) -> int | None:
    """0 for the embeddings, i+1 for ``blocks.i``, n_layer+1 for the head; None for the root."""
    head = path.split(".")[0]
    if head in ("wte", "wpe"):
        return 0
    if head == "blocks":
        return int(path.split(".")[1]) + 1
    if head in ("ln_f", "lm_head"):
        return n_layer + 1
    return None


def build_problem(spec: ModelSpec, microbatches: int, say: Callable[[str], None]) -> Built:
    """The planner's problem for one micro-batch of one sample at dp = 1 (as ``compile`` builds it)."""
    from partitioner.capture import capture, module_path
    from partitioner.coarsen import coarsen
    from partitioner.cost import predicted_times, profile
    from partitioner.devices import DEVICES
    from partitioner.formulate import formulate, graph_costs
    from partitioner.values import propagate_values

    model = spec.build()
    micro = spec.inputs(1)
    say(f"{spec.name}: capture + cost for the baselines")
    captured = capture(model, micro)
    propagate_values(captured.graph_module, micro)
    costs = profile(captured, micro, measure=False)
    device = DEVICES[DEVICE]
    times = {name: predicted_times(c, device) for name, c in costs.items()}
    blocks = coarsen(
        captured.graph_module, max_blocks=256, times={k: f + b for k, (f, b) in times.items()}
    )
    graph = graph_costs(captured, blocks, costs, times)
    problem = formulate(graph, dp=1, spec=device, memory_limit=float(device.memory_bytes))
    nodes = captured.nodes()
    units: list[int] = []
    for members in blocks:
        u = unit_of_path(module_path(nodes[members[0]]), spec.n_layer)
        units.append(u if u is not None else (units[-1] if units else 0))
    if any(b < a for a, b in itertools.pairwise(units)) or sorted(set(units)) != list(
        range(spec.n_layer + 2)
    ):
        raise RuntimeError(f"{spec.name}: solver blocks do not follow the layer order: {units}")
    groups = (
        [["wte", "wpe"]] + [[f"blocks.{i}"] for i in range(spec.n_layer)] + [["ln_f", "lm_head"]]
    )
    params = []
    for names in groups:
        seen: dict[int, int] = {}
        for name in names:
            for p in model.get_submodule(name).parameters():
                seen[id(p)] = p.numel()
        params.append(sum(seen.values()))
    return Built(
        problem, tuple(blocks), tuple(units), tuple(params), tuple("+".join(g) for g in groups)
    )


# --------------------------------------------------------------------------- the split tables


@dataclasses.dataclass
class Row:
    model: str
    stages: int
    microbatches: int
    ideal: float
    ours: float
    ours_recheck: float
    ours_solver: str
    ours_split: str
    baselines: dict[str, float]
    splits: dict[str, str]
    over_memory: list[str]
    contiguous: float | None = None
    exact: float | None = None
    down_set_count: int | None = None
    compile_s: float = 0.0


BASELINES = ("equal-layer", "equal-param", "by-time", "best-layer")


def bench_row(
    spec: ModelSpec,
    built: Built,
    stages: int,
    microbatches: int,
    say: Callable[[str], None],
    exact: bool,
) -> Row:
    from partitioner.planner import compile
    from partitioner.problem import check_assignment, stage_memory

    problem = built.problem
    n_units = len(built.unit_params)
    unit_times = [0.0] * n_units
    for b, u in enumerate(built.unit_of_block):
        unit_times[u] += problem.time_s[b]
    splits_units = {
        "equal-layer": equal_layers(n_units, stages),
        "equal-param": equal_parameters(built.unit_params, stages),
        "by-time": balance_by_time(unit_times, stages),
    }
    baselines: dict[str, float] = {}
    splits: dict[str, str] = {}
    over: list[str] = []
    limit = problem.memory_limit
    for name, unit_stage in splits_units.items():
        stage_of = units_to_blocks(unit_stage, built.unit_of_block)
        assert check_assignment(problem, stage_of, stages) is None, name
        baselines[name] = _step(problem, stage_of, microbatches)
        splits[name] = stage_sizes(unit_stage)
        if (
            limit is not None
            and max(
                stage_memory(problem, stage_of, stages, microbatches=microbatches, schedule="gpipe")
            )
            > limit
        ):
            over.append(name)
    best = best_whole_layer_split(problem, built.unit_of_block, stages, microbatches)
    if best is not None:
        baselines["best-layer"] = best[0]
        best_units = [0] * n_units
        for b, u in enumerate(built.unit_of_block):
            best_units[u] = best[1][b]
        splits["best-layer"] = stage_sizes(best_units)
    say(f"{spec.name} P={stages}: compile (capture, cost, solve)")
    start = time.perf_counter()
    plan = compile(
        spec.build(),
        spec.inputs(microbatches),
        gpus=stages,
        pp=stages,
        microbatches=microbatches,
        device=DEVICE,
    )
    compile_s = time.perf_counter() - start
    # Re-evaluate the plan's assignment on our problem: both must be the same problem.
    block_of = {name: b for b, members in enumerate(built.blocks) for name in members}
    plan_stage = [-1] * problem.size
    for st in plan.stages:
        for name in st.nodes:
            if name in block_of:
                plan_stage[block_of[name]] = st.index
    recheck = _step(problem, plan_stage, microbatches) if min(plan_stage) >= 0 else math.nan
    row = Row(
        model=spec.name,
        stages=stages,
        microbatches=microbatches,
        ideal=ideal_step(problem.time_s, stages, microbatches),
        ours=plan.solver.objective,
        ours_recheck=recheck,
        ours_solver=f"{plan.solver.name} ({plan.solver.status})",
        ours_split=_first_modules([st.modules[0] for st in plan.stages]),
        baselines=baselines,
        splits=splits,
        over_memory=over,
        compile_s=compile_s,
    )
    if exact:
        say(f"{spec.name} P={stages}: exact references")
        contiguous = best_contiguous(problem, list(range(problem.size + 1)), stages, microbatches)
        row.contiguous = contiguous[0] if contiguous else None
        sets = down_sets(problem)
        row.down_set_count = None if sets is None else len(sets)
        found = exact_split(problem, stages, microbatches) if sets is not None else None
        row.exact = found[0] if found else None
    return row


def _first_modules(names: list[str], keep: int = 12) -> str:
    if len(names) <= keep:
        return " | ".join(names)
    return (
        " | ".join(names[: keep - 2])
        + f" | ... ({len(names) - keep} more) ... | "
        + " | ".join(names[-2:])
    )


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{1e3 * x:.4f}"


def _ratio(x: float | None, ref: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x / ref:.3f}x"


def print_tables(rows: list[Row], models: dict[str, ModelSpec]) -> bool:
    """Print the split tables; True when every target is met."""
    ok_all = True
    header = ["model", "P", "M", "ideal", "ours"] + list(BASELINES) + ["ours<=all"]
    table_ms, table_x = [], []
    for r in rows:
        base = [r.baselines.get(b) for b in BASELINES]
        feasible = [v for b, v in r.baselines.items() if v is not None and b not in r.over_memory]
        ok = all(r.ours <= v * (1 + 1e-9) for v in feasible)
        ok_all &= ok
        mark = "yes" if ok else "NO"
        table_ms.append(
            [r.model, r.stages, r.microbatches, _ms(r.ideal), _ms(r.ours)]
            + [_ms(v) for v in base]
            + [mark]
        )
        table_x.append(
            [r.model, r.stages, r.microbatches, "1.000x", _ratio(r.ours, r.ideal)]
            + [_ratio(v, r.ideal) for v in base]
            + [mark]
        )
    print("Predicted GPipe step time, ms per step (device h100, FLOP/byte roofline, dp = 1)")
    _print(header, table_ms)
    print()
    print(
        "Same, as a ratio to the perfectly balanced ideal (sum t + (M-1) sum t / P, free communication)"
    )
    _print(header, table_x)
    print()
    print(
        "Models: "
        + "; ".join(f"{m.name} = {m.describe()}" for m in models.values())
        + f"; one micro-batch = 1 sample; M = {MICROBATCHES}."
    )
    print()
    print(
        "Splits (units per stage: embeddings, blocks.0..L-1, head) and ours (first module of each stage)"
    )
    for r in rows:
        parts = [f"{b} {r.splits[b]}" for b in BASELINES if b in r.splits]
        over = f"  [over memory: {', '.join(r.over_memory)}]" if r.over_memory else ""
        print(f"  {r.model} P={r.stages}: " + ", ".join(parts) + over)
        print(f"      ours [{r.ours_solver}, compile {r.compile_s:.1f} s]: {r.ours_split}")
        if not math.isclose(r.ours, r.ours_recheck, rel_tol=1e-9):
            ok_all = False
            print(
                f"      MISMATCH: plan objective {_ms(r.ours)} ms, its split on our problem {_ms(r.ours_recheck)} ms"
            )
    exact_rows = [r for r in rows if r.contiguous is not None or r.exact is not None]
    if exact_rows:
        print()
        print("Optimality: ours vs the best contiguous split of the solver blocks in their order,")
        print(
            "and vs the exact optimum over every valid assignment (DP over down-sets of the block graph)"
        )
        table = []
        for r in exact_rows:
            gap = (
                "-"
                if r.exact is None
                else f"{100 * (r.ours / r.exact - 1) + 0.0:+.3f}%".replace("-0.000", "+0.000")
            )
            within = (
                "-" if r.exact is None else ("yes" if r.ours <= r.exact * TARGET_RATIO else "NO")
            )
            if r.exact is not None:
                ok_all &= r.ours <= r.exact * TARGET_RATIO
            table.append(
                [
                    r.model,
                    r.stages,
                    _ms(r.ours),
                    _ms(r.contiguous),
                    _ms(r.exact),
                    r.down_set_count if r.down_set_count is not None else f">{MAX_DOWN_SETS}",
                    gap,
                    within,
                    r.ours_solver,
                ]
            )
        _print(
            [
                "model",
                "P",
                "ours",
                "contiguous",
                "exact",
                "down-sets",
                "gap",
                "within 1%",
                "solver",
            ],
            table,
        )
    return ok_all


def _print(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for k, row in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if i < 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )
        if k == 0:
            print("  ".join("-" * w for w in widths))


# --------------------------------------------------------------------------- wall time


COUNTED = ("capture", "propagate_values")  # phases whose call count is shown when > 1
PHASES = (
    "capture",
    "propagate_values",
    "profile",
    "coarsen",
    "graph_costs",
    "formulate",
    "solve",
    "_build_plan",
)


def wall_child(layers: int, gpus: int, repeat: bool, cprofile: bool) -> dict[str, Any]:
    """Time ``compile`` over every pp x dp in this (fresh) process, phase by phase."""
    from partitioner import planner

    spec = WALL_MODELS[layers, gpus]
    model = spec.build()
    inputs = spec.inputs(gpus * MICROBATCHES)  # every dp divides the batch
    spent: dict[str, list[float]] = {}
    active: list[str] = []  # a phase called inside another counts for the outer one
    for name in PHASES:
        fn = getattr(planner, name, None)
        if fn is None:
            continue

        def timed(
            *args: Any, _fn: Callable[..., Any] = fn, _name: str = name, **kwargs: Any
        ) -> Any:
            if active:
                return _fn(*args, **kwargs)
            active.append(_name)
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                active.pop()
                entry = spent.setdefault(_name, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        setattr(planner, name, timed)
    runs = []
    for attempt in range(2 if repeat else 1):
        spent.clear()
        profiler = None
        if cprofile and attempt == 0:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        start, cpu_start = time.perf_counter(), time.process_time()
        plan = planner.compile(
            model, inputs, gpus=gpus, microbatches=MICROBATCHES, device=DEVICE, status=_child_status
        )
        total = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        runs.append(
            {
                "total": total,
                "cpu": cpu,
                "phases": {k: v[0] for k, v in spent.items()},
                "calls": {k: v[1] for k, v in spent.items()},
                "pp": plan.pp,
                "dp": plan.dp,
                "blocks": plan.solver.blocks,
                "candidates": [[c.pp, c.dp, c.step_s, c.status, c.note] for c in plan.candidates],
            }
        )
    return {
        "model": spec.name,
        "describe": spec.describe(),
        "batch": gpus * MICROBATCHES,
        "runs": runs,
    }


def _child_status(message: str) -> None:
    """The planner's status lines, without the per-node progress (only its last line)."""
    if message.startswith(("counting costs", "measuring costs")):
        done, _, total = message.rpartition(" ")[2].partition("/")
        if done != total:
            return
    print(f"    {message}", file=sys.stderr, flush=True)


def run_wall(
    layers: int, gpus: int, repeat: bool, cprofile: bool, say: Callable[[str], None]
) -> dict[str, Any]:
    say(f"wall time: {layers}-layer GPT on {gpus} GPUs (fresh process)")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--wall-child", f"{layers},{gpus}"]
    if repeat:
        cmd.append("--repeat")
    if cprofile:
        cmd.append("--cprofile")
    done = subprocess.run(
        cmd,
        check=False,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"wall-time child failed ({done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load"] = os.getloadavg()[0]  # other work on the machine inflates wall times
    return result


def print_wall(results: dict[tuple[int, int], dict[str, Any]]) -> bool:
    ok_all = True
    print(
        "Planner wall time: compile() over every pp x dp, in a fresh process (cold), then again (warm)"
    )
    print("(cpu s: the process's CPU time, less sensitive to other load; torch may use 2 threads)")
    names = [
        "capture",
        "propagate_values",
        "profile",
        "coarsen",
        "graph_costs",
        "formulate",
        "solve",
        "_build_plan",
    ]
    short = ["capture", "values", "profile", "coarsen", "costs", "formulate", "solve", "build plan"]
    header = (
        ["case", "run", "total s", "cpu s", "target", "met"] + short + ["other", "chose", "blocks"]
    )
    table = []
    for (layers, gpus), res in results.items():
        target = WALL_TARGETS[layers, gpus]
        for k, run in enumerate(res["runs"]):
            met = run["total"] <= target
            if k == 0:
                ok_all &= met
            phases = run["phases"]
            calls = run["calls"]
            cells = []
            for n in names:
                v = phases.get(n)
                cells.append(
                    "-"
                    if v is None
                    else f"{v:.2f}" + (f" x{calls[n]}" if n in COUNTED and calls[n] > 1 else "")
                )
            other = run["total"] - sum(phases.values())
            table.append(
                [
                    f"{layers}L / {gpus} GPUs",
                    "cold" if k == 0 else "warm",
                    f"{run['total']:.2f}",
                    f"{run['cpu']:.2f}",
                    f"< {target:.0f}",
                    "yes" if met else "NO",
                ]
                + cells
                + [f"{other:.2f}", f"{run['pp']}x{run['dp']}", run["blocks"]]
            )
    _print(header, table)
    for (layers, gpus), res in results.items():
        run = res["runs"][0]
        print(
            f"  {layers}L / {gpus} GPUs: {res['model']} = {res['describe']}, batch {res['batch']}, M = {MICROBATCHES}; "
            f"1-min load average after the run {res['load']:.1f} on {os.cpu_count()} cores; "
            "candidates (pp x dp: step ms, status):"
        )
        print(
            "    "
            + "; ".join(
                f"{p}x{d}: {_ms(s)} {st} ({note})" for p, d, s, st, note in run["candidates"]
            )
        )
        if run["total"] > WALL_TARGETS[layers, gpus]:
            phases = run["phases"]
            top = max(phases, key=phases.get)  # type: ignore[arg-type]
            print(
                f"    TARGET MISSED: {run['total']:.1f} s > {WALL_TARGETS[layers, gpus]:.0f} s; "
                f"largest phase {top} ({phases[top]:.1f} s, {100 * phases[top] / run['total']:.0f}%)"
            )
    return ok_all


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small model, two widths, 12L/8 wall time (< 60 s)"
    )
    parser.add_argument("--no-wall", action="store_true", help="skip the wall-time rows")
    parser.add_argument("--wall-only", action="store_true", help="only the wall-time rows")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact-optimum references")
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="print cProfile's top functions of each cold compile",
    )
    parser.add_argument("--wall-child", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.wall_child:
        layers, gpus = (int(x) for x in args.wall_child.split(","))
        print(json.dumps(wall_child(layers, gpus, args.repeat, args.cprofile)))
        return 0

    start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    import torch

    torch.manual_seed(0)
    models = QUICK_MODELS if args.quick else FULL_MODELS
    stage_sets = QUICK_STAGES if args.quick else FULL_STAGES
    rows: list[Row] = []
    for spec in [] if args.wall_only else models:
        built = build_problem(spec, MICROBATCHES, say)
        say(
            f"{spec.name}: {built.problem.size} solver blocks, {len(built.unit_params)} layer units"
        )
        for stages in stage_sets[spec.name]:
            rows.append(bench_row(spec, built, stages, MICROBATCHES, say, exact=not args.no_exact))
    ok = print_tables(rows, {m.name: m for m in models}) if rows else True
    if not args.no_wall:
        cases = [(12, 8)] if args.quick else [(12, 8), (96, 64)]
        results = {
            c: run_wall(
                *c, repeat=(c == (12, 8) and not args.quick), cprofile=args.cprofile, say=say
            )
            for c in cases
        }
        print()
        ok &= print_wall(results)
    print()
    print(
        f"All targets met: {'yes' if ok else 'NO'} (bench wall time {time.perf_counter() - start:.0f} s)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
