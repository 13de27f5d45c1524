"""bf16-mixed fully sharded stages (issue 21): FSDP2 gathers bfloat16 copies and reduces in float32; the cost
model prices exactly what it holds and moves.

One job of four really spawned CPU ranks (gloo) runs, at pp=2 x dp=2 under ``1f1b`` and ``bf16-mixed``, 2 SGD
steps of: the tiny tied LM (its embedding, in stage 0, is its LM head in stage 1) planned ``none``, ``full``
kept gathered and ``full`` ZeRO-3, and the tiny MLP under ZeRO-3 (equal layers, so its transient is exactly the
formula's).  Checked: every fully sharded stage computes with bfloat16 weights under FSDP2's policy while its
sharded gradients stay float32; losses and gradients match the same plan unsharded (and the whole model under
autocast in one process) within bf16 tolerance; the bytes FSDP2 really holds beyond the shards at each unit's
post-backward and each forward are those :mod:`partitioner.cost.precision` prices.  The tied LM's embedding
gathered in bf16 makes its residual stream, and so the boundary tensor, bf16: the ranks must agree on that
(``runtime.parallel.shard.bf16_gathered_parameters``) or the stages cannot talk.

Without ranks: the byte formulas under each precision (fp32 as before the policy).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import shard_workers
import torch
from rank_workers import spawn_and_wait
from shard_workers import plan_sharded, reference

from partitioner.cost.comm import link
from partitioner.cost.devices import DEVICES
from partitioner.cost.precision import (
    gathered_bytes,
    gradient_bytes,
    shard_footprint,
    weight_bytes,
    zero3_transient_bytes,
)
from partitioner.solve.formulate import GraphCosts, formulate, zero3_costs
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
TIED = str(MODELS / "tied_lm.py")
MLP = str(MODELS / "mlp.py")
STEPS = 2
# bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3).  The fully sharded stages read bf16-rounded copies
# of the weights in the ops autocast leaves alone (the embedding lookup, the layer norm's affine, the bias adds
# outside a matmul), where the unsharded stages read float32: differences of a few roundoffs per op.  Gradients:
# each tensor within 8 roundoffs of its largest entry (seen: up to 2.3 roundoffs); losses (means over many
# tokens) within 1e-3 relative (seen: 5e-5).
GRADIENT_RTOL = 8 * 2**-8
LOSS_RTOL = 1e-3
# name: (model, shard, reshard_after_forward)
CASES = {
    "tied-none": (TIED, "none", False),
    "tied-gathered": (TIED, "full", False),
    "tied-zero3": (TIED, "full", True),
    "mlp-zero3": (MLP, "full", True),
}
SAVED = "tied-zero3-adamw-saved"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("shard-bf16")
    out = root / "out"
    out.mkdir()
    cases = []
    for name, (spec, shard, reshard) in CASES.items():
        plan_sharded(spec, root / name, schedule="1f1b", shard=shard, reshard_after_forward=reshard,
                     precision="bf16-mixed")
        cases.append({"name": name, "plan": str(root / name), "spec": spec, "optimizer": "sgd", "steps": STEPS,
                      "grads": True, "probe": shard == "full"})
    # One AdamW step of the ZeRO-3 plan, checkpointed (DCP): what FSDP2's policy must leave float32.
    cases.append({"name": SAVED, "plan": str(root / "tied-zero3"), "spec": TIED, "optimizer": "plain", "steps": 1,
                  "save": str(root / "ckpt")})
    start = time.monotonic()
    codes = spawn_and_wait(shard_workers.shard_worker, 4, (4, free_port(), TIED, str(out), cases), limit_s=120)
    seconds = time.monotonic() - start
    results = {c["name"]: [torch.load(out / f"{c['name']}-rank{r}.pt", weights_only=False) for r in range(4)]
               for c in cases if (out / f"{c['name']}-rank0.pt").exists()}
    errors = {n: [r["error"] for r in rs if r["error"]] for n, rs in results.items()}
    assert codes == [0] * 4 and not any(errors.values()), (
        f"rank exit codes {codes} (None: still running after 120 s); errors {errors}; "
        f"{[r.get('traceback', '')[-3000:] for rs in results.values() for r in rs if r['error']][:1]}")
    whole = reference(TIED, dp=2, microbatches=2, steps=STEPS, optimizer="sgd", precision="bf16-mixed")
    return {"results": results, "whole": whole, "seconds": seconds, "checkpoint": root / "ckpt"}


def _worst_gradient(ranks: list[dict[str, Any]], want: list[dict[str, Any]] | dict[str, Any]) -> float:
    """The largest |difference| over every step's gradients, relative to each tensor's largest entry."""
    worst = 0.0
    for i, r in enumerate(ranks):
        other = want[i]["grads"] if isinstance(want, list) else want["grads"]
        for got, expected in zip(r["grads"], other, strict=True):
            for name, g in got.items():
                worst = max(worst, float((g - expected[name]).abs().max() / expected[name].abs().max()))
    return worst


def test_fully_sharded_stages_compute_with_bf16_gathered_weights(runs: dict[str, Any]) -> None:
    """FSDP2's policy on every unit: bf16 gathered weights in every parametrised op, fp32 sharded gradients."""
    for name in ("tied-gathered", "tied-zero3", "mlp-zero3"):
        for r in runs["results"][name]:
            probe = r["probe"]
            assert probe["policies"] == [("torch.bfloat16", "torch.float32")], (name, probe["policies"])
            assert probe["weight_dtypes"] == ["torch.bfloat16"], (name, probe["weight_dtypes"])
            assert r["grad_dtypes"] == ["torch.float32"] and r["parameter_types"] == ["DTensor"], name
    for r in runs["results"]["tied-none"]:  # autocast over float32 weights (DDP): no FSDP2, no probe
        assert r["grad_dtypes"] == ["torch.float32"] and r["parameter_types"] == ["Parameter"]


def test_bf16_fully_sharded_training_matches_the_unsharded_plan(runs: dict[str, Any]) -> None:
    results, whole = runs["results"], runs["whole"]
    none = results["tied-none"]
    # The unsharded plan is the whole model under autocast (fp32 weights): equal up to the replicas' sums' order.
    assert _worst_gradient(none, whole) <= 1e-5
    for name in ("tied-gathered", "tied-zero3"):
        worst = _worst_gradient(results[name], none)
        print(f"{name}: worst gradient difference {worst:.2e} of the tensor's largest entry (job {runs['seconds']:.1f} s)")
        assert worst <= GRADIENT_RTOL, (name, worst)
        for got, want in zip(results[name], none, strict=True):
            if want["losses"][0] is not None:
                assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_RTOL), name
    # Kept gathered or per layer: the same ops on the same bf16 copies.
    assert _worst_gradient(results["tied-zero3"], results["tied-gathered"]) <= 1e-6


def test_checkpoints_keep_the_float32_shards_and_optimizer_state(runs: dict[str, Any]) -> None:
    from tied_lm import build_model
    from torch.distributed.checkpoint import FileSystemReader

    (step,) = Path(runs["checkpoint"]).glob("step-*")
    entries = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    names = [n for n, _ in build_model().named_parameters()]  # the tied embedding / head once
    weights = [entries[f"model.{n}"] for n in names]
    moments = [entries[f"optim.state.{n}.{k}"] for n in names for k in ("exp_avg", "exp_avg_sq")]
    assert {str(v.properties.dtype) for v in (*weights, *moments)} == {"torch.float32"}  # type: ignore[union-attr]


def _total(moment: dict[str, Any]) -> int:
    return moment["gathered"] + moment["grads"] + moment["accumulated"] + moment["reduce_scatter_input"]


def test_fsdp2_holds_what_the_cost_model_prices(runs: dict[str, Any]) -> None:
    """Kept gathered: bf16 weights + fp32 accumulator between backwards (6 bytes per element), plus that backward's
    bf16 gradients at its end (8: ``gathered_bytes``).  ZeRO-3, at a layer's post-backward: two layers' bf16
    weights, its bf16 gradients, the previous layer's fp32 reduce-scatter input (10: ``zero3_transient_bytes``)."""
    for rank, r in enumerate(runs["results"]["tied-gathered"]):
        (elements,) = r["probe"]["unit_elements"]  # one unit per stage
        moments = r["probe"]["moments"]
        priced = gathered_bytes("bf16-mixed", elements=elements, model_bytes=4 * elements)
        assert max(_total(m) for m in moments) == priced == 8 * elements
        backward_ends = [_total(m) for m in moments if m["when"] == "backward" and m["accumulated"]]
        assert priced in backward_ends
        forwards = [_total(m) for m in moments if m["when"] == "forward"]
        # Stage 1 (ranks 2, 3) runs micro-batch 2's forward after micro-batch 1's backward: accumulator held.
        assert max(forwards) == (6 * elements if rank >= 2 else 2 * elements), (rank, sorted(set(forwards)))
    for name in ("tied-zero3", "mlp-zero3"):
        for rank, r in enumerate(runs["results"][name]):
            largest = max(r["probe"]["unit_elements"])
            priced = zero3_transient_bytes("bf16-mixed", elements=largest, model_bytes=4 * largest)
            held = max(_total(m) for m in r["probe"]["moments"])
            assert held <= priced, (name, rank, held, priced)
            if name == "mlp-zero3" and rank < 2:  # stage 0: six equal layers, the bound is reached
                assert held == priced == 10 * largest, (held, priced)


# ----------------------------------------------------------------- the formulas, without ranks


def test_bytes_per_element_by_precision() -> None:
    """(gathered copy = what an all-gather moves, kept gathered, ZeRO-3 transient) per element of a float32 model."""
    got = {p: (weight_bytes(p, elements=1, model_bytes=4, compute=True), gathered_bytes(p, elements=1, model_bytes=4),
               zero3_transient_bytes(p, elements=1, model_bytes=4)) for p in ("fp32", "bf16-mixed", "bf16")}
    assert got == {"fp32": (4, 8, 16), "bf16-mixed": (2, 2 + 4 + 2, 2 + 2 + 2 + 4), "bf16": (2, 4, 8)}
    # The held (master) weights a ZeRO-1 broadcast moves, and the gradients a reduce-scatter moves, stay float32.
    assert weight_bytes("bf16-mixed", elements=1, model_bytes=4) == gradient_bytes("bf16-mixed", elements=1,
                                                                                   model_bytes=4) == 4
    # Held and moved per parameter, kept gathered, 2 replicas, Adam: the all-gather halves.
    assert shard_footprint("bf16-mixed", 2, "full", 2) == (16 / 2 + 8, 4 + 2)
    assert shard_footprint("fp32", 2, "full", 2) == (16 / 2 + 8, 4 + 4)


@pytest.mark.parametrize("per_element", [4, 2])
def test_fp32_bytes_are_those_before_the_policy(per_element: int) -> None:
    """fp32 trains the model in its own dtype (float32, or a bfloat16 model as it is): W + G and 2 (W + G)."""
    nbytes = 1000 * per_element
    assert weight_bytes("fp32", elements=1000, model_bytes=nbytes, compute=True) == nbytes
    assert gathered_bytes("fp32", elements=1000, model_bytes=nbytes) == 2 * nbytes
    assert zero3_transient_bytes("fp32", elements=1000, model_bytes=nbytes) == 2 * (nbytes + nbytes)


def test_the_solver_prices_bf16_gathers_and_fp32_scatters() -> None:
    """formulate's per-step collectives (kept gathered) and ZeRO-3's per-micro-batch ones and transient."""
    graph = GraphCosts(blocks=(("a",), ("b",)), node_time_s={"a": 3e-4, "b": 3e-4},
                       node_forward_s={"a": 1e-4, "b": 1e-4}, node_saved_bytes={"a": 0, "b": 0},
                       node_output_bytes={"a": 0, "b": 0},
                       parameter_bytes={"layers.0.w": 4 * 10**8, "layers.1.w": 4 * 10**8},
                       block_parameters=(("layers.0.w",), ("layers.1.w",)), edges=((0, 1),), block_sends=(0, 0))
    spec = DEVICES["h100"]
    on = link(spec)
    full = formulate(graph, dp=2, spec=spec, memory_limit=80e9, shard="full", precision="bf16-mixed")
    assert full.static_bytes == pytest.approx([10**8 * (16 / 2 + 8)] * 2)
    # Latency in the stage's fixed term: bandwidth only here.
    assert full.allreduce_s == pytest.approx([on.shard_seconds(4e8, 2, messages=0)
                                              + on.shard_seconds(2e8, 2, messages=0)] * 2)
    z = zero3_costs(graph, dp=2, spec=spec, precision="bf16-mixed", gpus_per_node=8)
    assert z.transient_bytes == 10 * 10**8
    assert z.first_gather_s == pytest.approx(on.shard_seconds(2e8, 2))
    fp32 = zero3_costs(graph, dp=2, spec=spec, precision="fp32", gpus_per_node=8)
    assert fp32.transient_bytes == 16 * 10**8 and fp32.first_gather_s == pytest.approx(on.shard_seconds(4e8, 2))
