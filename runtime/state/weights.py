"""Weights from disk, per stage: each rank reads only the tensors its stages hold.

Two formats, told apart by what ``path`` is:

* Hugging Face safetensors: one file (``model.safetensors`` or any
  ``*.safetensors``), a directory holding ``model.safetensors``, or a sharded
  checkpoint (a directory with ``model.safetensors.index.json``, or that index
  file itself).  Tensors are read one by one with ``safetensors.safe_open``, so
  a file none of this rank's tensors live in is never opened.
* torch.distributed.checkpoint (DCP): a directory with a ``.metadata`` file, as
  ``dcp.save(model.state_dict(), checkpoint_id=DIR)`` writes, or a checkpoint of
  :meth:`runtime.pipeline.Pipeline.save_checkpoint` (its ``model.`` entries).
  Only the wanted keys are read, without collectives (each rank on its own).
  DCP's ``.metadata`` is a pickle: read only checkpoints you trust.  A directory
  of Pipeline checkpoints (``step-N`` folders) gives its newest complete step; a
  folder with a manifest (``checkpoint.json``) has every file's size checked and
  the files this rank reads checked against their CRC-32; an unfinished save (a
  ``.step-N.tmp-*`` folder, or ``plan.json`` without ``checkpoint.json``) is refused.

A truncated or garbage file, or a shard shorter than the entries it should hold,
is an error naming the file (never torch's or safetensors' own exception alone).

Names are the original model's.  A tied parameter is found under any of its
names (Hugging Face drops ``lm_head.weight`` when it is ``wte.weight``); one read
by several stages under one name is loaded into each of them, equal.  A
tensor stored in another floating dtype is cast to the wanted one (a bf16 file
into an fp32 model); a missing or misshapen tensor is an error naming it.

A model built on the meta device takes its weights through
:func:`weights_supply` (the ``supply`` of :mod:`runtime.state.materialise`), or
:func:`load_weights`, which replaces meta tensors by the loaded ones.

``autopartition run plan/ --weights PATH -- train.py`` passes PATH to the
ranks in the environment variable ``AUTOPARTITION_WEIGHTS`` (:data:`WEIGHTS_ENV`);
``Pipeline(plan, model, loss_fn)`` reads it when ``weights=`` is not given.

Example::

    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> path = tempfile.mkdtemp() + "/model.safetensors"
    >>> save_file({"wte.weight": torch.ones(4, 2), "ln.bias": torch.zeros(2)}, path)
    >>> got = read_stage_weights(path, {"lm_head.weight": ((4, 2), torch.float32)},
    ...                          aliases={"lm_head.weight": ("wte.weight",)})
    >>> got["lm_head.weight"].shape
    torch.Size([4, 2])
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from partitioner.errors import CheckpointError
from partitioner.plan import TiedParameter
from runtime.state.folders import (
    DCP_METADATA,
    MANIFEST,
    PLAN_FILE,
    STEP_FOLDER,
    UNFINISHED_FOLDER,
    find_checkpoint,
    read_manifest_files,
)

__all__ = [
    "WEIGHTS_ENV",
    "CheckpointError",
    "WeightSpec",
    "alias_map",
    "check_files",
    "check_reads",
    "dcp_storage",
    "file_crc32",
    "fill_module",
    "load_weights",
    "read_dcp",
    "read_stage_weights",
    "wanted_entries",
    "weights_from_env",
    "weights_supply",
]

WEIGHTS_ENV = "AUTOPARTITION_WEIGHTS"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# A Pipeline checkpoint stores the model's tensors under this prefix (runtime.state.checkpoint).
MODEL_PREFIX = "model."
# Where a DCP entry's bytes lie: (file relative to the folder, offset, length) per stored piece.
Storage = dict[str, list[tuple[str, int, int]]]

# name -> (shape, dtype); dtype None keeps the stored dtype.
WeightSpec = tuple[Sequence[int], torch.dtype | None]


def weights_from_env(weights: str | os.PathLike[str] | None) -> str | os.PathLike[str] | None:
    """``weights`` itself, or else the path ``autopartition run --weights`` put into the environment.

    >>> weights_from_env("w.safetensors")
    'w.safetensors'
    """
    if weights is not None:
        return weights
    return os.environ.get(WEIGHTS_ENV) or None


def alias_map(tied: Iterable[TiedParameter]) -> dict[str, tuple[str, ...]]:
    """Every name of a tied parameter -> its other names (canonical first).

    >>> sorted(alias_map([TiedParameter("wte.weight", ("lm_head.weight", "wte.weight"), (0, 1))]).items())
    [('lm_head.weight', ('wte.weight',)), ('wte.weight', ('lm_head.weight',))]
    """
    out: dict[str, tuple[str, ...]] = {}
    for t in tied:
        names = (t.name, *sorted(set(t.aliases) - {t.name}))
        for name in names:
            out[name] = tuple(n for n in names if n != name)
    return out


def wanted_entries(
    modules: Sequence[nn.Module], *, keys: Collection[str], aliases: Mapping[str, Sequence[str]]
) -> dict[str, WeightSpec]:
    """The entries of ``modules`` a checkpoint holds: parameters and persistent buffers.

    ``keys``: the whole model's state-dict keys; a stage module's entry that is
    neither one of them nor a tied alias is a non-persistent buffer, which no
    checkpoint stores.
    """
    wanted: dict[str, WeightSpec] = {}
    for module in modules:
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name in keys or name in aliases:
                wanted[name] = (tuple(tensor.shape), tensor.dtype)
    return wanted


def read_stage_weights(
    path: str | os.PathLike[str],
    names: Mapping[str, WeightSpec],
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the tensors ``names`` (name -> (shape, dtype)) from a safetensors or DCP checkpoint.

    ``aliases``: name -> its other names (tied parameters, :func:`alias_map`); a
    name absent from the file is looked up under them.  Returns CPU tensors of
    the wanted dtypes (cast where the file holds another one), keyed by the
    wanted names.  Reads nothing when any tensor is missing or misshapen: the
    :class:`CheckpointError` names them and the file.
    """
    source = _open(Path(path))
    others = aliases or {}
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in names:
        key = next((k for k in source.candidates((name, *others.get(name, ()))) if source.has(k)), None)
        if key is None:
            missing.append(name)
        else:
            found[name] = key
    if missing:
        raise CheckpointError(_missing_message(source, missing, others))
    wrong = [
        f"{name} is {_shape(source.shape(key))} in {source.where(key)}, the model's is {_shape(names[name][0])}"
        for name, key in found.items()
        if tuple(source.shape(key)) != tuple(names[name][0])
    ]
    if wrong:
        raise CheckpointError(
            f"{len(wrong)} tensors in {source.describe} do not fit the model: {'; '.join(wrong[:5])}"
            f"{' ...' if len(wrong) > 5 else ''}. The weights are of another model (or another size of it): "
            "load weights saved from this model."
        )
    stored = source.read(sorted(set(found.values())))
    out: dict[str, torch.Tensor] = {}
    for name, key in found.items():
        dtype = names[name][1]
        tensor = stored[key]
        out[name] = tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
    return out


def load_weights(
    modules: Sequence[nn.Module],
    path: str | os.PathLike[str],
    *,
    keys: Collection[str],
    tied: Iterable[TiedParameter] = (),
) -> None:
    """Fill ``modules`` (this rank's stages) with the weights at ``path``.

    ``keys``: the whole model's state-dict keys (:func:`wanted_entries`).
    Real tensors are overwritten in place; a tensor on the meta device is
    replaced by the loaded one (parameters stay parameters, tied ones stay one).
    """
    aliases = alias_map(tied)
    values = read_stage_weights(path, wanted_entries(modules, keys=keys, aliases=aliases), aliases)
    with torch.no_grad():
        for module in modules:
            fill_module(module, values)


def weights_supply(
    path: str | os.PathLike[str], *, keys: Collection[str], tied: Iterable[TiedParameter] = ()
) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The weights at ``path`` as a ``supply`` for :mod:`runtime.state.materialise` (meta-built models).

    Given ``{name: meta tensor}``, returns the checkpoint's tensors for the
    persistent ones (``keys``: the whole model's state-dict keys; a tied one by
    any of its names); a non-persistent buffer (no checkpoint holds one) is left
    to initialisation.  A persistent tensor the file lacks is an error.
    """
    aliases = alias_map(tied)

    def supply(wanted: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = {n: (tuple(t.shape), t.dtype) for n, t in wanted.items() if n in keys or n in aliases}
        return read_stage_weights(path, names, aliases)

    return supply


# ----------------------------------------------------------------- filling


def fill_module(module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Put ``values`` (state-dict name -> tensor) into ``module``: copied into real tensors, in place;
    a meta tensor is replaced (a parameter by a parameter; a tensor several names share, once)."""
    replaced: dict[int, torch.Tensor] = {}  # meta tensor id -> its new tensor (ties stay one object)
    for name, tensor in module.state_dict(keep_vars=True).items():
        value = values.get(name)
        if value is None:
            continue
        if not tensor.is_meta:
            tensor.copy_(value)
            continue
        new = replaced.get(id(tensor))
        if new is None:
            data = value.clone()
            new = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
            replaced[id(tensor)] = new
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner)
        if leaf in sub._parameters:
            sub._parameters[leaf] = new  # type: ignore[assignment]
        else:
            sub._buffers[leaf] = new


# ----------------------------------------------------------------- sources


class _Source(Protocol):
    describe: str

    def candidates(self, names: Sequence[str]) -> list[str]: ...
    def has(self, key: str) -> bool: ...
    def keys(self) -> list[str]: ...
    def shape(self, key: str) -> Sequence[int]: ...
    def where(self, key: str) -> str: ...
    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]: ...


def _open(path: Path) -> _Source:
    """The checkpoint at ``path``, told apart by its files."""
    if not path.exists():
        raise CheckpointError(
            f"The weights path {path} does not exist. Pass a model.safetensors file, a directory holding "
            f"it (or {SAFETENSORS_INDEX}), or a torch.distributed.checkpoint directory."
        )
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _Safetensors.from_index(path)
        if path.suffix == ".safetensors":
            return _Safetensors.from_files([path])
        raise CheckpointError(
            f"{path} is neither a .safetensors file nor a safetensors index. Only safetensors and "
            "torch.distributed.checkpoint are read (no pickles): convert it, e.g. with "
            "safetensors.torch.save_file(torch.load(path), 'model.safetensors')."
        )
    if _pipeline_checkpoint(path):
        folder = find_checkpoint(path)
        return _Dcp(folder, files=read_manifest_files(folder))
    if (path / DCP_METADATA).is_file():
        return _Dcp(path)
    if (path / SAFETENSORS_INDEX).is_file():
        return _Safetensors.from_index(path / SAFETENSORS_INDEX)
    if (path / SAFETENSORS_FILE).is_file():
        return _Safetensors.from_files([path / SAFETENSORS_FILE])
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        return _Safetensors.from_files(files)
    found = f" (it has {len(files)} .safetensors files but no {SAFETENSORS_INDEX})" if files else ""
    raise CheckpointError(
        f"The directory {path} holds no weights autopartition reads{found}: expected {SAFETENSORS_FILE}, "
        f"{SAFETENSORS_INDEX} or a torch.distributed.checkpoint ({DCP_METADATA})."
    )


def _pipeline_checkpoint(path: Path) -> bool:
    """A folder Pipeline.save_checkpoint wrote, or a directory of its step folders, or an unfinished one."""
    if (path / MANIFEST).is_file() or UNFINISHED_FOLDER.fullmatch(path.name):
        return True
    if (path / DCP_METADATA).is_file():
        return (path / PLAN_FILE).is_file()  # plan.json without a manifest: a save that did not finish
    return any(STEP_FOLDER.fullmatch(p.name) or UNFINISHED_FOLDER.fullmatch(p.name) for p in path.iterdir())


def _safe_open(path: Path) -> Any:
    """``safetensors.safe_open`` of ``path``; a truncated or garbage file is an error naming it."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:
        raise CheckpointError(_unreadable_safetensors(path, exc)) from exc


def _unreadable_safetensors(path: Path, exc: BaseException) -> str:
    size = path.stat().st_size if path.is_file() else 0
    return (
        f"{path} is not a readable safetensors file ({size} bytes; {_first_line(exc)}): it is truncated "
        "(an interrupted download or copy) or not safetensors at all. Download or save it again."
    )


class _Safetensors:
    """One or several safetensors files; ``files`` maps each tensor name to the file holding it."""

    def __init__(self, files: dict[str, Path], describe: str) -> None:
        self.files = files
        self.describe = describe
        self._shapes: dict[str, Sequence[int]] = {}

    @staticmethod
    def from_files(paths: Sequence[Path]) -> _Safetensors:
        files: dict[str, Path] = {}
        for path in paths:
            with _safe_open(path) as f:  # reads the header only (and checks the file is as long as it says)
                for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    files[key] = path
        return _Safetensors(files, str(paths[0]) if len(paths) == 1 else f"{len(paths)} safetensors files")

    @staticmethod
    def from_index(index: Path) -> _Safetensors:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {str(k): index.parent / str(v) for k, v in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"{index} is not a safetensors index (a JSON object with a \"weight_map\" of tensor name -> "
                f"file): {exc}."
            ) from exc
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise CheckpointError(
                f"{index} names shard files that are not beside it: {', '.join(absent[:5])}. Download every shard."
            )
        return _Safetensors(files, str(index))

    def candidates(self, names: Sequence[str]) -> list[str]:
        return list(names)

    def has(self, key: str) -> bool:
        return key in self.files

    def keys(self) -> list[str]:
        return list(self.files)

    def where(self, key: str) -> str:
        return str(self.files[key])

    def shape(self, key: str) -> Sequence[int]:
        if key not in self._shapes:
            with _safe_open(self.files[key]) as f:
                try:
                    self._shapes[key] = f.get_slice(key).get_shape()
                except Exception as exc:
                    raise CheckpointError(f"{self.files[key]} does not hold {key}, though the index says so "
                                          f"({_first_line(exc)}). Download every shard again.") from exc
        return self._shapes[key]

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for path, names in by_file.items():
            with _safe_open(path) as f:
                for key in names:
                    try:
                        out[key] = f.get_tensor(key)
                    except Exception as exc:
                        raise CheckpointError(_unreadable_safetensors(path, exc)) from exc
        return out


class _Dcp:
    """A torch.distributed.checkpoint directory, read without collectives.

    ``files``: its manifest's file records (a Pipeline checkpoint), checked before reading.
    """

    def __init__(self, path: Path, *, files: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self.describe = f"the checkpoint {path}"
        self.files = files
        if files:
            check_files(path, files, checksum=(DCP_METADATA,), fix=_WEIGHTS_FIX)
        try:
            metadata = FileSystemReader(str(path)).read_metadata()
        except Exception as exc:
            raise CheckpointError(
                f"{path / DCP_METADATA} cannot be read as torch.distributed.checkpoint metadata "
                f"({_first_line(exc)}). The checkpoint is incomplete or corrupt."
            ) from exc
        self.tensors = {
            k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
        self.storage = dcp_storage(metadata)

    def candidates(self, names: Sequence[str]) -> list[str]:
        return [*names, *(MODEL_PREFIX + n for n in names)]

    def has(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def where(self, key: str) -> str:
        return str(self.path)

    def shape(self, key: str) -> Sequence[int]:
        return tuple(self.tensors[key].size)

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        check_reads(self.path, self.storage, keys, self.files, fix=_WEIGHTS_FIX)
        return read_dcp(self.path, {k: torch.empty(self.shape(k), dtype=self.tensors[k].properties.dtype)
                                    for k in keys})


_WEIGHTS_FIX = "Load the weights from another complete checkpoint (an earlier step-N folder), or save them again."


def read_dcp(path: Path, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill ``targets`` (key -> tensor of the stored shape) from the DCP directory ``path``, in place.

    No collectives: each rank reads its own keys, whatever the other ranks do.  DCP's
    failures (its ``CheckpointException`` is a BaseException; EOFError, unpickling
    errors) become a :class:`CheckpointError` naming ``path``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not targets:
        return targets
    try:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: that is the intent
            warnings.simplefilter("ignore")
            dcp.load(dict(targets), storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    except (Exception, CheckpointException) as exc:
        inner = list(exc.failures.values()) if isinstance(exc, CheckpointException) else []
        cause: BaseException = inner[0][0] if inner else exc  # failures: rank -> (exception, traceback)
        raise CheckpointError(
            f"The checkpoint {path} cannot be read: {type(cause).__name__}: {_first_line(cause)}. One of its "
            f"files ({', '.join(sorted(p.name for p in path.glob('*.distcp'))[:5]) or 'none'}) is corrupt or "
            "was written by another torch. Resume from another complete checkpoint (an earlier step-N folder)."
        ) from exc
    return targets


# ----------------------------------------------------------------- integrity


def file_crc32(path: Path) -> str:
    """The CRC-32 of the file at ``path`` (zlib's), as 8 hex digits; read in 16 MiB pieces."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def check_files(
    folder: Path, files: Mapping[str, Mapping[str, Any]], *, checksum: Iterable[str] = (), fix: str
) -> None:
    """Every file a manifest lists (name -> ``{"bytes", "crc32"}``) is in ``folder`` with its size;
    those named in ``checksum`` also with their CRC-32.  Otherwise an error naming the file, then ``fix``."""
    for name, record in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the manifest lists it ({record['bytes']} bytes). {fix}")
        size = path.stat().st_size
        if size != record["bytes"]:
            what = "truncated" if size < record["bytes"] else "longer than written"
            raise CheckpointError(f"{path} is {what}: {size} bytes, the manifest says {record['bytes']}. {fix}")
    for name in checksum:
        stored = files.get(name)
        found = file_crc32(folder / name) if stored is not None else None
        if stored is not None and found != stored["crc32"]:
            raise CheckpointError(
                f"{folder / name} is corrupt: its CRC-32 is {found}, the manifest says {stored['crc32']}. {fix}"
            )


def dcp_storage(metadata: Any) -> Storage:
    """DCP metadata's ``storage_data`` by entry: key -> [(file, offset, length)]."""
    out: Storage = {}
    for index, info in getattr(metadata, "storage_data", {}).items():
        out.setdefault(index.fqn, []).append((str(info.relative_path), int(info.offset), int(info.length)))
    return out


def check_reads(
    folder: Path,
    storage: Storage,
    keys: Iterable[str],
    files: Mapping[str, Mapping[str, Any]] | None,
    *,
    fix: str,
) -> None:
    """The files ``keys``' bytes lie in are there and long enough; with a manifest, their CRC-32s match.

    Cheap without a manifest (a ``stat`` per file), so a truncated shard of an
    older checkpoint is named too rather than left to DCP's unpickling error.
    """
    needed: dict[str, int] = {}
    for key in keys:
        for name, offset, length in storage.get(key, ()):
            needed[name] = max(needed.get(name, 0), offset + length)
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: DCP's index places tensors in it. {fix}")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(f"{path} is truncated: {size} bytes, its tensors need {end}. {fix}")
    if files:
        check_files(folder, {n: files[n] for n in needed if n in files}, checksum=sorted(needed), fix=fix)
        unlisted = sorted(n for n in needed if n not in files)
        if unlisted:
            raise CheckpointError(f"{folder / unlisted[0]} is not in the manifest {folder / MANIFEST}, "
                                  f"yet DCP's index places tensors in it. {fix}")


# ----------------------------------------------------------------- messages


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def _missing_message(source: _Source, missing: list[str], aliases: Mapping[str, Sequence[str]]) -> str:
    shown = [f"{n} (or {', '.join(aliases[n])})" if aliases.get(n) else n for n in missing[:5]]
    keys = source.keys()
    close = difflib.get_close_matches(missing[0], keys, n=3, cutoff=0.5)
    hint = f" Its names look like {', '.join(close)}." if close else (
        f" Its first names are {', '.join(sorted(keys)[:3])}." if keys else " It holds no tensors.")
    return (
        f"{source.describe} lacks {len(missing)} tensors this rank's stages need: {', '.join(shown)}"
        f"{' ...' if len(missing) > 5 else ''}.{hint} Load weights of this model, saved under its own "
        "parameter names (a prefix such as 'transformer.' or 'model.' must match too)."
    )
