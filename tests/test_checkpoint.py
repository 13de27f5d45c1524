"""Sharded checkpoints (runtime/state/checkpoint.py): save under one plan, resume under another.

Four spawned CPU ranks (gloo) train ``tests/models/tied_lm.py`` (tied embedding / LM
head, a persistent buffer) for two Adam steps as pp=4 x dp=1 and save; four new
ranks resume as pp=2 x dp=2.  Compared with the same two steps on the whole model
in one process (fp32, tolerance 1e-5): every parameter, Adam's ``exp_avg``,
``exp_avg_sq`` and ``step``, the next step's loss, and the parameters after it.
The resuming ranks first try the error cases (not a checkpoint, no optimizer state,
another model), all of which must raise on every rank and leave the job usable; after
one more step they save again, and two ranks of a zbv plan (two stages per rank, the
tied weight's two stages on one rank) resume from that.
The checkpoint's files and the optimizer-state flattening are also tested alone.

Atomic saves are tested in this process (a one-rank process group): each step in its
own folder, the newest ``keep`` kept, a crash at each point of a save (a
BaseException raised from the save's fault hook leaves the files as a killed process
would) leaving the previous step loadable with its exact values, and damaged files
named.  tests/test_checkpoint_crash.py kills real ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan, TiedParameter
from partitioner.search.planner import compile
from runtime.state import checkpoint as ckpt
from runtime.state import folders
from runtime.state.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    canonical_names,
    read_checkpoint_info,
)
from runtime.state.weights import read_stage_weights
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "tied_lm.py")
FOREIGN_SPEC = str(MODELS / "tied_lm_wide.py")
TOLERANCE = 1e-5

import checkpoint_workers
from checkpoint_workers import LR, STEPS_BEFORE, adam_records
from crash_workers import single_rank_group
from planning_helpers import make_plan
from rank_workers import spawn_and_wait

TIED = "wte.weight"  # canonical name of the tied embedding / LM head


def _reference() -> dict[str, Any]:
    """The uninterrupted run: STEPS_BEFORE Adam steps on the whole model, then one more (``later``: after it)."""
    out, later = adam_records(SPEC, batch=8, lr=LR, records=2)
    return {**out, "later": later}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Save as pp=4 x dp=1 (4 ranks), resume as pp=2 x dp=2 (4 new ranks); what both saw."""
    root = tmp_path_factory.mktemp("checkpoint")
    saving = make_plan(SPEC, root / "plan_a", pp=4, dp=1, microbatches=2, schedule="1f1b")
    resuming = make_plan(SPEC, root / "plan_b", pp=2, dp=2, microbatches=2, schedule="gpipe")
    foreign = make_plan(FOREIGN_SPEC, root / "plan_foreign", pp=4, dp=1, microbatches=2, schedule="gpipe")
    checkpoints = {name: str(root / name) for name in ("full", "model_only", "foreign", "resaved", "absent")}
    out = root / "out"
    out.mkdir()
    codes = spawn_and_wait(
        checkpoint_workers.save_worker, saving.gpus,
        (saving.gpus, free_port(), str(root / "plan_a"), SPEC, str(out), checkpoints,
         str(root / "plan_foreign"), FOREIGN_SPEC),
        limit_s=120,
    )
    assert codes == [0] * saving.gpus, f"saving ranks' exit codes {codes} (None: still running after 120 s)"
    codes = spawn_and_wait(
        checkpoint_workers.resume_worker, resuming.gpus,
        (resuming.gpus, free_port(), str(root / "plan_b"), SPEC, str(out), checkpoints, str(root / "plan_a")),
        limit_s=120,
    )
    assert codes == [0] * resuming.gpus, f"resuming ranks' exit codes {codes} (None: still running after 120 s)"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(resuming.gpus)]
    return {"plans": (saving, resuming, foreign), "ranks": ranks, "checkpoints": checkpoints,
            "reference": _reference(), "root": root}


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) if got.numel() else 0.0


def _check_resumed(ranks: list[dict[str, Any]], ref: dict[str, Any], plan: Plan, step: int) -> None:
    """Every rank's parameters and Adam state equal the reference's, then its next loss and parameters."""
    canon = canonical_names(plan.tied)
    held: set[str] = set()
    for rank, result in enumerate(ranks):
        assert result["step"] == step
        for key in ("parameters", "after_next"):
            for name, value in result[key].items():
                diff = _close(value, ref[key][name])
                assert diff <= TOLERANCE, f"rank {rank}: {key} {name} differs by {diff:.2e}"
        held |= set(result["parameters"])
        assert result["optimizer"], f"rank {rank} has no optimizer state"
        for name, state in result["optimizer"].items():
            want = ref["optimizer"][canon.get(name, name)]
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"} == set(want), (rank, name, sorted(state))
            for key in state:
                diff = _close(state[key], want[key])
                assert diff <= TOLERANCE, f"rank {rank}: Adam {key} of {name} differs by {diff:.2e}"
    assert held == set(ref["parameters"]), f"no rank holds {sorted(set(ref['parameters']) - held)}"
    last = plan.stages[-1].ranks
    for rank, result in enumerate(ranks):
        if rank in last:
            assert result["next_loss"] == pytest.approx(ref["next_loss"], abs=TOLERANCE)
        else:
            assert result["next_loss"] is None


@pytest.mark.slow  # spawns ranks (twice per module)
def test_resume_under_another_plan_equals_uninterrupted_training(resumed: dict[str, Any]) -> None:
    saving, resuming, _ = resumed["plans"]
    assert (saving.pp, saving.dp, resuming.pp, resuming.dp) == (4, 1, 2, 2)
    _check_resumed(resumed["ranks"], resumed["reference"], resuming, STEPS_BEFORE)
    assert all(result["lr"] == [LR] for result in resumed["ranks"])


@pytest.mark.slow  # spawns ranks (a third time)
def test_resume_on_ranks_holding_two_stages_each(resumed: dict[str, Any]) -> None:
    """zbv: rank 0 holds the first and the last stage, so the tied embedding / LM head twice."""
    root = resumed["root"]
    model_file = load_model_file(SPEC)  # planning_helpers.make_plan expects one stage per rank
    plan = compile(model_file.build(), model_file.example_inputs(8), gpus=2, pp=2, dp=1, microbatches=2,
                   schedule="zbv", device="h100")
    plan.save(root / "plan_zbv")
    assert plan.chunks == 2 and plan.stages_of(0) == (0, 3), [s.rank for s in plan.stages]
    out = root / "out"
    codes = spawn_and_wait(
        checkpoint_workers.continue_worker, plan.gpus,
        (plan.gpus, free_port(), str(root / "plan_zbv"), SPEC, str(out), resumed["checkpoints"]["resaved"]),
        limit_s=120,
    )
    assert codes == [0] * plan.gpus, f"exit codes {codes} (None: still running after 120 s)"
    ranks = [torch.load(out / f"continue_rank{r}.pt", weights_only=True) for r in range(plan.gpus)]
    assert [r["stages"] for r in ranks] == [(0, 3), (1, 2)]
    _check_resumed(ranks, resumed["reference"]["later"], plan, STEPS_BEFORE + 1)


@pytest.mark.slow  # spawns ranks (twice per module)
def test_error_cases_raise_on_every_rank_and_name_the_problem(resumed: dict[str, Any]) -> None:
    for rank, result in enumerate(resumed["ranks"]):
        errors = result["errors"]
        assert "CheckpointError" in errors["not_a_checkpoint"] and "is not a checkpoint" in errors["not_a_checkpoint"]
        assert "not a directory" in errors["absent"], errors["absent"]
        assert "holds no optimizer state" in errors["no_optimizer_state"], errors["no_optimizer_state"]
        foreign = errors["foreign"]
        assert "another model (a WideTiedLM)" in foreign and "layers.4.weight" in foreign, foreign
        assert "wte.weight (40, 16) there, (32, 16) here" in foreign, foreign
        assert result["model_only_step"] == STEPS_BEFORE  # optimizer=None: the model alone loads


@pytest.mark.slow  # spawns ranks (twice per module)
def test_checkpoint_directory_layout(resumed: dict[str, Any]) -> None:
    assert [p.name for p in Path(resumed["checkpoints"]["full"]).iterdir()] == [f"step-{STEPS_BEFORE}"]
    full = Path(resumed["checkpoints"]["full"]) / f"step-{STEPS_BEFORE}"
    assert {".metadata", "plan.json", "checkpoint.json"} <= {p.name for p in full.iterdir()}
    assert Plan.load(full).pp == 4  # the plan that wrote it
    manifest = json.loads((full / "checkpoint.json").read_text())
    assert manifest["step"] == STEPS_BEFORE and manifest["saved_by"]["pp"] == 4
    assert manifest["optimizer"]["class"] == "Adam" and len(manifest["optimizer"]["groups"]) == 1
    assert manifest["optimizer"]["groups"][0]["lr"] == LR
    info = read_checkpoint_info(full)
    model_keys = set(info.model_entries())
    assert model_keys == set(resumed["reference"]["parameters"]) - {"lm_head.weight"}  # the tied weight once
    assert {f"optim.state.{TIED}.{k}" for k in ("step", "exp_avg", "exp_avg_sq")} <= set(info.tensors)
    assert not any(k.startswith("optim.state.lm_head.") for k in info.tensors)
    # Saved by two replicas of each stage, it takes no more room than saved by one.
    resaved = Path(resumed["checkpoints"]["resaved"]) / f"step-{STEPS_BEFORE + 1}"
    assert set(read_checkpoint_info(resaved).tensors) == set(info.tensors)
    written = {p: sum(f.stat().st_size for f in p.glob("*.distcp")) for p in (full, resaved)}
    assert written[resaved] < 1.1 * written[full], written
    assert json.loads((resaved / "checkpoint.json").read_text())["saved_by"]["dp"] == 2
    # It is also weights: read back as the trained model.
    after = resumed["reference"]["after_next"]
    got = read_stage_weights(resaved, {n: (tuple(v.shape), v.dtype) for n, v in after.items()},
                             {"lm_head.weight": (TIED,)})
    for name, value in got.items():
        assert _close(value, after[name]) <= TOLERANCE, name


# -------------------------------------------------------------- no ranks


def test_directories_that_are_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        read_checkpoint_info(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        read_checkpoint_info(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="did not finish") as unfinished:
        read_checkpoint_info(tmp_path)
    assert "weights=" not in str(unfinished.value), "a half-written directory must not be advised as weights"
    assert "No complete checkpoint is in" in str(unfinished.value)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="not an autopartition checkpoint manifest"):
        read_checkpoint_info(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps(
        {"format": folders.FORMAT, "format_version": 1, "step": 1, "model": "M", "optimizer": None}))
    with pytest.raises(CheckpointError, match="incomplete"):  # .metadata is empty
        read_checkpoint_info(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps(
        {"format": folders.FORMAT, "format_version": 1, "step": -3, "model": "M", "optimizer": None}))
    with pytest.raises(CheckpointError, match=r"its step is -3, not a count of steps"):
        read_checkpoint_info(tmp_path)


def test_model_check_names_unexpected_missing_and_misshapen_entries(tmp_path: Path) -> None:
    info = CheckpointInfo(path=tmp_path, step=0, model_class="Other", optimizer=None, tensors={
        "model.a.weight": ((2, 3), torch.float32), "model.extra": ((1,), torch.float32),
        "model.emb": ((4, 2), torch.float32)})
    canon = canonical_names([TiedParameter("emb", ("emb", "head"), (0, 1))])
    here = {"a.weight": torch.zeros(2, 4), "b": torch.zeros(1), "head": torch.zeros(4, 2)}
    entries = ckpt._local_entries([_Holder(here)], keys={"a.weight", "b", "emb", "head"}, canon=canon)
    assert set(entries) == {"a.weight", "b", "emb"}  # the tied weight under its canonical name
    with pytest.raises(CheckpointError) as info_error:
        ckpt._check_model(info, entries, keys={"a.weight", "b", "emb", "head"}, canon=canon)
    message = str(info_error.value)
    assert "another model (a Other)" in message
    assert "1 entries this model lacks (extra)" in message
    assert "lacks 1 this rank's stages need (b)" in message
    assert "a.weight (2, 3) there, (2, 4) here" in message
    assert "emb" not in message.split("(b)")[1], message  # found under its other name, right shape


def test_several_stage_modules_on_one_rank_hold_a_tied_weight_once() -> None:
    """A V-shaped rank holds the first and the last stage: embedding and LM head, one weight."""
    canon = canonical_names([TiedParameter("emb", ("emb", "head"), (0, 3))])
    keys = {"emb", "head", "a", "b"}
    first, last = _Holder({"emb": torch.ones(4, 2), "a": torch.zeros(2)}), _Holder({"b": torch.zeros(2)})
    last.register_parameter("head", first.get_parameter("emb"))  # shared by the two stages: one object
    entries = ckpt._local_entries([first, last], keys=keys, canon=canon)
    assert {k: [(i, n) for i, n, _ in v] for k, v in entries.items()} == {
        "emb": [(0, "emb")], "a": [(0, "a")], "b": [(1, "b")]}
    assert sorted(ckpt._parameter_names([first, last], canon).values()) == ["a", "b", "emb"]
    copy = _Holder({"head": torch.ones(4, 2)})  # a separate copy (stages on one rank not shared): both filled
    entries = ckpt._local_entries([first, copy], keys=keys, canon=canon)
    assert [(i, n) for i, n, _ in entries["emb"]] == [(0, "emb"), (1, "head")]
    targets = {f"model.{k}": torch.full_like(v[0][2], 7.0) for k, v in entries.items()}
    ckpt._apply_model([first, copy], entries, targets)
    assert torch.equal(copy.get_parameter("head"), torch.full((4, 2), 7.0))
    assert torch.equal(first.get_parameter("a"), torch.full((2,), 7.0))


def test_optimizer_state_round_trip_by_name_with_param_groups() -> None:
    torch.manual_seed(0)
    saved_model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD([{"params": saved_model[0].parameters(), "lr": 0.1},
                           {"params": saved_model[1].parameters(), "lr": 0.2}], lr=0.5, momentum=0.9)
    saved_model(torch.randn(4, 3)).sum().backward()
    opt.step()
    names = {id(p): n for n, p in saved_model.named_parameters()}
    state, hyper = ckpt._optimizer_entries(opt, names)
    assert set(state) == {f"optim.state.{n}.momentum_buffer" for n in ("0.weight", "0.bias", "1.weight", "1.bias")}
    manifest = ckpt._manifest(_plan_stub(), 3, ("SGD", [hyper, hyper]))  # a replica's record: the same
    assert [g["lr"] for g in manifest["optimizer"]["groups"]] == [0.1, 0.2]
    info = CheckpointInfo(path=Path("."), step=3, model_class="Sequential", optimizer=manifest["optimizer"],
                          tensors={k: (tuple(v.shape), v.dtype) for k, v in state.items()})

    # The same parameters, now in the other order of groups and at other rates: loading restores them.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    fresh = torch.optim.SGD([{"params": model[1].parameters(), "lr": 9.0},
                             {"params": model[0].parameters(), "lr": 9.0}], lr=9.0, momentum=0.9)
    new_names = {id(p): n for n, p in model.named_parameters()}
    ckpt._check_optimizer(info, fresh, new_names)
    fresh.load_state_dict(ckpt._torch_optimizer_state(info, fresh, new_names, {k: v.clone() for k, v in state.items()}))
    assert [g["lr"] for g in fresh.param_groups] == [0.2, 0.1]
    for (name, p), q in zip(model.named_parameters(), saved_model.parameters(), strict=True):
        assert torch.equal(fresh.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"]), name

    mixed = torch.optim.SGD(model.parameters(), lr=9.0, momentum=0.9)  # both saved groups in one
    with pytest.raises(CheckpointError, match="different hyperparameters"):
        ckpt._check_optimizer(info, mixed, new_names)
    with pytest.raises(CheckpointError, match="holds SGD state, but the optimizer is a Adam"):
        ckpt._check_optimizer(info, torch.optim.Adam(model.parameters()), new_names)
    extra = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(CheckpointError, match="not one of this Pipeline's"):
        ckpt._check_optimizer(info, torch.optim.SGD([extra], lr=0.1), new_names)


class _Holder(torch.nn.Module):
    """A module whose state dict holds the given tensors under dotted names."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, value in tensors.items():
            owner, _, leaf = name.rpartition(".")
            module: torch.nn.Module = self
            for part in filter(None, owner.split(".")):
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(value))


def _plan_stub() -> Plan:
    from partitioner.plan import example_plan

    return example_plan()


# ------------------------------------------------- atomic saves, one rank in this process

PLAN = None  # example_plan(), made on first use


def _plan() -> Plan:
    global PLAN
    if PLAN is None:
        PLAN = _plan_stub()
    return PLAN


class _Crash(BaseException):
    """Raised from the save's fault hook: escapes every ``except Exception``, as a kill stops everything."""


@pytest.fixture
def group() -> Iterator[None]:
    with single_rank_group():
        yield


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model and an Adam optimizer with state, both depending on ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2, bias=False))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(directory: Path, seed: int, step: int, **options: Any) -> dict[str, torch.Tensor]:
    """Save the model of ``seed`` as ``step``; returns its state (what a load must give back)."""
    model, opt = _trained(seed)
    ckpt.save_checkpoint(directory, modules=[model], plan=_plan(), keys=set(model.state_dict()), optimizer=opt,
                         step=step, **options)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load(directory: Path) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt = _trained(99)
    step = ckpt.load_checkpoint(directory, modules=[model], plan=_plan(), keys=set(model.state_dict()),
                                optimizer=opt)
    return step, dict(model.state_dict())


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_each_step_is_its_own_folder_and_the_newest_are_kept(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    states = {step: _save(root, step, step) for step in (1, 2, 3)}
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3"]  # keep=2: the default
    manifest = json.loads((root / "step-3" / "checkpoint.json").read_text())
    assert manifest["format_version"] == 2 and manifest["step"] == 3
    assert set(manifest["files"]) == {".metadata", "plan.json", "__0_0.distcp"}
    for name, record in manifest["files"].items():
        assert record == {"bytes": (root / "step-3" / name).stat().st_size,
                          "crc32": ckpt.file_crc32(root / "step-3" / name)}, name
    assert Plan.load(root / "step-3").pp == 2
    step, state = _load(root)
    assert step == 3 and _equal(state, states[3])
    step, state = _load(root / "step-2")  # an explicit step
    assert step == 2 and _equal(state, states[2])
    states[3] = _save(root, 33, 3)  # the same step again replaces it
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3"]
    assert _equal(_load(root)[1], states[3])
    _save(root, 4, 4, keep=None)
    _save(root, 5, 5, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-5"]
    with pytest.raises(CheckpointError, match="keep=0"):
        _save(root, 6, 6, keep=0)
    with pytest.raises(CheckpointError, match=r"step=-1: pass the number of steps trained"):
        _save(root, 6, -1)
    assert sorted(p.name for p in root.iterdir()) == ["step-5"]  # refused before anything is written


# point in the save -> the step a load then finds (the crash is in the save of step 2)
_CRASH_POINTS = {"shards": 1, "mid-shard": 1, "plan": 1, "manifest": 1, "rename": 1, "prune": 2, "delete": 2,
                 "replace": 1}


@pytest.mark.parametrize("point", sorted(_CRASH_POINTS))
def test_a_crash_at_any_point_of_a_save_leaves_a_complete_step(
    group: None, tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    states = {1: _save(root, 1, 1, keep=1)}  # keep=1: pruning step 1 is part of the next save
    if point == "mid-shard":  # the shard is half written when the process dies
        original = dcp.FileSystemWriter.write_data

        def torn(self: Any, plan: Any, planner: Any) -> Any:
            for result in original(self, plan, planner).wait():
                shard = Path(str(self.path)) / result.storage_data.relative_path
                with shard.open("r+b") as f:
                    f.truncate(shard.stat().st_size // 2)
            raise _Crash

        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", torn)
    else:
        def hook(reached: str) -> None:
            if reached == point:
                raise _Crash

        monkeypatch.setattr(ckpt, "_fault_hook", hook)
    second = 1 if point == "replace" else 2
    with pytest.raises((_Crash, CheckpointError)):
        states[2] = _save(root, 2, second, keep=1)
    monkeypatch.undo()
    want = _CRASH_POINTS[point]  # 2: the crash came after the rename, so the new step is complete
    step, state = _load(root)
    assert step == (second if want == 2 else 1), point
    assert _equal(state, states[1] if want == 1 else _saved_state(2)), point
    states[3] = _save(root, 3, 3, keep=1)  # the next save finishes and clears what the crash left
    assert sorted(p.name for p in root.iterdir()) == ["step-3"], point
    assert _equal(_load(root)[1], states[3])


def _saved_state(seed: int) -> dict[str, torch.Tensor]:
    model, _ = _trained(seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_damaged_files_are_named_with_the_previous_step_as_the_fix(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, 1, 1)
    _save(root, 2, 2)
    shard = root / "step-2" / "__0_0.distcp"
    pristine = shard.read_bytes()

    def refused() -> str:
        with pytest.raises(CheckpointError) as error:
            _load(root)
        return str(error.value)

    shard.write_bytes(pristine[: len(pristine) // 2])
    message = refused()
    assert f"{shard} is truncated" in message and f"exists at {root / 'step-1'}" in message, message
    shard.write_bytes(pristine[:100] + bytes([pristine[100] ^ 0xFF]) + pristine[101:])
    assert f"{shard} is corrupt: its CRC-32" in refused()
    shard.unlink()
    assert f"{shard} is missing" in refused()
    shard.write_bytes(pristine)
    metadata = root / "step-2" / ".metadata"
    good = metadata.read_bytes()
    metadata.write_bytes(b"\x00" * len(good))
    assert f"{metadata} is corrupt" in refused()
    metadata.write_bytes(good)
    assert _load(root)[0] == 2
    # A version-1 manifest (no checksums): a truncated shard is still named, and DCP's own
    # failure (a BaseException, CheckpointException) becomes a CheckpointError naming the folder.
    manifest = root / "step-2" / "checkpoint.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = 1
    del data["files"]
    manifest.write_text(json.dumps(data))
    shard.write_bytes(pristine[: len(pristine) // 2])
    assert f"{shard} is truncated" in refused()
    shard.write_bytes(b"\x00" * len(pristine))
    message = refused()
    assert f"The checkpoint {root / 'step-2'} cannot be read" in message and "__0_0.distcp" in message, message


def test_unfinished_saves_are_refused_and_the_complete_step_named(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    unfinished = root / ".step-4.tmp-0123abcd"
    unfinished.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint: the save of step 4 did not finish"):
        _load(root)
    _save(root, 2, 2)
    shutil.copytree(root / "step-2", unfinished, dirs_exist_ok=True)
    (unfinished / "checkpoint.json").unlink()
    assert _load(root)[0] == 2  # the newest complete step, not the unfinished one
    with pytest.raises(CheckpointError) as error:
        _load(unfinished)
    assert "did not finish" in str(error.value) and f"exists at {root / 'step-2'}" in str(error.value)
    assert folders.find_checkpoint(root) == root / "step-2"


def test_single_folder_checkpoints_of_earlier_versions_still_load(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    state = _save(root, 7, 7)
    legacy = tmp_path / "legacy"
    shutil.copytree(root / "step-7", legacy)  # checkpoint.json directly in the directory
    data = json.loads((legacy / "checkpoint.json").read_text())
    data["format_version"] = 1
    del data["files"]
    (legacy / "checkpoint.json").write_text(json.dumps(data))
    step, got = _load(legacy)
    assert step == 7 and _equal(got, state)
    newer = _save(legacy, 8, 8)  # saving into it adds step folders beside; the newest loads
    assert (legacy / "step-8").is_dir() and (legacy / "checkpoint.json").is_file()
    step, got = _load(legacy)
    assert step == 8 and _equal(got, newer)


def test_directories_a_checkpoint_cannot_be_saved_into(group: None, tmp_path: Path) -> None:
    plan_dir = tmp_path / "plan"
    _plan().save(plan_dir)
    before = sorted(p.name for p in plan_dir.iterdir())
    with pytest.raises(CheckpointError, match="is a plan directory"):
        _save(plan_dir, 1, 1)
    assert sorted(p.name for p in plan_dir.iterdir()) == before  # nothing written, nothing replaced
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="it is a file"):
        ckpt.check_save_directory(tmp_path / "file")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        ckpt.check_save_directory(tmp_path / "file" / "ckpt")
    _save(tmp_path / "ckpt", 1, 1)
    with pytest.raises(CheckpointError, match="is one step of a checkpoint"):
        ckpt.check_save_directory(tmp_path / "ckpt" / "step-1")
    assert ckpt.check_save_directory(tmp_path / "new" / "ckpt") == tmp_path / "new" / "ckpt"
    assert not (tmp_path / "new").exists()  # checked, not created


def test_train_gpt_refuses_a_bad_save_directory_before_training(tmp_path: Path) -> None:
    """examples/train_gpt.py --save: a plan directory, or a path under a file, stops it at once (exit 2)."""
    import subprocess
    import sys

    plan_dir = tmp_path / "plan"
    _plan().save(plan_dir)
    (tmp_path / "file").write_text("")
    script = Path(__file__).parent.parent / "examples" / "train_gpt.py"
    cases = {plan_dir: "is a plan directory", tmp_path / "file" / "ckpt": "is a file, not a directory"}
    runs = {save: subprocess.Popen([sys.executable, str(script), "--plan", str(plan_dir), "--steps", "50", "--save",
                                    str(save)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "WORLD_SIZE": "1"})
            for save in cases}  # both at once: most of the time is importing torch
    for save, expected in cases.items():
        try:
            stdout, stderr = runs[save].communicate(timeout=120)
        finally:
            runs[save].kill()
        assert runs[save].returncode == 2, (runs[save].returncode, stderr[-2000:])
        assert expected in stderr and "step " not in stdout, (stdout, stderr)
        assert "Traceback" not in stderr, stderr
