"""A model that raises on its own example inputs is told so, not to try another capture (issue 19 item 5).

A GPT fed sequences longer than its ``block_size`` indexes past its position
embedding: symbolic tracing records the graph without data, shape propagation
then fails, and the message used to advise ``--capture export`` (which fails the
same way, advising traceable control flow).  Neither capture can help: the
message must name the model's failing line and exception, and say that the model
fails on its own inputs.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from _examples import example as _example
from torch import nn

from partitioner.cli import main
from partitioner.errors import CaptureError
from partitioner.search import planner

ROOT = Path(__file__).resolve().parent.parent
GPT_PY = ROOT / "examples" / "gpt.py"


def _too_long(batch: int = 4) -> tuple[torch.Tensor]:
    gpt = _example("gpt")
    return (torch.zeros(batch, gpt.GPTConfig().block_size + 8, dtype=torch.long),)


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _says_the_model_fails_on_its_inputs(message: str) -> None:
    line = _line_of(GPT_PY, "x = self.wte(idx) + self.wpe(pos)")
    assert f"{GPT_PY}:{line}" in message, message  # the model's own line
    assert "IndexError" in message and "index out of range" in message, message  # and what it raised
    assert "example inputs" in message and "not a capture" in message, message
    assert "--capture export" not in message and "traceable" not in message, message


@pytest.mark.parametrize("method", ["auto", "symbolic_trace", "export"])
def test_inputs_longer_than_block_size(method: str) -> None:
    model = _example("gpt").build_model()
    with pytest.raises(CaptureError) as caught:
        planner.compile(model, _too_long(), gpus=2, device="h100", microbatches=2, pp=2,
                        capture_method=method)  # type: ignore[arg-type]
    _says_the_model_fails_on_its_inputs(str(caught.value))


def test_inputs_longer_than_block_size_from_the_command_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "long_gpt.py"
    path.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        import torch

        spec = importlib.util.spec_from_file_location("_long_gpt_base", {str(GPT_PY)!r})
        gpt = importlib.util.module_from_spec(spec)
        sys.modules["_long_gpt_base"] = gpt
        spec.loader.exec_module(gpt)

        def build_model():
            return gpt.build_model()

        def example_inputs(batch_size):
            return (torch.zeros(batch_size, gpt.GPTConfig().block_size + 8, dtype=torch.long),)
    """))
    assert main([str(path), "--gpus", "2", "--device", "h100", "--out", str(tmp_path / "plan")]) == 2
    _says_the_model_fails_on_its_inputs(" ".join(capsys.readouterr().err.split()))


class _DataDependent(nn.Module):
    """Branches on a tensor's value: no capture records that, though the model runs on its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h * 2 if h.sum() > 0 else h


def test_a_model_that_runs_keeps_the_capture_advice() -> None:
    """The eager run is only a diagnosis: a model that runs on its inputs is not blamed."""
    with pytest.raises(CaptureError) as caught:
        planner.compile(_DataDependent(), (torch.randn(4, 4),), gpus=1, device="h100", microbatches=1)
    assert "Could not capture _DataDependent" in str(caught.value) and "traceable" in str(caught.value)
    assert "not a capture" not in str(caught.value)


class _NormThenNarrow(nn.Module):
    """Updates running statistics, then reads past its bias: the diagnosis must not change the model."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h + self.bias.narrow(0, 0, h.size(1))


def test_the_diagnosis_leaves_the_model_as_it_was() -> None:
    model = _NormThenNarrow()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CaptureError, match="_NormThenNarrow's forward raised RuntimeError") as caught:
        planner.compile(model, (torch.randn(4, 6),), gpus=1, device="h100", microbatches=1)
    assert "test_capture_errors.py" in str(caught.value) and "self.bias.narrow(0, 0, h.size(1))" in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running stats put back


# ----------------------------------------------------------------- models built on meta (issue 32)
# Meta tensors hold no values: an eager run of a meta model fails wherever it reads one, however good
# its inputs are. So a meta model's capture failure is reported as the capture failure, never blamed on
# the inputs.

TESTS_PY = Path(__file__).resolve()


def _blames_no_input(message: str) -> None:
    assert "example inputs" not in message and "not a capture" not in message, message
    assert "forward raised" not in message and "meta tensors" not in message, message


def test_an_uncapturable_meta_model_reports_the_capture_failure() -> None:
    with torch.device("meta"):
        model = _DataDependent()
    with pytest.raises(CaptureError) as caught:
        planner.compile(model, (torch.randn(4, 4),), gpus=1, device="h100", microbatches=1)
    message = str(caught.value)
    assert message.startswith("Could not capture _DataDependent"), message
    line = _line_of(TESTS_PY, "return h * 2 if h.sum() > 0 else h")
    assert f"{TESTS_PY}:{line}" in message, message  # the model's line that stops capture
    _blames_no_input(message)


class _Histc(nn.Module):
    """Counts tokens per expert with ``histc`` on integer ids (Hugging Face's MoE layers off the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).topk(2, dim=-1).indices
        counts = torch.histc(chosen.int(), bins=4, min=0, max=3)  # the line propagation fails at
        return x * counts.sum()


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_a_propagation_failure_on_meta_names_op_module_and_line(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An op fake tensors cannot run (here: integer histc without the planner's own rule) fails value propagation
    after capture: the error names the op, its module and the model's line (found by capturing again with source
    lines), not the inputs."""
    import contextlib

    from partitioner.graph import values

    monkeypatch.setattr(values, "fake_kernels", contextlib.nullcontext)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), _Histc())
    with pytest.raises(CaptureError) as caught:
        planner.compile(model, (torch.randn(4, 8),), gpus=1, device="h100", microbatches=1,
                        capture_method=method)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("Shape propagation failed on the captured graph at node histc"), message
    assert "in 1 (_Histc)" in message and "histogram_cpu" in message, message
    line = _line_of(TESTS_PY, "counts = torch.histc(chosen.int(), bins=4, min=0, max=3)")
    assert f"from {TESTS_PY}:{line} in forward()" in message, message
    _blames_no_input(message)
