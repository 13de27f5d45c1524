"""What a training loop needs across stages: gradient clipping, evaluation, and feeding inputs where needed.

Spawned CPU ranks (gloo) run a tiny language model whose embedding and LM head share
one weight (``tests/models/tied_lm.py``) as 2 stages x 2 replicas, each replica
given only its own half of the batch (``batch="replica"``) and each rank only what
it reads (``inputs=None`` on the stage that reads no input, ``target=None`` off
the last stage).  Compared with the whole model in one process:

* ``clip_grad_norm_`` returns ``torch.nn.utils.clip_grad_norm_``'s norm (2 and inf;
  one step under the threshold) on every rank and leaves the same clipped
  gradients, the tied weight counted once although two stages and two replicas
  hold a copy;
* training with clipping ends at the same parameters;
* ``eval_step`` returns the whole model's eval loss and its outputs.

In one process: the forward chain runs stage modules in eval mode (dropout off)
and gives every module its mode back.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import block_mlp
import pytest
import runtime_workers
import torch
from rank_workers import spawn_and_wait
from runtime_workers import plan_model, reference_run

from partitioner.plan import Plan
from runtime.evaluate import concat_microbatches, evaluate, evaluation_mode
from runtime.execute.comm import RecvSpec, Work
from runtime.execute.stage import build_local_stage
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
TIED = str(MODELS / "tied_lm.py")
BLOCKS = str(MODELS / "block_mlp.py")
CLIP = [(0.5, 2.0), (0.05, math.inf), (1e3, 2.0)]  # the last one clips nothing
LR = 0.1
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("clip")
    plan = plan_model(TIED, root, pp=2, dp=2, microbatches=2)
    out = root / "out"
    out.mkdir()
    config = {"steps": len(CLIP), "lr": LR, "clip": CLIP, "eval": True, "feed": "needed",
              "pipeline": {"batch": "replica"}, "check_errors": True}
    codes = spawn_and_wait(
        runtime_workers.train_worker, plan.gpus, (plan.gpus, free_port(), str(root), TIED, str(out), config),
        limit_s=120)
    assert codes == [0] * plan.gpus, f"rank exit codes {codes} (None: still running after 120 s)"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(plan.gpus)]
    want = reference_run(TIED, dp=2, microbatches=2, steps=len(CLIP), lr=LR, clip=CLIP, evaluate=True)
    return {"plan": plan, "ranks": ranks, "want": want}


@pytest.mark.slow  # spawns ranks (once per module)
def test_only_the_ranks_that_read_them_need_inputs_and_target(tied_run: dict[str, Any]) -> None:
    plan: Plan = tied_run["plan"]
    assert [s.model_inputs for s in plan.stages] == [("idx",), ()]
    layout = plan.rank_layout()
    for rank, r in enumerate(tied_run["ranks"]):
        stage, _ = layout[rank]
        # batch="replica": the first stage reads the target with the inputs and sends it on (issue 18, item 6).
        assert (r["needs_inputs"], r["needs_target"]) == (stage == 0, stage == 0), rank


@pytest.mark.slow  # spawns ranks (once per module)
def test_missing_inputs_and_a_global_batch_in_replica_mode_are_clear_errors(tied_run: dict[str, Any]) -> None:
    for rank, r in enumerate(tied_run["ranks"]):
        if not r["needs_inputs"]:
            assert r["errors"] == {}
            continue
        message = r["errors"]["no_inputs"]
        assert message is not None and message.startswith("AutopartitionError: "), message
        assert "inputs=None" in message and "'idx'" in message and "needs_inputs" in message, message
        message = r["errors"]["global_batch"]
        assert message is not None and "batch='replica'" in message and "Pass batches of 4" in message, message


def _check_clipping(ranks: list[dict[str, Any]], want: dict[str, Any]) -> None:
    for rank, r in enumerate(ranks):
        for got, ref in zip(r["norms"], want["norms"], strict=True):
            assert got == pytest.approx(ref, rel=1e-6), f"rank {rank}: norm {got} != torch's {ref}"
        for step, grads in enumerate(r["clipped"]):
            for name, g in grads.items():
                diff = float((g - want["clipped"][step][name]).abs().max())
                assert diff <= 1e-6, f"rank {rank} step {step}: clipped gradient of {name} differs by {diff:.2e}"


@pytest.mark.slow  # spawns ranks (once per module)
def test_clip_grad_norm_equals_torch_on_the_whole_model(tied_run: dict[str, Any]) -> None:
    plan: Plan = tied_run["plan"]
    assert any(t.stages == (0, 1) for t in plan.tied), "the tied weight must sit on both stages"
    want = tied_run["want"]
    assert want["norms"][2] < CLIP[2][0] < 1e9 and want["norms"][0] > CLIP[0][0] and want["norms"][1] > CLIP[1][0]
    _check_clipping(tied_run["ranks"], want)
    for r in tied_run["ranks"]:
        assert {"wte.weight", "lm_head.weight"} & set(r["clipped"][0]), "the tied weight is clipped too"


@pytest.mark.slow  # spawns ranks (once per module)
def test_training_with_clipping_and_replica_batches_matches(tied_run: dict[str, Any]) -> None:
    want = tied_run["want"]
    for rank, r in enumerate(tied_run["ranks"]):
        for name, value in r["state"].items():
            diff = float((value - want["state"][name]).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"
        if r["losses"][0] is not None:
            assert r["losses"] == pytest.approx(want["losses"], abs=TOLERANCE)


@pytest.mark.slow  # spawns ranks (once per module)
def test_eval_step_equals_the_whole_model(tied_run: dict[str, Any]) -> None:
    plan: Plan = tied_run["plan"]
    want = tied_run["want"]
    size = plan.batch_size // plan.dp
    for rank, r in enumerate(tied_run["ranks"]):
        stage, replica = plan.rank_layout()[rank]
        assert r["grad_enabled_after_eval"]
        if stage != plan.pp - 1:
            assert r["eval_loss"] is None and r["eval_outputs"] is None
            continue
        assert r["eval_loss"] == pytest.approx(want["eval_loss"], abs=TOLERANCE)
        rows = want["eval_outputs"][replica * size : (replica + 1) * size]
        assert float((r["eval_outputs"] - rows).abs().max()) <= TOLERANCE


@pytest.mark.slow  # spawns ranks
def test_clip_and_eval_with_two_stages_per_rank(tmp_path: Path) -> None:
    """ZB-V: rank 0 holds the first and the last stage (the tied weight is one Parameter there), rank 1
    the two middle ones (their boundary is handed over in memory)."""
    plan = plan_model(TIED, tmp_path, pp=2, microbatches=2, schedule="zbv")
    assert plan.stages_of(0) == (0, 3) and plan.stages_of(1) == (1, 2)
    assert [t.stages for t in plan.tied] == [(0, 3)]
    out = tmp_path / "out"
    out.mkdir()
    config = {"steps": 2, "lr": LR, "clip": CLIP[:2], "eval": True, "feed": "needed"}
    codes = spawn_and_wait(
        runtime_workers.train_worker, 2, (2, free_port(), str(tmp_path), TIED, str(out), config), limit_s=120)
    assert codes == [0, 0], f"rank exit codes {codes}"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    want = reference_run(TIED, dp=1, microbatches=2, steps=2, lr=LR, clip=CLIP[:2], evaluate=True)
    assert [(r["needs_inputs"], r["needs_target"]) for r in ranks] == [(True, True), (False, False)]
    _check_clipping(ranks, want)
    assert ranks[0]["eval_loss"] == pytest.approx(want["eval_loss"], abs=TOLERANCE)
    assert ranks[1]["eval_loss"] is None
    assert float((ranks[0]["eval_outputs"] - want["eval_outputs"]).abs().max()) <= TOLERANCE
    for rank, r in enumerate(ranks):
        for name, value in r["state"].items():
            assert float((value - want["state"][name]).abs().max()) <= TOLERANCE, f"rank {rank}: {name}"


# ------------------------------------------------------------- one process


class _Mailbox:
    """In-memory messages; the ranks run one after the other (every send precedes its receive)."""

    def __init__(self, rank: int, boxes: dict[tuple[int, int, int], list[torch.Tensor]]) -> None:
        self.rank, self.boxes = rank, boxes

    def send_tensors(self, tensors: Sequence[torch.Tensor], *, peer: int, tag: int) -> list[Work]:
        self.boxes[self.rank, peer, tag].extend(t.clone() for t in tensors)
        return []

    def post_recv(
        self, specs: Sequence[RecvSpec], *, peer: int, tag: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[Work]]:
        got = [self.boxes[peer, self.rank, tag].pop(0) for _ in specs]
        assert [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in got] == [
            (s.shape, s.dtype) for s in specs]
        return got, []


def test_forward_chain_in_eval_mode_equals_the_whole_model(tmp_path: Path) -> None:
    plan = plan_model(BLOCKS, tmp_path, pp=2, microbatches=2)
    inputs, target = block_mlp.example_inputs(8), block_mlp.example_target(8)
    size = plan.microbatch_size
    micro = [((inputs[0][m * size : (m + 1) * size],), target[m * size : (m + 1) * size]) for m in range(2)]
    boxes: dict[tuple[int, int, int], list[torch.Tensor]] = defaultdict(list)
    losses = []
    for index in range(plan.pp):
        stage = build_local_stage(plan, block_mlp.build_model(dropout=0.5), index)
        assert stage.module.training
        with evaluation_mode([stage.module]):
            loss, outputs = evaluate(
                plan, [(stage, stage.module)], micro, replica=0, rank=index, loss_fn=block_mlp.loss_fn,
                device=torch.device("cpu"), timeout=5, comm=_Mailbox(index, boxes), keep_outputs=True)
        assert all(m.training for m in stage.module.modules()), "modes are given back"
        losses.append(loss)
    assert losses[0] is None and not any(boxes.values()), "every message was received"
    model = block_mlp.build_model(dropout=0.5).eval()
    with torch.no_grad():
        logits = model(*inputs)
    assert float(losses[1]) == pytest.approx(float(block_mlp.loss_fn(logits, target)), abs=TOLERANCE)
    assert torch.allclose(concat_microbatches(outputs), logits, atol=TOLERANCE)
