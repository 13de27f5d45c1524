"""``autopartition verify`` can be trusted: the reference runs the way the pipeline runs.

Fast tests (one process): random ops are found in both capture routes and
neutralised the same way in eager and captured runs; the reference slices the
batch exactly as ``Pipeline.step``; the float64 plan; each step is compared from the
pipeline's parameters (drift cannot accumulate); the verdict's wording.

Slow tests (really spawned CPU ranks, 2 each): a BatchNorm U-Net, a dropout MLP, a
GroupNorm/max-pool CNN over 4 steps and a float64 run with replicas all verify OK
(each failed on the full-batch, drifting, randomness-blind verify this replaced);
a deliberately wrong model still gives MISMATCH, naming the step and parameter.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.graph.capture import capture
from partitioner.modelfile import load_model_file
from partitioner.plan import Boundary, Plan, TensorSpec, example_plan
from runtime.pipeline import Pipeline
from runtime.verify import (
    Derandomised,
    ModelTraits,
    RandomOp,
    VerifyResult,
    _compare_steps,
    _rank_failure,
    model_traits,
    plan_in_dtype,
    reference_microbatches,
    verify,
)

MODELS = Path(__file__).parent / "models"
BN_UNET = str(MODELS / "bn_unet.py")
DROPOUT_MLP = str(MODELS / "dropout_mlp.py")
MAXPOOL_NET = str(MODELS / "maxpool_net.py")
MLP = str(MODELS / "mlp.py")
EMA = str(MODELS / "fuzz_buffer_update.py")
UNUSED = str(MODELS / "fuzz_unused_parameter.py")


def _model(spec: str) -> tuple[Any, nn.Module]:
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    return model_file, model_file.build()


# ------------------------------------------------------------ random ops


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_random_ops_are_found_in_either_capture_route(method: str) -> None:
    model_file, model = _model(DROPOUT_MLP)
    captured = capture(model, model_file.example_inputs(4), method=method)  # type: ignore[arg-type]
    traits = model_traits(model, captured.graph_module)
    dropout = [(r.op.lower(), r.p) for r in traits.random_ops if r.dropout]
    assert [p for _, p in dropout] == [0.1, 0.2, 0.3] and all(op == "dropout" for op, _ in dropout)
    assert [r.op for r in traits.random_ops if not r.dropout] == ["randn_like"]
    assert not traits.batch_stats
    text = traits.random_text()
    assert "3 dropout ops neutralised (p=0) in both runs" in text and "p=0.2" in text
    assert "1 other random op given the same draws in both runs" in text and "randn_like" in text


def test_batch_statistics_are_found() -> None:
    model_file, model = _model(BN_UNET)
    captured = capture(model, model_file.example_inputs(4), method="symbolic_trace")
    traits = model_traits(model, captured.graph_module)
    assert traits.random_ops == ()
    assert traits.batch_stats[0] == "BatchNorm2d down.1 (running statistics)" and len(traits.batch_stats) == 3
    assert traits.has_running_stats


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_captured_graph_and_eager_model_draw_the_same(method: str) -> None:
    """Under Derandomised, the eager model and its captured graph compute the same, whatever the seed."""
    model_file, model = _model(DROPOUT_MLP)
    x = model_file.example_inputs(4)
    graph = capture(model, x, method=method).graph_module  # type: ignore[arg-type]
    runs = []
    for seed, run in ((1, model), (2, graph)):
        torch.manual_seed(seed)  # the global stream must not matter
        with Derandomised() as changed:
            out = run(*x)
        runs.append(out[0] if isinstance(out, tuple) else out)
        assert sum(changed.dropout.values()) == 3 and sum(changed.draws.values()) == 1, changed.counts
    assert torch.equal(runs[0], runs[1])


def test_dropout_is_off_however_it_is_called() -> None:
    x = torch.randn(64)
    calls = [
        lambda: nn.Dropout(0.5)(x),
        lambda: nn.functional.dropout(x, 0.5),
        lambda: nn.functional.dropout(x, p=0.5, training=True),
        lambda: torch.dropout(x, 0.5, True),
        lambda: torch.ops.aten.dropout.default(x, 0.5, True),
        lambda: torch.ops.aten.native_dropout.default(x, 0.5, True)[0],
    ]
    with Derandomised() as changed:
        for call in calls:
            assert torch.equal(call(), x)
    assert sum(changed.dropout.values()) == len(calls) and not changed.draws


def test_dropout_inside_a_leaf_module_is_neutralised() -> None:
    """Dropout that the function mode cannot see (inside attention) still draws from the fixed seed."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=True)
    x = torch.randn(2, 3, 8)
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with Derandomised():
            outs.append(layer(x))
    assert torch.equal(outs[0], outs[1])
    wrapped = nn.Sequential(layer)  # the layer is then a leaf module of the traced graph
    graph = capture(wrapped, (x,), method="symbolic_trace").graph_module
    listed = [str(r) for r in model_traits(wrapped, graph).random_ops]
    assert any("self_attn" in s for s in listed) and any("dropout1" in s for s in listed), listed


def test_a_generator_argument_is_reseeded_too() -> None:
    g = torch.Generator().manual_seed(5)
    with Derandomised():
        a = torch.rand(4, generator=g)
        b = torch.rand(4)
    assert torch.equal(a, b)


# ----------------------------------------------------- the reference's batches


def _plan(**changes: Any) -> Plan:
    return dataclasses.replace(example_plan(), **changes)


@pytest.mark.parametrize(("dp", "microbatches"), [(1, 2), (2, 2), (2, 1), (4, 2)])
def test_reference_slices_the_batch_as_the_pipeline(dp: int, microbatches: int) -> None:
    plan = _plan(dp=dp, microbatches=microbatches, batch_size=8 * dp * microbatches // 2, gpus=2 * dp)
    inputs = (torch.arange(plan.batch_size * 4.0).reshape(plan.batch_size, 4),)
    target = {"labels": torch.arange(plan.batch_size), "scale": 2.0}
    for replica in range(dp):
        runtime_view = SimpleNamespace(plan=plan, replica=replica, device=torch.device("cpu"), _batch="global")
        want = Pipeline._split(runtime_view, inputs, target)  # type: ignore[arg-type]
        got = reference_microbatches(plan, inputs, target, replica)
        assert len(got) == len(want) == microbatches
        for (gx, gy), (wx, wy) in zip(got, want):
            assert torch.equal(gx[0], wx[0]) and torch.equal(gy["labels"], wy["labels"]) and gy["scale"] == 2.0


def test_plan_in_float64() -> None:
    plan = example_plan()
    ids = Boundary("ids", (2,), "int64", 0, 1)
    ints = dataclasses.replace(plan.stages[1], inputs=(*plan.stages[1].inputs, ids))
    plan = dataclasses.replace(plan, stages=(plan.stages[0], ints))
    doubled = plan_in_dtype(plan, torch.float64)
    assert doubled.model.inputs == (TensorSpec("x", (2, 4), "float64"),)
    assert [b.dtype for b in doubled.stages[1].inputs] == ["float64", "int64"]
    assert [b.dtype for b in doubled.stages[0].outputs] == ["float64"]
    assert plan_in_dtype(doubled, torch.float64) is doubled
    assert plan_in_dtype(plan, torch.float32) is plan


# ---------------------------------------------- per-step comparison (in process)


def _pipeline_records(
    spec: str, plan: Plan, *, steps: int, lr: float, tamper: Callable[[int, nn.Module], None]
) -> list[dict[str, Any]]:
    """What one rank holding the whole model (pp=1, dp=1) records, with ``tamper(step, model)`` applied."""
    model_file, model = _model(spec)
    inputs, target = model_file.example_inputs(plan.batch_size), model_file.example_target(plan.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    record: dict[str, Any] = {"stage": 0, "stages": (0,), "replica": 0,
                              "losses": [], "grads": [], "params": [], "buffers": []}

    def snapshot() -> None:
        record["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        record["buffers"].append({n: b.detach().clone() for n, b in model.named_buffers()})

    for step in range(steps):
        tamper(step, model)
        snapshot()
        opt.zero_grad()
        total = torch.zeros(())
        for x, y in reference_microbatches(plan, inputs, target, 0):
            loss = model_file.loss_fn(model(*x), y) / plan.microbatches
            loss.backward()
            total += loss.detach()
        record["losses"].append(float(total))
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    snapshot()
    return [record]


def _compare(spec: str, tamper: Callable[[int, nn.Module], None], steps: int = 3) -> VerifyResult:
    plan = _plan(pp=1, dp=1, gpus=1, microbatches=2, batch_size=8)
    ranks = _pipeline_records(spec, plan, steps=steps, lr=0.1, tamper=tamper)
    model_file = load_model_file(spec)
    return _compare_steps(plan, model_file, ranks, steps=steps, lr=0.1, tolerance=1e-5, dtype="float32",
                          traits=ModelTraits())


def test_each_step_starts_from_the_pipelines_parameters() -> None:
    """Drift between the runs (here 1e-3 on every weight from step 2) is not compared: each step is."""

    def drift(step: int, model: nn.Module) -> None:
        if step == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)

    result = _compare(MAXPOOL_NET, drift, steps=3)
    assert [s.step for s in result.per_step] == [1, 2, 3]
    # Every step's loss and gradients match: the reference took the drifted parameters.
    assert all(s.loss_diff < 1e-6 and s.grad.value < 1e-6 and s.grad.total == 14 for s in result.per_step)
    # The drift shows once, where it entered: step 1's update is not what the pipeline went on with.
    assert [s.param.value > 1e-4 for s in result.per_step] == [True, False, False], result.report()
    assert "first at step 1 of 3: gradients match but parameter blocks" in result.summary()


def test_a_wrong_gradient_is_named_with_its_step() -> None:
    def wrong(step: int, model: nn.Module) -> None:
        if step == 1:  # the pipeline's bias gradient is scaled at step 2, through a hook
            model.get_parameter("head.bias").register_hook(lambda g: g * 1.5)

    result = _compare(MLP, wrong, steps=3)
    assert not result.ok
    text = result.summary()
    assert text.startswith("MISMATCH: first at step 2 of 3: the loss matches but 1 of 18 gradients differ"), text
    assert "head.bias on rank 0 (stage 0, replica 0)" in text and "no random ops" in text
    lines = result.report().splitlines()
    assert lines[0].startswith("step 1: OK") and lines[1].startswith("step 2: MISMATCH"), lines


def test_ranks_starting_elsewhere_are_reported() -> None:
    def moved(step: int, model: nn.Module) -> None:
        if step == 0:
            with torch.no_grad():
                model.get_parameter("head.weight").add_(0.1)

    result = _compare(MLP, moved, steps=1)
    assert not result.ok
    assert "the ranks start from other parameters or buffers than the model file builds" in result.summary()
    assert "head.weight on rank 0" in result.summary()


def _records(spec: str, plan: Plan, steps: int = 2) -> list[dict[str, Any]]:
    return _pipeline_records(spec, plan, steps=steps, lr=0.1, tamper=lambda step, model: None)


def _verdict(spec: str, plan: Plan, ranks: list[dict[str, Any]], steps: int = 2) -> VerifyResult:
    return _compare_steps(plan, load_model_file(spec), ranks, steps=steps, lr=0.1, tolerance=1e-5, dtype="float32",
                          traits=ModelTraits())


def test_a_gradient_missing_on_its_rank_is_a_gradient_difference() -> None:
    """A rank that lost a gradient (the optimizer then skips it) was read as a match (fuzz_split_backward_inplace)."""
    plan = _plan(pp=1, dp=1, gpus=1, microbatches=2, batch_size=8)
    ranks = _records(MLP, plan)
    for grads in ranks[0]["grads"]:
        del grads["head.bias"]
    text = _verdict(MLP, plan, ranks).summary()
    assert text.startswith("MISMATCH: first at step 1 of 2: the loss matches but 1 of 18 gradients differ, the most "
                           "head.bias on rank 0"), text


def test_a_parameter_the_forward_never_reads_is_no_mismatch() -> None:
    """No rank holds it and the reference never changes it (fuzz_unused_parameter): OK, and said."""
    plan = _plan(pp=1, dp=1, gpus=1, microbatches=2, batch_size=8)
    ranks = _records(UNUSED, plan)
    for params in ranks[0]["params"]:
        del params["fc.bias"]
    result = _verdict(UNUSED, plan, ranks)
    assert result.ok, result.summary()
    assert "1 parameter the forward never reads (fc.bias): no gradient, held by no rank" in result.summary()
    for params in ranks[0]["params"]:  # one it reads, held by no rank: still a mismatch
        del params["head.bias"]
    assert "head.bias (held by no rank)" in _verdict(UNUSED, plan, ranks).summary()


def test_a_buffer_the_model_writes_and_no_rank_holds_is_a_mismatch() -> None:
    """A counter the stages lost (symbolic tracing dropped ``self.calls.add_(1)``) was never compared."""
    plan = _plan(pp=1, dp=1, gpus=1, microbatches=2, batch_size=8)
    ranks = _records(EMA, plan)
    for buffers in ranks[0]["buffers"]:
        del buffers["calls"]
    result = _verdict(EMA, plan, ranks)
    assert not result.ok
    assert "buffer calls (written, held by no rank) differs by inf" in result.summary(), result.summary()


def test_mismatch_says_whether_the_model_has_random_ops_or_batch_statistics() -> None:
    traits = ModelTraits(random_ops=(RandomOp("drop", "Dropout", 0.1, dropout=True),),
                         batch_stats=("BatchNorm2d bn (running statistics)",))
    facts = traits.facts()
    assert "random ops (drop (Dropout, p=0.1)), neutralised in both runs" in facts
    assert "batch statistics (BatchNorm2d bn (running statistics)), per micro-batch in both runs" in facts
    assert ModelTraits().facts() == "The model has no random ops, and no batch statistics"


def test_a_user_error_in_a_rank_is_one_paragraph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from partitioner.errors import PlanMismatchError
    from runtime.launch import failure

    monkeypatch.setattr(failure, "_this_rank_stages", None)  # as in a rank that built no Pipeline yet
    try:
        raise PlanMismatchError("The plan was made for a TinyMLP, but the model is a Net.")
    except PlanMismatchError as exc:
        failure.record_failure(exc, rank=1, directory=tmp_path)
    exited = torch.multiprocessing.ProcessExitedException("process 1 terminated with exit code 2", 1, 1, 2)
    error = _rank_failure(tmp_path, example_plan(), exited)
    assert isinstance(error, failure.RankInputError) and error.exit_code == 2  # an AutopartitionError: exit 2
    assert str(error).splitlines()[0] == (
        "rank 1 (stage 1, replica 0): PlanMismatchError: The plan was made for a TinyMLP, but the model is a Net.")


def test_a_rank_that_died_without_a_record_is_named(tmp_path: Path) -> None:
    from runtime.launch import failure

    killed = torch.multiprocessing.ProcessExitedException("process 0 terminated with signal SIGKILL", 0, 7, -9,
                                                          "SIGKILL")
    error = _rank_failure(tmp_path, example_plan(), killed)
    assert type(error) is failure.RankFailure and error.exit_code == 1
    assert str(error).startswith("rank 0 ended with signal SIGKILL without raising an error")


@pytest.mark.slow  # spawns two ranks
@pytest.mark.parametrize(("fault", "code", "first"), [
    # The model file's loss_fn raising is the model file's error (ModelFileError, bad input), at its line.
    ("raise", 2, ("autopartition: error: rank 1 (stage 1, action 1F1): ModelFileError: dying.py:loss_fn(...) "
                  "raised TypeError: the loss got a str where a tensor belongs")),
    ("exit", 1, "autopartition: error: rank 1 ended with exit code 17 without raising an error"),
])
def test_a_failing_rank_is_named_with_its_cause_not_a_graph_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fault: str, code: int,
    first: str,
) -> None:
    from planning_helpers import make_plan  # type: ignore[import-not-found]  # tests/models, on sys.path

    from partitioner.cli import main

    spec = str(MODELS / "dying.py")
    make_plan(spec, tmp_path, pp=2, microbatches=4, schedule="1f1b")
    monkeypatch.setenv("AUTOPARTITION_TEST_DIE_RANK", "1")  # the spawned ranks inherit it
    monkeypatch.setenv("AUTOPARTITION_TEST_FAULT", fault)
    assert main(["verify", str(tmp_path), "--model", spec, "--steps", "2"]) == code
    err = capsys.readouterr().err
    lines = err[err.index("autopartition: error:"):].splitlines()
    assert lines[0].startswith(first), err
    assert "Traceback" not in err and "A rank failed" not in err
    if fault == "raise":
        assert lines[1] == "  at tests/models/dying.py:52: raise TypeError(TYPE_ERROR)", err
        log = Path(lines[-1].rsplit(": ", 1)[1])
        assert "Traceback" in log.read_text()


# ------------------------------------------------------------------ spawned ranks


def _verify(tmp_path: Path, spec: str, *, steps: int = 3, dtype: str = "float32", **shape: Any) -> VerifyResult:
    from planning_helpers import make_plan  # type: ignore[import-not-found]  # tests/models, on sys.path

    make_plan(spec, tmp_path, **{"pp": 2, "microbatches": 2, "schedule": "1f1b", **shape})
    result = verify(tmp_path, spec, steps=steps, dtype=dtype)
    print(result.report())  # the closing note quotes these
    return result


@pytest.mark.slow
def test_batchnorm_unet_matches(tmp_path: Path) -> None:
    result = _verify(tmp_path, BN_UNET)
    assert result.ok, result.report()
    assert all(s.buffer.total == 9 for s in result.per_step), "running statistics are compared"
    assert result.max_grad_diff < 1e-6
    text = result.summary()
    assert "reference micro-batched as the pipeline (1 replica x 2 micro-batches of 4; BatchNorm2d" in text, text


@pytest.mark.slow
def test_dropout_mlp_matches_with_its_random_ops_listed(tmp_path: Path) -> None:
    result = _verify(tmp_path, DROPOUT_MLP)
    assert result.ok, result.report()
    text = result.summary()
    assert "3 dropout ops neutralised (p=0) in both runs" in text and "randn_like" in text, text
    assert "24 random calls changed in each run" in text, text  # 3 steps x 2 micro-batches x 4 ops


@pytest.mark.slow
def test_maxpool_groupnorm_over_four_steps(tmp_path: Path) -> None:
    result = _verify(tmp_path, MAXPOOL_NET, steps=4, capture_method="export")
    assert result.ok, result.report()
    lines = result.report().splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"step {i}" for i in range(1, 5)]
    assert all(" OK " in line for line in lines[:4]) and lines[4].startswith("OK: ")


@pytest.mark.slow
def test_float64_with_replicas_and_batchnorm(tmp_path: Path) -> None:
    """pp=1 x dp=2: each replica's running statistics follow its own micro-batches."""
    result = _verify(tmp_path, BN_UNET, dtype="float64", pp=1, dp=2)
    assert result.ok and result.tolerance == 1e-10 and result.dtype == "float64", result.report()
    assert "running statistics per replica" in result.summary()


@pytest.mark.slow
def test_a_wrong_model_is_still_a_mismatch(tmp_path: Path) -> None:
    result = _verify(tmp_path, str(MODELS / "rank_dependent.py"))
    assert not result.ok
    text = result.summary()
    assert text.startswith("MISMATCH: first at step 1 of 3: the loss differs by 1.0e-02"), text
    assert " on rank 1 (stage 1, replica 0)" in text and "look at the forward" in text, text
    assert all(line.split()[2] == "MISMATCH" for line in result.report().splitlines()[:3])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "schedule", "chunks"),
    [("tied_lm.py", "zbv", 2), ("meta_gpt.py", "interleaved-1f1b", 2)],
)
def test_chunked_schedules_verify(tmp_path: Path, model: str, schedule: str, chunks: int) -> None:
    """verify runs a plan whose ranks hold several stages (a meta-built model too) and names them."""
    from chunked import plan_schedule  # type: ignore[import-not-found]  # tests/models, on sys.path

    spec = str(MODELS / model)
    plan = plan_schedule(spec, tmp_path, ranks=2, chunks=chunks, microbatches=4, schedule=schedule)
    result = verify(tmp_path, spec, steps=3)
    assert result.ok, result.report()
    assert result.max_grad_diff < 1e-5
    assert any("stages " in place for place in result.rank_places), result.rank_places
    assert plan.chunks == 2 and len(plan.stages) == 4


def test_ranks_are_new_processes_with_the_environment_of_each_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_ranks forks ranks from a server started once: each must still see the caller's environment now."""
    import rank_workers

    from runtime.verify import start_ranks

    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv("AUTOPARTITION_TEST_VALUE", value)
        out = tmp_path / value
        out.mkdir()
        start_ranks(rank_workers.environment_worker, ("AUTOPARTITION_TEST_VALUE", str(out)), 2)
        seen.append([(out / f"rank{r}.txt").read_text().split() for r in range(2)])
    assert [[v for v, _ in call] for call in seen] == [["first", "first"], ["second", "second"]], seen
    pids = [int(p) for call in seen for _, p in call]
    assert len(set(pids)) == 4 and os.getpid() not in pids, pids  # a fresh process per rank and call
