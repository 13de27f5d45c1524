"""``autopartition export --to torchtitan``: what torchtitan would run, compared with plan.json field by field.

The mapping tests (stages as whole blocks placed by parameters, names, schedules,
batch and accumulation, replicas and resharding, recomputation, the TOML, the
command) run everywhere.  With torchtitan installed (the ``dev`` extra, Python
3.11+), the command in the export's header goes through torchtitan's own
``ConfigManager``; its ``ParallelDims`` checks the degrees; its
``_pipeline_module_split`` cuts its own Llama, built on the meta device, once per
pipeline rank (a fake process group stands in for the ranks); its
``_build_pipeline_schedule`` builds the schedule; and :func:`_check_with_torchtitan`
asserts degrees, sequence length, global and local batch, micro-batches and
accumulation, schedule and stage placement, resharding, activation checkpointing
and each stage's modules and parameter count against the plan.

Plans: hand-made ones of the tiny Llama (examples/llama.py, checked against
torchtitan's debug Llama cut to its 4 layers), and the planner's own for Llama 3 8B
and 70B on meta (6 layouts each: :data:`LAYOUTS`; the default tier plans one 8B
layout, the exhaustive tier all twelve, cached per process: :func:`llama_plan`).

torchtitan's model package imports its MoE expert-parallel GPU kernels, written in
Triton (1 GB, GPU-only, not a dependency of CPU torch); where Triton is absent the
kernel module is replaced by a stand-in that raises when called.  A dense Llama
never calls it; the config, the model, the split and the schedule are torchtitan's own.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import shlex
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from partitioner.cli import main
from partitioner.errors import AutopartitionError
from partitioner.export.blocks import block_of, held_parameters, split_blocks
from partitioner.export.torchtitan import (
    LLAMA3_CONFIGS,
    TORCHTITAN_VERSION,
    TorchtitanExport,
    export_torchtitan,
    shard_layout,
    stage_blocks,
    torchtitan_flags,
    torchtitan_stage_ranks,
)
from partitioner.orders import stage_ranks
from partitioner.plan import Plan, TensorSpec, TiedParameter, example_plan, legacy_spans

LAYERS = 4  # examples/llama.py:llama_tiny
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GB = 1e9
UNLIMITED = 1e15  # bytes per GPU: the layout is what is tested, not whether it fits


def _hf_llama_parameters(layers: int = LAYERS) -> list[str]:
    """A Hugging Face LlamaForCausalLM's parameter names in graph order."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        names += [f"model.layers.{i}.{p}.weight" for p in (
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names + ["model.norm.weight", "lm_head.weight"]


# llama_tiny's parameter elements (hidden 64, FFN 176, 4 heads / 2 KV heads of 16, vocabulary 512).
_TINY_ROLE = {"input_layernorm": 64, "q_proj": 4096, "k_proj": 2048, "v_proj": 2048, "o_proj": 4096,
              "post_attention_layernorm": 64, "gate_proj": 11264, "up_proj": 11264, "down_proj": 11264}
TINY_SIZES = {name: (32768 if "embed" in name or "lm_head" in name else 64 if name == "model.norm.weight"
                     else _TINY_ROLE[name.split(".")[-2]]) for name in _hf_llama_parameters()}


def _layer_start(i: int) -> int:
    """Index of layer i's first parameter in :func:`_hf_llama_parameters` (the embedding is index 0)."""
    return 1 + 9 * i


def _llama_plan(schedule: str = "1f1b", *, pp: int = 2, dp: int = 1, chunks: int = 1, cuts: tuple[int, ...] = (),
                shard: tuple[str, ...] | str = "none", recompute: tuple[str, ...] | str = "none",
                reshard: bool = False, ops_layers: int = 0, span: str = "", precision: str = "fp32",
                microbatches: int = 4, batch_size: int = 16, gpus_per_node: int = 8, tp: int = 1) -> Plan:
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
        mode = shard if isinstance(shard, str) else shard[s]
        redo = recompute if isinstance(recompute, str) else recompute[s]
        stage = dataclasses.replace(
            base.stages[0], index=s, rank=placed[s], ranks=tuple(placed[s] * dp + i for i in range(dp)),
            parameters=tuple(sorted(held)), nodes=tuple(n.replace(".", "_") for n in held), shard=mode,
            recompute=redo, reshard_after_forward=reshard and mode == "full",
            recompute_ops_layers=ops_layers if redo == "selective" else 0, shard_span=span)  # "": a legacy plan
        stages.append(stage)
    micro = batch_size // (dp * microbatches)
    model = dataclasses.replace(base.model, class_name="LlamaForCausalLM", parameters=sum(TINY_SIZES.values()),
                                inputs=(TensorSpec("input_ids", (micro, 32), "int64"),))
    return dataclasses.replace(
        base, gpus=pp * dp * tp, pp=pp, dp=dp, tp=tp, chunks=chunks, schedule=schedule, microbatches=microbatches,
        batch_size=batch_size, stages=tuple(stages), precision=precision, actions=(("",),) * pp,
        stage_code=("",) * n_stages, gpus_per_node=min(gpus_per_node, pp * dp * tp), model=model)


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
    parts, notes = stage_blocks(plan, sizes=TINY_SIZES)  # auto: a Hugging Face Llama gets torchtitan's names
    assert parts == expected and notes == []
    own, own_notes = stage_blocks(plan, names="model", sizes=TINY_SIZES)
    assert own[0][:2] == ["model.embed_tokens", "model.layers.0"] and own[-1][-2:] == ["model.norm", "lm_head"]
    assert any("--names torchtitan-llama" in n for n in own_notes)  # the model's own names, and the hint
    flat = [m for part in parts for m in part]
    assert sorted(flat) == sorted(["tok_embeddings", "norm", "lm_head"] + [f"layers.{i}" for i in range(LAYERS)])


def test_a_cut_inside_a_block_moves_the_block_whole_and_says_how_far() -> None:
    parts, notes = stage_blocks(INSIDE, sizes=TINY_SIZES)
    assert parts == [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "lm_head"]]
    assert len(notes) == 1
    assert "cuts inside 1 block" in notes[0] and "layers.3 (64 in 2 + 46.1K in 3) -> stage 3" in notes[0]
    assert "2 -0.1%, 3 +0.1%" in notes[0]  # 64 of stage 2's 46,272 parameters move to stage 3
    # The layer's bulk decides: with only its down projection in stage 3, layer 3 stays in stage 2.
    mostly_early = _llama_plan("interleaved-1f1b", pp=2, chunks=2,
                               cuts=(_layer_start(1), _layer_start(2), _layer_start(4) - 1))
    assert stage_blocks(mostly_early, sizes=TINY_SIZES)[0][2:] == [["layers.2", "layers.3"], ["norm", "lm_head"]]


def test_a_cut_layer_goes_where_its_parameters_are_not_where_its_tensors_are() -> None:
    """Six small tensors of layer 2 (norms, attention: 12,416) in stage 0, its MLP (3 tensors, 33,792) in stage 1."""
    plan = _llama_plan(pp=2, cuts=(_layer_start(2) + 6,))
    by_size = split_blocks(plan, sizes=TINY_SIZES)
    assert by_size.parts()[1][0] == "model.layers.2"  # with its MLP: 12,416 moved, not 33,792
    assert by_size.deviation == pytest.approx((-12416 / 137600, 12416 / 112832))
    by_count = split_blocks(plan)  # tensors only: six against three, the wrong side, 3x the parameters moved
    assert by_count.parts()[0][-1] == "model.layers.2"
    block_size = {b: sum(n for p, n in TINY_SIZES.items() if p.startswith(b + ".")) for b in by_count.blocks}
    placed = [sum(block_size[b] for b in part) for part in by_count.parts()]
    assert placed == [137600 + 33792, 112832 - 33792]  # 25 % and 30 % off the plan's stages
    out = export_torchtitan(plan)
    assert any("parameter sizes unknown" in n for n in out.notes)


def test_a_tied_head_is_listed_under_its_own_name_in_the_last_stage() -> None:
    plan, expected = WHOLE["1f1b"]
    last = plan.stages[-1]
    tied_last = dataclasses.replace(last, parameters=tuple(
        "model.embed_tokens.weight" if p == "lm_head.weight" else p for p in last.parameters))
    plan = dataclasses.replace(plan, stages=(*plan.stages[:-1], tied_last), tied=(TiedParameter(
        "model.embed_tokens.weight", ("model.embed_tokens.weight", "lm_head.weight"), (0, 1)),))
    parts, notes = stage_blocks(plan, sizes=TINY_SIZES)
    assert parts == expected
    assert len(notes) == 1 and "tied parameters model.embed_tokens.weight" in notes[0]


def test_more_stages_than_blocks_is_refused_with_what_to_do() -> None:
    eight = _llama_plan("interleaved-1f1b", pp=2, chunks=4, cuts=(5, 10, 15, 20, 25, 30, 35))  # 39 tensors
    with pytest.raises(AutopartitionError, match=r"8 stages over 7 blocks.*fewer --chunks"):
        export_torchtitan(eight, sizes=TINY_SIZES)


def test_names_the_target_model_lacks_are_refused_by_name_never_left_as_empty_stages() -> None:
    plan = example_plan()  # an MLP: blocks "0" and "2", which torchtitan's Llama has no names for
    sizes = {"0.weight": 16, "2.weight": 16}
    assert stage_blocks(plan, sizes=sizes)[0] == [["0"], ["2"]]  # auto: the model's own names
    out = export_torchtitan(plan, sizes=sizes)
    assert out.module == "" and "YOUR_MODULE" in out.command and any("register it with torchtitan" in n
                                                                    for n in out.notes)
    with pytest.raises(AutopartitionError, match=r"has 2 blocks torchtitan's Llama has no name for: 0, 2\."):
        stage_blocks(plan, names="torchtitan-llama", sizes=sizes)
    # A Llama with an extra block: auto keeps the model's names, torchtitan-llama names the block it cannot place.
    names = [*_hf_llama_parameters(), "model.adapter.weight"]
    extra = dataclasses.replace(WHOLE["1f1b"][0], stages=(WHOLE["1f1b"][0].stages[0], dataclasses.replace(
        WHOLE["1f1b"][0].stages[1], parameters=(*WHOLE["1f1b"][0].stages[1].parameters, names[-1]))))
    with pytest.raises(AutopartitionError, match=r"1 block torchtitan's Llama has no name for: model\.adapter"):
        export_torchtitan(extra, names="torchtitan-llama", sizes={**TINY_SIZES, names[-1]: 8})
    with pytest.raises(AutopartitionError, match="Unknown --names"):
        stage_blocks(plan, names="megatron", sizes=sizes)
    with pytest.raises(AutopartitionError, match=r"lack 1 parameter the plan holds \(model\.adapter\.weight\)"):
        export_torchtitan(extra, sizes=TINY_SIZES)


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
    out = export_torchtitan(_llama_plan(schedule, pp=2, chunks=chunks, cuts=cuts), sizes=TINY_SIZES)
    assert out.sections["parallelism"]["pipeline_parallel_schedule"] == name
    others = [n for n in out.notes if "no torchtitan llama3 config" not in n]  # the tiny shape has none
    assert (note is None and others == []) or [n for n in others if note is not None and note in n], out.notes
    # Our stage i is torchtitan's model part i on the same pipeline rank.
    assert torchtitan_stage_ranks(name, pp=2, stages=2 * chunks) == stage_ranks(schedule, ranks=2, chunks=chunks)


@pytest.mark.parametrize(("pp", "dp", "microbatches", "batch", "local"), [
    (2, 2, 4, 32, 16),  # pipelined: one step of 16 per replica, cut into 4 micro-batches of 4
    (1, 2, 4, 32, 4),  # pp = 1: torchtitan accumulates gradients over 32 / (4 x 2) = 4 steps of 4
    (1, 4, 1, 8, 2),
])
def test_batch_micro_batches_and_sequence_length(pp: int, dp: int, microbatches: int, batch: int, local: int) -> None:
    plan = _llama_plan(pp=pp, dp=dp, cuts=_whole_layer_cuts(2)[:pp - 1], microbatches=microbatches,
                       batch_size=batch)
    training = export_torchtitan(plan, sizes=TINY_SIZES).sections["training"]
    assert (training["local_batch_size"], training["global_batch_size"], training["seq_len"]) == (local, batch, 32)
    steps = batch // (local * dp)  # torchtitan's Trainer: gradient accumulation steps
    per_step = local // plan.microbatch_size if pp > 1 else 1  # its pipeline micro-batches per step
    assert steps * per_step == microbatches


@pytest.mark.parametrize(("shard", "reshard", "span", "dp", "expected", "note"), [
    ("none", False, "", 4, (4, 1, None), None),
    ("full", False, "", 4, (1, 4, "never"), None),
    ("full", True, "", 4, (1, 4, "always"), "reduce-scatters its gradients once per step"),
    ("full", True, "", 16, (2, 8, "always"), None),  # replicas on 2 whole nodes at tp 1: HSDP by default
    ("full", True, "world", 16, (1, 16, "always"), None),
    ("full", False, "node", 16, (2, 8, "never"), None),
    ("optimizer", False, "", 4, (1, 4, "never"), "no optimizer-only sharding"),
    (("none", "full"), False, "", 4, (1, 4, "never"), "replicates stage 0 and shards the others"),
    (("full", "full"), (True, False), "", 4, (1, 4, "always"), "on stage(s) 0 only"),
])
def test_replicas_and_resharding_map_to_one_data_parallel_setting(
        shard: Any, reshard: Any, span: str, dp: int, expected: tuple[int, int, str | None], note: str | None) -> None:
    plan = _llama_plan(pp=2, dp=dp, cuts=_whole_layer_cuts(2), shard=shard, reshard=reshard is True, span=span,
                       batch_size=8 * dp)
    if isinstance(reshard, tuple):
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, reshard_after_forward=r)
                                                      for s, r in zip(plan.stages, reshard)))
    out = export_torchtitan(plan, sizes=TINY_SIZES)
    par = out.sections["parallelism"]
    got = (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"],
           par.get("fsdp_reshard_after_forward"))
    assert got == expected
    assert note is None or [n for n in out.notes if note in n], out.notes


def test_hsdp_by_default_follows_the_cost_model() -> None:
    """Without shard_span (a plan older than spans), a full stage group is HSDP exactly where the planner priced it so
    (plan.legacy_spans), and with a span, as the span says (Plan.shard_degree)."""
    for dp, per_node, tp in ((16, 8, 1), (4, 8, 1), (12, 8, 1), (16, 8, 2), (32, 8, 1)):
        plan = dataclasses.replace(example_plan(), gpus=2 * dp * tp, pp=2, dp=dp, tp=tp, gpus_per_node=per_node)
        for span in ("", "world", "node"):
            stage = dataclasses.replace(plan.stages[0], shard="full", shard_span=span)
            priced = legacy_spans(dataclasses.replace(plan, stages=(stage, *plan.stages[1:])))
            replicas, shards = shard_layout(plan, stage)
            assert replicas * shards == dp
            assert shards == priced.shard_degree(priced.stages[0]), (dp, per_node, tp, span)


def test_a_tensor_parallel_plan_exports_its_degree_with_sequence_parallelism() -> None:
    plan = _llama_plan(pp=2, dp=2, cuts=_whole_layer_cuts(2), tp=2)
    par = export_torchtitan(plan, sizes=TINY_SIZES).sections["parallelism"]
    assert (par["tensor_parallel_degree"], par["enable_sequence_parallel"]) == (2, True)


@pytest.mark.parametrize(("recompute", "ops_layers", "mode", "note"), [
    ("none", 0, "none", None),
    ("full", 0, "full", None),
    (("full", "none"), 0, "full", "whole layers: stage 0; nothing: stage 1"),
    ("selective", 2, "selective", "recomputes only cheap ops"),  # the plan's per-op policy, on 2 layers
    (("selective", "none"), 1, "selective", "every layer"),
])
def test_recomputation_maps_to_one_checkpointing_mode(recompute: Any, ops_layers: int, mode: str,
                                                      note: str | None) -> None:
    out = export_torchtitan(_llama_plan(cuts=_whole_layer_cuts(2), recompute=recompute, ops_layers=ops_layers),
                            sizes=TINY_SIZES)
    assert out.sections["activation_checkpoint"] == {"mode": mode}
    assert note is None or [n for n in out.notes if note in n], out.notes
    assert out.flags[-1] == f"activation_checkpoint:{mode}"


def test_selective_layers_recomputed_whole_take_full() -> None:
    plan = _llama_plan(cuts=_whole_layer_cuts(2), recompute="selective", ops_layers=1)
    plan = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], recompute_layers=1),
                                             plan.stages[1]))
    out = export_torchtitan(plan, sizes=TINY_SIZES)
    assert out.sections["activation_checkpoint"] == {"mode": "full"}
    assert [n for n in out.notes if "only some of their layers" in n]


@pytest.mark.parametrize(("precision", "dtype", "param"), [
    ("fp32", "float32", "float32"), ("bf16-mixed", "float32", "bfloat16"), ("bf16", "bfloat16", "bfloat16"),
    ("fp8", "float32", "bfloat16"),
])
def test_precision(precision: str, dtype: str, param: str) -> None:
    out = export_torchtitan(_llama_plan(cuts=_whole_layer_cuts(2), precision=precision), sizes=TINY_SIZES)
    assert (out.sections["training"]["dtype"], out.sections["training"]["mixed_precision_param"]) == (dtype, param)
    assert any("float8" in n for n in out.notes) == (precision == "fp8"), out.notes


def _command_in_header(text: str) -> list[str]:
    """The shell command the file's header holds (its comment lines after "run this")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "run this on every node" in line) + 2
    shell = " ".join(line[1:].strip().rstrip("\\") for line in lines[start:] if line.startswith("#   "))
    return shlex.split(shell)


def test_toml_reads_back_and_its_header_holds_the_whole_command() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    plan, _ = WHOLE["interleaved-1f1b"]
    out = export_torchtitan(plan, sizes=TINY_SIZES, source="plan/")
    text = out.toml()
    assert tomllib.loads(text) == out.sections
    command = _command_in_header(text)
    assert command == out.command
    assert command[:6] == ["torchrun", "--nproc_per_node", "4", "-m", "torchtitan.train", "--module"]
    assert command[6:9] == ["llama3", "--config", "YOUR_CONFIG"]  # no torchtitan config has the tiny shape
    assert out.flags[-2:] == ["--training.disable_cuda_graphs", "activation_checkpoint:none"]
    assert f"checked against {TORCHTITAN_VERSION}" in text and "0.2" not in text
    assert torchtitan_flags({"parallelism": {"pipeline_parallel_degree": 1}}) == [
        "--parallelism.pipeline_parallel_degree", "1"]  # no pipeline: CUDA graphs may stay


def test_llama3_shapes_name_their_torchtitan_config() -> None:
    plan, _ = WHOLE["1f1b"]
    for config, (layers, parameters) in LLAMA3_CONFIGS.items():
        names = _hf_llama_parameters(layers)
        half = _layer_start(layers // 2)
        sized = dataclasses.replace(plan, model=dataclasses.replace(plan.model, parameters=parameters), stages=(
            dataclasses.replace(plan.stages[0], parameters=tuple(names[:half])),
            dataclasses.replace(plan.stages[1], parameters=tuple(names[half:]))))
        out = export_torchtitan(sized)
        assert (out.module, out.config) == ("llama3", config)
        assert out.command[out.command.index("--config") + 1] == config


# ------------------------------------------------------------------ the command


def _saved_llama_plan(directory: Path, *, source: str = f"{EXAMPLES / 'llama.py'}:llama_tiny") -> Path:
    """example_plan's two stages (a valid layout) holding the tiny Llama cut in layer 2 after its attention, saved.

    Six small tensors of layer 2 sit in stage 0, its three MLP matrices (3x their parameters) in stage 1.
    """
    cut = _llama_plan(pp=2, cuts=(_layer_start(2) + 6,))
    base = example_plan()
    stages = tuple(dataclasses.replace(st, parameters=s.parameters, nodes=s.nodes)
                   for st, s in zip(base.stages, cut.stages))
    model = dataclasses.replace(base.model, class_name="LlamaForCausalLM", source=source,
                                parameters=sum(TINY_SIZES.values()))
    return dataclasses.replace(base, stages=stages, model=model).save(directory)


def test_export_command_writes_the_file_with_stages_placed_by_the_model_s_sizes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="examples/llama.py builds a Hugging Face Llama")
    plan_dir = _saved_llama_plan(tmp_path / "plan")
    out = tmp_path / "torchtitan.toml"
    assert main(["export", str(plan_dir), "--to", "torchtitan", "-o", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out == "" and f"wrote {out}" in said.err and "reads no TOML" in said.err
    assert "sizes unknown" not in said.err  # the plan's model file gave them
    text = out.read_text()
    # Layer 2 goes whole to stage 1, with its MLP (counting tensors would keep it in stage 0).
    assert 'module_fqns_per_model_part = [\n  ["tok_embeddings", "layers.0", "layers.1"],' in text
    assert main(["export", str(plan_dir / "plan.json"), "--to", "torchtitan", "--names", "model"]) == 0
    said = capsys.readouterr()
    assert '["model.embed_tokens", "model.layers.0", "model.layers.1"]' in said.out
    assert "export with --names torchtitan-llama" not in said.err


def test_export_without_the_model_file_says_so_and_counts_tensors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_dir = _saved_llama_plan(tmp_path / "plan", source=str(tmp_path / "gone.py"))
    assert main(["export", str(plan_dir), "--to", "torchtitan"]) == 0
    said = capsys.readouterr()
    assert "parameter sizes unknown: its model file" in said.err and "gone.py" in said.err
    assert '["tok_embeddings", "layers.0", "layers.1", "layers.2"]' in said.out  # six tensors outvote three


@pytest.mark.parametrize(("args", "message"), [
    (["export", "{tmp}/missing", "--to", "torchtitan"], "No plan at"),
    (["export", "{plan}", "--to", "deepspeed"], "--to deepspeed: autopartition exports to torchtitan or megatron"),
    (["export", "{plan}", "--to", "torchtitan", "--names", "gpt"], "Unknown --names 'gpt'"),
    (["export", "{plan}", "--to", "megatron", "--names", "model"], "--names applies to --to torchtitan"),
    (["export", "{plan}", "--to", "torchtitan", "-o", "{tmp}"], "is a directory"),
    (["export", "{plan}"], "the following arguments are required: --to"),
])
def test_bad_input_exits_2_with_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    plan_dir = _saved_llama_plan(tmp_path / "plan", source="")
    argv = [a.format(tmp=tmp_path, plan=plan_dir) for a in args]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err


# ------------------------------------------------------------------ plans of Llama 3 8B and 70B


def _layout(**options: Any) -> dict[str, Any]:
    return options


# The six layouts of the issue, per model: compile() keywords, "batch" the mini-batch, and what the plan must show.
LAYOUTS: dict[str, dict[str, dict[str, Any]]] = {
    "llama3_8b": {
        "pp": _layout(gpus=8, pp=8, dp=1, microbatches=16, schedule="1f1b", recompute="none", shard="none", batch=16),
        "tp-pp": _layout(gpus=16, tp=4, pp=4, dp=1, microbatches=8, schedule="gpipe", recompute="none", shard="none",
                      batch=8),
        "fsdp": _layout(gpus=16, pp=4, dp=4, microbatches=4, schedule="1f1b", recompute="none", shard="full", batch=16),
        "zero3": _layout(gpus=8, pp=1, dp=8, microbatches=4, schedule="1f1b", recompute="none", shard="full", batch=32),
        "zbv": _layout(gpus=8, pp=4, dp=2, microbatches=8, schedule="zbv", recompute="none", shard="none", batch=16),
        "interleaved-selective": _layout(gpus=8, tp=2, pp=4, dp=1, chunks=2, microbatches=8,
                                      schedule="interleaved-1f1b", recompute="auto", shard="none", batch=8,
                                      memory_per_gpu=30 * GB),
    },
    "llama3_70b": {
        "pp": _layout(gpus=16, pp=16, dp=1, microbatches=32, schedule="1f1b", recompute="none", shard="none", batch=32,
                   memory_per_gpu=UNLIMITED),
        "tp-pp": _layout(gpus=32, tp=8, pp=4, dp=1, microbatches=8, schedule="gpipe", recompute="none", shard="none",
                      batch=8, memory_per_gpu=UNLIMITED),
        "fsdp": _layout(gpus=32, pp=4, dp=8, microbatches=4, schedule="1f1b", recompute="none", shard="full", batch=32,
                     memory_per_gpu=UNLIMITED),
        "zero3": _layout(gpus=64, tp=8, pp=1, dp=8, microbatches=4, schedule="1f1b", recompute="none", shard="full",
                      batch=32, memory_per_gpu=40 * GB),
        "zbv": _layout(gpus=16, pp=8, dp=2, microbatches=16, schedule="zbv", recompute="none", shard="none", batch=32,
                    memory_per_gpu=UNLIMITED),
        "interleaved-selective": _layout(gpus=32, tp=8, pp=4, dp=1, chunks=2, microbatches=8,
                                      schedule="interleaved-1f1b", recompute="auto", shard="none", batch=8,
                                      memory_per_gpu=40 * GB),
    },
}
# What each layout's plan must hold, so that a planner change that drops it fails here, not silently.
SHOWS: dict[str, Callable[[Plan], bool]] = {
    "pp": lambda p: p.tp == 1 and p.dp == 1 and p.pp > 1,
    "tp-pp": lambda p: p.tp > 1 and p.pp > 1,
    "fsdp": lambda p: all(s.shard == "full" and not s.reshard_after_forward for s in p.stages),
    "zero3": lambda p: all(s.shard == "full" and s.reshard_after_forward for s in p.stages) and p.pp == 1,
    "zbv": lambda p: p.schedule == "zbv",
    "interleaved-selective": lambda p: p.chunks > 1 and any(s.recompute == "selective" for s in p.stages),
}
DEFAULT_TIER = ("llama3_8b", "interleaved-selective")  # the default tier's representative plan
PLANS = [pytest.param(model, layout, id=f"{model}-{layout}",
                      marks=() if (model, layout) == DEFAULT_TIER else pytest.mark.exhaustive)
         for model, layouts in LAYOUTS.items() for layout in layouts]
_CACHE: dict[Any, Any] = {}


def llama_model(name: str) -> tuple[Any, dict[str, int]]:
    """examples/llama.py's model ``name`` built on meta, and its parameter sizes (kept per process)."""
    if name not in _CACHE:
        pytest.importorskip("transformers", reason="examples/llama.py builds a Hugging Face Llama")
        from partitioner.export.sizes import parameter_sizes
        from partitioner.modelfile import load_model_file

        model_file = load_model_file(f"{EXAMPLES / 'llama.py'}:{name}")
        model = model_file.build()
        _CACHE[name] = (model, model_file, parameter_sizes(model))
    model, _, sizes = _CACHE[name]
    return model, sizes


def llama_plan(name: str, layout: str) -> Plan:
    """The planner's plan of Llama 3 ``name`` under ``layout`` (:data:`LAYOUTS`), h100, bf16-mixed; kept per process."""
    key = (name, layout)
    if key not in _CACHE:
        from partitioner.search.planner import compile

        model, _ = llama_model(name)
        model_file = _CACHE[name][1]
        options = dict(LAYOUTS[name][layout])
        batch = options.pop("batch")
        plan = compile(model, model_file.example_inputs(batch), device="h100", precision="bf16-mixed",
                       capture_method="export", **options)
        assert SHOWS[layout](plan), f"the {layout} plan of {name} lost what it is for: {plan.stages}"
        _CACHE[key] = plan
    plan = _CACHE[key]
    assert isinstance(plan, Plan)
    return plan


def stage_parameters(plan: Plan, sizes: dict[str, int]) -> list[int]:
    """Each stage's parameter elements in the plan (a tied tensor counted on every stage that holds it)."""
    return [sum(sizes[name] for name in names) for names in held_parameters(plan)]


def allowed_deviation(plan: Plan, sizes: dict[str, int]) -> float:
    """5 %, or what whole blocks force: the smaller side of the blocks cut at a stage's ends, over that stage."""
    split = split_blocks(plan, sizes=sizes)
    forced = [0.0] * len(plan.stages)
    for shares in split.cut.values():
        for stage in shares:
            forced[stage] += min(shares.values())
    return max(0.05, max(f / p for f, p in zip(forced, split.planned)))


@pytest.mark.parametrize(("model", "layout"), PLANS)
def test_llama3_plans_export_to_stages_within_5_percent(model: str, layout: str) -> None:
    plan = llama_plan(model, layout)
    _, sizes = llama_model(model)
    out = export_torchtitan(plan, sizes=sizes)
    assert (out.module, out.config) == ("llama3", model)
    allowed = allowed_deviation(plan, sizes)
    assert max(map(abs, out.deviation)) <= allowed + 1e-9, (out.deviation, allowed)
    assert allowed <= 0.11  # at worst the smaller half of an 8B layer on a 4-layer stage


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
    """torchtitan's config loader, its Llama, pipeline split, schedules and FSDP policy (skips where missing)."""
    pytest.importorskip("torchtitan", reason="torchtitan (the dev extra, Python 3.11+) checks the export")
    _stand_in_for_gpu_kernels()
    config = pytest.importorskip("torchtitan.config")
    llama3 = pytest.importorskip("torchtitan.models.llama3")
    pipeline = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    dims = pytest.importorskip("torchtitan.distributed.parallel_dims")
    fsdp = pytest.importorskip("torchtitan.distributed.fsdp")
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    from torch.distributed.pipelining.schedules import get_schedule_class

    return types.SimpleNamespace(config=config, llama3=llama3, pipeline=pipeline, dims=dims, fsdp=fsdp, ac=ac,
                                 get_schedule_class=get_schedule_class, models={})


def _titan_model(titan: types.SimpleNamespace, flavor: str, layers: int | None = None) -> Any:
    """torchtitan's own Llama 3 ``flavor`` on the meta device (its first ``layers`` only, if given); kept."""
    import torch

    key = (flavor, layers)
    if key not in titan.models:
        config = titan.llama3.llama3_configs[flavor](attn_backend="flex")
        if layers is not None:
            config.layers = config.layers[:layers]
        with torch.device("meta"):
            titan.models[key] = config.build()
    return titan.models[key]


def _parse(titan: types.SimpleNamespace, command: list[str], *, config: str = "llama3_debugmodel") -> Any:
    """torchtitan's own config loading of the command's arguments (a placeholder config replaced by ``config``)."""
    args = command[command.index("torchtitan.train") + 1:]
    return titan.config.ConfigManager().parse_args([config if a == "YOUR_CONFIG" else a for a in args])


def _split_by_torchtitan(titan: types.SimpleNamespace, model: Any, parts: list[list[str]], parallelism: Any,
                         local_batch: int) -> dict[int, list[tuple[int, Any, Any]]]:
    """Per pipeline rank: (stage index, model part, schedule) of each stage torchtitan builds there."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    pp = parallelism.pipeline_parallel_degree
    built: dict[int, list[tuple[int, Any, Any]]] = {}
    for rank in range(pp):
        dist.init_process_group("fake", rank=rank, world_size=pp, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
            stages, chunks = titan.pipeline._pipeline_module_split(
                model, mesh, parallelism.pipeline_parallel_schedule, torch.device("meta"), parts)
            schedule = titan.pipeline._build_pipeline_schedule(
                parallelism=parallelism, local_batch_size=local_batch, stages=stages,
                loss_fn=lambda *args, **kwargs: (args[0].sum(), None))
            built[rank] = [(stage.stage_index, chunk, schedule) for stage, chunk in zip(stages, chunks)]
        finally:
            dist.destroy_process_group()
    return built


def _blocks_with_parameters(module: Any) -> list[str]:
    blocks = {".".join(n.split(".")[:2]) if n.startswith("layers.") else n.split(".")[0]
              for n, _ in module.named_parameters()}
    return sorted(blocks)


def _titan_block(block: str) -> str:
    """A Hugging Face Llama block's name in torchtitan's Llama."""
    fixed = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "lm_head"}
    return fixed.get(block, block.removeprefix("model."))


def _expected_checkpointing(plan: Plan) -> str | None:
    """The torchtitan activation-checkpointing config the plan needs: per-op where it recomputes only cheap ops."""
    modes = {s.recompute for s in plan.stages}
    if modes == {"none"}:
        return None
    if all(s.recompute == "none" or (s.recompute == "selective" and s.recompute_layers == 0)
           for s in plan.stages):
        return "SelectiveAC.Config"
    return "FullAC.Config"


def _check_with_torchtitan(titan: types.SimpleNamespace, plan: Plan, out: TorchtitanExport, *, flavor: str,
                           layers: int | None = None, sizes: dict[str, int] | None = None) -> None:
    """What torchtitan would run from the export's header command, against plan.json, field by field."""
    tomllib = pytest.importorskip("tomllib")
    text = out.toml()
    command = _command_in_header(text)
    assert command == out.command and tomllib.loads(text) == out.sections
    job = _parse(titan, command)
    # Degrees: torchtitan's ParallelDims from its parsed config, over the plan's GPUs.
    dims = titan.dims.ParallelDims.from_config(job.parallelism, plan.gpus)
    replicas, shards = (plan.dp, 1) if all(s.shard == "none" for s in plan.stages) else \
        shard_layout(plan, next(s for s in plan.stages if s.shard != "none"))
    assert (dims.pp, dims.tp, dims.dp_replicate, dims.dp_shard) == (plan.pp, plan.tp, replicas, shards)
    assert dims.dp_replicate * dims.dp_shard * dims.pp * dims.tp == plan.gpus
    assert plan.tp == 1 or job.parallelism.enable_sequence_parallel  # as priced
    # Sequence, batch, micro-batches, accumulation, as torchtitan's Trainer derives them.
    assert job.training.seq_len == plan.model.inputs[0].shape[1]
    assert job.training.global_batch_size == plan.batch_size
    accumulation = job.training.global_batch_size // (job.training.local_batch_size * dims.dp_replicate * dims.dp_shard)
    per_step = job.training.local_batch_size // job.parallelism.pipeline_parallel_microbatch_size if plan.pp > 1 \
        else 1
    assert accumulation * per_step == plan.microbatches
    assert job.training.local_batch_size // per_step == plan.microbatch_size
    # Resharding: torchtitan's own policy resolution.
    if shards > 1:
        resharded = titan.fsdp.get_fsdp_reshard_after_forward_policy(
            job.parallelism.fsdp_reshard_after_forward, plan.pp > 1)
        assert resharded == any(s.reshard_after_forward for s in plan.stages)
    # Activation checkpointing: the config class torchtitan built.
    expected = _expected_checkpointing(plan)
    got = job.activation_checkpoint
    assert (got is None and expected is None) or type(got).__qualname__ == expected, (got, expected)
    if plan.pp == 1:
        return
    # Schedule and stage placement: torchtitan's split of its own model, rank by rank, and its schedule.
    model = _titan_model(titan, flavor, layers)
    parts = job.parallelism.module_fqns_per_model_part
    assert parts == out.sections["parallelism"]["module_fqns_per_model_part"]
    built = _split_by_torchtitan(titan, model, parts, job.parallelism, job.training.local_batch_size)
    schedule_class = titan.get_schedule_class(job.parallelism.pipeline_parallel_schedule)
    planned_blocks = [{_titan_block(block_of(name)) for name in names} for names in held_parameters(plan)]
    counts: dict[int, int] = {}
    for rank in range(plan.pp):
        assert [s for s, _, _ in built[rank]] == list(plan.stages_of(rank))
        for stage, chunk, schedule in built[rank]:
            assert type(schedule) is schedule_class
            assert schedule._n_microbatches == plan.microbatches
            if hasattr(schedule, "stage_index_to_group_rank"):
                assert schedule.stage_index_to_group_rank[stage] == plan.stages[stage].rank
            blocks = _blocks_with_parameters(chunk)
            assert blocks and blocks == sorted(parts[stage]), (rank, stage)  # never an empty stage
            assert set(blocks) <= planned_blocks[stage], (stage, blocks)  # each block where the plan holds it
            counts[stage] = sum(p.numel() for p in chunk.parameters())
    if sizes is not None:  # each stage within 5 % of the plan's parameters, or what whole layers force
        planned = stage_parameters(plan, sizes)
        allowed = allowed_deviation(plan, sizes)
        for stage, count in counts.items():
            assert abs(count / planned[stage] - 1) <= allowed + 1e-9, (stage, count, planned[stage], allowed)
            assert abs(count / planned[stage] - 1 - out.deviation[stage]) < 1e-6  # the export said how far


TINY_PLANS = {
    **{k: v[0] for k, v in WHOLE.items()},
    "inside-a-layer": INSIDE,
    "pp1-accumulating-zero3": _llama_plan(pp=1, dp=4, shard="full", reshard=True, microbatches=4, batch_size=32),
    "hsdp-kept-gathered": _llama_plan(pp=2, dp=16, cuts=_whole_layer_cuts(2), shard="full", batch_size=128),
    "zero3-selective": _llama_plan("interleaved-1f1b", pp=2, dp=2, chunks=2, cuts=_whole_layer_cuts(1, 2, 3),
                                   shard="full", reshard=True, recompute="selective", ops_layers=1),
    "tensor-parallel-full": _llama_plan(pp=2, dp=2, tp=2, cuts=_whole_layer_cuts(2), recompute="full"),
}


@pytest.mark.parametrize("kind", sorted(TINY_PLANS))
def test_torchtitan_runs_what_the_plan_says_tiny(titan: types.SimpleNamespace, kind: str) -> None:
    plan = TINY_PLANS[kind]
    _check_with_torchtitan(titan, plan, export_torchtitan(plan, sizes=TINY_SIZES), flavor="debugmodel",
                           layers=LAYERS)


@pytest.mark.parametrize(("model", "layout"), PLANS)
def test_torchtitan_runs_what_the_plan_says_llama3(titan: types.SimpleNamespace, model: str, layout: str) -> None:
    """The planner's Llama 3 plan through torchtitan's own config, split and schedule, field by field."""
    plan = llama_plan(model, layout)
    _, sizes = llama_model(model)
    out = export_torchtitan(plan, sizes=sizes)
    _check_with_torchtitan(titan, plan, out, flavor={"llama3_8b": "8B", "llama3_70b": "70B"}[model], sizes=sizes)


def test_torchtitan_is_the_release_the_export_claims(titan: types.SimpleNamespace) -> None:
    assert importlib.metadata.version("torchtitan") == TORCHTITAN_VERSION
    for config, (layers, parameters) in LLAMA3_CONFIGS.items():
        flavor = config.removeprefix("llama3_").upper()
        model = _titan_model(titan, flavor)
        assert (len(model.layers), sum(p.numel() for p in model.parameters())) == (layers, parameters)
        assert [name for name, _ in model.named_children()] == ["tok_embeddings", "layers", "norm", "lm_head"]


def test_torchtitan_checks_are_live(titan: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    """The checks can fail: a wrong local batch, schedule, stage list, AC mode or replica layout is caught."""
    plan, _ = WHOLE["interleaved-1f1b"]
    out = export_torchtitan(plan, sizes=TINY_SIZES)
    with pytest.raises(SystemExit):  # tyro reports Trainer.Config's ValueError and exits
        _parse(titan, [f for f in out.command if f != "--training.disable_cuda_graphs"])
    assert "CUDA graphs do not support pipeline parallelism" in capsys.readouterr().err
    broken = [
        _replace(out, "training", local_batch_size=plan.batch_size // plan.dp * 2),
        _replace(out, "parallelism", pipeline_parallel_schedule="ZBVZeroBubble"),
        _replace(out, "parallelism", module_fqns_per_model_part=[
            ["tok_embeddings", "layers.0", "layers.1"], ["layers.2"], ["layers.3"], ["norm", "lm_head"]]),
        _replace(out, "activation_checkpoint", mode="full"),
        _replace(out, "parallelism", data_parallel_replicate_degree=1, data_parallel_shard_degree=2),
    ]
    for wrong in broken:
        with pytest.raises((AssertionError, ValueError)):
            _check_with_torchtitan(titan, plan, wrong, flavor="debugmodel", layers=LAYERS)
        capsys.readouterr()


def _replace(out: TorchtitanExport, section: str, **values: Any) -> TorchtitanExport:
    """``out`` with some settings changed, its header's command too."""
    changed = dataclasses.replace(out, sections={**out.sections, section: {**out.sections[section], **values}})
    return dataclasses.replace(changed, header=("run this on every node", "", f"  {shlex.join(changed.command)}"))


@pytest.mark.parametrize(("shard", "tp", "degrees", "note"), [
    ("none", 1, (2, 2), "dp_shard x tp = efsdp x ep"),  # replicas only: the dense parts sharded over the ep ranks
    ("full", 1, (1, 4), None),  # ep inside the 4 shards: torchtitan's own layout
    ("none", 2, (4, 1), None),  # ep borrows the tensor-parallel ranks
])
def test_expert_parallelism_fits_torchtitan_s_mesh(titan: types.SimpleNamespace, shard: str, tp: int,
                                                   degrees: tuple[int, int], note: str | None) -> None:
    from test_export_megatron import _experts_layers

    plan = _llama_plan(pp=2, dp=4, tp=tp, cuts=_whole_layer_cuts(2), shard=shard, batch_size=32)
    plan = dataclasses.replace(plan, ep=2, experts=_experts_layers(1, 2, 3))
    out = export_torchtitan(plan, sizes=TINY_SIZES)
    par = out.sections["parallelism"]
    assert par["expert_parallel_degree"] == 2
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == degrees
    assert (note is None) == (not [n for n in out.notes if "efsdp" in n]), out.notes
    assert note is None or [n for n in out.notes if note in n]
    dims = titan.dims.ParallelDims.from_config(_parse(titan, out.command).parallelism, plan.gpus)  # its checks run
    assert dims.ep == 2 and dims.dp_replicate * dims.dp_shard * dims.pp * dims.tp == plan.gpus
