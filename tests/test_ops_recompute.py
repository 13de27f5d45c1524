"""Per-op selective recomputation at run time: a layer run that recomputes only its cheap ops.

Checked: an ``"ops"`` run keeps its matmul outputs (live bytes after the forward lie
between keeping everything and recomputing wholly) and its backward re-runs the
pointwise ops and layer norms but no matmul (ops counted with a dispatch mode), for
``Recomputed`` and ZeRO-3's ``LayeredStage``; outputs and gradients are bit-identical
to the plain stage, dropout and bf16 autocast included; a run that writes in place recomputes wholly
(torch refuses a saved output written in place); counts the stage does not have are
refused; and a 2-rank pipeline whose stages recompute some runs wholly and some
runs' ops trains like the whole model under 1F1B, under ZB-H1 (our split backward)
and under ``engine="torch"``'s ZBV (which backpropagates twice: ops runs recompute
wholly there); and (slow) a ZeRO-3 stage, whose FSDP2 units gather inside the
per-op checkpointed forward, and a tensor-parallel one (DTensor).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import block_mlp
import ops_recompute_workers
import pytest
import torch
import torch.nn.functional as F
from schedule_workers import compare_with_reference
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from partitioner.errors import PlanMismatchError
from partitioner.graph.capture import capture
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile
from runtime.execute.recompute import SAVED_OPS, Recomputed, block_nodes, block_run, run_block
from runtime.parallel.shard import LayeredStage

SPEC = str(Path(__file__).parent / "models" / "block_mlp.py")
GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
STEPS = 3
TOLERANCE = 1e-5  # fp32, against the whole model in one process

Wrap = Callable[..., nn.Module]
WRAPS: dict[str, Wrap] = {
    "Recomputed": lambda gm, layers=None, ops=0: Recomputed(gm, layers=layers, ops_layers=ops),
    "LayeredStage": lambda gm, layers=None, ops=0: LayeredStage(
        gm, recompute=True if layers is None else layers, ops_layers=ops),
}


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny ops: one thread is many times faster than a pool contending for shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Ops(TorchDispatchMode):
    """Counts the aten ops run under it and keeps a weak reference to every tensor they make."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.counts[func.overloadpacket.__name__] += 1
        self.made += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def _graph(dropout: float = 0.0) -> fx.GraphModule:
    return capture(block_mlp.build_model(dropout), block_mlp.example_inputs(8)).graph_module


def _train(module: nn.Module, gm: fx.GraphModule, *, autocast: bool = False
           ) -> tuple[int, Counter[str], torch.Tensor, list[torch.Tensor]]:
    """Bytes the forward leaves alive for the backward, the backward's ops, the loss and the gradients (seeded).

    ``autocast``: the forward under CPU autocast to bfloat16 (bf16-mixed).
    """
    inputs, target = block_mlp.example_inputs(8), block_mlp.example_target(8)
    torch.manual_seed(5)
    forward = _Ops()
    with forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = block_mlp.loss_fn(module(*inputs)[0], target)
    gc.collect(1)  # the forward's garbage is young
    # Saved tensors (autograd's and the per-op checkpoint's cache) are what the forward made and still lives.
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in forward.made)
            if t is not None}
    backward = _Ops()
    with backward:
        grads = list(torch.autograd.grad(loss, list(gm.parameters())))
    return sum(live.values()), backward.counts, loss.detach(), grads


def test_the_saved_ops_are_matmuls_and_attention() -> None:
    names = {op.overloadpacket.__name__ for op in SAVED_OPS}
    assert {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"} <= names
    assert not names & {"gelu", "native_layer_norm", "add", "mul", "native_dropout", "_softmax"}
    # What the captured ops dispatch to on CPU: a linear (2-d and 3-d), a batched matmul, attention.
    x, w, b = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)
    with _Ops() as ops:
        F.linear(x[0], w, b), F.linear(x, w, b), F.linear(x, w), x @ x.transpose(1, 2)
        F.scaled_dot_product_attention(x[None], x[None], x[None], is_causal=True)
    assert {"addmm", "mm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"} <= set(ops.counts)


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_ops_runs_keep_matmul_outputs_and_recompute_the_rest(wrap: str) -> None:
    gm = _graph()
    runs = len(block_nodes(gm))  # embed, 4 blocks (layer norm, fc1, gelu, fc2, dropout, add), norm, head
    kept, plain_ops, _, _ = _train(gm, gm)
    full, full_ops, _, _ = _train(WRAPS[wrap](gm), gm)
    ops, ops_ops, _, _ = _train(WRAPS[wrap](gm, 0, runs), gm)
    mixed, _, _, _ = _train(WRAPS[wrap](gm, 2, 3), gm)  # embed, blocks.0 wholly; blocks.1-3 ops; norm, head kept
    # The blocks' 4x wider fc1 outputs stay with ops (not with full); GELU inputs' copies, masks, norm stats go.
    assert full < ops < kept and full < mixed < kept, (full, mixed, ops, kept)
    assert ops - full >= block_mlp.DEPTH * 8 * block_mlp.HIDDEN * 4  # at least each block's fc1 output
    # The backward re-runs the layer norms and GELUs of the ops runs, but no forward matmul (addmm), and no
    # more matmuls than the plain stage's gradients need; recomputing wholly re-runs the fc1 matmuls.
    assert ops_ops["addmm"] == 0 and ops_ops["mm"] == plain_ops["mm"], ops_ops
    assert ops_ops["gelu"] == block_mlp.DEPTH and ops_ops["native_layer_norm"] == block_mlp.DEPTH + 1
    assert plain_ops["gelu"] == plain_ops["native_layer_norm"] == 0
    assert full_ops["addmm"] >= block_mlp.DEPTH


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("wrap", list(WRAPS))
def test_ops_runs_change_no_number_with_dropout(wrap: str, autocast: bool) -> None:
    gm = _graph(0.3)
    _, _, loss, grads = _train(gm, gm, autocast=autocast)
    for layers, ops in ((0, len(block_nodes(gm))), (1, 2), (0, 1)):
        _, _, got_loss, got = _train(WRAPS[wrap](gm, layers, ops), gm, autocast=autocast)
        assert torch.equal(got_loss, loss), (layers, ops)
        assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True)), (layers, ops)
    # Control: the dropout masks matter, so equality above is not vacuous.
    torch.manual_seed(6)
    other = block_mlp.loss_fn(gm(*block_mlp.example_inputs(8))[0], block_mlp.example_target(8))
    assert not torch.equal(other.detach(), loss)


def test_kinds_follow_the_counts() -> None:
    gm = _graph()
    assert Recomputed(gm, layers=1, ops_layers=2).kinds == ("whole", "ops", "ops", "keep", "keep", "keep", "keep")
    only = Recomputed(gm, layers=0, ops_layers=7)
    assert (only.recomputed, only.ops_recomputed) == (0, 7)
    assert LayeredStage(gm, recompute=0, ops_layers=3).kinds == ("ops",) * 3 + ("keep",) * 4
    assert LayeredStage(gm, recompute=False).kinds == ("keep",) * 7
    assert Recomputed(gm).kinds == ("whole",) * 7


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_counts_the_stage_does_not_have_are_refused(wrap: str) -> None:
    gm = _graph()  # 7 runs
    with pytest.raises(PlanMismatchError, match=r"recomputes 5 layers wholly and the cheap ops of 3 more of a "
                                                r"stage that has 7 \(recompute_layers and recompute_ops_layers"):
        WRAPS[wrap](gm, 5, 3)
    with pytest.raises(PlanMismatchError, match="cheap ops of -1 more"):
        WRAPS[wrap](gm, 1, -1)
    with pytest.raises(PlanMismatchError, match="recomputes 0 layers of a stage that has 7"):
        WRAPS[wrap](gm, 0, 0)
    assert WRAPS[wrap](gm, 3, 4) is not None  # exactly the stage's runs


class _InPlace(nn.Module):
    """Two layers whose ReLU writes the linear's output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 2
        return x


def test_a_run_writing_in_place_recomputes_wholly() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    gm = capture(_InPlace(), (x,)).graph_module
    blocks = block_nodes(gm)
    run = Recomputed(gm, layers=0, ops_layers=2)
    assert run.kinds == ("whole", "whole")
    got = torch.autograd.grad(run(x)[0].sum(), list(gm.parameters()))
    want = torch.autograd.grad(gm(x)[0].sum(), list(gm.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # Control: torch's per-op checkpointing refuses that run (its saved matmul output was written).
    block, _, _ = block_run(gm, blocks, 0)
    (out,) = run_block(block, [x], "ops")
    with pytest.raises(RuntimeError, match="mutated"):
        torch.autograd.grad(out.sum(), list(gm.parameters()))


# ------------------------------------------------------------------ pipeline


def _plan(directory: Path, schedule: str, counts: list[tuple[int, int]], *, zero3: bool = False,
          spec: str = SPEC, tp: int = 1) -> Plan:
    """``spec`` (block_mlp) on 2 ranks, each stage given ``recompute="selective"`` with (whole, ops) run counts;
    saved.  ``zero3``: one stage on 2 replicas, ZeRO-3 (FSDP2 unit per layer run, resharded after forward);
    ``tp=2``: one stage split over 2 ranks (DTensor).
    """
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    dp = 2 if zero3 else 1
    pp = 2 // (dp * tp)
    plan = compile(model_file.build(), model_file.example_inputs(8), gpus=2, pp=pp, dp=dp, tp=tp,
                   microbatches=4 // (dp * tp), schedule=schedule, device="h100", shard="full" if zero3 else "none")
    stages = tuple(dataclasses.replace(s, recompute="selective", recompute_layers=n, recompute_ops_layers=k,
                                       reshard_after_forward=zero3)
                   for s, (n, k) in zip(plan.stages, counts, strict=True))
    dataclasses.replace(plan, stages=stages).save(directory)
    return Plan.load(directory)


def test_ops_recomputing_pipeline_trains_like_the_whole_model(tmp_path: Path) -> None:
    """pp=2, fp32, 3 steps: stage 0 (embed, blocks.0, blocks.1) recomputes its first run wholly and the next's
    ops, stage 1 (blocks.2, blocks.3, norm, head) the ops of two runs only; under 1F1B, ZB-H1 (our engine's split
    backward) and engine="torch"'s ZBV (4 stages; torch backpropagates twice, so ops runs recompute wholly)."""
    jobs = {
        "1f1b": (_plan(tmp_path / "1f1b", "1f1b", [(1, 1), (0, 2)]), "ours",
                 [["whole", "ops", "keep"]], [["ops", "ops", "keep", "keep"]]),
        "zb-h1": (_plan(tmp_path / "zb-h1", "zb-h1", [(1, 1), (0, 2)]), "ours",
                  [["whole", "ops", "keep"]], [["ops", "ops", "keep", "keep"]]),
        "zbv": (_plan(tmp_path / "zbv", "zbv", [(1, 1), (0, 1), (0, 1), (1, 1)]), "torch",
                [["whole", "whole"], ["whole", "whole", "keep"]], [["whole"], ["whole"]]),
    }
    _train_and_compare(jobs, tmp_path)


@pytest.mark.slow  # FSDP2's and DTensor's setup: seconds; the ops runs are checked in-process above
def test_ops_recomputing_zero3_and_tensor_parallel_stages_train_like_the_whole_model(tmp_path: Path) -> None:
    """ZeRO-3 (pp=1, dp=2, resharded after forward): FSDP2 gathers each layer unit inside the per-op
    checkpointed forward, and again for its recomputation.  Tensor parallel (examples/gpt.py, tp=2): the saved
    matmul and attention outputs are DTensors' local shards.  3 steps each against the whole model."""
    jobs = {
        "zero3": (_plan(tmp_path / "zero3", "1f1b", [(1, 4)], zero3=True), "ours",
                  *[[["whole", "ops", "ops", "ops", "ops", "keep", "keep"]]] * 2),
        "tp": (_plan(tmp_path / "tp", "gpipe", [(1, 6)], spec=GPT, tp=2), "ours",
               *[[["whole", "ops", "ops", "ops", "ops", "ops", "ops", "keep"]]] * 2),
    }
    _train_and_compare(jobs, tmp_path, specs={"tp": GPT})


def _train_and_compare(jobs: dict[str, tuple[Any, ...]], tmp_path: Path, *, specs: dict[str, str] | None = None
                       ) -> None:
    """Train every (plan, engine, kinds per rank) job in one spawn; check the kinds and the numbers."""
    spec = {name: (specs or {}).get(name, SPEC) for name in jobs}
    records = ops_recompute_workers.train_plans(
        [(tmp_path / name, job[1], spec[name]) for name, job in jobs.items()], steps=STEPS)
    for (name, (plan, _, *kinds)), ranks in zip(jobs.items(), records, strict=True):
        assert all(r and "error" not in r for r in ranks), (name, [r.get("error") for r in ranks])
        assert [r["kinds"] for r in ranks] == kinds, name
        diff = compare_with_reference(plan, spec[name], ranks)
        assert diff.largest() <= TOLERANCE and diff.compared >= STEPS * 2 * block_mlp.DEPTH, (name, diff)
