"""The model fuzzer (``tools/fuzz``): its generator, and a fixed seed set that must verify or be refused.

* Generator (fast, no ranks): a seed reproduces its case exactly; every generated model
  runs forward and backward in this process and reads every parameter it has; the grammar
  covers every pattern over the long tier's seeds, and :data:`DEFAULT_SEEDS` covers every
  pattern and schedule; a case written out is a model file; reduction and pattern
  stripping keep models valid; outcomes are classified (refused, crash, mismatch).
* Default tier: each of :data:`DEFAULT_SEEDS` planned under its layout and verified on CPU
  ranks over 2 steps: ``ok`` or ``refused``, never ``mismatch`` or ``crash``
  (:data:`KNOWN_FAILURES` are strict xfails naming the open bug's reproducer).
* The fuzzer can fail: a model whose gradient is scaled on the ranks only is a
  ``mismatch`` (with tensor parallelism too: the model's gradient hook moves to the
  DTensor parameter); one that fails on the ranks only is a ``crash``.
* Reproducers (slow): every ``tests/models/fuzz_*.py`` the fuzzer found, under its
  ``FUZZ_LAYOUT``, must verify or be refused; :data:`OPEN_BUGS` are strict xfails until fixed
  (none open: each is a regression test; ``tests/test_fuzz_finds.py`` pins each fix in one process).

The long tier is the command line (300 seeds, 4 to 7 minutes on 2 cores)::

    .venv/bin/python tools/fuzz_models.py --tier long --out fuzz-out
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from partitioner.errors import AutopartitionError
from partitioner.modelfile import load_model_file
from tools.fuzz.build import BATCH, build, render, write_model_file
from tools.fuzz.grammar import (
    CONV_BLOCKS,
    MAX_GPUS,
    PATTERNS,
    SCHEDULES,
    SEQ_BLOCKS,
    Case,
    Layout,
    case_from_json,
    generate,
    make_case,
    patterns,
)
from tools.fuzz.reduce import candidates, reduce_case, strip_patterns
from tools.fuzz.run import DEFAULT_SEEDS, TIERS, CaseResult, failure_kind, run_case, run_model_file

_MODELS = Path(__file__).resolve().parent / "models"

# Default-tier seeds that fail today because of an open bug (strict: a fix makes them pass; then drop them here).
KNOWN_FAILURES: dict[int, str] = {}

# Reproducers of bugs not fixed yet: file stem -> the bug (strict xfails: a fix turns them into failures to remove).
# Every reproducer of tests/models/fuzz_*.py is fixed (issue 29): each stays as a regression test below.
OPEN_BUGS: dict[str, str] = {}


# ----------------------------------------------------------------- generator


@pytest.mark.parametrize("seed", [0, 7, 123])
def test_a_seed_reproduces_its_case_exactly(seed: int) -> None:
    case = make_case(seed)
    assert case == make_case(seed)
    assert render(case.spec) == render(make_case(seed).spec)
    assert case_from_json(case.to_json()) == case  # a logged case rebuilds


def test_seeds_draw_different_models() -> None:
    sources = {render(generate(seed)) for seed in range(20)}
    assert len(sources) == 20


def _forward_backward(spec_seed: int) -> tuple[torch.Tensor, list[str]]:
    namespace = build(generate(spec_seed))
    model = namespace["build_model"]()
    torch.manual_seed(0)
    outputs = model(*namespace["example_inputs"](BATCH))
    loss = namespace["loss_fn"](outputs, namespace["example_target"](BATCH))
    loss.backward()
    unread = [n for n, p in model.named_parameters() if p.grad is None]
    return loss, unread


@pytest.mark.parametrize("chunk", range(4))
def test_every_generated_model_runs_forward_and_backward_and_reads_every_parameter(chunk: int) -> None:
    for seed in range(chunk * 15, chunk * 15 + 15):
        loss, unread = _forward_backward(seed)
        assert loss.dim() == 0 and torch.isfinite(loss), f"seed {seed}: loss {loss}"
        assert not unread, f"seed {seed}: parameters the forward never reads: {unread}"


def test_the_grammar_covers_every_pattern_block_and_schedule_over_the_long_tier() -> None:
    cases = [make_case(seed) for seed in TIERS["long"]]
    covered = set().union(*(patterns(c.spec) for c in cases))
    assert covered == set(PATTERNS), f"never generated: {sorted(set(PATTERNS) - covered)}"
    kinds = {(c.spec.family, b.kind) for c in cases for b in c.spec.blocks}
    assert {("seq", k) for k in SEQ_BLOCKS} | {("conv", k) for k in CONV_BLOCKS} <= kinds
    assert {c.layout.schedule for c in cases} == set(SCHEDULES)
    assert all(c.layout.gpus <= MAX_GPUS for c in cases)
    assert {(c.layout.dp, c.layout.tp) for c in cases} >= {(1, 1), (2, 1), (1, 2), (2, 2)}
    assert {c.layout.shard for c in cases} == {"none", "optimizer", "full"}
    assert {c.layout.recompute for c in cases} == {"none", "full", "auto"}


def test_the_default_seeds_cover_every_pattern_and_schedule() -> None:
    cases = [make_case(seed) for seed in DEFAULT_SEEDS]
    covered = set().union(*(patterns(c.spec) for c in cases))
    assert covered == set(PATTERNS), f"not in the default tier: {sorted(set(PATTERNS) - covered)}"
    assert {c.layout.schedule for c in cases} == set(SCHEDULES)
    assert {c.layout.shard for c in cases} == {"none", "optimizer", "full"}
    assert any(c.layout.tp > 1 for c in cases) and any(c.layout.dp > 1 for c in cases)
    assert set(KNOWN_FAILURES) <= set(DEFAULT_SEEDS)


def test_a_case_written_out_is_a_model_file_of_the_same_model(tmp_path: Path) -> None:
    case = make_case(5)
    path = write_model_file(case, tmp_path / "case5.py")
    text = path.read_text()
    assert "--seeds 5:6" in text and case.layout.cli_flags() in text  # the commands that replay it
    model_file = load_model_file(str(path))
    namespace = build(case.spec)
    torch.manual_seed(0)
    got = model_file.build()(*model_file.example_inputs(BATCH))
    torch.manual_seed(0)
    want = namespace["build_model"]()(*namespace["example_inputs"](BATCH))
    assert torch.equal(torch.as_tensor(got if isinstance(got, torch.Tensor) else got["logits"]),
                       torch.as_tensor(want if isinstance(want, torch.Tensor) else want["logits"]))


def test_reduction_finds_the_smallest_case_with_the_property() -> None:
    case = next(c for c in map(make_case, range(100))
                if sum(b.kind == "attention" for b in c.spec.blocks) == 1 and len(c.spec.blocks) >= 4)

    def has_attention(c: Case) -> bool:
        return any(b.kind == "attention" for b in c.spec.blocks)

    small = reduce_case(case, has_attention)
    assert [b.kind for b in small.spec.blocks] == ["attention"]
    assert small.layout.dp == 1 and small.layout.tp == 1 and small.layout.recompute == "none"
    for candidate in candidates(case):  # every step of the way is a valid model
        loss = _run_spec(candidate)
        assert torch.isfinite(loss)


def _run_spec(case: Case) -> torch.Tensor:
    namespace = build(case.spec)
    outputs = namespace["build_model"]()(*namespace["example_inputs"](BATCH))
    loss: torch.Tensor = namespace["loss_fn"](outputs, namespace["example_target"](BATCH))
    return loss


@pytest.mark.parametrize("pattern", PATTERNS)
def test_stripping_a_pattern_keeps_a_valid_model(pattern: str) -> None:
    strippable = {"inplace_input", "counter_buffer", "functional_weight", "matmul_weight", "tied_alias",
                  "reused_module", "attention", "fused_qkv", "dropout", "skip", "dict_output", "several_inputs",
                  "position_parameter", "scale_buffer"}
    for seed in range(8):
        spec = generate(seed)
        stripped = strip_patterns(spec, [pattern])
        if pattern in strippable:
            assert pattern not in patterns(stripped), f"seed {seed}: {pattern} still there"
        assert torch.isfinite(_run_spec(Case(seed, stripped, make_case(seed).layout)))
    with pytest.raises(ValueError, match="unknown patterns"):
        strip_patterns(generate(0), ["no_such_pattern"])


# ------------------------------------------------------------- classification


def _layout() -> Layout:
    return Layout(pp=2, dp=1, tp=1, schedule="gpipe", microbatches=2, shard="none", recompute="none")


def test_a_planner_error_is_refused_and_any_other_planner_exception_is_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partitioner.search import planner

    path = write_model_file(make_case(3), tmp_path / "m.py")

    def refuse(*_: Any, **__: Any) -> None:
        raise AutopartitionError("Nothing fits.\nMore.")

    monkeypatch.setattr(planner, "compile", refuse)
    result = run_model_file(path, _layout(), tmp_path)
    assert (result.outcome, result.detail, result.phase) == ("refused", "Nothing fits.", "plan")

    def internal(*_: Any, **__: Any) -> None:
        raise KeyError("node")

    monkeypatch.setattr(planner, "compile", internal)
    result = run_model_file(path, _layout(), tmp_path)
    assert result.outcome == "crash" and result.detail == "planner: KeyError: 'node'" and "KeyError" in result.error
    assert failure_kind(result) == "crash: planner: KeyError"


def test_a_run_time_failure_is_a_crash_and_a_failed_verdict_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runtime.verify

    path = write_model_file(make_case(3), tmp_path / "m.py")

    def runtime_refuses(*_: Any, **__: Any) -> None:
        raise AutopartitionError("this plan cannot run")

    monkeypatch.setattr(runtime.verify, "verify", runtime_refuses)
    result = run_model_file(path, _layout(), tmp_path)
    assert result.outcome == "crash" and result.phase == "verify" and result.chosen.startswith("2x1 gpipe")
    assert result.detail == "runtime: AutopartitionError: this plan cannot run"

    verdict = SimpleNamespace(ok=False, max_loss_diff=0.0, max_grad_diff=0.5, max_param_diff=0.0,
                              max_buffer_diff=0.0, summary=lambda: "MISMATCH: first at step 1 of 2: the loss "
                              "matches but 1 of 3 gradients differ")
    monkeypatch.setattr(runtime.verify, "verify", lambda *_, **__: verdict)
    result = run_model_file(path, _layout(), tmp_path)
    assert result.outcome == "mismatch" and result.diffs["grad"] == 0.5
    assert failure_kind(result) == "mismatch: gradients"
    assert failure_kind(CaseResult(0, "ok", "verify", "", "")) == "ok"


# ---------------------------------------------------------------- default tier


@pytest.mark.parametrize("seed", [
    pytest.param(seed, marks=pytest.mark.xfail(reason=KNOWN_FAILURES[seed], strict=True))
    if seed in KNOWN_FAILURES else seed for seed in DEFAULT_SEEDS])
def test_a_fuzzed_model_verifies_on_cpu_ranks_or_is_refused(tmp_path: Path, seed: int) -> None:
    case = make_case(seed)
    result = run_case(case, tmp_path)
    assert result.outcome in ("ok", "refused"), (
        f"seed {seed} ({case.layout.label()}, planned {result.chosen or '-'}): {result.outcome}: {result.detail}\n"
        f"replay: .venv/bin/python tools/fuzz_models.py --seeds {seed}:{seed + 1} --out fuzz-out --reduce\n"
        f"{result.error}")


# ------------------------------------------------------------ the fuzzer fails


def test_a_gradient_wrong_on_the_ranks_only_is_a_mismatch(tmp_path: Path) -> None:
    case = make_case(261)  # 2 stages, gpipe, no sharding: the sabotage's hook stays on its parameter
    assert run_case(case, tmp_path / "good").outcome == "ok"
    bad = dataclasses.replace(case, spec=dataclasses.replace(case.spec, sabotage="grad"))
    result = run_case(bad, tmp_path / "bad", from_seed=False)
    assert result.outcome == "mismatch", result.detail
    assert failure_kind(result) == "mismatch: gradients" and result.diffs["grad"] > 1e-3


@pytest.mark.slow
def test_a_gradient_hook_survives_tensor_parallelism(tmp_path: Path) -> None:
    """Tensor parallelism replaces each parameter by a DTensor one: the model's hook moves with it (it was dropped:
    the scaled gradient verified OK)."""
    case = make_case(261)
    layout = dataclasses.replace(case.layout, pp=1, tp=2, recompute="none")
    bad = dataclasses.replace(case, spec=dataclasses.replace(case.spec, sabotage="grad"), layout=layout)
    result = run_case(bad, tmp_path, from_seed=False)
    assert result.chosen.startswith("1x1x2") and result.outcome == "mismatch", result.detail
    assert failure_kind(result) == "mismatch: gradients"


def test_a_model_that_fails_on_the_ranks_only_is_a_crash(tmp_path: Path) -> None:
    case = make_case(261)
    bad = dataclasses.replace(case, spec=dataclasses.replace(case.spec, sabotage="crash"))
    result = run_case(bad, tmp_path, from_seed=False)
    assert result.outcome == "crash" and result.phase == "verify", result.detail
    assert "sabotaged" in result.detail + result.error


# ------------------------------------------------------------------ reproducers


def _reproducers() -> list[Any]:
    params = []
    for path in sorted(_MODELS.glob("fuzz_*.py")):
        marks = [pytest.mark.slow]
        if path.stem in OPEN_BUGS:
            marks.append(pytest.mark.xfail(reason=OPEN_BUGS[path.stem], strict=True))
        params.append(pytest.param(path, id=path.stem, marks=marks))
    return params


def test_every_reproducer_is_listed_or_fixed() -> None:
    stems = {p.stem for p in _MODELS.glob("fuzz_*.py")}
    assert set(OPEN_BUGS) <= stems, f"listed but missing: {sorted(set(OPEN_BUGS) - stems)}"


@pytest.mark.parametrize("path", _reproducers())
def test_a_fuzzer_reproducer_verifies_or_is_refused(tmp_path: Path, path: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"_fuzz_repro_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = run_model_file(path, Layout(**module.FUZZ_LAYOUT), tmp_path)
    assert result.outcome in ("ok", "refused"), f"{path.name} ({result.layout}): {result.outcome}: {result.detail}"
