"""The search over pp x dp x micro-batches x schedule: enumerate, bound, screen, refine, and say why each lost.

:func:`search` makes every allowed combination a :class:`Trial`, drops shapes
whose weights and optimizer state alone cannot fit, prunes by the lower bound
``T (1 + (M-1)/pp)`` once it loses to the ``REFINED_CANDIDATES``-th best closed
form, screens the rest with the interval DP and solves the best few again with
the full solver (the steps are described in :mod:`partitioner.search.planner`).

Schedules (:meth:`~partitioner.search.options.PlanOptions.schedule_variants`): each
combination is also a schedule and its stages per pipeline rank (``chunks``).
A chunked one (``interleaved-1f1b``, ``zbv``) is solved for ``pp x chunks``
stages placed by :func:`~partitioner.orders.stage_ranks`, first with
every stage capped at its rank's share of the GPU's memory
(:func:`~partitioner.solve.problem.chunk_memory_limit`: safe whatever moment each
chunk peaks at).  That cap is conservative (a rank's chunks do not peak
together, and the first chunk holds the most micro-batches), so where it
leaves no split, larger caps up to the whole GPU (:data:`CAP_LADDER`) are tried
and the first split whose exact per-rank peak (:func:`~partitioner.solve.problem.rank_memory`,
the schedule's own order walked rank by rank) fits the GPU is kept; that
exact peak is what the row reports, and every split of a chunked schedule,
refined ones included, is held to it.  The solvers
minimise ``sum t + (M-1) max t`` over their stages; for the other schedules they
keep, among the splits they try, the best by the schedule's own closed form
(:func:`~partitioner.solve.problem.step_time`), and the result is marked ``feasible``
with :func:`_time_bound` as its lower bound (the ILP, which optimises the GPipe
form only, is not run for them).  ``zb-h1`` and ``zbv`` are solved without
recomputation (:func:`~partitioner.solve.problem.choose_recompute`).
:func:`best_candidates` picks the ``SIMULATED_CANDIDATES`` the planner simulates;
:func:`candidate_rows` turns every trial into a report row with its verdict, and
:func:`infeasible_error` explains what would fit when nothing does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from partitioner.cost.precision import spans_nodes, static_bytes_per_element
from partitioner.defaults import (
    SCHEDULES,
    schedule_chunks,
    shard_refusal,
    splits_backward,
)
from partitioner.errors import AutopartitionError, InfeasibleError
from partitioner.layout import Layout
from partitioner.orders import rank_orders, stage_ranks
from partitioner.plan import Candidate, Plan
from partitioner.report.table import schedule_label
from partitioner.search.options import PlanOptions, Status
from partitioner.solve.coarsen import pinned_state
from partitioner.solve.formulate import (
    FULL_MODES,
    HSDP,
    HSDP_ZERO3,
    SEARCH_SHARD_MODES,
    ZERO3,
    Zero3Costs,
    mode_parts,
    reshards,
    zero3_costs,
)
from partitioner.solve.ilp import is_chain, solve
from partitioner.solve.problem import (
    Partition,
    PartitionProblem,
    RecomputeMode,
    ScheduleKind,
    StageRecompute,
    choose_recompute,
    chunk_memory_limit,
    rank_memory,
    stage_costs,
    within_limit,
)
from partitioner.solve.scaledcosts import ScaledCosts
from partitioner.units import format_bytes, plural

__all__ = [
    "CAP_LADDER",
    "REFINED_CANDIDATES",
    "SIMULATED_CANDIDATES",
    "TP_SIMULATION_MARGIN",
    "CombinationKey",
    "Pricing",
    "Solved",
    "Trial",
    "best_candidates",
    "candidate_rows",
    "combination_key",
    "infeasible_error",
    "percent_more",
    "priced",
    "rank_in_flight",
    "schedule_problem",
    "search",
]

_CLASSIC: tuple[ScheduleKind, ...] = ("gpipe", "1f1b")  # the schedules the solvers' own closed form describes


SIMULATED_CANDIDATES = 3  # best closed-form combinations that are simulated before choosing



REFINED_CANDIDATES = 4  # best screened combinations solved again by the full solver


# Another tensor-parallel degree's best is simulated only when its closed form comes within this share of the
# best closed form: the closed form and the simulation of one plan differ by a few percent (candidate tables).
TP_SIMULATION_MARGIN = 0.10



# Per-stage caps tried, as powers of the GPU's share (1/chunks), when the share leaves no split of a
# chunked schedule: from the whole GPU down towards the share; the first split that fits exactly wins.
CAP_LADDER = (0.0, 0.25, 0.5, 0.75)




class _Degrees:
    """The layout's degrees read through ``layout`` (:class:`~partitioner.layout.Layout`): a new axis is a
    field there, not here."""

    layout: Layout

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def chunks(self) -> int:
        return self.layout.chunks

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def stages(self) -> int:
        return self.layout.pp * self.layout.chunks


@dataclasses.dataclass(frozen=True)
class Solved(_Degrees):
    """One solved layout x M x schedule x shard combination and the problem it was solved for (reused by the plan).

    ``layout.pp``: pipeline ranks; ``layout.chunks``: stages per rank, so the partition has
    ``pp x chunks`` stages (:attr:`stages`); ``layout.ep``: groups of ep replicas share the experts.
    """

    layout: Layout
    problem: PartitionProblem
    partition: Partition
    microbatches: int
    schedule: ScheduleKind
    shard: str = "none"  # how the stage groups' replicas hold their state (the problem is priced for it)
    # Sharded, one stage per rank: the same combination's DDP problem; a stage group that fits whole under it
    # stays DDP (search.assemble), as a stage keeps its activations where they fit.
    whole: PartitionProblem | None = None
    gathered: float = 0.0  # ZeRO-3: the gathered units' bytes on every rank, beyond its problem's (formulate)



# A combination: (layout: every degree, micro-batches, schedule, shard mode).
CombinationKey = tuple[Layout, int | None, str | None, str]



def combination_key(solved: Solved) -> CombinationKey:
    return (solved.layout, solved.microbatches, solved.schedule, solved.shard)



def schedule_problem(problem: PartitionProblem, schedule: ScheduleKind, pp: int, chunks: int) -> PartitionProblem:
    """The problem as solved for ``schedule`` on ``pp`` ranks x ``chunks`` stages each.

    Several stages per rank: placed by the schedule, each capped at its share
    of the GPU (:func:`~partitioner.solve.problem.chunk_memory_limit`).  A split
    backward: no recomputation (:func:`~partitioner.solve.problem.choose_recompute`).
    GPipe and 1F1B: the problem itself.
    """
    if chunks > 1:
        problem = dataclasses.replace(problem, stage_rank=stage_ranks(schedule, ranks=pp, chunks=chunks),
                                      memory_limit=chunk_memory_limit(problem.memory_limit, chunks),
                                      rank_memory_limit=problem.memory_limit)
    if splits_backward(schedule) and problem.recompute != "none":
        problem = dataclasses.replace(problem, recompute="none")
    return problem



@functools.lru_cache(maxsize=1024)
def rank_in_flight(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Per pipeline rank, the most stage micro-batches (a stage's activations of one micro-batch) it holds.

    >>> rank_in_flight("1f1b", 4, 8), rank_in_flight("interleaved-1f1b", 4, 8, 2), rank_in_flight("zbv", 4, 8, 2)
    ((4, 3, 2, 1), (11, 9, 7, 5), (8, 8, 8, 8))
    """
    frees = "W" if splits_backward(schedule) else "B"
    out = []
    for row in rank_orders(schedule, ranks=pp, microbatches=microbatches, chunks=chunks):
        held = most = 0
        for _, kind, _ in row:
            held += 1 if kind == "F" else -1 if kind == frees else 0
            most = max(most, held)
        out.append(most)
    return tuple(out)



@dataclasses.dataclass(eq=False)
class Trial(_Degrees):
    """One layout x M x schedule combination (M and schedule None: the whole shape) as the search left it."""

    layout: Layout
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
    shard: str = "none"  # the stage groups' shard mode its problem is priced for
    whole: PartitionProblem | None = None  # sharded: the DDP problem its stages fall back to where they fit
    gathered: float = 0.0  # ZeRO-3: the gathered units' bytes on every rank, beyond its problem's (formulate)

    @property
    def key(self) -> CombinationKey:
        return (self.layout, self.microbatches, self.schedule, self.shard)

    def solved(self) -> Solved:
        assert self.problem is not None and self.partition is not None
        assert self.microbatches is not None and self.schedule is not None
        return Solved(self.layout, self.problem, self.partition, self.microbatches, self.schedule, self.shard,
                      self.whole, self.gathered)

    def simulated(self, draft: Plan) -> None:
        """Record the simulation of its draft plan."""
        self.simulated_s = draft.predicted.step_s
        self.simulated_bubble = draft.predicted.bubble_fraction
        self.memory = max(draft.predicted.peak_memory_bytes, default=0.0)



def _shared_state(scaled: ScaledCosts) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], set[int]]:
    """(tied parameters, buffers written in forward) read by several blocks -> those blocks, and the ends:
    the first block reading a parameter and the last block.

    A parameter read by several blocks is tied if a split separates them (by use:
    a layer applied at every depth, a head reading the embedding's weight; or under
    two names).  The last block is always in the last stage, and the first block
    reading a parameter in the first stage (the blocks before it are shape and
    index ops a split does not stand alone).
    """
    captured = scaled.captured
    readers = captured.state_readers(scaled.blocks)
    params = set(captured.parameter_names.values())
    tied = {name: blocks for name, blocks in readers.items() if name in params and len(blocks) > 1}
    written = {b: readers[b] for b in captured.written_buffers() if len(readers.get(b, ())) > 1}
    first = min((b for name, blocks in readers.items() if name in params for b in blocks), default=0)
    return tied, written, {first, len(scaled.blocks) - 1}


def _tied_on_one_rank(tied: dict[str, tuple[int, ...]], kind: str, p: int, v: int, ends: set[int]) -> list[str]:
    """Tied parameters (read by several blocks, under one name or several) that two stages of one pipeline
    rank may hold under this schedule (several stages per rank): fully sharded, that is one parameter in
    two FSDP units, which the runtime refuses (runtime/parallel/shard.py).  Interleaved places the first stage on
    rank 0 and the last on rank P-1, so a parameter read only at the ends (an embedding and its tied
    head) is safe there (should a split still put them on one rank, the runtime refuses it by name)."""
    if v == 1:
        return []
    return sorted(name for name, readers in tied.items()
                  if kind != "interleaved-1f1b" or p == 1 or not set(readers) <= ends)


def _tied_in_one_rank_reason(names: list[str], kind: str) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    where = "the first and last stages on one rank" if kind == "zbv" else "several stages on one rank"
    return (f"{kind} holds {where}, and a tied parameter held by two fully sharded stages of one rank cannot be "
            f"two FSDP units (runtime/shard.py): {shown} {'is' if len(names) == 1 else 'are'} read by several "
            "blocks that such stages may hold")


def _written_buffer_reason(written: dict[str, tuple[int, ...]]) -> str:
    name, blocks = next(iter(sorted(written.items())))
    return (f"the buffer {name} is written in forward and read by {len(blocks)} blocks (a module applied in several "
            "places, e.g. a BatchNorm's running statistics): stages cannot share it, each would update its own copy")


class Pricing(NamedTuple):
    """What one tensor-parallel degree's trials are priced with: its costs (one GPU of a group) and options
    (``options.gpus`` counts its groups, ``options.tp`` is the degree)."""

    scaled: ScaledCosts
    options: PlanOptions


def priced(layout: Layout) -> Layout:
    """The degrees a trial's costs are scaled for, a :class:`Pricing` each (tensor parallelism's; a new axis that
    changes every op's cost joins here): the key of ``pricings``.

    >>> priced(Layout(pp=2, dp=4, tp=2, ep=2))
    Layout(pp=1, dp=1, cp=1, tp=2, ep=1, dp_shard=0, chunks=1)
    """
    return Layout(tp=layout.tp)


def search(pricings: Mapping[Layout, Pricing], *, say: Status) -> tuple[list[Trial], list[Solved]]:
    """Every allowed combination of every degree as a trial, bounded, screened and refined together (see the
    module docstring): ``pricings`` by :func:`priced` degrees, which name each trial's pricing."""
    trials: list[Trial] = []
    pending: list[Trial] = []
    for scaled, options in pricings.values():
        found, waiting = _enumerate(scaled, options)
        trials += found
        pending += waiting
    trials += pending
    if not trials:
        gpus = sum(o.gpus * o.tp for _, o in pricings.values()) // max(1, len(pricings))
        raise AutopartitionError(
            f"No pp x dp shape fits --gpus {gpus} with the given --pp/--dp; check the numbers."
        )
    _screen(pending, pricings, say=say)
    # A sharded twin of a DDP combination that fits without recomputation is not needed (_needs_shard).
    trials = [t for t in trials if t.status != _UNNEEDED]
    pending = [t for t in pending if t.status != _UNNEEDED]
    _refine(pending, pricings)
    for t in pending:
        _describe(t, pricings[priced(t.layout)].options)
    return trials, [t.solved() for t in pending if t.partition is not None]


def _enumerate(scaled: ScaledCosts, options: PlanOptions) -> tuple[list[Trial], list[Trial]]:
    """One degree's combinations: (those decided here, skipped or infeasible; those to screen, bounded)."""
    gpus, batch, limit = options.gpus, options.batch, options.memory_limit
    blocks = len(scaled.blocks)
    tied, written, ends = _shared_state(scaled)
    trials: list[Trial] = []
    pending: list[Trial] = []
    shapes_tried: list[tuple[int, int, int]] = []
    for d in sorted(k for k in range(1, gpus + 1) if gpus % k == 0):
        p = gpus // d
        if (options.pp is not None and p != options.pp) or (options.dp is not None and d != options.dp):
            continue
        degrees = options.ep_choices(d)
        if not degrees:  # a fixed --ep that does not divide these replicas
            trials.append(Trial(_layout(options, p, d), options.microbatches, None, "skipped",
                                f"--ep {options.ep_fixed} does not divide {d} replicas"))
        shapes_tried += [(p, d, e) for e in degrees]
    for p, d, e in shapes_tried:
        # Expert parallelism (cost/experts.py): each degree prices the same shape's state and time its own way.
        sc = scaled.with_ep(e)
        choices = options.microbatch_choices(d)
        single = options.schedules[0] if len(options.schedules) == 1 else None
        shown = e == options.ep_choices(d)[0]  # a reason that holds whatever the degree: one row
        if not choices:
            if not shown:
                continue
            split = f"{d} replicas" + (f" x {options.microbatches} micro-batches" if options.microbatches else "")
            trials.append(Trial(_layout(options, p, d, ep=e), options.microbatches, single, "skipped",
                                f"batch {batch} does not split into {split}"))
            continue
        if p > blocks:
            if not shown:
                continue
            pinned = pinned_state(scaled.captured.graph_module)  # why so few, where a written buffer holds nodes together
            trials.append(Trial(_layout(options, p, d, ep=e), options.microbatches, single, "skipped",
                                f"only {blocks} blocks to place" + (f" ({pinned})" if pinned else "")))
            continue
        shapes = options.schedule_variants(p, blocks)
        # Each shard mode's state bound: a mode whose weights, gradients and optimizer state alone cannot
        # fit takes no part; the shape is infeasible when none fits.
        modes = list(dict.fromkeys(mode for k, _ in shapes for mode in _policies(options, k, d))) or ["none"]
        whole = _state_bound(sc.problem(d, choices[0]), p)
        # Sharding only shrinks the state (cost/precision.py): where DDP's fits, every mode's does.
        # ZeRO-3's gathered units come off its problem's limit (formulate): its state must fit in the rest.
        room = {mode: limit for mode in modes}
        for mode in modes:
            if reshards(mode) and limit is not None:
                room[mode] = limit - zero3_costs(sc.at(choices[0]), dp=d, spec=options.spec,
                                                 precision=options.precision, gpus_per_node=options.gpus_per_node,
                                                 unit=options.zero3_unit, span=mode_parts(mode)[2], ep=e).transient_bytes
        state = {mode: whole if mode == "none" or (room_of := room[mode]) is None or whole <= room_of else
                 _state_bound(sc.problem(d, choices[0], mode), p) for mode in modes}
        fitting = [mode for mode in modes if (room_of := room[mode]) is None or state[mode] <= room_of]
        if not fitting:
            least = min(modes, key=lambda mode: state[mode])
            trials.append(Trial(_layout(options, p, d, ep=e), options.microbatches, single, "infeasible", "state alone",
                                memory=state[least], shard=least))
            continue
        trials += [Trial(_layout(options, p, d, ep=e), options.microbatches, single, "infeasible", "state alone",
                         memory=state[mode], shard=mode) for mode in modes if mode not in fitting]  # one row each: what that mode's state needs
        variants = []
        for k, v in shapes:
            if p * v > blocks:  # whatever the micro-batches: one row for the shape
                trials.append(Trial(_layout(options, p, d, chunks=v, ep=e), options.microbatches, k, "skipped",
                                    f"only {blocks} blocks for {p} x {v} stages"))
            elif written and p * v > 1:
                trials.append(Trial(_layout(options, p, d, chunks=v, ep=e), options.microbatches, k, "skipped",
                                    _written_buffer_reason(written)))
            else:
                variants.append((k, v))
        z3: dict[tuple[int, str], Zero3Costs] = {}  # per micro-batch count and ZeRO-3 mode
        for m in choices:
            problem = sc.problem(d, m)  # DDP's: the bound (compute alone) is every mode's
            for mode in fitting:
                for k, v in variants:
                    if mode not in _policies(options, k, d):
                        continue
                    on_one_rank = _tied_on_one_rank(tied, k, p, v, ends) if mode in FULL_MODES else []
                    if on_one_rank:
                        trials.append(Trial(_layout(options, p, d, chunks=v, ep=e), m, k, "skipped",
                                            _tied_in_one_rank_reason(on_one_rank, k), shard=mode))
                        continue
                    why = _cannot_run(k, p, m, v, blocks)
                    if why:
                        trials.append(Trial(_layout(options, p, d, chunks=v, ep=e), m, k, "skipped", why, shard=mode))
                        continue
                    bound = _time_bound(problem, p, m, schedule=k, chunks=v)
                    if reshards(mode):  # its collectives' least exposure: the bound loses sooner (formulate)
                        z = z3.get((m, mode)) or z3.setdefault((m, mode), zero3_costs(
                            sc.at(m), dp=d, spec=options.spec, precision=options.precision,
                            gpus_per_node=options.gpus_per_node, unit=options.zero3_unit, span=mode_parts(mode)[2],
                            ep=e))
                        bound = _time_bound(problem, p, m, schedule=k, chunks=v, added=sum(z.forward_s)
                                            + sum(z.backward_s) + 2 * p * v * z.first_gather_s)
                    # A sharded trial's problem is formulated when it is screened (most are not needed).
                    own = schedule_problem(problem, k, p, v) if mode == "none" else None
                    pending.append(Trial(_layout(options, p, d, chunks=v, ep=e), m, k, bound=bound, problem=own,
                                         shard=mode))
    return trials, pending



def _layout(options: PlanOptions, pp: int, dp: int, *, chunks: int = 1, ep: int = 1) -> Layout:
    """A trial's degrees: its shape, the tensor-parallel degree this search prices, its chunks and experts."""
    return Layout(pp=pp, dp=dp, tp=options.tp, chunks=chunks, ep=ep)


def _same_split(a: Trial, b: Trial) -> bool:
    """The same pipeline, replicas, micro-batches and schedule (shard mode and expert degree aside)."""
    return (a.pp, a.dp, a.chunks, a.microbatches, a.schedule) == (b.pp, b.dp, b.chunks, b.microbatches, b.schedule)


def _policies(options: PlanOptions, schedule: ScheduleKind, dp: int) -> tuple[str, ...]:
    """The shard modes tried for ``schedule`` on ``dp`` replicas, ZeRO-3 among them (:data:`ZERO3`).

    ZeRO-3 is ``full`` with ``reshard_after_forward``: tried wherever ``full`` may run
    (:meth:`~partitioner.search.options.PlanOptions.shard_modes`' footprint filter aside,
    which prices per step what ZeRO-3 moves per micro-batch, mostly behind compute), except
    under a split backward, whose W the runtime cannot reduce per backward (runtime/parallel/shard.py).
    """
    modes = options.shard_modes(schedule, dp)
    if dp > 1 and options.shard in ("auto", "full", ZERO3) and not splits_backward(schedule) \
            and shard_refusal(schedule, "full") is None:
        modes = (*modes, ZERO3)
    if not spans_nodes(dp, options.gpus_per_node):  # the group fits a node: one span
        return modes
    node = {"full": HSDP, ZERO3: HSDP_ZERO3}
    if options.shard_span == "node":
        return tuple(node.get(m, m) for m in modes)
    if options.shard_span == "auto":
        return (*modes, *(node[m] for m in modes if m in node))
    return modes


def _state_bound(problem: PartitionProblem, stages: int) -> float:
    """Least static bytes (weights, gradients, optimizer state) on the fullest of ``stages`` stages.

    At least the total over the stages (a tied parameter counted once), and at
    least the largest block's own (a block sits whole on one stage).
    """
    total = sum(problem.static_bytes) + sum(held for held, _, _ in problem.shared)
    return max(total / stages, max(problem.static_bytes, default=0.0))



def _cannot_run(schedule: ScheduleKind, pp: int, microbatches: int, chunks: int, blocks: int) -> str:
    """Why ``schedule`` cannot run on ``pp`` ranks x ``chunks`` stages with these micro-batches (empty: it can)."""
    if pp * chunks > blocks:
        return f"only {blocks} blocks for {pp} x {chunks} stages"
    if schedule == "interleaved-1f1b" and microbatches % pp:
        return f"interleaved-1f1b needs a multiple of {pp} micro-batches"
    return ""



def _time_bound(
    problem: PartitionProblem, stages: int, microbatches: int, *, schedule: ScheduleKind = "gpipe", chunks: int = 1,
    added: float = 0.0,
) -> float:
    """A lower bound on the schedule's closed form (:func:`~partitioner.solve.problem.step_time`) over ``stages`` ranks.

    ``T`` is the blocks' compute per micro-batch: the stage times sum to at least
    ``T`` and the slowest rank holds at least their mean (transfers,
    recomputation and all-reduces only add).  GPipe and 1F1B: ``T (1 + (M-1)/P)``;
    interleaved: ``T (M + (P-1)/v) / P``; ZB-H1 and ZB-V: ``T M / P``.  ``added``: seconds
    per micro-batch the stages pay on top of their blocks whatever the split (ZeRO-3's
    exposed collectives: each block's, and a first unit's all-gather per forward and backward of each stage).
    """
    total = sum(problem.time_s) + added
    if schedule in _CLASSIC:
        return total * (1 + (microbatches - 1) / stages) + problem.allreduce_latency_s
    extra = (stages - 1) / chunks if schedule == "interleaved-1f1b" else 0.0
    return total * (microbatches + extra) / stages + problem.allreduce_latency_s



# A sharded trial left out: its DDP twin fits without recomputation (dropped from the rows).
_UNNEEDED = "unneeded"



def _needs_shard(t: Trial, by_key: dict[CombinationKey, Trial]) -> bool:
    """Is sharding worth solving for ``t``: its DDP twin (and, ZeRO-3, its kept-gathered twin) does not fit,
    or fits only by recomputing?

    The rule :func:`~partitioner.solve.problem.choose_recompute` applies to
    activations, applied to the replicas' state: keep it whole (DDP, whose
    bucketed all-reduce overlaps the last backward) where that fits, shard
    where it does not (or where only recomputation made it fit).  A
    ``--shard`` given explicitly is always solved (its trials have no twin).
    """
    if t.shard == "none":
        return True
    # ZeRO-3 against its kept-gathered twin as well: it only holds less (cost/precision.py), at the price
    # of collectives every micro-batch, so it is worth solving only where that twin needs more memory.
    twins = {ZERO3: ("none", "full"), HSDP: ("none",), HSDP_ZERO3: ("none", HSDP)}
    for other in twins.get(t.shard, ("none",)):
        twin = by_key.get((t.layout, t.microbatches, t.schedule, other))
        if twin is not None and twin.status == "pruned":
            return False  # the same bound: pruned alike, one row says so
        if twin is not None and twin.partition is not None and not any(_recompute_of(twin)):
            return False  # the twin fits as it is
    return True



def _screen(pending: list[Trial], pricings: Mapping[Layout, Pricing], *, say: Status) -> None:
    """Solve each trial with the interval DP, cheapest bound first, until bounds lose to the best found
    (of any degree: one screen for every axis).

    A trial's DDP twin is screened before its sharded ones (equal bounds; "none"
    first), which are solved only where it needs them (:func:`_needs_shard`).
    """
    found: dict[Layout, list[float]] = {}  # per degree (priced), the closed forms so far, ascending
    announced: set[Layout] = set()
    by_key = {t.key: t for t in pending}
    order: dict[str, int] = {mode: i for i, mode in enumerate(SEARCH_SHARD_MODES)}
    for t in sorted(pending, key=lambda t: (t.bound, order.get(t.shard, 0))):
        if not _needs_shard(t, by_key):
            t.status = _UNNEEDED
            continue
        key = priced(t.layout)
        mine = found.setdefault(key, [])
        other = min((f[0] for k, f in found.items() if f and k != key), default=None)
        if (len(mine) >= REFINED_CANDIDATES and t.bound >= mine[REFINED_CANDIDATES - 1]) or (
                other is not None and t.bound > other * (1 + TP_SIMULATION_MARGIN)):
            t.status = "pruned"  # loses to its degree's best four, or to another degree's best by the margin
            continue
        scaled, options = pricings[priced(t.layout)]
        if t.problem is None:
            assert t.microbatches is not None and t.schedule is not None
            sc = scaled.with_ep(t.ep)
            t.problem = schedule_problem(sc.problem(t.dp, t.microbatches, t.shard), t.schedule, t.pp, t.chunks)
            # --shard auto, one stage per rank (several share its memory: one mode for them all).
            if options.shard == "auto" and t.chunks == 1:
                t.whole = schedule_problem(sc.problem(t.dp, t.microbatches), t.schedule, t.pp, t.chunks)
            if reshards(t.shard):
                o = options
                t.gathered = zero3_costs(scaled.at(t.microbatches), dp=t.dp, spec=o.spec, precision=o.precision,
                                         gpus_per_node=o.gpus_per_node, unit=options.zero3_unit, span=mode_parts(t.shard)[2],
                                         ep=t.ep).transient_bytes
        shape = dataclasses.replace(t.layout, ep=1, chunks=1)
        if shape not in announced:
            announced.add(shape)
            tp = f" x tp {t.layout.tp}" if t.layout.tp > 1 else ""
            say(f"solving {plural(t.pp, 'stage')} x {plural(t.dp, 'replica')}{tp}")
        assert t.problem is not None and t.microbatches is not None and t.schedule is not None
        part = _solve_screen(t, t.problem, options)
        if part is None and t.chunks > 1:
            part = _solve_larger_caps(t, options)
        if part is None:
            t.status = "infeasible"
            continue
        if t.schedule not in _CLASSIC:
            # The solvers' bounds and proofs are for the GPipe form: for this schedule's own form
            # the split is a good one, not a proven optimum; the bound is the schedule's.
            part = dataclasses.replace(part, status="feasible", lower_bound=min(part.objective, t.bound))
        t.partition, t.status = part, part.status
        mine.append(part.objective)
        mine.sort()



def _solve_screen(t: Trial, problem: PartitionProblem, options: PlanOptions) -> Partition | None:
    """The interval DP's split, or the full solver's where the block order admits others."""
    assert t.microbatches is not None and t.schedule is not None
    part = solve(problem, stages=t.stages, microbatches=t.microbatches, schedule=t.schedule,
                 time_limit=options.time_limit, use_ilp=False)
    if part is None and not is_chain(problem):  # another block order may fit: the full solver
        part = solve(problem, stages=t.stages, microbatches=t.microbatches, schedule=t.schedule,
                     time_limit=options.time_limit)
    return part



def _solve_larger_caps(t: Trial, options: PlanOptions) -> Partition | None:
    """A chunked trial's split under a per-stage cap above the GPU's share whose ranks fit exactly, or None.

    Caps from the whole GPU down (:data:`CAP_LADDER`); the first split whose every
    rank's exact peak fits is kept, and the trial's problem takes that cap (so
    refinement keeps to it, besides the exact per-rank check).
    """
    assert t.problem is not None and t.microbatches is not None and t.schedule is not None
    limit = t.problem.rank_memory_limit
    if limit is None:
        return None
    for power in CAP_LADDER:
        problem = dataclasses.replace(t.problem, memory_limit=limit * (1 / t.chunks) ** power)
        part = _solve_screen(t, problem, options)
        if part is None:
            return None  # a smaller cap admits no more splits than this one
        if all(within_limit(m, limit) for m in rank_memory(
                problem, part.stage_of, t.stages, microbatches=t.microbatches, schedule=t.schedule,
                recompute=part.recompute or None)):
            t.problem = problem
            return part
    return None



def _refine(pending: list[Trial], pricings: Mapping[Layout, Pricing]) -> None:
    """Solve the best few screened trials again with the full solver (down-set DP or ILP).

    Sharded trials keep the interval DP's split: their per-stage collectives make the ILP of a
    large model run into its time limit (10 s each at 70B, and a result that then depends on
    how busy the machine is); the simulation-guided refinement still moves their cuts.
    """
    screened = sorted((t for t in pending if t.partition is not None), key=lambda t: _objective(t))
    counted: dict[Layout, int] = {}  # the best few of each degree (priced)
    for t in screened:
        counted[priced(t.layout)] = seen = counted.get(priced(t.layout), 0) + 1
        if seen > REFINED_CANDIDATES:
            continue
        assert t.problem is not None and t.partition is not None and t.microbatches and t.schedule
        if t.partition.status == "optimal" or t.schedule not in _CLASSIC:  # the ILP knows the GPipe form only
            continue
        if t.shard != "none":
            continue
        part = solve(t.problem, stages=t.pp, microbatches=t.microbatches, schedule=t.schedule,
                     time_limit=pricings[priced(t.layout)].options.time_limit)
        if part is not None and part.objective <= t.partition.objective * (1 + 1e-12):
            t.partition, t.status = part, part.status



def _objective(t: Trial) -> float:
    return t.partition.objective if t.partition is not None else math.inf



def _recompute_of(t: Trial) -> tuple[StageRecompute, ...]:
    """The trial's per-stage recomputation: the solver's, else the problem's rule for its split."""
    assert t.problem is not None and t.partition is not None and t.microbatches and t.schedule
    if t.partition.recompute:
        return t.partition.recompute
    return choose_recompute(t.problem, t.partition.stage_of, t.stages, microbatches=t.microbatches, schedule=t.schedule)



def _describe(t: Trial, options: PlanOptions) -> None:
    """Peak memory (needed, where it does not fit) and closed-form bubble of a trial."""
    if t.problem is None or t.microbatches is None or t.schedule is None:
        return
    m, kind = t.microbatches, t.schedule
    if t.partition is not None:
        recompute = _recompute_of(t)
        stage_of = t.partition.stage_of
        t.memory = t.gathered + max(rank_memory(t.problem, stage_of, t.stages, microbatches=m, schedule=kind,
                                                recompute=recompute))
        times, _ = stage_costs(t.problem, stage_of, t.stages, recompute=recompute)
        step = t.partition.objective
        t.bubble = max(0.0, 1 - m * sum(times) / (t.pp * step)) if step > 0 else 0.0
    elif t.status == "infeasible":
        # What its fastest split would need, with every stage recomputing where the options and the schedule allow.
        may: RecomputeMode = "none" if options.recompute == "none" or splits_backward(kind) else "full"
        lean = dataclasses.replace(t.problem, memory_limit=None, recompute=may)
        part = solve(lean, stages=t.stages, microbatches=m, schedule=kind, use_ilp=False)
        if part is not None:
            t.memory = t.gathered + max(rank_memory(lean, part.stage_of, t.stages, microbatches=m, schedule=kind,
                                       recompute=part.recompute or None))
        t.reason = _memory_reason(t, options)



def _memory_reason(t: Trial, options: PlanOptions) -> str:
    """What makes an infeasible trial's schedule hungrier than 1F1B, in a few words (or its old reason).

    Activations are counted in micro-batches of a whole rank's layers: a chunk of
    ``1/v`` of them counts ``1/v``.
    """
    if t.reason or t.microbatches is None or t.schedule is None or t.schedule in _CLASSIC:
        return t.reason
    held = [h / t.chunks for h in rank_in_flight(t.schedule, t.pp, t.microbatches, t.chunks)]
    plain = [min(t.microbatches, t.pp - r) for r in range(t.pp)]  # 1F1B: P - r on rank r
    what = (f"{schedule_label(t.schedule, t.chunks)} keeps {_counts(held)} micro-batches' activations per "
            f"pipeline rank at its peak, 1F1B {_counts(plain)}")
    if splits_backward(t.schedule) and options.recompute != "none":
        what += "; no recomputation with a split backward"
    return what



def _counts(values: Sequence[float]) -> str:
    """Per-rank counts, short: ``5, 4.5, 4, 3.5`` (at most 4 shown).

    >>> _counts([2.5, 2.0]), _counts([8.0, 7.0, 6.0, 5.0, 4.0])
    ('2.5, 2', '8, 7, 6, 5, ...')
    """
    shown = ", ".join(f"{v:.3g}" for v in values[:4])
    return shown + (", ..." if len(values) > 4 else "")



def best_candidates(trials: list[Trial]) -> list[Solved]:
    """For each degree of :func:`priced` (tensor parallelism) whose best closed form comes within
    :data:`TP_SIMULATION_MARGIN` of the best of all, best first: its :data:`SIMULATED_CANDIDATES` best solved
    trials by closed form (ties: less memory first), then, for the best degree, the best of its every other
    schedule (with its chunks) that has a solved trial.

    The first ones are refined in simulation and compete for the plan; the
    others are simulated too (and may still win), so that the candidate table
    says what each schedule tried predicts in simulation, not only in closed form.
    One stage runs the same actions in the same time under either schedule
    (GPipe only holds more micro-batches): a one-stage twin of a kept trial is skipped, and so is
    another shard mode of a kept layout, or a second ZeRO-3 trial, among the refined ones.  A degree
    further off is not simulated at all: the simulation moves a plan by a few percent, not by that.
    """
    ordered = sorted((t for t in trials if t.partition is not None), key=lambda t: (_objective(t), t.memory or 0.0))
    if not ordered:
        return []
    kept: list[Trial] = []
    for key in dict.fromkeys(priced(t.layout) for t in ordered):
        mine = [t for t in ordered if priced(t.layout) == key]
        if _objective(mine[0]) <= _objective(ordered[0]) * (1 + TP_SIMULATION_MARGIN):
            kept += _best_of(mine, every_schedule=not kept)
    return [t.solved() for t in kept]


def _best_of(ordered: list[Trial], *, every_schedule: bool) -> list[Trial]:
    """:func:`best_candidates` within one degree's trials (``ordered`` by closed form)."""
    kept: list[Trial] = []
    for t in ordered:
        if t.pp == 1 and any(k.pp == 1 and (k.dp, k.microbatches, k.shard) == (t.dp, t.microbatches, t.shard)
                             for k in kept):
            continue
        # One refined slot per layout (its shard modes' closed forms differ by little and refine alike), and
        # one for ZeRO-3's several layouts: the closed form ranks splits only roughly, so the slots go to
        # different layouts (refinement, not the closed form, found 70B/64's best plan).
        if any(_same_split(k, t) or (k.shard == t.shard and reshards(t.shard)) for k in kept):
            continue
        kept.append(t)
        if len(kept) == SIMULATED_CANDIDATES:
            break
    shown = {(t.schedule, t.chunks) for t in kept} if every_schedule else set()
    for t in ordered if every_schedule else ():
        if (t.schedule, t.chunks) not in shown and t.pp > 1:
            kept.append(t)
            shown.add((t.schedule, t.chunks))
    return kept



def candidate_rows(trials: list[Trial], chosen: Trial, options: PlanOptions) -> tuple[Candidate, ...]:
    """Every trial as a report row, with why it lost to ``chosen`` (or ``chosen``)."""
    rows = []
    order: dict[str | None, int] = {k: i for i, k in enumerate(SCHEDULES)}
    modes: dict[str, int] = {mode: i for i, mode in enumerate(SEARCH_SHARD_MODES)}
    for t in sorted(trials, key=lambda t: (t.dp, t.ep, t.microbatches or 0, order.get(t.schedule, -1), t.chunks,
                                           modes.get(t.shard, -1))):
        recomputed = sum(1 for r in _recompute_of(t) if r) if t.partition is not None else None
        fields: dict[str, Any] = {
            "pp": t.pp, "dp": t.dp, "step_s": None if t.partition is None else t.partition.objective,
            "status": t.status, "note": _verdict(t, chosen, options), "simulated_s": t.simulated_s,
            "microbatches": t.microbatches, "schedule": t.schedule, "recomputed_stages": recomputed,
            "memory_bytes": t.memory,
            "bubble_fraction": t.bubble if t.simulated_bubble is None else t.simulated_bubble,
            "chunks": t.chunks, "shard": t.shard, "ep": t.ep,
        }
        rows.append(Candidate(**{k: v for k, v in fields.items() if k in _CANDIDATE_FIELDS}))
    return tuple(rows)


# Until the plan's Candidate records chunks, pass the fields it has (the label then shows the schedule alone).
_CANDIDATE_FIELDS = frozenset(f.name for f in dataclasses.fields(Candidate))



def _verdict(t: Trial, chosen: Trial, options: PlanOptions) -> str:
    """Why ``t`` lost to ``chosen``, in a few words."""
    if t is chosen:
        return "chosen"
    if t.status == "skipped":
        return t.reason
    limit = options.memory_limit or 0.0
    if t.status == "infeasible":
        if t.memory is None:
            return "does not fit" + (f" ({t.reason})" if t.reason else "")
        if t.reason == "state alone":
            return f"does not fit: {t.reason} needs {format_bytes(t.memory)} > {format_bytes(limit)}"
        why = f" ({t.reason})" if t.reason else ""
        if t.memory <= limit:  # its leanest split fits, but none the solver tried under its caps did
            return f"does not fit: no split found within {format_bytes(limit)} (the leanest needs " \
                   f"{format_bytes(t.memory)}){why}"
        return f"does not fit: needs {format_bytes(t.memory)} > {format_bytes(limit)}{why}"
    best = _objective(chosen)
    if t.pp == chosen.pp == 1 and (t.dp, t.microbatches, t.shard) == (chosen.dp, chosen.microbatches, chosen.shard) \
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
    shared = next((t.reason for t in trials if t.status == "skipped" and "is written in forward" in (t.reason or "")),
                  None)
    tied = next((t.reason for t in trials if t.status == "skipped" and "two FSDP units" in (t.reason or "")), None)
    if (shared or tied) and all(t.status in ("skipped", "pruned") for t in trials):
        return AutopartitionError(
            f"No plan for {gpus} GPUs splits this model into stages: {shared}. Plan it with --pp 1 (data-parallel "
            "replicas only), or give each place its own module (copy.deepcopy) or no running statistics "
            "(track_running_stats=False)." if shared else
            f"No plan for {gpus} GPUs: {tied}. Use --shard optimizer or none with that schedule, or a schedule "
            "with one stage per rank (--schedule 1f1b, gpipe or zb-h1)."
        )
    unordered = sorted({schedule_label(t.schedule, t.chunks) for t in trials
                        if t.status == "skipped" and "cannot order" in (t.reason or "")})
    if unordered and all(t.status in ("skipped", "pruned") for t in trials):
        first = next(t.reason for t in trials if t.status == "skipped" and "cannot order" in (t.reason or ""))
        return AutopartitionError(
            f"No plan for {gpus} GPUs: {' and '.join(unordered)} could not order the messages of any split "
            "found. Use --schedule 1f1b or gpipe (one stage per rank, whole backward: these order any "
            f"split), or --schedule auto to let the planner choose. First refusal: {first}"
        )
    if not any(t.status == "infeasible" for t in trials):
        reasons = "; ".join(dict.fromkeys(f"{t.pp}x{t.dp}: {t.reason or t.status}" for t in trials))
        most = len(scaled.blocks)
        chunked = any(t.chunks > 1 for t in trials)
        return AutopartitionError(
            f"No pp x dp shape can be planned for {gpus} GPUs ({reasons}). The model can be split into at "
            f"most {most} stages here" + (" (pp x chunks with several stages per pipeline rank)" if chunked else "")
            + f"; use --pp {min(most, gpus)} or fewer (the rest of the GPUs become data-parallel replicas)"
            + (", fewer --chunks" if chunked else "") + ", and a batch size divisible by replicas x micro-batches."
        )
    # The least memory the options allow: pipeline stages only, the smallest micro-batches, 1F1B.
    m = max(options.microbatch_choices(1) or (options.reference_microbatches,))
    kind: ScheduleKind = "1f1b" if "1f1b" in options.schedules else options.schedules[0]
    v = options.chunks if kind == "interleaved-1f1b" and options.chunks else schedule_chunks(kind)
    most, limit = len(scaled.blocks), options.memory_limit
    stages = max(1, min(gpus, most // v))  # pipeline ranks
    may = "none" if options.recompute == "none" else "auto"  # fits if it fits either way

    def fits(precision: str, recompute: str, p: int = stages) -> bool:
        if _cannot_run(kind, p, m, v, most):
            return False
        problem = scaled.problem(1, m, precision=precision, recompute=recompute, gpus_per_node=None)
        return solve(schedule_problem(problem, kind, p, v), stages=p * v, microbatches=m, schedule=kind,
                     use_ilp=False) is not None

    lean = scaled.problem(1, m, memory_limit=None, gpus_per_node=None,
                          recompute="none" if options.recompute == "none" else "full")
    relaxed = None
    if not _cannot_run(kind, stages, m, v, most):
        lean = schedule_problem(lean, kind, stages, v)
        relaxed = solve(lean, stages=stages * v, microbatches=m, schedule=kind, use_ilp=False)
    need_memory = float("nan") if relaxed is None else max(rank_memory(
        lean, relaxed.stage_of, stages * v, microbatches=m, schedule=kind, recompute=relaxed.recompute or None))
    need_gpus = next((p for p in range(gpus + 1, most // v + 1) if fits(options.precision, may, p)), None)
    if need_gpus:
        more = f"It would fit on {need_gpus} GPUs as pipeline stages"
    else:
        state = _state_bound(lean, 1)
        more = (f"Even {most // v} stages (the most this model splits into) do not fit; its weights, gradients and "
                f"optimizer state alone take {format_bytes(state)}, at least "
                f"{math.ceil(state / limit) if limit else 1} GPUs' worth")
    assumed = _assumptions(options, m, schedule_label(kind, v))
    hints = []
    cheaper = [p for p in ("bf16-mixed", "bf16") if _cheaper(p, options.precision)]
    precision_fix = next((p for p in cheaper if fits(p, may)), None)
    if precision_fix:
        hints.append(f"--precision {precision_fix} it would fit on {gpus} GPUs")
    if options.shard == "none" and gpus > 1:
        hints.append("--shard auto (optimizer state or everything sharded across a stage's replicas) the "
                     "replicas' state may fit")
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
    """True when ``precision`` needs less memory than ``than`` (fp32 > bf16-mixed > fp8 > bf16).

    fp8 holds bf16-mixed's state and saves its FP8 matmuls' inputs in 1 byte: less than bf16-mixed, more than bf16.
    """
    rank = {"fp32": 3, "bf16-mixed": 2, "fp8": 1, "bf16": 0}
    return rank[precision] < rank[than]



def _assumptions(options: PlanOptions, microbatches: int, schedule: str) -> str:
    """The settings a memory estimate assumed, in words."""
    per_parameter = static_bytes_per_element(options.precision, options.optimizer_states)
    recompute = {"auto": "recomputation where it helps", "full": "every stage recomputing",
                 "none": "no recomputation"}[options.recompute]
    return (f"{options.precision} with {options.optimizer}, {per_parameter} bytes per parameter; {recompute}; "
            f"{schedule} with {microbatches} micro-batches, the least memory the options allow")
