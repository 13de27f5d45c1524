"""Sharded training checkpoints in the original names, loadable under another plan.

:meth:`Pipeline.save_checkpoint <runtime.pipeline.Pipeline.save_checkpoint>`
and ``load_checkpoint`` call :func:`save_checkpoint` / :func:`load_checkpoint`
here.  Every rank writes its own stages' tensors through
torch.distributed.checkpoint (DCP), which keeps one copy of a tensor several
ranks hold (replicas, a tied weight's copies).  Nothing in the files depends on
the plan, so a pp=4 x dp=1 run resumes as pp=2 x dp=2, another split or
schedule: each rank reads the entries its new stages hold, and nothing else.

A checkpoint directory holds one folder per saved step (torchtitan's layout; DCP's
own save overwrites in place, so a crash mid-save would leave no checkpoint)::

    DIR/step-N/.metadata        DCP's index: every entry's shape, dtype and where its bytes lie
    DIR/step-N/__R_0.distcp     the bytes rank R wrote (one file per rank that wrote any)
    DIR/step-N/plan.json        the plan of the run that saved it (``Plan.load(DIR/step-N)`` reads it)
    DIR/step-N/checkpoint.json  the manifest: step, optimizer hyperparameters, every file's size and CRC-32

A save is atomic: every rank writes its shards into ``DIR/.step-N.tmp-<id>``; once
all of them are written (DCP's own gather, then ours), rank 0 checksums the files
(the work split over the ranks), writes the manifest last and renames the folder to
``DIR/step-N`` (one ``rename``); then it removes all but the newest ``keep`` steps
and leftovers of unfinished saves.  A crash at any moment leaves the previous
steps as they were.  Loading ``DIR`` takes the newest ``step-N`` holding a
manifest (or pass ``DIR/step-N``); a directory with ``checkpoint.json`` directly
in it (the single-folder layout of earlier versions) loads as before.  Before a
rank reads a file it checks its size and CRC-32 against the manifest (zlib's
CRC-32: twice as fast as SHA-256 here and enough against truncation and bit rot;
this guards against accidents, not tampering, for which see the pickle below).

DCP entries (names are the original model's; a tied parameter once, under its
canonical name, the first in ``model.named_parameters()``; one read by several
stages under one name is written by each holding rank with equal values, and DCP
keeps one):

* ``model.<name>``: each parameter and persistent buffer;
* ``optim.state.<name>.<key>``: each tensor of the optimizer's per-parameter
  state (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``; SGD: ``momentum_buffer``).

``checkpoint.json`` (JSON, format ``autopartition-checkpoint`` version 2; version 1,
without ``files``, is still read): ``step`` (>= 0), ``model`` (class name),
``saved_by`` (pp, dp, chunks, schedule, gpus, tp), ``tied`` (the alias groups), and ``optimizer``: null, or ``class``, ``groups``
(each distinct param group's hyperparameters, ``params`` left out) and
``group_of`` (parameter name -> index into ``groups``), and ``files`` (file name ->
``{"bytes", "crc32"}``, every other file of the folder).  On load a param group
takes the hyperparameters its parameters were saved with (lr, betas, ...), as
``torch.optim.Optimizer.load_state_dict`` does.

Sharded replicas (:mod:`runtime.parallel.shard`): a fully sharded stage's parameters and Adam
state are ``DTensor`` shards, which DCP writes and reads as parts of the same whole
entries (a replica reads only its shard); under ZeRO-1 each replica writes the state
of the parameters it steps and the manifest names the wrapped optimizer's class, so a
checkpoint resumes under any other shard mode as well.

Expert parallelism (:mod:`runtime.parallel.experts`): entries hold every expert, in the original
names.  Listed experts are whole tensors on the member holding them; a stacked experts tensor's
slice (and its optimizer state) is written as a ``DTensor`` chunk over the EP group, and a load
reads the whole entry and keeps its member's experts, so a checkpoint resumes under any ``ep``.

Every rank reads the small files and its own entries, so the directory must be
on a file system all ranks see (as DCP itself needs).  DCP's ``.metadata`` is a
pickle: resume only from checkpoints you trust.

torch's ``torch.distributed.checkpoint.state_dict.get_state_dict`` wants one
module per optimizer; a rank here may hold several stage modules, two of them
copies of one tied weight, so the optimizer state is flattened here instead.

Example (in every rank)::

    pipe.save_checkpoint("ckpt/", optimizer=opt, step=step)   # ckpt/step-<step>, keeps the newest 2
    ...
    step = pipe.load_checkpoint("ckpt/", optimizer=opt)   # the newest step, under any plan of the model
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from partitioner.plan import Plan, TiedParameter
from runtime.state.folders import (
    DCP_METADATA,
    FORMAT,
    FORMAT_VERSION,
    LEFTOVER_FOLDER,
    MANIFEST,
    PLAN_FILE,
    REPLACED_FOLDER,
    STEP_FOLDER,
    complete_steps,
    damage_advice,
    find_checkpoint,
    folder_step,
    read_manifest,
)
from runtime.state.weights import (
    MODEL_PREFIX,
    CheckpointError,
    Storage,
    check_files,
    check_reads,
    dcp_storage,
    file_crc32,
    fill_module,
    read_dcp,
)

__all__ = [
    "DEFAULT_KEEP",
    "CheckpointError",
    "CheckpointInfo",
    "ExpertSlices",
    "canonical_names",
    "check_save_directory",
    "load_checkpoint",
    "read_checkpoint_info",
    "save_checkpoint",
]

OPTIM_PREFIX = "optim.state."


class ExpertSlices(Protocol):
    """Expert parallelism's view for checkpoints (:class:`runtime.parallel.experts.ExpertsLayer`)."""

    def for_checkpoint(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's values in original names, each stacked expert slice its chunk of the whole (no collective)."""
        ...

    def stacked_spans(self) -> dict[str, tuple[int, int, int]]:
        """Stacked expert parameter -> (first, end, experts) of dim 0 this rank holds."""
        ...


# The newest steps a save keeps: the one just written and the one before it, in case the newest is
# damaged later (a disk, a copy); twice a checkpoint's room on disk.
DEFAULT_KEEP = 2
# Tests stop a save at these points (tests/models/crash_workers.py): called with the point's name.
_fault_hook: Callable[[str], None] | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory holds, read from its small files only."""

    path: Path
    step: int
    model_class: str
    optimizer: dict[str, Any] | None  # {"class", "groups", "group_of"}; None: saved without one
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]  # DCP key -> (shape, dtype)
    files: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # name -> {bytes, crc32}; {}: v1
    storage: Storage = dataclasses.field(default_factory=dict)  # DCP key -> [(file, offset, length)]

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
    """Find the folder to load (:func:`find_checkpoint`), read its manifest and DCP's index.

    Every file the manifest lists must be there with its size, and DCP's index
    must match its CRC-32 (it is unpickled); else an error naming the file.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = find_checkpoint(directory)
    data = read_manifest(path)
    check_files(path, data["files"], checksum=(DCP_METADATA,), fix=damage_advice(path, int(data["step"])))
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{path / DCP_METADATA} cannot be read ({type(exc).__name__}: {exc}); the "
                              f"checkpoint is incomplete or corrupt. {damage_advice(path, int(data['step']))}") from exc
    tensors = {
        k: (tuple(v.size), v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    return CheckpointInfo(path=path, step=int(data["step"]), model_class=data["model"], optimizer=data["optimizer"],
                          tensors=tensors, files=data["files"], storage=dcp_storage(metadata))


def check_save_directory(directory: str | os.PathLike[str]) -> Path:
    """Refuse a directory a checkpoint cannot be saved into, before any training: call it up front.

    Not a directory, not writable (nor creatable), a plan directory (``plan.json``
    without a manifest), or one step folder of a checkpoint.  Creates nothing.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"Cannot save a checkpoint into {path}: it is a file. Pass a directory.")
    if path.is_dir():
        if (path / PLAN_FILE).is_file() and (path / DCP_METADATA).is_file() and not (path / MANIFEST).is_file():
            raise CheckpointError(
                f"{path} holds a checkpoint whose save did not finish (an earlier version saved in place): its "
                "files may mix two steps. Save into a new directory; move or delete this one first if you "
                "want the name."
            )
        if (path / PLAN_FILE).is_file() and not (path / MANIFEST).is_file():
            stages = sorted(p.name for p in path.glob("stage_*.py"))
            raise CheckpointError(
                f"{path} is a plan directory (it holds {PLAN_FILE}{' and ' + stages[0] if stages else ''}): "
                "a checkpoint saved there would sit among the plan's files. Save into a directory of its own, "
                f"e.g. {path.parent / 'ckpt'}."
            )
        if STEP_FOLDER.fullmatch(path.name) and (path / MANIFEST).is_file():
            raise CheckpointError(f"{path} is one step of a checkpoint. Save into its parent, {path.parent}: each "
                                  "step goes into a step-N folder there.")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise CheckpointError(f"Cannot save a checkpoint into {path}: {existing} is a file, not a directory.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise CheckpointError(f"Cannot save a checkpoint into {path}: {existing} is not writable ({exc.strerror}). "
                              "Pass a directory this job may write.") from exc
    return path


# ------------------------------------------------------------------- save


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    modules: Sequence[nn.Module],
    plan: Plan,
    keys: Collection[str],
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    keep: int | None = DEFAULT_KEEP,
    experts: ExpertSlices | None = None,
) -> Path:
    """Every rank writes its stages' entries into ``directory/step-<step>``, atomically (collective).

    ``modules``: this rank's stage modules; ``keys``: the whole model's
    state-dict keys (which entries are persistent); ``keep``: how many of the
    newest steps to keep (None: all); ``experts``: under expert parallelism, the
    experts layers (each member writes its slices and their optimizer state as chunks
    of the whole entries, so that any ``ep`` resumes).  Returns the step's folder.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    canon = canonical_names(plan.tied)
    flat: dict[str, torch.Tensor] = {}
    hyper: dict[str, dict[str, Any]] = {}
    failure: BaseException | None = None
    temporary = ""
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step={step!r}: pass the number of steps trained, an integer >= 0.")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise CheckpointError(f"keep={keep!r}: pass how many of the newest steps to keep (>= 1), or None for all.")
        model = {name: items[0][2].detach() for name, items in _local_entries(modules, keys=keys, canon=canon).items()}
        flat.update({MODEL_PREFIX + name: value for name, value in model.items()})
        if optimizer is not None:
            state, hyper = _optimizer_entries(optimizer, _parameter_names(modules, canon))
            flat.update(state)
        if rank == 0:
            check_save_directory(path)
            path.mkdir(parents=True, exist_ok=True)
            temporary = f".step-{step}.tmp-{uuid.uuid4().hex[:12]}"
            (path / temporary).mkdir()
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised
        failure = exc
    temporary = _agree(failure, "save the checkpoint", temporary)[0]
    if experts is not None:  # each stacked expert slice written as its chunk of the whole tensor
        flat = _expert_chunks(flat, experts)
    folder = path / temporary
    _at("shards")
    try:
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(folder)))  # fsyncs every file it writes
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        failure = CheckpointError(f"Writing the shards into {folder} failed: {type(exc).__name__}: {exc}")
    _agree(failure, "save the checkpoint")
    # Every rank's shards are written (DCP gathered their results before writing .metadata); the files'
    # checksums, the work split over the ranks, reach rank 0 with the optimizer's hyperparameters.
    names: list[str] = []
    try:
        if rank == 0:  # the files DCP's index places tensors in, and the index
            names = sorted({f for pieces in dcp_storage(_metadata(folder)).values() for f, _, _ in pieces})
            names.append(DCP_METADATA)
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised
        failure = CheckpointError(f"Cannot read back {folder / DCP_METADATA}, just written: {exc}")
    names = _agree(failure, "save the checkpoint", names)[0]
    records: dict[str, dict[str, Any]] = {}
    try:
        for name in names[rank::world]:
            records[name] = {"bytes": (folder / name).stat().st_size, "crc32": file_crc32(folder / name)}
    except OSError as exc:
        failure = CheckpointError(f"Cannot read back {exc.filename}, just written: {exc.strerror}.")
    gathered = _agree(failure, "save the checkpoint", (hyper, records))
    final = path / f"step-{step}"
    try:
        if rank == 0:
            _at("plan")
            (folder / PLAN_FILE).write_text(plan.to_json() + "\n")
            files = {name: record for _, part in gathered for name, record in part.items()}
            files[PLAN_FILE] = {"bytes": (folder / PLAN_FILE).stat().st_size, "crc32": file_crc32(folder / PLAN_FILE)}
            per_rank = [h for h, _ in gathered]
            manifest = _manifest(plan, step, None if optimizer is None else (_optimizer_kind(optimizer), per_rank))
            manifest["files"] = dict(sorted(files.items()))
            _at("manifest")
            _write_synced(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            _sync_directory(folder)
            _at("rename")
            _publish(folder, final, temporary)
            _at("prune")
            _prune(path, keep=keep, current=temporary)
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised
        failure = exc
    _agree(failure, "save the checkpoint")
    return final


def _expert_chunks(flat: dict[str, torch.Tensor], experts: ExpertSlices) -> dict[str, torch.Tensor]:
    """``flat``'s model and optimizer entries with each stacked expert slice as its chunk of the whole tensor
    (DCP stores one whole entry under the original name; listed experts are whole tensors already)."""
    kinds: dict[str, dict[str, torch.Tensor]] = {"": {}}
    out: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if key.startswith(MODEL_PREFIX):
            kinds[""][key[len(MODEL_PREFIX):]] = value
        elif key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX):].rpartition(".")
            kinds.setdefault(state_key, {})[name] = value
        else:
            out[key] = value
    for state_key in sorted(kinds):
        prefix = MODEL_PREFIX if state_key == "" else OPTIM_PREFIX
        suffix = "" if state_key == "" else f".{state_key}"
        for name, value in experts.for_checkpoint(kinds[state_key]).items():
            out[f"{prefix}{name}{suffix}"] = value
    return out


def _at(point: str) -> None:
    if _fault_hook is not None:
        _fault_hook(point)


def _metadata(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata()


def _write_synced(path: Path, text: str) -> None:
    """``path`` holds ``text`` on disk, or keeps what it held: written beside, fsynced, renamed."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _sync_directory(path: Path) -> None:
    """Make renames and new names in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _publish(folder: Path, final: Path, token: str) -> None:
    """Rename the written ``folder`` to ``final``; a step saved again replaces the old one.

    The old one is first renamed aside (``.step-N.old-*``, still loadable), so that
    no moment leaves step N absent from the directory.
    """
    replaced = None
    if final.exists():
        replaced = final.with_name(token.replace(".tmp-", ".old-"))
        os.rename(final, replaced)
        _at("replace")
    os.rename(folder, final)
    _sync_directory(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _prune(path: Path, *, keep: int | None, current: str) -> None:
    """Keep the newest ``keep`` complete steps; remove what unfinished saves left (never this save's)."""
    for child in sorted(path.iterdir()):
        match = REPLACED_FOLDER.fullmatch(child.name)
        if match and not (path / f"step-{match[1]}").exists():
            os.rename(child, path / f"step-{match[1]}")  # a crash stopped its replacement: it is that step
    steps = complete_steps(path)
    doomed = list(steps.values())[:-keep] if keep is not None else []
    for folder in doomed:  # renamed first, so that a crash mid-removal leaves no half step-N behind
        aside = path / f".step-{folder_step(folder)}.del-{current.rpartition('-')[2]}"
        try:
            os.rename(folder, aside)
        except OSError as exc:  # the new step is saved: an old one left behind is no reason to fail
            warnings.warn(f"Cannot remove the old checkpoint step {folder}: {exc.strerror}.", stacklevel=3)
            continue
        _at("delete")
        shutil.rmtree(aside, ignore_errors=True)
    for child in sorted(path.iterdir()):
        if LEFTOVER_FOLDER.fullmatch(child.name) and child.name != current:
            shutil.rmtree(child, ignore_errors=True)


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
                     "gpus": plan.gpus, "tp": plan.tp, "ep": plan.ep},
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
            for key, value in _optimizer_state(optimizer).get(param, {}).items():
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
    experts: ExpertSlices | None = None,
) -> int:
    """Fill this rank's stages (and ``optimizer``) from a checkpoint; returns its step.

    ``directory``: a directory of steps (the newest complete one loads), one
    ``step-N`` folder, or a single-folder checkpoint of earlier versions.
    Collective only to agree: any rank's problem (another model, no optimizer
    state, a missing, truncated or corrupt file) raises on every rank before
    anything is read.  ``experts``: under expert parallelism, the experts layers: a
    stacked expert parameter (and its optimizer state) is read whole and this member's
    experts kept; listed experts are whole tensors of their own names already.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    canon = canonical_names(plan.tied)
    failure: BaseException | None = None
    info: CheckpointInfo | None = None
    entries: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    names: dict[int, str] = {}
    spans = {} if experts is None else experts.stacked_spans()
    try:
        info = read_checkpoint_info(directory)
        entries = _local_entries(modules, keys=keys, canon=canon)
        _check_model(info, entries, keys=keys, canon=canon, spans=spans)
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
            if name in spans:  # read whole, this member's experts kept below
                real = None
            targets[MODEL_PREFIX + name] = real.detach() if real is not None else torch.empty(
                shape, dtype=items[0][2].dtype)
        optim_keys = [k for k in info.tensors if k.startswith(OPTIM_PREFIX)] if optimizer is not None else []
        wanted_names = set(names.values())
        held = _held_parameters(modules, canon)
        for key in optim_keys:
            name = key[len(OPTIM_PREFIX):].rpartition(".")[0]
            if name in wanted_names:
                shape, dtype = info.tensors[key]
                # A fully sharded parameter's state is read as its shard (DCP reads only that part).
                targets[key] = _like_parameter(torch.empty(shape, dtype=dtype), held.get(name))
        # The files this rank reads: there, long enough, and (with a manifest) their CRC-32s match.
        check_reads(info.path, info.storage, targets, info.files, fix=damage_advice(info.path, info.step))
        read_dcp(info.path, targets)
        for key, value in list(targets.items()):
            name = key[len(MODEL_PREFIX):] if key.startswith(MODEL_PREFIX) else key[len(OPTIM_PREFIX):].rpartition(".")[0]
            span = spans.get(name)
            if span is not None and value.dim() >= 1 and value.shape[0] == span[2]:
                targets[key] = value[span[0]:span[1]].clone()
        _apply_model(modules, entries, targets)
        if optimizer is not None:
            optimizer.load_state_dict(_torch_optimizer_state(info, optimizer, names, targets))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - shared with every rank, then raised
        failure = exc
    _agree(failure, "load the checkpoint")
    return info.step


def _check_model(
    info: CheckpointInfo,
    entries: dict[str, list[tuple[int, str, torch.Tensor]]],
    *,
    keys: Collection[str],
    canon: dict[str, str],
    spans: dict[str, tuple[int, int, int]] | None = None,
) -> None:
    """The checkpoint holds this model: every name it holds is the model's, every entry here fits.

    ``spans``: stacked expert slices this rank holds, stored whole (``experts`` on dim 0).
    """
    stored = info.model_entries()
    known = {canon.get(k, k) for k in keys}
    unexpected = sorted(k for k in stored if canon.get(k, k) not in known)
    missing = sorted(name for name in entries if name not in stored)
    spans = spans or {}

    def whole(name: str, shape: Sequence[int]) -> tuple[int, ...]:
        span = spans.get(name)
        return tuple(shape) if span is None or not shape else (span[2], *shape[1:])

    misshapen = [
        f"{name} {_shape(stored[name])} there, {_shape(whole(name, items[0][2].shape))} here"
        for name, items in sorted(entries.items())
        if name in stored and tuple(stored[name]) != whole(name, items[0][2].shape)
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
    kind = _optimizer_kind(optimizer)
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


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class; ZeRO-1's ``ZeroRedundancyOptimizer`` by the class it wraps (its state is that one's)."""
    parts = getattr(optimizer, "parts", None)  # expert parallelism under ZeRO-1 (ExpertSplitOptimizer)
    if parts is not None:
        return _optimizer_kind(parts[1])
    inner = getattr(optimizer, "optim", None)
    return type(inner if _is_zero(optimizer) else optimizer).__name__


def _optimizer_state(optimizer: torch.optim.Optimizer) -> Any:
    """Per-parameter state; under ZeRO-1 this replica's share (the replicas' shares make the whole, DCP
    writing each key once)."""
    parts = getattr(optimizer, "parts", None)  # expert parallelism under ZeRO-1: the dense share, the experts
    if parts is not None:
        return {p: state for part in parts for p, state in _optimizer_state(part).items()}
    return optimizer.optim.state if _is_zero(optimizer) else optimizer.state  # type: ignore[attr-defined]


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    # Not imported here: torch.distributed.optim warns on import; an instance means it is loaded already.
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def _held_parameters(modules: Sequence[nn.Module], canon: dict[str, str]) -> dict[str, torch.Tensor]:
    """Canonical name -> this rank's parameter."""
    return {canon.get(n, n): p for module in modules for n, p in module.named_parameters(remove_duplicate=False)}


def _like_parameter(value: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """``value`` laid out as ``param``: this rank's shard where the parameter is a same-shaped ``DTensor``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor) and tuple(param.shape) == tuple(value.shape):
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


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


def _agree(failure: BaseException | None, what: str, payload: Any = None) -> list[Any]:
    """Every rank learns whether any rank failed; all raise together (a lone raise would hang the others).

    Returns every rank's ``payload`` when none failed.
    """
    notes: list[Any] = [None] * dist.get_world_size()
    note = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(notes, (note, payload))
    if failure is not None:
        if isinstance(failure, Exception):
            raise failure
        raise CheckpointError(f"Cannot {what}: {note}") from failure  # DCP's CheckpointException
    failed = [(rank, n) for rank, (n, _) in enumerate(notes) if n is not None]
    if failed:
        rank, note = failed[0]
        raise CheckpointError(f"Rank {rank} cannot {what}: {note}")
    return [p for _, p in notes]


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def _few(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
