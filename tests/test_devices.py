"""Device numbers: the datasheet peaks and the two links every GPU spec carries."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.cost.devices import DEVICES, DeviceSpec


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


def test_specs_without_inter_node_numbers_still_build() -> None:
    cpu = DEVICES["cpu"]
    assert cpu.inter_node_bandwidth is None and cpu.inter_node_latency is None
    made = DeviceSpec("x", {"float32": 1e12}, 1e11, 2**30, 1e10, 1e-5, 1e-6)  # the fields before issue 8
    assert made.inter_node_bandwidth is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.link_bandwidth = 0.0  # type: ignore[misc]
