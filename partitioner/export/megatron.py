"""A plan as Megatron-LM arguments and a Megatron-Bridge recipe override (YAML).

Megatron splits a transformer into pipeline stages by its decoder layers: the
embedding lives on the first stage, the final norm, output layer and loss on
the last.  Our stages become whole layers (:func:`partitioner.export.blocks.split_blocks`,
a layer the plan cuts going whole to the side that keeps every stage's parameters
nearest the plan's); their layer counts are written, in this order of preference,
as Megatron's even split (nothing to write), ``--decoder-first-pipeline-num-layers``
/ ``--decoder-last-pipeline-num-layers`` (one stage per rank, the middle ones
equal), ``--num-virtual-stages-per-pipeline-rank`` (virtual stages, all equal),
or else a ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a layer,
``L`` the loss; stage ``i`` on pipeline rank ``i mod pp``, Megatron's placement
of virtual stages, which is ours for interleaved-1f1b).

The rest (each departure a note naming the nearest setting):

* **Schedule.** One stage per rank runs Megatron's 1F1B (gpipe and zb-h1: nearest
  1F1B, the same bubble); interleaved-1f1b its interleaved 1F1B; zbv has no
  Megatron schedule: nearest is interleaved 1F1B with 2 virtual stages, which places
  stage ``pp + r`` rather than ``2 pp - 1 - r`` on rank ``r``.  pp = 1 accumulates
  gradients over the micro-batches.
* **Batch.** ``--micro-batch-size`` and ``--global-batch-size``: Megatron runs
  ``global / (micro x dp)`` micro-batches, the plan's.  ``--seq-length``.
* **Tensor, sequence and expert parallelism.** ``--tensor-model-parallel-size``
  with ``--sequence-parallel`` (as priced).  A model with experts layers
  (``plan.experts``) gets ``--num-experts`` and ``--moe-router-topk``, and
  ``--moe-layer-freq`` where only some layers have experts (DeepSeek-V3's first
  three are dense); ``ep > 1`` gets ``--expert-model-parallel-size`` (Megatron, like
  us, forms expert groups from the data-parallel ranks) with
  ``--expert-tensor-parallel-size 1`` when ``tp > 1`` (our experts are whole on every
  rank of a tensor-parallel group, Megatron's default would split them).
* **Replicas.** shard ``optimizer`` (ZeRO-1) -> ``--use-distributed-optimizer``;
  ``full`` kept gathered through the step -> the same (its peak and traffic are
  ZeRO-1's); ZeRO-3 (``reshard_after_forward``) -> Megatron-FSDP
  (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params``,
  which needs ``--ckpt-format fsdp_dtensor``; Megatron-LM refuses torch FSDP2 with
  pipeline parallelism); HSDP (sharded inside a node, replicated across):
  ``--num-distributed-optimizer-instances`` = the replicas.  One setting for all stages.
* **Recomputation.** Every stage whole layers -> ``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1`` (each layer, as our runtime);
  some layers of each stage -> ``--recompute-method block --recompute-num-layers k``
  (the first ``k`` of every stage: the largest any stage needs); only cheap ops
  -> ``--recompute-granularity selective --recompute-modules layernorm``, every
  layer.  Megatron has one setting for every stage.
* **Precision.** bf16-mixed -> ``--bf16`` (Bridge: ``mixed_precision: bf16_mixed``).

The Bridge override holds the same settings as ``ConfigContainer`` sections
(``model``, ``train``, ``ddp``, ``optimizer``, ``dist``, ``checkpoint``,
``dataset``, ``mixed_precision``); the file's header holds the Megatron-LM arguments.
tests/test_export_megatron.py builds megatron-core's own ``TransformerConfig``,
``DistributedDataParallelConfig`` and ``OptimizerConfig`` from it.

Example::

    >>> from partitioner.plan import example_plan
    >>> import dataclasses
    >>> plan = example_plan()
    >>> stages = tuple(dataclasses.replace(s, parameters=(f"layers.{s.index}.weight",)) for s in plan.stages)
    >>> out = export_megatron(dataclasses.replace(plan, stages=stages))
    >>> out.arguments[:4], out.layers
    (('--tensor-model-parallel-size', '1', '--pipeline-model-parallel-size', '2'), (1, 1))
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from partitioner.errors import AutopartitionError
from partitioner.export.blocks import BlockSplit, block_of, layer_index, split_blocks
from partitioner.export.shell import shell_lines
from partitioner.export.torchtitan import recompute_summary, seq_len, shard_layout
from partitioner.plan import Plan
from partitioner.units import format_count, plural

__all__ = ["MEGATRON_CORE_VERSION", "MegatronExport", "export_megatron", "megatron_arguments", "pipeline_layout"]

MEGATRON_CORE_VERSION = "0.16.1"  # the release whose config classes check the export (tests/test_export_megatron.py)


@dataclasses.dataclass(frozen=True)
class MegatronExport:
    """Megatron settings of one plan.

    ``arguments``: Megatron-LM's (``pretrain_gpt.py``) command-line arguments;
    ``bridge``: the Megatron-Bridge ``ConfigContainer`` override, section -> field ->
    value (``mixed_precision`` a recipe name); ``layers``: decoder layers per stage,
    in our stage order; ``deviation``: each stage's parameters with whole layers
    over the plan's, minus 1.
    """

    arguments: tuple[str, ...]
    bridge: dict[str, Any]
    notes: tuple[str, ...]
    layers: tuple[int, ...]
    deviation: tuple[float, ...]
    header: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int = 1

    @property
    def command(self) -> list[str]:
        """Megatron-LM's launch with these arguments (the model, data and optimizer arguments are the user's)."""
        nodes = ["--nnodes", str(self.nodes)] if self.nodes > 1 else []
        return ["torchrun", *nodes, "--nproc_per_node", str(self.gpus_per_node), "pretrain_gpt.py",
                *self.arguments]

    def yaml(self) -> str:
        """The Bridge override as YAML, the header (with the Megatron-LM command) as comments."""
        lines = [f"# {line}" if line else "#" for line in self.header]
        for section, values in self.bridge.items():
            if isinstance(values, dict):
                lines += ["", f"{section}:"] + [f"  {key}: {_yaml_value(v)}" for key, v in values.items()]
            else:
                lines += ["", f"{section}: {_yaml_value(values)}"]
        return "\n".join(lines).lstrip("\n") + "\n"


def export_megatron(plan: Plan, *, sizes: Mapping[str, int] | None = None, source: str = "") -> MegatronExport:
    """The Megatron-LM arguments and Megatron-Bridge override that run ``plan`` (see the module docstring).

    ``sizes``: parameter name -> elements (:mod:`partitioner.export.sizes`; None:
    layers the plan cuts are placed by counting tensors); ``source``: for the header.
    """
    notes: list[str] = []
    split = split_blocks(plan, sizes=sizes, framework="Megatron")
    layers = _layers_per_stage(plan, split, notes)
    cut = split.note("Megatron")
    notes += [cut] if cut else []
    if sizes is None:
        notes.append("parameter sizes unknown: layers the plan cuts are placed by counting parameter tensors, "
                     "which can leave stages far from the plan's sizes; export where the plan's model file loads.")
    model: dict[str, Any] = {
        "tensor_model_parallel_size": plan.tp,
        "pipeline_model_parallel_size": plan.pp,
    }
    if plan.tp > 1:
        model["sequence_parallel"] = True  # as priced: boundaries and norms split over the tensor-parallel group
    model["num_layers"] = sum(layers)
    model |= _experts(plan, sum(layers), notes)
    model |= _pipeline(plan, layers, notes)
    length = seq_len(plan)
    if length is not None:
        model["seq_length"] = length
    else:
        notes.append("no token input (a 2-D integer tensor) in the plan's model inputs: the sequence length is not "
                     "written; set --seq-length to the one the plan was made for.")
    model |= _recompute(plan, layers, notes)
    ddp, dist, checkpoint = _replicas(plan, notes)
    bridge: dict[str, Any] = {
        "model": model,
        "train": {"micro_batch_size": plan.microbatch_size, "global_batch_size": plan.batch_size},
    }
    if ddp:
        bridge["ddp"] = ddp
        if ddp.get("use_distributed_optimizer"):
            bridge["optimizer"] = {"use_distributed_optimizer": True}
    if plan.optimizer != "adam":
        bridge.setdefault("optimizer", {})["optimizer"] = plan.optimizer
    if dist:
        bridge["dist"] = dist
    if checkpoint:
        bridge["checkpoint"] = checkpoint
    if length is not None:
        bridge["dataset"] = {"sequence_length": length}
    if plan.precision in ("bf16-mixed", "bf16"):
        bridge["mixed_precision"] = "bf16_mixed"
    if plan.precision == "bf16":
        notes.append("precision bf16 (weights and optimizer state in bf16): Megatron's --bf16 keeps fp32 main "
                     "weights and Adam state (bf16-mixed), 16 bytes per parameter against the plan's 8: nearest is "
                     "--bf16 (more memory than predicted).")
    elif plan.precision not in ("fp32", "bf16-mixed"):
        notes.append(f"precision {plan.precision}: no Megatron setting is written for it here (fp32 training).")
    per_node = plan.gpus_per_host or plan.gpus_per_node or plan.gpus  # torchrun runs per host
    out = MegatronExport(arguments=tuple(megatron_arguments(bridge)), bridge=bridge, notes=tuple(notes),
                         layers=tuple(layers), deviation=split.deviation, nodes=max(1, plan.gpus // per_node),
                         gpus_per_node=min(per_node, plan.gpus))
    return dataclasses.replace(out, header=_header(plan, out, source=source))


def pipeline_layout(layers: Sequence[int]) -> str:
    """Megatron's ``pipeline_model_parallel_layout`` for ``layers`` decoder layers per stage, in stage order.

    >>> pipeline_layout([3, 4, 4, 1]), pipeline_layout([0, 2, 0])
    ('Et*3|t*4|t*4|tL', 'E|t*2|L')
    """
    stages = []
    for i, n in enumerate(layers):
        body = "t" if n == 1 else f"t*{n}" if n > 1 else ""
        stages.append(("E" if i == 0 else "") + body + ("L" if i == len(layers) - 1 else ""))
    return "|".join(stages)


# ------------------------------------------------------------------ helpers


def _layers_per_stage(plan: Plan, split: BlockSplit, notes: list[str]) -> list[int]:
    """Decoder layers on each stage; the embedding's blocks on the first, the final ones on the last."""
    numbered = [i for i, b in enumerate(split.blocks) if layer_index(b) is not None]
    if not numbered:
        raise AutopartitionError(
            f"Megatron splits a transformer into pipeline stages by its decoder layers, and {plan.model.class_name} "
            f"has no numbered blocks (such as model.layers.N) among its blocks ({', '.join(split.blocks)}). Export "
            "it with --to torchtitan, which splits at any top-level blocks.")
    prefixes = {split.blocks[i].rsplit(".", 1)[0] for i in numbered}
    between = [b for b in split.blocks[numbered[0]:numbered[-1] + 1] if layer_index(b) is None]
    if len(prefixes) > 1 or between:
        odd = ", ".join(sorted(prefixes)) if len(prefixes) > 1 else ", ".join(between)
        raise AutopartitionError(
            f"Megatron's pipeline holds one stack of decoder layers between the embedding and the output, and "
            f"{plan.model.class_name} has {'several stacks' if len(prefixes) > 1 else 'blocks between its layers'} "
            f"({odd}). Export it with --to torchtitan, which splits at any top-level blocks.")
    last = len(plan.stages) - 1
    moved = sorted({b for i, b in enumerate(split.blocks) if i < numbered[0] and split.stage_of[i] != 0}
                   | {b for i, b in enumerate(split.blocks) if i > numbered[-1] and split.stage_of[i] != last})
    if moved:
        notes.append(f"{', '.join(moved)} sit on other stages in the plan than Megatron allows (the embedding on "
                     "the first stage, the final norm and output layer on the last): nearest is Megatron's placement.")
    layers = [0] * len(plan.stages)
    for i in numbered:
        layers[split.stage_of[i]] += 1
    return layers


def _pipeline(plan: Plan, layers: list[int], notes: list[str]) -> dict[str, Any]:
    """The TransformerConfig fields that split the layers: nothing, first/last, virtual stages or a layout."""
    fields: dict[str, Any] = {}
    if plan.schedule in ("gpipe", "zb-h1") and plan.pp > 1:
        notes.append(f"schedule {plan.schedule}: Megatron runs 1F1B with one stage per rank: the same bubble "
                     + ("and less activation memory than GPipe." if plan.schedule == "gpipe"
                        else "without ZB-H1's deferred weight gradients (a slightly longer step)."))
    if plan.schedule == "zbv":
        notes.append("schedule zbv: Megatron has no V schedule; nearest is interleaved 1F1B with 2 virtual stages "
                     "per rank, which puts stage pp + r (not 2 pp - 1 - r) on rank r: each rank holds other "
                     "stages than planned, so its memory and the bubble differ from the plan's.")
    if plan.pp == 1:
        return fields
    chunks = plan.chunks
    if chunks > 1:
        fields["virtual_pipeline_model_parallel_size"] = chunks
    if len(set(layers)) == 1:  # Megatron's even split
        return fields
    middle = layers[1:-1]
    if chunks == 1 and layers[0] > 0 and layers[-1] > 0 and len(set(middle)) <= 1:
        even = middle[0] if middle else None
        if even is None or layers[0] != even:
            fields["num_layers_in_first_pipeline_stage"] = layers[0]
        if even is None or layers[-1] != even:
            fields["num_layers_in_last_pipeline_stage"] = layers[-1]
        return fields
    fields["pipeline_model_parallel_layout"] = pipeline_layout(layers)
    return fields


def _experts(plan: Plan, num_layers: int, notes: list[str]) -> dict[str, Any]:
    """num_moe_experts, moe_router_topk, moe_layer_freq and the expert-parallel sizes of ``plan.experts``."""
    if not plan.experts:
        return {}
    experts = max(layer.experts for layer in plan.experts)
    top_k = max(layer.top_k for layer in plan.experts)
    if len({(layer.experts, layer.top_k) for layer in plan.experts}) > 1:
        notes.append(f"the plan's experts layers differ in experts or top-k; Megatron has one setting for all: "
                     f"written are the largest, {experts} experts, top-{top_k}.")
    out: dict[str, Any] = {"num_moe_experts": experts, "moe_router_topk": top_k}
    notes.append("experts: --moe-ffn-hidden-size, the router's score function and shared experts are the model's "
                 "and are not written; set them as your model has them (Megatron's defaults: the dense FFN size, "
                 "softmax, none).")
    moe = {layer_index(_block_of_module(layer.module)) for layer in plan.experts}
    if None in moe:
        notes.append("an experts layer outside the numbered layers: --moe-layer-freq cannot place it; written for "
                     "every layer.")
    elif len(moe) < num_layers:
        out["moe_layer_freq"] = [int(i in moe) for i in range(num_layers)]
    if plan.ep > 1:
        out["expert_model_parallel_size"] = plan.ep
        if plan.tp > 1:
            out["expert_tensor_parallel_size"] = 1
    return out


def _block_of_module(module: str) -> str:
    """The numbered block a module path belongs to (``model.layers.3.mlp.experts`` -> ``model.layers.3``)."""
    return block_of(module + ".weight")


def _recompute(plan: Plan, layers: list[int], notes: list[str]) -> dict[str, Any]:
    """TransformerConfig's recompute fields: the nearest that never keeps more than the plan does."""
    modes = {s.recompute for s in plan.stages}
    if modes == {"none"}:
        return {}
    if modes == {"full"}:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    whole, cheap, _ = recompute_summary(plan.stages)
    if not whole:
        notes.append(
            f"the plan recomputes only cheap ops (keeping matmul and attention outputs) on some layers of "
            f"stage{'s' if len(cheap) > 1 else ''} {', '.join(map(str, cheap))}; Megatron's selective recomputation "
            "takes modules, on every layer: nearest is --recompute-granularity selective --recompute-modules "
            "layernorm (the norms; the activation function's output stays kept: more memory than the plan on "
            "those layers).")
        return {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}
    need = []
    for stage, n in zip(plan.stages, layers):
        if stage.recompute == "full":
            need.append(n)
        elif stage.recompute == "selective":  # cheap-ops layers counted whole: never more memory than planned
            need.append(min(n, stage.recompute_layers + stage.recompute_ops_layers) if n else 0)
        else:
            need.append(0)
    k = max(1, max(need))
    if len(set(need)) > 1 or cheap:
        shown = ", ".join(f"{s} {n}" for s, n in enumerate(need))
        notes.append(
            f"the plan recomputes a different number of whole layers on each stage (stage: layers, cheap-op layers "
            f"counted whole: {shown}); Megatron recomputes the first --recompute-num-layers of every stage: nearest "
            f"is --recompute-method block --recompute-num-layers {k} (never more memory; more recomputation on "
            "stages that needed fewer).")
    return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": k}


def _replicas(plan: Plan, notes: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(ddp, dist, checkpoint) Bridge fields of the plan's data parallelism."""
    modes = {s.shard for s in plan.stages}
    if plan.dp == 1 or modes == {"none"}:
        return {}, {}, {}
    sharded = [s for s in plan.stages if s.shard != "none"]
    if "none" in modes:
        replicated = ", ".join(str(s.index) for s in plan.stages if s.shard == "none")
        notes.append(f"the plan replicates stage(s) {replicated} and shards the others; Megatron has one setting "
                     "for every stage: nearest is the others' (never more memory).")
    zero3 = [s.index for s in sharded if s.shard == "full" and s.reshard_after_forward]
    ddp: dict[str, Any] = {"use_distributed_optimizer": True}
    dist: dict[str, Any] = {}
    checkpoint: dict[str, Any] = {}
    if zero3:
        ddp |= {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"}
        dist["use_megatron_fsdp"] = True
        checkpoint["ckpt_format"] = "fsdp_dtensor"  # Megatron-FSDP's only checkpoint format
        if len(zero3) < len(sharded):
            notes.append(f"the plan reshards after forward (ZeRO-3) on stage(s) {', '.join(map(str, zero3))} only; "
                         "Megatron has one setting: nearest is Megatron-FSDP (optim_grads_params) for every stage.")
    elif any(s.shard == "full" for s in sharded):
        notes.append(
            "shard full with weights kept gathered from the first forward to the last backward: Megatron's nearest "
            "is the distributed optimizer (ZeRO-1), which has the same peak and the same traffic per step (gradients "
            "reduce-scattered, weights all-gathered once); between steps it keeps the weights whole.")
    layouts = {shard_layout(plan, s) for s in sharded}
    replicas, _ = min(layouts, key=lambda layout: (-layout[1], layout))  # the widest sharding: least memory
    if len(layouts) > 1:
        notes.append(f"the plan's sharded stages span different replica groups ({sorted(layouts)} as (replicas, "
                     f"shards)); Megatron has one: nearest is {replicas} instance(s) for all.")
    if replicas > 1:
        ddp["num_distributed_optimizer_instances"] = replicas
    return ddp, dist, checkpoint


# Bridge field -> Megatron-LM argument (the field's name with dashes, but for those named otherwise there).
_ARGUMENT_NAMES = {
    "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
    "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
    "seq_length": "--seq-length",
    "num_moe_experts": "--num-experts",
}
_NOT_ARGUMENTS = {("dataset", "sequence_length"), ("optimizer", "use_distributed_optimizer"), ("dist", "use_megatron_fsdp")}


def megatron_arguments(bridge: Mapping[str, Any]) -> list[str]:
    """Megatron-LM's arguments for a Bridge override: ``--field-name value``, ``--flag`` for true.

    >>> megatron_arguments({"model": {"num_layers_in_first_pipeline_stage": 3, "sequence_parallel": True}})
    ['--decoder-first-pipeline-num-layers', '3', '--sequence-parallel']
    """
    arguments: list[str] = []
    for section, values in bridge.items():
        if section == "mixed_precision":
            arguments.append("--bf16")
            continue
        for key, value in values.items():
            if (section, key) in _NOT_ARGUMENTS:
                continue  # the same setting as another section's, or no argument of its own
            if section == "model" and key == "virtual_pipeline_model_parallel_size" and \
                    "pipeline_model_parallel_layout" in values:
                continue  # the layout implies it; Megatron-LM refuses both
            name = _ARGUMENT_NAMES.get(key, "--" + key.replace("_", "-"))
            if value is True:
                arguments.append(name)
            elif key == "moe_layer_freq":  # one argument, a Python list Megatron-LM evaluates
                arguments += [name, "[" + ",".join(map(str, value)) + "]"]
            elif isinstance(value, list):
                arguments += [name, *map(str, value)]
            else:
                arguments += [name, str(value)]
    return arguments


def _header(plan: Plan, out: MegatronExport, *, source: str) -> tuple[str, ...]:
    shape = f"tp {plan.tp} x pp {plan.pp} x dp {plan.dp}" + (
        f", {plan.chunks} stages per rank" if plan.chunks > 1 else "")
    where = f"{out.nodes} nodes of {out.gpus_per_node} GPUs" if out.nodes > 1 else plural(plan.gpus, "GPU")
    length = seq_len(plan)
    lines = [
        (f"Megatron settings for the autopartition plan{' in ' + source if source else ''}: "
         f"{plan.model.class_name} ({format_count(plan.model.parameters)} parameters),"),
        (f"{where} ({shape}), schedule {plan.schedule}, "
         f"{plural(plan.microbatches, 'micro-batch', 'micro-batches')} of {plan.microbatch_size}"
         + (f", sequence {length}." if length is not None else ".")),
        f"Decoder layers per stage: {', '.join(map(str, out.layers))}.",
        ("Written by `autopartition export --to megatron`; checked against megatron-core "
         f"{MEGATRON_CORE_VERSION}'s config classes."),
        "",
        "Megatron-LM: these arguments, with your model, data and optimizer arguments, on every node:",
        *shell_lines(out.command, launcher=out.command.index("pretrain_gpt.py") + 1),
        "",
        "Megatron-Bridge: this file is a recipe override (ConfigContainer sections) with the same settings.",
    ]
    return tuple(lines)


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a YAML double-quoted scalar: JSON's escapes are YAML's
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    raise TypeError(f"no YAML form for {value!r}")
