"""The costed graph as one GPU of a tensor-parallel group sees it: the solver's problem per ``tp``.

Tensor parallelism (:mod:`partitioner.graph.tensorparallel` finds what splits,
:mod:`partitioner.cost.tensorparallel` prices it) changes the numbers the
pipeline search works with, not its shape: a group of ``tp`` GPUs behaves as one
device whose nodes are cheaper and hold less, plus the group's collectives.  So
the planner scales the costs (:func:`tensor_parallel_costs`) and runs the same
pp x dp x micro-batch x schedule x recomputation search for ``gpus / tp``
devices with ``gpus_per_node / tp`` per node (a group never spans nodes; ranks are
``(p x dp + r) x tp + t``), once per degree, keeping the best
(:mod:`partitioner.search.planner`); as :mod:`partitioner.solve.scaledcosts` does
per micro-batch count.  Per node, at degree ``tp``:

* a split node (a pair's columns, row and what runs between them; the
  vocabulary-parallel embedding, LM head and loss) does ``1 / share`` of its
  work and keeps ``1 / share`` of its saved activations and output, ``share``
  being ``tp`` (key/value heads fewer than ``tp``: their count,
  :func:`~partitioner.cost.tensorparallel.head_share`);
* a replicated node (norms, residual adds, rotary tables) runs whole, or, with
  sequence parallelism, on ``1 / tp`` of the sequence (Korthikanti et al. 2022,
  section 4.2.2): its time, saved activations and output divided by ``tp``;
  a node of a pair left whole (``TPLayout.whole``: its split would not survive
  a view, or its weight is read elsewhere another way) runs whole;
* split parameters hold ``1 / share`` of their elements (a vocabulary padded to a
  multiple of ``tp``); the others stay whole (norms, a row's bias);
* each pair adds its forward collective to its row's forward and its backward
  one to the row's backward (:func:`~partitioner.cost.tensorparallel.pair_seconds`,
  on the node's NVLink); recomputation repeats the forward one, as it does
  (Korthikanti et al., section 5); the embedding and head add theirs, and the
  head the vocabulary-parallel loss's three small all-reduces;
* model FLOPs are divided by ``tp`` (what one GPU's share of the model does), so
  the MFU over ``gpus / tp`` devices is the MFU over ``gpus``.

Pipeline messages (the residual stream at a stage boundary) are ``1 / tp`` per
GPU with sequence parallelism, and whole without it (each GPU of the group
sends its copy: Megatron-LM's scatter/gather optimisation, Narayanan et al.
2021 section 4.1, would send ``1 / tp`` and all-gather on the receiving side;
not priced).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from partitioner.cost.comm import link
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.precision import activation_scale
from partitioner.cost.tensorparallel import (
    head_share,
    loss_parallel_seconds,
    padded_units,
    pair_seconds,
)
from partitioner.graph.ir import dtype_itemsize
from partitioner.graph.tensorparallel import TPLayout
from partitioner.solve.formulate import GraphCosts
from partitioner.solve.scaledcosts import CostSettings, ScaledCosts

__all__ = ["TensorParallelCosts", "node_share", "tensor_parallel_costs", "tp_comm_seconds"]


def node_share(layout: TPLayout, name: str, tp: int, *, sequence_parallel: bool) -> int:
    """How many ways node ``name``'s work and activations divide at ``tp``.

    >>> from partitioner.graph.tensorparallel import TPRole
    >>> layout = TPLayout({"k": TPRole(0, "column", 2), "q": TPRole(0, "column", 8)}, (), {})
    >>> node_share(layout, "q", 4, sequence_parallel=False), node_share(layout, "k", 4, sequence_parallel=False)
    (4, 2)
    >>> node_share(layout, "norm", 4, sequence_parallel=False), node_share(layout, "norm", 4, sequence_parallel=True)
    (1, 4)
    """
    if tp <= 1 or name in layout.whole:  # a pair whose split would not survive runs whole (graph/tensorparallel.py)
        return 1
    role = layout.roles.get(name)
    if role is None:
        return tp if sequence_parallel else 1
    if role.role in ("embedding", "head", "vocab"):
        return tp
    return head_share(tp, role.units)


def tp_comm_seconds(
    graph: GraphCosts, layout: TPLayout, *, tp: int, spec: DeviceSpec, precision: str, sequence_parallel: bool
) -> dict[str, tuple[float, float]]:
    """(forward, backward) collective seconds per node that carries a group's collectives, one micro-batch.

    ``graph`` as costed (whole values, at dp = 1); the bytes moved are the
    pattern's ``b x s x h`` value at ``precision``.
    """
    if tp <= 1:
        return {}
    nvlink = link(spec)
    out: dict[str, tuple[float, float]] = {}

    def nbytes(name: str) -> float:
        return graph.node_output_bytes.get(name, 0) * activation_scale(precision, graph.node_dtype.get(name, "float32"))

    def add(name: str, forward: float, backward: float) -> None:
        f, b = out.get(name, (0.0, 0.0))
        out[name] = (f + forward, b + backward)

    for p in layout.patterns:
        size = nbytes(p.comm_node)
        whole = pair_seconds(size, tp, nvlink, sequence_parallel=sequence_parallel)  # all-reduce or AG + RS
        half = nvlink.shard_seconds(size, tp)  # one all-gather or one reduce-scatter
        if p.kind in ("attention", "mlp") and p.row is not None:
            add(p.row, whole, whole)
        elif p.kind == "embedding":
            # Forward: all-reduce of the partial embeddings (SP: reduce-scatter); backward: none (SP: all-gather).
            add(p.columns[0], half if sequence_parallel else whole, half if sequence_parallel else 0.0)
        elif p.kind == "head":
            # Forward: SP all-gathers the head's input; backward: the input gradient all-reduced (SP: reduce-scattered).
            itemsize = dtype_itemsize(graph.node_dtype.get(p.comm_node) or "float32")
            tokens = max(1, round(graph.node_output_bytes.get(p.comm_node, 0) / (max(1, p.hidden) * itemsize)))
            add(p.columns[0], (half if sequence_parallel else 0.0) + loss_parallel_seconds(1, tokens, tp=tp, link=nvlink),
                half if sequence_parallel else whole)
    return out


def tensor_parallel_costs(
    graph: GraphCosts, layout: TPLayout, *, tp: int, spec: DeviceSpec, precision: str, sequence_parallel: bool = True
) -> GraphCosts:
    """``graph`` (one micro-batch, dp = 1) as one GPU of a ``tp``-way group computes, holds and sends it.

    >>> from partitioner.cost.devices import DEVICES
    >>> from partitioner.graph.tensorparallel import TPPattern, TPRole
    >>> g = GraphCosts(blocks=(("up", "act", "down", "norm"),),
    ...     node_time_s={"up": 4.0, "act": 1.0, "down": 4.0, "norm": 1.0},
    ...     node_forward_s={"up": 2.0, "act": 0.5, "down": 2.0, "norm": 0.5},
    ...     node_saved_bytes={"up": 400, "act": 400, "down": 100, "norm": 100},
    ...     node_output_bytes={"up": 400, "act": 400, "down": 100, "norm": 100},
    ...     parameter_bytes={"w1": 1600, "w2": 1600, "g": 40}, block_parameters=(("g", "w1", "w2"),),
    ...     edges=(), block_sends=(100,), parameter_elements={"w1": 400, "w2": 400, "g": 10},
    ...     node_flops={"up": 8.0, "down": 8.0})
    >>> layout = TPLayout({"up": TPRole(0, "column", 16), "act": TPRole(0, "inner", 16), "down": TPRole(0, "row", 16)},
    ...     (TPPattern("mlp", ("up",), "down", "down", 16),), {"w1": (0, 16), "w2": (0, 16)})
    >>> t = tensor_parallel_costs(g, layout, tp=4, spec=DEVICES["h100"], precision="fp32", sequence_parallel=False)
    >>> t.node_time_s["up"], t.node_time_s["norm"], t.parameter_elements, t.node_flops["up"]
    (1.0, 1.0, {'w1': 100, 'w2': 100, 'g': 10}, 2.0)
    >>> round((t.node_forward_s["down"] - 0.5) * 1e6, 2)   # + one all-reduce of 100 bytes over 4 GPUs: latency
    60.0
    >>> s = tensor_parallel_costs(g, layout, tp=4, spec=DEVICES["h100"], precision="fp32")
    >>> s.node_time_s["norm"], s.node_saved_bytes["norm"], s.node_output_bytes["norm"]
    (0.25, 25.0, 25.0)
    """
    if tp <= 1:
        return graph
    names = [n for block in graph.blocks for n in block]
    share = {n: node_share(layout, n, tp, sequence_parallel=sequence_parallel) for n in names}
    comm = tp_comm_seconds(graph, layout, tp=tp, spec=spec, precision=precision, sequence_parallel=sequence_parallel)

    def per_node(values: Mapping[str, Any]) -> dict[str, Any]:
        return {k: (v / share[k] if k in share else v) for k, v in values.items()}

    time = per_node(graph.node_time_s)
    forward = per_node(graph.node_forward_s)
    for name, (f, b) in comm.items():
        time[name] = time.get(name, 0.0) + f + b
        forward[name] = forward.get(name, 0.0) + f
    patterns = layout.patterns

    def param_share(name: str) -> float:
        found = layout.parameters.get(name)
        if found is None:
            return 1.0
        pattern, units = found
        if patterns and patterns[pattern].kind in ("embedding", "head"):
            return tp * units / padded_units(units, tp)
        return float(head_share(tp, units))

    # Whole bytes and elements (plan.json's stage parameter bytes are integers).
    parameter_bytes = {k: round(v / param_share(k)) for k, v in graph.parameter_bytes.items()}
    elements = {k: round(v / param_share(k)) for k, v in graph.parameter_elements.items()}
    head = any(p.kind == "head" for p in patterns)
    return dataclasses.replace(
        graph,
        node_time_s=time,
        node_forward_s=forward,
        node_saved_bytes=per_node(graph.node_saved_bytes),
        node_output_bytes=per_node(graph.node_output_bytes),
        node_saved_float32_bytes=per_node(graph.node_saved_float32_bytes),
        node_weight_s=per_node(graph.node_weight_s),
        node_flops={k: v / tp for k, v in graph.node_flops.items()},
        parameter_bytes=parameter_bytes,
        parameter_elements=elements,
        block_sends=tuple(round(b / (tp if sequence_parallel else 1)) for b in graph.block_sends),
        loss_s=(graph.loss_s[0] / tp, graph.loss_s[1] / tp) if head else graph.loss_s,
        fp8_gathered=frozenset(),  # FSDP2 gathers tensor-parallel weights (DTensors) in bf16
    )


class TensorParallelCosts(ScaledCosts):
    """:class:`~partitioner.solve.scaledcosts.ScaledCosts` for one GPU of a ``tp``-way group.

    ``base``: the costs at tp = 1 (its graphs are shared, priced once);
    ``options``: the search's settings for ``gpus / tp`` devices, ``gpus_per_node / tp`` per node.
    """

    def __init__(self, base: ScaledCosts, layout: TPLayout, tp: int, options: CostSettings, *,
                 sequence_parallel: bool = True) -> None:
        super().__init__(base.captured, base.blocks, base.costs, options, loss_s=base.loss_s, split=base.split,
                         calibration=base.calibration)
        self.base, self.layout, self.tp, self.sequence_parallel = base, layout, tp, sequence_parallel
        self._tp_graphs: dict[int, GraphCosts] = {}

    def at(self, microbatches: int) -> GraphCosts:
        if microbatches not in self._tp_graphs:
            self._tp_graphs[microbatches] = tensor_parallel_costs(
                self.base.at(microbatches), self.layout, tp=self.tp, spec=self.options.spec,
                precision=self.options.precision, sequence_parallel=self.sequence_parallel)
        return self._tp_graphs[microbatches]

    def comm_s(self, microbatches: int) -> dict[str, tuple[float, float]]:
        """(forward, backward) tensor-parallel collective seconds per node, one micro-batch at dp = 1."""
        o = self.options
        return tp_comm_seconds(self.base.at(microbatches), self.layout, tp=self.tp, spec=o.spec,
                               precision=o.precision, sequence_parallel=self.sequence_parallel)
