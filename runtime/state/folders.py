"""A checkpoint directory's layout: its step folders and their manifests, read without torch.

:mod:`runtime.state.checkpoint` writes and loads checkpoints in this layout;
:mod:`runtime.state.weights` reads one as weights.  Both import this module, which
imports neither (so they do not import each other both ways).

    >>> bool(STEP_FOLDER.fullmatch("step-12")), bool(UNFINISHED_FOLDER.fullmatch(".step-12.tmp-0af3"))
    (True, True)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from partitioner.errors import CheckpointError

__all__ = [
    "DCP_METADATA",
    "FORMAT",
    "FORMAT_VERSION",
    "LEFTOVER_FOLDER",
    "MANIFEST",
    "PLAN_FILE",
    "READ_VERSIONS",
    "REPLACED_FOLDER",
    "STEP_FOLDER",
    "UNFINISHED_FOLDER",
    "complete_steps",
    "damage_advice",
    "find_checkpoint",
    "folder_step",
    "previous_advice",
    "read_manifest",
    "read_manifest_files",
]

FORMAT = "autopartition-checkpoint"
FORMAT_VERSION = 2  # 2 added "files" (sizes, CRC-32s); 1 is still read
READ_VERSIONS = (1, 2)
# The manifest: a DCP folder holding one is a Pipeline checkpoint (sizes and CRC-32s).
MANIFEST = "checkpoint.json"
DCP_METADATA = ".metadata"
PLAN_FILE = "plan.json"
STEP_FOLDER = re.compile(r"step-(\d+)")
# A save under way, or one a crash stopped; ".old": a step being replaced; ".del": a step being pruned.
UNFINISHED_FOLDER = re.compile(r"\.step-(\d+)\.tmp-[0-9a-f]+")
REPLACED_FOLDER = re.compile(r"\.step-(\d+)\.old-[0-9a-f]+")
LEFTOVER_FOLDER = re.compile(r"\.step-(\d+)\.(tmp|old|del)-[0-9a-f]+")


def complete_steps(directory: str | os.PathLike[str]) -> dict[int, Path]:
    """The complete steps in ``directory``: step -> its ``step-N`` folder (one holding a manifest).

    A ``.step-N.old-*`` folder (a step a crash left half-replaced) counts when no ``step-N`` does.
    """
    path = Path(directory)
    out: dict[int, Path] = {}
    if not path.is_dir():
        return out
    for child in sorted(path.iterdir()):
        match = STEP_FOLDER.fullmatch(child.name) or REPLACED_FOLDER.fullmatch(child.name)
        if match and (child / MANIFEST).is_file() and (child.name.startswith("step-") or int(match[1]) not in out):
            out[int(match[1])] = child
    return dict(sorted(out.items()))


def find_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """The folder to load: ``directory``'s newest complete step, or ``directory`` itself when it is one.

    A folder with ``checkpoint.json`` in it is one (a ``step-N`` folder, or the
    single-folder layout of earlier versions); an unfinished save is refused, naming
    the newest complete step beside it, if any.
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"No checkpoint at {path}: it is not a directory. Pass the directory "
                              "save_checkpoint wrote.")
    unfinished = UNFINISHED_FOLDER.fullmatch(path.name)
    if unfinished:
        raise CheckpointError(
            f"{path} is a save of step {unfinished[1]} that did not finish: it is not loadable, and its shards may "
            f"be partly written. {previous_advice(path.parent)}"
        )
    steps = complete_steps(path)
    if (path / MANIFEST).is_file():
        if steps and max(steps) >= _manifest_step(path):
            return steps[max(steps)]  # a single-folder checkpoint that newer saves went beside
        return path
    if steps:
        return steps[max(steps)]
    if (path / DCP_METADATA).is_file():
        raise CheckpointError(
            f"{path} is a torch.distributed.checkpoint without {MANIFEST}: not written by save_checkpoint, or "
            f"its save did not finish (then its shards may mix two steps). {previous_advice(path)}"
        )
    pending = sorted(int(m[1]) for m in map(UNFINISHED_FOLDER.fullmatch, _names(path)) if m)
    if pending:
        raise CheckpointError(
            f"{path} holds no complete checkpoint: the save of step {pending[-1]} did not finish "
            f"(.step-{pending[-1]}.tmp-*). Start afresh, or resume from another directory."
        )
    raise CheckpointError(f"{path} is not a checkpoint. Resume from a directory Pipeline.save_checkpoint wrote.")


def _names(path: Path) -> list[str]:
    return [p.name for p in path.iterdir()] if path.is_dir() else []


def _manifest_step(path: Path) -> int:
    try:
        return int(json.loads((path / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def previous_advice(directory: Path, *, before: int | None = None) -> str:
    """Where the newest complete step (older than ``before``) in ``directory`` is, to resume from it."""
    steps = {k: v for k, v in complete_steps(directory).items() if before is None or k < before}
    if not steps:
        return (f"No complete checkpoint is in {directory}: start afresh, or resume from another directory "
                "(do not load this one as weights: its files may mix two steps).")
    newest = steps[max(steps)]
    return f"Resume from the previous complete step, which exists at {newest} (pass that folder)."


def read_manifest_files(folder: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The ``files`` records of ``folder``'s manifest ({} for a version-1 manifest); checked as JSON."""
    return read_manifest(Path(folder))["files"]


def read_manifest(path: Path) -> dict[str, Any]:
    manifest = path / MANIFEST
    try:
        data = json.loads(manifest.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"its format is {data.get('format') if isinstance(data, dict) else data!r}")
        if data.get("format_version") not in READ_VERSIONS:
            raise ValueError(f"format version {data.get('format_version')!r}, this autopartition reads "
                             f"{', '.join(map(str, READ_VERSIONS))}")
        step = data["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"its step is {step!r}, not a count of steps (an integer >= 0)")
        files = data.get("files", {}) if data["format_version"] == 1 else data["files"]
        if not isinstance(files, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("crc32"), str)
            for r in files.values()
        ):
            raise ValueError("its files are not name -> {bytes, crc32}")
        data["model"], data["optimizer"] = str(data["model"]), data["optimizer"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is not an autopartition checkpoint manifest ({exc}). "
                              f"{damage_advice(path, folder_step(path))}") from exc
    data["files"] = files
    return data


def folder_step(path: Path) -> int | None:
    match = STEP_FOLDER.fullmatch(path.name)
    return int(match[1]) if match else None


def damage_advice(path: Path, step: int | None) -> str:
    """What to do when the checkpoint at ``path`` (of ``step``) is damaged: the step before it, if any."""
    if folder_step(path) is None and not REPLACED_FOLDER.fullmatch(path.name):
        return "Resume from another complete checkpoint, or start afresh."  # a single-folder checkpoint
    return previous_advice(path.parent, before=step)
