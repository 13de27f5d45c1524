"""Run-time precision: bf16-mixed runs stages and loss under autocast, bf16 holds bfloat16 parameters.

Boundary dtypes: fake propagation of the captured graph under autocast agrees with a
real autocast run node by node, and the runtime's plan carries those dtypes.

Training (really spawned CPU ranks, gloo, 3 SGD steps) is compared with one process:

* against the same training of the whole model under the same precision, run the
  way the pipeline runs it (same micro-batches, ``loss / M`` each, replicas
  averaged): ``TIGHT`` = 1e-6.  Both runs do the same bfloat16 ops on the same
  values; only float32 additions may come in another order (DDP sums the replicas'
  gradients), so they agree far inside float32's tolerance (measured: 0 with one
  replica, 1.2e-7 with two).  Running any part in float32 instead (a stage or the
  loss outside autocast, a boundary sent as float32) moves the loss by ~1e-4 or
  more; the negative control checks that the fp32 run misses ``TIGHT`` by 100x;
* against one forward of the whole mini-batch under autocast (what a user without
  a pipeline runs): ``WHOLE_BATCH`` = 1e-3.  A different micro-batch size changes
  the float32 accumulation order inside each matmul before its result is rounded
  to bfloat16, so single elements may differ by one bfloat16 ulp (2**-7 relative);
  the loss and the parameters sum many such roundings, which largely cancel
  (measured: 3e-5 on the loss, 7e-5 on parameters of magnitude ~0.3 after three
  steps).  1e-3, a quarter of a bfloat16 ulp at 1.0, bounds that with a margin of
  ten; it cannot tell bf16-mixed from fp32 (3e-4 apart), which is ``TIGHT``'s job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import runtime_workers
import torch
from rank_workers import spawn_and_wait
from runtime_workers import plan_model, reference_run
from torch import fx

from partitioner.graph.capture import capture
from partitioner.modelfile import load_model_file
from runtime.execute.stage import example_microbatch
from runtime.state.precision import PrecisionForward, boundary_dtypes, plan_at_precision
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
MLP = str(MODELS / "mlp.py")
TIED = str(MODELS / "tied_lm.py")
STEPS = 3
LR = 0.1
TIGHT = 1e-6
WHOLE_BATCH = 1e-3


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    diffs = [(float((got[k].float() - want[k].float()).abs().max()), k) for k in got]
    return max(diffs, default=(0.0, "-"))


def _train(plan_dir: Path, spec: str, gpus: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    out = plan_dir / "out"
    out.mkdir()
    codes = spawn_and_wait(
        runtime_workers.train_worker, gpus, (gpus, free_port(), str(plan_dir), spec, str(out), config), limit_s=120)
    assert codes == [0] * gpus, f"rank exit codes {codes} (None: still running after 120 s)"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(gpus)]


def _compare(ranks: list[dict[str, Any]], want: dict[str, Any]) -> tuple[float, float]:
    """Largest loss and parameter differences of the pipeline against a reference run."""
    last = [r for r in ranks if r["losses"][0] is not None]
    assert last, "no rank returned a loss"
    loss_diff = max(abs(a - b) for r in last for a, b in zip(r["losses"], want["losses"], strict=True))
    state_diff = max(_max_diff(r["state"], want["state"])[0] for r in ranks)
    return loss_diff, state_diff


# ------------------------------------------------------------ boundary dtypes


def _real_dtypes(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, str]:
    found: dict[str, str] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if isinstance(value, torch.Tensor):
                found[n.name] = str(value.dtype).removeprefix("torch.")
            return value

    with torch.autocast("cpu", dtype=torch.bfloat16):
        Record(gm).run(*inputs)
    return found


def test_fake_propagation_under_autocast_matches_a_real_run() -> None:
    model_file = load_model_file(TIED)
    inputs = model_file.example_inputs(4)
    gm = capture(model_file.build(), inputs).graph_module
    fake = boundary_dtypes(gm, inputs, precision="bf16-mixed")
    assert fake == _real_dtypes(gm, inputs)
    # Both kinds occur: linear outputs in bf16, the residual stream (fp32 embedding + bf16) in fp32.
    assert fake["layers_0"] == "bfloat16" and fake["add"] == "float32" and fake["idx"] == "int64"


def test_bf16_makes_every_floating_value_bfloat16() -> None:
    model_file = load_model_file(TIED)
    inputs = model_file.example_inputs(4)
    gm = capture(model_file.build(), inputs).graph_module
    dtypes = boundary_dtypes(gm, inputs, precision="bf16")
    assert {d for n, d in dtypes.items() if n != "idx"} == {"bfloat16"} and dtypes["idx"] == "int64"
    assert next(gm.parameters()).dtype == torch.float32, "the model itself is left as it was"


def test_runtime_plan_carries_the_real_boundary_dtypes(tmp_path: Path) -> None:
    plan = plan_model(MLP, tmp_path, pp=2, microbatches=2, precision="bf16-mixed")
    assert {b.dtype for s in plan.stages for b in s.outputs} == {"float32"}  # the plan: the model's dtype
    gm = capture(load_model_file(MLP).build(), example_microbatch(plan)).graph_module
    runtime = plan_at_precision(plan, gm, example_microbatch(plan), device_type="cpu")
    assert [b.dtype for b in runtime.stages[0].outputs] == [b.dtype for b in runtime.stages[1].inputs] == ["bfloat16"]
    assert runtime.stages[0].outputs[0].shape == plan.stages[0].outputs[0].shape
    fp32 = plan_model(MLP, tmp_path / "fp32", pp=2, microbatches=2)
    assert plan_at_precision(fp32, gm, example_microbatch(fp32), device_type="cpu") is fp32


def test_bf16_casts_model_inputs_but_not_received_tensors() -> None:
    seen: list[torch.dtype] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
            seen.extend([x.dtype, received.dtype])
            return x

    run = PrecisionForward(Probe(), precision="bf16", device_type="cpu", model_inputs=1)
    run(torch.ones(2), torch.ones(2))
    assert seen == [torch.bfloat16, torch.float32]


# ----------------------------------------------------------------- training


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize(("dp", "schedule"), [(1, "zbv"), (2, "1f1b")])
def test_bf16_mixed_pipeline_equals_autocast_training(tmp_path: Path, dp: int, schedule: str) -> None:
    """Two pipeline ranks: ZB-V (two stages per rank, backward split into B and W) or 1F1B x 2 replicas (DDP)."""
    plan = plan_model(MLP, tmp_path, pp=2, dp=dp, microbatches=2, schedule=schedule, precision="bf16-mixed")
    assert len(plan.stages) == (4 if schedule == "zbv" else 2)
    ranks = _train(tmp_path, MLP, plan.gpus, {"steps": STEPS, "lr": LR})
    for r in ranks:
        assert set(r["dtypes"].values()) == {"bfloat16"}, "linear and tanh outputs travel in bf16"
        assert r["parameter_dtypes"] == ["torch.float32"], "bf16-mixed keeps float32 parameters"
        assert "PrecisionForward" in r["runtime_modules"]
    same = reference_run(MLP, dp=dp, microbatches=2, steps=STEPS, lr=LR, precision="bf16-mixed")
    loss_diff, state_diff = _compare(ranks, same)
    assert loss_diff <= TIGHT and state_diff <= TIGHT, (loss_diff, state_diff)
    whole = reference_run(MLP, dp=dp, microbatches=2, steps=STEPS, lr=LR, precision="bf16-mixed", whole_batch=True)
    loss_diff, state_diff = _compare(ranks, whole)
    assert loss_diff <= WHOLE_BATCH and state_diff <= WHOLE_BATCH, (loss_diff, state_diff)
    # Negative control: the same training in fp32 is far outside TIGHT.
    fp32 = reference_run(MLP, dp=dp, microbatches=2, steps=STEPS, lr=LR)
    loss_diff, state_diff = _compare(ranks, fp32)
    assert max(loss_diff, state_diff) > 100 * TIGHT, (loss_diff, state_diff)


@pytest.mark.slow  # spawns ranks
def test_bf16_pipeline_equals_bf16_training(tmp_path: Path) -> None:
    """bfloat16 parameters, a tied weight on both stages, integer inputs; one micro-batch.

    With one micro-batch both runs add the tied weight's two gradients in one
    bfloat16 addition (more micro-batches would add them in another order, which
    bfloat16 rounds differently), so the runs agree to float32's tolerance.
    """
    plan = plan_model(TIED, tmp_path, pp=2, microbatches=1, precision="bf16")
    assert any(len(t.stages) == 2 for t in plan.tied)
    ranks = _train(tmp_path, TIED, plan.gpus, {"steps": STEPS, "lr": LR})
    for r in ranks:
        assert set(r["dtypes"].values()) == {"bfloat16"}
        assert r["parameter_dtypes"] == ["torch.bfloat16"]
    same = reference_run(TIED, dp=1, microbatches=1, steps=STEPS, lr=LR, precision="bf16")
    loss_diff, state_diff = _compare(ranks, same)
    assert loss_diff <= TIGHT and state_diff <= TIGHT, (loss_diff, state_diff)
    fp32 = reference_run(TIED, dp=1, microbatches=1, steps=STEPS, lr=LR)
    loss_diff, state_diff = _compare(ranks, fp32)
    assert max(loss_diff, state_diff) > 100 * TIGHT, (loss_diff, state_diff)
