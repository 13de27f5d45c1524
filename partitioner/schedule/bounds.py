"""What no step of a plan can beat: each GPU's compute at peak, and each link's bytes over its bandwidth.

Overlap hides communication behind compute, never below either bound
(issue 30): a plan's predicted step is at least

* **compute**: the busiest GPU's FLOPs per step (its stages' forward, backward
  and recomputed forward, ``StagePrediction.peak_s`` per micro-batch: each op at
  the peak of its dtype) run at peak;
* **links**, for each link a GPU uses: the bytes it must send (or receive, the
  larger) through it per step over its bandwidth, as the datasheet gives it
  (no efficiency, no latency):

  - **inter-node ports** (one per GPU): the boundary tensors it sends to and
    receives from stages on other nodes (activations forward, their gradients
    back, ``1/tp`` each under sequence parallelism), and its share of its stage
    group's collectives that cross nodes.  A group with ``k`` members on every
    node it spans (``N`` nodes, ``D = N k`` replicas) moves at least
    ``(D - k) / D`` of a gathered or reduced tensor in or out of each node, through
    its ``k`` ports (:func:`partitioner.cost.comm.ring_link`): per port
    ``(D - k) / (D k)`` of it per all-gather or reduce-scatter, twice that per
    all-reduce.  Sharded over one node's replicas (HSDP, ``shard_span`` "node")
    only the shards' gradients cross nodes (an all-reduce of ``G / k`` over
    ``N``, one member per node per ring, each on its own port);
  - **NVLink**: the same for boundaries and collectives that stay inside a
    node.  Tensor-parallel collectives are not counted here: they are priced
    inside each stage's forward and backward, where no compute hides them.

  Per step, per stage group of ``D > 1`` replicas (``W``, ``G``, ``C``: a
  parameter's weight as held, gradient as reduced, weight as gathered;
  :mod:`partitioner.cost.precision`): DDP all-reduces ``G``; ZeRO-1 all-reduces
  ``G`` and gathers ``W``; ``full`` kept gathered reduce-scatters ``G`` and
  gathers ``C`` once; ZeRO-3 gathers ``C`` twice and reduce-scatters ``G`` every
  micro-batch; ``C`` counts the weights FSDP2 gathers as FP8 casts (tensorwise
  fp8) at 1 byte per element.  (The all-reduce of a parameter tied across pipeline ranks is left
  out: the plan does not record each parameter's size.)

:func:`step_bounds` reads only the plan; the simulator holds every rank's step
to its links (:func:`rank_link_seconds`), and the planner checks each plan it
emits against :func:`step_bounds` (``search/assemble.py``).

Example (the two-stage plan of ``example_plan``: one node, no replicas)::

    >>> from partitioner.plan import example_plan
    >>> b = step_bounds(example_plan())
    >>> b.compute_s, sorted(b.links_s)
    (0.0, ['NVLink'])
    >>> b.describe()
    'compute bound 0 s, link bound 64.0 ns (NVLink)'
"""

from __future__ import annotations

import dataclasses

from partitioner.cost.comm import members_per_node, node_of
from partitioner.cost.precision import (
    activation_scale,
    fp8_gather_saving,
    gradient_bytes,
    weight_bytes,
)
from partitioner.plan import Plan, StagePlan
from partitioner.units import format_seconds

__all__ = ["INTER", "INTRA", "StepBounds", "rank_link_bytes", "rank_link_seconds", "step_bounds"]

INTER = "inter-node ports"
INTRA = "NVLink"


@dataclasses.dataclass(frozen=True)
class StepBounds:
    """The least step a plan can take: its busiest GPU's compute at peak, and each link's bytes over bandwidth."""

    compute_s: float
    links_s: dict[str, float]  # link name -> the busiest GPU's seconds on it

    @property
    def link_s(self) -> float:
        return max(self.links_s.values(), default=0.0)

    @property
    def lower_s(self) -> float:
        """The larger bound: no predicted step may be shorter."""
        return max(self.compute_s, self.link_s)

    @property
    def binding(self) -> str:
        """Which bound is the larger: ``compute`` or a link's name."""
        if not self.links_s or self.compute_s >= self.link_s:
            return "compute"
        return max(self.links_s, key=lambda k: self.links_s[k])

    def describe(self) -> str:
        """``compute bound X s, link bound Y s (name)``: the report's line."""
        link = max(self.links_s, key=lambda k: self.links_s[k]) if self.links_s else "none"
        return f"compute bound {format_seconds(self.compute_s)}, link bound {format_seconds(self.link_s)} ({link})"


def step_bounds(plan: Plan) -> StepBounds:
    """The compute and link bounds of ``plan``'s step (module docstring)."""
    ranks = range(plan.pp)
    compute = max((plan.microbatches * sum(st.predicted.peak_s for st in plan.stages if st.rank == r)
                   for r in ranks), default=0.0)
    per_rank = rank_link_bytes(plan)
    bandwidth = _bandwidths(plan)
    links: dict[str, float] = {}
    for moved in per_rank:
        for name, (out, into) in moved.items():
            links[name] = max(links.get(name, 0.0), max(out, into) / bandwidth[name])
    return StepBounds(compute, links)


def rank_link_seconds(plan: Plan) -> list[float]:
    """Per pipeline rank, the seconds its busiest link needs for the step's bytes (the simulator's floor)."""
    bandwidth = _bandwidths(plan)
    return [max((max(out, into) / bandwidth[name] for name, (out, into) in moved.items()), default=0.0)
            for moved in rank_link_bytes(plan)]


def rank_link_bytes(plan: Plan) -> list[dict[str, tuple[float, float]]]:
    """Per pipeline rank, per link: (bytes one of its GPUs sends, bytes it receives) through it per step."""
    moved: list[dict[str, list[float]]] = [{} for _ in range(max(plan.pp, *(st.rank + 1 for st in plan.stages)))]

    def add(rank: int, name: str, out: float, into: float) -> None:
        pair = moved[rank].setdefault(name, [0.0, 0.0])
        pair[0] += out
        pair[1] += into

    m, tp = plan.microbatches, plan.tp
    for st in plan.stages:
        for b in st.outputs:
            if not 0 <= b.target < len(plan.stages):
                continue  # a hand-made plan's dangling boundary: plan.json's checks refuse those on load
            target = plan.stages[b.target]
            if target.rank == st.rank:
                continue  # handed over in memory
            nbytes = m * b.nbytes * activation_scale(plan.precision, b.dtype) / tp
            name = INTER if b.link == "inter" else INTRA
            add(st.rank, name, nbytes, nbytes)  # activations out, their gradients back in
            add(target.rank, name, nbytes, nbytes)
        if plan.dp > 1:
            for name, nbytes in _group_bytes(plan, st).items():
                add(st.rank, name, nbytes, nbytes)  # a ring sends as much as it receives
    return [{k: (v[0], v[1]) for k, v in per.items()} for per in moved]


def _bandwidths(plan: Plan) -> dict[str, float]:
    cm = plan.cost_model
    inter = cm.inter_node_bandwidth if cm.inter_node_bandwidth is not None else cm.link_bandwidth
    return {INTER: inter, INTRA: cm.link_bandwidth}


def _elements(plan: Plan, st: StagePlan) -> float:
    per_element = plan.model.parameter_bytes / plan.model.parameters if plan.model.parameters else 4.0
    return st.predicted.parameter_bytes / per_element


def _group_bytes(plan: Plan, st: StagePlan) -> dict[str, float]:
    """Bytes one GPU of ``st``'s replica group moves through each link per step for the group's collectives."""
    nbytes = st.predicted.parameter_bytes
    elements = _elements(plan, st)
    g = gradient_bytes(plan.precision, elements=elements, model_bytes=nbytes)
    d = plan.dp
    per_node = plan.group_gpus_per_node
    first = st.ranks[0]
    crosses = node_of(first, per_node) != node_of(first + d - 1, per_node)
    k = members_per_node(d, per_node) if crosses else d

    def ring(tensor: float, factor: float) -> float:
        """Per GPU, ``factor`` all-gathers' or reduce-scatters' worth of ``tensor`` over the group's link."""
        return factor * (d - k) / (d * k) * tensor if crosses else factor * (d - 1) / d * tensor

    link = INTER if crosses else INTRA
    if st.shard == "none":
        return {link: ring(g, 2)}
    if st.shard == "optimizer":
        return {link: ring(g, 2) + ring(weight_bytes(plan.precision, elements=elements, model_bytes=nbytes), 1)}
    c = weight_bytes(plan.precision, elements=elements, model_bytes=nbytes, compute=True) - fp8_gather_saving(
        plan.precision, st.predicted.fp8_gathered_elements)  # FP8 linears' weights gathered as 1-byte casts
    times = plan.microbatches if st.reshard_after_forward else 1
    gathers = 2 if st.reshard_after_forward else 1
    if crosses and plan.shard_degree(st) < d:  # HSDP: gathers inside the node, shards' gradients across nodes
        shards = plan.shard_degree(st)
        nodes = d // shards
        return {INTRA: times * (gathers * c + g) * (shards - 1) / shards,
                INTER: times * 2 * (nodes - 1) / nodes * g / shards}
    return {link: times * ring(gathers * c + g, 1)}
