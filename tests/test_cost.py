"""Cost: FLOPs, saved activations, measured vs counted times, the roofline, and no side effects."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from partitioner.cost.devices import DEVICES, device_spec
from partitioner.cost.nodecost import NodeCost, predicted_times
from partitioner.cost.nodes import COST_KEY, _calibrated, profile
from partitioner.graph.capture import CapturedModel, capture
from partitioner.graph.values import propagate_values

B, IN, HID, OUT = 16, 32, 64, 8


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


def _captured(model: nn.Module, inputs: tuple[torch.Tensor, ...], method: str = "export") -> CapturedModel:
    captured = capture(model, inputs, method=method)  # type: ignore[arg-type]
    propagate_values(captured.graph_module, inputs)
    return captured


@pytest.fixture(scope="module")
def mlp_costs() -> dict[str, NodeCost]:
    inputs = (torch.randn(B, IN),)
    return profile(_captured(_mlp(), inputs), inputs, measure=False)


def test_linear_flops_forward_and_backward(mlp_costs: dict[str, NodeCost]) -> None:
    assert set(mlp_costs) == {"linear", "relu", "linear_1"}
    second = mlp_costs["linear_1"]  # its input requires grad: dX and dW
    assert second.forward_flops == 2 * B * HID * OUT
    assert second.backward_flops == 2 * second.forward_flops
    first = mlp_costs["linear"]  # reads the model input, which needs no gradient: dW only
    assert first.forward_flops == 2 * B * IN * HID
    assert first.backward_flops == first.forward_flops
    assert mlp_costs["relu"].forward_flops == 0


def test_linear_flops_symbolic_trace() -> None:
    inputs = (torch.randn(B, IN),)
    costs = profile(_captured(_mlp(), inputs, "symbolic_trace"), inputs, measure=False)
    assert costs["_2"].forward_flops == 2 * B * HID * OUT
    assert costs["_2"].backward_flops == 4 * B * HID * OUT


def test_saved_bytes_exclude_parameters(mlp_costs: dict[str, NodeCost]) -> None:
    relu = mlp_costs["relu"]
    assert relu.saved_bytes > 0
    assert relu.saved_bytes == B * HID * 4  # relu keeps its output
    # The second linear keeps its input for dW, but not its weight (a parameter).
    weight_bytes = HID * OUT * 4
    assert mlp_costs["linear_1"].saved_bytes == B * HID * 4
    assert mlp_costs["linear_1"].saved_bytes < B * HID * 4 + weight_bytes
    for cost in mlp_costs.values():
        assert cost.dtype == "float32"


def test_io_bytes_count_inputs_parameters_and_outputs(mlp_costs: dict[str, NodeCost]) -> None:
    expected = (B * HID + HID * OUT + OUT + B * OUT) * 4
    assert mlp_costs["linear_1"].io_bytes == expected
    assert mlp_costs["relu"].io_bytes == 2 * B * HID * 4


def test_measure_false_gives_zero_times(mlp_costs: dict[str, NodeCost]) -> None:
    for cost in mlp_costs.values():
        assert cost.forward_s == 0.0
        assert cost.backward_s == 0.0


def test_measure_true_gives_positive_times() -> None:
    inputs = (torch.randn(B, IN),)
    captured = _captured(_mlp(), inputs)
    costs = profile(captured, inputs, measure=True, warmup=0, repeats=1)
    for name, cost in costs.items():
        assert cost.forward_s > 0, name
        assert cost.backward_s > 0, name
        meta = captured.nodes()[name].meta[COST_KEY]  # written on the node as well
        assert (meta.forward_flops, meta.backward_flops, meta.saved_bytes) == (
            cost.forward_flops, cost.backward_flops, cost.saved_bytes)


def test_progress_reports_every_node() -> None:
    inputs = (torch.randn(B, IN),)
    captured = _captured(_mlp(), inputs)
    seen: list[tuple[int, int]] = []
    profile(captured, inputs, measure=False, progress=lambda done, total: seen.append((done, total)))
    total = len(captured.graph_module.graph.nodes)
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == list(range(1, total + 1))


# ----------------------------------------------------------------- roofline


def test_roofline_matmul_heavy_is_compute_bound() -> None:
    spec = dataclasses.replace(device_spec("h100"), efficiency=())  # the bare roofline (efficiencies: test_devices_efficiency)
    cost = NodeCost(0.0, 0.0, forward_flops=2e12, backward_flops=4e12, saved_bytes=10**6,
                    io_bytes=10**6, dtype="float32")
    forward, backward = predicted_times(cost, spec)
    assert forward == pytest.approx(2e12 / 67e12 + spec.kernel_overhead, rel=1e-12)
    assert backward == pytest.approx(4e12 / 67e12 + spec.kernel_overhead, rel=1e-12)
    # In half precision the tensor-core peak applies.
    half = predicted_times(NodeCost(0, 0, 2e12, 4e12, 10**6, 10**6, "bfloat16"), spec)
    assert half[0] == pytest.approx(2e12 / 989e12 + spec.kernel_overhead, rel=1e-12)


def test_roofline_memory_bound_uses_bandwidth() -> None:
    spec = device_spec("h100")
    cost = NodeCost(0.0, 0.0, forward_flops=1e6, backward_flops=0.0, saved_bytes=4 * 10**8,
                    io_bytes=8 * 10**8, dtype="float32")
    forward, backward = predicted_times(cost, spec)
    assert forward == pytest.approx(8e8 / 3.35e12 + spec.kernel_overhead, rel=1e-12)
    assert backward == pytest.approx(2 * 8e8 / 3.35e12 + spec.kernel_overhead, rel=1e-12)
    # Same node on an H200: only the bandwidth differs.
    h200 = predicted_times(cost, device_spec("h200"))
    assert h200[0] == pytest.approx(8e8 / 4.8e12 + spec.kernel_overhead, rel=1e-12)


def test_roofline_no_backward_without_flops_or_saved_tensors() -> None:
    spec = device_spec("a100")
    forward, backward = predicted_times(NodeCost(0, 0, 0.0, 0.0, 0, 1000, "float32"), spec)
    assert backward == 0.0
    assert forward == pytest.approx(1000 / spec.memory_bandwidth + spec.kernel_overhead)


def test_roofline_unknown_dtype_uses_fp32_peak() -> None:
    spec = device_spec("h100")
    assert spec.peak("int64") == spec.peak("float32") == 67e12
    assert spec.peak("float16") == 989e12


def test_roofline_on_profiled_nodes(mlp_costs: dict[str, NodeCost]) -> None:
    spec = DEVICES["h100"]
    for cost in mlp_costs.values():
        forward, backward = predicted_times(cost, spec)
        assert forward == pytest.approx(
            max(cost.forward_flops / spec.peak(cost.dtype), cost.io_bytes / spec.memory_bandwidth)
            + spec.kernel_overhead
        )
        assert backward > 0  # every node here has saved tensors or backward FLOPs
    big = NodeCost(0, 0, 2 * 1024**3, 4 * 1024**3, 0, 1024, "float32")
    small = mlp_costs["relu"]
    assert predicted_times(big, spec)[0] > predicted_times(small, spec)[0]


def test_unknown_device_name() -> None:
    from partitioner.errors import AutopartitionError

    with pytest.raises(AutopartitionError, match="Unknown device 'tpu'"):
        device_spec("tpu")
    assert device_spec("H100") is DEVICES["h100"]


# ----------------------------------------------------------------- side effects


class _WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.lin(x))))


@pytest.mark.parametrize("measure", [False, True])
@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_profiling_leaves_model_state_alone(method: str, measure: bool) -> None:
    torch.manual_seed(0)
    model = _WithBatchNorm().train()
    inputs = (torch.randn(16, 4),)
    captured = _captured(model, inputs, method)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_graph = {k: v.clone() for k, v in captured.graph_module.state_dict().items()}
    profile(captured, inputs, measure=measure, warmup=1, repeats=2)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == [], f"profiling changed the model's {changed}"
    changed = [k for k, v in captured.graph_module.state_dict().items() if not torch.equal(v, before_graph[k])]
    assert changed == [], f"profiling changed the captured graph's {changed}"


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_profiling_leaves_no_gradients(method: str) -> None:
    model = _mlp()
    inputs = (torch.randn(B, IN),)
    captured = _captured(model, inputs, method)
    profile(captured, inputs, measure=True, warmup=0, repeats=1)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in captured.graph_module.parameters())
    assert all(p.requires_grad for p in model.parameters())


def test_profiling_keeps_existing_gradients() -> None:
    """A model planned mid-training keeps the gradients it has accumulated."""
    model = _mlp()
    inputs = (torch.randn(B, IN),)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    captured = _captured(model, inputs)
    profile(captured, inputs, measure=True, warmup=0, repeats=1)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"profiling dropped {name}.grad"
        assert torch.equal(p.grad, torch.full_like(p, 0.5)), name


def test_cpu_flash_attention_counts_its_matmuls() -> None:
    # scaled_dot_product_attention on CPU (and CPU fake) tensors runs a kernel torch's
    # FLOP registry does not list; its two matmuls must still be counted, fwd and bwd.
    from partitioner.cost.nodes import _FlopCount

    b, h, t, d = 2, 4, 16, 8
    q = torch.randn(b, h, t, d, requires_grad=True)
    with _FlopCount() as forward:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert forward.total == 2 * (2 * b * h * t * t * d)  # QK^T and (softmax)V
    with _FlopCount() as backward:
        out.sum().backward()
    assert backward.total == 5 * (b * h * t * t * d) * 2  # 5 matmuls of the same size


def test_weight_gradient_share_is_measured() -> None:
    """A linear on an activation times its parameters' backward alone (about half its backward);
    one on the graph's input has no input gradient to compute: its whole backward is W."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    inputs = (torch.randn(64, 256),)
    costs = profile(_captured(model, inputs), inputs, measure=True, warmup=1, repeats=5)
    first, second = [n for n, c in costs.items() if c.weight_bytes]
    assert costs[first].weight_backward_s == pytest.approx(costs[first].backward_s)
    assert 0 < costs[second].weight_backward_s < costs[second].backward_s
    assert all(c.weight_backward_s == 0 for c in costs.values() if not c.weight_bytes)


def test_in_situ_backward_times_replace_isolated_ones() -> None:
    """Nodes clocked inside the real backward take those seconds; the others share the rest of it."""
    def cost(backward: float) -> NodeCost:
        return NodeCost(1.0, backward, 0.0, 0.0, 0, 0, "float32", weight_backward_s=backward / 2)

    costs = {"a": cost(1.0), "b": cost(2.0), "c": cost(1.0)}
    got = _calibrated(costs, {"a": 0.5}, {"a": 3.0}, 7.0)
    assert [got[k].backward_s for k in "abc"] == pytest.approx([3.0, 8 / 3, 4 / 3])  # rest 4 over b, c's 3
    assert [got[k].weight_backward_s for k in "abc"] == pytest.approx([1.5, 4 / 3, 2 / 3])  # same share
    assert (got["a"].forward_s, got["b"].forward_s) == (0.5, 1.0)


def test_measured_times_sum_to_a_plain_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clocks say how a pass divides among nodes; plain passes (no clocks) say how long it takes."""
    from partitioner.cost import nodes as cost

    inputs = (torch.randn(B, IN),)
    captured = _captured(_mlp(), inputs)
    forward_s, backward_s = 1.0, 3.0  # a plain pass far slower than any clocked one: the scale must follow
    monkeypatch.setattr(cost, "_plain_pass", lambda *_args: (forward_s, backward_s))
    costs = profile(captured, inputs, measure=True)
    # Medians of nodes against the mean of sums: equal up to the spread of the clocked passes.
    assert sum(c.forward_s for c in costs.values()) == pytest.approx(forward_s, rel=0.3)
    # The backward's nodes share it, less what runs before the first node's backward (autograd's
    # start, large against this tiny MLP's microseconds; unscaled, they would sum to microseconds).
    assert 0.3 * backward_s < sum(c.backward_s for c in costs.values()) <= 1.01 * backward_s
