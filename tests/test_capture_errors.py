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
