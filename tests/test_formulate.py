"""Formulate: static memory, tied parameters, dp scaling, all-reduce and transfer costs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from partitioner.capture import CapturedModel, capture
from partitioner.coarsen import coarsen
from partitioner.cost import predicted_times, profile
from partitioner.devices import DEVICES, DeviceSpec
from partitioner.formulate import (
    GraphCosts,
    allreduce_seconds,
    formulate,
    graph_costs,
    transfer_seconds,
)
from partitioner.values import propagate_values

V, H, B, T = 50, 16, 4, 6
SPEC = DEVICES["h100"]


class Tied(nn.Module):
    """Embedding -> two hidden layers -> head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mid = nn.Linear(H, H)
        self.out = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mid(self.emb(ids)))
        return self.head(torch.tanh(self.out(h)))


@pytest.fixture(scope="module")
def tied() -> tuple[CapturedModel, GraphCosts]:
    torch.manual_seed(0)
    model = Tied()
    inputs = (torch.randint(0, V, (B, T)),)
    captured = capture(model, inputs, method="export")
    propagate_values(captured.graph_module, inputs)
    costs = profile(captured, inputs, measure=False)
    times = {name: predicted_times(c, SPEC) for name, c in costs.items()}
    blocks = coarsen(captured.graph_module, max_blocks=256)
    return captured, graph_costs(captured, blocks, costs, times)


def _unique_parameter_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in Tied().parameters())


def _block_of(graph: GraphCosts, node: str) -> int:
    return next(b for b, members in enumerate(graph.blocks) if node in members)


@pytest.mark.parametrize("optimizer_states", [0, 1, 2])
def test_static_bytes_are_weights_grads_and_optimizer_state(
    tied: tuple[CapturedModel, GraphCosts], optimizer_states: int
) -> None:
    _, graph = tied
    problem = formulate(graph, dp=1, spec=SPEC, memory_limit=None, optimizer_states=optimizer_states)
    total = sum(problem.static_bytes) + sum(nbytes for nbytes, _, _ in problem.shared)
    assert total == (2 + optimizer_states) * _unique_parameter_bytes()
    # Per block: the parameters it alone reads.
    mid = _block_of(graph, "linear")
    assert problem.static_bytes[mid] == (2 + optimizer_states) * (H * H + H) * 4


def test_tied_parameter_is_shared(tied: tuple[CapturedModel, GraphCosts]) -> None:
    captured, graph = tied
    assert captured.tied_parameters() == {"emb.weight": ["emb.weight", "head.weight"]}
    assert set(graph.parameter_bytes) == {"emb.weight", "mid.weight", "mid.bias", "out.weight", "out.bias"}
    embedding, head = _block_of(graph, "embedding"), _block_of(graph, "linear_2")
    assert "emb.weight" in graph.block_parameters[embedding]
    assert "emb.weight" in graph.block_parameters[head]
    assert all("head.weight" not in params for params in graph.block_parameters)  # canonical names only
    problem = formulate(graph, dp=1, spec=SPEC, memory_limit=None, optimizer_states=2)
    assert len(problem.shared) == 1
    nbytes, seconds, readers = problem.shared[0]
    assert nbytes == 4 * V * H * 4
    assert seconds == 0.0  # no replicas, no all-reduce
    assert readers == (embedding, head)
    # Not also counted in the readers' own static bytes.
    assert problem.static_bytes[embedding] == 0.0
    assert problem.static_bytes[head] == 0.0


def test_dp_scaling_halves_time_and_activations(tied: tuple[CapturedModel, GraphCosts]) -> None:
    _, graph = tied
    one = formulate(graph, dp=1, spec=SPEC, memory_limit=123.0)
    two = formulate(graph, dp=2, spec=SPEC, memory_limit=123.0)
    assert any(t > 0 for t in one.time_s)
    assert any(a > 0 for a in one.activation_bytes)
    for a, b in zip(one.time_s, two.time_s):
        assert b == pytest.approx(a / 2, rel=1e-12)
    for a, b in zip(one.activation_bytes, two.activation_bytes):
        assert b == pytest.approx(a / 2, rel=1e-12)
    assert one.static_bytes == two.static_bytes  # every replica holds the whole stage state
    assert one.edges == two.edges
    assert one.memory_limit == two.memory_limit == 123.0
    # Time per block is the sum of its nodes' forward + backward seconds.
    for b, members in enumerate(graph.blocks):
        assert one.time_s[b] == pytest.approx(sum(graph.node_time_s[n] for n in members))


def test_allreduce_zero_at_dp1_and_ring_at_dp2(tied: tuple[CapturedModel, GraphCosts]) -> None:
    _, graph = tied
    one = formulate(graph, dp=1, spec=SPEC, memory_limit=None)
    assert all(s == 0.0 for s in one.allreduce_s)
    assert all(s == 0.0 for _, s, _ in one.shared)
    bucket = 25 * 1024**2
    two = formulate(graph, dp=2, spec=SPEC, memory_limit=None, bucket_cap_mb=25)
    mid = _block_of(graph, "linear")
    nbytes = (H * H + H) * 4
    # Ring: 2 (D-1)/D x bytes / bandwidth = bytes / bandwidth at D = 2, plus each byte's share of
    # the per-bucket latency 2 (D-1) alpha; the first bucket's latency is a fixed term.
    share = 2 * SPEC.link_latency / bucket
    assert two.allreduce_s[mid] == pytest.approx(nbytes / SPEC.link_bandwidth + nbytes * share)
    assert two.shared[0][1] == pytest.approx(V * H * 4 / SPEC.link_bandwidth + V * H * 4 * share)
    assert two.allreduce_latency_s == pytest.approx(2 * SPEC.link_latency)
    four = formulate(graph, dp=4, spec=SPEC, memory_limit=None, bucket_cap_mb=25)
    assert four.allreduce_s[mid] == pytest.approx(1.5 * nbytes / SPEC.link_bandwidth + nbytes * 3 * share)
    assert four.allreduce_latency_s == pytest.approx(6 * SPEC.link_latency)
    assert one.allreduce_latency_s == 0.0


def test_allreduce_formula() -> None:
    spec = DEVICES["a100"]
    assert allreduce_seconds(1e9, 1, spec) == 0.0
    assert allreduce_seconds(0, 8, spec) == 0.0
    expected = 2 * 3 / 4 * 1e9 / spec.link_bandwidth + 3 * 6 * spec.link_latency
    assert allreduce_seconds(1e9, 4, spec, messages=3) == pytest.approx(expected)
    assert allreduce_seconds(1e9, 2, spec, messages=0) == pytest.approx(1e9 / spec.link_bandwidth)


def test_transfer_formula() -> None:
    spec = dataclasses.replace(DEVICES["cpu"], link_bandwidth=1e9, link_latency=1e-4)
    assert transfer_seconds(0, spec) == 0.0
    assert transfer_seconds(1e6, spec) == pytest.approx(1e-4 + 1e-3)
    assert transfer_seconds(2e6, spec) == pytest.approx(1e-4 + 2e-3)


def test_transfer_cost_per_block(tied: tuple[CapturedModel, GraphCosts]) -> None:
    _, graph = tied
    spec: DeviceSpec = DEVICES["h100"]
    for dp in (1, 2):
        problem = formulate(graph, dp=dp, spec=spec, memory_limit=None)
        for b, nbytes in enumerate(graph.block_sends):
            expected = 0.0 if nbytes == 0 else 2 * (spec.link_latency + nbytes / dp / spec.link_bandwidth)
            assert problem.transfer_s[b] == pytest.approx(expected)  # activation forward, gradient back
    mid = _block_of(graph, "linear")
    assert graph.block_sends[mid] == B * T * H * 4  # its (B, T, H) output
    last = len(graph.blocks) - 1
    assert graph.block_sends[last] == 0  # the head's output is the model's output


def test_edges_follow_the_data(tied: tuple[CapturedModel, GraphCosts]) -> None:
    _, graph = tied
    n = len(graph.blocks)
    assert all(0 <= u < v < n for u, v in graph.edges)
    chain = {(b, b + 1) for b in range(n - 1)}
    assert chain <= set(graph.edges)  # a chain of layers
    # The embedding output only feeds the next block.
    embedding = _block_of(graph, "embedding")
    assert [v for u, v in graph.edges if u == embedding] == [embedding + 1]


def test_loss_is_charged_to_the_last_block(tied: tuple[CapturedModel, GraphCosts]) -> None:
    _, graph = tied
    base = formulate(graph, dp=1, spec=SPEC, memory_limit=None)
    with_loss = formulate(dataclasses.replace(graph, loss_s=(1e-3, 2e-3)), dp=2, spec=SPEC, memory_limit=None)
    assert with_loss.time_s[-1] == pytest.approx((base.time_s[-1] + 3e-3) / 2)
    assert with_loss.time_s[0] == pytest.approx(base.time_s[0] / 2)
