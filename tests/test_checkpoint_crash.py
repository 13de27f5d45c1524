"""Real ranks killed while saving a checkpoint: the previous step stays loadable, exactly.

Two spawned CPU ranks (gloo) train ``tests/models/tied_lm.py`` as pp=2, save step 1,
train one more step and save step 2 while one rank dies at a chosen point of the
save (tests/models/crash_workers.py lists them: before any shard, mid-shard with a
torn file on disk, SIGKILL from this test, before plan.json, before the manifest,
before the rename, after the rename, between the two renames of a step saved
again).  The test then kills the surviving rank, as a crashed job's ranks go down.
Two fresh ranks resume from each directory: the step they load and every parameter
and buffer equal what the ranks held when that step was saved (``torch.equal``).

The same fresh ranks then load damaged checkpoints (a truncated shard, a flipped
byte, an unfinished save named directly, a checkpoint without checksums whose shard
is garbage): every rank raises a CheckpointError naming the file (the rank that does
not read it learns it from the one that does), and a final collective shows that no
rank hangs or sees its peer's connection close.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "tied_lm.py")
LIMIT_S = 120

import crash_workers
from crash_workers import KILLED, POINTS
from planning_helpers import make_plan
from rank_workers import spawn_and_wait

DEFAULT_POINTS = ("mid-shard",)  # the rest: @slow (tests/test_checkpoint.py covers every point in-process)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("crash_plan") / "plan"
    make_plan(SPEC, directory, pp=2, dp=1, microbatches=2, schedule="1f1b")
    return directory


def _crash(root: Path, plan_dir: Path, point: str) -> list[int | None]:
    """Run the saving job with ``point``'s fault; the exit codes."""
    root.mkdir(parents=True)
    victim = POINTS[point][0]
    return crash_workers.run_crash_job(
        crash_workers.crash_save_worker, 2, (2, free_port(), str(plan_dir), SPEC, str(root), point),
        victim=victim, marker=root / "saving" if point == "sigkill" else None, limit_s=LIMIT_S,
    )


def _resume(root: Path, plan_dir: Path, directories: dict[str, str], broken: dict[str, str]) -> list[dict[str, Any]]:
    out = root / "resume"
    out.mkdir(parents=True)
    codes = spawn_and_wait(crash_workers.resume_worker, 2,
                           (2, free_port(), str(plan_dir), SPEC, str(out), directories, broken), limit_s=LIMIT_S)
    assert codes == [0, 0], f"resuming ranks' exit codes {codes} (None: still running after {LIMIT_S} s)"
    return [torch.load(out / f"resume_rank{r}.pt", weights_only=True) for r in range(2)]


def _damaged(source: Path, root: Path) -> dict[str, str]:
    """Copies of the complete step ``source`` with one file damaged each; label -> directory."""
    out: dict[str, str] = {}
    shard = "__1_0.distcp"  # rank 1's stage (and the tied embedding, which rank 0 reads too)
    for label in ("truncated", "flipped", "garbage-v1"):
        target = root / "damaged" / label / source.name
        shutil.copytree(source, target)
        data = (target / shard).read_bytes()
        if label == "truncated":
            (target / shard).write_bytes(data[: len(data) // 2])
        elif label == "flipped":
            (target / shard).write_bytes(data[:64] + bytes([data[64] ^ 0xFF]) + data[65:])
        else:  # a version-1 manifest (no checksums): DCP itself meets the garbage
            manifest = json.loads((target / "checkpoint.json").read_text())
            manifest["format_version"] = 1
            del manifest["files"]
            (target / "checkpoint.json").write_text(json.dumps(manifest))
            (target / shard).write_bytes(b"\x00" * len(data))
        out[label] = str(target.parent)
    return out


def _check_crashes(roots: dict[str, Path], codes: dict[str, list[int | None]], ranks: list[dict[str, Any]]) -> None:
    for point, root in roots.items():
        victim, save = POINTS[point]
        want_code = -9 if point == "sigkill" else KILLED
        assert codes[point][victim] == want_code, f"{point}: exit codes {codes[point]}"
        step = 1 if save == 1 or point == "replace" else 2
        for rank, result in enumerate(ranks):
            got = result["resumed"][point]
            assert got["step"] == step, f"{point}: rank {rank} resumed step {got['step']}, want {step}"
            want = torch.load(root / f"state_save{save}_rank{rank}.pt", weights_only=True)
            assert set(got["state"]) == set(want), point
            for name, value in want.items():
                assert torch.equal(got["state"][name], value), f"{point}: rank {rank} {name} differs"


def _run(points: tuple[str, ...], tmp_path: Path, plan_dir: Path) -> None:
    roots = {point: tmp_path / point for point in points}
    codes = {point: _crash(root, plan_dir, point) for point, root in roots.items()}
    first = roots[points[0]] / "ckpt"
    broken = _damaged(first / "step-1", tmp_path)
    unfinished = sorted(first.glob(".step-2.tmp-*"))
    if unfinished:
        broken["unfinished"] = str(unfinished[0])
    ranks = _resume(tmp_path, plan_dir, {point: str(root / "ckpt") for point, root in roots.items()}, broken)
    _check_crashes(roots, codes, ranks)
    for rank, result in enumerate(ranks):
        assert result["after"] == "reached"
        errors = result["errors"]
        for label in broken:
            assert errors[label] is not None and errors[label].startswith("CheckpointError"), (rank, label, errors[label])
            assert "Connection closed" not in errors[label], errors[label]
        assert "__1_0.distcp is truncated" in errors["truncated"], errors["truncated"]
        assert "__1_0.distcp is corrupt: its CRC-32" in errors["flipped"], errors["flipped"]
        assert "cannot be read" in errors["garbage-v1"] and "__1_0.distcp" in errors["garbage-v1"], errors["garbage-v1"]
        if "unfinished" in broken:
            assert "did not finish" in errors["unfinished"] and "step-1" in errors["unfinished"], errors["unfinished"]


def test_a_rank_killed_mid_shard_leaves_the_previous_step_and_damage_is_agreed(
    tmp_path: Path, plan_dir: Path
) -> None:
    _run(DEFAULT_POINTS, tmp_path, plan_dir)


@pytest.mark.slow  # one saving job per kill point, ~10 s each
@pytest.mark.exhaustive  # the in-process tests of test_checkpoint.py cover every kill point
def test_every_kill_point_leaves_a_loadable_step_with_its_exact_values(tmp_path: Path, plan_dir: Path) -> None:
    _run(tuple(p for p in POINTS if p not in DEFAULT_POINTS), tmp_path, plan_dir)
