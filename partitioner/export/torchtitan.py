"""A plan as torchtitan 0.3 settings: its command line, and the same as ``[parallelism]``, ``[training]`` TOML.

torchtitan (pytorch/torchtitan) splits a model for pipelining by module names:
``parallelism.module_fqns_per_model_part`` lists, per stage, the top-level
blocks that stage keeps (``tok_embeddings``, ``layers.N``, ``norm``,
``lm_head``); its splitter keeps the named children of the model's root, one
level into a ``ModuleList`` / ``ModuleDict``, and silently drops every other
name.  Stage ``i`` of that list is placed as torchtitan's schedules place it:
looped schedules put stage ``i`` on pipeline rank ``i mod pp``, the V schedules
rank ``r`` on stages ``r`` and ``2 pp - 1 - r``; that is our placement
(:func:`partitioner.orders.stage_ranks`), and :func:`export_torchtitan` checks it.

Mapping rules (each departure is a note naming the nearest setting):

* **Target model and names.** ``names="auto"`` (the default): a Hugging Face
  ``LlamaForCausalLM`` (``model.embed_tokens``, ``model.layers.N``,
  ``model.norm``, ``lm_head``) becomes torchtitan's own Llama 3 (``--module
  llama3``; ``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head``), with the
  ``--config`` whose layers and parameter count are the model's (:data:`LLAMA3_CONFIGS`);
  any other model keeps its own names, for a torchtitan model registered under
  them.  ``"torchtitan-llama"`` insists on the Llama mapping and refuses, naming
  them, blocks it has no name for; ``"model"`` keeps the model's names.
* **Stages** are whole blocks (:func:`partitioner.export.blocks.split_blocks`):
  a block the plan cuts goes whole to the side that keeps every stage's
  parameter count nearest the plan's; the note says how far each stage moves.
* **Schedules.** gpipe -> ``GPipe``, 1f1b -> ``1F1B``, interleaved-1f1b ->
  ``Interleaved1F1B``, zbv -> ``ZBVZeroBubble``; zb-h1 (one stage per rank)
  has no torchtitan schedule: nearest with the same stages is ``1F1B``.
* **Batch.** ``global_batch_size`` is the plan's batch.  With pipeline stages
  torchtitan runs ``local_batch_size / pipeline_parallel_microbatch_size``
  micro-batches per replica, so ``local_batch_size = batch / dp``; without
  (pp = 1) it accumulates gradients over ``global / (local x dp)`` steps, so
  ``local_batch_size`` is the plan's micro-batch.  ``seq_len`` is the token
  input's length.
* **Replicas.** One setting for every stage: shard ``none`` (DDP) ->
  ``data_parallel_replicate_degree = dp``; ``full`` -> ``data_parallel_shard_degree``,
  over every replica or, HSDP, over a node's and replicated across nodes (a
  stage's ``shard_span``; by default HSDP where tp = 1 and the replicas span
  whole nodes: :func:`shard_layout`); ``optimizer`` (ZeRO-1) has no counterpart:
  nearest is shard, weights kept gathered.  ``fsdp_reshard_after_forward`` is
  ``always`` for ZeRO-3 stages (``reshard_after_forward``), ``never`` for stages
  kept gathered: written explicitly, since torchtitan's ``default`` reshards
  after forward only without pipeline parallelism.
* **Recomputation.** ``[activation_checkpoint] mode``: ``none``, ``full`` (each
  layer), or ``selective`` (torchtitan's per-op policy) where the plan recomputes
  only cheap ops; one mode for every layer of every stage, so per-stage and
  per-layer choices take the nearest that never needs more memory.
* **Precision.** fp32 -> ``mixed_precision_param = "float32"``, bf16-mixed ->
  ``"bfloat16"``, bf16 -> ``dtype = "bfloat16"``.

torchtitan 0.3 reads no TOML: :meth:`TorchtitanExport.command` is the command
line (``torchrun ... -m torchtitan.train --module llama3 --config llama3_8b``
and the flags), which the file's header holds; the sections are the same settings.

Example::

    >>> from partitioner.plan import example_plan
    >>> out = export_torchtitan(example_plan(), sizes={"0.weight": 16, "2.weight": 16})
    >>> out.sections["parallelism"]["module_fqns_per_model_part"]
    [['0'], ['2']]
    >>> out.sections["parallelism"]["pipeline_parallel_schedule"], out.sections["activation_checkpoint"]
    ('GPipe', {'mode': 'none'})
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from partitioner.errors import AutopartitionError, InternalError
from partitioner.export.blocks import BlockSplit, layer_index, split_blocks
from partitioner.export.shell import shell_lines
from partitioner.orders import stage_ranks
from partitioner.plan import Plan, StagePlan
from partitioner.units import format_count, plural

__all__ = [
    "LLAMA3_CONFIGS",
    "NAME_STYLES",
    "SCHEDULE_NAMES",
    "TORCHTITAN_VERSION",
    "TorchtitanExport",
    "export_torchtitan",
    "recompute_summary",
    "seq_len",
    "shard_layout",
    "stage_blocks",
    "torchtitan_flags",
    "torchtitan_stage_ranks",
]

TORCHTITAN_VERSION = "0.3.0"  # the release the settings are checked against (tests/test_export_torchtitan.py)

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

NAME_STYLES = ("auto", "model", "torchtitan-llama")
# Hugging Face LlamaForCausalLM block -> torchtitan 0.3 Llama3Model block (``layers.N`` by rule).
_LLAMA_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "lm_head"}
_LLAMA_LAYER = re.compile(r"^model\.layers\.(\d+)$")
# torchtitan 0.3's Llama 3 configs (``--module llama3 --config NAME``): (layers, parameters), checked by the tests.
LLAMA3_CONFIGS: dict[str, tuple[int, int]] = {
    "llama3_8b": (32, 8_030_261_248),
    "llama3_70b": (80, 70_553_706_496),
    "llama3_405b": (126, 405_853_388_800),
}
_PLACEHOLDER_CONFIG = "YOUR_CONFIG"

_PRECISION = {  # plan precision -> torchtitan [training] settings
    "fp32": {"dtype": "float32", "mixed_precision_param": "float32"},
    "bf16-mixed": {"dtype": "float32", "mixed_precision_param": "bfloat16"},
    "bf16": {"dtype": "bfloat16", "mixed_precision_param": "bfloat16"},
}


@dataclasses.dataclass(frozen=True)
class TorchtitanExport:
    """torchtitan settings of one plan: TOML sections, the departures from the plan, a header.

    ``module`` / ``config``: torchtitan's ``--module`` / ``--config`` ("" where no
    torchtitan model or config of the model's shape is known: the command holds a
    placeholder); ``deviation``: each stage's parameters with whole blocks over the plan's, minus 1.
    """

    sections: dict[str, dict[str, Any]]  # section -> key -> value, in writing order
    notes: tuple[str, ...]  # what torchtitan cannot express, each with the nearest setting written
    header: tuple[str, ...] = ()  # comment lines above the sections
    module: str = ""
    config: str = ""
    nodes: int = 1
    gpus_per_node: int = 1
    deviation: tuple[float, ...] = ()

    @property
    def flags(self) -> list[str]:
        return torchtitan_flags(self.sections)

    @property
    def command(self) -> list[str]:
        """The torchrun command that runs the plan on each node (rendezvous options are the user's)."""
        nodes = ["--nnodes", str(self.nodes)] if self.nodes > 1 else []
        return ["torchrun", *nodes, "--nproc_per_node", str(self.gpus_per_node), "-m", "torchtitan.train",
                "--module", self.module or "YOUR_MODULE", "--config", self.config or _PLACEHOLDER_CONFIG,
                *self.flags]

    def toml(self) -> str:
        lines = [f"# {line}" if line else "#" for line in self.header]
        for section, values in self.sections.items():
            lines += ["", f"[{section}]"]
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        return "\n".join(lines).lstrip("\n") + "\n"


def export_torchtitan(plan: Plan, *, names: str = "auto", sizes: Mapping[str, int] | None = None,
                      source: str = "") -> TorchtitanExport:
    """The torchtitan settings that run ``plan`` (see the module docstring for the rules).

    ``names``: one of :data:`NAME_STYLES`; ``sizes``: parameter name -> elements
    (:mod:`partitioner.export.sizes`; None: blocks are placed by counting tensors);
    ``source``: where the plan came from, for the header.
    """
    notes: list[str] = []
    parts, split, shown, style = _stages(plan, names=names, sizes=sizes)
    cut = split.note("torchtitan", names=shown)
    notes += [cut] if cut else []
    if sizes is None:
        notes.append("parameter sizes unknown: blocks the plan cuts are placed by counting parameter tensors, "
                     "which can leave stages far from the plan's sizes; export where the plan's model file loads.")
    module, config = _target(plan, split, style, notes)
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

    parallelism: dict[str, Any] = {"pipeline_parallel_degree": plan.pp}
    if plan.pp > 1:
        parallelism |= {
            "pipeline_parallel_schedule": schedule,
            "pipeline_parallel_microbatch_size": plan.microbatch_size,
            "module_fqns_per_model_part": parts,
        }
    parallelism |= _data_parallel(plan, notes)
    tp = plan.tp
    parallelism["tensor_parallel_degree"] = tp  # torchtitan's TP is Megatron's pairs, as we price them
    if tp > 1:
        parallelism["enable_sequence_parallel"] = True  # as priced: boundaries and norms split over the group
    parallelism |= _expert_parallel(plan, parallelism, notes)
    training: dict[str, Any] = {
        # pp > 1: one step of batch / dp, cut into the plan's micro-batches; pp = 1: torchtitan accumulates
        # gradients over global / (local x dp) steps of one micro-batch each.
        "local_batch_size": plan.batch_size // plan.dp if plan.pp > 1 else plan.microbatch_size,
        "global_batch_size": plan.batch_size,
    }
    length = seq_len(plan)
    if length is not None:
        training["seq_len"] = length
    else:
        notes.append("no token input (a 2-D integer tensor) in the plan's model inputs: training.seq_len is not "
                     "written; set it to the sequence length the plan was made for.")
    training |= _PRECISION.get(plan.precision, _PRECISION["fp32"])
    if plan.precision not in _PRECISION:
        notes.append(f"precision {plan.precision}: no torchtitan setting is written for it here; nearest written "
                     "is fp32 training with fp32 parameters.")
    if plan.optimizer != "adam":
        notes.append(f"optimizer {plan.optimizer}: the plan's memory assumes it, and torchtitan's Llama configs "
                     "use AdamW (2 state tensors per parameter): choose the same optimizer there, or expect more "
                     "memory per GPU than the plan predicts.")
    sections = {
        "parallelism": parallelism,
        "training": training,
        "activation_checkpoint": {"mode": _checkpointing(plan, notes)},
    }
    per_node = plan.gpus_per_host or plan.gpus_per_node or plan.gpus  # torchrun runs per host
    out = TorchtitanExport(sections=sections, notes=tuple(notes), module=module, config=config,
                           nodes=max(1, plan.gpus // per_node), gpus_per_node=min(per_node, plan.gpus),
                           deviation=split.deviation)
    return dataclasses.replace(out, header=_header(plan, out, source=source, style=style))


def stage_blocks(plan: Plan, *, names: str = "auto", sizes: Mapping[str, int] | None = None,
                 ) -> tuple[list[list[str]], list[str]]:
    """Each stage's top-level blocks (torchtitan's ``module_fqns_per_model_part``) and the notes on them.

    Every block with parameters appears in exactly one stage, stages in pipeline order,
    blocks in model order within each.
    """
    parts, split, shown, style = _stages(plan, names=names, sizes=sizes)
    note = split.note("torchtitan", names=shown)
    notes = [note] if note else []
    if style == "model" and any(b in _LLAMA_NAMES or _LLAMA_LAYER.match(b) for b in split.blocks):
        notes.append("module names are the model's own (Hugging Face Llama); for torchtitan's own Llama "
                     "(tok_embeddings, layers.N, norm, lm_head) export with --names torchtitan-llama or auto.")
    shared = [t for t in plan.tied if len(set(t.stages)) > 1]
    if shared:
        tied = ", ".join(f"{t.name} ({', '.join(t.aliases)})" for t in shared)
        notes.append(f"tied parameters {tied}: torchtitan's pipeline split keeps each stage's copy separate "
                     "(it ties nothing across stages); tie them yourself or untie them in the model.")
    return parts, notes


def torchtitan_flags(sections: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """torchtitan 0.3's command-line flags for the TOML ``sections`` (0.3 reads no TOML).

    ``[section] key = value`` becomes ``--section.key value`` (a list of lists:
    one comma-joined argument per inner list; ``true`` a bare flag, ``false`` its
    ``--section.no-key`` form, as tyro writes booleans); ``[activation_checkpoint]
    mode`` becomes its subcommand ``activation_checkpoint:MODE``, last.  With pipeline
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
            if isinstance(value, bool):
                flags.append(f"--{section}.{key}" if value else f"--{section}.no-{key}")
                continue
            flags.append(f"--{section}.{key}")
            if isinstance(value, list) and value and isinstance(value[0], list):
                flags += [",".join(part) for part in value]
            elif isinstance(value, list):
                flags.append(",".join(map(str, value)))
            else:
                flags.append(str(value))
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


def seq_len(plan: Plan) -> int | None:
    """The sequence length the plan was made for: the length of its first token input (2-D, integer), or None."""
    for spec in plan.model.inputs:
        if len(spec.shape) == 2 and spec.dtype in ("int64", "int32", "torch.int64", "torch.int32"):
            return spec.shape[1]
    return None


def shard_layout(plan: Plan, stage: StagePlan) -> tuple[int, int]:
    """(replicas, shards) a ``full`` or ``optimizer`` stage group's ``dp`` replicas form: HSDP or not.

    A stage's ``shard_span`` says: ``"world"`` shards over every replica,
    ``"node"`` over the replicas on one node, replicated across nodes (HSDP).
    Absent (older plans), ``full`` is HSDP where tp = 1 and the replicas span
    whole nodes, as :func:`partitioner.cost.precision.shard_degree` prices it;
    ``optimizer`` shards over every replica.  A node holds ``gpus_per_node / tp``
    replicas of a stage.

    >>> from partitioner.plan import example_plan
    >>> plan = dataclasses.replace(example_plan(), gpus=32, pp=2, dp=16, gpus_per_node=8)
    >>> [shard_layout(plan, dataclasses.replace(plan.stages[0], shard="full", shard_span=span)) for span in ("node", "world")]
    [(2, 8), (1, 16)]
    """
    per_node = max(1, (plan.gpus_per_node or plan.gpus) // plan.tp)
    whole_nodes = plan.dp > per_node and plan.dp % per_node == 0
    span = getattr(stage, "shard_span", "") or ""
    if span == "":
        span = "node" if stage.shard == "full" and plan.tp == 1 and whole_nodes else "world"
    if span == "node" and whole_nodes:
        return plan.dp // per_node, per_node
    return 1, plan.dp


def recompute_summary(stages: Sequence[StagePlan]) -> tuple[list[int], list[int], list[int]]:
    """(stages recomputing whole layers, stages recomputing only cheap ops, stages recomputing nothing)."""
    whole = [s.index for s in stages if s.recompute == "full" or s.recompute_layers > 0]
    cheap = [s.index for s in stages if s.index not in whole and s.recompute_ops_layers > 0]
    kept = [s.index for s in stages if s.index not in whole and s.index not in cheap]
    return whole, cheap, kept


# ------------------------------------------------------------------ helpers


def _stages(plan: Plan, *, names: str, sizes: Mapping[str, int] | None,
            ) -> tuple[list[list[str]], BlockSplit, dict[str, str], str]:
    """(model parts in torchtitan's names, the split, block -> shown name, the resolved name style)."""
    if names not in NAME_STYLES:
        raise AutopartitionError(f"Unknown --names {names!r}; choose one of {', '.join(NAME_STYLES)}.")
    split = split_blocks(plan, sizes=sizes, framework="torchtitan")
    unmapped = [b for b in split.blocks if _llama_name(b) is None]
    style = names
    if names == "auto":
        style = "torchtitan-llama" if not unmapped else "model"
    if style == "torchtitan-llama" and unmapped:
        raise AutopartitionError(
            f"--names torchtitan-llama maps a Hugging Face LlamaForCausalLM (model.embed_tokens, model.layers.N, "
            f"model.norm, lm_head) to torchtitan's Llama, and this model has {plural(len(unmapped), 'block')} "
            f"torchtitan's Llama has no name for: {', '.join(unmapped)}. torchtitan's split drops names it does not "
            "find, leaving stages without those blocks. Export with --names model (for a torchtitan model "
            "registered under the model's own names).")
    shown = {b: (_llama_name(b) or b) if style == "torchtitan-llama" else b for b in split.blocks}
    return [[shown[b] for b in part] for part in split.parts()], split, shown, style


def _llama_name(block: str) -> str | None:
    if block in _LLAMA_NAMES:
        return _LLAMA_NAMES[block]
    layer = _LLAMA_LAYER.match(block)
    return f"layers.{layer.group(1)}" if layer else None


def _target(plan: Plan, split: BlockSplit, style: str, notes: list[str]) -> tuple[str, str]:
    """torchtitan's (--module, --config) for the model; "" where none is known (a note says what to do)."""
    if style != "torchtitan-llama":
        notes.append(
            f"torchtitan has no model known here for {plan.model.class_name}: the stages name the model's own "
            "modules; register it with torchtitan (a module with a config_registry) under those names and put its "
            "--module and --config in the command. torchtitan's split drops every name it does not find.")
        return "", ""
    layers = sum(1 for b in split.blocks if layer_index(b) is not None)
    for config, (n_layers, parameters) in LLAMA3_CONFIGS.items():
        if layers == n_layers and abs(plan.model.parameters - parameters) <= 0.01 * parameters:
            return "llama3", config
    known = "; ".join(f"{c}: {n} layers, {format_count(p)}" for c, (n, p) in LLAMA3_CONFIGS.items())
    notes.append(
        f"no torchtitan llama3 config has this model's shape ({plural(layers, 'layer')}, "
        f"{format_count(plan.model.parameters)} parameters; torchtitan {TORCHTITAN_VERSION} has {known}): the command "
        f"says --config {_PLACEHOLDER_CONFIG}; add a config of this shape to torchtitan's "
        "models/llama3/config_registry.py and name it there (a smaller config would drop the layers it lacks).")
    return "llama3", ""


def _check_placement(plan: Plan, schedule: str) -> None:
    """Our stage i must be torchtitan's model part i on the same pipeline rank."""
    ours = stage_ranks(plan.schedule, ranks=plan.pp, chunks=plan.chunks)
    theirs = torchtitan_stage_ranks(schedule, pp=plan.pp, stages=len(plan.stages))
    if plan.stage_ranks() != ours or ours != theirs:
        raise InternalError(
            f"stage placement differs: plan {plan.stage_ranks()}, {plan.schedule} {ours}, torchtitan {schedule} {theirs}")


def _data_parallel(plan: Plan, notes: list[str]) -> dict[str, Any]:
    """data_parallel_replicate_degree, data_parallel_shard_degree and, when sharded, fsdp_reshard_after_forward."""
    if plan.dp == 1:
        return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1}
    modes = {stage.shard for stage in plan.stages}
    if modes == {"none"}:
        return {"data_parallel_replicate_degree": plan.dp, "data_parallel_shard_degree": 1}
    sharded = [s for s in plan.stages if s.shard != "none"]
    if "optimizer" in modes:
        notes.append(
            f"shard optimizer (ZeRO-1) on {_stages_with(plan.stages, 'shard', 'optimizer')}: torchtitan has no "
            "optimizer-only sharding; nearest is FSDP with weights kept gathered from the first forward to the last "
            "backward (fsdp_reshard_after_forward = never): the same peak, its state sharded between steps.")
    if "none" in modes:
        notes.append(
            f"the plan replicates {_stages_with(plan.stages, 'shard', 'none')} and shards the others; torchtitan "
            "has one setting for all: nearest is data_parallel_shard_degree for every stage (never more memory).")
    layouts = {shard_layout(plan, s) for s in sharded}
    replicate, shard = min(layouts, key=lambda layout: (-layout[1], layout))  # the widest sharding: least memory
    if len(layouts) > 1:
        notes.append(f"the plan's sharded stages span different replica groups ({sorted(layouts)} as (replicas, "
                     f"shards)); torchtitan has one mesh: nearest is {replicate} x {shard} for all.")
    resharded = [s.index for s in sharded if s.shard == "full" and s.reshard_after_forward]
    policy = "always" if resharded else "never"
    if resharded and len(resharded) < len(sharded):
        notes.append(f"the plan reshards after forward (ZeRO-3) on stage(s) {', '.join(map(str, resharded))} only; "
                     "torchtitan has one fsdp_reshard_after_forward: nearest is always (never more memory).")
    if resharded and plan.pp > 1:
        notes.append(
            "ZeRO-3 with pipeline stages: torch.distributed.pipelining keeps each stage's weights gathered after "
            "its backward and reduce-scatters its gradients once per step, not per micro-batch as the plan prices "
            "ZeRO-3, so a stage's weights and gradients are whole from its first backward to the step's end: more "
            "memory than predicted on those stages (fsdp_reshard_after_forward = always frees them after each "
            "forward only).")
    if not resharded and plan.pp == 1:
        notes.append(
            "weights kept gathered through the step: with pp = 1 torchtitan accumulates gradients by running "
            "FSDP's forward and backward per micro-batch, which reshards after each backward and reduce-scatters "
            "gradients per micro-batch (more traffic than the plan's once per step).")
    return {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
            "fsdp_reshard_after_forward": policy}


def _expert_parallel(plan: Plan, parallelism: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """expert_parallel_degree, and the data-parallel degrees torchtitan's mesh needs for it.

    torchtitan forms expert groups inside the sharded and tensor-parallel ranks only
    (``ParallelDims``: ``dp_shard x cp x tp = efsdp x ep``; replicas are outside), where
    ours are ``ep`` consecutive data-parallel replicas, sharded or not.  Where ``ep`` does
    not divide ``dp_shard x tp`` the nearest torchtitan layout shards the dense parts over
    more replicas (never more memory, more traffic), said in a note.
    """
    if plan.ep == 1:
        return {}
    out: dict[str, Any] = {"expert_parallel_degree": plan.ep}
    replicate = int(parallelism["data_parallel_replicate_degree"])
    shard = int(parallelism["data_parallel_shard_degree"])
    need = plan.ep // math.gcd(plan.ep, shard * plan.tp)
    if need > 1:
        out |= {"data_parallel_replicate_degree": replicate // need, "data_parallel_shard_degree": shard * need}
        if shard == 1:
            out["fsdp_reshard_after_forward"] = "never"
        notes.append(
            f"ep {plan.ep} over {replicate} replicated x {shard} sharded data-parallel ranks: torchtitan forms expert "
            f"groups from sharded and tensor-parallel ranks only (dp_shard x tp = efsdp x ep); nearest is "
            f"data_parallel_shard_degree {shard * need} (the dense parts sharded over {need}x more ranks: never more "
            "memory, more traffic than the plan's).")
    return out


def _checkpointing(plan: Plan, notes: list[str]) -> str:
    """torchtitan's activation checkpointing mode, the nearest that never keeps more than the plan does."""
    modes = {stage.recompute for stage in plan.stages}
    if modes == {"none"}:
        return "none"
    if modes == {"full"}:
        return "full"
    whole, cheap, kept = recompute_summary(plan.stages)
    listed = "; ".join(f"{what}: stage{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}" for what, ids in
                       (("whole layers", whole), ("cheap ops only", cheap), ("nothing", kept)) if ids)
    if not whole:
        notes.append(
            f"the plan recomputes only cheap ops (keeping matmul and attention outputs) on some layers ({listed}; "
            "the first recompute_ops_layers of each); torchtitan's selective mode applies its per-op policy to "
            "every layer and also recomputes every second matmul: nearest is selective (never more memory, more "
            "recomputation).")
        return "selective"
    partial = [str(s.index) for s in plan.stages if s.recompute == "selective"]
    notes.append(
        f"the plan's recomputation differs by stage ({listed}"
        + (f"; stage{'s' if len(partial) > 1 else ''} {', '.join(partial)} only some of their layers" if partial
           else "")
        + "); torchtitan's activation checkpointing is one mode for every layer: nearest is full everywhere (fits "
        "where the plan fits, at the cost of recomputing the rest too).")
    return "full"


def _stages_with(stages: Sequence[StagePlan], field: str, value: str) -> str:
    chosen = [str(s.index) for s in stages if getattr(s, field) == value]
    return f"stage{'s' if len(chosen) > 1 else ''} {', '.join(chosen)}"


def _header(plan: Plan, out: TorchtitanExport, *, source: str, style: str) -> tuple[str, ...]:
    shape = f"pp {plan.pp} x dp {plan.dp}" + (f" x tp {plan.tp}" if plan.tp > 1 else "") \
        + (f", {plan.chunks} stages per rank" if plan.chunks > 1 else "")
    length = seq_len(plan)
    where = f"{out.nodes} nodes of {out.gpus_per_node} GPUs" if out.nodes > 1 else plural(plan.gpus, "GPU")
    lines = [
        (f"torchtitan settings for the autopartition plan{' in ' + source if source else ''}: "
         f"{plan.model.class_name} ({format_count(plan.model.parameters)} parameters),"),
        (f"{where} ({shape}), schedule {plan.schedule}, "
         f"{plural(plan.microbatches, 'micro-batch', 'micro-batches')} of {plan.microbatch_size}"
         + (f", sequence {length}." if length is not None else ".")),
        f"Written by `autopartition export --to torchtitan` for torchtitan 0.3 (checked against {TORCHTITAN_VERSION}).",
        "Module names: " + ("torchtitan's Llama 3, mapped from Hugging Face Llama names."
                            if style == "torchtitan-llama" else "the model's own."),
    ]
    if "fsdp_reshard_after_forward" in out.sections["parallelism"]:
        lines.append("fsdp_reshard_after_forward is explicit: torchtitan's default reshards only without pipeline "
                     "parallelism.")
    lines += [
        "",
        "torchtitan 0.3 reads no TOML: run this on every node (add your rendezvous options); the sections below",
        "hold the same settings:",
        *shell_lines(out.command, launcher=_launcher_words(out.command),
                     starts_option=lambda word: word.startswith("--") or ":" in word),
    ]
    return tuple(lines)


def _launcher_words(command: Sequence[str]) -> int:
    """How many words of ``command`` launch torchtitan (through ``-m torchtitan.train``); 0 where none do."""
    return command.index("torchtitan.train") + 1 if "torchtitan.train" in command else 0


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
