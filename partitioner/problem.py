"""The numbers the solver sees: blocks in a topological order, their costs and edges.

A :class:`PartitionProblem` is plain data (no torch); :mod:`partitioner.solve`
turns it into a :class:`Partition`.  Costs are per micro-batch, per replica.

Example::

    >>> p = PartitionProblem(time_s=(1.0, 2.0), static_bytes=(0.0, 0.0),
    ...     activation_bytes=(0.0, 0.0), allreduce_s=(0.0, 0.0),
    ...     transfer_s=(0.5, 0.0), edges=((0, 1),))
    >>> step_time(p, (0, 1), microbatches=4)
    (11.0, (1.0, 2.5))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from partitioner.defaults import ScheduleKind

__all__ = [
    "Partition",
    "PartitionProblem",
    "ScheduleKind",
    "check_assignment",
    "in_flight",
    "relative_gap",
    "stage_costs",
    "stage_memory",
    "step_time",
]


@dataclasses.dataclass(frozen=True)
class PartitionProblem:
    """Blocks ``0..N-1`` in a topological order and what each costs.

    * ``time_s[v]``: forward + backward seconds of block v per micro-batch.
    * ``static_bytes[v]``: memory held for the whole step (parameters, gradients,
      optimizer state) for parameters only block v reads.
    * ``activation_bytes[v]``: memory kept for backward per micro-batch in flight.
    * ``allreduce_s[v]``: seconds to all-reduce block v's gradients across replicas.
    * ``transfer_s[u]``: seconds to send block u's output to another stage and its
      gradient back, charged once per receiving stage.
    * ``edges``: ``(u, v)`` with ``u < v``: block v reads block u's output.
      The last block produces the model's output and always sits in the last stage.
    * ``shared``: parameters read by several blocks (tied weights): ``(static_bytes,
      allreduce_s, readers)``; held once by each stage with a reader.
    """

    time_s: tuple[float, ...]
    static_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    transfer_s: tuple[float, ...]
    edges: tuple[tuple[int, int], ...]
    shared: tuple[tuple[float, float, tuple[int, ...]], ...] = ()
    memory_limit: float | None = None
    allreduce_latency_s: float = 0.0  # fixed cost of a stage's first all-reduce bucket (replicas > 1)

    @property
    def size(self) -> int:
        return len(self.time_s)

    def __post_init__(self) -> None:
        n = len(self.time_s)
        for field in ("static_bytes", "activation_bytes", "allreduce_s", "transfer_s"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"{field} has {len(getattr(self, field))} entries, expected {n}")
        for u, v in self.edges:
            if not 0 <= u < v < n:
                raise ValueError(f"edge {(u, v)} is not forward in the block order of {n} blocks")


@dataclasses.dataclass(frozen=True)
class Partition:
    """The solver's answer: a stage for every block, and how good it is."""

    stage_of: tuple[int, ...]
    stages: int
    objective: float  # predicted step seconds (closed form)
    lower_bound: float
    status: Literal["optimal", "feasible"]
    solver: str
    wall_s: float

    @property
    def gap(self) -> float:
        return relative_gap(self.objective, self.lower_bound)


def relative_gap(objective: float, lower_bound: float) -> float:
    """How far ``objective`` may be above the optimum, as a share of it: ``1 - bound / objective``, at least 0.

    The one definition behind :attr:`Partition.gap`, the saved plan's solver gap and the reports.

    >>> round(relative_gap(10.0, 9.0), 6), relative_gap(10.0, 11.0), relative_gap(0.0, 0.0)
    (0.1, 0.0, 0.0)
    """
    return 0.0 if objective <= 0 else max(0.0, 1 - lower_bound / objective)


def in_flight(stage: int, stages: int, microbatches: int, schedule: ScheduleKind) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if schedule == "1f1b":
        return min(microbatches, stages - stage)
    return microbatches


def stage_costs(problem: PartitionProblem, stage_of: Sequence[int], stages: int) -> tuple[list[float], list[float]]:
    """Per-stage time (compute + transfers in) and all-reduce seconds."""
    times = [0.0] * stages
    allreduce = [0.0] * stages
    for v, s in enumerate(stage_of):
        times[s] += problem.time_s[v]
        allreduce[s] += problem.allreduce_s[v]
    received: set[tuple[int, int]] = set()
    for u, v in problem.edges:
        if stage_of[u] != stage_of[v] and (u, stage_of[v]) not in received:
            received.add((u, stage_of[v]))
            times[stage_of[v]] += problem.transfer_s[u]
    for _, seconds, readers in problem.shared:
        for s in {stage_of[r] for r in readers}:
            allreduce[s] += seconds
    return times, allreduce


def stage_memory(
    problem: PartitionProblem,
    stage_of: Sequence[int],
    stages: int,
    *,
    microbatches: int,
    schedule: ScheduleKind,
) -> list[float]:
    """Peak bytes per stage: static state plus activations of the micro-batches in flight."""
    static = [0.0] * stages
    activations = [0.0] * stages
    for v, s in enumerate(stage_of):
        static[s] += problem.static_bytes[v]
        activations[s] += problem.activation_bytes[v]
    for nbytes, _, readers in problem.shared:
        for s in {stage_of[r] for r in readers}:
            static[s] += nbytes
    return [
        static[s] + in_flight(s, stages, microbatches, schedule) * activations[s] for s in range(stages)
    ]


def step_time(
    problem: PartitionProblem, stage_of: Sequence[int], *, microbatches: int
) -> tuple[float, tuple[float, ...]]:
    """Closed-form step time ``sum t + (M-1) max t + max all-reduce`` and the stage times."""
    stages = max(stage_of) + 1
    times, allreduce = stage_costs(problem, stage_of, stages)
    total = sum(times) + (microbatches - 1) * max(times) + max(allreduce) + problem.allreduce_latency_s
    return total, tuple(times)


def check_assignment(problem: PartitionProblem, stage_of: Sequence[int], stages: int) -> str | None:
    """Why an assignment is invalid (precedence, empty stage), or None."""
    if len(stage_of) != problem.size:
        return f"{len(stage_of)} stages given for {problem.size} blocks"
    if sorted(set(stage_of)) != list(range(stages)):
        return f"stages used {sorted(set(stage_of))}, expected every one of 0..{stages - 1}"
    for u, v in problem.edges:
        if stage_of[u] > stage_of[v]:
            return f"edge {u}->{v} goes back from stage {stage_of[u]} to {stage_of[v]}"
    if stage_of[-1] != stages - 1:
        return f"the last block (the model's output) is in stage {stage_of[-1]}, not the last stage"
    return None
