"""Sharded replicas (issue 21) train exactly as the unpartitioned model.

One job of four really spawned CPU ranks (gloo) runs every case in turn: a
pp=2 x dp=2 plan of a small MLP whose stages are planned ``optimizer`` (ZeRO-1:
``ZeroRedundancyOptimizer`` over each stage group) or ``full`` (FSDP2
``fully_shard`` over a 1-D mesh of each stage group; parameters kept gathered
across micro-batches, or resharded after every forward), under ``1f1b``,
``gpipe`` and ``zb-h1`` (B and W apart); 3 AdamW steps each (fp32), compared with
the whole model trained on the whole mini-batch in one process: loss and every
trained parameter within 1e-5.  One case clips the gradients
(``clip_grad_norm_`` over DTensor shards), one builds its optimizer the old way
(``AdamW(pipe.parameters())``), one asks for a pair the runtime refuses.

Without ranks: every (schedule, mode) pair the runtime does not run is refused
with its reason, by the defaults table and by the Pipeline's plan check.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import shard_workers
import torch
from rank_workers import spawn_and_wait
from shard_workers import plan_sharded, reference

from partitioner import defaults
from partitioner.defaults import SCHEDULES, SHARD_MODES, shard_refusal
from partitioner.errors import ScheduleError
from partitioner.plan import Plan
from runtime.parallel.shard import check_shard_plan
from runtime.verify import free_port

MODELS = Path(__file__).parent / "models"
SPEC = str(MODELS / "mlp.py")
TIED = str(MODELS / "tied_lm.py")
META_GPT = str(MODELS / "meta_gpt.py")
TOLERANCE = 1e-5
CLIP = 0.05

# name: (schedule, shard, reshard_after_forward, how the optimizer is built, clip)
CASES: dict[str, tuple[str, str, bool, str, float | None]] = {
    "1f1b-optimizer": ("1f1b", "optimizer", False, "pipe", None),
    "1f1b-full-gathered": ("1f1b", "full", False, "plain", CLIP),
    "1f1b-full-resharded": ("1f1b", "full", True, "pipe", None),
    "gpipe-optimizer-plain": ("gpipe", "optimizer", False, "plain", None),
    "gpipe-full-resharded": ("gpipe", "full", True, "plain", None),
    "zb-h1-optimizer": ("zb-h1", "optimizer", False, "pipe", None),
    "zb-h1-full-gathered": ("zb-h1", "full", False, "plain", None),
    "interleaved-1f1b-optimizer": ("interleaved-1f1b", "optimizer", False, "pipe", None),
    "interleaved-1f1b-full-gathered": ("interleaved-1f1b", "full", False, "plain", None),
    "interleaved-1f1b-full-resharded": ("interleaved-1f1b", "full", True, "plain", CLIP),
    "zbv-optimizer": ("zbv", "optimizer", False, "pipe", None),
    "zbv-full-gathered": ("zbv", "full", False, "plain", CLIP),
    "1f1b-full-resharded-recomputed": ("1f1b", "full", True, "plain", None),
    "1f1b-mixed": ("1f1b", "full,optimizer", True, "pipe", CLIP),  # stage 0 full, stage 1 ZeRO-1
}
SUPPORTED = {(kind, mode) for kind, modes, *_ in CASES.values() for mode in modes.split(",")}
# The tiny LM whose embedding is its LM head (stage 0 and stage 1): the copies summed shard for shard.
TIED_CASE = "tied-1f1b-full-resharded"
# pp=1 x dp=4 on two nodes of 2: HSDP, sharded inside a node, replicated across (a 2-D mesh).
HSDP_CASE = "hsdp-2x2-full"
# The same under ZeRO-3: each layer's gradients reduce-scattered inside a node and all-reduced across, per micro-batch.
HSDP_ZERO3_CASE = "hsdp-2x2-zero3"
# ZeRO-3 over every replica of a group that spans nodes (shard_span "world", a 1-D mesh): pp=1 x dp=4 on two
# nodes of 2, and pp=2 x dp=2 with every rank on its own node; and HSDP at pp=2 x dp=2 there (one shard per node).
WORLD_CASES: dict[str, tuple[int, int, int, str]] = {  # name: (pp, dp, gpus per node, span)
    "world-1x4-zero3": (1, 4, 2, "world"),
    "world-2x2-zero3": (2, 2, 1, "world"),
    "hsdp-2x2-zero3-pp2": (2, 2, 1, "node"),
}
# A plan the runtime refuses (the tied weight in two fully sharded stages of one rank): refused on every rank.
REFUSED_CASE = "refused-tied-zbv-full"
# Resumed runs: name -> (the case that saved, schedule, shard, pp, dp, optimizer); one more step each.
RESUMES: dict[str, tuple[str, str, str, int, int, str]] = {
    "resume-full-as-none": ("1f1b-full-resharded", "1f1b", "none", 2, 2, "plain"),
    "resume-zero1-as-full-dp4": ("1f1b-optimizer", "gpipe", "full", 1, 4, "plain"),
    "resume-full-as-zero1-interleaved": ("zb-h1-full-gathered", "interleaved-1f1b", "optimizer", 2, 2, "pipe"),
}
SAVERS = {saver for saver, *_ in RESUMES.values()}
# eval_step between backward and optimizer step (it gathers a full stage: the next step must not reuse that).
EVALS = {"1f1b-full-gathered", "1f1b-full-resharded"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("shard")
    out = root / "out"
    out.mkdir()
    cases = []
    for name, (kind, mode, reshard, optimizer, clip) in CASES.items():
        plan_sharded(SPEC, root / name, schedule=kind, shard=tuple(mode.split(",")) if "," in mode else mode,
                     reshard_after_forward=reshard,
                     recompute="full" if name.endswith("-recomputed") else "none")
        cases.append({"name": name, "plan": str(root / name), "optimizer": optimizer, "clip": clip,
                      "save": str(root / f"ckpt-{name}") if name in SAVERS else None, "eval": name in EVALS})
    plan_sharded(TIED, root / TIED_CASE, schedule="1f1b", shard="full", reshard_after_forward=True)
    cases.append({"name": TIED_CASE, "plan": str(root / TIED_CASE), "spec": TIED, "clip": CLIP})
    plan_sharded(SPEC, root / HSDP_CASE, schedule="1f1b", shard="full", pp=1, dp=4, gpus_per_node=2,
                 shard_span="node")
    cases.append({"name": HSDP_CASE, "plan": str(root / HSDP_CASE), "clip": CLIP, "mesh": True})
    plan_sharded(SPEC, root / HSDP_ZERO3_CASE, schedule="1f1b", shard="full", pp=1, dp=4, gpus_per_node=2,
                 reshard_after_forward=True, shard_span="node")
    cases.append({"name": HSDP_ZERO3_CASE, "plan": str(root / HSDP_ZERO3_CASE), "clip": CLIP, "mesh": True})
    for name, (pp, dp, per_node, span) in WORLD_CASES.items():
        plan_sharded(SPEC, root / name, schedule="1f1b", shard="full", pp=pp, dp=dp, gpus_per_node=per_node,
                     reshard_after_forward=True, shard_span=span)
        cases.append({"name": name, "plan": str(root / name), "clip": CLIP, "mesh": True})
    plan_sharded(TIED, root / REFUSED_CASE, schedule="zbv", shard="full")
    cases.append({"name": REFUSED_CASE, "plan": str(root / REFUSED_CASE), "spec": TIED, "expect_error": True})
    for name, (saver, kind, mode, pp, dp, optimizer) in RESUMES.items():
        plan_sharded(SPEC, root / name, schedule=kind, shard=mode, pp=pp, dp=dp)
        cases.append({"name": name, "plan": str(root / name), "optimizer": optimizer, "steps": 1,
                      "load": str(root / f"ckpt-{saver}")})
    start = time.monotonic()
    codes = spawn_and_wait(shard_workers.shard_worker, 4, (4, free_port(), SPEC, str(out), cases), limit_s=240)
    seconds = time.monotonic() - start
    results = {c["name"]: [torch.load(out / f"{c['name']}-rank{r}.pt", weights_only=False) for r in range(4)]
               for c in cases if (out / f"{c['name']}-rank0.pt").exists()}
    errors = {n: [r["error"] for r in rs if r["error"]] for n, rs in results.items() if n != REFUSED_CASE}
    assert codes == [0] * 4 and not any(errors.values()), (
        f"rank exit codes {codes} (None: still running after 240 s); errors {errors}; "
        f"{[r.get('traceback', '')[-3000:] for rs in results.values() for r in rs if r['error']][:1]}")
    plain = reference(SPEC, dp=2, microbatches=2)
    clipped = reference(SPEC, dp=2, microbatches=2, clip=CLIP)
    longer = reference(SPEC, dp=2, microbatches=2, steps=shard_workers.STEPS + 1)
    tied = reference(TIED, dp=2, microbatches=2, clip=CLIP)
    hsdp = reference(SPEC, dp=4, microbatches=2, clip=CLIP)
    return {"results": results, "plain": plain, "clipped": clipped, "longer": longer, "tied": tied,
            "hsdp": hsdp, "seconds": seconds}


def _max_diff(ranks: list[dict[str, Any]], want: dict[str, Any]) -> float:
    worst = 0.0
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        merged.update(r["state"])
    assert set(merged) == set(want["state"]), sorted(set(want["state"]) ^ set(merged))
    for key, value in merged.items():
        worst = max(worst, float((value - want["state"][key]).abs().max()))
    for r in ranks:
        if r["losses"][0] is not None:
            worst = max(worst, max(abs(a - b) for a, b in zip(r["losses"], want["losses"])))
    return worst


@pytest.mark.slow  # spawns ranks (once per module, every case in one job)
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_training_matches_whole_model(runs: dict[str, Any], name: str) -> None:
    _, modes, _, optimizer, clip = CASES[name]
    ranks = runs["results"][name]
    want = runs["clipped"] if clip is not None else runs["plain"]
    diff = _max_diff(ranks, want)
    print(f"{name}: max abs diff {diff:.2e} (job {runs['seconds']:.1f} s)")
    assert diff <= TOLERANCE, f"{name}: max abs diff {diff:.3g} > {TOLERANCE}"
    if clip is not None:
        for r in ranks:  # every rank gets the whole model's norm
            assert r["norms"] == pytest.approx(want["norms"], abs=TOLERANCE)
    if name.endswith("-recomputed"):  # each layer under activation checkpointing, around its FSDP unit
        assert all(r["layered_recompute"] == [True] for r in ranks), ranks[0]["layered_recompute"]
    reshard = CASES[name][2]
    for rank, r in enumerate(ranks):
        full = (modes.split(",")[-1] if "," in modes and rank >= 2 else modes.split(",")[0]) == "full"
        if full and reshard:  # ZeRO-3: one FSDP2 unit per layer (the MLP's 8 Linears split 2 ways) + the root
            assert "FSDPLayerUnit" in r["runtime_modules"], r["runtime_modules"]
            assert r["fsdp_units"] > 2, r["fsdp_units"]
        elif full:  # kept gathered: one unit per stage
            assert "FSDPLayerUnit" not in r["runtime_modules"] and r["fsdp_units"] in (1, 2), r["fsdp_units"]
    if name in EVALS:  # no dropout, equal micro-batches: the eval loss is the step's training loss
        for r in ranks:
            if r["losses"][0] is not None:
                assert r["eval_losses"] == pytest.approx(want["losses"], abs=TOLERANCE)
    for rank, r in enumerate(ranks):
        mode = modes.split(",")[-1] if "," in modes and rank >= 2 else modes.split(",")[0]  # stage = rank // 2
        if mode == "full":  # FSDP2: DTensor parameters, each replica holding half
            assert r["parameter_types"] == ["DTensor"], r["parameter_types"]
            assert r["local_numel"] < r["whole_numel"], (r["local_numel"], r["whole_numel"])
        elif optimizer == "pipe":  # ZeRO-1: Adam state for this replica's share only
            assert r["optimizer"] == "ZeroRedundancyOptimizer"
            assert 0 < r["optimizer_states"] < len(list(r["state"])), r["optimizer_states"]
        else:  # the old way under "optimizer": right, with a warning that nothing is saved
            assert r["optimizer"] == "AdamW"
            assert any("pipe.optimizer(" in w for w in r["warnings"]), r["warnings"]


def test_refused_pairs_are_exactly_those_not_proven() -> None:
    """Every pair the runtime tests prove runs; every other sharded pair is refused with a reason."""
    for kind in SCHEDULES:
        for mode in SHARD_MODES:
            why = shard_refusal(kind, mode)
            if mode == "none" or (kind, mode) in SUPPORTED:
                assert why is None, (kind, mode, why)
            else:
                assert why and len(why) > 20, (kind, mode, why)


def test_a_plan_with_a_refused_pair_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_sharded(SPEC, tmp_path, schedule="zb-h1", shard="full")
    check_shard_plan(plan)  # proven: runs
    monkeypatch.setitem(defaults._SHARD_UNSUPPORTED, ("zb-h1", "full"), "cannot do this yet (a test's reason)")
    with pytest.raises(ScheduleError, match="shard='full' under schedule 'zb-h1', which cannot do this yet") as info:
        check_shard_plan(plan)
    assert "Re-plan" in str(info.value)


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_zero3_under_a_split_backward_is_refused_with_the_reason(tmp_path: Path, kind: str) -> None:
    """W computes weight gradients after B, outside FSDP2's hooks: no reduce-scatter per backward there."""
    plan = plan_sharded(SPEC, tmp_path, schedule=kind, shard="full")
    check_shard_plan(plan)  # kept gathered: runs
    zero3 = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, reshard_after_forward=True) for s in plan.stages))
    with pytest.raises(ScheduleError, match=rf"reshard_after_forward .* under schedule '{kind}', whose W computes"):
        check_shard_plan(zero3)


def test_stages_of_one_rank_in_different_modes_are_refused(tmp_path: Path) -> None:
    plan = plan_sharded(SPEC, tmp_path, schedule="interleaved-1f1b", shard="full")
    first = plan.stages_of(0)[0]
    mixed = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, shard="optimizer") if s.index == first else s for s in plan.stages))
    with pytest.raises(ScheduleError, match=r"pipeline rank 0 holds stages .* different shard modes"):
        check_shard_plan(mixed)


@pytest.mark.slow  # spawns ranks (once per module, every case in one job)
def test_a_tied_weight_in_fully_sharded_stages_trains_and_clips_as_one(runs: dict[str, Any]) -> None:
    ranks, want = runs["results"][TIED_CASE], runs["tied"]
    diff = _max_diff(ranks, want)
    print(f"{TIED_CASE}: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE, f"{TIED_CASE}: max abs diff {diff:.3g} > {TOLERANCE}"
    for r in ranks:
        assert r["parameter_types"] == ["DTensor"], r["parameter_types"]
        assert r["norms"] == pytest.approx(want["norms"], abs=TOLERANCE)


@pytest.mark.slow  # spawns ranks (once per module, every case in one job)
@pytest.mark.parametrize("case", [HSDP_CASE, HSDP_ZERO3_CASE])
def test_replicas_on_two_nodes_shard_inside_a_node_and_replicate_across(runs: dict[str, Any], case: str) -> None:
    ranks, want = runs["results"][case], runs["hsdp"]
    diff = _max_diff(ranks, want)
    print(f"{case}: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE, f"{case}: max abs diff {diff:.3g} > {TOLERANCE}"
    for r in ranks:
        assert r["mesh"] == {"replicate": 2, "shard": 2}, r["mesh"]
        assert r["norms"] == pytest.approx(want["norms"], abs=TOLERANCE)  # a shard counted once, not per node
        assert r["local_numel"] * 2 == pytest.approx(r["whole_numel"], rel=0.05)


@pytest.mark.slow  # spawns ranks (once per module, every case in one job)
@pytest.mark.parametrize("case", list(WORLD_CASES))
def test_zero3_over_every_replica_across_nodes_and_hsdp_beside_it(runs: dict[str, Any], case: str) -> None:
    """shard_span "world": one shard per replica over a group spanning nodes (a 1-D mesh); "node": per node."""
    pp, dp, _, span = WORLD_CASES[case]
    ranks = runs["results"][case]
    want = runs["hsdp"] if pp == 1 else runs["clipped"]
    diff = _max_diff(ranks, want)
    print(f"{case}: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE, f"{case}: max abs diff {diff:.3g} > {TOLERANCE}"
    shards = dp if span == "world" else 1  # one rank per node at pp = 2: HSDP keeps whole shards, replicated
    for r in ranks:
        assert r["mesh"] == ({"shard": dp} if span == "world" else {"replicate": dp // shards, "shard": shards}), r["mesh"]
        assert r["local_numel"] * shards == pytest.approx(r["whole_numel"], rel=0.05)


@pytest.mark.slow  # spawns ranks (once per module, every case in one job)
def test_the_pipeline_refuses_a_plan_the_runtime_cannot_run_on_every_rank(runs: dict[str, Any]) -> None:
    for r in runs["results"][REFUSED_CASE]:
        assert r["error"] is not None and r["error"].startswith("ScheduleError: The plan cannot run: the tied "
                                                                  "parameter"), r["error"]
        assert "one parameter cannot be two FSDP units" in r["error"]


def test_a_tied_parameter_sharded_in_one_stage_only_or_twice_on_one_rank_is_refused(tmp_path: Path) -> None:
    plan: Plan = plan_sharded(TIED, tmp_path, schedule="1f1b", shard="full")
    (tied,) = [t for t in plan.tied if len(t.stages) > 1]
    check_shard_plan(plan)  # every holder full: summed shard for shard
    half = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, shard="none") if s.index == tied.stages[-1] else s for s in plan.stages))
    with pytest.raises(ScheduleError, match="tied parameter .* every stage holding it must be 'full'"):
        check_shard_plan(half)
    vee = plan_sharded(TIED, tmp_path / "zbv", schedule="zbv", shard="full")
    with pytest.raises(ScheduleError, match="tied parameter .* on one pipeline rank: one parameter cannot be two"):
        check_shard_plan(vee)
    zero1 = plan_sharded(TIED, tmp_path / "zero1", schedule="zbv", shard="optimizer")
    check_shard_plan(zero1)  # whole parameters: tied copies are summed as before


@pytest.mark.slow  # spawns ranks (once per module, every case in one job)
@pytest.mark.parametrize("name", list(RESUMES))
def test_a_sharded_checkpoint_resumes_under_another_mode_and_layout(runs: dict[str, Any], name: str) -> None:
    """Saved after 3 steps under one mode and layout, resumed under another: the 4th step as if uninterrupted."""
    ranks = runs["results"][name]
    want = runs["longer"]
    assert all(r["loaded_step"] == shard_workers.STEPS for r in ranks)
    diff = _max_diff(ranks, {"state": want["state"], "losses": want["losses"][shard_workers.STEPS:]})
    print(f"{name}: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE, f"{name}: max abs diff {diff:.3g} > {TOLERANCE}"


@pytest.mark.slow  # spawns verify's ranks
def test_verify_runs_a_fully_sharded_meta_built_model_against_the_whole_model(tmp_path: Path) -> None:
    """``verify`` gathers sharded parameters and gradients whole to compare them (issue 21, item 5).

    The GPT is built on meta (tied embedding / LM head across the two stages, a causal-mask buffer):
    each rank materialises its stage straight into shards, and must start from the values the whole
    model gets from the same per-module initialisation.
    """
    from runtime.verify import verify

    plan_sharded(META_GPT, tmp_path, schedule="1f1b", shard="full", reshard_after_forward=True)
    result = verify(tmp_path, META_GPT, steps=shard_workers.STEPS, tolerance=TOLERANCE)
    assert result.ok, result.summary()


def test_a_meta_stage_is_materialised_one_module_at_a_time_into_shards(tmp_path: Path) -> None:
    """What a fully sharded rank keeps of its meta-built stage: its shard of every parameter, whole buffers."""
    from partitioner.modelfile import load_model_file
    from runtime.execute.stage import build_local_stage
    from runtime.parallel.shard import shard_of, shardable_on_meta
    from runtime.state.materialise import materialise_model, materialised_values

    plan = plan_sharded(META_GPT, tmp_path, schedule="1f1b", shard="full")
    model_file = load_model_file(META_GPT)
    model = model_file.build()
    stage = build_local_stage(plan, model, 0).module
    assert shardable_on_meta([stage])
    whole: list[int] = []

    def keep(value: torch.Tensor, is_param: bool) -> torch.Tensor:
        whole.append(value.numel())
        return shard_of(value, dp=2, replica=1) if is_param else value

    kept = materialised_values(model, [stage], init_weights=model_file.init_weights, keep=keep)
    assert all(t.is_meta for t in stage.parameters())  # nothing put in yet: FSDP2 takes the shards
    reference = model_file.build()
    materialise_model(reference, init_weights=model_file.init_weights)
    want = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in stage.named_parameters():
        assert torch.equal(kept[name], torch.chunk(want[name].detach(), 2)[1]), name
    assert sum(t.numel() for n, t in kept.items() if n in dict(stage.named_parameters())) < sum(whole) / 1.5


def test_zero3_units_are_the_layers_of_an_exported_graph() -> None:
    """ZeRO-3's FSDP2 units: one per layer run of a stage graph (here the whole model's), owning every parameter
    only it reads; the graph run layer by layer computes what it does (without ranks: no FSDP2 applied here).
    A Hugging Face model is captured by export, whose graph reads every parameter by ``get_attr`` (no module
    calls for FSDP2's hooks): the units own the parameters' modules and run the layer's nodes themselves.
    (symbolic_trace's graphs, which call leaf modules, run in the rank-spawning cases above.)"""
    spec = "examples/llama.py:llama_tiny"
    from partitioner.graph.capture import capture
    from partitioner.modelfile import load_model_file
    from runtime.execute.recompute import block_nodes
    from runtime.parallel.shard import LayeredStage
    from runtime.state.materialise import materialise_model

    model_file = load_model_file(spec)
    model = model_file.build()
    materialise_model(model, init_weights=model_file.init_weights)
    inputs = tuple(model_file.example_inputs(2))
    captured = capture(model, inputs)
    assert captured.method == "export"
    gm = captured.graph_module
    layered = LayeredStage(gm, recompute=False)
    # Tied embedding and head (one parameter read by two layers) stay with the root unit; the rest are layers'.
    shared = {p for p in gm.parameters()} - layered.layer_parameters()
    assert sum(p.numel() for p in shared) <= max(p.numel() for p in gm.parameters()), len(shared)
    assert 3 <= len(layered.units) <= len(block_nodes(gm))
    for want, got in zip(gm(*inputs), layered(*inputs), strict=True):
        assert torch.equal(want, got)
