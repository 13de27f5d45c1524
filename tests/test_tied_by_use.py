"""Weights tied by use train as the unpartitioned model (issue 29).

Two models read one parameter from several stages under one name:
``flinear_lm`` (an LM head ``F.linear(h, self.emb.weight)``: the first and the last
stage) and ``albert_shared`` (one layer applied at every depth, its calls split
across every stage).  Each is planned with predicted h100 costs (deterministic
splits) and trained on really spawned CPU ranks (:mod:`tied_workers`: one start of
the ranks for every case without DTensors, one for each with): three SGD steps
whose loss, gradients (the tied ones summed over the stages that read them) and
updated parameters equal the whole
model's on the same micro-batches, under every schedule, with replicas averaged
(DDP, our reducer), sharded (ZeRO-1, FSDP2) and tensor-parallel; clipping counts a
tied weight once, ``eval_step`` sees equal copies, a checkpoint stores it once
with the trained value.  The default tier (three starts of four ranks) covers each
schedule and mode once; ``AUTOPARTITION_EXHAUSTIVE=1`` runs both models under every
schedule x layout.

In process: the plan lists the ties with their stages; clipping counts a tie on
its first stage only; a buffer written in forward by several blocks keeps its
reads and writes in one stage (refused, naming it, only where they span the whole
model); what the planner refuses before solving (a tied parameter in two fully
sharded stages of one rank) and what ``--engine torch`` refuses (its split backward with a
parameter read at several ops of one stage), each naming the tensor.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tied_workers import Job, compare, plan_case, train_jobs

from partitioner.errors import AutopartitionError
from partitioner.graph.capture import capture, written_state_nodes
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from runtime.engines.torch_engine import torch_stage_refusal
from runtime.execute.stage import build_local_stages
from runtime.parallel.clip import local_gradients

MODELS = Path(__file__).parent / "models"
ALBERT = str(MODELS / "albert_shared.py")
FLINEAR = str(MODELS / "flinear_lm.py")
SHARED = ("layer.down.bias", "layer.down.weight", "layer.norm.bias", "layer.norm.weight", "layer.up.bias",
          "layer.up.weight")
STEPS = 3
TOLERANCE = 1e-5
CLIP = 0.05

# name: (model, layout, job options); every plan of the default tier in one spawn of four ranks.
Case = tuple[str, dict[str, Any], dict[str, Any]]
DEFAULT: dict[str, Case] = {
    "albert gpipe dp2 (DDP) clipped, saved": (ALBERT, {"pp": 2, "dp": 2, "schedule": "gpipe"},
                                              {"clip": CLIP, "save": True}),
    "albert interleaved": (ALBERT, {"pp": 2, "schedule": "interleaved-1f1b", "chunks": 2, "microbatches": 4}, {}),
    "albert zbv dp2 (reducer)": (ALBERT, {"pp": 2, "dp": 2, "schedule": "zbv"}, {}),
    "albert zb-h1 dp2 full": (ALBERT, {"pp": 2, "dp": 2, "schedule": "zb-h1", "shard": "full"}, {}),
    "albert interleaved, engine torch": (ALBERT, {"pp": 2, "schedule": "interleaved-1f1b", "chunks": 2,
                                                  "microbatches": 4}, {"engine": "torch"}),
    "flinear 1f1b tp2, eval": (FLINEAR, {"pp": 2, "tp": 2, "schedule": "1f1b"}, {"eval": True}),
    "flinear zbv dp2 optimizer": (FLINEAR, {"pp": 2, "dp": 2, "schedule": "zbv", "shard": "optimizer"}, {}),
    "flinear 1f1b dp2 clipped, eval": (FLINEAR, {"pp": 2, "dp": 2, "schedule": "1f1b"}, {"clip": CLIP, "eval": True}),
}


def _exhaustive() -> dict[str, Case]:
    """Both models x every schedule x (one replica, DDP / reducer, ZeRO-1, FSDP2, ZeRO-3, tp 2, engine torch),
    less what the planner refuses (tests below) and what the default tier runs."""
    cases: dict[str, Case] = {}
    for model, spec in (("albert", ALBERT), ("flinear", FLINEAR)):
        for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"):
            base: dict[str, Any] = {"pp": 2, "schedule": schedule}
            if schedule == "interleaved-1f1b":
                base["chunks"] = 2
            layouts: dict[str, dict[str, Any]] = {
                "": {}, "dp2": {"dp": 2}, "dp2 optimizer": {"dp": 2, "shard": "optimizer"},
                "dp2 full": {"dp": 2, "shard": "full"}, "tp2": {"tp": 2}, "tp2 dp2": {"tp": 2, "dp": 2},
            }
            if schedule in ("gpipe", "1f1b"):
                layouts["dp2 zero3"] = {"dp": 2, "shard": "full", "reshard_after_forward": True}
            for label, layout in layouts.items():
                chunked_full = layout.get("shard") == "full" and schedule in ("interleaved-1f1b", "zbv")
                if chunked_full and (model == "albert" or schedule == "zbv"):
                    continue  # refused before solving: a tied parameter in two FSDP units of one rank
                cases[f"{model} {schedule} {label}".strip()] = (spec, {**base, **layout}, {"clip": CLIP})
            if not (model == "albert" and schedule in ("zb-h1", "zbv")):  # torch's split backward refuses those
                cases[f"{model} {schedule} engine torch"] = (spec, base, {"engine": "torch", "eval": True})
    return cases


def _run(root: Path, cases: dict[str, Case]) -> dict[str, tuple[Plan, str, Job, list[dict[str, Any]]]]:
    jobs: dict[str, tuple[Plan, str, Job]] = {}
    for k, (name, (spec, layout, options)) in enumerate(cases.items()):
        directory = root / f"case{k}"
        plan = plan_case(spec, directory, **layout)
        save = str(root / f"ckpt{k}") if options.get("save") else None
        jobs[name] = (plan, spec, Job(str(directory), spec, engine=options.get("engine", "ours"),
                                      clip=options.get("clip"), eval=options.get("eval", False), save=save))
    records = train_jobs([job for _, _, job in jobs.values()], steps=STEPS)
    return {name: (*value, rec) for (name, value), rec in zip(jobs.items(), records, strict=True)}


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, str, Job, list[dict[str, Any]]]]:
    return _run(tmp_path_factory.mktemp("tied-by-use"), DEFAULT)


def _check(plan: Plan, spec: str, job: Job, ranks: list[dict[str, Any]]) -> None:
    diff = compare(plan, spec, ranks, clip=job.clip)
    print(f"{Path(spec).stem} {plan.schedule} pp{plan.pp} dp{plan.dp} tp{plan.tp} "
          f"{plan.stages[0].shard} {job.engine}: max diff {diff.largest():.1e}")
    assert diff.largest() <= TOLERANCE, diff
    assert any(len(t.stages) > 1 for t in plan.tied), "the case splits no tied weight across stages"
    model = load_model_file(spec).build()
    held = {n for r in ranks for n in r["grads"][0]}
    assert set(dict(model.named_parameters())) <= held, "a parameter got no gradient"
    assert diff.compared >= len(held) * STEPS
    if job.clip is not None:
        assert all(r["norms"] for r in ranks)
    if job.eval:
        assert any(r.get("eval") is not None for r in ranks)


@pytest.mark.parametrize("case", list(DEFAULT))
def test_tied_by_use_trains_as_the_whole_model(default_runs: dict[str, Any], case: str) -> None:
    _check(*default_runs[case])


def test_the_checkpoint_stores_a_tied_weight_once_with_its_trained_value(default_runs: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    from runtime.state.folders import find_checkpoint

    _, spec, job, ranks = default_runs["albert gpipe dp2 (DDP) clipped, saved"]
    assert job.save is not None
    folder = find_checkpoint(job.save)
    keys = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    model = load_model_file(spec).build()
    assert {k for k in keys if k.startswith("model.")} == {f"model.{n}" for n in model.state_dict()}
    trained = ranks[0]["params"][-1]  # equal on every rank and replica (compared above)
    state = {f"model.{n}": torch.zeros_like(trained[n]) for n in SHARED}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    for name in SHARED:
        torch.testing.assert_close(state[f"model.{name}"], trained[name], rtol=0, atol=0)


@pytest.mark.exhaustive
def test_every_schedule_and_layout(tmp_path: Path) -> None:
    runs = _run(tmp_path, _exhaustive())
    failures = []
    for name, run in runs.items():
        try:
            _check(*run)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ in process


def _compiled(spec: str, tmp_path: Path, **layout: Any) -> Plan:
    return plan_case(spec, tmp_path, **layout)


def test_the_plan_lists_each_tie_by_use_with_the_stages_reading_it(tmp_path: Path) -> None:
    plan = _compiled(ALBERT, tmp_path / "albert", pp=2, schedule="1f1b")
    ties = {t.name: t for t in plan.tied}
    assert set(ties) == set(SHARED)
    for name in SHARED:
        assert ties[name].aliases == (name,) and ties[name].stages == (0, 1)
        assert all(name in s.parameters for s in plan.stages)
    # Counted in both stages' memory: the solver holds a tied parameter in every stage reading it.
    layer = sum(p.nbytes for p in load_model_file(ALBERT).build().layer.parameters())
    assert all(s.predicted.parameter_bytes >= layer for s in plan.stages)
    lm = _compiled(FLINEAR, tmp_path / "flinear", pp=2, schedule="zbv", microbatches=4)
    (tie,) = lm.tied
    assert (tie.name, tie.aliases, tie.stages) == ("emb.weight", ("emb.weight",), (0, 3))
    assert Plan.load(tmp_path / "flinear").tied == lm.tied  # plan.json keeps it
    exported = plan_compile(load_model_file(FLINEAR), pp=2, dp=1, schedule="1f1b", capture_method="export")
    assert [(t.name, t.stages) for t in exported.tied] == [("emb.weight", (0, 1))]  # an aten graph's get_attr


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_capture_finds_what_several_places_read_by_any_op(method: str) -> None:
    """A module call at every depth, ``F.linear`` and ``h @ w.T`` on another module's weight, buffers read
    through a product; a BatchNorm's running statistics written by every call: fx graphs and aten graphs alike."""
    from partitioner.graph.capture import capture
    from partitioner.graph.ir import KIND_KEY

    cases = [(ALBERT, {*SHARED}, {"layer.gain"}), (FLINEAR, {"emb.weight"}, {"scale"}),
             (f"{FLINEAR}:build_matmul_head", {"emb.weight"}, {"scale"})]
    for spec, parameters, buffers in cases:
        model_file = load_model_file(spec)
        captured = capture(model_file.build(), model_file.example_inputs(4), method=method)  # type: ignore[arg-type]
        nodes = [[n.name] for n in captured.graph_module.graph.nodes if n.meta.get(KIND_KEY) == "compute"]
        assert set(captured.shared_parameters(nodes)) == parameters, (spec, method)
        several = {name for name, groups in captured.state_readers(nodes).items() if len(groups) > 1}
        assert several - parameters == buffers, (spec, method)
        assert captured.written_buffers() == {}, (spec, method)
    bn = load_model_file(f"{ALBERT}:build_batchnorm")
    captured = capture(bn.build(), bn.example_inputs(4), method=method)  # type: ignore[arg-type]
    written = captured.written_buffers()
    assert {"layer.norm.running_mean", "layer.norm.running_var"} <= set(written), method
    assert len(written["layer.norm.running_mean"]) == 8  # one write per depth


def test_clipping_counts_a_tied_weight_on_its_first_stage_only(tmp_path: Path) -> None:
    plan = _compiled(ALBERT, tmp_path, pp=2, schedule="1f1b")
    model_file = load_model_file(ALBERT)
    stages = build_local_stages(plan, model_file.build(), (0, 1))
    for local in stages:
        for p in local.module.parameters():
            p.grad = torch.ones_like(p)
    first, _ = local_gradients(plan, [(0, stages[0].module)], replica=0)
    second, held = local_gradients(plan, [(1, stages[1].module)], replica=0)
    shared = {id(p.grad) for n, p in stages[1].module.named_parameters() if n in SHARED}
    assert not shared & {id(g) for g in second}, "stage 1 counts the layer stage 0 counts already"
    assert shared <= {id(g) for g in held}, "but scales it"
    whole = sum(p.numel() for p in model_file.build().parameters())
    assert sum(g.numel() for g in (*first, *second)) == whole  # every parameter once


def test_a_buffer_written_in_forward_by_several_blocks_keeps_its_writes_and_reads_in_one_stage() -> None:
    """Its reads and writes stay in one stage (the blocks between them too) instead of a refusal: two stages
    would each update their own copy.  A refusal where they span the whole model, naming the buffer."""
    model_file = load_model_file(f"{ALBERT}:build_batchnorm")
    plan = plan_compile(model_file, pp=2, dp=1, schedule="1f1b")
    captured = capture(model_file.build(), model_file.example_inputs(8), method=plan.model.capture)  # type: ignore[arg-type]
    touching = written_state_nodes(captured.graph_module)["layer.norm.running_mean"]
    assert len(touching) == 8 and plan.pp == 2
    assert [s.index for s in plan.stages if set(touching) & set(s.nodes)] == [0], "one stage holds every write"

    class Ends(torch.nn.Module):  # one BatchNorm first and last: nothing can be cut
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc = torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(torch.tanh(self.fc(self.norm(x))))

    ends = SimpleNamespace(build=Ends, example_inputs=lambda n: (torch.randn(n, 6),))
    with pytest.raises(AutopartitionError, match=r"only 1 blocks to place \(the buffer norm\.\w+ is written in "
                       r"forward and read from node norm to node norm_1.*--pp 1"):
        plan_compile(ends, pp=2, dp=1, schedule="1f1b")


def plan_compile(model_file: Any, **layout: Any) -> Plan:
    from partitioner.search.planner import compile

    return compile(model_file.build(), model_file.example_inputs(8), gpus=layout["pp"] * layout["dp"],
                   microbatches=2, device="h100", **layout)


@pytest.mark.parametrize(("spec", "schedule", "refused"), [
    (ALBERT, "zbv", True),
    (ALBERT, "interleaved-1f1b", True),  # the layer's calls fill every stage: two on one rank
    (FLINEAR, "zbv", True),  # the first and the last stage share rank 0
    (FLINEAR, "interleaved-1f1b", False),  # first and last stage on ranks 0 and 1: one FSDP unit each
])
def test_a_tied_parameter_in_two_fully_sharded_stages_of_one_rank_is_refused_before_solving(
    spec: str, schedule: str, refused: bool
) -> None:
    model_file = load_model_file(spec)
    layout = {"pp": 2, "dp": 2, "schedule": schedule, "shard": "full"}
    if not refused:
        plan = plan_compile(model_file, **layout)
        (tie,) = plan.tied
        assert {plan.stages[s].shard for s in tie.stages} == {"full"}
        assert len({plan.stages[s].rank for s in tie.stages}) == len(tie.stages)
        return
    name = "emb.weight" if spec == FLINEAR else r"layer\.down\.bias"
    with pytest.raises(AutopartitionError, match=rf"two FSDP units .*{name}.* --shard optimizer or none"):
        plan_compile(model_file, **layout)


def test_engine_torch_refuses_a_split_backward_over_a_parameter_read_at_several_ops(tmp_path: Path) -> None:
    plan = _compiled(ALBERT, tmp_path / "zb", pp=2, schedule="zb-h1")
    stages = build_local_stages(plan, load_model_file(ALBERT).build(), (0, 1))
    why = torch_stage_refusal(plan, stages)
    assert why is not None and "reads layer." in why and "--engine ours" in why
    whole = _compiled(ALBERT, tmp_path / "1f1b", pp=2, schedule="1f1b")
    assert torch_stage_refusal(whole, build_local_stages(whole, load_model_file(ALBERT).build(), (0, 1))) is None
    lm = _compiled(FLINEAR, tmp_path / "lm", pp=2, schedule="zb-h1")  # its head reads the weight once per stage
    assert torch_stage_refusal(lm, build_local_stages(lm, load_model_file(FLINEAR).build(), (0, 1))) is None
