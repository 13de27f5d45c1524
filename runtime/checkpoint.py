"""Sharded training checkpoints in the original names, loadable under another plan.

:meth:`Pipeline.save_checkpoint <runtime.pipeline.Pipeline.save_checkpoint>`
and ``load_checkpoint`` call :func:`save_checkpoint` / :func:`load_checkpoint`
here.  Every rank writes its own stages' tensors through
torch.distributed.checkpoint (DCP), which keeps one copy of a tensor several
ranks hold (replicas, a tied weight's copies).  Nothing in the files depends on
the plan, so a pp=4 x dp=1 run resumes as pp=2 x dp=2, another split or
schedule: each rank reads the entries its new stages hold, and nothing else.

A checkpoint directory::

    DIR/.metadata        DCP's index: every entry's shape, dtype and where its bytes lie
    DIR/__R_0.distcp     the bytes rank R wrote (one file per rank that wrote any)
    DIR/plan.json        the plan of the run that saved it (``Plan.load(DIR)`` reads it)
    DIR/checkpoint.json  the step, the optimizer's hyperparameters; written last: no file, no checkpoint

DCP entries (names are the original model's; a tied parameter once, under its
canonical name, the first in ``model.named_parameters()``):

* ``model.<name>``: each parameter and persistent buffer;
* ``optim.state.<name>.<key>``: each tensor of the optimizer's per-parameter
  state (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``; SGD: ``momentum_buffer``).

``checkpoint.json`` (JSON, format ``autopartition-checkpoint`` version 1):
``step``, ``model`` (class name), ``saved_by`` (pp, dp, chunks, schedule, gpus),
``tied`` (the alias groups), and ``optimizer``: null, or ``class``, ``groups``
(each distinct param group's hyperparameters, ``params`` left out) and
``group_of`` (parameter name -> index into ``groups``).  On load a param group
takes the hyperparameters its parameters were saved with (lr, betas, ...), as
``torch.optim.Optimizer.load_state_dict`` does.

Every rank reads the small files and its own entries, so the directory must be
on a file system all ranks see (as DCP itself needs).  DCP's ``.metadata`` is a
pickle: resume only from checkpoints you trust.

torch's ``torch.distributed.checkpoint.state_dict.get_state_dict`` wants one
module per optimizer; a rank here may hold several stage modules, two of them
copies of one tied weight, so the optimizer state is flattened here instead.

Example (in every rank)::

    pipe.save_checkpoint("ckpt/", optimizer=opt, step=step)
    ...
    step = pipe.load_checkpoint("ckpt/", optimizer=opt)   # under any plan of the same model
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.plan import Plan, TiedParameter
from runtime.weights import DCP_METADATA, MODEL_PREFIX, CheckpointError, fill_module, read_dcp

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CheckpointInfo",
    "canonical_names",
    "load_checkpoint",
    "read_checkpoint_info",
    "save_checkpoint",
]

FORMAT = "autopartition-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
PLAN_FILE = "plan.json"
OPTIM_PREFIX = "optim.state."


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory holds, read from its small files only."""

    path: Path
    step: int
    model_class: str
    optimizer: dict[str, Any] | None  # {"class", "groups", "group_of"}; None: saved without one
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]  # DCP key -> (shape, dtype)

    def model_entries(self) -> dict[str, tuple[int, ...]]:
        """Model entry name -> shape."""
        n = len(MODEL_PREFIX)
        return {k[n:]: shape for k, (shape, _) in self.tensors.items() if k.startswith(MODEL_PREFIX)}


def canonical_names(tied: Iterable[TiedParameter]) -> dict[str, str]:
    """Each alias of a tied parameter -> its canonical name (the name a checkpoint stores).

    >>> canonical_names([TiedParameter("wte.weight", ("lm_head.weight", "wte.weight"), (0, 3))])
    {'lm_head.weight': 'wte.weight', 'wte.weight': 'wte.weight'}
    """
    return {alias: t.name for t in tied for alias in t.aliases}


def read_checkpoint_info(directory: str | os.PathLike[str]) -> CheckpointInfo:
    """Read ``checkpoint.json`` and DCP's index; a clear error when ``directory`` is no checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"No checkpoint at {path}: it is not a directory. Pass the directory "
                              "save_checkpoint wrote.")
    manifest = path / MANIFEST
    if not manifest.is_file():
        what = (
            f"a torch.distributed.checkpoint without {MANIFEST} (not written by save_checkpoint, or "
            "its save did not finish); to take only its weights, use Pipeline(..., weights=DIR)"
            if (path / DCP_METADATA).is_file()
            else "not a checkpoint"
        )
        raise CheckpointError(f"{path} is {what}. Resume from a directory Pipeline.save_checkpoint wrote.")
    try:
        data = json.loads(manifest.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"its format is {data.get('format') if isinstance(data, dict) else data!r}")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('format_version')!r}, this autopartition reads "
                             f"{FORMAT_VERSION}")
        step, model_class, optimizer = int(data["step"]), str(data["model"]), data["optimizer"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is not an autopartition checkpoint manifest ({exc}).") from exc
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{path / DCP_METADATA} cannot be read ({exc}); the checkpoint is incomplete.") from exc
    tensors = {
        k: (tuple(v.size), v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    return CheckpointInfo(path=path, step=step, model_class=model_class, optimizer=optimizer, tensors=tensors)


# ------------------------------------------------------------------- save


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    modules: Sequence[nn.Module],
    plan: Plan,
    keys: Collection[str],
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
) -> Path:
    """Every rank writes its stages' entries (collective); rank 0 writes plan.json and checkpoint.json.

    ``modules``: this rank's stage modules; ``keys``: the whole model's
    state-dict keys (which entries are persistent).  Returns the directory.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(directory)
    rank = dist.get_rank()
    canon = canonical_names(plan.tied)
    flat: dict[str, torch.Tensor] = {}
    hyper: dict[str, dict[str, Any]] = {}
    failure: Exception | None = None
    try:
        for name, items in _local_entries(modules, keys=keys, canon=canon).items():
            flat[MODEL_PREFIX + name] = items[0][2].detach()
        if optimizer is not None:
            state, hyper = _optimizer_entries(optimizer, _parameter_names(modules, canon))
            flat.update(state)
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / MANIFEST).unlink(missing_ok=True)  # until the new one is written, no checkpoint here
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised
        failure = exc
    _agree(failure, "save the checkpoint")
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(path)))
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(hyper, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        (path / PLAN_FILE).write_text(plan.to_json() + "\n")
        manifest = _manifest(plan, step, None if optimizer is None else (type(optimizer).__name__, gathered))
        temporary = path / (MANIFEST + ".tmp")
        temporary.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(temporary, path / MANIFEST)
    dist.barrier()
    return path


def _manifest(plan: Plan, step: int, optimizer: tuple[str, list[dict[str, dict[str, Any]]]] | None) -> dict[str, Any]:
    saved: dict[str, Any] | None = None
    if optimizer is not None:
        kind, per_rank = optimizer
        groups: list[dict[str, Any]] = []
        group_of: dict[str, int] = {}
        for part in per_rank:
            for name, hyperparameters in sorted(part.items()):
                if name in group_of:
                    continue  # a replica's or tied copy's record: the same
                if hyperparameters not in groups:
                    groups.append(hyperparameters)
                group_of[name] = groups.index(hyperparameters)
        saved = {"class": kind, "groups": groups, "group_of": dict(sorted(group_of.items()))}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "model": plan.model.class_name,
        "saved_by": {"pp": plan.pp, "dp": plan.dp, "chunks": plan.chunks, "schedule": plan.schedule,
                     "gpus": plan.gpus},
        "tied": [sorted(t.aliases) for t in plan.tied],
        "optimizer": saved,
    }


def _optimizer_entries(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(``optim.state.<name>.<key>`` -> tensor, name -> its group's hyperparameters as JSON values)."""
    state: dict[str, torch.Tensor] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        settings = {k: _jsonable(v, k) for k, v in sorted(group.items()) if k not in ("params", "param_names")}
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise CheckpointError(_foreign_parameter(param))
            if name in hyper:
                continue  # the other copy of a tied weight on this rank: equal state
            hyper[name] = settings
            for key, value in optimizer.state.get(param, {}).items():
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor) or "." in str(key):
                    raise CheckpointError(
                        f"The optimizer's state {key!r} of {name} is a {type(value).__name__}; a checkpoint "
                        "stores per-parameter tensors only (Adam, AdamW, SGD, Adagrad, RMSprop keep those)."
                    )
                state[f"{OPTIM_PREFIX}{name}.{key}"] = value.detach()
    return state, hyper


def _jsonable(value: Any, key: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, key) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"The optimizer's hyperparameter {key}={value!r} is a {type(value).__name__}; a checkpoint stores "
        "numbers, strings, booleans and lists of them."
    )


# ------------------------------------------------------------------- load


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    modules: Sequence[nn.Module],
    plan: Plan,
    keys: Collection[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> int:
    """Fill this rank's stages (and ``optimizer``) from a checkpoint; returns its step.

    Collective only to agree: any rank's problem (another model, no optimizer
    state) raises on every rank before anything is read.
    """
    canon = canonical_names(plan.tied)
    failure: Exception | None = None
    info: CheckpointInfo | None = None
    entries: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    names: dict[int, str] = {}
    try:
        info = read_checkpoint_info(directory)
        entries = _local_entries(modules, keys=keys, canon=canon)
        _check_model(info, entries, keys=keys, canon=canon)
        names = _parameter_names(modules, canon)
        if optimizer is not None:
            _check_optimizer(info, optimizer, names)
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised
        failure = exc
    _agree(failure, "load the checkpoint")
    assert info is not None  # _agree raised otherwise
    try:
        targets: dict[str, torch.Tensor] = {}
        for name, items in entries.items():
            real = next((t for _, _, t in items if not t.is_meta), None)
            shape, _ = info.tensors[MODEL_PREFIX + name]
            targets[MODEL_PREFIX + name] = real.detach() if real is not None else torch.empty(
                shape, dtype=items[0][2].dtype)
        optim_keys = [k for k in info.tensors if k.startswith(OPTIM_PREFIX)] if optimizer is not None else []
        wanted_names = set(names.values())
        for key in optim_keys:
            if key[len(OPTIM_PREFIX):].rpartition(".")[0] in wanted_names:
                shape, dtype = info.tensors[key]
                targets[key] = torch.empty(shape, dtype=dtype)
        read_dcp(info.path, targets)
        _apply_model(modules, entries, targets)
        if optimizer is not None:
            optimizer.load_state_dict(_torch_optimizer_state(info, optimizer, names, targets))
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised
        failure = exc
    _agree(failure, "load the checkpoint")
    return info.step


def _check_model(
    info: CheckpointInfo,
    entries: dict[str, list[tuple[int, str, torch.Tensor]]],
    *,
    keys: Collection[str],
    canon: dict[str, str],
) -> None:
    """The checkpoint holds this model: every name it holds is the model's, every entry here fits."""
    stored = info.model_entries()
    known = {canon.get(k, k) for k in keys}
    unexpected = sorted(k for k in stored if canon.get(k, k) not in known)
    missing = sorted(name for name in entries if name not in stored)
    misshapen = [
        f"{name} {_shape(stored[name])} there, {_shape(items[0][2].shape)} here"
        for name, items in sorted(entries.items())
        if name in stored and tuple(stored[name]) != tuple(items[0][2].shape)
    ]
    if not (unexpected or missing or misshapen):
        return
    parts = []
    if unexpected:
        parts.append(f"it holds {len(unexpected)} entries this model lacks ({_few(unexpected)})")
    if missing:
        parts.append(f"it lacks {len(missing)} this rank's stages need ({_few(missing)})")
    if misshapen:
        parts.append(f"{len(misshapen)} differ in shape ({_few(misshapen)})")
    raise CheckpointError(
        f"The checkpoint {info.path} is of another model (a {info.model_class}): {'; '.join(parts)}. "
        "Resume with the model that saved it."
    )


def _check_optimizer(info: CheckpointInfo, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    saved = info.optimizer
    if saved is None:
        raise CheckpointError(
            f"The checkpoint {info.path} holds no optimizer state (it was saved without optimizer=). "
            "Load it with optimizer=None to take the model only (the optimizer then starts afresh), or "
            "resume from a checkpoint saved with the optimizer."
        )
    kind = type(optimizer).__name__
    if saved.get("class") != kind:
        raise CheckpointError(
            f"The checkpoint {info.path} holds {saved.get('class')} state, but the optimizer is a {kind}. "
            f"Resume with a {saved.get('class')}, or load with optimizer=None."
        )
    group_of = saved.get("group_of", {})
    for group in optimizer.param_groups:
        params = [names.get(id(p)) for p in group["params"]]
        foreign = [p for p, n in zip(group["params"], params) if n is None]
        if foreign:
            raise CheckpointError(_foreign_parameter(foreign[0]))
        absent = [n for n in params if n not in group_of]
        if absent:
            raise CheckpointError(
                f"The checkpoint {info.path} has no optimizer state for {len(absent)} parameters this "
                f"optimizer holds ({_few(sorted(set(map(str, absent))))}): they were not in the optimizer "
                "that saved it. Build the optimizer over the same parameters, or load with optimizer=None."
            )
        kinds = {group_of[n] for n in params}
        if len({json.dumps(saved["groups"][i], sort_keys=True) for i in kinds}) > 1:
            raise CheckpointError(
                f"Parameters {_few(sorted(map(str, params)))} share one param group now but had different "
                "hyperparameters when saved. Build the param groups as the run that saved it did."
            )


def _torch_optimizer_state(
    info: CheckpointInfo,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    targets: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """The checkpoint's optimizer state in ``optimizer.state_dict()``'s own layout (parameter indices)."""
    assert info.optimizer is not None  # _check_optimizer
    groups_saved, group_of = info.optimizer["groups"], info.optimizer["group_of"]
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in targets.items():
        if key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX):].rpartition(".")
            by_name.setdefault(name, {})[state_key] = value
    state: dict[int, dict[str, torch.Tensor]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in optimizer.param_groups:
        ids = []
        for param in group["params"]:
            # A copy per parameter: two copies of a tied weight must not share one exp_avg.
            saved_state = by_name.get(names[id(param)], {})
            if saved_state:
                state[index] = {k: v.clone() for k, v in saved_state.items()}
            ids.append(index)
            index += 1
        settings = groups_saved[group_of[names[id(group["params"][0])]]] if group["params"] else {}
        merged = {k: v for k, v in group.items() if k != "params"}
        merged.update({k: _restore(v, group.get(k)) for k, v in settings.items()})
        merged["params"] = ids
        groups.append(merged)
    return {"state": state, "param_groups": groups}


def _restore(value: Any, current: Any) -> Any:
    """A JSON hyperparameter in the type the optimizer holds now (tuple betas, tensor lr)."""
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(current, torch.Tensor):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    return value


def _apply_model(
    modules: Sequence[nn.Module],
    entries: dict[str, list[tuple[int, str, torch.Tensor]]],
    targets: dict[str, torch.Tensor],
) -> None:
    """Copy each read entry into this rank's other copies; meta tensors are replaced."""
    meta: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, items in entries.items():
            value = targets[MODEL_PREFIX + name]
            for index, local, tensor in items:
                if tensor.is_meta:
                    meta.setdefault(index, {})[local] = value
                elif tensor.data_ptr() != value.data_ptr():
                    tensor.copy_(value)
        for index, values in meta.items():
            fill_module(modules[index], values)


# ---------------------------------------------------------------- helpers


def _local_entries(
    modules: Sequence[nn.Module], *, keys: Collection[str], canon: dict[str, str]
) -> dict[str, list[tuple[int, str, torch.Tensor]]]:
    """Canonical name -> every (module index, local name, tensor) holding it on this rank.

    Parameters and persistent buffers only (``keys``: the whole model's
    state-dict keys); one tensor object once.
    """
    out: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    seen: set[int] = set()
    for index, module in enumerate(modules):
        for local, tensor in module.state_dict(keep_vars=True).items():
            if (local not in keys and local not in canon) or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            out.setdefault(canon.get(local, local), []).append((index, local, tensor))
    return out


def _parameter_names(modules: Sequence[nn.Module], canon: dict[str, str]) -> dict[int, str]:
    """id(parameter) -> its canonical original name, over this rank's stage modules."""
    return {
        id(p): canon.get(n, n)
        for module in modules
        for n, p in module.named_parameters(remove_duplicate=False)
    }


def _foreign_parameter(param: torch.Tensor) -> str:
    return (
        f"The optimizer holds a parameter of shape {_shape(param.shape)} that is not one of this Pipeline's. "
        "Build it over pipe.parameters()."
    )


def _agree(failure: Exception | None, what: str) -> None:
    """Every rank learns whether any rank failed; all raise together (a lone raise would hang the others)."""
    notes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(notes, None if failure is None else str(failure))
    if failure is not None:
        raise failure
    failed = [(rank, note) for rank, note in enumerate(notes) if note is not None]
    if failed:
        rank, note = failed[0]
        raise CheckpointError(f"Rank {rank} cannot {what}: {note}")


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def _few(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
