"""Expert parallelism in the runtime (issue 32): plans with ``ep > 1`` train as the unpartitioned model.

Each stage group's ``dp`` replicas form EP groups of ``ep`` consecutive replicas; member ``j``
holds experts ``[j*E/ep, (j+1)*E/ep)`` of every experts layer and tokens travel to their
expert's member and back (:mod:`runtime.parallel.experts`).  ``verify`` trains 3 SGD steps on
really spawned CPU ranks (gloo) and compares loss, every gradient and the parameters after
each update (whole experts, gathered over the EP group) with the whole model in one process.
Plans come from the planner at a fixed layout and ``ep``, with the experts layers it found.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner.errors import AutopartitionError
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile
from runtime.verify import free_port, verify

MODELS = Path(__file__).parent / "models"
USER_MOE = str(MODELS / "user_moe_routed.py")  # experts in a ModuleList ("list")
USER_MOE_DEEP = str(MODELS / "user_moe_routed_deep.py")  # eight layers: stages of whole layers
META_MOE = str(MODELS / "meta_moe_routed.py")  # USER_MOE built on meta, with init_weights
MIXTRAL = str(MODELS / "zoo_mixtral.py")  # Hugging Face Mixtral: experts stacked on dim 0 ("stacked")
EXAMPLES = Path(__file__).parent.parent / "examples"
QWEN3_MOE = str(EXAMPLES / "moe.py")  # tiny Qwen3-MoE: 2 layers of 8 stacked experts, top-2
DEEPSEEK_V3 = str(EXAMPLES / "deepseek_v3.py")  # tiny DeepSeek-V3: dense first layer, then 8 experts + shared
STEPS = 3
TOLERANCE = 1e-5


def _ep_plan(spec: str, directory: Path, *, ep: int, pp: int, dp: int, schedule: str, microbatches: int = 2,
             chunks: int | None = None, batch_size: int = 8, tp: int = 1) -> Plan:
    """The planner's plan at this layout with expert-parallel degree ``ep`` (predicted h100 costs), saved."""
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    shape: dict[str, Any] = {} if chunks is None else {"chunks": chunks}
    plan = compile(model_file.build(), model_file.example_inputs(batch_size), gpus=pp * dp * tp, pp=pp, dp=dp, ep=ep, tp=tp,
                   microbatches=microbatches, schedule=schedule, device="h100", **shape)
    assert (plan.pp, plan.dp, plan.ep, plan.tp) == (pp, dp, ep, tp) and plan.experts, "the planner found no experts layer"
    plan.save(directory)
    return plan


def _verified(directory: Path, spec: str, *, steps: int = STEPS, engine: str = "ours") -> None:
    result = verify(directory, spec, steps=steps, tolerance=TOLERANCE, engine=engine)
    assert result.ok, result.report()
    assert len(result.per_step) == steps


def test_the_planner_records_the_experts_layers(tmp_path: Path) -> None:
    plan = _ep_plan(USER_MOE, tmp_path, ep=1, pp=1, dp=2, schedule="1f1b")
    assert [(layer.module, layer.layout, layer.experts) for layer in plan.experts] == [
        (f"layers.{i}.moe", "list", 4) for i in range(3)]
    assert Plan.load(tmp_path).experts == plan.experts


@pytest.mark.parametrize("dp", [2, 4])
def test_listed_experts_over_replicas_match_the_whole_model(tmp_path: Path, dp: int) -> None:
    """dp 2: one EP group; dp 4: two, each expert's gradient also summed over its two copies."""
    _ep_plan(USER_MOE, tmp_path, ep=2, pp=1, dp=dp, microbatches=2, schedule="1f1b")
    _verified(tmp_path, USER_MOE)


def test_each_member_holds_its_experts_and_gives_whole_state(tmp_path: Path) -> None:
    import expert_workers
    from rank_workers import spawn_and_wait

    plan = _ep_plan(USER_MOE, tmp_path, ep=2, pp=1, dp=2, microbatches=2, schedule="1f1b")
    out = tmp_path / "out"
    out.mkdir()
    codes = spawn_and_wait(expert_workers.holdings_worker, plan.gpus,
                           (plan.gpus, free_port(), str(tmp_path), USER_MOE, str(out)), limit_s=120)
    assert codes == [0, 0], codes
    model_file = load_model_file(USER_MOE)
    torch.manual_seed(0)
    whole = model_file.build().state_dict()
    records = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(plan.gpus)]
    for member, record in enumerate(records):
        held = {int(n.split(".")[4]) for n in record["shapes"] if ".moe.experts." in n}
        assert held == {2 * member, 2 * member + 1}, sorted(record["shapes"])
        assert record["shapes"]["layers.0.router.weight"] == (4, 16)  # dense: whole on every replica
        for key in ("state", "reloaded"):
            assert set(record[key]) == set(whole)
            assert all(torch.equal(record[key][k], whole[k]) for k in whole), key
        assert record["eval_loss"] is not None
        assert record["checkpoint"] == "step-0"
        assert torch.allclose(record["clip_norm"], record["grad_norm"], rtol=1e-6), (record["clip_norm"],
                                                                                    record["grad_norm"])
    # After a step both members give the same whole state: the experts each trained, gathered.
    assert all(torch.equal(records[0]["trained"][k], records[1]["trained"][k]) for k in whole)
    assert any(not torch.equal(records[0]["trained"][k], whole[k]) for k in whole if ".moe.experts.3." in k)


def test_an_experts_layer_split_across_stages_is_refused() -> None:
    from runtime.execute.stage import build_local_stages
    from runtime.parallel.experts import ExpertGroups, _swap_layer

    model_file = load_model_file(USER_MOE)
    torch.manual_seed(0)
    model = model_file.build()
    plan = compile(model, model_file.example_inputs(8), gpus=1, pp=1, dp=1, microbatches=2, schedule="1f1b",
                   device="h100")
    local = build_local_stages(plan, model, (0,))[0]
    # The layer as if its last node ran in the next stage: this stage runs all but one of its nodes.
    layer = dataclasses.replace(plan.experts[0], nodes=(*plan.experts[0].nodes, "a_node_of_the_next_stage"))
    groups = ExpertGroups(ep=None, ep_ranks=(0, 1), member=0, edp=None, edp_ranks=(0,))  # type: ignore[arg-type]
    with pytest.raises(AutopartitionError, match="layers.0.moe is split across stages .* whole in one stage"):
        _swap_layer(local.module, layer, model, groups, ep=2, stage=0)


@pytest.mark.slow  # Hugging Face Mixtral: ~30 s
def test_stacked_mixtral_experts_match_the_whole_model(tmp_path: Path) -> None:
    plan = _ep_plan(MIXTRAL, tmp_path, ep=2, pp=1, dp=2, microbatches=2, schedule="1f1b")
    assert {layer.layout for layer in plan.experts} == {"stacked"}
    _verified(tmp_path, MIXTRAL)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "recompute"), [
    ("1f1b", "none"), ("zb-h1", "full"),
    pytest.param("zb-h1", "none", marks=pytest.mark.exhaustive),  # the rest of the grid: the exhaustive tier
    pytest.param("1f1b", "full", marks=pytest.mark.exhaustive)])
def test_pipeline_and_expert_parallel(tmp_path: Path, schedule: str, recompute: str) -> None:
    """pp 2 x dp 2, ep 2: each stage's replicas exchange tokens; zb-h1 splits the backward into B and W;
    recompute "full" runs the exchanges again in the backward."""
    plan = _ep_plan(USER_MOE, tmp_path, ep=2, pp=2, dp=2, microbatches=2, schedule=schedule)
    dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=recompute) for s in plan.stages)
                        ).save(tmp_path)
    _verified(tmp_path, USER_MOE)


@pytest.mark.slow
@pytest.mark.exhaustive  # Qwen3-MoE under zbv runs two stages per rank in the slow tier
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_two_stages_per_rank_and_expert_parallel(tmp_path: Path, schedule: str) -> None:
    plan = _ep_plan(USER_MOE_DEEP, tmp_path, ep=2, pp=2, dp=2, microbatches=4, schedule=schedule,
                    chunks=2 if schedule == "interleaved-1f1b" else None)
    assert plan.chunks == 2 and len(plan.stages) == 4
    _verified(tmp_path, USER_MOE_DEEP)


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_with_expert_parallel_matches_the_whole_model(tmp_path: Path, dp: int) -> None:
    """shard "optimizer": the dense parameters' state split over the replicas (ZeRO-1), each member stepping its
    own experts (dp 4: two copies of each, stepped alike)."""
    plan = _ep_plan(USER_MOE, tmp_path, ep=2, pp=1, dp=dp, microbatches=2 if dp == 2 else 1, schedule="1f1b")
    dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard="optimizer") for s in plan.stages)
                        ).save(tmp_path)
    assert {s.shard for s in Plan.load(tmp_path).stages} == {"optimizer"}
    _verified(tmp_path, USER_MOE)


@pytest.mark.parametrize(("dp", "reshard"), [(2, False), (2, True), (4, False)])
def test_fsdp2_with_expert_parallel_matches_the_whole_model(tmp_path: Path, dp: int, reshard: bool) -> None:
    """shard "full": the dense parameters FSDP2 shards (kept gathered, or ZeRO-3 per layer), the experts
    ignored by FSDP2 (whole slices, reduced over their expert-data-parallel group)."""
    plan = _ep_plan(USER_MOE, tmp_path, ep=2, pp=1, dp=dp, microbatches=2 if dp == 2 else 1, schedule="1f1b")
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard="full", reshard_after_forward=reshard)
                                                  for s in plan.stages))
    plan.save(tmp_path)
    _verified(tmp_path, USER_MOE, steps=2)
    if dp == 4 and not reshard:  # dense shards count on every replica, experts on the first EP group's
        _check_clip_and_state(tmp_path, plan)


@pytest.mark.parametrize("shard", ["none", "full"])
def test_a_meta_model_with_expert_parallel(tmp_path: Path, shard: str) -> None:
    """Materialised per stage, then each member keeps its experts (under "full" whole first, not straight
    into FSDP2's shards: a slice of a shard is no expert)."""
    plan = _ep_plan(META_MOE, tmp_path, ep=2, pp=2, dp=2, microbatches=2, schedule="1f1b")
    dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=shard) for s in plan.stages)).save(tmp_path)
    _verified(tmp_path, META_MOE, steps=2)


def test_tensor_and_expert_parallel_listed_experts(tmp_path: Path) -> None:
    """tp 2 x dp 2, ep 2 (4 ranks): the experts whole on each tensor-parallel rank (Megatron's expert-tensor-
    parallel 1), each tensor-parallel rank exchanging the same tokens with its own EP group."""
    plan = _ep_plan(USER_MOE, tmp_path, ep=2, pp=1, dp=2, tp=2, microbatches=2, schedule="1f1b")
    _verified(tmp_path, USER_MOE, steps=2)
    _check_clip_and_state(tmp_path, plan)  # each expert counted once, not once per tensor-parallel rank


def _check_clip_and_state(tmp_path: Path, plan: Plan) -> None:
    """After one step every rank's ``clip_grad_norm_`` is the whole model's gradient norm; state dicts whole."""
    import expert_workers
    from rank_workers import spawn_and_wait

    out = tmp_path / "out"
    out.mkdir()
    codes = spawn_and_wait(expert_workers.clip_worker, plan.gpus,
                           (plan.gpus, free_port(), str(tmp_path), USER_MOE, str(out)), limit_s=120)
    assert codes == [0] * plan.gpus, codes
    model_file = load_model_file(USER_MOE)
    torch.manual_seed(0)
    model = model_file.build()
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert model_file.loss_fn is not None and model_file.example_target is not None
    model_file.loss_fn(model(*model_file.example_inputs(plan.batch_size)),
                       model_file.example_target(plan.batch_size)).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    for rank in range(plan.gpus):
        record = torch.load(out / f"clip{rank}.pt", weights_only=True)
        assert torch.allclose(record["clip_norm"], norm, rtol=1e-5), (rank, record["clip_norm"], norm)
        assert set(record["state"]) == set(whole) and all(torch.equal(record["state"][k], whole[k]) for k in whole)


@pytest.mark.exhaustive  # 8 ranks: ~20 s
def test_pipeline_tensor_and_expert_parallel(tmp_path: Path) -> None:
    """pp 2 x dp 2 x tp 2, ep 2: each stage's four EP groups (one per tensor-parallel rank and stage)."""
    _ep_plan(USER_MOE, tmp_path, ep=2, pp=2, dp=2, tp=2, microbatches=2, schedule="1f1b")
    _verified(tmp_path, USER_MOE, steps=2)


@pytest.mark.slow  # Hugging Face Mixtral: ~15-50 s
@pytest.mark.exhaustive  # the listed experts' tp x ep test runs in the default tier
@pytest.mark.parametrize("shard", ["none", "full"])
def test_tensor_and_expert_parallel_mixtral(tmp_path: Path, shard: str) -> None:
    """tp 2 x dp 2, ep 2: attention split by heads under sequence parallelism, the stacked experts not split;
    shard "full": FSDP2 over the replicas shards the tensor-parallel dense parameters again, not the experts."""
    plan = _ep_plan(MIXTRAL, tmp_path, ep=2, pp=1, dp=2, tp=2, microbatches=2, schedule="1f1b")
    assert {layer.layout for layer in plan.experts} == {"stacked"}
    dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=shard) for s in plan.stages)).save(tmp_path)
    _verified(tmp_path, MIXTRAL, steps=2)


@pytest.mark.slow  # Hugging Face models: ~25-40 s each
@pytest.mark.parametrize(("spec", "dp"), [
    pytest.param(QWEN3_MOE, 2, id="2-qwen3_moe"), pytest.param(DEEPSEEK_V3, 4, id="4-deepseek_v3"),
    pytest.param(QWEN3_MOE, 4, id="4-qwen3_moe", marks=pytest.mark.exhaustive),
    pytest.param(DEEPSEEK_V3, 2, id="2-deepseek_v3", marks=pytest.mark.exhaustive)])
def test_hf_moe_examples_over_replicas(tmp_path: Path, spec: str, dp: int) -> None:
    """ep = dp: one EP group of every replica, each holding 8 / dp experts of every layer (DeepSeek-V3: its
    shared expert and sigmoid gating outside the experts module, its first layer dense)."""
    plan = _ep_plan(spec, tmp_path, ep=dp, pp=1, dp=dp, microbatches=1, schedule="1f1b", batch_size=dp)
    assert {layer.experts for layer in plan.experts} == {8}
    _verified(tmp_path, spec, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "schedule", "chunks"), [
    pytest.param(QWEN3_MOE, "interleaved-1f1b", 2, id="interleaved-1f1b-2-qwen3_moe", marks=pytest.mark.exhaustive),
    pytest.param(QWEN3_MOE, "zbv", None, id="zbv-None-qwen3_moe"),
    *(pytest.param(spec, schedule, chunks, id=f"{schedule}-{chunks}-{name}", marks=pytest.mark.exhaustive)
      for spec, name in ((QWEN3_MOE, "qwen3_moe"), (DEEPSEEK_V3, "deepseek_v3"))
      for schedule, chunks in (("1f1b", None), ("interleaved-1f1b", 2), ("zbv", None))
      if (name, schedule) not in (("qwen3_moe", "interleaved-1f1b"), ("qwen3_moe", "zbv")))])
def test_hf_moe_examples_in_a_pipeline(tmp_path: Path, spec: str, schedule: str, chunks: int | None) -> None:
    """pp 2 x dp 2, ep 2; two stages per rank under interleaved-1f1b and zbv."""
    microbatches = 2 if chunks is None and schedule == "1f1b" else 4
    plan = _ep_plan(spec, tmp_path, ep=2, pp=2, dp=2, microbatches=microbatches, schedule=schedule,
                    chunks=chunks, batch_size=2 * microbatches)
    assert plan.pp == 2 and len(plan.stages) == (2 if schedule == "1f1b" else 4)
    _verified(tmp_path, spec, steps=2)


def _checkpoint_reference(spec: str, batch_size: int) -> dict[int, dict[str, Any]]:
    """The uninterrupted run on the whole model: Adam's state and the parameters after STEPS_BEFORE steps and
    after one and two more (each with the loss of the step that follows and the parameters after it)."""
    from checkpoint_workers import adam_records
    from expert_workers import ADAM_EPS, LR, STEPS_BEFORE

    records = adam_records(spec, batch=batch_size, lr=LR, eps=ADAM_EPS, before=STEPS_BEFORE, records=3, seed=0)
    return {STEPS_BEFORE + i: r for i, r in enumerate(records)}


def _check_resumed(records: list[dict[str, Any]], want: dict[str, Any], what: str, *, zero1: bool = False) -> None:
    def close(got: torch.Tensor, ref: torch.Tensor) -> float:
        return float((got.float() - ref.float()).abs().max()) if got.numel() else 0.0

    for rank, record in enumerate(records):
        for key in ("parameters", "after_next"):
            assert set(record[key]) == set(want[key]), (what, rank, key)
            for name, value in record[key].items():
                diff = close(value, want[key][name])
                assert diff <= TOLERANCE, f"{what} rank {rank}: {key} {name} differs by {diff:.2e}"
        if not zero1:  # ZeRO-1: the dense parameters' state is a share of them on each replica
            assert set(record["optimizer"]) == set(want["optimizer"]), (what, rank)
        for name, state in record["optimizer"].items():
            assert set(state) == set(want["optimizer"][name]), (what, rank, name)
            for key, value in state.items():
                diff = close(value, want["optimizer"][name][key])
                assert diff <= TOLERANCE, f"{what} rank {rank}: Adam {key} of {name} differs by {diff:.2e}"
        assert record["next_loss"] == pytest.approx(want["next_loss"], abs=TOLERANCE), (what, rank)


@pytest.mark.parametrize("spec", [USER_MOE, pytest.param(QWEN3_MOE, marks=pytest.mark.exhaustive)])
def test_checkpoints_resume_under_another_ep(tmp_path: Path, spec: str) -> None:
    """Saved under ep 2, resumed under ep 1 (which saves again), that resumed under ep 2, under ep 2 with ZeRO-1
    (which saves again, resumed under ep 1), and the first under ep 4, ep 2 with FSDP2 and tp 2 x ep 2; saved
    under dp 4 x ep 2 (two EP groups), resumed under ep 4: each equals the uninterrupted run
    (parameters, Adam's state of every expert, the next loss)."""
    import expert_workers
    from expert_workers import STEPS_BEFORE
    from rank_workers import spawn_and_wait

    from runtime.state.checkpoint import read_checkpoint_info

    plans = {name: _ep_plan(spec, tmp_path / name, ep=ep, pp=1, dp=dp, microbatches=1, schedule="1f1b")
             for name, ep, dp in (("ep2", 2, 2), ("ep1", 1, 2), ("ep4", 4, 4), ("dp4_ep2", 2, 4))}
    for mode, name in (("optimizer", "zero1"), ("full", "fsdp2")):
        plans[name] = dataclasses.replace(plans["ep2"], stages=tuple(dataclasses.replace(s, shard=mode)
                                                                     for s in plans["ep2"].stages))
        plans[name].save(tmp_path / name)
    if spec == USER_MOE:  # the planner finds no column/row pair to split in the tiny Qwen3-MoE's attention
        plans["tp2"] = _ep_plan(spec, tmp_path / "tp2", ep=2, pp=1, dp=2, tp=2, microbatches=1, schedule="1f1b")
    out = tmp_path / "out"
    out.mkdir()
    first, second, third, fourth = (str(tmp_path / name) for name in ("ckpt_ep2", "ckpt_ep1", "ckpt_zero1",
                                                                      "ckpt_dp4_ep2"))
    runs = [  # tag, plan, load, save before, save after, the step it resumes at
        ("save", "ep2", None, first, None, STEPS_BEFORE),
        ("ep2_to_ep1", "ep1", first, None, second, STEPS_BEFORE),
        ("ep1_to_ep2", "ep2", second, None, None, STEPS_BEFORE + 1),
        ("ep1_to_zero1", "zero1", second, None, third, STEPS_BEFORE + 1),
        ("zero1_to_ep1", "ep1", third, None, None, STEPS_BEFORE + 2),
        ("ep2_to_ep4", "ep4", first, None, None, STEPS_BEFORE),
        ("ep2_to_fsdp2", "fsdp2", first, None, None, STEPS_BEFORE),
        # Two EP groups write the same chunks; compared with its own run, not the whole model's: four micro-batches
        # of 2 in Adam drift ~1e-5 from the whole batch of 8 (summation order), which is not the checkpoint's.
        ("save_dp4", "dp4_ep2", None, fourth, None, STEPS_BEFORE),
        ("dp4_ep2_to_ep4", "ep4", fourth, None, None, STEPS_BEFORE),
        ("ep2_to_tp2", "tp2", first, None, None, STEPS_BEFORE),
    ]
    reference = _checkpoint_reference(spec, plans["ep2"].batch_size)
    for tag, name, load, before, after, step in runs:
        if name not in plans:
            continue
        plan = plans[name]
        codes = spawn_and_wait(expert_workers.checkpoint_worker, plan.gpus,
                               (plan.gpus, free_port(), str(tmp_path / name), spec, str(out), tag, load, before,
                                after), limit_s=180)
        assert codes == [0] * plan.gpus, (tag, codes)
        records = [torch.load(out / f"checkpoint{tag}_rank{r}.pt", weights_only=True) for r in range(plan.gpus)]
        assert all(record["step"] == step for record in records), tag
        if tag == "save_dp4":
            saved_dp4 = records[0]
            continue
        want = saved_dp4 if tag == "dp4_ep2_to_ep4" else reference[step]
        _check_resumed(records, want, tag, zero1=name == "zero1")
    # The experts are stored whole, in their original names.
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    whole = model_file.build().state_dict()
    entries = read_checkpoint_info(first).model_entries()
    assert entries == {k: tuple(v.shape) for k, v in whole.items()}


def test_torch_engine_with_expert_parallel(tmp_path: Path) -> None:
    """--engine torch (torch.distributed.pipelining): its DDP and reducer leave the experts alone."""
    _ep_plan(USER_MOE, tmp_path, ep=2, pp=1, dp=2, microbatches=2, schedule="1f1b")
    _verified(tmp_path, USER_MOE, steps=2, engine="torch")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", *(pytest.param(k, marks=pytest.mark.exhaustive)
                                              for k in ("zb-h1", "interleaved-1f1b", "zbv"))])
def test_torch_engine_pipeline_and_expert_parallel(tmp_path: Path, schedule: str) -> None:
    """pp 2 x dp 2, ep 2 under torch's schedules (two stages per rank for interleaved-1f1b and zbv)."""
    two = schedule in ("interleaved-1f1b", "zbv")
    spec = USER_MOE_DEEP if two else USER_MOE
    _ep_plan(spec, tmp_path, ep=2, pp=2, dp=2, microbatches=4 if two else 2, schedule=schedule,
             chunks=2 if schedule == "interleaved-1f1b" else None)
    _verified(tmp_path, spec, steps=2, engine="torch")


@pytest.mark.exhaustive  # Hugging Face Mixtral, 4 ranks each: ~15-30 s
@pytest.mark.parametrize(("pp", "dp", "ep", "schedule", "chunks"), [
    (1, 4, 4, "1f1b", None), (2, 2, 2, "1f1b", None), (2, 2, 2, "interleaved-1f1b", 2), (2, 2, 2, "zbv", None)])
def test_stacked_mixtral_at_ep4_and_in_a_pipeline(tmp_path: Path, pp: int, dp: int, ep: int, schedule: str,
                                                  chunks: int | None) -> None:
    """Mixtral's four stacked experts one per member (ep 4), and pp 2 x dp 2 ep 2 under 1F1B, interleaved, ZB-V."""
    microbatches = 2 if chunks is None and schedule == "1f1b" else 4
    plan = _ep_plan(MIXTRAL, tmp_path, ep=ep, pp=pp, dp=dp, microbatches=microbatches, schedule=schedule,
                    chunks=chunks, batch_size=2 * dp * microbatches)  # 2 per micro-batch: Mixtral exports alike
    assert plan.ep == ep and {layer.layout for layer in plan.experts} == {"stacked"}
    _verified(tmp_path, MIXTRAL, steps=2)
