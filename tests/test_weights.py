"""Weights from disk per stage (runtime/state/weights.py): safetensors (one file, sharded) and DCP.

The reader is tested on its own first (no ranks): every form of path, a tied
weight stored once under one of its names (as Hugging Face saves GPT-2), dtype
casts, a rank's reads limited to its own tensors, the errors, and filling a
model built on meta.  Then two spawned CPU ranks (gloo) build a two-stage
Pipeline with ``weights=`` from each source (and into a model built on meta):
each rank's state equals the whole model loaded from the same state dict.

Damaged files are errors naming the file: a truncated or garbage safetensors file, a
Pipeline checkpoint's shard that its manifest's size or CRC-32 does not match.  A
directory of Pipeline checkpoints gives its newest complete step; an unfinished save
(a ``.step-N.tmp-*`` folder, or ``plan.json`` and shards without ``checkpoint.json``)
is refused rather than read as a mix of two steps.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from partitioner.modelfile import load_model_file
from partitioner.plan import TiedParameter
from runtime.state.weights import (
    WEIGHTS_ENV,
    CheckpointError,
    alias_map,
    load_weights,
    read_stage_weights,
    weights_from_env,
    weights_supply,
)
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "tied_lm.py")
TIED = (TiedParameter("wte.weight", ("lm_head.weight", "wte.weight"), (0, 1)),)
ALIASES = alias_map(TIED)

import checkpoint_workers
from crash_workers import single_rank_group
from planning_helpers import make_plan
from rank_workers import spawn_and_wait


def _state() -> dict[str, torch.Tensor]:
    """tied_lm's state dict, moved away from build()'s values (so loading shows)."""
    model = load_model_file(SPEC).build()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        for b in model.buffers():
            b.mul_(1.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hf_style(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As Hugging Face saves a tied model: the LM head's weight only as the embedding's."""
    return {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}


def _specs(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, Any]:
    return {n: (tuple(state[n].shape), state[n].dtype) for n in names}


def _write_sharded(directory: Path, state: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """Two shards and their index: the embedding and first layers in one, the rest in the other."""
    directory.mkdir(parents=True, exist_ok=True)
    first = {k: v for k, v in state.items() if k.startswith(("wte.", "layers.0.", "layers.1."))}
    rest = {k: v for k, v in state.items() if k not in first}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name, part in zip(names, (first, rest), strict=True):
        save_file(part, str(directory / name))
    weight_map = {k: names[0] if k in first else names[1] for k in state}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory / names[0], directory / names[1]


def _write_dcp(directory: Path, state: dict[str, torch.Tensor]) -> None:
    with warnings.catch_warnings():  # DCP warns that it saves from one process: intended here
        warnings.simplefilter("ignore")
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)


# ------------------------------------------------------------------- reader


def test_single_file_and_its_directory_give_the_stored_tensors(tmp_path: Path) -> None:
    state = _state()
    save_file(_hf_style(state), str(tmp_path / "model.safetensors"))
    names = ["layers.2.weight", "ln_f.bias", "scale"]
    for path in (tmp_path / "model.safetensors", tmp_path):
        got = read_stage_weights(path, _specs(state, names))
        assert set(got) == set(names)
        for n in names:
            assert torch.equal(got[n], state[n]), f"{n} read from {path}"


def test_tied_weight_stored_once_is_found_under_either_name(tmp_path: Path) -> None:
    state = _state()
    save_file(_hf_style(state), str(tmp_path / "model.safetensors"))
    got = read_stage_weights(tmp_path, _specs(state, ["lm_head.weight", "wte.weight"]), ALIASES)
    assert torch.equal(got["lm_head.weight"], state["wte.weight"])
    assert torch.equal(got["wte.weight"], state["wte.weight"])
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):  # without the tie it is missing
        read_stage_weights(tmp_path, _specs(state, ["lm_head.weight"]))


def test_sharded_checkpoint_reads_only_the_shards_and_tensors_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors

    state = _state()
    first, second = _write_sharded(tmp_path / "sharded", _hf_style(state))
    opened: list[str] = []
    read: list[str] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, path: str, **options: Any) -> None:
            opened.append(Path(path).name)
            self._handle = real_open(path, **options)

        def __enter__(self) -> Any:
            self._file = self._handle.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._handle.__exit__(*exc)

        def get_slice(self, name: str) -> Any:
            return self._file.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self._file.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    stage = ["layers.3.weight", "layers.3.bias", "ln_f.weight", "lm_head.weight"]  # a last stage
    for path in (tmp_path / "sharded", tmp_path / "sharded" / "model.safetensors.index.json"):
        opened.clear()
        read.clear()
        got = read_stage_weights(path, _specs(state, stage), ALIASES)
        assert torch.equal(got["lm_head.weight"], state["wte.weight"])  # from the first shard
        assert torch.equal(got["layers.3.weight"], state["layers.3.weight"])
        assert sorted(read) == sorted(["layers.3.weight", "layers.3.bias", "ln_f.weight", "wte.weight"])
        assert set(opened) == {first.name, second.name}
    # A stage whose tensors all lie in the second shard never opens the first.
    opened.clear()
    read_stage_weights(tmp_path / "sharded", _specs(state, ["layers.3.weight", "ln_f.bias"]))
    assert set(opened) == {second.name}


def test_dcp_directory_plain_and_pipeline_checkpoint_layouts(tmp_path: Path) -> None:
    state = _state()
    _write_dcp(tmp_path / "plain", _hf_style(state))
    _write_dcp(tmp_path / "prefixed", {f"model.{k}": v for k, v in _hf_style(state).items()})
    names = ["layers.1.weight", "lm_head.weight", "scale"]
    for layout in ("plain", "prefixed"):
        got = read_stage_weights(tmp_path / layout, _specs(state, names), ALIASES)
        assert torch.equal(got["layers.1.weight"], state["layers.1.weight"]), layout
        assert torch.equal(got["lm_head.weight"], state["wte.weight"]), layout
        assert torch.equal(got["scale"], state["scale"]), layout


def test_other_dtype_in_the_file_is_cast_to_the_models(tmp_path: Path) -> None:
    state = _state()
    save_file({k: v.to(torch.bfloat16) for k, v in _hf_style(state).items()}, str(tmp_path / "model.safetensors"))
    got = read_stage_weights(tmp_path, _specs(state, ["layers.0.weight"]))
    assert got["layers.0.weight"].dtype == torch.float32
    assert torch.equal(got["layers.0.weight"], state["layers.0.weight"].to(torch.bfloat16).float())
    kept = read_stage_weights(tmp_path, {"layers.0.weight": ((16, 16), None)})  # None keeps the stored dtype
    assert kept["layers.0.weight"].dtype == torch.bfloat16


def test_missing_and_misshapen_tensors_are_named_with_the_file(tmp_path: Path) -> None:
    state = _state()
    file = tmp_path / "model.safetensors"
    save_file({k: v for k, v in _hf_style(state).items() if k != "layers.2.bias"}, str(file))
    with pytest.raises(CheckpointError) as missing:
        read_stage_weights(file, _specs(state, ["layers.1.bias", "layers.2.bias"]))
    message = str(missing.value)
    assert "layers.2.bias" in message and str(file) in message and "lacks 1 tensors" in message, message
    wrong = {"layers.1.weight": ((16, 8), torch.float32)}
    with pytest.raises(CheckpointError) as misshapen:
        read_stage_weights(file, wrong)
    message = str(misshapen.value)
    assert "layers.1.weight is (16, 16)" in message and "(16, 8)" in message and str(file) in message, message
    _write_dcp(tmp_path / "dcp", {"model.other": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors.*layers\.1\.weight"):
        read_stage_weights(tmp_path / "dcp", wrong)


def test_paths_that_hold_no_weights_are_clear_errors(tmp_path: Path) -> None:
    spec = {"a": ((1,), torch.float32)}
    with pytest.raises(CheckpointError, match="does not exist"):
        read_stage_weights(tmp_path / "nowhere", spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no weights"):
        read_stage_weights(tmp_path / "empty", spec)
    torch.save({"a": torch.zeros(1)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="neither a .safetensors file"):
        read_stage_weights(tmp_path / "model.pt", spec)
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        read_stage_weights(tmp_path / "sharded", spec)


def test_truncated_or_garbage_safetensors_files_are_named(tmp_path: Path) -> None:
    state = _state()
    file = tmp_path / "model.safetensors"
    save_file(_hf_style(state), str(file))
    whole = file.read_bytes()
    spec = _specs(state, ["layers.0.weight"])
    for label, data in (("truncated", whole[: len(whole) // 2]), ("garbage", b"not safetensors at all" * 4)):
        bad = tmp_path / f"{label}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(CheckpointError) as error:
            read_stage_weights(bad, spec)
        message = str(error.value)
        assert f"{bad} is not a readable safetensors file ({len(data)} bytes" in message, message
        assert "truncated" in message and "Download or save it again" in message, message
    _, second = _write_sharded(tmp_path / "sharded", _hf_style(state))
    second.write_bytes(second.read_bytes()[:-8])  # a shard whose download stopped short
    with pytest.raises(CheckpointError, match=f"{second} is not a readable safetensors file"):
        read_stage_weights(tmp_path / "sharded", _specs(state, ["ln_f.bias"]))


def test_pipeline_checkpoints_give_their_newest_complete_step_and_refuse_unfinished_ones(tmp_path: Path) -> None:
    from partitioner.plan import example_plan
    from runtime.state.checkpoint import save_checkpoint

    root = tmp_path / "ckpt"
    states = {}
    model = load_model_file(SPEC).build()
    with single_rank_group():
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(step))
            states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            save_checkpoint(root, modules=[model], plan=example_plan(), keys=set(model.state_dict()), step=step)
    names = ["layers.1.weight", "lm_head.weight", "scale"]
    for path, step in ((root, 2), (root / "step-1", 1)):
        got = read_stage_weights(path, _specs(states[step], names), ALIASES)
        for name in names:
            assert torch.equal(got[name], states[step][name]), (path, name)
    unfinished = root / ".step-3.tmp-0a1b2c"
    shutil.copytree(root / "step-2", unfinished)
    (unfinished / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match=f"did not finish.*exists at {root / 'step-2'}"):
        read_stage_weights(unfinished, _specs(states[2], names), ALIASES)
    half = tmp_path / "half"  # as an interrupted save of earlier versions left it: plan.json, no manifest
    shutil.copytree(unfinished, half)
    with pytest.raises(CheckpointError, match="did not finish") as error:
        read_stage_weights(half, _specs(states[2], names), ALIASES)
    assert "weights=" not in str(error.value)
    shard = root / "step-2" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-16])
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        read_stage_weights(root, _specs(states[2], names), ALIASES)


def test_model_built_on_meta_is_filled_and_keeps_its_tie(tmp_path: Path) -> None:
    state = _state()
    save_file(_hf_style(state), str(tmp_path / "model.safetensors"))
    model_file = load_model_file(SPEC)
    with torch.device("meta"):
        model: Any = model_file.build()  # a TiedLM: its submodules by attribute
    assert model.wte.weight.is_meta
    load_weights([model], tmp_path, keys=set(state), tied=TIED)
    assert model.lm_head.weight is model.wte.weight and isinstance(model.wte.weight, torch.nn.Parameter)
    for name, value in model.state_dict().items():
        assert not value.is_meta and torch.equal(value, state[name]), name
    real: Any = model_file.build()  # real tensors are overwritten in place
    before = real.layers[0].weight
    load_weights([real], tmp_path, keys=set(state), tied=TIED)
    assert real.layers[0].weight is before and torch.equal(before, state["layers.0.weight"])


def test_supply_for_materialisation_skips_non_persistent_buffers(tmp_path: Path) -> None:
    state = _state()
    save_file(_hf_style(state), str(tmp_path / "model.safetensors"))
    supply = weights_supply(tmp_path, keys=set(state), tied=TIED)
    wanted = {"lm_head.weight": torch.empty(32, 16, device="meta"),
              "rotary.inv_freq": torch.empty(4, device="meta")}  # not a state-dict key: initialised instead
    got = supply(wanted)
    assert set(got) == {"lm_head.weight"} and torch.equal(got["lm_head.weight"], state["wte.weight"])


def test_cli_run_passes_weights_to_the_ranks_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from partitioner import cli
    from partitioner.plan import example_plan
    from runtime.launch import torchrun as launch

    example_plan().save(tmp_path / "plan")
    (tmp_path / "model.safetensors").write_bytes(b"")
    seen: list[str | None] = []
    def run_plan(*args: Any) -> int:
        seen.append(os.environ.get(WEIGHTS_ENV))
        return 0

    monkeypatch.setattr(launch, "run_plan", run_plan)
    before = os.environ.get(WEIGHTS_ENV)
    monkeypatch.setenv(WEIGHTS_ENV, "")  # so that the value cli.main sets is undone after the test
    monkeypatch.delenv(WEIGHTS_ENV)
    argv = ["run", str(tmp_path / "plan"), "--weights", str(tmp_path / "model.safetensors"), "--", "train.py"]
    assert cli.main(argv) == 0
    assert seen == [str((tmp_path / "model.safetensors").resolve())]
    assert weights_from_env(None) == seen[0] and weights_from_env("other") == "other"
    argv[3] = str(tmp_path / "absent.safetensors")
    assert cli.main(argv) == 2
    assert "--weights" in capsys.readouterr().err and len(seen) == 1
    monkeypatch.undo()
    assert os.environ.get(WEIGHTS_ENV) == before  # later tests' ranks must not load these weights


# -------------------------------------------------------------------- ranks


@pytest.mark.slow  # spawns ranks
def test_pipeline_stages_load_their_weights_from_each_source(tmp_path: Path) -> None:
    """Two ranks, one stage each; the tied weight is on both, stored once in every file."""
    plan = make_plan(SPEC, tmp_path / "plan", pp=2, dp=1, microbatches=2, schedule="1f1b")
    assert [t.stages for t in plan.tied] == [(0, 1)]
    state = _state()
    stored = _hf_style(state)
    save_file(stored, str(tmp_path / "model.safetensors"))
    _write_sharded(tmp_path / "sharded", stored)
    _write_dcp(tmp_path / "dcp", stored)
    save_file({k: v for k, v in stored.items() if k != "ln_f.weight"}, str(tmp_path / "broken.safetensors"))
    sources = {"file": str(tmp_path / "model.safetensors"), "sharded": str(tmp_path / "sharded"),
               "dcp": str(tmp_path / "dcp"), "env": str(tmp_path), "meta": str(tmp_path / "sharded")}
    out = tmp_path / "out"
    out.mkdir()
    codes = spawn_and_wait(
        checkpoint_workers.weights_worker, plan.gpus,
        (plan.gpus, free_port(), str(tmp_path / "plan"), SPEC, str(out), sources,
         str(tmp_path / "broken.safetensors")),
        limit_s=120,
    )
    assert codes == [0] * plan.gpus, f"rank exit codes {codes} (None: still running after 120 s)"
    whole = load_model_file(SPEC).build()
    whole.load_state_dict(state)
    want = whole.state_dict()
    held: set[str] = set()
    for rank in range(plan.gpus):
        result = torch.load(out / f"rank{rank}.pt", weights_only=True)
        for label in sources:
            assert result[label], f"rank {rank} holds nothing from {label}"
            for name, value in result[label].items():
                assert torch.allclose(value, want[name], rtol=0, atol=1e-6), f"rank {rank}, {label}: {name}"
            held |= set(result[label])
        # ln_f lives on the last stage only, yet every rank stops with the error.
        broken = result["broken"]
        assert broken is not None and "ln_f.weight" in broken and "broken.safetensors" in broken, (rank, broken)
    assert held == set(want)
