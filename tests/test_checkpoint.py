"""Sharded checkpoints (runtime/checkpoint.py): save under one plan, resume under another.

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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan, TiedParameter
from partitioner.planner import compile
from runtime import checkpoint as ckpt
from runtime.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    canonical_names,
    read_checkpoint_info,
)
from runtime.verify import free_port
from runtime.weights import read_stage_weights

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "tied_lm.py")
FOREIGN_SPEC = str(MODELS / "tied_lm_wide.py")
TOLERANCE = 1e-5

import checkpoint_workers
from checkpoint_workers import LR, STEPS_BEFORE
from planning_helpers import make_plan
from rank_workers import spawn_and_wait

TIED = "wte.weight"  # canonical name of the tied embedding / LM head


def _reference() -> dict[str, Any]:
    """The uninterrupted run: STEPS_BEFORE Adam steps on the whole model, then one more."""
    model_file = load_model_file(SPEC)
    model = model_file.build()
    inputs, target = model_file.example_inputs(8), model_file.example_target(8)
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step() -> float:
        opt.zero_grad()
        loss = model_file.loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        return loss.item()

    def record() -> dict[str, Any]:
        return {"parameters": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}}

    for _ in range(STEPS_BEFORE):
        step()
    out = record()
    out["next_loss"] = step()
    out["after_next"] = record()["parameters"]
    later = record()  # STEPS_BEFORE + 1 steps: what the resumed run saved
    later["next_loss"] = step()
    later["after_next"] = record()["parameters"]
    out["later"] = later
    return out


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
    full = Path(resumed["checkpoints"]["full"])
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
    resaved = Path(resumed["checkpoints"]["resaved"])
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
    with pytest.raises(CheckpointError, match=r"weights=DIR"):
        read_checkpoint_info(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="not an autopartition checkpoint manifest"):
        read_checkpoint_info(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps(
        {"format": ckpt.FORMAT, "format_version": ckpt.FORMAT_VERSION, "step": 1, "model": "M", "optimizer": None}))
    with pytest.raises(CheckpointError, match="incomplete"):  # .metadata is empty
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
    last.register_parameter("head", first.emb)  # shared by the two stages: one object
    entries = ckpt._local_entries([first, last], keys=keys, canon=canon)
    assert {k: [(i, n) for i, n, _ in v] for k, v in entries.items()} == {
        "emb": [(0, "emb")], "a": [(0, "a")], "b": [(1, "b")]}
    assert sorted(ckpt._parameter_names([first, last], canon).values()) == ["a", "b", "emb"]
    copy = _Holder({"head": torch.ones(4, 2)})  # a separate copy (stages on one rank not shared): both filled
    entries = ckpt._local_entries([first, copy], keys=keys, canon=canon)
    assert [(i, n) for i, n, _ in entries["emb"]] == [(0, "emb"), (1, "head")]
    targets = {f"model.{k}": torch.full_like(v[0][2], 7.0) for k, v in entries.items()}
    ckpt._apply_model([first, copy], entries, targets)
    assert torch.equal(copy.head, torch.full((4, 2), 7.0)) and torch.equal(first.a, torch.full((2,), 7.0))


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
