"""Inputs and targets of the same samples, whatever sampler fed the ranks (issue 18, item 6).

With ``Pipeline(..., batch="replica")`` the first stage's ranks read the inputs and
the last stage's the target.  A ``DistributedSampler`` over the global rank (the
DDP habit) gives the two stages of one replica different samples.  Spawned CPU
ranks (gloo), the MLP as 2 stages x 2 replicas (``tests/models/pairing_workers.py``):

* given everything (inputs and target on every rank), the ranks see on the first
  step that they hold different samples and every rank refuses, with the fix;
* given only what they read (``needs_inputs`` / ``needs_target``), the target
  travels with the inputs from the first stage: loss and gradients are the whole
  model's on correctly paired samples;
* sharded over ``pipe.dp_rank`` they train as the whole model on those samples.

In process: the digest and the refusal message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pairing_workers
import pytest
import torch
from rank_workers import spawn_and_wait
from runtime_workers import plan_model

from partitioner.modelfile import load_model_file
from runtime.pipeline import _digest, _feeding_message
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
MLP = str(MODELS / "mlp.py")
LIMIT_S = 150.0
TOLERANCE = 1e-5
FIX = "DistributedSampler(dataset, num_replicas=pipe.dp_size, rank=pipe.dp_rank)"

# ---------------------------------------------------------------- in process


def _note(stage: int, replica: int, fed: dict[str, str], *, sends: bool = False,
          receives_from: int | None = None) -> dict[str, Any]:
    return {"group": replica, "stages": [stage], "fed": fed, "sends": sends, "receives_from": receives_from}


def test_the_digest_follows_the_data_not_the_object() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert _digest(x) == _digest(x.clone()) == _digest(torch.arange(12.0).reshape(3, 4)[:, :])
    assert _digest(x) != _digest(x.flip(0)) and _digest(x) != _digest(x.reshape(4, 3))
    assert _digest({"a": x}) != _digest({"b": x}) and _digest(x) != _digest(x.double())


def test_ranks_of_one_replica_given_different_samples_are_refused_with_the_fix() -> None:
    # pp=2 x dp=2: ranks 0, 1 hold stage 0 (replicas 0, 1), ranks 2, 3 stage 1.
    same = [_note(0, 0, {"input 'x'": "a", "target": "t"}), _note(0, 1, {"input 'x'": "b", "target": "u"}),
            _note(1, 0, {"input 'x'": "a", "target": "t"}), _note(1, 1, {"input 'x'": "b", "target": "u"})]
    assert _feeding_message(same, batch="replica", call="step") is None  # replicas differ, as they should
    shifted = [same[0], same[1], _note(1, 0, {"input 'x'": "c", "target": "v"}), same[3]]
    message = _feeding_message(shifted, batch="replica", call="step")
    assert message is not None and FIX in message and "not over the global rank" in message, message
    assert "in replica 0, the input 'x' of rank 0 (stage 0) differs from that of rank 2 (stage 1)" in message
    assert "replica 1" not in message, message
    assert _feeding_message(shifted, batch="global", call="step") is not None  # global: all ranks alike


def test_a_first_stage_without_the_target_is_refused() -> None:
    notes = [_note(0, 0, {"input 'x'": "a"}, sends=True), _note(1, 0, {}, receives_from=0)]
    message = _feeding_message(notes, batch="replica", call="step")
    assert message is not None and message.startswith("Rank 0 (stage 0, replica 0) got target=None"), message
    assert _feeding_message(notes, batch="replica", call="eval_step") is None  # no target: no loss
    notes[1]["fed"]["target"] = "t"  # the last stage's target would be dropped for None
    assert _feeding_message(notes, batch="replica", call="eval_step") is not None


# ------------------------------------------------------------- spawned ranks


@pytest.fixture(scope="module")
def pairing_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pairing")
    plan = plan_model(MLP, root, pp=2, dp=2, microbatches=2)
    out = root / "out"
    out.mkdir()
    codes = spawn_and_wait(pairing_workers.pairing_worker, plan.gpus,
                           (plan.gpus, free_port(), str(root), MLP, str(out)), limit_s=LIMIT_S)
    assert codes == [0] * plan.gpus, f"rank exit codes {codes} (None: still running after {LIMIT_S:g} s)"
    return {"plan": plan, "ranks": [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(plan.gpus)]}


def _whole_model(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Loss and gradients of the unpartitioned MLP on the replicas' batches, concatenated."""
    model_file = load_model_file(MLP)
    torch.manual_seed(0)
    model = model_file.build()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    loss = model_file.loss_fn(model(x), y)  # type: ignore[misc]
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _check_trains_as_whole_model(ranks: list[dict[str, Any]], key: str, want: dict[str, Any]) -> None:
    for rank, r in enumerate(ranks):
        got = r[key]
        assert got["error"] is None, f"rank {rank}: {got['error']}"
        if r["stage"] == 1:
            assert got["loss"] == pytest.approx(want["loss"], abs=TOLERANCE), (rank, got["loss"], want["loss"])
        assert got["grads"], f"rank {rank} has no gradients"
        for name, g in got["grads"].items():
            diff = float((g - want["grads"][name]).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: gradient of {name} differs by {diff:.2e} ({key})"


@pytest.mark.slow  # spawns ranks (once per module)
def test_a_sampler_over_the_global_rank_is_refused_on_every_rank_on_the_first_step(
    pairing_run: dict[str, Any],
) -> None:
    for rank, r in enumerate(pairing_run["ranks"]):
        message = r["global_all"]["error"] or "<trained>"
        assert message.startswith("AutopartitionError: The ranks were given different data"), (rank, message)
        assert FIX in message and "not over the global rank" in message, message
        assert r["global_all"]["grads"] == {}, f"rank {rank} computed gradients"


@pytest.mark.slow  # spawns ranks (once per module)
def test_the_target_travels_with_the_inputs_when_each_rank_gets_only_what_it_reads(
    pairing_run: dict[str, Any],
) -> None:
    plan = pairing_run["plan"]
    size = plan.batch_size // plan.dp
    # Replica r's samples are those its first-stage rank (global rank r) read: paired, from shard r of 4.
    data = pairing_workers.dataset()
    batches = [pairing_workers.replica_batch(data, size, num_replicas=plan.gpus, rank=r) for r in range(plan.dp)]
    _check_trains_as_whole_model(pairing_run["ranks"], "global_needed", _whole_model(batches))
    for r in pairing_run["ranks"]:  # the first stage reads inputs and target, the last stage nothing
        assert (r["needs_inputs"], r["needs_target"]) == (r["stage"] == 0, r["stage"] == 0), r


@pytest.mark.slow  # spawns ranks (once per module)
def test_a_sampler_over_dp_rank_trains_as_the_whole_model(pairing_run: dict[str, Any]) -> None:
    plan = pairing_run["plan"]
    size = plan.batch_size // plan.dp
    data = pairing_workers.dataset()
    batches = [pairing_workers.replica_batch(data, size, num_replicas=plan.dp, rank=r) for r in range(plan.dp)]
    _check_trains_as_whole_model(pairing_run["ranks"], "dp_all", _whole_model(batches))
