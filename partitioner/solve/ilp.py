"""Solve: split blocks into contiguous pipeline stages (an ILP; exact DP for chains).

Pure function over numbers: a :class:`~partitioner.solve.problem.PartitionProblem`
in, a :class:`~partitioner.solve.problem.Partition` out; no torch.

The ILP (PuLP, HiGHS through ``highspy``, CBC as fallback) uses a cumulative
binary ``x[v, s]`` = "block v is in stage <= s", which keeps precedence linear
(``x[v, s] <= x[u, s]`` for every edge u -> v) and lets stages follow any
topological order, not only the given one.  ``y[u, r]`` marks block u's output
received by stage r; ``z[k, s]`` a shared (tied) parameter held by stage s.
Objective: ``sum_s t_s + (M-1) T + A`` with ``T >= t_s`` and ``A >=`` each
stage's all-reduce time; memory per stage is a hard limit.

Links and recomputation (:mod:`partitioner.solve.problem`): whether stage s's inbound
link or all-reduce crosses nodes depends on s alone, so its transfer and
all-reduce prices are constants per stage and stay linear.  Where stages may
recompute ("auto"), a binary ``r_s`` chooses, and ``w[v, s] = in(v, s) AND r_s``
is linearised exactly (``w <= in``, ``w <= r``, ``w >= in + r - 1``): stage s's
time gains ``sum_v recompute_s[v] w[v, s]``, its memory swaps ``activation_bytes``
for ``recompute_bytes`` on those blocks and adds ``P_s >= activation_bytes[v]
w[v, s]`` (the largest block's activations, live again in its backward).  After
solving, the choice is taken again by :func:`~partitioner.solve.problem.choose_recompute`
(it differs from ``r`` only on ties) and the split priced by ``step_time``.  A stage
recomputes all its blocks or none in the ILP; where the problem allows selective
recomputation (``layer_start``) the rule's choice, which may recompute fewer blocks,
is applied to the ILP's split afterwards (:func:`~partitioner.solve.interval.selective_again`).

:func:`solve` first runs the exact interval DP (:mod:`partitioner.solve.interval`)
over the given order; when the blocks form a chain and there are no replicas,
that is already optimal.  Without replicas on a graph with at most
``DOWN_SET_LIMIT`` down-sets, the same DP over down-sets is exact for every
topological order.  Otherwise (replicas: the all-reduce term is a second
bottleneck) the ILP runs with the DP's answer as an upper bound, within a time
limit, and the better of the two is returned with the ILP's proven lower bound.

Example::

    >>> from partitioner.solve.problem import PartitionProblem
    >>> p = PartitionProblem(time_s=(3.0, 1.0, 1.0, 1.0), static_bytes=(0,) * 4,
    ...     activation_bytes=(0,) * 4, allreduce_s=(0,) * 4, transfer_s=(0,) * 4,
    ...     edges=((0, 3), (1, 3), (2, 3)))
    >>> solve(p, stages=2, microbatches=4).stage_of
    (0, 1, 1, 1)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import pulp

from partitioner.defaults import DEFAULT_SCHEDULE
from partitioner.solve.interval import (
    all_or_nothing,
    down_sets,
    selective_again,
    simple_bound,
    solve_down_sets,
    solve_intervals,
)
from partitioner.solve.problem import (
    Partition,
    PartitionProblem,
    ScheduleKind,
    allreduce_latencies,
    can_recompute,
    check_assignment,
    choose_recompute,
    in_flight,
    recompute_peak,
    stage_links,
    stage_memory,
    step_time,
    within_limit,
)

__all__ = ["DOWN_SET_LIMIT", "ILP_SIZE_LIMIT", "is_chain", "solve", "solve_ilp"]

# Blocks x stages above which the ILP is skipped (DESIGN.md: a 700-node, 8-stage
# ILP took 43 s here; 300 x 4 about 1 s).
ILP_SIZE_LIMIT = 1600
DOWN_SET_LIMIT = 600  # down-sets of the block graph up to which the exact down-set DP replaces the ILP
_RETRIES = 8  # re-solves after a tolerance artefact (an answer a few bytes over the limit)


def is_chain(problem: PartitionProblem) -> bool:
    """True when the blocks admit only their given order (every consecutive pair is an edge)."""
    edges = set(problem.edges)
    return all((v, v + 1) in edges for v in range(problem.size - 1))


def solve(
    problem: PartitionProblem,
    *,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind = DEFAULT_SCHEDULE,
    time_limit: float = 10.0,
    use_ilp: bool | None = None,
) -> Partition | None:
    """Best split into ``stages`` stages; None when no split meets the memory limit.

    ``use_ilp=None`` decides automatically (see the module docstring).
    """
    start = time.perf_counter()
    interval = solve_intervals(problem, stages=stages, microbatches=microbatches, schedule=schedule)
    replicated = _replicated(problem)
    if not replicated and not is_chain(problem) and use_ilp is None:
        member = down_sets(problem, limit=DOWN_SET_LIMIT)
        if member is not None:  # few enough orders to enumerate: exact without the ILP
            exact = solve_down_sets(problem, member, stages=stages, microbatches=microbatches, schedule=schedule)
            if exact is None:
                return None
            if exact.status == "optimal":
                # Exact: the optimum is its own lower bound (the DP's pruning bound is weaker: no "optimal, gap 3%").
                exact = _with(exact, lower_bound=exact.objective)
            return _with(exact, wall_s=time.perf_counter() - start)
    exact_already = is_chain(problem) and not replicated
    if use_ilp is None:
        use_ilp = not exact_already and problem.size * stages <= ILP_SIZE_LIMIT
    if not use_ilp:
        if interval is None:
            return None
        if not exact_already:
            interval = _with(interval, status="feasible", lower_bound=simple_bound(problem, stages, microbatches))
        else:  # exact, as above
            interval = _with(interval, lower_bound=interval.objective)
        return _with(interval, wall_s=time.perf_counter() - start)
    ilp = solve_ilp(
        problem,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        time_limit=time_limit,
        upper_bound=_upper_bound(problem, interval, microbatches, schedule),
    )
    if ilp is None and interval is None:
        return None
    if ilp is None:
        assert interval is not None
        return _with(
            interval,
            status="feasible",
            lower_bound=min(interval.objective, simple_bound(problem, stages, microbatches)),
            wall_s=time.perf_counter() - start,
        )
    best = ilp if interval is None or ilp.objective <= interval.objective + 1e-12 else interval
    return _with(
        best,
        status=ilp.status,
        lower_bound=best.objective if ilp.status == "optimal" else min(ilp.lower_bound, best.objective),
        solver=ilp.solver if best is ilp else f"{interval.solver if interval else ''}+{ilp.solver}",
        wall_s=time.perf_counter() - start,
    )


def _upper_bound(
    problem: PartitionProblem, interval: Partition | None, microbatches: int, schedule: ScheduleKind
) -> float | None:
    """The interval DP's objective as the ILP's bound, priced as the ILP prices it (all blocks or none)."""
    if interval is None:
        return None
    if all(isinstance(r, bool) for r in interval.recompute):
        return interval.objective
    return step_time(all_or_nothing(problem), interval.stage_of, microbatches=microbatches, schedule=schedule)[0]


def _replicated(problem: PartitionProblem) -> bool:
    """True when some all-reduce costs anything: a second bottleneck the DPs do not enumerate.

    (The fixed latency term alone is no bottleneck: every split has every stage.)
    """
    slow = (*(problem.allreduce_slow_s or ()), *(problem.shared_slow_allreduce_s or ()))
    return (
        any(a > 0 for a in problem.allreduce_s)
        or any(s[1] > 0 for s in problem.shared)
        or any(a > 0 for a in slow)
    )


def solve_ilp(
    problem: PartitionProblem,
    *,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind = DEFAULT_SCHEDULE,
    time_limit: float = 10.0,
    upper_bound: float | None = None,
) -> Partition | None:
    """The ILP of the module docstring; None if infeasible or no solution in time."""
    found = _solve_ilp(all_or_nothing(problem), stages=stages, microbatches=microbatches, schedule=schedule,
                       time_limit=time_limit, upper_bound=upper_bound)
    if found is None:
        return None
    return selective_again(problem, found, microbatches=microbatches, schedule=schedule,
                           lower_bound=simple_bound(problem, stages, microbatches))


def _solve_ilp(
    problem: PartitionProblem,
    *,
    stages: int,
    microbatches: int,
    schedule: ScheduleKind,
    time_limit: float,
    upper_bound: float | None,
) -> Partition | None:
    start = time.perf_counter()
    n, P, M = problem.size, stages, microbatches
    if not 1 <= P <= n:
        return None
    lp = pulp.LpProblem("pipeline_split", pulp.LpMinimize)
    # Scale seconds by the total work and bytes by the memory limit so every coefficient
    # is O(1): HiGHS's tolerances are absolute (~1e-6), and real stage times differ by less.
    t_unit = max(sum(problem.time_s), 1e-30)
    b_unit = problem.memory_limit or 1.0
    x = {(v, s): _var(lp, f"x_{v}_{s}", 0, 1, "Binary") for v in range(n) for s in range(P - 1)}

    def upto(v: int, s: int) -> pulp.LpAffineExpression | int:
        if s < 0:
            return 0
        if s >= P - 1:
            return 1
        return x[v, s]

    def inside(v: int, s: int) -> pulp.LpAffineExpression:
        return upto(v, s) - upto(v, s - 1)

    for v in range(n):
        for s in range(P - 2):
            lp += x[v, s] <= x[v, s + 1]
    for u, v in problem.edges:
        for s in range(P - 1):
            lp += x[v, s] <= x[u, s]
    for s in range(P - 1):  # the last block holds the model's output: last stage
        lp += x[n - 1, s] == 0
    for s in range(P):
        lp += pulp.lpSum(inside(v, s) for v in range(n)) >= 1
    receives: dict[tuple[int, int], pulp.LpVariable] = {}
    for u, v in problem.edges:
        if problem.transfer_s[u] <= 0:
            continue
        for r in range(1, P):
            var = receives.get((u, r))
            if var is None:
                var = receives[u, r] = _var(lp, f"y_{u}_{r}", 0, 1)
            lp += var >= inside(v, r) + upto(u, r - 1) - 1
    holds = {
        (k, s): _var(lp, f"z_{k}_{s}", 0, 1) for k in range(len(problem.shared)) for s in range(P)
    }
    for k, (_, _, readers) in enumerate(problem.shared):
        for s in range(P):
            for v in set(readers):
                lp += holds[k, s] >= inside(v, s)
    redo, both, choice = _recompute_variables(lp, problem, P, inside)
    inbound, outbound = stage_links(problem, P)
    latency = allreduce_latencies(problem, P)
    least_latency = min(latency)
    bottleneck = _var(lp, "T", 0, None)
    allreduce = _var(lp, "A", 0, None)
    stage_time = []
    for s in range(P):
        transfer = _prices(problem.transfer_s, problem.transfer_slow_s, inbound[s])
        block_allreduce = _prices(problem.allreduce_s, problem.allreduce_slow_s, outbound[s])
        shared_allreduce = _prices(
            tuple(k[1] for k in problem.shared), problem.shared_slow_allreduce_s, outbound[s]
        )
        t = (
            pulp.lpSum(problem.time_s[v] / t_unit * inside(v, s) for v in range(n))
            + pulp.lpSum(transfer[u] / t_unit * var for (u, r), var in receives.items() if r == s)
            + pulp.lpSum(
                problem.recompute_s[v] / t_unit * var
                for (v, r), var in both.items()
                if r == s and problem.recompute_s is not None
            )
        )
        stage_time.append(t)
        lp += bottleneck >= t
        # Latency above the least stage's (0 without topology): the least is added after solving.
        lp += allreduce >= pulp.lpSum(
            block_allreduce[v] / t_unit * inside(v, s) for v in range(n)
        ) + pulp.lpSum(
            shared_allreduce[k] / t_unit * holds[k, s] for k in range(len(problem.shared))
        ) + (latency[s] - least_latency) / t_unit
        if problem.memory_limit is not None:
            flight = in_flight(s, P, M, schedule, chunks=problem.chunks if problem.stage_rank else None)
            memory = pulp.lpSum(
                (problem.static_bytes[v] + flight * problem.activation_bytes[v]) / b_unit * inside(v, s)
                for v in range(n)
            ) + pulp.lpSum(problem.shared[k][0] / b_unit * holds[k, s] for k in range(len(problem.shared)))
            if s in redo:  # recomputed blocks keep their inputs instead, plus the largest block's activations
                assert problem.recompute_bytes is not None
                peak = _var(lp, f"P_{s}", 0, None)
                live = recompute_peak(problem)  # a recomputed layer's activations, during its backward
                for v in range(n):
                    if live[v] > 0:
                        lp += peak >= live[v] / b_unit * both[v, s]
                memory += peak + pulp.lpSum(
                    flight * (problem.recompute_bytes[v] - problem.activation_bytes[v]) / b_unit * both[v, s]
                    for v in range(n)
                )
            lp += memory <= 1 + 1e-9
    objective = pulp.lpSum(stage_time) + (M - 1) * bottleneck + allreduce
    lp += objective
    if upper_bound is not None:
        lp += objective <= (upper_bound - least_latency) / t_unit * (1 + 1e-9)
    for _ in range(_RETRIES):
        status, bound, name = _run(lp, time_limit)
        if status not in ("optimal", "feasible"):
            return None
        stage_of = tuple(
            next(s for s in range(P) if s == P - 1 or (x[v, s].value() or 0) > 0.5) for v in range(n)
        )
        other_split = pulp.lpSum(1 - var if var.value() > 0.5 else var for var in x.values())
        if check_assignment(problem, stage_of, P) is not None or not _fits(problem, stage_of, P, M, schedule):
            # Within HiGHS's tolerances but over the limit by a few bytes: exclude it and solve again.
            lp += other_split >= 1
            continue
        recompute = choose_recompute(problem, stage_of, P, microbatches=M, schedule=schedule)
        kept = [s for s, var in choice.items() if recompute[s] and (var.value() or 0) < 0.5]
        if not kept:
            break
        # Kept within tolerance, but only recomputing fits: this split keeps those stages no more.
        for s in kept:
            lp += other_split + choice[s] >= 1
    else:
        return None
    value, _ = step_time(problem, stage_of, microbatches=M, schedule=schedule, recompute=recompute)
    bound = None if bound is None else bound * t_unit + least_latency
    return Partition(
        stage_of=stage_of,
        stages=P,
        objective=value,
        # Proven optimal: the objective is its own lower bound (HiGHS's bound can trail by its tolerance).
        lower_bound=value if status == "optimal" or bound is None else min(value, bound),
        status="optimal" if status == "optimal" else "feasible",
        solver=name,
        wall_s=time.perf_counter() - start,
        recompute=recompute,
    )


def _prices(fast: tuple[float, ...], slow: tuple[float, ...] | None, crosses: bool) -> tuple[float, ...]:
    """The inter-node prices where the link crosses nodes and they are given, else the intra-node ones."""
    return slow if crosses and slow is not None else fast


def _recompute_variables(
    lp: pulp.LpProblem,
    problem: PartitionProblem,
    stages: int,
    inside: Callable[[int, int], pulp.LpAffineExpression],
) -> tuple[set[int], dict[tuple[int, int], pulp.LpAffineExpression], dict[int, pulp.LpVariable]]:
    """The stages that may recompute, ``w[v, s]`` = block v in stage s AND stage s recomputes, and ``r_s``.

    "full": every stage recomputes (``w = in``); "auto" with a memory limit: a binary
    ``r_s`` per stage, ``w`` linearised (``w <= in``, ``w <= r``, ``w >= in + r - 1``,
    exact at integral ``in`` and ``r``).  Otherwise (or without recomputation costs,
    or "auto" without a limit, where keeping always fits and is never slower): none.
    """
    n = problem.size
    if not can_recompute(problem) or (problem.recompute == "auto" and problem.memory_limit is None):
        return set(), {}, {}
    both: dict[tuple[int, int], pulp.LpAffineExpression] = {}
    choice: dict[int, pulp.LpVariable] = {}
    for s in range(stages):
        if problem.recompute == "full":
            both.update({(v, s): pulp.LpAffineExpression(inside(v, s)) for v in range(n)})
            continue
        redo = choice[s] = _var(lp, f"r_{s}", 0, 1, "Binary")
        for v in range(n):
            w = _var(lp, f"w_{v}_{s}", 0, 1)
            lp += w <= inside(v, s)
            lp += w <= redo
            lp += w >= inside(v, s) + redo - 1
            both[v, s] = pulp.LpAffineExpression(w)
    return set(range(stages)), both, choice


def _run(lp: pulp.LpProblem, time_limit: float) -> tuple[str, float | None, str]:
    """Solve with HiGHS (CBC if HiGHS is missing): (status, lower bound, solver name)."""
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        solver: pulp.LpSolver = pulp.HiGHS(
            msg=False,
            timeLimit=time_limit,
            gapRel=0.0,  # "optimal" must mean optimal, not within HiGHS's default 1e-4
            gapAbs=0.0,
            threads=1,
            primal_feasibility_tolerance=1e-9,
            mip_feasibility_tolerance=1e-9,
        )
        name = "ilp-highs"
    else:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=0.0, gapAbs=0.0)
        name = "ilp-cbc"
    with _quiet():
        code = lp.solve(solver)
    has_solution = lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if code == pulp.LpStatusOptimal and lp.sol_status == pulp.LpSolutionOptimal:
        status = "optimal"
    elif has_solution:
        status = "feasible"
    else:
        return "none", None, name
    bound: float | None = None
    model = getattr(lp, "solverModel", None)
    if status == "optimal":
        bound = pulp.value(lp.objective)
    elif model is not None and hasattr(model, "getInfo"):
        bound = float(model.getInfo().mip_dual_bound)
    return status, bound, name


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the solver banner HiGHS prints to fd 1 even with msg=False."""
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _var(lp: pulp.LpProblem, name: str, low: float | None, high: float | None, cat: str = "Continuous") -> pulp.LpVariable:
    if hasattr(lp, "add_variable"):  # PuLP >= 3.3
        return lp.add_variable(name, low, high, cat=cat)
    return pulp.LpVariable(name, low, high, cat=cat)


def _fits(problem: PartitionProblem, stage_of: tuple[int, ...], P: int, M: int, schedule: ScheduleKind) -> bool:
    """Every stage within the memory limit, with the recomputation :func:`choose_recompute` picks."""
    if problem.memory_limit is None:
        return True
    memory = stage_memory(problem, stage_of, P, microbatches=M, schedule=schedule)
    return all(within_limit(m, problem.memory_limit) for m in memory)


def _with(partition: Partition, **changes: object) -> Partition:
    import dataclasses

    return dataclasses.replace(partition, **changes)  # type: ignore[arg-type]
