"""Device numbers: the datasheet peaks and the two links every GPU spec carries."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch

from partitioner.cost.devices import DEVICES, DeviceSpec, device_spec
from partitioner.errors import AutopartitionError


@pytest.mark.parametrize(
    ("name", "fp32", "bf16"),
    [("a100", 19.5e12, 312e12), ("h100", 67e12, 989e12), ("h200", 67e12, 989e12)],
)
def test_dense_peaks(name: str, fp32: float, bf16: float) -> None:
    spec = DEVICES[name]
    assert spec.peak("float32") == fp32
    assert spec.peak("bfloat16") == spec.peak("float16") == bf16
    assert spec.peak("float64") == fp32  # a dtype without its own peak falls back to fp32


@pytest.mark.parametrize(
    ("name", "nvlink", "network"), [("a100", 300e9, 25e9), ("h100", 450e9, 50e9), ("h200", 450e9, 50e9)]
)
def test_intra_and_inter_node_links(name: str, nvlink: float, network: float) -> None:
    spec = DEVICES[name]
    assert (spec.link_bandwidth, spec.inter_node_bandwidth) == (nvlink, network)  # 200 / 400 Gb/s per GPU
    assert spec.inter_node_latency is not None and spec.inter_node_latency > spec.link_latency


# The accelerators of 2026 (issue 33), from their datasheets (partitioner/cost/devices.py cites each): dense FP32
# and BF16/FP16 peaks, memory, its bandwidth, the scale-up link and the network port per GPU, one direction.
NEW_DEVICES = {
    "b200": (75e12, 2.25e15, 180e9, 7.7e12, 900e9, 50e9),
    "gb200": (80e12, 2.5e15, 186e9, 8e12, 900e9, 50e9),
    "b300": (75e12, 2.25e15, 270e9, 7.7e12, 900e9, 100e9),
    "mi300x": (163.4e12, 1307.4e12, 192e9, 5.3e12, 448e9, 50e9),
    "mi325x": (163.4e12, 1307.4e12, 256e9, 6e12, 448e9, 50e9),
    "mi355x": (157.3e12, 2.5e15, 288e9, 8e12, 537.6e9, 50e9),
    "l40s": (91.6e12, 362.05e12, 48e9, 0.864e12, 32e9, 25e9),
}


@pytest.mark.parametrize("name", sorted(NEW_DEVICES))
def test_the_devices_of_2026_carry_their_datasheet_numbers(name: str) -> None:
    fp32, half, memory, bandwidth, link, network = NEW_DEVICES[name]
    spec = device_spec(name.upper())
    assert spec.name == name and spec.peak("float32") == fp32
    assert spec.peak("bfloat16") == spec.peak("float16") == half
    assert (spec.memory_bytes, spec.memory_bandwidth) == (int(memory), bandwidth)
    assert (spec.link_bandwidth, spec.inter_node_bandwidth) == (link, network)
    assert spec.inter_node_latency is not None and spec.inter_node_latency > spec.link_latency


@pytest.mark.parametrize("name", [  # one of each kind of node (NVLink 5, Infinity Fabric, PCIe) by default
    name if name in ("b200", "mi300x", "l40s") else pytest.param(name, marks=pytest.mark.exhaustive)
    for name in sorted(NEW_DEVICES)])
def test_each_device_of_2026_plans_a_small_gpt(name: str) -> None:
    """examples/gpt.py on 8 of them; the report names what calibrates the device: Blackwell's FP8 runs, or none
    (the bare roofline)."""
    from partitioner.modelfile import load_model_file
    from partitioner.report.table import device_summary
    from partitioner.search.planner import compile

    model_file = load_model_file(str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py"))
    plan = compile(model_file.build(), model_file.example_inputs(16), gpus=8, microbatches=4, device=name,
                   precision="bf16-mixed", time_limit=5.0)
    assert plan.device == name and plan.predicted.step_s > 0
    assert plan.cost_model.peak_flops == pytest.approx(DEVICES[name].peak("bfloat16"))
    if DEVICES[name].calibrated_by:  # Blackwell: fitted to published FP8 runs (tools/published)
        assert "fitted to 3 published runs" in device_summary(plan) and "405b-128-bridge-b200-fp8cs" in device_summary(plan)
    else:
        assert "no published run calibrates it" in device_summary(plan)


def test_the_cli_offers_every_named_device() -> None:
    from partitioner.cli import _DEVICES

    assert set(DEVICES) <= set(_DEVICES) and {"auto", "cuda"} <= set(_DEVICES)


def test_specs_without_inter_node_numbers_still_build() -> None:
    cpu = DEVICES["cpu"]
    assert cpu.inter_node_bandwidth is None and cpu.inter_node_latency is None
    made = DeviceSpec("x", {"float32": 1e12}, 1e11, 2**30, 1e10, 1e-5, 1e-6)  # the fields before issue 8
    assert made.inter_node_bandwidth is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.link_bandwidth = 0.0  # type: ignore[misc]


# ----------------------------------------------------------------- a user's own device (--device FILE)

_FIELDS = {"name": "mine", "peak_flops": {"float32": 19.5e12, "bfloat16": 312e12}, "memory_bytes": 40e9,
           "memory_bandwidth": 1.555e12, "link_bandwidth": 300e9, "link_latency": 1e-5,
           "inter_node_bandwidth": 12.5e9, "inter_node_latency": 1.5e-5,
           "efficiency": {"matmul": 0.6, "attention": 0.5}}


def _write(path: Path, fields: dict[str, object]) -> Path:
    path.write_text(json.dumps(fields))
    return path


def test_a_device_file_in_json_and_toml(tmp_path: Path) -> None:
    spec = device_spec(str(_write(tmp_path / "mine.json", _FIELDS)))
    assert (spec.name, spec.memory_bytes, spec.inter_node_bandwidth) == ("mine", 40_000_000_000, 12.5e9)
    assert spec.efficiency_of("matmul") == 0.6 and spec.efficiency_of("memory") == 1.0
    toml = tmp_path / "mine.toml"
    toml.write_text(textwrap.dedent("""\
        name = "mine"
        memory_bytes = 40e9
        memory_bandwidth = 1.555e12
        link_bandwidth = 300e9
        link_latency = 1e-5
        inter_node_bandwidth = 12.5e9
        inter_node_latency = 1.5e-5
        calibrated_by = ["my-run"]
        [peak_flops]
        float32 = 19.5e12
        bfloat16 = 312e12
        [efficiency]
        matmul = 0.6
        """))
    spec = device_spec(str(toml))
    assert spec.peak("bfloat16") == 312e12 and spec.calibrated_by == ("my-run",)


@pytest.mark.parametrize(("change", "message"), [
    ({"memory_bytes": None}, "missing fields ['memory_bytes']"),
    ({"nvlink": 1}, "unknown fields ['nvlink']"),
    ({"efficiency": {"matmul": 1.5}}, "efficiency.matmul is 1.5"),
    ({"peak_flops": {"bfloat16": 1e12}}, "must give float32"),
    ({"link_bandwidth": -1}, "link_bandwidth is -1"),
])
def test_a_bad_device_file_is_refused_by_name(tmp_path: Path, change: dict[str, object], message: str) -> None:
    fields = {k: v for k, v in {**_FIELDS, **change}.items() if v is not None}
    with pytest.raises(AutopartitionError, match=re.escape(message)):
        device_spec(str(_write(tmp_path / "bad.json", fields)))


def test_the_planner_predicts_for_a_device_file_and_says_who_calibrated_it(tmp_path: Path) -> None:
    from torch import nn

    from partitioner.report.table import device_summary, format_plan
    from partitioner.search.planner import compile

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    path = _write(tmp_path / "mine.json", _FIELDS)
    plan = compile(model, (torch.randn(8, 64),), gpus=2, microbatches=2, device=str(path))
    assert plan.device == "mine" and plan.cost_model.inter_node_bandwidth == 12.5e9
    assert "no published run calibrates it" in device_summary(plan) and "device: mine" in format_plan(plan)
    calibrated = compile(model, (torch.randn(8, 64),), gpus=2, microbatches=2, device="h100")
    assert "fitted to" in device_summary(calibrated), device_summary(calibrated)
