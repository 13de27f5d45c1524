"""Issue 19 item 5: an MFU above 100%, and plans hand-edited into a crash inside torch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.cost.calibration import Calibration
from partitioner.cost.devices import DEVICES
from partitioner.errors import PlanFormatError
from partitioner.plan import Plan
from partitioner.search import planner
from partitioner.search.assemble import mfu_peak_flops

# ----------------------------------------------------------------- MFU


def _mlp(dtype: torch.dtype = torch.float32, width: int = 512, *, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(4))).to(dtype)


def _check_mfu(plan: Plan) -> float:
    """The plan's MFU, checked against its own numbers without the cap (which would hide a wrong peak)."""
    p = plan.predicted
    assert p.model_flops and p.mfu is not None and plan.cost_model.peak_flops
    raw = p.model_flops / (plan.gpus * plan.cost_model.peak_flops * p.step_s)
    assert raw <= 1.0 + 1e-9, f"MFU {100 * raw:.1f}%: model FLOPs run faster than the peak they are divided by"
    assert p.mfu == pytest.approx(raw)
    return raw


def test_mfu_of_a_bf16_model_planned_at_fp32_uses_the_bf16_peak() -> None:
    """The roofline ran the bf16 matmuls at the bf16 peak but the MFU divided by the fp32 one: 230% for a GPT."""
    plan = planner.compile(_mlp(torch.bfloat16, 1024, device="meta"), (torch.randn(2048, 1024, dtype=torch.bfloat16),),
                           gpus=2, device="h100", microbatches=2, pp=1, dp=2)
    mfu = _check_mfu(plan)
    assert plan.cost_model.peak_flops == pytest.approx(DEVICES["h100"].peak("bfloat16"))
    assert 0.1 < mfu  # large bf16 matmuls: a good share of the bf16 peak


def test_mfu_of_an_fp32_model_keeps_the_datasheet_peak() -> None:
    plan = planner.compile(_mlp(), (torch.randn(256, 512),), gpus=2, device="h100", microbatches=2, pp=1, dp=2)
    _check_mfu(plan)
    assert plan.cost_model.peak_flops == pytest.approx(DEVICES["h100"].peak("float32"))


def test_mfu_under_a_calibration_faster_than_the_roofline() -> None:
    """A calibration that makes every node 10x faster than the roofline: the peak was no peak."""
    plan = planner.compile(_mlp(width=1024, device="meta"), (torch.randn(2048, 1024),), gpus=2, device="h100",
                           microbatches=2,
                           pp=1, dp=2, calibration=Calibration(scale=0.1))
    _check_mfu(plan)
    assert (plan.cost_model.peak_flops or 0) > DEVICES["h100"].peak("float32")


def test_measured_mfu_against_a_peak_the_cpu_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 14M GPT measured on CPU ranks: 105.7% MFU against the cpu spec's rough 50 GFLOP/s, which is no peak.

    The spec's number is cut here to 1 MFLOP/s so that any machine beats it.
    """
    monkeypatch.setitem(DEVICES, "cpu", dataclasses.replace(DEVICES["cpu"], peak_flops={"float32": 1e6}))
    plan = planner.compile(_mlp(width=128), (torch.randn(64, 128),), gpus=2, device="cpu", microbatches=2,
                           pp=1, dp=2, remeasure=True)
    _check_mfu(plan)
    assert (plan.cost_model.peak_flops or 0) > 1e6


def test_mfu_peak_is_weighted_by_where_the_flops_run() -> None:
    flops, dtypes = {"mm": 3e12, "half": 1e12, "view": 0.0}, {"mm": "float32", "half": "bfloat16", "view": "float32"}
    seconds = {"mm": 1.0, "half": 1.0, "view": 0.0}
    h100 = DEVICES["h100"]
    peak = mfu_peak_flops(flops, seconds, dtypes, spec=h100, precision="fp32")
    assert peak == pytest.approx(4e12 / (3e12 / h100.peak("float32") + 1e12 / h100.peak("bfloat16")))
    # bf16-mixed runs the float32 node in bfloat16 too: one peak for all
    assert mfu_peak_flops(flops, seconds, dtypes, spec=h100, precision="bf16-mixed") == pytest.approx(
        h100.peak("bfloat16"))
    assert mfu_peak_flops({"view": 0.0}, {}, {}, spec=h100, precision="fp32") is None


# ----------------------------------------------------------------- hand-edited plan.json


@pytest.mark.parametrize("command", ["verify", "run"])
def test_an_edited_batch_size_stops_before_any_rank_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str], command: str) -> None:
    """A batch_size edited in plan.json aborted a rank inside gloo (SIGABRT); now: exit 2 with what to do."""
    from partitioner.cli import main
    from partitioner.plan import example_plan
    from runtime import verify
    from runtime.launch import torchrun as launch

    def no_ranks(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("ranks started on a corrupt plan")

    monkeypatch.setattr(verify, "verify_plan", no_ranks)
    monkeypatch.setattr(launch, "run_plan", no_ranks)
    directory = example_plan().save(tmp_path / "plan")
    data = json.loads((directory / "plan.json").read_text())
    data["batch_size"] = 8
    (directory / "plan.json").write_text(json.dumps(data))
    args = ["verify", str(directory), "--model", "examples/gpt.py"] if command == "verify" else \
        ["run", str(directory), "--", "train.py"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "plan.model.inputs[0] (x) holds micro-batches of 2 samples" in err
    assert "batch_size / (dp x microbatches) = 8 / (1 x 2) = 4" in err and "--batch-size" in err
    with pytest.raises(PlanFormatError):
        Plan.load(directory)
