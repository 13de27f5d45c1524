"""Recomputation at run time: a stage the plan marks ``recompute="full"`` checkpoints each layer.

Checked: blocks follow the model's layers; recomputation changes no number (outputs
and gradients bit-identical, dropout included, also when input and parameter
gradients are taken in two backward calls as a B/W split does); it lowers the
bytes autograd keeps between forward and backward (measured with
``saved_tensors_hooks``); and a pipeline with a recomputing plan trains like the
whole model (spawned CPU ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import block_mlp
import pytest
import runtime_workers
import torch
from rank_workers import spawn_and_wait
from runtime_workers import plan_model, reference_run
from torch import fx

from partitioner.graph.capture import capture
from runtime.execute.recompute import Recomputed, block_nodes
from runtime.verify import free_port

SPEC = str(Path(__file__).parent / "models" / "block_mlp.py")
STEPS = 3
LR = 0.1
TOLERANCE = 1e-6


def _graph(dropout: float) -> tuple[fx.GraphModule, tuple[torch.Tensor, ...], torch.Tensor]:
    inputs = block_mlp.example_inputs(8)
    return capture(block_mlp.build_model(dropout), inputs).graph_module, inputs, block_mlp.example_target(8)


def _run(module: torch.nn.Module, gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
         *, seed: int = 5) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    loss = block_mlp.loss_fn(module(*inputs)[0], target)
    return loss.detach(), list(torch.autograd.grad(loss, list(gm.parameters())))


def test_blocks_are_the_model_layers_with_glue_joining_the_layer_before() -> None:
    gm, _, _ = _graph(0.0)
    blocks = block_nodes(gm)
    assert blocks[0] == ("embed",) and blocks[-2:] == [("norm",), ("head",)]
    assert len(blocks) == block_mlp.DEPTH + 3
    # The residual add (root-level code) closes its layer's block.
    assert blocks[1] == ("blocks_0_ln", "blocks_0_fc1", "gelu", "blocks_0_fc2", "blocks_0_drop", "add")
    assert Recomputed(gm).blocks == len(blocks)


def test_recomputation_changes_no_number_with_dropout() -> None:
    gm, inputs, target = _graph(0.3)
    plain_loss, plain_grads = _run(gm, gm, inputs, target)
    run = Recomputed(gm)
    assert [n for n, _ in run.named_parameters()] == [f"stage.{n}" for n, _ in gm.named_parameters()]
    loss, grads = _run(run, gm, inputs, target)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    # Control: the dropout masks matter (another seed, other numbers), so equality above is not vacuous.
    other, _ = _run(gm, gm, inputs, target, seed=6)
    assert not torch.equal(other, plain_loss)


def test_input_and_parameter_gradients_in_two_backward_calls() -> None:
    """What a zero-bubble schedule does (B: inputs' gradient, W: parameters'): recomputed for each call."""
    gm, inputs, target = _graph(0.3)

    def split(module: torch.nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(5)
        x = inputs[0].clone().requires_grad_()
        loss = block_mlp.loss_fn(module(x)[0], target)
        (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        return [dx, *torch.autograd.grad(loss, list(gm.parameters()))]

    assert all(torch.equal(a, b) for a, b in zip(split(Recomputed(gm)), split(gm), strict=True))


def _saved_bytes(forward: Callable[[], torch.Tensor], parameters: list[torch.nn.Parameter]) -> int:
    """Bytes of the distinct storages autograd keeps from forward to backward, parameters excluded."""
    weights = {p.untyped_storage().data_ptr() for p in parameters}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    return sum(kept.values())


def test_recomputation_lowers_saved_activation_bytes() -> None:
    gm, inputs, target = _graph(0.3)
    params = list(gm.parameters())
    run = Recomputed(gm)
    plain = _saved_bytes(lambda: block_mlp.loss_fn(gm(*inputs)[0], target), params)
    again = _saved_bytes(lambda: block_mlp.loss_fn(run(*inputs)[0], target), params)
    # Kept: each block's input (8 x 16 floats) and the logits' softmax; gone: the 4x wider hidden
    # activations, GELU inputs, dropout masks and layer-norm statistics of every block.
    assert again < plain / 4, (again, plain)
    batch = 8
    assert again <= (len(block_nodes(gm)) + 1) * batch * block_mlp.WIDTH * 4 + batch * block_mlp.NUM_CLASSES * 4


@pytest.mark.parametrize("how", ["whole", "ops", "layered"])
def test_recomputed_runs_write_batchnorm_statistics_and_in_place_inputs_once(how: str) -> None:
    """A ResNet with BatchNorm and ``nn.ReLU(inplace=True)``: recomputing it changes no output, gradient or
    running statistic.  (Recomputed naively, each BatchNorm counts a batch twice, and checkpoint refuses the
    ReLU's write into an input it keeps.)"""
    import resnet_inplace

    from runtime.parallel.shard import LayeredStage

    inputs = resnet_inplace.example_inputs(4)
    torch.manual_seed(0)
    plain = capture(resnet_inplace.build_model(), inputs).graph_module
    torch.manual_seed(0)
    gm = capture(resnet_inplace.build_model(), inputs).graph_module
    runs = len(block_nodes(gm))
    module: torch.nn.Module = {
        "whole": lambda: Recomputed(gm),
        "ops": lambda: Recomputed(gm, layers=0, ops_layers=runs),
        "layered": lambda: LayeredStage(gm, recompute=True),
    }[how]()
    results = []
    for m, owner in ((plain, plain), (module, gm)):
        out = m(*inputs)
        (out[0] if isinstance(out, (tuple, list)) else out).square().sum().backward()
        results.append((out, {n: p.grad for n, p in owner.named_parameters()}, dict(owner.named_buffers())))
    (out_a, grads_a, buffers_a), (out_b, grads_b, buffers_b) = results
    assert torch.equal(out_a[0] if isinstance(out_a, (tuple, list)) else out_a,
                       out_b[0] if isinstance(out_b, (tuple, list)) else out_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.allclose(grads_a[n], grads_b[n]) for n in grads_a)
    assert any("num_batches_tracked" in n for n in buffers_a)
    assert all(torch.equal(buffers_a[n], buffers_b[n]) for n in buffers_a), "running statistics written twice"


def test_without_gradients_blocks_just_run() -> None:
    gm, inputs, _ = _graph(0.0)
    with torch.no_grad():
        assert torch.equal(Recomputed(gm)(*inputs)[0], gm(*inputs)[0])


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_recomputing_pipeline_trains_like_the_whole_model(tmp_path: Path, schedule: str) -> None:
    """Two ranks: one stage each, or two each (interleaved)."""
    plan = plan_model(SPEC, tmp_path, pp=2, microbatches=2, schedule=schedule, recompute="full")
    assert [s.recompute for s in plan.stages] == ["full"] * (4 if schedule == "interleaved-1f1b" else 2)
    out = tmp_path / "out"
    out.mkdir()
    codes = spawn_and_wait(
        runtime_workers.train_worker, 2, (2, free_port(), str(tmp_path), SPEC, str(out), {"steps": STEPS, "lr": LR}),
        limit_s=120)
    assert codes == [0, 0], f"rank exit codes {codes}"
    ranks: list[dict[str, Any]] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all("Recomputed" in r["runtime_modules"] for r in ranks)
    want = reference_run(SPEC, dp=1, microbatches=2, steps=STEPS, lr=LR)
    last = next(r for r in ranks if r["losses"][0] is not None)
    for a, b in zip(last["losses"], want["losses"], strict=True):
        assert abs(a - b) <= TOLERANCE
    for rank, r in enumerate(ranks):
        for name, value in r["state"].items():
            diff = float((value - want["state"][name]).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"
