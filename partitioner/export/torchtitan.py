"""A plan as torchtitan settings: ``[parallelism]``, ``[training]``, ``[activation_checkpoint]``.

torchtitan (pytorch/torchtitan) splits a model for pipelining by module names:
``parallelism.module_fqns_per_model_part`` lists, per stage, the top-level
blocks that stage keeps (``tok_embeddings``, ``layers.N``, ``norm``,
``lm_head``); its splitter keeps the named children of the model's root, one
level into a ``ModuleList`` / ``ModuleDict``, and drops the rest.  Stage ``i``
of that list is placed as torchtitan's schedules place it: looped schedules
put stage ``i`` on pipeline rank ``i mod pp``, the V schedules rank ``r`` on
stages ``r`` and ``2 pp - 1 - r``; that is our placement
(:func:`partitioner.orders.stage_ranks`), so our stage ``i`` is its model part
``i`` and :func:`export_torchtitan` checks that it is.

Mapping rules (each departure is a note naming the nearest setting):

* **Stages.** Each stage's blocks come from its parameter names: the tensor's
  own name dropped, then cut after the first numeric part (``model.layers.3``),
  so every block with parameters is listed once.  A plan may cut inside a
  block (the planner cuts between any two ops); torchtitan cannot, so a block
  held by several stages goes whole to one of them, chosen for all blocks at
  once to keep the most parameter tensors where the plan put them, every
  stage keeping at least one block.  Fewer blocks than stages is an error.
* **Names** follow the model's own (``names="model"``); ``"torchtitan-llama"``
  maps a Hugging Face ``LlamaForCausalLM`` (``model.embed_tokens``,
  ``model.layers.N``, ``model.norm``, ``lm_head``) to torchtitan 0.3's Llama
  (``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head``; 0.2 named the last
  ``output``).
* **Schedules.** gpipe -> ``GPipe``, 1f1b -> ``1F1B``, interleaved-1f1b ->
  ``Interleaved1F1B``, zbv -> ``ZBVZeroBubble``; zb-h1 (one stage per rank)
  has no torchtitan schedule: nearest with the same stages is ``1F1B`` (its
  ``InterleavedZeroBubble`` needs >= 2 stages per rank).
* **Micro-batches.** torchtitan runs ``local_batch_size /
  pipeline_parallel_microbatch_size`` micro-batches per data-parallel rank.
* **Replicas.** One setting for every stage: shard ``none`` ->
  ``data_parallel_replicate_degree = dp``, ``full`` -> ``data_parallel_shard_degree
  = dp``; ``optimizer`` (ZeRO-1) has no counterpart: nearest is shard; stages that
  differ take shard (it never needs more memory).
* **Recomputation.** One ``mode`` for every stage: ``none`` or ``full`` (each
  layer checkpointed, as our runtime does); stages that differ take ``full``.
* **Precision.** fp32 -> ``mixed_precision_param = "float32"``, bf16-mixed ->
  ``"bfloat16"``, bf16 -> ``dtype = "bfloat16"``.

torchtitan 0.2 reads the TOML (``--job.config_file``); torchtitan 0.3 reads no
TOML: :func:`torchtitan_flags` gives the same settings as its command-line
flags, which the file's header repeats.

Example::

    >>> from partitioner.plan import example_plan
    >>> out = export_torchtitan(example_plan())
    >>> out.sections["parallelism"]["module_fqns_per_model_part"]
    [['0'], ['2']]
    >>> out.sections["parallelism"]["pipeline_parallel_schedule"], out.sections["activation_checkpoint"]
    ('GPipe', {'mode': 'none'})
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from partitioner.errors import AutopartitionError, InternalError
from partitioner.orders import stage_ranks
from partitioner.plan import Plan, StagePlan
from partitioner.units import plural

__all__ = [
    "NAME_STYLES",
    "SCHEDULE_NAMES",
    "TorchtitanExport",
    "export_torchtitan",
    "stage_blocks",
    "torchtitan_flags",
    "torchtitan_stage_ranks",
]

# Our schedule -> torchtitan's ``pipeline_parallel_schedule`` (torch.distributed.pipelining's
# get_schedule_class names).  zb-h1 has none of its own: 1F1B keeps its stages (see the notes).
SCHEDULE_NAMES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "zb-h1": "1F1B",
    "zbv": "ZBVZeroBubble",
}
_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # torchtitan places these in a V, the rest in a loop

NAME_STYLES = ("model", "torchtitan-llama")
# Hugging Face LlamaForCausalLM block -> torchtitan 0.3 Llama3Model block (``layers.N`` by rule).
_LLAMA_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "lm_head"}
_LLAMA_LAYER = re.compile(r"^model\.layers\.(\d+)$")

_PRECISION = {  # plan precision -> torchtitan [training] settings
    "fp32": {"dtype": "float32", "mixed_precision_param": "float32"},
    "bf16-mixed": {"dtype": "float32", "mixed_precision_param": "bfloat16"},
    "bf16": {"dtype": "bfloat16", "mixed_precision_param": "bfloat16"},
}


@dataclasses.dataclass(frozen=True)
class TorchtitanExport:
    """torchtitan settings of one plan: TOML sections, the departures from the plan, a header."""

    sections: dict[str, dict[str, Any]]  # section -> key -> value, in writing order
    notes: tuple[str, ...]  # what torchtitan cannot express, each with the nearest setting written
    header: tuple[str, ...] = ()  # comment lines above the sections

    @property
    def flags(self) -> list[str]:
        return torchtitan_flags(self.sections)

    def toml(self) -> str:
        lines = [f"# {line}" if line else "#" for line in self.header]
        for section, values in self.sections.items():
            lines += ["", f"[{section}]"]
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        return "\n".join(lines).lstrip("\n") + "\n"


def export_torchtitan(plan: Plan, *, names: str = "model", source: str = "") -> TorchtitanExport:
    """The torchtitan settings that run ``plan`` (see the module docstring for the rules).

    ``names``: ``"model"`` (the model's own module names) or ``"torchtitan-llama"``;
    ``source``: where the plan came from, for the header.
    """
    notes: list[str] = []
    parts, block_notes = stage_blocks(plan, names=names)
    notes += block_notes
    schedule = SCHEDULE_NAMES.get(plan.schedule)
    if schedule is None:
        raise InternalError(f"schedule {plan.schedule!r} has no torchtitan name")
    if plan.schedule == "zb-h1":
        notes.append(
            "schedule zb-h1: torchtitan has no one-stage-per-rank zero-bubble schedule; nearest with these stages "
            "is 1F1B (ZB-H1 is 1F1B with each weight gradient deferred into the cool-down, so 1F1B's step is a "
            "little longer). torchtitan's InterleavedZeroBubble needs >= 2 stages per rank: plan with "
            "--schedule interleaved-1f1b or zbv to get a zero-bubble schedule torchtitan runs.")
    _check_placement(plan, schedule)

    parallelism: dict[str, Any] = {
        "pipeline_parallel_degree": plan.pp,
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": plan.microbatch_size,
        "module_fqns_per_model_part": parts,
    }
    replicate, shard = _data_parallel(plan, notes)
    parallelism |= {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": getattr(plan, "tp", 1),  # torchtitan's TP is Megatron's pairs, as we price them
    }
    training: dict[str, Any] = {
        "local_batch_size": plan.batch_size // plan.dp,
        "global_batch_size": plan.batch_size,
        **_PRECISION.get(plan.precision, _PRECISION["fp32"]),
    }
    if plan.optimizer != "adam":
        notes.append(f"optimizer {plan.optimizer}: the plan's memory assumes it, and torchtitan's Llama configs "
                     "use AdamW (2 state tensors per parameter): choose the same optimizer there, or expect more "
                     "memory per GPU than the plan predicts.")
    sections = {
        "parallelism": parallelism,
        "training": training,
        "activation_checkpoint": {"mode": _recompute_mode(plan, notes)},
    }
    header = _header(plan, sections, source=source, names=names)
    return TorchtitanExport(sections=sections, notes=tuple(notes), header=header)


def stage_blocks(plan: Plan, *, names: str = "model") -> tuple[list[list[str]], list[str]]:
    """Each stage's top-level blocks (torchtitan's ``module_fqns_per_model_part``) and the notes.

    Every block with parameters appears in exactly one stage, stages in pipeline order,
    blocks in model order within each.
    """
    if names not in NAME_STYLES:
        raise AutopartitionError(f"Unknown --names {names!r}; choose one of {', '.join(NAME_STYLES)}.")
    held = _held_parameters(plan)
    order: dict[str, tuple[int, int]] = {}  # block -> (first stage holding it, position in that stage's graph)
    counts: dict[str, dict[int, int]] = {}  # block -> stage -> parameter tensors of it there
    for plan_stage in plan.stages:
        position = {node: i for i, node in enumerate(plan_stage.nodes)}
        for name in held[plan_stage.index]:
            block = _block(name)
            counts.setdefault(block, {}).setdefault(plan_stage.index, 0)
            counts[block][plan_stage.index] += 1
            node = name.replace(".", "_")  # fx's name for a parameter; torch.export's adds "p_"
            seen = (plan_stage.index, position.get(node, position.get(f"p_{node}", len(position))))
            order[block] = min(order.get(block, seen), seen)
    blocks = sorted(order, key=lambda b: (order[b], _natural(b)))
    n_stages = len(plan.stages)
    if len(blocks) < n_stages:
        raise AutopartitionError(
            f"torchtitan keeps whole top-level blocks in each stage, and this plan has {n_stages} stages "
            f"over {plural(len(blocks), 'block')} with parameters ({', '.join(blocks)}): it cannot give every "
            "stage a block. Plan with fewer stages (fewer --chunks, or a smaller --pp) and export that plan.")
    chosen = _nearest_split([counts[b] for b in blocks], n_stages)
    shown = {b: _llama_name(b) if names == "torchtitan-llama" else b for b in blocks}
    notes = []
    for block, stage in zip(blocks, chosen):
        holders = sorted(counts[block])
        if holders != [stage]:
            total = sum(counts[block].values())
            moved = total - counts[block].get(stage, 0)
            where = " and ".join(map(str, holders)) if len(holders) > 1 else str(holders[0])
            notes.append(
                f"the plan splits {shown[block]} over stages {where}; torchtitan splits at whole blocks: nearest, "
                f"all of {shown[block]} in stage {stage} ({moved} of its {plural(total, 'parameter tensor')} moved), "
                "so that stage's time and memory differ from the plan's prediction."
                if len(holders) > 1 else
                f"{shown[block]} moves from stage {where} to stage {stage}, so that each stage keeps a whole block.")
    parts: list[list[str]] = [[] for _ in range(n_stages)]
    for block, stage in zip(blocks, chosen):
        parts[stage].append(shown[block])
    if names == "model" and any(b in _LLAMA_NAMES or _LLAMA_LAYER.match(b) for b in blocks):
        notes.append("module names are the model's own (Hugging Face Llama); for torchtitan's own Llama "
                     "(tok_embeddings, layers.N, norm, lm_head) export with --names torchtitan-llama.")
    shared = [t for t in plan.tied if len(set(t.stages)) > 1]
    if shared:
        tied = ", ".join(f"{t.name} ({', '.join(t.aliases)})" for t in shared)
        notes.append(f"tied parameters {tied}: torchtitan's pipeline split keeps each stage's copy separate "
                     "(it ties nothing across stages); tie them yourself or untie them in the model.")
    return parts, notes


def torchtitan_flags(sections: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """torchtitan 0.3's command-line flags for the TOML ``sections`` (0.3 reads no TOML).

    ``[section] key = value`` becomes ``--section.key value`` (a list of lists:
    one comma-joined argument per inner list); ``[activation_checkpoint] mode``
    becomes its subcommand ``activation_checkpoint:MODE``, last.  With pipeline
    parallelism 0.3 also needs ``--training.disable_cuda_graphs`` (its CUDA graphs
    do not run pipelines).

    >>> torchtitan_flags({"parallelism": {"pipeline_parallel_degree": 2,
    ...     "module_fqns_per_model_part": [["a", "b"], ["c"]]}, "activation_checkpoint": {"mode": "none"}})
    ['--parallelism.pipeline_parallel_degree', '2', '--parallelism.module_fqns_per_model_part', 'a,b', 'c', \
'--training.disable_cuda_graphs', 'activation_checkpoint:none']
    """
    flags: list[str] = []
    for section, values in sections.items():
        if section == "activation_checkpoint":
            continue
        for key, value in values.items():
            flags.append(f"--{section}.{key}")
            if isinstance(value, list) and value and isinstance(value[0], list):
                flags += [",".join(part) for part in value]
            elif isinstance(value, list):
                flags.append(",".join(map(str, value)))
            else:
                flags.append(str(value).lower() if isinstance(value, bool) else str(value))
    if int(sections.get("parallelism", {}).get("pipeline_parallel_degree", 1)) > 1:
        flags.append("--training.disable_cuda_graphs")
    mode = sections.get("activation_checkpoint", {}).get("mode")
    if mode is not None:
        flags.append(f"activation_checkpoint:{mode}")
    return flags


def torchtitan_stage_ranks(schedule: str, *, pp: int, stages: int) -> tuple[int, ...]:
    """The pipeline rank torchtitan gives each of ``stages`` model parts under its ``schedule``.

    Looped schedules: part ``i`` on rank ``i mod pp``; V schedules: rank ``r`` holds
    parts ``r`` and ``stages - 1 - r`` (torchtitan's pipeline_parallel.py).

    >>> torchtitan_stage_ranks("Interleaved1F1B", pp=2, stages=4), torchtitan_stage_ranks("ZBVZeroBubble", pp=2, stages=4)
    ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    if schedule in _V_SCHEDULES:
        return tuple(range(pp)) + tuple(reversed(range(pp)))
    return tuple(i % pp for i in range(stages))


# ------------------------------------------------------------------ helpers


def _held_parameters(plan: Plan) -> list[list[str]]:
    """Each stage's parameter names, a tied tensor's alias given to each stage that holds it, in order."""
    held = [list(stage.parameters) for stage in plan.stages]
    for tied in plan.tied:
        names = (tied.name, *[a for a in tied.aliases if a != tied.name])
        holders = sorted(tied.stages)
        for stage in holders:
            if tied.name in held[stage]:
                held[stage].remove(tied.name)
        # The k-th holder (pipeline order) uses the k-th name (graph order): an embedding first, its tied head last.
        for k, stage in enumerate(holders):
            held[stage].append(names[min(k, len(names) - 1)])
    return held


def _block(parameter: str) -> str:
    """The top-level block a parameter belongs to: its module path, cut after the first index.

    >>> _block("model.layers.3.self_attn.q_proj.weight"), _block("model.norm.weight"), _block("lm_head.weight")
    ('model.layers.3', 'model.norm', 'lm_head')
    """
    path = parameter.split(".")[:-1]
    for i, part in enumerate(path):
        if part.isdigit():
            return ".".join(path[: i + 1])
    return ".".join(path) or parameter


def _natural(name: str) -> list[Any]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _nearest_split(counts: Sequence[Mapping[int, int]], n_stages: int) -> list[int]:
    """A stage per block, in order, each stage one contiguous non-empty run, keeping the most tensors in place.

    Dynamic programming over (block, stage): block i goes to the stage of block i-1 or the next one.

    >>> _nearest_split([{0: 3}, {0: 1, 1: 4}, {1: 2}], 2)
    [0, 1, 1]
    """
    n = len(counts)
    unreachable = -1
    best = [[unreachable] * n_stages for _ in range(n)]
    came = [[0] * n_stages for _ in range(n)]
    best[0][0] = counts[0].get(0, 0)
    for i in range(1, n):
        for s in range(min(i + 1, n_stages)):
            # Stay in s, or open s (after s - 1); leave enough blocks for the stages after s.
            if n - i < n_stages - s:
                continue
            options = [(best[i - 1][s], s), (best[i - 1][s - 1], s - 1) if s else (unreachable, s)]
            score, prev = max(options, key=lambda o: (o[0], -o[1]))
            if score == unreachable:
                continue
            best[i][s] = score + counts[i].get(s, 0)
            came[i][s] = prev
    if best[n - 1][n_stages - 1] == unreachable:
        raise InternalError(f"no split of {n} blocks into {n_stages} stages")
    chosen = [n_stages - 1]
    for i in range(n - 1, 0, -1):
        chosen.append(came[i][chosen[-1]])
    return chosen[::-1]


def _llama_name(block: str) -> str:
    if block in _LLAMA_NAMES:
        return _LLAMA_NAMES[block]
    layer = _LLAMA_LAYER.match(block)
    if layer:
        return f"layers.{layer.group(1)}"
    raise AutopartitionError(
        f"--names torchtitan-llama maps a Hugging Face LlamaForCausalLM (model.embed_tokens, model.layers.N, "
        f"model.norm, lm_head), and this model has a block {block!r} that is none of those. Export with "
        "--names model to keep the model's own names.")


def _check_placement(plan: Plan, schedule: str) -> None:
    """Our stage i must be torchtitan's model part i on the same pipeline rank."""
    ours = stage_ranks(plan.schedule, ranks=plan.pp, chunks=plan.chunks)
    theirs = torchtitan_stage_ranks(schedule, pp=plan.pp, stages=len(plan.stages))
    if plan.stage_ranks() != ours or ours != theirs:
        raise InternalError(
            f"stage placement differs: plan {plan.stage_ranks()}, {plan.schedule} {ours}, torchtitan {schedule} {theirs}")


def _data_parallel(plan: Plan, notes: list[str]) -> tuple[int, int]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree)."""
    if plan.dp == 1:
        return 1, 1
    modes = {stage.shard for stage in plan.stages}
    if modes == {"none"}:
        if plan.pp > 1:
            notes.append(
                "replicas (DDP) with pipeline stages: torchtitan 0.3 replicates through fully_shard on a "
                "(replicate, shard=1) mesh, as written; torchtitan 0.2 refuses DDP with pp > 1 (\"DDP has not "
                f"supported > 1D parallelism\"): there, nearest is data_parallel_shard_degree = {plan.dp} with "
                "data_parallel_replicate_degree = 1 (FSDP).")
        return plan.dp, 1
    if "optimizer" in modes:
        notes.append(
            f"shard optimizer (ZeRO-1) on {_stages_with(plan.stages, 'shard', 'optimizer')}: torchtitan has no "
            "optimizer-only sharding; nearest is data_parallel_shard_degree (FSDP: weights and gradients "
            "sharded too, less memory, an all-gather of the weights in forward and backward).")
    if "none" in modes:
        notes.append(
            f"the plan replicates {_stages_with(plan.stages, 'shard', 'none')} and shards the others; torchtitan "
            "has one setting for all: nearest is data_parallel_shard_degree for every stage (never more memory).")
    return 1, plan.dp


def _recompute_mode(plan: Plan, notes: list[str]) -> str:
    modes = {stage.recompute for stage in plan.stages}
    if modes == {"none"}:
        return "none"
    if modes != {"full"}:
        redo = [str(s.index) for s in plan.stages if s.recompute != "none"]  # "selective": its first layers only
        selective = " (some only their first layers, or only their cheap ops)" if "selective" in modes else ""
        notes.append(
            f"the plan recomputes stage{'s' if len(redo) > 1 else ''} {', '.join(redo)}{selective} only; "
            "torchtitan's activation "
            "checkpointing is one mode for every stage: nearest is full everywhere (fits where the plan fits, "
            "at the cost of recomputing the other stages' forwards too).")
    return "full"


def _stages_with(stages: Sequence[StagePlan], field: str, value: str) -> str:
    chosen = [str(s.index) for s in stages if getattr(s, field) == value]
    return f"stage{'s' if len(chosen) > 1 else ''} {', '.join(chosen)}"


def _header(plan: Plan, sections: Mapping[str, Mapping[str, Any]], *, source: str, names: str) -> tuple[str, ...]:
    shape = f"pp {plan.pp} x dp {plan.dp}" + (f", {plan.chunks} stages per rank" if plan.chunks > 1 else "")
    lines = [
        f"torchtitan settings for the autopartition plan{' in ' + source if source else ''}: {plan.model.class_name},",
        (f"{plan.gpus} GPUs ({shape}), schedule {plan.schedule}, "
         f"{plural(plan.microbatches, 'micro-batch', 'micro-batches')} of {plan.microbatch_size}."),
        "Written by `autopartition export --to torchtitan`; merge these sections into your torchtitan config.",
        "Module names: " + ("torchtitan 0.3's Llama, mapped from Hugging Face Llama names (torchtitan 0.2 "
                            "calls lm_head output)." if names != "model" else "the model's own."),
        "",
        "torchtitan 0.2 reads this file: --job.config_file FILE. torchtitan 0.3 reads no TOML; pass instead:",
        *_flag_lines(torchtitan_flags(sections)),
    ]
    return tuple(lines)


def _flag_lines(flags: Sequence[str]) -> list[str]:
    """Shell lines, one option (with its values) each, continued with backslashes."""
    groups: list[list[str]] = []
    for flag in flags:
        if flag.startswith("-") or ":" in flag or not groups:
            groups.append([flag])
        else:
            groups[-1].append(flag)
    lines = [f"  {shlex.join(group)}" for group in groups]
    return [line + " \\" for line in lines[:-1]] + lines[-1:]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        if value and isinstance(value[0], list):
            return "[\n" + "".join(f"  {_toml_value(v)},\n" for v in value) + "]"
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise InternalError(f"no TOML form for {value!r}")
