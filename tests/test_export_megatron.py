"""``autopartition export --to megatron``: Megatron-LM arguments and a Megatron-Bridge override, checked by megatron-core.

The mapping tests (layers per stage as Megatron's even split, first/last stage
layers, virtual stages or a layout; schedules; batch; recomputation; the
distributed optimizer and Megatron-FSDP; tensor, sequence and expert parallelism;
the YAML and the command) run everywhere.  With megatron-core installed (the
``dev`` extra) the export's ``model`` section builds megatron-core's own
``TransformerConfig`` (its validation of the pipeline split and recomputation),
its ``ddp`` and ``optimizer`` sections its ``DistributedDataParallelConfig`` and
``OptimizerConfig``; megatron-core's own functions then say which layers each
pipeline rank and virtual stage builds (:func:`_check_with_megatron`), and those
are compared with plan.json: every stage's layers where the plan holds them, its
parameters within 5 % of the plan's (or what whole layers force), the micro-batches.

Plans: hand-made ones of the tiny Llama, and the planner's Llama 3 8B and 70B plans
of tests/test_export_torchtitan.py (:func:`llama_plan`, shared within a process).
"""

from __future__ import annotations

import dataclasses
import shlex
import types
from typing import Any

import pytest
from test_export_torchtitan import (
    PLANS,
    TINY_SIZES,
    WHOLE,
    _layer_start,
    _llama_plan,
    _saved_llama_plan,
    _whole_layer_cuts,
    allowed_deviation,
    llama_model,
    llama_plan,
    stage_parameters,
)

from partitioner.cli import main
from partitioner.errors import AutopartitionError
from partitioner.export.blocks import block_of, held_parameters, layer_index
from partitioner.export.megatron import (
    MEGATRON_CORE_VERSION,
    MegatronExport,
    export_megatron,
    megatron_arguments,
    pipeline_layout,
)
from partitioner.graph.experts import ExpertLayer
from partitioner.plan import Plan, example_plan

TINY = types.SimpleNamespace(hidden=64, ffn=176, heads=4, kv_heads=2)  # examples/llama.py's llama_tiny


def _export(plan: Plan) -> MegatronExport:
    return export_megatron(plan, sizes=TINY_SIZES)


# ------------------------------------------------------------------ the mapping


@pytest.mark.parametrize(("plan", "layers", "fields"), [
    (_llama_plan(pp=2, cuts=_whole_layer_cuts(2)), (2, 2), {}),  # Megatron's even split
    (_llama_plan(pp=3, cuts=_whole_layer_cuts(1, 3)), (1, 2, 1),
     {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 1}),
    (_llama_plan(pp=2, cuts=_whole_layer_cuts(3)), (3, 1),
     {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 1}),
    (_llama_plan(pp=4, cuts=_whole_layer_cuts(0, 2, 3)), (0, 2, 1, 1),
     {"pipeline_model_parallel_layout": "E|t*2|t|tL"}),  # an embedding-only stage: a layout
    (_llama_plan("interleaved-1f1b", pp=2, chunks=2, cuts=_whole_layer_cuts(1, 2, 3)), (1, 1, 1, 1),
     {"virtual_pipeline_model_parallel_size": 2}),
    (WHOLE["zbv"][0], (1, 2, 1, 0),
     {"virtual_pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t*2|t|L"}),
    (_llama_plan(pp=1, dp=2, microbatches=2), (4,), {}),
], ids=["even", "first-last", "two-stages", "layout", "virtual", "zbv-layout", "no-pipeline"])
def test_layers_per_stage_take_megatron_s_simplest_form(plan: Plan, layers: tuple[int, ...],
                                                       fields: dict[str, Any]) -> None:
    out = _export(plan)
    assert out.layers == layers
    split = {k: v for k, v in out.bridge["model"].items()
             if ("pipeline" in k and k != "pipeline_model_parallel_size") or k.startswith("num_layers_in")}
    assert split == fields
    assert out.bridge["model"]["num_layers"] == 4


def test_a_cut_inside_a_layer_moves_it_whole_by_parameters() -> None:
    plan = _llama_plan(pp=2, cuts=(_layer_start(2) + 6,))  # layer 2's norms and attention in 0, its MLP in 1
    out = _export(plan)
    assert out.layers == (2, 2) and [n for n in out.notes if "model.layers.2 (12.4K in 0 + 33.8K in 1) -> stage 1"
                                      in n]
    assert out.deviation == pytest.approx((-12416 / 137600, 12416 / 112832))


@pytest.mark.parametrize(("schedule", "chunks", "note"), [
    ("gpipe", 1, "Megatron runs 1F1B"), ("zb-h1", 1, "without ZB-H1's deferred weight gradients"),
    ("1f1b", 1, None), ("interleaved-1f1b", 2, None), ("zbv", 2, "puts stage pp + r (not 2 pp - 1 - r) on rank r"),
])
def test_schedules_name_the_nearest_megatron_runs(schedule: str, chunks: int, note: str | None) -> None:
    cuts = _whole_layer_cuts(2) if chunks == 1 else _whole_layer_cuts(1, 2, 3)
    out = _export(_llama_plan(schedule, pp=2, chunks=chunks, cuts=cuts))
    assert (note is None and out.notes == ()) or [n for n in out.notes if note is not None and note in n], out.notes


@pytest.mark.parametrize(("recompute", "ops", "layers", "expected", "note"), [
    ("none", 0, 0, {}, None),
    ("full", 0, 0, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, None),
    ("selective", 1, 0, {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
     "recomputes only cheap ops"),
    (("selective", "none"), 0, 1, {"recompute_granularity": "full", "recompute_method": "block",
                                   "recompute_num_layers": 1}, "0 1, 1 0"),
    (("full", "selective"), 1, 0, {"recompute_granularity": "full", "recompute_method": "block",
                                   "recompute_num_layers": 2}, "0 2, 1 1"),
])
def test_recomputation_takes_one_megatron_setting(recompute: Any, ops: int, layers: int, expected: dict[str, Any],
                                                   note: str | None) -> None:
    plan = _llama_plan(cuts=_whole_layer_cuts(2), recompute=recompute, ops_layers=ops)
    plan = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, recompute_layers=layers) if s.recompute == "selective" else s for s in plan.stages))
    out = _export(plan)
    assert {k: v for k, v in out.bridge["model"].items() if k.startswith("recompute")} == expected
    assert note is None or [n for n in out.notes if note in n], out.notes


@pytest.mark.parametrize(("shard", "reshard", "dp", "ddp", "note"), [
    ("none", False, 4, None, None),
    ("optimizer", False, 4, {"use_distributed_optimizer": True}, None),
    ("full", False, 4, {"use_distributed_optimizer": True}, "same peak and the same traffic"),
    ("full", True, 4, {"use_distributed_optimizer": True, "use_megatron_fsdp": True,
                       "data_parallel_sharding_strategy": "optim_grads_params"}, None),
    ("full", True, 16, {"use_distributed_optimizer": True, "use_megatron_fsdp": True,  # HSDP over 2 nodes
                        "data_parallel_sharding_strategy": "optim_grads_params",
                        "num_distributed_optimizer_instances": 2}, None),
    (("none", "optimizer"), False, 4, {"use_distributed_optimizer": True}, "replicates stage(s) 0"),
])
def test_replicas_map_to_the_distributed_optimizer_or_megatron_fsdp(
        shard: Any, reshard: bool, dp: int, ddp: dict[str, Any] | None, note: str | None) -> None:
    out = _export(_llama_plan(pp=2, dp=dp, cuts=_whole_layer_cuts(2), shard=shard, reshard=reshard,
                              batch_size=8 * dp))
    assert out.bridge.get("ddp") == ddp
    fsdp = bool(ddp and ddp.get("use_megatron_fsdp"))
    assert (out.bridge.get("checkpoint") == {"ckpt_format": "fsdp_dtensor"}) == fsdp
    assert ("--use-megatron-fsdp" in out.arguments) == fsdp
    assert ("--use-distributed-optimizer" in out.arguments) == bool(ddp)
    assert note is None or [n for n in out.notes if note in n], out.notes


def test_tensor_sequence_and_expert_parallelism() -> None:
    plan = _llama_plan(pp=2, dp=2, tp=2, cuts=_whole_layer_cuts(2))
    model = _export(plan).bridge["model"]
    assert (model["tensor_model_parallel_size"], model["sequence_parallel"]) == (2, True)
    assert "expert_model_parallel_size" not in model and "num_moe_experts" not in model  # no experts
    out = _export(dataclasses.replace(plan, ep=2, experts=_experts_layers(1, 2, 3)))
    model = out.bridge["model"]
    assert (model["num_moe_experts"], model["moe_router_topk"]) == (4, 2)
    assert model["moe_layer_freq"] == [0, 1, 1, 1]  # layer 0 dense, as DeepSeek-V3's first three
    assert (model["expert_model_parallel_size"], model["expert_tensor_parallel_size"]) == (2, 1)
    arguments = _parse_arguments(out.arguments)
    assert arguments["--num-experts"] == ["4"] and arguments["--moe-layer-freq"] == ["[0,1,1,1]"]
    assert arguments["--expert-model-parallel-size"] == ["2"]
    every = _export(dataclasses.replace(plan, experts=_experts_layers(0, 1, 2, 3))).bridge["model"]
    assert "moe_layer_freq" not in every and "expert_model_parallel_size" not in every  # ep 1: Megatron's default


def test_megatron_core_accepts_the_experts_settings(core: types.SimpleNamespace) -> None:
    plan = dataclasses.replace(_llama_plan(pp=2, dp=2, tp=2, cuts=_whole_layer_cuts(2)), ep=2,
                               experts=_experts_layers(1, 2, 3))
    config = _transformer_config(core, _export(plan), TINY)
    assert (config.num_moe_experts, config.moe_router_topk, config.expert_model_parallel_size) == (4, 2, 2)
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.expert_tensor_parallel_size == 1


def _experts_layers(*layers: int) -> tuple[ExpertLayer, ...]:
    """Experts layers (4 experts, top-2, stacked) in the given decoder layers of the tiny Llama."""
    return tuple(ExpertLayer(
        module=f"model.layers.{i}.mlp.experts", module_class="Experts", experts=4, top_k=2, hidden=TINY.hidden,
        tokens_per_batch=64, layout="stacked", parameters=(f"model.layers.{i}.mlp.experts.gate_up_proj",),
        nodes=(f"experts_{i}",), tokens=f"tokens_{i}", index=f"index_{i}", weights=f"weights_{i}",
        output=f"experts_{i}") for i in layers)


@pytest.mark.parametrize(("precision", "mixed", "note"), [
    ("fp32", None, None), ("bf16-mixed", "bf16_mixed", None), ("bf16", "bf16_mixed", "16 bytes per parameter"),
    ("fp8", "bf16_mixed", "--fp8-format hybrid --fp8-recipe tensorwise"),
])
def test_precision(precision: str, mixed: str | None, note: str | None) -> None:
    out = _export(_llama_plan(cuts=_whole_layer_cuts(2), precision=precision))
    assert out.bridge.get("mixed_precision") == mixed and ("--bf16" in out.arguments) == (mixed is not None)
    assert note is None or [n for n in out.notes if note in n], out.notes


def test_batch_and_sequence() -> None:
    out = _export(_llama_plan(pp=2, dp=2, cuts=_whole_layer_cuts(2), microbatches=4, batch_size=32))
    assert out.bridge["train"] == {"micro_batch_size": 4, "global_batch_size": 32}  # 32 / (4 x 2): 4 micro-batches
    assert out.bridge["model"]["seq_length"] == out.bridge["dataset"]["sequence_length"] == 32


def test_models_megatron_cannot_split_are_refused_with_what_to_do() -> None:
    with pytest.raises(AutopartitionError, match=r"no numbered blocks .*--to torchtitan"):
        export_megatron(example_plan(), sizes={"0.weight": 16, "2.weight": 16})
    plan = _llama_plan(pp=2, cuts=_whole_layer_cuts(2))
    stage = plan.stages[0]
    mid = dataclasses.replace(stage, parameters=(*stage.parameters, "model.mid.weight"),
                              nodes=(*stage.nodes[:-9], "model_mid_weight", *stage.nodes[-9:]))
    with pytest.raises(AutopartitionError, match=r"blocks between its layers \(model\.mid\)"):
        export_megatron(dataclasses.replace(plan, stages=(mid, plan.stages[1])),
                        sizes={**TINY_SIZES, "model.mid.weight": 8})


def _parse_arguments(arguments: tuple[str, ...] | list[str]) -> dict[str, list[str]]:
    parsed: dict[str, list[str]] = {}
    for word in arguments:
        if word.startswith("--"):
            current = parsed.setdefault(word, [])
        else:
            current.append(word)
    return parsed


_RENAMED = {"--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
            "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
            "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size"}


def _check_arguments_match_bridge(out: MegatronExport) -> None:
    """Every Megatron-LM argument is the same setting as the Bridge fields of its name, and every field has one."""
    fields = {(section, key): value for section, values in out.bridge.items() if isinstance(values, dict)
              for key, value in values.items()}
    seen = set()
    for flag, values in _parse_arguments(out.arguments).items():
        if flag == "--bf16":
            assert out.bridge["mixed_precision"] == "bf16_mixed" and values == []
            continue
        key = _RENAMED.get(flag, flag[2:].replace("-", "_"))
        found = [(s, k) for (s, k) in fields if k == key]
        assert found, flag
        for where in found:
            value = fields[where]
            assert values == ([] if value is True else [str(v) for v in value] if isinstance(value, list)
                              else [str(value)]), flag
        seen |= set(found)
    implied = {("dataset", "sequence_length")}  # --seq-length sets both
    if ("model", "pipeline_model_parallel_layout") in fields:
        implied.add(("model", "virtual_pipeline_model_parallel_size"))  # Megatron-LM reads it off the layout
    assert set(fields) - seen <= implied, set(fields) - seen


def _command_in_header(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Megatron-LM:")) + 1
    shell = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        shell.append(line[1:].strip().rstrip("\\"))
    return shlex.split(" ".join(shell))


def test_yaml_reads_back_and_its_header_holds_the_megatron_lm_command() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the Bridge override back")
    out = _export(_llama_plan("interleaved-1f1b", pp=2, dp=4, chunks=2, cuts=_whole_layer_cuts(0, 2, 3),
                              shard="full", reshard=True, recompute="full", precision="bf16-mixed", batch_size=32))
    text = out.yaml()
    assert yaml.safe_load(text) == out.bridge
    command = _command_in_header(text)
    assert command == out.command and command[:4] == ["torchrun", "--nproc_per_node", "8", "pretrain_gpt.py"]
    assert f"megatron-core {MEGATRON_CORE_VERSION}" in text
    _check_arguments_match_bridge(out)


def test_export_command_writes_the_override(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="examples/llama.py builds a Hugging Face Llama")
    plan_dir = _saved_llama_plan(tmp_path / "plan")
    out = tmp_path / "megatron.yaml"
    assert main(["export", str(plan_dir), "--to", "megatron", "-o", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out == "" and f"wrote {out}" in said.err and "sizes unknown" not in said.err
    assert "model.layers.2 (12.4K in 0 + 33.8K in 1) -> stage 1" in " ".join(said.err.split())
    text = out.read_text()
    assert "--decoder-first-pipeline-num-layers 2" not in text  # 2 + 2 layers: Megatron's even split
    assert "Decoder layers per stage: 2, 2." in text
    assert main(["export", str(plan_dir), "--to", "megatron"]) == 0
    assert capsys.readouterr().out == text


# ------------------------------------------------------------------ megatron-core itself


@pytest.fixture(scope="module")
def core() -> types.SimpleNamespace:
    """megatron-core's config classes and layer-split functions (skips where megatron-core is missing)."""
    pytest.importorskip("megatron.core", reason="megatron-core (the dev extra) checks the Megatron export")
    import warnings

    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": CPU fallbacks, unused here
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    return types.SimpleNamespace(TransformerConfig=TransformerConfig, DDPConfig=DistributedDataParallelConfig,
                                 OptimizerConfig=OptimizerConfig, layers_to_build=get_num_layers_to_build,
                                 layer_offset=get_transformer_layer_offset, parallel_state=parallel_state)


def _transformer_config(core: types.SimpleNamespace, out: MegatronExport, shape: Any) -> Any:
    """megatron-core's TransformerConfig of the export's model section on the model's shape (its validation runs)."""
    import torch

    model = dict(out.bridge["model"])
    model.pop("seq_length", None)  # the Bridge model provider's, not TransformerConfig's
    known = {f.name for f in dataclasses.fields(core.TransformerConfig)}
    assert set(model) <= known, set(model) - known
    return core.TransformerConfig(hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
                                  num_attention_heads=shape.heads, num_query_groups=shape.kv_heads,
                                  pipeline_dtype=torch.bfloat16, bf16=True, **model)


def _megatron_layers(core: types.SimpleNamespace, config: Any, *, stage: int, pp: int) -> list[int]:
    """The decoder layers megatron-core builds for virtual stage ``stage // pp`` of pipeline rank ``stage % pp``."""
    rank, virtual = stage % pp, stage // pp
    vp = virtual if config.virtual_pipeline_model_parallel_size else None
    layout = config.pipeline_model_parallel_layout
    # A layout reads the virtual stage only where parallel_state has a virtual world size (set at initialisation).
    before = core.parallel_state.get_virtual_pipeline_model_parallel_world_size()
    core.parallel_state.set_virtual_pipeline_model_parallel_world_size(config.virtual_pipeline_model_parallel_size)
    try:
        if layout is not None:
            n = layout.get_num_layers_to_build(vp_stage=vp, pp_rank=rank)
            offset = layout.get_layer_offset(vp_stage=vp, pp_rank=rank)
        else:
            n = core.layers_to_build(config, vp_stage=vp, pp_rank=rank)
            offset = core.layer_offset(config, vp_stage=vp, pp_rank=rank)
    finally:
        core.parallel_state.set_virtual_pipeline_model_parallel_world_size(before)
    return list(range(offset, offset + n))


def _check_with_megatron(core: types.SimpleNamespace, plan: Plan, out: MegatronExport, *, shape: Any,
                         sizes: dict[str, int] | None = None) -> None:
    """What megatron-core would build from the export, against plan.json."""
    _check_arguments_match_bridge(out)
    config = _transformer_config(core, out, shape)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (plan.tp, plan.pp)
    assert config.sequence_parallel == (plan.tp > 1)
    assert (config.virtual_pipeline_model_parallel_size or 1) == plan.chunks
    # Layers: megatron-core's split, stage by stage, in order, each layer where the plan holds it.
    held = held_parameters(plan)
    built: list[list[int]] = []
    for stage in range(len(plan.stages)):
        layers = _megatron_layers(core, config, stage=stage, pp=plan.pp)
        assert layers == list(range(sum(map(len, built)), sum(map(len, built)) + len(layers)))
        planned = {layer_index(block_of(name)) for name in held[stage]} - {None}
        assert set(layers) <= planned, (stage, layers, planned)
        if plan.schedule != "zbv":  # Megatron places virtual stage v of rank r at v x pp + r: our loop
            assert plan.stages[stage].rank == stage % plan.pp
        built.append(layers)
    assert sum(map(len, built)) == config.num_layers and tuple(map(len, built)) == out.layers
    # Micro-batches: Megatron runs global / (micro x dp).
    dp = plan.gpus // (plan.tp * plan.pp)
    train = out.bridge["train"]
    assert train["global_batch_size"] // (train["micro_batch_size"] * dp) == plan.microbatches
    # Recomputation: never keeps more than the plan.
    if all(s.recompute == "none" for s in plan.stages):
        assert config.recompute_granularity is None
    elif all(s.recompute == "full" for s in plan.stages):
        assert (config.recompute_granularity, config.recompute_method) == ("full", "uniform")
    elif config.recompute_granularity == "full":
        assert config.recompute_method == "block"
        assert all(config.recompute_num_layers >= min(len(layers), s.recompute_layers + s.recompute_ops_layers)
                   for s, layers in zip(plan.stages, built) if s.recompute == "selective")
    else:
        assert all(s.recompute_layers == 0 and s.recompute != "full" for s in plan.stages)
    # Data parallelism: megatron-core's DDP and optimizer configs.
    ddp = core.DDPConfig(**out.bridge.get("ddp", {}))
    optimizer = core.OptimizerConfig(**out.bridge.get("optimizer", {}))
    sharded = [s for s in plan.stages if s.shard != "none"]
    assert ddp.use_distributed_optimizer == optimizer.use_distributed_optimizer == bool(sharded and plan.dp > 1)
    zero3 = any(s.reshard_after_forward for s in sharded)
    assert ddp.use_megatron_fsdp == zero3
    assert ddp.data_parallel_sharding_strategy == ("optim_grads_params" if zero3 else "no_shard")
    # Parameters: megatron-core's layers plus the embedding (first stage) and the final blocks (last stage).
    if sizes is not None:
        blocks: dict[Any, int] = {}
        for name, n in sizes.items():
            index = layer_index(block_of(name))
            key = index if index is not None else ("embedding" if "embed" in name else "final")
            blocks[key] = blocks.get(key, 0) + n
        counts = [sum(blocks[i] for i in layers) for layers in built]
        counts[0] += blocks["embedding"]
        counts[-1] += blocks["final"]
        planned_counts = stage_parameters(plan, sizes)
        allowed = allowed_deviation(plan, sizes)
        for stage, (count, want) in enumerate(zip(counts, planned_counts)):
            assert abs(count / want - 1) <= allowed + 1e-9, (stage, count, want, allowed)
            assert abs(count / want - 1 - out.deviation[stage]) < 1e-6  # the export said how far


TINY_PLANS = {
    "even": _llama_plan(pp=2, cuts=_whole_layer_cuts(2)),
    "first-last": _llama_plan(pp=3, cuts=_whole_layer_cuts(1, 3)),
    "layout": _llama_plan(pp=4, cuts=_whole_layer_cuts(0, 2, 3), recompute="full"),
    "virtual": _llama_plan("interleaved-1f1b", pp=2, chunks=2, cuts=_whole_layer_cuts(1, 2, 3), tp=2, dp=2),
    "virtual-layout": _llama_plan("interleaved-1f1b", pp=2, chunks=2, cuts=_whole_layer_cuts(0, 2, 3)),
    "zbv": WHOLE["zbv"][0],
    "zero3-hsdp": _llama_plan(pp=2, dp=16, cuts=_whole_layer_cuts(2), shard="full", reshard=True, batch_size=128),
    "optimizer-selective": _llama_plan(pp=2, dp=2, cuts=_whole_layer_cuts(2), shard="optimizer",
                                       recompute="selective", ops_layers=1),
    "pp1": _llama_plan(pp=1, dp=4, shard="full", microbatches=2, batch_size=16),
    "inside-a-layer": _llama_plan(pp=2, cuts=(_layer_start(2) + 6,)),
}


@pytest.mark.parametrize("kind", sorted(TINY_PLANS))
def test_megatron_core_accepts_what_the_plan_says_tiny(core: types.SimpleNamespace, kind: str) -> None:
    plan = TINY_PLANS[kind]
    _check_with_megatron(core, plan, _export(plan), shape=TINY, sizes=TINY_SIZES)


@pytest.mark.parametrize(("model", "layout"), PLANS)
def test_megatron_core_accepts_what_the_plan_says_llama3(core: types.SimpleNamespace, model: str,
                                                         layout: str) -> None:
    plan = llama_plan(model, layout)
    hf, sizes = llama_model(model)
    config = hf.config
    shape = types.SimpleNamespace(hidden=config.hidden_size, ffn=config.intermediate_size,
                                  heads=config.num_attention_heads, kv_heads=config.num_key_value_heads)
    out = export_megatron(plan, sizes=sizes)
    _check_with_megatron(core, plan, out, shape=shape, sizes=sizes)


def test_megatron_core_checks_are_live(core: types.SimpleNamespace) -> None:
    """The checks can fail: megatron-core refuses splits that do not add up; a split or recomputation off the plan
    is caught."""
    plan = TINY_PLANS["layout"]  # layers 0, 2, 1, 1 with every stage recomputed
    out = _export(plan)
    with pytest.raises(AssertionError, match="must match num_layers"):
        _transformer_config(core, _changed(out, pipeline_model_parallel_layout=pipeline_layout([0, 2, 1, 2])), TINY)
    with pytest.raises(ValueError, match="middle"):
        _transformer_config(core, _changed(_export(TINY_PLANS["first-last"]), num_layers_in_first_pipeline_stage=3),
                            TINY)
    with pytest.raises(AssertionError, match=r"\(0, \[0\], set\(\)\)"):  # layer 0 where the plan has only the embedding
        _check_with_megatron(core, plan, _changed(out, pipeline_model_parallel_layout=pipeline_layout([1, 1, 1, 1])),
                             shape=TINY)
    with pytest.raises(AssertionError):  # no recomputation where the plan recomputes every layer
        _check_with_megatron(core, plan, _changed(out, recompute_granularity=None, recompute_method=None,
                                                  recompute_num_layers=None), shape=TINY)


def _changed(out: MegatronExport, **model: Any) -> MegatronExport:
    """``out`` with some model fields changed (None: removed), its arguments rebuilt."""
    fields = {k: v for k, v in {**out.bridge["model"], **model}.items() if v is not None}
    bridge = {**out.bridge, "model": fields}
    return dataclasses.replace(out, bridge=bridge, arguments=tuple(megatron_arguments(bridge)))
