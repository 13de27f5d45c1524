"""The costed graph at every micro-batch count: counted once at a reference size, then scaled.

The planner counts (or measures) each node's cost once, for one micro-batch of
the reference size (:attr:`CostSettings.reference_microbatches`: the search's
:class:`~partitioner.search.options.PlanOptions` is one, read by attribute, never imported);
:class:`ScaledCosts` scales those costs linearly to every other micro-batch
size, prices times again at each size, and formulates the solver's problem once
per (dp, M).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from partitioner.cost.calibration import Calibration
from partitioner.cost.devices import DeviceSpec
from partitioner.cost.experts import DEFAULT_IMBALANCE
from partitioner.cost.nodecost import NodeCost, SplitOverhead
from partitioner.cost.precision import DEFAULT_FP8_RECIPE
from partitioner.solve.formulate import GraphCosts, formulate, graph_costs, node_times
from partitioner.solve.problem import PartitionProblem

if TYPE_CHECKING:  # types only: this module imports without torch
    from partitioner.graph.capture import CapturedModel

__all__ = ["CostSettings", "ScaledCosts"]


class CostSettings(Protocol):
    """The settings :class:`ScaledCosts` prices and formulates with (``PlanOptions`` has them all)."""

    @property
    def spec(self) -> DeviceSpec: ...
    @property
    def measure(self) -> bool: ...
    @property
    def memory_limit(self) -> float | None: ...
    @property
    def precision(self) -> str: ...
    @property
    def optimizer_states(self) -> int: ...
    @property
    def recompute(self) -> str: ...
    @property
    def gpus_per_node(self) -> int: ...
    @property
    def bucket_cap_mb(self) -> float: ...
    @property
    def reference_microbatches(self) -> int: ...


class ScaledCosts:
    """The costed graph at every micro-batch count: counted once at the reference size, then scaled.

    Node costs scale linearly with the samples per micro-batch
    (:meth:`~partitioner.cost.nodecost.NodeCost.scaled`: weights are read once whatever
    the size); times are priced again at each size (:func:`~partitioner.solve.formulate.node_times`).
    """

    def __init__(
        self,
        captured: CapturedModel,
        blocks: list[tuple[str, ...]],
        costs: dict[str, NodeCost],
        options: CostSettings,
        *,
        loss_s: tuple[float, float],
        split: SplitOverhead | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        self.captured, self.blocks, self.costs, self.options, self.loss_s = captured, blocks, costs, options, loss_s
        self.split = split or SplitOverhead(0.0, 0.0)  # what a split backward adds per parameter-reading node
        self.calibration = calibration or Calibration()  # node times x scale, + action_s per compute action
        self._graphs: dict[int, GraphCosts] = {}
        self._problems: dict[tuple[int, int, str, int], PartitionProblem] = {}  # once per (dp, M, shard, ep)
        self.ep = 1  # expert-parallel degree the problems are priced for (:meth:`with_ep`)

    def at(self, microbatches: int) -> GraphCosts:
        """Costs of one micro-batch when the mini-batch is split into ``microbatches`` (at dp = 1)."""
        if microbatches not in self._graphs:
            o = self.options
            factor = o.reference_microbatches / microbatches
            costs = self.costs if factor == 1 else {k: _scaled(c, factor) for k, c in self.costs.items()}
            scale = self.calibration.scale
            times = {k: (f * scale, b * scale)
                     for k, (f, b) in node_times(costs, o.spec, precision=o.precision, measure=o.measure,
                                fp8_recipe=getattr(o, "fp8_recipe", DEFAULT_FP8_RECIPE)).items()}
            loss = (self.loss_s[0] * factor * scale, self.loss_s[1] * factor * scale)
            graph = graph_costs(self.captured, self.blocks, costs, times, loss_s=loss,
                                split_overhead_s=self.split.per_op_s, split_share=self.split.share,
                                split_forward=self.split.forward_part, split_weight=self.split.weight_part,
                                action_s=self.calibration.action_s)
            if factor != 1:  # values read across blocks (sent, kept for recomputation): at the captured size
                graph = dataclasses.replace(
                    graph,
                    node_output_bytes={k: round(v * factor) for k, v in graph.node_output_bytes.items()},
                    block_sends=tuple(round(b * factor) for b in graph.block_sends),
                    expert_layers=tuple(layer._replace(tokens=layer.tokens * factor) for layer in graph.expert_layers),
                )
            if o.precision == "fp8" and getattr(o, "fp8_recipe", DEFAULT_FP8_RECIPE) == "tensorwise":
                graph = dataclasses.replace(graph, fp8_gathered=self._fp8_gathered_names)
            self._graphs[microbatches] = graph
        return self._graphs[microbatches]

    @functools.cached_property
    def _fp8_gathered_names(self) -> frozenset[str]:
        """Canonical names of the weights a fully sharded stage gathers as FP8 casts (GraphCosts.fp8_gathered):
        those only FP8 matmuls read, each under one name (FSDP2 gathers a tied one in bf16)."""
        from partitioner.graph.fp8 import fp8_only_weights  # torch: the solver imports without it

        names = self.captured.parameter_names
        seen = Counter(names.values())
        return frozenset(names[w] for w in fp8_only_weights(self.captured.graph_module)
                         if w in names and seen[names[w]] == 1)

    def with_ep(self, ep: int) -> ScaledCosts:
        """These costs priced for expert parallelism ``ep`` (the graphs and problems kept are shared)."""
        if ep == self.ep:
            return self
        view = copy.copy(self)
        view.ep = ep
        return view

    def problem(self, dp: int, microbatches: int, shard: str = "none", **changes: Any) -> PartitionProblem:
        """The solver's problem for ``dp`` replicas and ``microbatches``, with the options' settings.

        ``changes`` override formulate's keywords (``precision``, ``recompute``, ``memory_limit``...).
        ``shard``: how the stage groups' replicas hold their state (``formulate``'s).  Priced for
        expert parallelism :attr:`ep` where it divides ``dp`` (else without: such a trial is skipped).
        """
        ep = self.ep if dp % self.ep == 0 else 1
        if not changes and (dp, microbatches, shard, ep) in self._problems:
            return self._problems[dp, microbatches, shard, ep]
        o = self.options
        kwargs: dict[str, Any] = {
            "spec": o.spec, "memory_limit": o.memory_limit, "precision": o.precision,
            "optimizer_states": o.optimizer_states, "bucket_cap_mb": o.bucket_cap_mb,
            "gpus_per_node": o.gpus_per_node, "recompute": o.recompute, "shard": shard,
            "zero3_unit": getattr(o, "zero3_unit", "layer"), "ep": ep,
            "expert_imbalance": getattr(o, "expert_imbalance", DEFAULT_IMBALANCE), **changes,
        }
        problem = formulate(self.at(microbatches), dp=dp, **kwargs)
        if not changes:
            self._problems[dp, microbatches, shard, ep] = problem
        return problem



def _scaled(cost: NodeCost, factor: float) -> NodeCost:
    """``cost`` for a micro-batch ``factor`` times as large: linear in the samples, weights read once.

    >>> c = _scaled(NodeCost(1.0, 2.0, 10.0, 20.0, 100, 1000, "float32", weight_bytes=200), 0.5)
    >>> c.forward_s, c.backward_flops, c.saved_bytes, c.io_bytes, c.weight_bytes
    (0.5, 10.0, 50, 600, 200)
    """
    return dataclasses.replace(
        cost,
        forward_s=cost.forward_s * factor,
        backward_s=cost.backward_s * factor,
        forward_flops=cost.forward_flops * factor,
        backward_flops=cost.backward_flops * factor,
        saved_bytes=round(cost.saved_bytes * factor),
        io_bytes=round(cost.weight_bytes + (cost.io_bytes - cost.weight_bytes) * factor),
        saved_float32_bytes=None if cost.saved_float32_bytes is None else round(cost.saved_float32_bytes * factor),
        weight_backward_s=cost.weight_backward_s * factor,
    )
