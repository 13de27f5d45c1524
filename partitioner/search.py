"""The search over pp x dp x micro-batches x schedule: enumerate, bound, screen, refine, and say why each lost.

:func:`search` makes every allowed combination a :class:`Trial`, drops shapes
whose weights and optimizer state alone cannot fit, prunes by the lower bound
``T (1 + (M-1)/pp)`` once it loses to the ``REFINED_CANDIDATES``-th best closed
form, screens the rest with the interval DP and solves the best few again with
the full solver (the steps are described in :mod:`partitioner.planner`).
:func:`best_candidates` picks the ``SIMULATED_CANDIDATES`` the planner simulates;
:func:`candidate_rows` turns every trial into a report row with its verdict, and
:func:`infeasible_error` explains what would fit when nothing does.
"""

from __future__ import annotations

import dataclasses
import math

from partitioner.defaults import SCHEDULES
from partitioner.errors import AutopartitionError, InfeasibleError
from partitioner.options import PlanOptions, Status
from partitioner.plan import Candidate, Plan
from partitioner.precision import static_bytes_per_element
from partitioner.problem import (
    Partition,
    PartitionProblem,
    ScheduleKind,
    choose_recompute,
    stage_costs,
    stage_memory,
)
from partitioner.scaledcosts import ScaledCosts
from partitioner.solve import is_chain, solve
from partitioner.units import format_bytes, plural

__all__ = [
    "REFINED_CANDIDATES",
    "SIMULATED_CANDIDATES",
    "CombinationKey",
    "Solved",
    "Trial",
    "best_candidates",
    "candidate_rows",
    "combination_key",
    "infeasible_error",
    "percent_more",
    "search",
]


SIMULATED_CANDIDATES = 3  # best closed-form combinations that are simulated before choosing



REFINED_CANDIDATES = 4  # best screened combinations solved again by the full solver



@dataclasses.dataclass(frozen=True)
class Solved:
    """One solved pp x dp x M x schedule combination and the problem it was solved for (reused by the plan)."""

    pp: int
    dp: int
    problem: PartitionProblem
    partition: Partition
    microbatches: int
    schedule: ScheduleKind



# A combination: (pp, dp, micro-batches, schedule).
CombinationKey = tuple[int, int, int | None, str | None]



def combination_key(solved: Solved) -> CombinationKey:
    return (solved.pp, solved.dp, solved.microbatches, solved.schedule)



@dataclasses.dataclass(eq=False)
class Trial:
    """One pp x dp x M x schedule combination (M and schedule None: the whole shape) as the search left it."""

    pp: int
    dp: int
    microbatches: int | None = None
    schedule: ScheduleKind | None = None
    status: str = "pending"  # then skipped, infeasible, pruned, or the solver's optimal / feasible
    reason: str = ""  # skipped / infeasible: why
    bound: float = 0.0  # a lower bound on its closed-form step
    problem: PartitionProblem | None = None
    partition: Partition | None = None
    memory: float | None = None  # peak bytes per GPU of its split; infeasible: what its split would need
    simulated_s: float | None = None
    bubble: float | None = None  # closed form
    simulated_bubble: float | None = None

    @property
    def key(self) -> CombinationKey:
        return (self.pp, self.dp, self.microbatches, self.schedule)

    def solved(self) -> Solved:
        assert self.problem is not None and self.partition is not None
        assert self.microbatches is not None and self.schedule is not None
        return Solved(self.pp, self.dp, self.problem, self.partition, self.microbatches, self.schedule)

    def simulated(self, draft: Plan) -> None:
        """Record the simulation of its draft plan."""
        self.simulated_s = draft.predicted.step_s
        self.simulated_bubble = draft.predicted.bubble_fraction
        self.memory = max(draft.predicted.peak_memory_bytes, default=0.0)



def search(scaled: ScaledCosts, options: PlanOptions, *, say: Status) -> tuple[list[Trial], list[Solved]]:
    """Every allowed combination as a trial (bounded, screened, refined: see the module docstring)."""
    gpus, batch, limit = options.gpus, options.batch, options.memory_limit
    blocks = len(scaled.blocks)
    trials: list[Trial] = []
    pending: list[Trial] = []
    for d in sorted(k for k in range(1, gpus + 1) if gpus % k == 0):
        p = gpus // d
        if (options.pp is not None and p != options.pp) or (options.dp is not None and d != options.dp):
            continue
        choices = options.microbatch_choices(d)
        single = options.schedules[0] if len(options.schedules) == 1 else None
        if not choices:
            split = f"{d} replicas" + (f" x {options.microbatches} micro-batches" if options.microbatches else "")
            trials.append(Trial(p, d, options.microbatches, single, "skipped", f"batch {batch} does not split into {split}"))
            continue
        if p > blocks:
            trials.append(Trial(p, d, options.microbatches, single, "skipped", f"only {blocks} blocks to place"))
            continue
        state = _state_bound(scaled.problem(d, choices[0]), p)
        if limit is not None and state > limit:
            trials.append(Trial(p, d, options.microbatches, single, "infeasible", "state alone", memory=state))
            continue
        for m in choices:
            problem = scaled.problem(d, m)
            bound = _time_bound(problem, p, m)
            pending += [Trial(p, d, m, k, bound=bound, problem=problem) for k in options.schedules]
    trials += pending
    if not trials:
        raise AutopartitionError(
            f"No pp x dp shape fits --gpus {gpus} with the given --pp/--dp; check the numbers."
        )
    _screen(pending, options, say=say)
    _refine(pending, options)
    for t in pending:
        _describe(t, options)
    return trials, [t.solved() for t in pending if t.partition is not None]



def _state_bound(problem: PartitionProblem, stages: int) -> float:
    """Least static bytes (weights, gradients, optimizer state) on the fullest of ``stages`` stages.

    At least the total over the stages (a tied parameter counted once), and at
    least the largest block's own (a block sits whole on one stage).
    """
    total = sum(problem.static_bytes) + sum(held for held, _, _ in problem.shared)
    return max(total / stages, max(problem.static_bytes, default=0.0))



def _time_bound(problem: PartitionProblem, stages: int, microbatches: int) -> float:
    """A lower bound on the closed form ``sum t + (M-1) max t + max all-reduce``: ``T (1 + (M-1)/P)``.

    ``T`` is the blocks' compute per micro-batch: the stage times sum to at least
    ``T`` and the slowest is at least their mean (transfers, recomputation and
    all-reduces only add).
    """
    total = sum(problem.time_s)
    return total * (1 + (microbatches - 1) / stages) + problem.allreduce_latency_s



def _screen(pending: list[Trial], options: PlanOptions, *, say: Status) -> None:
    """Solve each trial with the interval DP, cheapest bound first, until bounds lose to the best found."""
    found: list[float] = []  # closed forms so far, ascending
    announced: set[tuple[int, int]] = set()
    for t in sorted(pending, key=lambda t: t.bound):
        if len(found) >= REFINED_CANDIDATES and t.bound >= found[REFINED_CANDIDATES - 1]:
            t.status = "pruned"
            continue
        if (t.pp, t.dp) not in announced:
            announced.add((t.pp, t.dp))
            say(f"solving {plural(t.pp, 'stage')} x {plural(t.dp, 'replica')}")
        assert t.problem is not None and t.microbatches is not None and t.schedule is not None
        part = solve(t.problem, stages=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                     time_limit=options.time_limit, use_ilp=False)
        if part is None and not is_chain(t.problem):  # another block order may fit: the full solver
            part = solve(t.problem, stages=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                         time_limit=options.time_limit)
        if part is None:
            t.status = "infeasible"
            continue
        t.partition, t.status = part, part.status
        found.append(part.objective)
        found.sort()



def _refine(pending: list[Trial], options: PlanOptions) -> None:
    """Solve the best few screened trials again with the full solver (down-set DP or ILP)."""
    screened = sorted((t for t in pending if t.partition is not None), key=lambda t: _objective(t))
    for t in screened[:REFINED_CANDIDATES]:
        assert t.problem is not None and t.partition is not None and t.microbatches and t.schedule
        if t.partition.status == "optimal":
            continue
        part = solve(t.problem, stages=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                     time_limit=options.time_limit)
        if part is not None and part.objective <= t.partition.objective * (1 + 1e-12):
            t.partition, t.status = part, part.status



def _objective(t: Trial) -> float:
    return t.partition.objective if t.partition is not None else math.inf



def _recompute_of(t: Trial) -> tuple[bool, ...]:
    """The trial's per-stage recomputation: the solver's, else the problem's rule for its split."""
    assert t.problem is not None and t.partition is not None and t.microbatches and t.schedule
    if t.partition.recompute:
        return t.partition.recompute
    return choose_recompute(t.problem, t.partition.stage_of, t.pp, microbatches=t.microbatches, schedule=t.schedule)



def _describe(t: Trial, options: PlanOptions) -> None:
    """Peak memory (needed, where it does not fit) and closed-form bubble of a trial."""
    if t.problem is None or t.microbatches is None or t.schedule is None:
        return
    m, kind = t.microbatches, t.schedule
    if t.partition is not None:
        recompute = _recompute_of(t)
        stage_of = t.partition.stage_of
        t.memory = max(stage_memory(t.problem, stage_of, t.pp, microbatches=m, schedule=kind, recompute=recompute))
        times, _ = stage_costs(t.problem, stage_of, t.pp, recompute=recompute)
        step = t.partition.objective
        t.bubble = max(0.0, 1 - m * sum(times) / (t.pp * step)) if step > 0 else 0.0
    elif t.status == "infeasible":
        # What its fastest split would need, with every stage recomputing where the options allow it.
        lean = dataclasses.replace(t.problem, memory_limit=None,
                                   recompute="none" if options.recompute == "none" else "full")
        part = solve(lean, stages=t.pp, microbatches=m, schedule=kind, use_ilp=False)
        if part is not None:
            t.memory = max(stage_memory(lean, part.stage_of, t.pp, microbatches=m, schedule=kind,
                                        recompute=part.recompute or None))



def best_candidates(trials: list[Trial]) -> list[Solved]:
    """The :data:`SIMULATED_CANDIDATES` best solved trials by closed form (ties: less memory first).

    One stage runs the same actions in the same time under either schedule
    (GPipe only holds more micro-batches): a one-stage twin of a kept trial is skipped.
    """
    kept: list[Trial] = []
    for t in sorted((t for t in trials if t.partition is not None), key=lambda t: (_objective(t), t.memory or 0.0)):
        if t.pp == 1 and any(k.pp == 1 and (k.dp, k.microbatches) == (t.dp, t.microbatches) for k in kept):
            continue
        kept.append(t)
    return [t.solved() for t in kept[:SIMULATED_CANDIDATES]]



def candidate_rows(trials: list[Trial], chosen: Trial, options: PlanOptions) -> tuple[Candidate, ...]:
    """Every trial as a report row, with why it lost to ``chosen`` (or ``chosen``)."""
    rows = []
    order: dict[str | None, int] = {k: i for i, k in enumerate(SCHEDULES)}
    for t in sorted(trials, key=lambda t: (t.dp, t.microbatches or 0, order.get(t.schedule, -1))):
        recomputed = sum(_recompute_of(t)) if t.partition is not None else None
        rows.append(Candidate(
            pp=t.pp, dp=t.dp, step_s=None if t.partition is None else t.partition.objective,
            status=t.status, note=_verdict(t, chosen, options), simulated_s=t.simulated_s,
            microbatches=t.microbatches, schedule=t.schedule, recomputed_stages=recomputed,
            memory_bytes=t.memory, bubble_fraction=t.bubble if t.simulated_bubble is None else t.simulated_bubble,
        ))
    return tuple(rows)



def _verdict(t: Trial, chosen: Trial, options: PlanOptions) -> str:
    """Why ``t`` lost to ``chosen``, in a few words."""
    if t is chosen:
        return "chosen"
    if t.status == "skipped":
        return t.reason
    limit = options.memory_limit or 0.0
    if t.status == "infeasible":
        if t.memory is None:
            return "does not fit"
        what = f"{t.reason} " if t.reason else ""
        return f"does not fit: {what}needs {format_bytes(t.memory)} > {format_bytes(limit)}"
    best = _objective(chosen)
    if t.pp == chosen.pp == 1 and (t.dp, t.microbatches) == (chosen.dp, chosen.microbatches) \
            and _objective(t) == best:
        return "same step: one stage runs either schedule alike"
    if t.status == "pruned":
        return f"slower: at least {percent_more(t.bound, best)} (bound)"
    if t.simulated_s is not None and chosen.simulated_s is not None:
        slower = f"slower: {percent_more(t.simulated_s, chosen.simulated_s)} (simulated)"
        bubble = t.simulated_bubble
    else:
        slower = f"slower: {percent_more(_objective(t), best)} (closed form)"
        bubble = t.bubble
    if t.pp > 1 and bubble is not None and bubble >= 0.1:
        slower += f", bubble {bubble:.0%}"  # the pipeline's idle share, a likely reason
    return slower



def percent_more(value: float, base: float) -> str:
    """``value`` against ``base`` as "+12.3%"."""
    return f"{value / base - 1:+.1%}" if base > 0 else "+inf"



def infeasible_error(scaled: ScaledCosts, options: PlanOptions, trials: list[Trial]) -> AutopartitionError:
    """Why nothing fits, under which assumptions, and what would: GPUs, memory, precision, recomputation."""
    gpus = options.gpus
    if not any(t.status == "infeasible" for t in trials):
        reasons = "; ".join(f"{t.pp}x{t.dp}: {t.reason or t.status}" for t in trials)
        most = len(scaled.blocks)
        return AutopartitionError(
            f"No pp x dp shape can be planned for {gpus} GPUs ({reasons}). The model can be split into at "
            f"most {most} pipeline stages here; use --pp {min(most, gpus)} or fewer (the rest of the GPUs "
            "become data-parallel replicas), and a batch size divisible by replicas x micro-batches."
        )
    # The least memory the options allow: pipeline stages only, the smallest micro-batches, 1F1B.
    m = max(options.microbatch_choices(1) or (options.reference_microbatches,))
    kind: ScheduleKind = "1f1b" if "1f1b" in options.schedules else options.schedules[0]
    most, limit = len(scaled.blocks), options.memory_limit
    stages = min(gpus, most)
    may = "none" if options.recompute == "none" else "auto"  # fits if it fits either way

    def fits(precision: str, recompute: str, p: int = stages) -> bool:
        problem = scaled.problem(1, m, precision=precision, recompute=recompute, gpus_per_node=None)
        return solve(problem, stages=p, microbatches=m, schedule=kind, use_ilp=False) is not None

    lean = scaled.problem(1, m, memory_limit=None, gpus_per_node=None,
                          recompute="none" if options.recompute == "none" else "full")
    relaxed = solve(lean, stages=stages, microbatches=m, schedule=kind, use_ilp=False)
    need_memory = float("nan") if relaxed is None else max(stage_memory(
        lean, relaxed.stage_of, stages, microbatches=m, schedule=kind, recompute=relaxed.recompute or None))
    need_gpus = next((p for p in range(gpus + 1, most + 1) if fits(options.precision, may, p)), None)
    if need_gpus:
        more = f"It would fit on {need_gpus} GPUs as pipeline stages"
    else:
        state = _state_bound(lean, 1)
        more = (f"Even {most} stages (the most this model splits into) do not fit; its weights, gradients and "
                f"optimizer state alone take {format_bytes(state)}, at least "
                f"{math.ceil(state / limit) if limit else 1} GPUs' worth")
    assumed = _assumptions(options, m, kind)
    hints = []
    cheaper = [p for p in ("bf16-mixed", "bf16") if _cheaper(p, options.precision)]
    precision_fix = next((p for p in cheaper if fits(p, may)), None)
    if precision_fix:
        hints.append(f"--precision {precision_fix} it would fit on {gpus} GPUs")
    if options.recompute == "none" and fits(options.precision, "auto"):
        hints.append(f"--recompute auto (or full) it would fit on {gpus} GPUs")
    elif options.recompute == "none" and not precision_fix:
        both = next((p for p in cheaper if fits(p, "auto")), None)
        if both:
            hints.append(f"--precision {both} --recompute auto it would fit on {gpus} GPUs")
    fix = "".join(f" With {hint}." for hint in hints)
    one_f_one_b = "" if "1f1b" in options.schedules else ", use --schedule 1f1b (fewer micro-batches in flight)"
    return InfeasibleError(
        f"No split of the model over {gpus} GPUs fits in {format_bytes(limit or 0)} per GPU "
        f"(parameters, gradients, optimizer state and activations of the micro-batches in flight; {assumed}). "
        f"{more}; with {stages} stages each GPU would need about {format_bytes(need_memory)}.{fix} "
        f"Otherwise add GPUs, raise --memory-per-gpu{one_f_one_b}, or shrink the batch."
    )



def _cheaper(precision: str, than: str) -> bool:
    """True when ``precision`` needs less memory than ``than`` (fp32 > bf16-mixed > bf16)."""
    rank = {"fp32": 2, "bf16-mixed": 1, "bf16": 0}
    return rank[precision] < rank[than]



def _assumptions(options: PlanOptions, microbatches: int, schedule: str) -> str:
    """The settings a memory estimate assumed, in words."""
    per_parameter = static_bytes_per_element(options.precision, options.optimizer_states)
    recompute = {"auto": "recomputation where it helps", "full": "every stage recomputing",
                 "none": "no recomputation"}[options.recompute]
    return (f"{options.precision} with {options.optimizer}, {per_parameter} bytes per parameter; {recompute}; "
            f"{schedule} with {microbatches} micro-batches, the least memory the options allow")
