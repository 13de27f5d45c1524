"""Per-op recomputation in the planner: what a layer keeps and spends when it recomputes only its cheap ops.

Checked: the formulation prices a block's cheap recomputation as its inputs plus the
outputs of its FLOP-carrying nodes (matmuls, attention) kept, and the forward of its
other nodes spent again; a stage's memory and time with such blocks lie between
keeping and recomputing them wholly, in the closed form, the per-stage and the
per-rank peaks alike; the planner writes such layers into the plan
(``recompute_ops_layers``), which saves and loads, and its report says so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.cost.devices import DEVICES
from partitioner.cost.nodecost import predicted_times
from partitioner.cost.nodes import profile
from partitioner.graph.capture import capture
from partitioner.graph.values import propagate_values
from partitioner.plan import Plan
from partitioner.report.table import format_plan, recompute_summary
from partitioner.search.planner import compile
from partitioner.solve.coarsen import coarsen
from partitioner.solve.formulate import formulate, graph_costs
from partitioner.solve.problem import (
    PartitionProblem,
    in_flight,
    rank_memory,
    stage_costs,
    stage_memory,
)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def test_a_cheap_block_keeps_its_inputs_and_matmul_outputs_and_spends_its_other_forwards() -> None:
    model, inputs = _Mlp(), (torch.randn(8, 16),)
    captured = capture(model, inputs, method="export")
    propagate_values(captured.graph_module, inputs)
    costs = profile(captured, inputs, measure=False)
    times = {name: predicted_times(c, DEVICES["h100"]) for name, c in costs.items()}
    graph = graph_costs(captured, coarsen(captured.graph_module, max_blocks=1), costs, times)
    problem = formulate(graph, dp=1, spec=DEVICES["h100"], recompute="auto", memory_limit=1e12)
    assert problem.op_kept_bytes is not None and problem.op_recompute_s is not None and problem.recompute_s
    members = graph.blocks[0]
    heavy = [n for n in members if costs[n].forward_flops > 0]
    assert len(heavy) == 2  # the two linears; gelu and the residual add carry no FLOPs
    outputs = 8 * 64 * 4 + 8 * 16 * 4  # up's and down's outputs, float32
    assert problem.op_kept_bytes[0] == pytest.approx(problem.recompute_bytes[0] + outputs)  # type: ignore[index]
    light = sum(graph.node_forward_s[n] for n in members if n not in heavy)
    assert problem.op_recompute_s[0] == pytest.approx(light)
    assert 0 < problem.op_recompute_s[0] < problem.recompute_s[0]


def test_a_layer_writing_in_place_is_priced_as_recomputing_wholly() -> None:
    """torch refuses an op writing into a saved output, so the runtime recomputes such a layer wholly."""
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Linear(64, 16))
    inputs = (torch.randn(8, 16),)
    captured = capture(model, inputs, method="symbolic_trace")
    propagate_values(captured.graph_module, inputs)
    costs = profile(captured, inputs, measure=False)
    assert [c.writes_in_place for c in costs.values()] == [False, True, False]
    times = {name: predicted_times(c, DEVICES["h100"]) for name, c in costs.items()}
    graph = graph_costs(captured, coarsen(captured.graph_module, max_blocks=1), costs, times)
    problem = formulate(graph, dp=1, spec=DEVICES["h100"], recompute="auto", memory_limit=1e12)
    assert problem.op_kept_bytes == problem.recompute_bytes and problem.op_recompute_s == problem.recompute_s


def _problem() -> PartitionProblem:
    n = 4
    return PartitionProblem(
        time_s=(1.0,) * n, static_bytes=(1.0,) * n, activation_bytes=(10.0,) * n, allreduce_s=(0.0,) * n,
        transfer_s=(0.0,) * n, edges=tuple((v, v + 1) for v in range(n - 1)), recompute_bytes=(2.0,) * n,
        recompute_s=(0.3,) * n, recompute="auto", layer_start=(True,) * n, op_kept_bytes=(5.0,) * n,
        op_recompute_s=(0.05,) * n, stage_rank=(0, 1, 0, 1))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b"])
def test_cheap_blocks_cost_between_keeping_and_recomputing_wholly(schedule: str) -> None:
    p, stage_of, kwargs = _problem(), (0, 1, 2, 3), {"microbatches": 4, "schedule": schedule}
    kept = stage_memory(p, stage_of, 4, recompute=(False,) * 4, **kwargs)
    cheap = stage_memory(p, stage_of, 4, recompute=(False,) * 4, ops=(1,) * 4, **kwargs)
    whole = stage_memory(p, stage_of, 4, recompute=(True,) * 4, **kwargs)
    flights = [in_flight(s, 4, 4, schedule, chunks=2) for s in range(4)]
    assert all(w < c for w, c in zip(whole, cheap))
    # Beside keeping: 5 bytes per micro-batch rather than 10, but the layer is remade (10) during its backward.
    assert [c < k for c, k in zip(cheap, kept)] == [f * 5 > 10 for f in flights] and any(f > 2 for f in flights)
    t_kept, _ = stage_costs(p, stage_of, 4, recompute=(False,) * 4)
    t_cheap, _ = stage_costs(p, stage_of, 4, recompute=(False,) * 4, ops=(1,) * 4)
    t_whole, _ = stage_costs(p, stage_of, 4, recompute=(True,) * 4)
    assert t_cheap == pytest.approx([k + 0.05 for k in t_kept]) and all(c < w for c, w in zip(t_cheap, t_whole))
    ranks = rank_memory(p, stage_of, 4, recompute=(False,) * 4, ops=(1,) * 4, **kwargs)
    assert all(r <= a + b for r, a, b in zip(ranks, cheap[:2], cheap[2:]))  # a rank holds at most its stages' sum
    one = dataclasses.replace(p, stage_rank=None)  # one stage per rank: the rank's peak is its stage's
    assert rank_memory(one, stage_of, 4, recompute=(False,) * 4, ops=(1,) * 4, microbatches=4, schedule="1f1b") == \
        stage_memory(one, stage_of, 4, recompute=(False,) * 4, ops=(1,) * 4, microbatches=4, schedule="1f1b")


class _Layer(nn.Module):
    """An RMS norm and a SwiGLU MLP: most of what its backward keeps is pointwise (as in Llama)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class _Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)


FRACTION = 0.45  # of the way from recomputing everything to keeping everything: one layer recomputes its cheap ops


def _plan(**kwargs: object) -> Plan:
    torch.manual_seed(0)
    return compile(_Stack(), (torch.randn(4096, 32),), gpus=2, pp=2, dp=1, microbatches=4, schedule="1f1b",
                   device="h100", **kwargs)  # type: ignore[arg-type]


def test_the_planner_writes_cheap_layers_into_the_plan_and_the_report(tmp_path: Path) -> None:
    kept, whole = (max(_plan(recompute=r).predicted.peak_memory_bytes) for r in ("none", "full"))
    plan = _plan(recompute="auto", memory_per_gpu=whole + FRACTION * (kept - whole))
    cheap = [s for s in plan.stages if s.recompute_ops_layers]
    assert cheap, [(s.recompute, s.recompute_layers, s.recompute_ops_layers) for s in plan.stages]
    assert all(s.recompute == "selective" for s in cheap)
    assert max(plan.predicted.peak_memory_bytes) <= whole + FRACTION * (kept - whole)
    assert "ops-only" in format_plan(plan) and "cheap ops" in recompute_summary(plan)
    assert Plan.load(plan.save(tmp_path)) == plan
