"""Per-op-class efficiencies and the 500 W Grand Teton H100 (issue 23): where they change a predicted time, and where not."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.cost.devices import (
    A100_EFFICIENCY,
    AMPERE_RUNS,
    BLACKWELL_EFFICIENCY,
    BLACKWELL_RUNS,
    DEVICES,
    H100_500W_PEAK_SHARE,
    H100_EFFICIENCY,
    HOPPER_RUNS,
    device_spec,
)
from partitioner.cost.nodecost import OP_CLASSES, NodeCost, op_class, predicted_times
from partitioner.solve.formulate import node_times

MATMUL = NodeCost(0.0, 0.0, 989e9, 1978e9, 0, 1_000, "bfloat16", weight_bytes=500)  # compute-bound, reads weights
ATTENTION = NodeCost(0.0, 0.0, 989e9, 1978e9, 0, 1_000, "bfloat16")  # compute-bound, no weights
ELEMENTWISE = NodeCost(0.0, 0.0, 0.0, 0.0, 10, 3_350_000_000, "bfloat16")  # 1 s of bytes at 3.35 TB/s


def test_each_class_scales_only_its_own_ops() -> None:
    bare = dataclasses.replace(DEVICES["h100"], efficiency=())
    for cls in OP_CLASSES:
        spec = dataclasses.replace(bare, efficiency=((cls, 0.5),))
        for cost, its_class in ((MATMUL, "matmul"), (ATTENTION, "attention"), (ELEMENTWISE, "memory")):
            slow, fast = predicted_times(cost, spec), predicted_times(cost, bare)
            overhead = spec.kernel_overhead
            expected = 2.0 if cls == its_class else 1.0  # half the peak (FLOPs or bandwidth): twice the time
            assert (slow[0] - overhead) == pytest.approx(expected * (fast[0] - overhead)), (cls, cost)
            assert (slow[1] - overhead) == pytest.approx(expected * (fast[1] - overhead)), (cls, cost)
    assert [op_class(c) for c in (MATMUL, ATTENTION)] == ["matmul", "attention"]


def test_fp8_matmuls_take_their_own_share_or_the_matmul_one() -> None:
    """Under --precision fp8 a linear layer's matmul is priced at the FP8 peak times ``fp8-matmul``'s share, and
    at ``matmul``'s where the device gives none; bf16 matmuls never take the FP8 share."""
    fp8 = dataclasses.replace(MATMUL, dtype="float8_e4m3fn")
    assert op_class(fp8) == "fp8-matmul"
    bare = dataclasses.replace(DEVICES["h100"], efficiency=())
    base = predicted_times(fp8, bare)[0] - bare.kernel_overhead
    for efficiency, share in (((("matmul", 0.5),), 0.5), ((("matmul", 0.5), ("fp8-matmul", 0.25)), 0.25)):
        spec = dataclasses.replace(bare, efficiency=efficiency)
        assert predicted_times(fp8, spec)[0] - spec.kernel_overhead == pytest.approx(base / share)
        assert predicted_times(MATMUL, spec)[0] - spec.kernel_overhead == pytest.approx(
            (predicted_times(MATMUL, bare)[0] - bare.kernel_overhead) / 0.5)


def test_measured_times_ignore_the_efficiencies() -> None:
    measured = {"mm": dataclasses.replace(MATMUL, forward_s=0.25, backward_s=0.5)}
    assert node_times(measured, DEVICES["h100"], measure=True) == {"mm": (0.25, 0.5)}


def test_each_generation_carries_its_fitted_efficiencies_and_names_the_runs() -> None:
    """Hopper and Ampere devices: their generation's fitted shares and the published runs fitted (a third at most
    of that generation's runs, tools/published); measured CPU ranks: none."""
    from tools.published import RUNS

    for efficiency, runs, names in ((H100_EFFICIENCY, HOPPER_RUNS, ("h100", "h100-500w", "h200")),
                                    (A100_EFFICIENCY, AMPERE_RUNS, ("a100", "a100-40gb", "a100-opa")),
                                    (BLACKWELL_EFFICIENCY, BLACKWELL_RUNS, ("b200", "gb200", "b300"))):
        # Every class but fp8-matmul, which falls back to matmul where not fitted apart.
        assert set(OP_CLASSES) - {"fp8-matmul"} <= {k for k, _ in efficiency} <= set(OP_CLASSES)
        for name in names:
            assert DEVICES[name].efficiency == efficiency and DEVICES[name].calibrated_by == runs
        generation = {r.name: r for r in RUNS}
        assert all(generation[r].role == "fit" and generation[r].device in names for r in runs)
        priced = [r for r in RUNS if r.device in names and not r.unpriced]
        assert 3 * len(runs) <= len(priced), (len(runs), len(priced))
    # Blackwell's only dense runs are FP8 (Megatron-Bridge): its shares are fitted to FP8 runs.
    assert all(r.fp8 for r in RUNS if r.name in BLACKWELL_RUNS)
    assert all(DEVICES["cpu"].efficiency_of(c) == 1.0 for c in OP_CLASSES) and not DEVICES["cpu"].calibrated_by


def test_every_other_gpu_is_the_bare_roofline_and_says_so() -> None:
    """The accelerators no published run calibrates (AMD Instinct, L40S): no efficiencies, no runs named,
    none borrowed from Hopper, Ampere or Blackwell, and a report that says so; no run on them is fitted."""
    from partitioner.plan import example_plan
    from partitioner.report.table import device_summary
    from tools.published import GENERATIONS, RUNS

    fitted = {"a100", "a100-40gb", "a100-opa", "h100", "h100-500w", "h200", "h800", "b200", "gb200", "b300", "cpu"}
    others = sorted(set(DEVICES) - fitted)
    assert {"mi300x", "mi325x", "mi355x", "l40s"} <= set(others)
    for name in others:
        spec = DEVICES[name]
        assert spec.efficiency == () and spec.calibrated_by == (), name
        assert all(spec.efficiency_of(c) == 1.0 for c in OP_CLASSES)
        assert GENERATIONS.get(name) not in ("ampere", "hopper", "blackwell")
        assert not any(r.device == name and r.role == "fit" for r in RUNS)
        plan = example_plan()
        plan = dataclasses.replace(plan, device=name, cost_model=dataclasses.replace(
            plan.cost_model, source=f"predicted for {name}", efficiency=spec.efficiency, calibrated_by=spec.calibrated_by))
        assert device_summary(plan) == f"{name}: no published run calibrates it: the bare datasheet roofline " \
            "(every op at its peak)"


def test_the_500w_grand_teton_h100() -> None:
    sxm, titan = DEVICES["h100"], device_spec("H100-500W")
    assert 835 / 989 - 1e-12 <= H100_500W_PEAK_SHARE <= 1.0  # between the H100 NVL and SXM datasheets
    assert titan.peak("bfloat16") == pytest.approx(sxm.peak("bfloat16") * H100_500W_PEAK_SHARE)
    assert (titan.memory_bandwidth, titan.memory_bytes) == (2.4e12, 96 * 10**9)  # HBM2e, torchtitan's benchmark page
    assert (titan.link_bandwidth, titan.inter_node_bandwidth) == (sxm.link_bandwidth, sxm.inter_node_bandwidth)
    # Same kernels, slower memory: an elementwise op takes 3.35 / 2.4 as long, a matmul 1 / share as long.
    ratio = (predicted_times(ELEMENTWISE, titan)[0] - titan.kernel_overhead) / (
        predicted_times(ELEMENTWISE, sxm)[0] - sxm.kernel_overhead)
    assert ratio == pytest.approx(3.35 / 2.4)
    ratio = (predicted_times(MATMUL, titan)[0] - titan.kernel_overhead) / (
        predicted_times(MATMUL, sxm)[0] - sxm.kernel_overhead)
    assert ratio == pytest.approx(1 / H100_500W_PEAK_SHARE)
