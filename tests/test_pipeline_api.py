"""The Pipeline's public API on really spawned CPU ranks (gloo).

Two ranks run a two-stage plan of a tiny language model whose embedding and LM head
share one weight and which holds a persistent buffer (``tests/models/tied_lm.py``).
Checked: ``Pipeline.state_dict()`` uses the original model's names; the union of the
ranks' state dicts after training loads into the unpartitioned model with
``strict=True`` and equals the same training done on the whole model; a full
checkpoint loads into the pipeline; bad mini-batches and a wrong world size raise
clear errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from partitioner.errors import AutopartitionError
from partitioner.modelfile import load_model_file
from runtime.pipeline import Pipeline
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "tied_lm.py")
BATCH = 8
STEPS = 3
TOLERANCE = 1e-5

import rank_workers
from planning_helpers import make_plan
from rank_workers import spawn_and_wait


def _perturbed_checkpoint(model_file: Any) -> dict[str, torch.Tensor]:
    """A full state dict different from build()'s (tied entries stay one tensor)."""
    torch.manual_seed(0)
    model = model_file.build()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for b in model.buffers():
            b.mul_(1.25)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reference(model_file: Any, checkpoint: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The same run on the whole model: STEPS SGD steps, then one step from the checkpoint."""
    torch.manual_seed(0)
    model = model_file.build()
    inputs = model_file.example_inputs(BATCH)
    target = model_file.example_target(BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=rank_workers.LR, momentum=rank_workers.MOMENTUM)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model_file.loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(checkpoint, strict=True)
    model.zero_grad(set_to_none=True)
    loss = model_file.loss_fn(model(*inputs), target)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "trained": trained, "loss_after_load": loss.item(), "grads_after_load": grads}


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, name = 0.0, "-"
    for k, v in got.items():
        d = float((v - want[k]).abs().max()) if v.numel() else 0.0
        if d > worst:
            worst, name = d, k
    return worst, name


@pytest.fixture(scope="module", params=["symbolic_trace", "export"])
def api_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One two-rank run of ``rank_workers.api_worker`` per capture route; the tests below read it.

    Both routes, because they name a tied parameter differently in the captured graph
    (``torch.export`` keeps a single name for the shared tensor).
    """
    root = tmp_path_factory.mktemp("api")
    plan = make_plan(SPEC, root / "plan", pp=2, dp=1, microbatches=2, schedule="1f1b",
                     capture_method=request.param)
    model_file = load_model_file(SPEC)
    checkpoint = _perturbed_checkpoint(model_file)
    torch.save(checkpoint, root / "checkpoint.pt")
    out = root / "out"
    out.mkdir()
    codes = spawn_and_wait(
        rank_workers.api_worker, plan.gpus,
        (plan.gpus, free_port(), str(root / "plan"), SPEC, str(out), STEPS, str(root / "checkpoint.pt")),
        limit_s=120,
    )
    assert codes == [0] * plan.gpus, f"rank exit codes {codes} (None: still running after 120 s)"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(plan.gpus)]
    torch.manual_seed(0)
    model = model_file.build()
    return {"plan": plan, "ranks": ranks, "model": model, "checkpoint": checkpoint,
            "reference": _reference(model_file, checkpoint)}


@pytest.mark.slow  # spawns ranks (once per module)
def test_plan_splits_the_tied_weight_across_both_ranks(api_run: dict[str, Any]) -> None:
    plan = api_run["plan"]
    assert (plan.pp, plan.dp, plan.gpus) == (2, 1, 2)
    tied = {t.name: t for t in plan.tied}
    assert "wte.weight" in tied and tied["wte.weight"].stages == (0, 1)


@pytest.mark.slow  # spawns ranks (once per module)
def test_state_dict_keys_are_the_original_names(api_run: dict[str, Any]) -> None:
    full = set(api_run["model"].state_dict())
    union: set[str] = set()
    for rank, result in enumerate(api_run["ranks"]):
        keys = set(result["keys_before"])
        assert keys, f"rank {rank} has an empty state dict"
        assert keys <= full, f"rank {rank} has keys not in the model: {sorted(keys - full)}"
        assert set(result["trained"]) == keys
        union |= keys
    assert union == full, f"missing from every rank: {sorted(full - union)}"
    # The buffer and both names of the tied weight are there.
    assert {"scale", "wte.weight", "lm_head.weight"} <= union


@pytest.mark.slow  # spawns ranks (once per module)
def test_union_of_state_dicts_loads_strictly_into_the_unpartitioned_model(api_run: dict[str, Any]) -> None:
    union: dict[str, torch.Tensor] = {}
    for result in api_run["ranks"]:
        union.update(result["trained"])
    model = api_run["model"]
    model.load_state_dict(union, strict=True)  # raises on a missing or unexpected key
    diff, name = _max_diff(model.state_dict(), api_run["reference"]["trained"])
    assert diff <= TOLERANCE, f"{name} differs from the reference by {diff:.2e} after loading"


@pytest.mark.slow  # spawns ranks (once per module)
def test_trained_state_equals_reference_training(api_run: dict[str, Any]) -> None:
    want = api_run["reference"]["trained"]
    # Every entry of every rank, including the tied weight that both ranks hold.
    for rank, result in enumerate(api_run["ranks"]):
        diff, name = _max_diff(result["trained"], want)
        assert diff <= TOLERANCE, f"rank {rank}: {name} differs from the reference by {diff:.2e}"
    last = api_run["ranks"][-1]["losses"]
    for got, ref in zip(last, api_run["reference"]["losses"], strict=True):
        assert got == pytest.approx(ref, abs=TOLERANCE)
    assert api_run["ranks"][0]["losses"] == [None] * STEPS


@pytest.mark.slow  # spawns ranks (once per module)
def test_load_state_dict_of_a_full_checkpoint(api_run: dict[str, Any]) -> None:
    checkpoint = api_run["checkpoint"]
    for rank, result in enumerate(api_run["ranks"]):
        assert set(result["loaded"]) == set(result["keys_before"])
        for name, value in result["loaded"].items():
            assert torch.equal(value, checkpoint[name]), f"rank {rank}: {name} was not loaded"
    ref = api_run["reference"]
    assert api_run["ranks"][-1]["loss_after_load"] == pytest.approx(ref["loss_after_load"], abs=TOLERANCE)
    for rank, result in enumerate(api_run["ranks"]):
        assert result["grads_after_load"], f"rank {rank} computed no gradients"
        diff, name = _max_diff(result["grads_after_load"], ref["grads_after_load"])
        assert diff <= TOLERANCE, f"rank {rank}: gradient of {name} after loading differs by {diff:.2e}"


@pytest.mark.slow  # spawns ranks (once per module)
def test_wrong_batch_size_names_the_expected_size(api_run: dict[str, Any]) -> None:
    """The rejected step raises before any communication: training afterwards still matches."""
    plan = api_run["plan"]
    wrong = plan.batch_size + plan.dp * plan.microbatches  # what api_worker passes
    for rank, result in enumerate(api_run["ranks"]):
        message = result["wrong_batch_error"]
        assert message is not None, f"rank {rank} accepted a mini-batch of the wrong size"
        assert message.startswith("partitioner.errors.AutopartitionError: "), message
        assert f"batch {wrong}" in message and f"batches of {BATCH}" in message, message


@pytest.mark.slow  # spawns ranks (once per module)
def test_wrong_number_of_inputs_is_a_clear_error(api_run: dict[str, Any]) -> None:
    for rank, result in enumerate(api_run["ranks"]):
        message = result["extra_input_error"]
        assert message is not None, f"rank {rank} accepted two inputs for a one-input model"
        assert message.startswith(("partitioner.errors.AutopartitionError: ", "partitioner.errors.CaptureError: ")), message
        assert "expected 1 positional argument" in message and "got 2" in message, message


def test_world_size_other_than_plan_gpus_is_a_clear_error(tmp_path: Path) -> None:
    plan = make_plan(SPEC, tmp_path / "plan", pp=2, dp=1, microbatches=2, schedule="gpipe")
    assert plan.gpus == 2
    model_file = load_model_file(SPEC)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(AutopartitionError) as info:
            Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=30)
    finally:
        dist.destroy_process_group()
    message = str(info.value)
    assert "needs 2 ranks" in message and "1 were started" in message, message


def test_pipeline_without_a_process_group_or_launcher_env_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = make_plan(SPEC, tmp_path / "plan", pp=2, dp=1, microbatches=2, schedule="gpipe")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    model_file = load_model_file(SPEC)
    with pytest.raises(AutopartitionError, match="not initialised"):
        Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"))
