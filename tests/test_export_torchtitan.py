"""``autopartition export --to torchtitan``: a plan as torchtitan's settings, checked by torchtitan itself.

The mapping tests (stages as whole blocks, schedules, replicas, recomputation, the
TOML, the command) run everywhere.  With torchtitan installed (the ``dev`` extra,
Python 3.11+) its own config loader parses the exported settings for its Llama
(``--module llama3 --config llama3_debugmodel``, validated by its ``Trainer.Config``),
its ``ParallelDims`` checks the degrees against the plan's GPUs, and its
``_pipeline_module_split`` cuts its own Llama, built on the meta device with the
plan's 4 layers, once per pipeline rank (a fake process group stands in for the
ranks): each rank must get our stages, each with exactly our modules.

torchtitan's model package imports its MoE expert-parallel GPU kernels, written in
Triton (1 GB, GPU-only, not a dependency of CPU torch); where Triton is absent the
kernel module is replaced by a stand-in that raises when called.  A dense Llama
never calls it; the config, the model and the split are torchtitan's own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shlex
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from partitioner.cli import main
from partitioner.errors import AutopartitionError
from partitioner.export.torchtitan import (
    export_torchtitan,
    stage_blocks,
    torchtitan_flags,
    torchtitan_stage_ranks,
)
from partitioner.orders import stage_ranks
from partitioner.plan import Plan, TiedParameter, example_plan

LAYERS = 4  # examples/llama.py:llama_tiny
LLAMA = "examples/llama.py:llama_tiny"


def _hf_llama_parameters(layers: int = LAYERS) -> list[str]:
    """A Hugging Face LlamaForCausalLM's parameter names in graph order."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        names += [f"model.layers.{i}.{p}.weight" for p in (
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names + ["model.norm.weight", "lm_head.weight"]


def _layer_start(i: int) -> int:
    """Index of layer i's first parameter in :func:`_hf_llama_parameters` (the embedding is index 0)."""
    return 1 + 9 * i


def _llama_plan(schedule: str = "1f1b", *, pp: int = 2, dp: int = 1, chunks: int = 1, cuts: tuple[int, ...] = (),
                shard: tuple[str, ...] | str = "none", recompute: tuple[str, ...] | str = "none",
                precision: str = "fp32", microbatches: int = 4, batch_size: int = 16) -> Plan:
    """A plan of a 4-layer Hugging Face Llama whose stage s starts at parameter ``cuts[s - 1]``.

    Parameters are listed sorted, as the planner writes them; their graph order is the nodes'.
    """
    names = _hf_llama_parameters()
    bounds = (0, *cuts, len(names))
    n_stages = pp * chunks
    assert len(bounds) == n_stages + 1
    placed = stage_ranks(schedule, ranks=pp, chunks=chunks)
    base = example_plan()
    stages = []
    for s in range(n_stages):
        held = names[bounds[s]:bounds[s + 1]]
        stages.append(dataclasses.replace(
            base.stages[0], index=s, rank=placed[s], ranks=tuple(placed[s] * dp + i for i in range(dp)),
            parameters=tuple(sorted(held)), nodes=tuple(n.replace(".", "_") for n in held),
            shard=shard if isinstance(shard, str) else shard[s],
            recompute=recompute if isinstance(recompute, str) else recompute[s]))
    return dataclasses.replace(
        base, gpus=pp * dp, pp=pp, dp=dp, chunks=chunks, schedule=schedule, microbatches=microbatches,
        batch_size=batch_size, stages=tuple(stages), precision=precision, actions=(("",),) * pp,
        stage_code=("",) * n_stages)


def _whole_layer_cuts(*first_layers: int) -> tuple[int, ...]:
    return tuple(_layer_start(i) for i in first_layers)


# Plans cut at whole blocks, with the module lists torchtitan must get.
WHOLE = {
    "1f1b": (_llama_plan("1f1b", pp=2, dp=2, cuts=_whole_layer_cuts(2)),
             [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "lm_head"]]),
    "interleaved-1f1b": (_llama_plan("interleaved-1f1b", pp=2, dp=2, chunks=2, cuts=_whole_layer_cuts(1, 2, 3)),
                         [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"],
                          ["layers.3", "norm", "lm_head"]]),
    "zbv": (_llama_plan("zbv", pp=2, chunks=2, cuts=_whole_layer_cuts(1, 3) + (_layer_start(4),)),
            [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3"], ["norm", "lm_head"]]),
}
# As the planner cut llama_tiny for interleaved-1f1b (2 chunks): layer 3's input norm in stage 2, the rest in 3.
INSIDE = _llama_plan("interleaved-1f1b", pp=2, chunks=2, cuts=(_layer_start(1), _layer_start(2), _layer_start(3) + 1))


# ------------------------------------------------------------------ the mapping


@pytest.mark.parametrize("kind", sorted(WHOLE))
def test_whole_block_stages_map_to_torchtitan_names_once_each(kind: str) -> None:
    plan, expected = WHOLE[kind]
    parts, notes = stage_blocks(plan, names="torchtitan-llama")
    assert parts == expected and notes == []
    own, own_notes = stage_blocks(plan)
    assert own[0][:2] == ["model.embed_tokens", "model.layers.0"] and own[-1][-2:] == ["model.norm", "lm_head"]
    assert any("--names torchtitan-llama" in n for n in own_notes)  # the model's own names, and the hint
    flat = [m for part in parts for m in part]
    assert sorted(flat) == sorted(["tok_embeddings", "norm", "lm_head"] + [f"layers.{i}" for i in range(LAYERS)])


def test_a_cut_inside_a_block_moves_the_block_whole_and_says_so() -> None:
    parts, notes = stage_blocks(INSIDE, names="torchtitan-llama")
    assert parts == [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "lm_head"]]
    assert len(notes) == 1
    assert "splits layers.3 over stages 2 and 3" in notes[0] and "1 of its 9 parameter tensors" in notes[0]
    # The layer's bulk decides: with only its input norm in stage 3, layer 3 stays in stage 2.
    mostly_early = _llama_plan("interleaved-1f1b", pp=2, chunks=2,
                               cuts=(_layer_start(1), _layer_start(2), _layer_start(4) - 1))
    assert stage_blocks(mostly_early, names="torchtitan-llama")[0][2:] == [["layers.2", "layers.3"], ["norm", "lm_head"]]


def test_a_tied_head_is_listed_under_its_own_name_in_the_last_stage() -> None:
    plan, expected = WHOLE["1f1b"]
    last = plan.stages[-1]
    tied_last = dataclasses.replace(last, parameters=tuple(
        "model.embed_tokens.weight" if p == "lm_head.weight" else p for p in last.parameters))
    plan = dataclasses.replace(plan, stages=(*plan.stages[:-1], tied_last), tied=(TiedParameter(
        "model.embed_tokens.weight", ("model.embed_tokens.weight", "lm_head.weight"), (0, 1)),))
    parts, notes = stage_blocks(plan, names="torchtitan-llama")
    assert parts == expected
    assert len(notes) == 1 and "tied parameters model.embed_tokens.weight" in notes[0]


def test_more_stages_than_blocks_is_refused_with_what_to_do() -> None:
    eight = _llama_plan("interleaved-1f1b", pp=2, chunks=4, cuts=(5, 10, 15, 20, 25, 30, 35))  # 39 tensors
    with pytest.raises(AutopartitionError, match=r"8 stages over 7 blocks.*fewer --chunks"):
        export_torchtitan(eight)


def test_names_the_llama_mapping_cannot_place_are_refused() -> None:
    plan = example_plan()  # an MLP: blocks "0" and "2"
    assert stage_blocks(plan)[0] == [["0"], ["2"]]
    with pytest.raises(AutopartitionError, match="--names model"):
        stage_blocks(plan, names="torchtitan-llama")
    with pytest.raises(AutopartitionError, match="Unknown --names"):
        stage_blocks(plan, names="megatron")


@pytest.mark.parametrize(("schedule", "chunks", "name", "note"), [
    ("gpipe", 1, "GPipe", None),
    ("1f1b", 1, "1F1B", None),
    ("zb-h1", 1, "1F1B", "InterleavedZeroBubble needs >= 2 stages per rank"),
    ("interleaved-1f1b", 2, "Interleaved1F1B", None),
    ("zbv", 2, "ZBVZeroBubble", None),
])
def test_schedules_map_to_torchtitan_and_zb_h1_names_the_nearest(
        schedule: str, chunks: int, name: str, note: str | None) -> None:
    cuts = _whole_layer_cuts(2) if chunks == 1 else _whole_layer_cuts(1, 2, 3)
    out = export_torchtitan(_llama_plan(schedule, pp=2, chunks=chunks, cuts=cuts), names="torchtitan-llama")
    assert out.sections["parallelism"]["pipeline_parallel_schedule"] == name
    assert [n for n in out.notes if note is not None and note in n] or (note is None and out.notes == ())
    # Our stage i is torchtitan's model part i on the same pipeline rank.
    assert torchtitan_stage_ranks(name, pp=2, stages=2 * chunks) == stage_ranks(schedule, ranks=2, chunks=chunks)


@pytest.mark.parametrize(("shard", "replicate_shard", "note"), [
    ("none", (4, 1), None),
    ("full", (1, 4), None),
    ("optimizer", (1, 4), "no optimizer-only sharding"),
    (("none", "full"), (1, 4), "replicates stage 0 and shards the others"),
])
def test_replicas_map_to_one_data_parallel_setting(shard: Any, replicate_shard: tuple[int, int], note: str | None) -> None:
    out = export_torchtitan(_llama_plan(pp=2, dp=4, cuts=_whole_layer_cuts(2), shard=shard))
    par = out.sections["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == replicate_shard
    assert par["tensor_parallel_degree"] == 1
    assert [n for n in out.notes if note is not None and note in n] or note is None


def test_a_tensor_parallel_plan_exports_its_degree() -> None:
    plan = _llama_plan(pp=2, dp=2, cuts=_whole_layer_cuts(2))
    plan = dataclasses.replace(plan, tp=2, gpus=plan.gpus * 2)
    assert export_torchtitan(plan).sections["parallelism"]["tensor_parallel_degree"] == 2


@pytest.mark.parametrize(("recompute", "mode", "note"), [
    ("none", "none", None), ("full", "full", None), (("full", "none"), "full", "recomputes stage 0 only"),
])
def test_recomputation_maps_to_one_checkpointing_mode(recompute: Any, mode: str, note: str | None) -> None:
    out = export_torchtitan(_llama_plan(cuts=_whole_layer_cuts(2), recompute=recompute))
    assert out.sections["activation_checkpoint"] == {"mode": mode}
    assert [n for n in out.notes if note is not None and note in n] or note is None


@pytest.mark.parametrize(("precision", "dtype", "param"), [
    ("fp32", "float32", "float32"), ("bf16-mixed", "float32", "bfloat16"), ("bf16", "bfloat16", "bfloat16"),
])
def test_micro_batches_and_precision(precision: str, dtype: str, param: str) -> None:
    plan = _llama_plan(pp=2, dp=2, cuts=_whole_layer_cuts(2), precision=precision, microbatches=4, batch_size=32)
    out = export_torchtitan(plan)
    assert out.sections["parallelism"]["pipeline_parallel_microbatch_size"] == 4  # 32 / (2 replicas x 4)
    training = out.sections["training"]
    # torchtitan runs local_batch_size / microbatch_size micro-batches per replica: the plan's 4.
    assert training["local_batch_size"] // out.sections["parallelism"]["pipeline_parallel_microbatch_size"] == 4
    assert (training["global_batch_size"], training["dtype"], training["mixed_precision_param"]) == (32, dtype, param)


def test_toml_reads_back_and_its_header_holds_the_flags() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    plan, _ = WHOLE["interleaved-1f1b"]
    out = export_torchtitan(plan, names="torchtitan-llama", source="plan/")
    text = out.toml()
    assert tomllib.loads(text) == out.sections
    lines = text.splitlines()
    shell = " ".join(line[2:].rstrip("\\") for line in lines[lines.index(next(ln for ln in lines if "pass instead" in ln)) + 1:]
                     if line.startswith("#   "))
    assert shlex.split(shell) == out.flags  # the header's command line is the flags, one option a line
    assert out.flags[-2:] == ["--training.disable_cuda_graphs", "activation_checkpoint:none"]
    assert torchtitan_flags({"parallelism": {"pipeline_parallel_degree": 1}}) == [
        "--parallelism.pipeline_parallel_degree", "1"]  # no pipeline: CUDA graphs may stay


# ------------------------------------------------------------------ the command


def _saved_llama_plan(directory: Path) -> Path:
    """example_plan's two stages (a valid layout) holding a Llama's parameters, saved."""
    names = _hf_llama_parameters()
    base = example_plan()
    halves = (names[:_layer_start(2)], names[_layer_start(2):])
    stages = tuple(dataclasses.replace(st, parameters=tuple(sorted(h)), nodes=tuple(n.replace(".", "_") for n in h))
                   for st, h in zip(base.stages, halves))
    return dataclasses.replace(base, stages=stages).save(directory)


def test_export_command_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_dir = _saved_llama_plan(tmp_path / "plan")
    out = tmp_path / "torchtitan.toml"
    assert main(["export", str(plan_dir), "--to", "torchtitan", "--names", "torchtitan-llama", "-o", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out == "" and f"wrote {out}" in said.err
    text = out.read_text()
    assert 'module_fqns_per_model_part = [\n  ["tok_embeddings", "layers.0", "layers.1"],' in text
    assert main(["export", str(plan_dir / "plan.json"), "--to", "torchtitan"]) == 0  # to standard output
    said = capsys.readouterr()
    assert '["model.embed_tokens", "model.layers.0", "model.layers.1"]' in said.out
    assert "export with --names torchtitan-llama" in said.err


@pytest.mark.parametrize(("args", "message"), [
    (["export", "{tmp}/missing", "--to", "torchtitan"], "No plan at"),
    (["export", "{plan}", "--to", "megatron"], "--to megatron: autopartition exports to torchtitan only"),
    (["export", "{plan}", "--to", "torchtitan", "--names", "gpt"], "Unknown --names 'gpt'"),
    (["export", "{plan}", "--to", "torchtitan", "-o", "{tmp}"], "is a directory"),
    (["export", "{plan}"], "the following arguments are required: --to"),
])
def test_bad_input_exits_2_with_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    plan_dir = _saved_llama_plan(tmp_path / "plan")
    argv = [a.format(tmp=tmp_path, plan=plan_dir) for a in args]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err


# ------------------------------------------------------------------ torchtitan itself


def _stand_in_for_gpu_kernels() -> None:
    """torchtitan's MoE expert-parallel kernels (Triton) for a CPU machine without Triton: never called here."""
    name = "torchtitan.distributed.minimal_async_ep"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    stand_in = types.ModuleType(name)

    def _gpu_only(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torchtitan's MinimalAsyncEP kernels need Triton (a stand-in in this test)")

    for attr in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config"):
        setattr(stand_in, attr, _gpu_only)
    stand_in.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})  # type: ignore[attr-defined]
    sys.modules[name] = stand_in


@pytest.fixture(scope="module")
def titan() -> types.SimpleNamespace:
    """torchtitan's config loader, its Llama and its pipeline split (skips where torchtitan is missing)."""
    pytest.importorskip("torchtitan", reason="torchtitan (the dev extra, Python 3.11+) checks the export")
    _stand_in_for_gpu_kernels()
    config = pytest.importorskip("torchtitan.config")
    registry = pytest.importorskip("torchtitan.models.llama3.config_registry")
    llama3 = pytest.importorskip("torchtitan.models.llama3")
    pipeline = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    dims = pytest.importorskip("torchtitan.distributed.parallel_dims")
    return types.SimpleNamespace(config=config, registry=registry, llama3=llama3, pipeline=pipeline, dims=dims)


def _parse(titan: types.SimpleNamespace, flags: list[str]) -> Any:
    """torchtitan's own config loading: its Llama 3 debug job, our settings on top (its CLI, since 0.3)."""
    return titan.config.ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *flags])


def _split_by_torchtitan(titan: types.SimpleNamespace, parts: list[list[str]], schedule: str, pp: int,
                         ) -> dict[int, list[tuple[int, list[str]]]]:
    """Per pipeline rank: (stage index, blocks with parameters) of each stage torchtitan builds there."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = titan.llama3.llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:LAYERS]
    with torch.device("meta"):
        model = config.build()
    built: dict[int, list[tuple[int, list[str]]]] = {}
    for rank in range(pp):
        dist.init_process_group("fake", rank=rank, world_size=pp, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
            stages, chunks = titan.pipeline._pipeline_module_split(model, mesh, schedule, torch.device("meta"), parts)
            built[rank] = [(stage.stage_index, _blocks_with_parameters(chunk)) for stage, chunk in zip(stages, chunks)]
        finally:
            dist.destroy_process_group()
    return built


def _blocks_with_parameters(module: Any) -> list[str]:
    blocks = {".".join(n.split(".")[:2]) if n.startswith("layers.") else n.split(".")[0]
              for n, _ in module.named_parameters()}
    return sorted(blocks)


TITAN_PLANS = {**{k: v[0] for k, v in WHOLE.items()}, "inside-a-layer": INSIDE}


@pytest.mark.parametrize("kind", sorted(TITAN_PLANS))
def test_torchtitan_loads_the_settings_and_splits_its_llama_into_our_stages(
        titan: types.SimpleNamespace, kind: str) -> None:
    plan = TITAN_PLANS[kind]
    _check_with_torchtitan(titan, plan, export_torchtitan(plan, names="torchtitan-llama").sections)


def _check_with_torchtitan(titan: types.SimpleNamespace, plan: Plan, sections: dict[str, dict[str, Any]]) -> None:
    par = sections["parallelism"]
    job = _parse(titan, torchtitan_flags(sections))
    for key, value in par.items():
        assert getattr(job.parallelism, key) == value, key
    for key, value in sections["training"].items():
        assert getattr(job.training, key) == value, key
    mode = sections["activation_checkpoint"]["mode"]
    assert (job.activation_checkpoint is None) == (mode == "none")
    assert mode == "none" or type(job.activation_checkpoint).__qualname__ == "FullAC.Config"
    titan.dims.ParallelDims.from_config(job.parallelism, plan.gpus)  # degrees multiply to the plan's GPUs
    # torchtitan's split, rank by rank: our stages on our ranks, each with exactly our modules.
    parts = par["module_fqns_per_model_part"]
    built = _split_by_torchtitan(titan, parts, par["pipeline_parallel_schedule"], plan.pp)
    for rank in range(plan.pp):
        assert [s for s, _ in built[rank]] == list(plan.stages_of(rank))
        for stage, blocks in built[rank]:
            assert blocks == sorted(parts[stage]), (rank, stage)


def test_torchtitan_validation_is_live(titan: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    """The checks can fail: torchtitan refuses a pipeline without disable_cuda_graphs, a bad degree, a bad V."""
    plan, _ = WHOLE["1f1b"]
    flags = export_torchtitan(plan, names="torchtitan-llama").flags
    with pytest.raises(SystemExit):  # tyro reports Trainer.Config's ValueError and exits
        _parse(titan, [f for f in flags if f != "--training.disable_cuda_graphs"])
    assert "CUDA graphs do not support pipeline parallelism" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="Invalid parallel dims"):
        titan.dims.ParallelDims.from_config(_parse(titan, flags).parallelism, plan.gpus + 1)
    with pytest.raises(AssertionError, match="v schedules assume 2 stages per rank"):
        _split_by_torchtitan(titan, [["tok_embeddings"], ["layers.0"]], "ZBVZeroBubble", 2)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "chunks"), [("zb-h1", None), ("interleaved-1f1b", 2)])
def test_llama_tiny_plans_export_to_torchtitan(
        titan: types.SimpleNamespace, tmp_path: Path, schedule: str, chunks: int | None) -> None:
    """About 15 s each: llama_tiny planned for 4 h100s, pp 2 x dp 2, exported by the command, run through torchtitan."""
    from partitioner.modelfile import load_model_file
    from partitioner.search.planner import compile

    tomllib = pytest.importorskip("tomllib")
    model_file = load_model_file(LLAMA)
    plan = compile(model_file.build(), model_file.example_inputs(32), gpus=4, pp=2, dp=2, microbatches=2,
                   schedule=schedule, chunks=chunks, device="h100")
    plan_dir = plan.save(tmp_path / "plan")
    out = tmp_path / "torchtitan.toml"
    assert main(["export", str(plan_dir), "--to", "torchtitan", "--names", "torchtitan-llama", "-o", str(out)]) == 0
    sections = tomllib.loads(out.read_text())
    assert len(sections["parallelism"]["module_fqns_per_model_part"]) == len(plan.stages)
    _check_with_torchtitan(titan, Plan.load(plan_dir), sections)
