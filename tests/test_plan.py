"""Plan files: exact JSON round trip, no code execution on load, clear errors, fingerprints."""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import pickle
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from _examples import example as _example

from partitioner import compile, load_plan
from partitioner.errors import PlanFormatError
from partitioner.graph.capture import capture
from partitioner.graph.ir import graph_fingerprint
from partitioner.plan import FORMAT_VERSION, Plan, example_plan

ROOT = Path(__file__).resolve().parent.parent




@pytest.fixture(scope="module")
def gpt() -> types.ModuleType:
    return _example("gpt")


@pytest.fixture(scope="module")
def real_plan(gpt: types.ModuleType) -> Plan:
    model = gpt.build_model(gpt.GPTConfig(n_layer=2))
    return compile(model, gpt.example_inputs(4), gpus=2, microbatches=2, device="h100", pp=2)


def _saved(plan: Plan, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    directory = plan.save(tmp_path / "plan")
    return directory, json.loads((directory / "plan.json").read_text())


def _write(directory: Path, data: Any) -> None:
    (directory / "plan.json").write_text(json.dumps(data))


# ----------------------------------------------------------------- round trip


def test_real_plan_round_trips_exactly(real_plan: Plan, tmp_path: Path) -> None:
    assert real_plan.pp == 2 and len(real_plan.stages) == 2
    assert real_plan.tied  # GPT's tied embedding travels in the plan too
    directory = real_plan.save(tmp_path / "plan")
    loaded = Plan.load(directory)
    assert loaded == real_plan
    assert load_plan(str(directory)) == real_plan
    assert Plan.load(directory / "plan.json") == real_plan  # the file itself works too
    assert Plan.from_json(real_plan.to_json()) == real_plan
    # Saving the loaded plan gives the same bytes.
    again = loaded.save(tmp_path / "again")
    assert (again / "plan.json").read_bytes() == (directory / "plan.json").read_bytes()


def test_example_plan_round_trips(tmp_path: Path) -> None:
    plan = example_plan()
    assert Plan.load(plan.save(tmp_path)) == plan


def test_plan_json_is_json_not_pickle(real_plan: Plan, tmp_path: Path) -> None:
    directory, data = _saved(real_plan, tmp_path)
    raw = (directory / "plan.json").read_bytes()
    assert raw.lstrip().startswith(b"{")
    assert b"\x80" not in raw  # no pickle protocol header anywhere
    raw.decode("utf-8")
    assert data["format_version"] == FORMAT_VERSION
    for key in ("model", "gpus", "pp", "dp", "microbatches", "schedule", "batch_size", "device",
                "stages", "predicted", "solver"):
        assert key in data, key
    assert data["model"]["fingerprint"] == real_plan.model.fingerprint
    for stage in data["stages"]:
        for key in ("index", "ranks", "nodes", "parameters", "inputs", "outputs", "predicted"):
            assert key in stage, key
    # A compiled plan also writes its block graph as data (its picture is the report's; see test_blockgraph.py).
    assert sorted(p.name for p in directory.iterdir()) == [
        "blocks.graphml", "plan.json", "stage_0.py", "stage_1.py"]
    assert (directory / "stage_1.py").read_text() == real_plan.stage_code[1]


def test_save_removes_stale_stage_files(real_plan: Plan, tmp_path: Path) -> None:
    directory = tmp_path / "plan"
    directory.mkdir()
    (directory / "stage_7.py").write_text("# from an older plan\n")
    real_plan.save(directory)
    assert not (directory / "stage_7.py").exists()


# ----------------------------------------------------------------- loading is inert


def test_loading_never_executes_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    plan = dataclasses.replace(
        example_plan(),
        stage_code=(payload, f"exec({payload!r})\n"),
        device=payload,
        schedule="gpipe",
    )
    plan = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], nodes=(payload, "eval('1+1')")), plan.stages[1]))
    directory = plan.save(tmp_path / "plan")
    # A stage file that would do damage if anything ran it.
    (directory / "stage_0.py").write_text(f"{payload}\n")

    def forbidden(name: str) -> Any:
        def refuse(*_args: Any, **_kwargs: Any) -> Any:
            raise AssertionError(f"loading a plan called {name}")
        return refuse

    evaluated: list[str] = []

    def recording(original: Any) -> Any:
        # typing.get_type_hints evaluates the dataclasses' own annotations; record the rest.
        def record(source: Any, *args: Any, **kwargs: Any) -> Any:
            evaluated.append(source if isinstance(source, str) else repr(source))
            return original(source, *args, **kwargs)
        return record

    with monkeypatch.context() as patch:
        for name in ("exec", "eval", "compile"):
            patch.setattr(builtins, name, recording(getattr(builtins, name)))
        patch.setattr(os, "system", forbidden("os.system"))
        patch.setattr(pickle, "loads", forbidden("pickle.loads"))
        patch.setattr(pickle, "load", forbidden("pickle.load"))
        loaded = Plan.load(directory)
    assert not any("__import__" in text or "eval(" in text for text in evaluated), evaluated
    assert not marker.exists()
    assert loaded.stage_code == (payload, f"exec({payload!r})\n")  # just strings
    assert loaded.device == payload
    assert loaded.stages[0].nodes == (payload, "eval('1+1')")
    assert all(isinstance(code, str) for code in loaded.stage_code)


# ----------------------------------------------------------------- errors


def test_missing_plan(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="No plan at"):
        Plan.load(tmp_path / "nowhere")
    with pytest.raises(PlanFormatError, match="No plan at"):
        Plan.load(tmp_path)  # a directory without plan.json


def test_corrupt_json(tmp_path: Path) -> None:
    directory = example_plan().save(tmp_path / "plan")
    text = (directory / "plan.json").read_text()
    (directory / "plan.json").write_text(text[: len(text) // 2])
    with pytest.raises(PlanFormatError) as info:
        Plan.load(directory)
    message = str(info.value)
    assert "not valid JSON" in message
    assert str(directory / "plan.json") in message
    assert "autopartition" in message  # says how to make it again


@pytest.mark.parametrize("data", [[], "plan", 3, {"gpus": 2}])
def test_not_a_plan(tmp_path: Path, data: Any) -> None:
    directory = tmp_path / "plan"
    directory.mkdir()
    _write(directory, data)
    with pytest.raises(PlanFormatError, match="no format_version"):
        Plan.load(directory)


@pytest.mark.parametrize("version", [0, 4, 99, "1", "2", True])
def test_unknown_format_version(tmp_path: Path, version: Any) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    data["format_version"] = version
    _write(directory, data)
    with pytest.raises(PlanFormatError) as info:
        Plan.load(directory)
    message = str(info.value)
    assert f"format version {version!r}" in message
    assert f"version {FORMAT_VERSION}" in message


def test_missing_field(tmp_path: Path) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    del data["stages"][1]["nodes"]
    _write(directory, data)
    with pytest.raises(PlanFormatError) as info:
        Plan.load(directory)
    assert "plan.stages[1]" in str(info.value)
    assert "nodes" in str(info.value)
    assert "corrupt" in str(info.value)


@pytest.mark.parametrize("field", ["precision", "optimizer", "gpus_per_node"])
def test_version_2_fields_are_required(tmp_path: Path, field: str) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    del data[field]  # only a version-1 plan may lack them (it loads with their defaults)
    _write(directory, data)
    with pytest.raises(PlanFormatError, match=field):
        Plan.load(directory)
    data["format_version"] = 1
    _write(directory, data)
    assert getattr(Plan.load(directory), field) == getattr(example_plan(), field)


def test_missing_top_level_field(tmp_path: Path) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    del data["microbatches"]
    _write(directory, data)
    with pytest.raises(PlanFormatError, match="microbatches"):
        Plan.load(directory)


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("gpus",), "2", "plan.gpus"),
        (("gpus",), 2.0, "plan.gpus"),
        (("gpus",), True, "plan.gpus"),
        (("stages", 0, "ranks"), [0, "1"], "plan.stages[0].ranks[1]"),
        (("stages", 0, "nodes"), "linear", "plan.stages[0].nodes"),
        (("model",), [], "plan.model"),
        (("predicted", "step_s"), "fast", "plan.predicted.step_s"),
        (("stages", 1, "inputs", 0, "shape"), {"a": 1}, "plan.stages[1].inputs[0].shape"),
        (("schedule",), None, "plan.schedule"),
    ],
)
def test_wrong_type(tmp_path: Path, path: tuple[Any, ...], value: Any, where: str) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    _write(directory, data)
    with pytest.raises(PlanFormatError) as info:
        Plan.load(directory)
    assert where in str(info.value)


def test_unknown_field(tmp_path: Path) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    data["stages"][0]["surprise"] = 1
    _write(directory, data)
    with pytest.raises(PlanFormatError, match="surprise"):
        Plan.load(directory)


def test_numbers_are_accepted_as_floats(tmp_path: Path) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    data["predicted"]["step_s"] = 1  # an int where a float is expected is fine
    _write(directory, data)
    assert Plan.load(directory).predicted.step_s == 1.0


# ----------------------------------------------------------------- fingerprint


def test_fingerprint_changes_with_architecture(gpt: types.ModuleType) -> None:
    inputs = gpt.example_inputs(2)
    two = capture(gpt.build_model(gpt.GPTConfig(n_layer=2)), inputs)
    three = capture(gpt.build_model(gpt.GPTConfig(n_layer=3)), inputs)
    assert graph_fingerprint(two.graph_module) != graph_fingerprint(three.graph_module)
    fp = graph_fingerprint(two.graph_module)
    assert isinstance(fp, str) and len(fp) == 16
    int(fp, 16)  # hexadecimal


def test_fingerprint_stable_across_batch_sizes(gpt: types.ModuleType) -> None:
    model = gpt.build_model(gpt.GPTConfig(n_layer=2))
    for method in ("export", "symbolic_trace"):
        prints = {graph_fingerprint(capture(model, gpt.example_inputs(b), method=method).graph_module)
                  for b in (1, 2, 5)}
        assert len(prints) == 1, method
    # And a different capture route is a different graph.
    export = graph_fingerprint(capture(model, gpt.example_inputs(2), method="export").graph_module)
    trace = graph_fingerprint(capture(model, gpt.example_inputs(2), method="symbolic_trace").graph_module)
    assert export != trace


def test_fingerprint_ignores_weights(gpt: types.ModuleType) -> None:
    inputs = gpt.example_inputs(2)
    torch.manual_seed(1)
    a = gpt.GPT(gpt.GPTConfig(n_layer=1))
    torch.manual_seed(2)
    b = gpt.GPT(gpt.GPTConfig(n_layer=1))
    assert graph_fingerprint(capture(a, inputs).graph_module) == graph_fingerprint(capture(b, inputs).graph_module)


def test_compiled_plan_fingerprint_is_batch_independent(gpt: types.ModuleType, real_plan: Plan) -> None:
    model = gpt.build_model(gpt.GPTConfig(n_layer=2))
    other = compile(model, gpt.example_inputs(8), gpus=2, microbatches=2, device="h100", pp=2)
    assert other.model.fingerprint == real_plan.model.fingerprint
    assert other.batch_size == 8 and real_plan.batch_size == 4
    assert other.model.inputs[0].shape == (4, 32) and real_plan.model.inputs[0].shape == (2, 32)


def test_version_2_plan_loads_as_one_stage_per_rank(tmp_path: Path) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    data["format_version"] = 2
    del data["chunks"]
    for stage in data["stages"]:
        del stage["rank"], stage["predicted"]["weight_s"]
    _write(directory, data)
    plan = Plan.load(directory)
    assert plan == example_plan()
    assert (plan.chunks, plan.stage_ranks(), plan.rank_layout()) == (1, (0, 1), {0: (0, 0), 1: (1, 0)})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(chunks=2), "expected pp x chunks"),
        (lambda d: d["stages"][1].update(rank=0, ranks=[0]), "rank 0 holds stages"),
        (lambda d: d["stages"][1].update(rank=2), "expected 0 .. 1"),
        (lambda d: d["stages"][1].update(ranks=[0]), "expected rank x dp"),
        (lambda d: d.update(actions=d["actions"][:1]), "one per pipeline rank"),
    ],
)
def test_inconsistent_rank_layout_is_corrupt(tmp_path: Path, change: Any, message: str) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    change(data)
    _write(directory, data)
    with pytest.raises(PlanFormatError, match=message):
        Plan.load(directory)


@pytest.mark.parametrize("jitter", [-0.1, 1e300, "nan"])
def test_a_corrupt_jitter_is_refused_on_load(jitter: float | str) -> None:
    data = json.loads(example_plan().to_json())
    data["cost_model"]["action_jitter"] = float(jitter)
    with pytest.raises(PlanFormatError, match="action_jitter"):
        Plan.from_json(json.dumps(data))


# ----------------------------------------------------------------- hand-edited sizes (issue 19 item 5)


def _first_forward(d: dict[str, Any]) -> None:
    d["actions"][0][0] = "0F7"  # a micro-batch the plan does not have


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # A batch_size edited by hand aborted a rank inside gloo: its micro-batches no longer matched the
        # boundary shapes the receiving rank allocates.
        (lambda d: d.update(batch_size=8), (r"plan.model.inputs\[0\] \(x\) holds micro-batches of 2 samples, but "
                                           r"batch_size / \(dp x microbatches\) = 8 / \(1 x 2\) = 4")),
        (lambda d: d.update(batch_size=5), "plan.batch_size is 5, not a multiple of dp x microbatches = 1 x 2"),
        (lambda d: d.update(batch_size=0), "plan.batch_size is 0, expected a whole number of at least 1"),
        (lambda d: d.update(batch_size=-4), "plan.batch_size is -4"),
        (lambda d: d.update(microbatches=0), "plan.microbatches is 0, expected a whole number of at least 1"),
        (lambda d: d.update(microbatches=-2), "plan.microbatches is -2"),
        (lambda d: d.update(microbatches=1, batch_size=2), "0F1, for micro-batch 1, but plan.microbatches is 1"),
        (lambda d: d.update(microbatches=4, batch_size=8), ("stage 0 runs the forward of 2 micro-batches, but "
                                                           "plan.microbatches is 4")),
        (_first_forward, "0F7, for micro-batch 7, but plan.microbatches is 2"),
        (lambda d: d["actions"][0].__setitem__(0, "1F0"), "stage 1 is not on pipeline rank 0"),
        (lambda d: d["actions"][0].__setitem__(0, "9F0"), "stage 9 is not on pipeline rank 0"),
        (lambda d: d["actions"][0].__setitem__(0, "zero"), "Cannot parse schedule action 'zero'"),
        (lambda d: d.update(gpus=4), r"plan.gpus is 4, expected pp x dp = 2 x 1 = 2"),
        (lambda d: d.update(gpus_per_node=3), "plan.gpus_per_node is 3, which does not divide plan.gpus"),
        (lambda d: d.update(schedule="gpipe2"), "plan.schedule is 'gpipe2', expected one of"),
        (lambda d: d["model"]["inputs"][0].update(dtype="float33"), "unknown dtype 'float33'"),
        (lambda d: d["model"]["inputs"][0].update(shape=[2, -4]), "sizes cannot be negative"),
        (lambda d: d["stages"][0]["outputs"][0].update(shape=[2, 8]), r"boundary relu into stage 1 is \[2, 8\]"),
        (lambda d: d["stages"][0]["outputs"][0].update(target=5), "relu.* goes 0 -> 5"),
        (lambda d: d["stages"][1]["inputs"].clear(), "boundary relu into stage 1 .* but missing where received"),
        (lambda d: d["stages"][1].update(index=0), r"plan.stages\[1\].index is 0, expected 1"),
    ],
)
def test_hand_edited_sizes_are_refused_on_load(tmp_path: Path, change: Any, message: str) -> None:
    directory, data = _saved(example_plan(), tmp_path)
    Plan.load(directory)  # as saved: fine
    change(data)
    _write(directory, data)
    with pytest.raises(PlanFormatError, match=message) as caught:
        Plan.load(directory)
    assert "autopartition model.py" in str(caught.value)  # and what to do: plan again


def test_an_edited_batch_size_of_a_real_plan_is_refused(real_plan: Plan, tmp_path: Path) -> None:
    directory, data = _saved(real_plan, tmp_path)
    data["batch_size"] *= 2  # 8 of 2 x 4 micro-batches of 2 would be, by the recorded shapes, 4 x 2
    _write(directory, data)
    with pytest.raises(PlanFormatError, match="batch_size, dp or microbatches was edited after planning") as caught:
        Plan.load(directory)
    assert "--batch-size" in str(caught.value)
    # A batch that still splits into the recorded micro-batches (more of them) is an edited micro-batch count.
    data["microbatches"] *= 2
    _write(directory, data)
    with pytest.raises(PlanFormatError, match="forward of 2 micro-batches, but plan.microbatches is 4"):
        Plan.load(directory)
