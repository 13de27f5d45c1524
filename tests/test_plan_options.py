"""Issue 8 options end to end: precision, optimizer, recomputation, GPUs per node, M and schedule search.

The memory and time checks use a model small enough to count by hand: four MLP
blocks ``Linear(64, 256) -> GELU -> Linear(256, 64)`` with biases, one block per
solver block (``max_blocks=4``), costs predicted for an H100.

* Parameters: ``E = 4 x (64 x 256 + 256 + 256 x 64 + 64) = 132,352`` elements.
* Saved for backward per sample, float32: ``fc1`` its input (64 values), GELU its
  input (256), ``fc2`` its input (256): ``576 x 4 = 2,304`` bytes per block.
* Kept per sample by a recomputing block (Korthikanti et al. 2022): its input
  only, ``64 x 4 = 256`` bytes; during its backward one block's activations live again.
* Static bytes per parameter element with Adam: fp32 16, bf16-mixed 16, bf16 8;
  with SGD (one state) fp32 12.  Float32 activations halve under bf16.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import compile
from partitioner.cost.devices import DEVICES
from partitioner.cost.nodes import profile
from partitioner.defaults import SCHEDULES
from partitioner.errors import AutopartitionError, InfeasibleError
from partitioner.graph.capture import capture
from partitioner.graph.values import propagate_values
from partitioner.plan import FORMAT_VERSION, Plan
from partitioner.report.markdown import report_markdown
from partitioner.report.table import WIDTH, format_plan
from partitioner.solve.formulate import node_times

D = 64
BLOCKS = 4
E = BLOCKS * (D * 4 * D + 4 * D + 4 * D * D + D)  # parameter elements
SAVED = (D + 4 * D + 4 * D) * 4  # float32 bytes saved per sample per block
KEPT = D * 4  # bytes a recomputing block keeps per sample: its input
OPS_KEPT = (D + 4 * D + D) * 4  # and one recomputing only its cheap ops: its input and both linears' outputs
H100 = DEVICES["h100"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.fixture(scope="module")
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def _plan(model: nn.Module, batch: int = 8, **options: Any) -> Plan:
    options = {"gpus": 1, "microbatches": 2, "schedule": "gpipe", "device": "h100", "max_blocks": BLOCKS,
               "recompute": "none", **options}
    return compile(model, (torch.randn(batch, D),), **options)  # type: ignore[arg-type]


def test_hand_counted_model() -> None:
    assert E == 132_352 and SAVED == 2_304 and KEPT == 256


# ----------------------------------------------------------------- precision and recomputation


@pytest.mark.parametrize(
    ("precision", "optimizer", "per_element", "activation_scale"),
    [("fp32", "adam", 16, 1.0), ("bf16-mixed", "adam", 16, 0.5), ("bf16", "adam", 8, 0.5),
     ("fp32", "sgd", 12, 1.0), ("bf16", "sgd", 6, 0.5)],
)
def test_memory_follows_precision_and_optimizer(
    mlp: nn.Module, precision: str, optimizer: str, per_element: int, activation_scale: float
) -> None:
    # One GPU, GPipe, 2 micro-batches of 4 samples: both held at the peak.
    plan = _plan(mlp, precision=precision, optimizer=optimizer)
    (stage,) = plan.stages
    activations = BLOCKS * 4 * SAVED * activation_scale  # per micro-batch
    assert stage.predicted.activation_bytes == activations
    assert stage.predicted.memory_bytes == per_element * E + 2 * activations
    assert plan.predicted.peak_memory_bytes == (stage.predicted.memory_bytes,)  # the simulation agrees
    assert (plan.precision, plan.optimizer) == (precision, optimizer)
    assert plan.cost_model.optimizer_states == {"adam": 2, "sgd": 1}[optimizer]
    assert stage.recompute == "none" and stage.predicted.recompute_s == 0.0


@pytest.mark.parametrize(("precision", "scale"), [("fp32", 1.0), ("bf16-mixed", 0.5), ("bf16", 0.5)])
def test_full_recomputation_memory_and_time(mlp: nn.Module, precision: str, scale: float) -> None:
    kept = _plan(mlp, precision=precision)
    redo = _plan(mlp, precision=precision, recompute="full")
    (k,), (r,) = kept.stages, redo.stages
    static = k.predicted.memory_bytes - 2 * k.predicted.activation_bytes
    # static + in flight x (block inputs) + one block's activations during its backward
    assert r.recompute == "full"
    assert r.predicted.activation_bytes == BLOCKS * 4 * KEPT * scale
    assert r.predicted.recompute_peak_bytes == 4 * SAVED * scale
    assert r.predicted.memory_bytes == static + 2 * BLOCKS * 4 * KEPT * scale + 4 * SAVED * scale
    assert redo.predicted.peak_memory_bytes == (r.predicted.memory_bytes,)
    # time: one more forward of every block in the backward
    assert r.predicted.forward_s == k.predicted.forward_s
    assert r.predicted.recompute_s == pytest.approx(k.predicted.forward_s, rel=1e-12)
    assert r.predicted.backward_s == pytest.approx(k.predicted.backward_s + k.predicted.forward_s, rel=1e-12)
    # model FLOPs (for the MFU) do not count the recomputation
    assert redo.predicted.model_flops == kept.predicted.model_flops


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_stage_times_are_the_nodes_roofline_at_the_precision(mlp: nn.Module, precision: str) -> None:
    plan = _plan(mlp, precision=precision)
    micro = (torch.randn(4, D),)
    captured = capture(mlp, micro, method=plan.model.capture)  # type: ignore[arg-type]
    propagate_values(captured.graph_module, micro)
    times = node_times(profile(captured, micro, measure=False), H100, precision=precision)
    (stage,) = plan.stages
    assert stage.predicted.forward_s == pytest.approx(sum(f for f, _ in times.values()), rel=1e-12)
    assert stage.predicted.backward_s == pytest.approx(sum(b for _, b in times.values()), rel=1e-12)


def test_mfu_by_hand(mlp: nn.Module) -> None:
    batch = 8
    plan = _plan(mlp, batch=batch, precision="bf16-mixed")
    forward = batch * 2 * (D * 4 * D) * 2 * BLOCKS  # two matmuls per block, 2 FLOPs per multiply-add
    first_input_gradient = batch * 2 * D * 4 * D  # the model's input needs no gradient
    flops = 3 * forward - first_input_gradient
    assert plan.predicted.model_flops == flops
    assert plan.cost_model.peak_flops == 989e12  # bf16 compute on an H100
    assert plan.predicted.mfu == pytest.approx(flops / (1 * 989e12 * plan.predicted.step_s), rel=1e-12)
    fp32 = _plan(mlp, batch=batch)
    assert fp32.cost_model.peak_flops == 67e12 and fp32.predicted.model_flops == flops
    assert fp32.predicted.mfu == pytest.approx(flops / (67e12 * fp32.predicted.step_s), rel=1e-12)
    assert "MFU" in format_plan(plan) and "MFU" in report_markdown(plan)


def test_recomputation_only_where_it_is_needed(mlp: nn.Module) -> None:
    # Two stages of two blocks, 1F1B with 8 micro-batches of 8: stage 0 holds 2 in flight, stage 1 one.
    options = {"gpus": 2, "pp": 2, "microbatches": 8, "schedule": "1f1b"}
    static = 16 * E / 2
    activations = 2 * 8 * SAVED  # two blocks, 8 samples
    limit = static + 1.5 * activations  # stage 1 keeps (1 in flight); stage 0 (2 in flight) cannot
    plan = _plan(mlp, batch=64, recompute="auto", memory_per_gpu=limit, **options)
    # Stage 0 recomputes its first block wholly and only the cheap op (GELU) of its second: that fits, and
    # costs less than recomputing both wholly (solve/headroom.py).
    assert [(s.recompute, s.recompute_layers, s.recompute_ops_layers) for s in plan.stages] == \
        [("selective", 1, 1), ("none", 0, 0)]
    assert [len(s.parameters) for s in plan.stages] == [8, 8]  # the balanced split, not a lopsided one
    first, second = (s.predicted for s in plan.stages)
    assert first.memory_bytes == static + 2 * 8 * (KEPT + OPS_KEPT) + 8 * SAVED <= limit
    assert second.memory_bytes == static + activations <= limit
    assert first.recompute_s > 0 and second.recompute_s == 0
    assert "first 1 run, 1 ops-only" in format_plan(plan)
    candidate = next(c for c in plan.candidates if c.note == "chosen")
    assert candidate.recomputed_stages == 1
    # Without recomputation nothing fits; the message says what would.
    with pytest.raises(InfeasibleError) as info:
        _plan(mlp, batch=64, recompute="none", memory_per_gpu=limit, **options)
    message = " ".join(str(info.value).split())
    assert "fp32 with adam, 16 bytes per parameter; no recomputation" in message
    assert "It would fit on 3 GPUs" in message and "With --recompute auto (or full) it would fit on 2 GPUs" in message


# ----------------------------------------------------------------- infeasible, bad options


def test_fits_nowhere_says_how_many_gpus(mlp: nn.Module) -> None:
    # 1 KiB per GPU: not even one block's weights fit, whatever the precision or recomputation.
    with pytest.raises(InfeasibleError) as info:
        _plan(mlp, gpus=2, recompute="auto", precision="bf16", memory_per_gpu=1024.0)
    message = " ".join(str(info.value).split())
    assert "over 2 GPUs fits in 1.00 KiB per GPU" in message
    assert "bf16 with adam, 8 bytes per parameter; recomputation where it helps" in message
    assert f"Even {BLOCKS} stages" in message
    assert f"alone take {8 * E / 2**20:.2f} MiB, at least {-(-8 * E // 1024)} GPUs' worth" in message
    assert "--precision" not in message  # nothing cheaper to suggest


def test_precision_is_suggested_when_it_helps(mlp: nn.Module) -> None:
    # Adam fp32 static and one micro-batch of fp32 activations on one GPU: bf16-mixed halves the activations.
    activations = BLOCKS * 8 * SAVED
    limit = 16 * E + 0.75 * activations
    with pytest.raises(InfeasibleError) as info:
        _plan(mlp, microbatches=1, memory_per_gpu=limit)
    message = " ".join(str(info.value).split())
    assert "With --precision bf16-mixed it would fit on 1 GPUs" in message
    assert "--recompute auto" in message  # recomputation alone would do too
    plan = _plan(mlp, microbatches=1, memory_per_gpu=limit, precision="bf16-mixed")
    assert plan.stages[0].predicted.memory_bytes == 16 * E + activations / 2


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"gpus": 8, "gpus_per_node": 3}, r"--gpus-per-node 3 does not divide --gpus 8.*1, 2, 4, 8"),
        ({"gpus": 4, "gpus_per_node": 8}, r"--gpus-per-node 8 does not divide --gpus 4"),
        ({"precision": "fp16"}, r"Unknown precision 'fp16'"),
        ({"optimizer": "lion"}, r"Unknown optimizer 'lion'"),
        ({"recompute": "some"}, r"Unknown recomputation 'some'"),
        ({"microbatches": "many"}, r"--microbatches must be a whole number or 'auto'"),
        ({"schedule": "zerobubble"},
         r"Unknown schedule 'zerobubble'; choose one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, or auto"),
    ],
)
def test_bad_options(mlp: nn.Module, options: dict[str, Any], pattern: str) -> None:
    with pytest.raises(AutopartitionError, match=pattern):
        _plan(mlp, **options)


# ----------------------------------------------------------------- search


def test_microbatches_and_schedule_auto(mlp: nn.Module) -> None:
    plan = _plan(mlp, batch=32, gpus=2, microbatches="auto", schedule="auto")
    assert plan.batch_size % (plan.dp * plan.microbatches) == 0
    combos = {(c.pp, c.dp, c.microbatches, c.schedule) for c in plan.candidates}
    # pp x dp over the divisors, M over the divisors of each replica's batch, every schedule on two
    # ranks (interleaved with 2 stages per rank: 4 blocks), the one-stage schedules on one
    assert {(c.pp, c.dp) for c in plan.candidates} == {(2, 1), (1, 2)}
    assert {m for p, d, m, s in combos if d == 1} == {1, 2, 4, 8, 16, 32}
    assert {m for p, d, m, s in combos if d == 2} == {1, 2, 4, 8, 16}
    assert {s for p, d, m, s in combos if p == 2} == set(SCHEDULES)
    assert {s for p, d, m, s in combos if p == 1} == {"gpipe", "1f1b"}
    (chosen,) = [c for c in plan.candidates if c.note == "chosen"]
    assert (chosen.pp, chosen.dp, chosen.microbatches, chosen.schedule) == (
        plan.pp, plan.dp, plan.microbatches, plan.schedule)
    simulated = [c for c in plan.candidates if c.simulated_s is not None]
    # The best three by closed form, and the best of each other schedule (search.best_candidates).
    assert len(simulated) >= 3 and chosen.simulated_s == min(c.simulated_s or 0.0 for c in simulated)
    assert {c.schedule for c in simulated} == {c.schedule for c in plan.candidates if c.pp > 1 and c.step_s}
    assert chosen.simulated_s == plan.predicted.step_s
    for c in plan.candidates:
        if c is chosen:
            continue
        assert c.note.startswith(("slower: +", "slower: at least +", "does not fit", "same step: one stage",
                                  "interleaved-1f1b needs a multiple of 2 micro-batches")), c
        if c.status == "pruned":
            assert c.step_s is None and c.note.endswith("(bound)")
        elif c.simulated_s is not None:
            assert c.note.endswith("(simulated)") or "(simulated), bubble" in c.note
    # The text table has M and schedule columns and fits 100 columns.
    text = format_plan(plan)
    header = next(line for line in text.splitlines() if "why not chosen" in line)
    assert header.split() == ["pp", "dp", "M", "sched", "recomp", "closed", "form", "simulated", "why", "not",
                              "chosen"]
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    report = report_markdown(plan)
    assert "| pp x dp | M | schedule | shard | recomputes |" in report
    assert sum(line.startswith("| ") for line in report.split("## Combinations")[1].split("##")[0].splitlines()) \
        == len(plan.candidates) + 1


def test_memory_prunes_small_microbatch_counts(mlp: nn.Module) -> None:
    # With GPipe every micro-batch is in flight; with 1F1B on one stage one is: few large ones do not fit.
    activations = BLOCKS * 32 * SAVED  # the whole batch at once
    plan = _plan(mlp, batch=32, microbatches="auto", schedule="1f1b", memory_per_gpu=16 * E + activations / 3)
    assert plan.microbatches >= 4
    too_big = [c for c in plan.candidates if c.microbatches in (1, 2)]
    assert too_big and all(c.note.startswith("does not fit: needs") for c in too_big)
    for c in too_big:
        assert c.memory_bytes is not None and c.memory_bytes > 16 * E + activations / 3


class Branchy(nn.Module):
    """Exported at one sample, its graph has one more node: plans for that size cannot use the costed graph."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            x = x * 1.0
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_a_winner_whose_graph_differs_is_planned_on_its_own_graph() -> None:
    # Two stages, a batch of 2 long sequences: two micro-batches of one sample simulate faster, and
    # the graph exported at one sample (one node more) is not the costed one: the winner is built on it.
    torch.manual_seed(0)
    plan = compile(Branchy(), (torch.randn(2, 8192, 256),), gpus=2, pp=2, microbatches="auto",
                   schedule="gpipe", device="h100", capture_method="export")
    assert (plan.microbatches, plan.microbatch_size) == (2, 1)
    (other,) = [c for c in plan.candidates if c.microbatches == 1]
    assert other.simulated_s is None or other.simulated_s > plan.predicted.step_s
    costed = capture(Branchy(), (torch.randn(2, 8192, 256),), method="export").graph_module.graph.nodes
    planned = {n for s in plan.stages for n in s.nodes}
    assert planned - {n.name for n in costed}, "the plan's stages hold the one-sample graph's nodes"


# ----------------------------------------------------------------- topology


@pytest.mark.parametrize(
    ("pp", "dp", "boundaries", "allreduce"),
    [(4, 1, ["intra", "inter", "intra"], ["intra"] * 4),  # ranks 0 1 | 2 3
     (2, 2, ["inter"], ["intra", "intra"]),  # stage 0 on node 0, stage 1 on node 1
     (1, 4, [], ["inter"])],  # one all-reduce over both nodes
)
def test_links_follow_the_node_layout(
    mlp: nn.Module, pp: int, dp: int, boundaries: list[str], allreduce: list[str]
) -> None:
    plan = _plan(mlp, batch=16, gpus=4, pp=pp, dp=dp, gpus_per_node=2)
    assert plan.gpus_per_node == 2
    assert [b.link for s in plan.stages for b in s.outputs] == boundaries
    assert [s.allreduce_link for s in plan.stages] == allreduce
    text = format_plan(plan)
    assert "2 nodes of 2" in text and "50 GB/s, 15 µs between nodes" in text
    crossing = [f"{b.source}->{b.target}" for s in plan.stages for b in s.outputs if b.link == "inter"]
    if crossing:
        assert f"boundaries {', '.join(crossing)} cross nodes" in text
    if "inter" in allreduce and dp > 1:
        assert "the all-reduces of stages 0 cross nodes" in text
    one_node = _plan(mlp, batch=16, gpus=4, pp=pp, dp=dp)
    assert one_node.gpus_per_node == 4 and "everything stays inside one node" in format_plan(one_node)
    assert plan.predicted.step_s >= one_node.predicted.step_s


# ----------------------------------------------------------------- plan.json


def test_options_round_trip_into_plan_json(mlp: nn.Module, tmp_path: Path) -> None:
    plan = _plan(mlp, batch=16, gpus=4, pp=2, dp=2, precision="bf16-mixed", optimizer="sgd",
                 recompute="full", gpus_per_node=2, microbatches="auto", schedule="auto")
    directory = plan.save(tmp_path / "plan")
    data = json.loads((directory / "plan.json").read_text())
    assert data["format_version"] == FORMAT_VERSION == 3
    assert (data["precision"], data["optimizer"], data["gpus_per_node"]) == ("bf16-mixed", "sgd", 2)
    assert [s["recompute"] for s in data["stages"]] == ["full", "full"]
    assert [s["allreduce_link"] for s in data["stages"]] == ["intra", "intra"]
    assert [b["link"] for b in data["stages"][0]["outputs"]] == ["inter"]
    assert data["predicted"]["mfu"] == plan.predicted.mfu and 0 < data["predicted"]["mfu"] < 1
    assert data["predicted"]["model_flops"] > 0
    assert data["cost_model"]["optimizer_states"] == 1 and data["cost_model"]["peak_flops"] == 989e12
    assert all(c["microbatches"] and c["schedule"] in SCHEDULES for c in data["candidates"])
    assert Plan.load(directory) == plan
    # A misspelt name is a corrupt plan.
    data["stages"][0]["recompute"] = "partial"
    (directory / "plan.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match=r"plan.stages\[0\].recompute is 'partial'"):
        Plan.load(directory)


def _as_version_1(data: dict[str, object]) -> dict[str, object]:
    """A current plan's JSON in the layout of format version 1 (before issue 8)."""
    old = json.loads(json.dumps(data))
    old["format_version"] = 1
    for key in ("precision", "optimizer", "gpus_per_node"):
        del old[key]
    for stage in old["stages"]:  # type: ignore[attr-defined]
        del stage["recompute"], stage["allreduce_link"]
        del stage["predicted"]["recompute_s"], stage["predicted"]["recompute_peak_bytes"]
        for boundary in (*stage["inputs"], *stage["outputs"]):
            del boundary["link"]
    del old["predicted"]["model_flops"], old["predicted"]["mfu"]  # type: ignore[attr-defined]
    for key in ("inter_node_bandwidth", "inter_node_latency", "peak_flops"):
        del old["cost_model"][key]  # type: ignore[attr-defined]
    for c in old["candidates"]:  # type: ignore[attr-defined]
        for key in ("microbatches", "schedule", "recomputed_stages", "memory_bytes", "bubble_fraction"):
            del c[key]
    return old


def test_version_1_plans_still_load(mlp: nn.Module, tmp_path: Path) -> None:
    plan = _plan(mlp, batch=16, gpus=4, pp=2, dp=2, gpus_per_node=2, optimizer="sgd")
    directory = plan.save(tmp_path / "plan")
    old = _as_version_1(json.loads((directory / "plan.json").read_text()))
    (directory / "plan.json").write_text(json.dumps(old))
    loaded = Plan.load(directory)
    assert loaded.format_version == FORMAT_VERSION
    assert (loaded.precision, loaded.optimizer, loaded.gpus_per_node) == ("fp32", "sgd", 4)
    assert [s.recompute for s in loaded.stages] == ["none", "none"]
    assert {b.link for s in loaded.stages for b in (*s.inputs, *s.outputs)} == {"intra"}
    assert {s.allreduce_link for s in loaded.stages} == {"intra"}
    assert loaded.predicted.mfu is None and loaded.predicted.model_flops is None
    assert all((c.microbatches, c.schedule) == (plan.microbatches, plan.schedule) for c in loaded.candidates)
    # It reads as the plan it was, less what version 1 did not record (one node, no MFU).
    same = dataclasses.replace(plan, gpus_per_node=4, predicted=dataclasses.replace(
        plan.predicted, model_flops=None, mfu=None))
    assert [s.nodes for s in loaded.stages] == [s.nodes for s in same.stages]
    assert loaded.stages[0].predicted.memory_bytes == plan.stages[0].predicted.memory_bytes
    text = format_plan(loaded)  # and shows, without an MFU
    assert "MFU: not known" in text and "one node of 4" in text
    assert report_markdown(loaded)


# ----------------------------------------------------------------- the 1.3B GPT of issue 8


def test_gpt_1_3b_plans_in_seconds_and_fits() -> None:
    """24 layers, d 2,048, 16 heads, seq 2,048, vocab 50,257, built on meta: bf16-mixed on 8 H100s, batch 32."""
    from _examples import example

    gpt = example("gpt")
    config = gpt.GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    with torch.device("meta"):
        model = gpt.GPT(config)
    tokens = torch.zeros(32, 2048, dtype=torch.long)
    start = time.perf_counter()
    plan = compile(model, (tokens,), gpus=8, device="h100", precision="bf16-mixed",
                   microbatches="auto", schedule="auto")
    wall = time.perf_counter() - start
    print(f"1.3B GPT planned in {wall:.1f} s: {plan.pp} x {plan.dp}, M = {plan.microbatches}, "
          f"{plan.schedule}, MFU {plan.predicted.mfu:.1%}")
    assert 1.2e9 < plan.model.parameters < 1.4e9
    assert max(plan.predicted.peak_memory_bytes) <= 80e9
    assert plan.predicted.mfu is not None and 0.2 < plan.predicted.mfu < 1
    assert wall < 30
