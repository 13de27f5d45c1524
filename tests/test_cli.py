"""The ``autopartition`` command line: exit codes, messages, files written, and dispatch."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from partitioner import cli
from partitioner.cli import main, parse_size
from partitioner.errors import AutopartitionError, InfeasibleError, InternalError
from partitioner.plan import Plan, example_plan
from partitioner.report.table import format_plan
from partitioner.search import planner

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")

MLP = """
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential({layers})

def example_inputs(batch_size):
    return (torch.randn(batch_size, 64),)
"""


def _model(tmp_path: Path, layers: int = 2, text: str | None = None) -> str:
    body = text or MLP.format(layers=", ".join(["nn.Linear(64, 64)"] * layers))
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _saved_plan(tmp_path: Path) -> Path:
    return example_plan().save(tmp_path / "plan")


def _error_of(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "autopartition: error:" in err
    # The error's own lines wrap at 100; usage and progress lines ("[autopartition] loading PATH") hold paths.
    assert all(len(line) <= 100 for line in err.splitlines() if not line.startswith(("usage", "[autopartition]")))
    return " ".join(err.split())


# ----------------------------------------------------------------- plan


def test_plan_show_and_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main([GPT, "--gpus", "2", "--batch-size", "8", "--microbatches", "2", "--device", "h100",
                 "--pp", "2"])
    out, err = capfd.readouterr()
    assert code == 0, err
    plan_dir = tmp_path / "plan"
    assert (plan_dir / "plan.json").is_file() and (plan_dir / "stage_0.py").is_file()
    assert (plan_dir / "stage_1.py").is_file()
    plan = Plan.load(plan_dir)
    assert format_plan(plan) in out
    assert "plan saved to plan/" in out
    assert f"autopartition verify plan --model {GPT}" in out
    assert f"autopartition run plan -- {ROOT / 'examples' / 'train_gpt.py'}" in out  # a file that exists
    assert "[autopartition] capturing GPT" in err
    # The schedule is the planner's pick: one stage per rank, or several (interleaved, zbv).
    assert re.search(r"\[autopartition\] chose 2 (stages|pipeline ranks \(\d+ stages\)) x 1 replica,", err), err
    for banner in ("Running HiGHS", "Copyright (c)", "HiGHS run time"):
        assert banner not in out and banner not in err

    assert main(["show", "plan"]) == 0
    out, err = capfd.readouterr()
    assert format_plan(plan) in out and "stage" in out and "wte.weight = lm_head.weight" in out


def test_fixed_batch_from_model_file_and_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    model = _model(tmp_path, text="""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        example_inputs = (torch.randn(6, 8),)
    """)
    assert main([model, "--gpus", "1", "--microbatches", "3", "--device", "a100", "--quiet",
                 "--out", "p1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "batch 6" in out and Plan.load(tmp_path / "p1").batch_size == 6


def test_report_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[Plan, Path]] = []

    def write_report(plan: Plan, directory: Path) -> Path:
        calls.append((plan, Path(directory)))
        return Path(directory) / "report.html"

    fake = types.ModuleType("partitioner.report.markdown")
    fake.write_report = write_report  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "partitioner.report.markdown", fake)
    plan_dir = _saved_plan(tmp_path)
    assert main(["show", str(plan_dir)]) == 0
    assert calls == [(example_plan(), plan_dir)]
    assert f"report: {plan_dir / 'report.html'}" in capsys.readouterr().out


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--memory-per-gpu" in out and "autopartition show plan/" in out
    for command in ("show", "verify", "run"):
        assert main([command, "--help"]) == 0
        assert f"autopartition {command}" in capsys.readouterr().out


def test_python_dash_m() -> None:
    done = subprocess.run([sys.executable, "-m", "partitioner", "show", "/nonexistent/plan"],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "No plan at /nonexistent/plan" in done.stderr


# ----------------------------------------------------------------- bad input


def test_missing_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing.py"), "--gpus", "2"]) == 2
    message = _error_of(capsys)
    assert "missing.py" in message and "does not exist" in message


def test_gpus_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([_model(tmp_path), "--gpus", "0"]) == 2
    assert "argument --gpus: must be at least 1, got 0" in capsys.readouterr().err


def test_no_gpus_and_no_gpu_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_local_gpus", lambda: 0)
    assert main([_model(tmp_path)]) == 2
    message = _error_of(capsys)
    assert "No --gpus given and this machine has no GPU" in message and "`--gpus 4 --device h100`" in message


@pytest.mark.parametrize("value", ["80 potatoes", "lots", "-1GiB", "0", "80"])
def test_bad_memory_per_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main([_model(tmp_path), "--gpus", "2", f"--memory-per-gpu={value}"]) == 2
    assert "argument --memory-per-gpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "size"),
    [("80GiB", 80 * 2**30), ("40GB", 40e9), ("512MiB", 512 * 2**20), ("1.5e9B", 1.5e9),
     ("1KiB", 1024), ("2 tb", 2e12), ("80G", 80 * 2**30), ("80g", 80 * 2**30)],
)
def test_parse_size(text: str, size: float) -> None:
    assert parse_size(text) == size


def test_out_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").write_text("")
    assert main([_model(tmp_path), "--gpus", "1", "--out", str(tmp_path / "taken")]) == 2
    assert "is a file" in _error_of(capsys)


def test_corrupt_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_dir = _saved_plan(tmp_path)
    (plan_dir / "plan.json").write_text("{ this is not json")
    assert main(["show", str(plan_dir)]) == 2
    message = _error_of(capsys)
    assert "not valid JSON" in message and "autopartition model.py" in message


def test_unknown_format_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_dir = _saved_plan(tmp_path)
    data = json.loads((plan_dir / "plan.json").read_text())
    data["format_version"] = 99
    (plan_dir / "plan.json").write_text(json.dumps(data))
    assert main(["show", str(plan_dir)]) == 2
    message = _error_of(capsys)
    assert "format version 99" in message and "Re-plan" in message


def test_missing_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "nothing")]) == 2
    assert "No plan at" in _error_of(capsys)


def test_memory_too_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model(tmp_path, layers=4)
    code = main([model, "--gpus", "2", "--batch-size", "8", "--microbatches", "2", "--device", "h100",
                 "--memory-per-gpu", "1KiB", "--out", str(tmp_path / "plan")])
    assert code == 2
    message = _error_of(capsys)
    assert "per GPU" in message and "GPUs" in message and "--memory-per-gpu" in message
    assert not (tmp_path / "plan").exists()


def test_more_stages_than_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model(tmp_path, layers=2)
    code = main([model, "--gpus", "8", "--pp", "8", "--batch-size", "8", "--microbatches", "1",
                 "--device", "h100", "--out", str(tmp_path / "plan")])
    assert code == 2
    message = _error_of(capsys)
    assert "8 GPUs" in message and "8x1" in message


def test_batch_not_divisible(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([_model(tmp_path), "--gpus", "1", "--batch-size", "10", "--microbatches", "4",
                 "--device", "h100", "--out", str(tmp_path / "plan")])
    assert code == 2
    assert "multiple of 4" in _error_of(capsys)


def test_issue_8_options_reach_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    code = main([_model(tmp_path, layers=4), "--gpus", "4", "--batch-size", "16", "--device", "h100",
                 "--precision", "bf16-mixed", "--optimizer", "sgd", "--recompute", "full", "--gpus-per-node", "2",
                 "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert code == 0
    plan = Plan.load(out)
    assert (plan.precision, plan.optimizer, plan.gpus_per_node) == ("bf16-mixed", "sgd", 2)
    assert plan.cost_model.optimizer_states == 1 and {s.recompute for s in plan.stages} == {"full"}
    # microbatches and schedule default to auto: several of each were tried (not zb-h1 and zbv, which
    # split the backward and so do not recompute)
    assert len({c.microbatches for c in plan.candidates}) > 1
    assert {c.schedule for c in plan.candidates} == {"gpipe", "1f1b", "interleaved-1f1b"}
    assert "bf16-mixed, sgd" in text and "MFU" in text and "2 nodes of 2" in text
    assert format_plan(plan) in text and all(len(line) <= 100 for line in format_plan(plan).splitlines())


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--precision", "fp16"], ["argument --precision: invalid choice: 'fp16'", "fp32", "bf16-mixed", "bf16"]),
        (["--optimizer", "lion"], ["argument --optimizer: invalid choice: 'lion'", "adam", "sgd"]),
        (["--recompute", "half"], ["argument --recompute: invalid choice: 'half'", "auto", "none", "full"]),
        (["--schedule", "zb"], ["argument --schedule: invalid choice: 'zb'", "auto", "gpipe", "1f1b"]),
        (["--microbatches", "many"], ["argument --microbatches: expected a whole number, got 'many' (or auto)"]),
        (["--gpus-per-node", "0"], ["argument --gpus-per-node: must be at least 1, got 0"]),
    ],
)
def test_bad_issue_8_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                           expected: list[str]) -> None:
    assert main([_model(tmp_path), "--gpus", "8", *flags]) == 2
    err = capsys.readouterr().err
    assert all(text in err for text in expected), err


def test_schedule_and_chunks_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    code = main([GPT, "--gpus", "4", "--pp", "2", "--batch-size", "16", "--microbatches", "4", "--device", "h100",
                 "--schedule", "interleaved-1f1b", "--chunks", "2", "--gpus-per-node", "2", "--out", str(out),
                 "--quiet"])
    text = capsys.readouterr().out
    assert code == 0
    plan = Plan.load(out)
    assert (plan.schedule, plan.pp, plan.dp, plan.chunks, plan.stage_ranks()) == (
        "interleaved-1f1b", 2, 2, 2, (0, 1, 0, 1))
    layout = ["pipeline ranks (interleaved-1f1b x2, 2 stages each):", "rank 0 (GPUs 0,1): stages 0, 2",
              "rank 1 (GPUs 2,3): stages 1, 3"]
    assert all(line in text for line in layout) and "stage_0.py … stage_3.py" in text
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert all(line in shown for line in layout)
    report = (out / "report.md").read_text()
    assert "| rank | pipeline rank | stages | replica |" in report and "| 2 | 1 | 1, 3 | 0 |" in report


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--chunks", "0"], "argument --chunks: must be at least 1, got 0"),
        (["--schedule", "1f1b", "--chunks", "2"], "--chunks 2 does not apply to --schedule 1f1b"),
        (["--schedule", "zbv", "--chunks", "4"], "--schedule zbv always holds 2 stages per pipeline rank"),
        (["--schedule", "interleaved-1f1b", "--pp", "2", "--microbatches", "3", "--batch-size", "12"],
         "needs a multiple of 2 micro-batches, not 3"),
    ],
)
def test_bad_chunk_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                         expected: str) -> None:
    assert main([_model(tmp_path), "--gpus", "2", "--device", "h100", *flags]) == 2
    err = capsys.readouterr().err
    assert expected in " ".join(err.split()), err


def test_gpus_per_node_must_divide(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([_model(tmp_path), "--gpus", "8", "--gpus-per-node", "3", "--device", "h100",
                 "--out", str(tmp_path / "plan")])
    assert code == 2
    message = _error_of(capsys)
    assert "--gpus-per-node 3 does not divide --gpus 8" in message and "1, 2, 4, 8" in message
    assert not (tmp_path / "plan").exists()


def test_fits_nowhere_says_how_many_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([_model(tmp_path, layers=4), "--gpus", "2", "--batch-size", "8", "--device", "h100",
                 "--precision", "bf16", "--memory-per-gpu", "20KiB", "--out", str(tmp_path / "plan")])
    assert code == 2
    message = _error_of(capsys)
    assert "over 2 GPUs fits in 20.0 KiB per GPU" in message
    assert "bf16 with adam, 8 bytes per parameter; recomputation where it helps" in message
    # 4 x (64 x 64 + 64) parameters x 8 bytes = 130 KiB: at least 7 GPUs' worth, but one layer (32.5 KiB)
    # does not fit one GPU: no number of stages does.
    assert "Even 4 stages" in message and "130 KiB, at least 7 GPUs' worth" in message


# ----------------------------------------------------------------- failures


def _plan_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> int:
    """``autopartition model.py`` with the planner raising ``error``: the exit code."""
    def broken(*args: Any, **kwargs: Any) -> Plan:
        raise error

    monkeypatch.setattr(planner, "compile", broken)
    return main([_model(tmp_path), "--gpus", "1", "--quiet", "--out", str(tmp_path / "plan")])


@pytest.mark.parametrize("error", [RuntimeError("kaboom"), InternalError("stage 2 flows backward to 1")])
def test_internal_error_is_a_bug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str], error: Exception) -> None:
    assert _plan_raising(tmp_path, monkeypatch, error) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and f"{type(error).__name__}: {error}" in err and "this is a bug" in err
    assert "autopartition: error:" not in err


def test_user_error_exits_2_with_one_paragraph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    error = InfeasibleError("Nothing fits in 1 KiB per GPU; raise --memory-per-gpu.")
    assert _plan_raising(tmp_path, monkeypatch, error) == 2
    assert capsys.readouterr().err == f"autopartition: error: {error}\n"  # no traceback


def test_internal_error_is_not_user_error() -> None:
    assert not issubclass(InternalError, AutopartitionError)


def test_keyboard_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan_raising(tmp_path, monkeypatch, KeyboardInterrupt()) == 130
    assert "interrupted" in capsys.readouterr().err


# ----------------------------------------------------------------- verify and run


def _fake(monkeypatch: pytest.MonkeyPatch, module: str, function: str, result: Any) -> list[Any]:
    calls: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return result

    fake = types.ModuleType(module)
    setattr(fake, function, record)
    monkeypatch.setitem(sys.modules, module, fake)
    return calls


def test_verify_calls_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake(monkeypatch, "runtime.verify", "verify_plan", 0)
    plan_dir = str(_saved_plan(tmp_path))
    assert main(["verify", plan_dir, "--model", "m.py:f", "--steps", "2", "--timeout", "30"]) == 0
    assert main(["verify", plan_dir, "--model", "m.py"]) == 0
    assert calls == [((plan_dir, "m.py:f"), {"steps": 2, "timeout": 30.0}),
                     ((plan_dir, "m.py"), {"steps": 3})]  # no --timeout: the verifier's default


def test_verify_mismatch_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, "runtime.verify", "verify_plan", 1)
    assert main(["verify", str(_saved_plan(tmp_path)), "--model", "m.py"]) == 1


def test_verify_without_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "runtime.verify", None)
    assert main(["verify", str(_saved_plan(tmp_path)), "--model", "m.py"]) == 1
    assert "runtime.verify.verify_plan" in _error_of(capsys)


def test_verify_needs_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(_saved_plan(tmp_path))]) == 2
    assert "--model" in capsys.readouterr().err


def test_run_splits_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake(monkeypatch, "runtime.launch.torchrun", "run_plan", 3)
    plan_dir = str(_saved_plan(tmp_path))
    code = main(["run", plan_dir, "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-endpoint=h:1",
                 "--", "train.py", "--lr", "1", "--", "x"])
    assert code == 3
    assert calls == [((plan_dir, ["--nproc-per-node", "4", "--nnodes", "2", "--rdzv-endpoint=h:1"],
                       ["train.py", "--lr", "1", "--", "x"]), {})]


def test_engine_option_reaches_verify_and_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    verified = _fake(monkeypatch, "runtime.verify", "verify_plan", 0)
    ran = _fake(monkeypatch, "runtime.launch.torchrun", "run_plan", 0)
    plan_dir = str(_saved_plan(tmp_path))
    assert main(["verify", plan_dir, "--model", "m.py", "--engine", "torch"]) == 0
    assert main(["run", plan_dir, "--engine", "torch", "--", "train.py"]) == 0
    assert verified == [((plan_dir, "m.py"), {"steps": 3, "engine": "torch"})]
    assert ran == [((plan_dir, [], ["train.py"]), {"engine": "torch"})]
    assert main(["verify", plan_dir, "--model", "m.py", "--engine", "megatron"]) == 2
    assert "invalid choice: 'megatron'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["verify", "run"])
def test_a_tensor_parallel_plan_is_refused_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str) -> None:
    """Found: `verify` of a --tp 2 plan crashed with a KeyError (an internal error) after starting ranks.
    Tensor-parallel plans run now; under --engine torch, which cannot run them, they are refused before any
    rank starts."""
    base = example_plan()
    plan_dir = dataclasses.replace(base, tp=2, gpus=base.gpus * 2).save(tmp_path / "plan")
    monkeypatch.setattr("runtime.verify.verify_plan", lambda *a, **k: pytest.fail("verify started ranks"))
    monkeypatch.setattr("runtime.launch.torchrun.run_plan", lambda *a, **k: pytest.fail("run started ranks"))
    args = ([command, str(plan_dir), "--model", "m.py", "--engine", "torch"] if command == "verify"
            else [command, str(plan_dir), "--engine", "torch", "--", "t.py"])
    assert main(args) == 2
    error = _error_of(capsys)
    assert "tp=2" in error and "--engine ours" in error, error


def test_the_runtime_entry_points_refuse_a_tensor_parallel_plan_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Called from Python, not only through the CLI: no rank starts for a plan the runtime cannot run."""
    from runtime import verify
    from runtime.launch import torchrun as launch

    base = example_plan()
    zero1 = tuple(dataclasses.replace(s, shard="optimizer", ranks=(2 * s.rank, 2 * s.rank + 1)) for s in base.stages)
    plan_dir = dataclasses.replace(base, tp=2, dp=2, gpus=base.gpus * 4, stages=zero1,
                                   batch_size=base.batch_size * 2).save(tmp_path / "plan")
    monkeypatch.setattr(verify, "start_ranks", lambda *a, **k: pytest.fail("verify started ranks"))
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("run started torchrun"))
    with pytest.raises(AutopartitionError, match="--shard none or full"):
        launch.run_plan(str(plan_dir), [], ["t.py"])
    tp_dir = dataclasses.replace(base, tp=2, gpus=base.gpus * 2).save(tmp_path / "tp")
    with pytest.raises(AutopartitionError, match="--engine ours"):
        verify.verify(str(tp_dir), "m.py", engine="torch")
    with pytest.raises(AutopartitionError, match="--engine ours"):
        launch.run_plan(str(tp_dir), [], ["t.py"], engine="torch")


def test_run_needs_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(_saved_plan(tmp_path)), "train.py"]) == 2
    message = _error_of(capsys)
    assert "after `--`" in message and "did you mean `-- train.py`" in message


def test_run_without_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "runtime.launch.torchrun", None)
    assert main(["run", str(_saved_plan(tmp_path)), "--", "train.py"]) == 1
    assert "runtime.launch.torchrun.run_plan" in _error_of(capsys)


def test_cli_module_exports() -> None:
    assert sorted(cli.__all__) == ["main", "parse_size"]


# ----------------------------------------------------------------- issue 10: CLI and output


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("autopartition ")


def test_gpus_default_to_the_local_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_local_gpus", lambda: 2)
    assert main([_model(tmp_path), "--device", "h100", "--out", str(tmp_path / "plan")]) == 0
    err = capsys.readouterr().err
    assert "[autopartition] planning for 2 GPUs (the GPUs on this machine" in err
    assert Plan.load(tmp_path / "plan").gpus == 2 and "CPU timings" not in err


def test_progress_is_one_line_per_phase_out_of_the_nodes_announced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a terminal: one line for costing, its total the node count announced; auto without a GPU says so."""
    monkeypatch.setattr(cli, "_local_gpus", lambda: 0)
    assert main([_model(tmp_path, layers=12), "--gpus", "2", "--pp", "1", "--batch-size", "8",
                 "--microbatches", "2", "--out", str(tmp_path / "plan")]) == 0
    err = capsys.readouterr().err
    assert "no GPU here: planning with CPU timings" in err and "--device h100" in err
    announced = next(line for line in err.splitlines() if " compute nodes with " in line).split()[2]
    costs = [line for line in err.splitlines() if "ing costs: " in line]
    assert len(costs) == 1 and f"measuring costs: {announced}/{announced} nodes in " in costs[0]
    assert "chose 1 stage x 2 replicas" in err and "\r" not in err


def _capture_failure(tmp_path: Path) -> str:
    return _model(tmp_path, text="""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(16, 16)

            def forward(self, x):
                h = self.a(x)
                if h.sum() > 0:
                    h = h * 2
                return h

        def build_model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 16),)
    """)


@pytest.mark.slow
def test_capture_failure_prints_only_our_paragraph(tmp_path: Path) -> None:
    """Issue 10: torch's symbolic_shapes warning and a 25-line graph dump came before our message."""
    command = [sys.executable, "-m", "partitioner", _capture_failure(tmp_path), "--gpus", "2", "--device", "h100",
               "--out", str(tmp_path / "plan")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("autopartition: error:"))
    assert all(line.startswith("[autopartition] ") for line in lines[:first]), done.stderr
    assert "Could not capture Net" in done.stderr and "def forward" not in done.stderr
    assert "symbolic_shapes" not in done.stderr and len(lines) - first <= 10
    verbose = subprocess.run([*command, "--verbose"], check=False, capture_output=True, text=True, cwd=ROOT,
                             timeout=300)
    assert verbose.returncode == 2 and "def forward" in verbose.stderr  # what was hidden, on request


def test_out_keeps_another_models_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = dataclasses.replace(example_plan(), model=dataclasses.replace(example_plan().model, class_name="GPT"))
    other.save(tmp_path / "plan")
    args = [_model(tmp_path), "--gpus", "1", "--device", "h100", "--out", str(tmp_path / "plan")]
    assert main(args) == 2
    message = _error_of(capsys)
    assert "holds the plan of another model: a GPT with graph fingerprint 0123456789abcdef" in message
    assert "while this Sequential from" in message and "--force" in message
    assert Plan.load(tmp_path / "plan").model.class_name == "GPT"
    assert main([*args, "--force"]) == 0
    assert Plan.load(tmp_path / "plan").model.class_name == "Sequential"
    capsys.readouterr()
    assert main(args) == 0  # the same model again: replaced, and said
    assert f"replacing the plan for Sequential in {tmp_path / 'plan'}" in capsys.readouterr().err


GPT_MEDIUM = f"{GPT}:gpt_medium"
OTHER_GPT = """
import torch
from torch import nn

class GPT(nn.Module):  # another model of the same class name as examples/gpt.py's
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(512, 32)
        self.head = nn.Linear(32, 512)

    def forward(self, idx):
        return self.head(self.wte(idx))

def build_model():
    torch.manual_seed(0)
    return GPT()

def example_inputs(batch_size):
    return (torch.zeros(batch_size, 32, dtype=torch.long),)
"""


def test_out_tells_models_apart_by_fingerprint_not_class_name(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 19: --out replaced another model's plan because both classes are named GPT."""
    out = tmp_path / "plan"
    common = ["--gpus", "1", "--device", "h100", "--batch-size", "4", "--out", str(out)]
    assert main([GPT, *common]) == 0
    first = Plan.load(out)
    other = _model(tmp_path, text=OTHER_GPT)
    for spec in (GPT_MEDIUM, other):  # two other GPTs: refused before planning
        capsys.readouterr()
        assert main([spec, *common]) == 2
        message = _error_of(capsys)
        assert f"holds the plan of another model: a GPT with graph fingerprint {first.model.fingerprint} from {GPT}" \
            in message and "--force" in message
        assert Plan.load(out) == first  # kept
    assert first.model.source == GPT  # recorded: the model file (resolved) the plan was made from
    assert main([other, *common, "--force"]) == 0
    assert Plan.load(out).model.source == other
    capsys.readouterr()
    assert main([other, *common, "--batch-size", "8"]) == 0  # the same model file again: replaced
    assert f"replacing the plan for GPT in {out}" in capsys.readouterr().err


def test_out_replaces_a_plan_of_the_same_graph_from_elsewhere(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A plan without a model file (made from Python, or before plans recorded one): the fingerprint decides."""
    out = tmp_path / "plan"
    common = ["--gpus", "1", "--device", "h100", "--batch-size", "4", "--out", str(out)]
    original = _model(tmp_path, text=OTHER_GPT)
    assert main([original, *common]) == 0
    data = json.loads((out / "plan.json").read_text())
    data["model"].pop("source", None)
    (out / "plan.json").write_text(json.dumps(data))
    copy = tmp_path / "copy_of_model.py"
    copy.write_text(Path(original).read_text())
    capsys.readouterr()
    assert main([str(copy), *common]) == 0
    assert f"replacing the plan for GPT in {out}{os.sep} (the same graph)" in capsys.readouterr().err
    assert Plan.load(out).model.source == str(copy)
    assert main([GPT, *common]) == 2  # another file, another graph
    assert "holds the plan of another model" in _error_of(capsys)


def test_out_refuses_a_directory_of_other_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "stage_1.py").write_text("# mine")
    assert main([_model(tmp_path), "--gpus", "1", "--device", "h100", "--out", str(tmp_path / "src")]) == 2
    assert "already holds files but no plan.json" in _error_of(capsys)
    assert (tmp_path / "src" / "stage_1.py").read_text() == "# mine"


def test_next_step_hints_name_files_that_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    model = _model(tmp_path)
    assert main([model, "--gpus", "1", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    verify = next(line for line in out.splitlines() if "autopartition verify" in line)
    run = next(line for line in out.splitlines() if "autopartition run" in line)
    assert verify.split("--model ")[1] == model and Path(model).is_file()
    script = run.split(" -- ")[1].split("  #")[0]
    assert Path(script).is_file() and script.endswith("train_gpt.py") and "copy it for your model" in run


def test_verify_says_what_is_starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    _fake(monkeypatch, "runtime.verify", "verify_plan", 0)
    assert main(["verify", str(_saved_plan(tmp_path)), "--model", "m.py", "--steps", "1"]) == 0
    assert ("[autopartition] verify: starting 2 CPU ranks (2 stages x 1 replica) for 1 step"
            in capsys.readouterr().err)


@pytest.mark.parametrize(("preset", "expected"), [(None, "1"), ("4", "4")])
def test_run_sets_omp_threads_and_says_what_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str], preset: str | None,
                                                   expected: str) -> None:
    """torchrun prints its OMP_NUM_THREADS banner only when the variable is unset: set it (1) for the ranks."""
    from runtime.launch import torchrun as launch

    seen: list[dict[str, str]] = []

    def fake_run(command: list[str], *, env: dict[str, str], job: Path, grace: float) -> tuple[int, None]:
        seen.append(env)
        return 0, None

    monkeypatch.setattr(launch, "_supervise", fake_run)
    if preset is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["run", str(_saved_plan(tmp_path)), "--", str(script)]) == 0
    assert seen[0]["OMP_NUM_THREADS"] == expected
    err = capsys.readouterr().err
    assert f"run: starting 2 ranks per node with torchrun for 2 stages x 1 replica (OMP_NUM_THREADS={expected})" in err


@pytest.mark.slow  # captures a Hugging Face model at several micro-batch sizes (~10 s)
def test_hugging_face_example_command_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The example's own command used to stop after solving every shape: GPT-2 exported at one
    # sample per micro-batch is another graph. Such shapes are now planned on their own graph.
    pytest.importorskip("transformers")
    code = main([str(ROOT / "examples" / "hf_gpt2.py"), "--gpus", "4", "--batch-size", "16",
                 "--microbatches", "4", "--out", str(tmp_path / "plan"), "--quiet"])
    assert code == 0
    plan = Plan.load(tmp_path / "plan")  # validated: boundary shapes agree with its micro-batch size
    assert not [c for c in plan.candidates if c.note.startswith("graph differs")]


# ----------------------------------------------------------------- calibrate


def test_calibrate_then_plan_with_the_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from partitioner.orders import Action
    from partitioner.schedule.timeline import TimelineEvent, write_chrome_trace

    model = _model(tmp_path, layers=4)
    first, second = tmp_path / "plan", tmp_path / "again"
    common = ["--gpus", "2", "--pp", "2", "--batch-size", "8", "--microbatches", "2", "--schedule", "gpipe",
              "--device", "h100", "--quiet"]
    assert main([model, *common, "--out", str(first)]) == 0
    plan = Plan.load(first)
    # A run whose every compute action took 1.5x its prediction + 20 us, twice (two steps).
    events, clock = [], 0.0
    for _ in range(2):
        for rank, row in enumerate(plan.actions):
            for name in row:
                a = Action.parse(name)
                if a.kind in "FB":
                    p = plan.stages[a.stage].predicted
                    d = 1.5 * (p.forward_s if a.kind == "F" else p.backward_s) + 20e-6
                    events.append(TimelineEvent(rank, name, name, a.microbatch, a.kind, clock, clock + d))
                    clock += d
    trace = write_chrome_trace(tmp_path / "trace.json", events, title="measured", pid=1)
    capsys.readouterr()
    assert main(["calibrate", str(first), str(trace), "-o", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "fit: measured = 1.500 x predicted + 20 us per action" in out and "--calibration" in out
    assert "actions spread 0%" in out  # every action as long as its stage's others: no jitter
    assert main([model, *common, "--out", str(second), "--calibration", str(tmp_path / "c.json")]) == 0
    again = Plan.load(second)
    assert (again.cost_model.calibration_scale, again.cost_model.action_host_s) == pytest.approx((1.5, 20e-6))
    assert again.cost_model.action_jitter == 0.0
    for old, new in zip(plan.stages, again.stages, strict=True):  # the same split, costs as the run showed
        assert new.predicted.forward_s == pytest.approx(1.5 * old.predicted.forward_s + 20e-6)
        assert new.predicted.backward_s == pytest.approx(1.5 * old.predicted.backward_s + 20e-6)
    assert again.predicted.step_s > plan.predicted.step_s


def test_a_missing_calibration_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([_model(tmp_path), "--gpus", "2", "--device", "h100", "--out", str(tmp_path / "p"),
                 "--calibration", str(tmp_path / "nope.json")])
    assert code == 2
    error = _error_of(capsys)
    assert "calibration file" in error and "does not exist" in error and "autopartition calibrate" in error
