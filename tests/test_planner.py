"""The compiler driver: valid splits, memory limits, pp x dp search, options, and clear errors.

Costs are predicted for an H100 (``device="h100"``), so plans are deterministic.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from _examples import example as _example
from torch import nn

from partitioner import compile
from partitioner.errors import AutopartitionError, InfeasibleError, InternalError
from partitioner.graph.capture import capture
from partitioner.graph.ir import compute_nodes, graph_fingerprint
from partitioner.graph.values import propagate_values
from partitioner.plan import Plan
from partitioner.schedule.lower import validate
from partitioner.search import assemble
from partitioner.search.planner import stage_layout
from partitioner.solve import scaledcosts

ROOT = Path(__file__).resolve().parent.parent
BATCH = 8




class Model:
    """A model, its example mini-batch, and graph captures cached by micro-batch size."""

    def __init__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        self.module, self.inputs = module, inputs
        self._graphs: dict[tuple[str, int], torch.fx.GraphModule] = {}

    def compile(self, **options: object) -> Plan:
        return compile(self.module, self.inputs, device="h100", **options)  # type: ignore[arg-type]

    def graph(self, plan: Plan) -> torch.fx.GraphModule:
        size = plan.microbatch_size
        key = (plan.model.capture, size)
        if key not in self._graphs:
            micro = tuple(x[:size] for x in self.inputs)
            gm = capture(self.module, micro, method=plan.model.capture).graph_module  # type: ignore[arg-type]
            propagate_values(gm, micro)  # final node kinds: input metadata becomes recomputable
            self._graphs[key] = gm
        gm = self._graphs[key]
        assert graph_fingerprint(gm) == plan.model.fingerprint
        return gm


@pytest.fixture(scope="module")
def gpt() -> Model:
    module = _example("gpt")
    return Model(module.build_model(), module.example_inputs(BATCH))


@pytest.fixture(scope="module")
def cnn() -> Model:
    module = _example("cnn")
    return Model(module.build_model(), module.example_inputs(BATCH))


@pytest.fixture(scope="module")
def gpt_auto(gpt: Model) -> Plan:
    return gpt.compile(gpus=4, microbatches=2)


@pytest.fixture(scope="module")
def gpt_gpipe(gpt: Model) -> Plan:
    return gpt.compile(gpus=4, microbatches=8, pp=4)


@pytest.fixture(scope="module")
def gpt_1f1b(gpt: Model) -> Plan:
    return gpt.compile(gpus=4, microbatches=8, pp=4, schedule="1f1b")


@pytest.fixture(scope="module")
def cnn_pp4(cnn: Model) -> Plan:
    return cnn.compile(gpus=4, microbatches=2, pp=4)


def _check_plan(model: Model, plan: Plan) -> None:
    """Everything any plan must satisfy."""
    gm = model.graph(plan)
    assert plan.pp * plan.dp == plan.gpus
    assert len(plan.stages) == plan.pp
    assert [s.index for s in plan.stages] == list(range(plan.pp))
    assert [s.ranks for s in plan.stages] == stage_layout(plan.pp, plan.dp)
    assert sorted(r for s in plan.stages for r in s.ranks) == list(range(plan.gpus))
    assert plan.batch_size == BATCH
    assert plan.microbatch_size * plan.dp * plan.microbatches == BATCH
    # Every compute node in exactly one stage.
    compute = [n.name for n in compute_nodes(gm)]
    stage_of: dict[str, int] = {}
    for stage in plan.stages:
        mine = [n for n in stage.nodes if n in compute]
        assert len(mine) == stage.compute_nodes > 0
        for name in mine:
            assert name not in stage_of, f"{name} in stages {stage_of[name]} and {stage.index}"
            stage_of[name] = stage.index
        assert set(stage.nodes) <= {n.name for n in gm.graph.nodes}
    assert set(stage_of) == set(compute)
    # Precedence: every edge between compute nodes goes forward, every boundary too.
    for node in gm.graph.nodes:
        if node.name not in stage_of:
            continue
        for arg in node.all_input_nodes:
            if arg.name in stage_of:
                assert stage_of[arg.name] <= stage_of[node.name], (arg.name, node.name)
    for stage in plan.stages:
        for b in stage.inputs:
            assert b.target == stage.index
            assert b.source < b.target
            assert stage_of[b.producer] == b.source
        for b in stage.outputs:
            assert b.source == stage.index and b.source < b.target
    # Output nodes are in the last stage.
    assert all(stage_of[name] == plan.pp - 1 for name in plan.model.outputs)
    # The schedule is the one the runtime will run, and it is valid.
    validate(plan.schedule_data(), sends_to=plan.sends_to(), receives_from=plan.receives_from())
    # Candidates are shapes of the GPU count.
    for c in plan.candidates:
        assert c.pp * c.dp == plan.gpus
    assert (plan.pp, plan.dp) in {(c.pp, c.dp) for c in plan.candidates}


def _memory_within(plan: Plan, limit: float) -> None:
    assert plan.cost_model.memory_limit == limit
    assert len(plan.predicted.peak_memory_bytes) == plan.pp
    for peak in plan.predicted.peak_memory_bytes:
        assert 0 < peak <= limit
    for stage in plan.stages:
        assert 0 < stage.predicted.memory_bytes <= limit


# ----------------------------------------------------------------- valid plans


def test_gpt_auto_plan(gpt: Model, gpt_auto: Plan) -> None:
    _check_plan(gpt, gpt_auto)
    assert gpt_auto.gpus == 4
    assert {(c.pp, c.dp) for c in gpt_auto.candidates} == {(4, 1), (2, 2), (1, 4)}  # all divisors
    # The chosen shape is the best simulated one.
    chosen = next(c for c in gpt_auto.candidates if c.note == "chosen")
    simulated = [c.simulated_s for c in gpt_auto.candidates if c.simulated_s is not None]
    assert chosen.simulated_s == min(simulated)
    _memory_within(gpt_auto, 80e9)  # the H100's memory by default


def test_gpt_fixed_pp_plans(gpt: Model, gpt_gpipe: Plan, gpt_1f1b: Plan) -> None:
    for plan in (gpt_gpipe, gpt_1f1b):
        _check_plan(gpt, plan)
        assert (plan.pp, plan.dp) == (4, 1)
        assert [(c.pp, c.dp) for c in plan.candidates] == [(4, 1)]
    assert gpt_gpipe.schedule == "gpipe" and gpt_1f1b.schedule == "1f1b"
    # The tied embedding is held by the first and last stages.
    (tied,) = gpt_gpipe.tied
    assert tied.name == "wte.weight"
    assert tied.stages == (0, 3)


def test_cnn_plan_with_a_long_skip(cnn: Model, cnn_pp4: Plan) -> None:
    _check_plan(cnn, cnn_pp4)
    assert cnn_pp4.pp == 4
    skips = [b for s in cnn_pp4.stages for b in s.inputs if b.target - b.source > 1]
    assert skips, "the long skip connection crosses more than one boundary"
    assert cnn_pp4.sends_to()[skips[0].source]  # sent straight to the stage that reads it


def test_cnn_auto_lists_every_divisor(cnn: Model) -> None:
    plan = cnn.compile(gpus=6, microbatches=1, max_blocks=16)
    _check_plan(cnn, plan)
    assert {(c.pp, c.dp) for c in plan.candidates} == {(6, 1), (3, 2), (2, 3), (1, 6)}
    skipped = {(c.pp, c.dp) for c in plan.candidates if c.status == "skipped"}
    assert skipped == {(2, 3), (1, 6)}  # a batch of 8 does not split over 3 or 6 replicas
    for c in plan.candidates:
        assert (c.step_s is None) == (c.status == "skipped")


def test_dp_option_is_respected(gpt: Model) -> None:
    plan = gpt.compile(gpus=4, microbatches=2, dp=2)
    _check_plan(gpt, plan)
    assert (plan.pp, plan.dp) == (2, 2)
    assert [(c.pp, c.dp) for c in plan.candidates] == [(2, 2)]
    assert plan.microbatch_size == 2
    assert plan.model.inputs[0].shape == (2, 32)  # boundary shapes are per replica
    for stage in plan.stages:
        for b in stage.inputs:
            assert b.shape[0] == 2


def test_pp_and_dp_together(gpt: Model) -> None:
    plan = gpt.compile(gpus=4, microbatches=2, pp=4, dp=1)
    assert (plan.pp, plan.dp) == (4, 1)


def test_one_gpu(gpt: Model) -> None:
    plan = gpt.compile(gpus=1, microbatches=2)
    _check_plan(gpt, plan)
    assert (plan.pp, plan.dp) == (1, 1)
    assert plan.stages[0].inputs == () and plan.stages[0].outputs == ()


# ----------------------------------------------------------------- memory


def test_memory_limit_is_respected(gpt: Model, gpt_gpipe: Plan) -> None:
    unconstrained = max(gpt_gpipe.predicted.peak_memory_bytes)
    limit = 0.98 * unconstrained  # the unconstrained split no longer fits
    plan = gpt.compile(gpus=4, microbatches=8, pp=4, memory_per_gpu=limit)
    _check_plan(gpt, plan)
    _memory_within(plan, limit)
    assert [s.nodes for s in plan.stages] != [s.nodes for s in gpt_gpipe.stages]
    assert plan.predicted.step_s >= gpt_gpipe.predicted.step_s * (1 - 1e-9)  # a constraint costs time


def test_1f1b_needs_no_more_memory_than_gpipe(gpt: Model) -> None:
    # Memory does not bind here, so both schedules solve to the same split (before the
    # simulation-guided refinement, which may move each schedule's split differently).
    gpt_gpipe = gpt.compile(gpus=4, microbatches=8, pp=4, refine_simulations=0)
    gpt_1f1b = gpt.compile(gpus=4, microbatches=8, pp=4, schedule="1f1b", refine_simulations=0)
    assert [s.nodes for s in gpt_1f1b.stages] == [s.nodes for s in gpt_gpipe.stages]
    gpipe, one = gpt_gpipe.predicted.peak_memory_bytes, gpt_1f1b.predicted.peak_memory_bytes
    for s, (a, b) in enumerate(zip(gpipe, one)):
        assert b <= a, s
    # With 8 micro-batches and 4 stages, 1F1B holds at most 4 - s of them: strictly less.
    assert all(b < a for a, b in zip(gpipe, one))
    for g, f in zip(gpt_gpipe.stages, gpt_1f1b.stages):
        assert f.predicted.memory_bytes <= g.predicted.memory_bytes


def _gib_or_mib(text: str) -> float:
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    match = re.search(r"would need about ([\d.]+) (B|KiB|MiB|GiB|TiB)", text)
    assert match, text
    return float(match[1]) * units[match[2]]


def test_too_little_memory_says_what_it_would_take(gpt: Model, gpt_gpipe: Plan) -> None:
    limit = 0.5 * max(gpt_gpipe.predicted.peak_memory_bytes)
    with pytest.raises(InfeasibleError) as info:
        gpt.compile(gpus=4, microbatches=8, memory_per_gpu=limit)
    message = " ".join(str(info.value).split())
    assert "4 GPUs" in message
    match = re.search(r"fit on (\d+) GPUs", message)
    assert match, message
    gpus = int(match[1])
    assert gpus > 4
    need = _gib_or_mib(message)
    assert need > limit
    # Both suggestions hold: that many GPUs as stages fits, and so does that much memory.
    plan = gpt.compile(gpus=gpus, microbatches=8, pp=gpus, memory_per_gpu=limit)
    _memory_within(plan, limit)
    roomy = need * 1.01  # the message rounds
    plan = gpt.compile(gpus=4, microbatches=8, pp=4, memory_per_gpu=roomy)
    _memory_within(plan, roomy)


def test_hopelessly_little_memory(gpt: Model) -> None:
    with pytest.raises(InfeasibleError) as info:
        gpt.compile(gpus=2, microbatches=2, memory_per_gpu=1000.0)
    message = " ".join(str(info.value).split())
    assert "2 GPUs" in message
    assert "1000 B" in message or "0.00" in message
    assert _gib_or_mib(message) > 1000  # how much memory two stages would need
    assert "--memory-per-gpu" in message


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"gpus": 0}, r"--gpus must be at least 1, got 0"),
        ({"gpus": -2}, r"--gpus must be at least 1"),
        ({"gpus": 2, "microbatches": 3}, r"batch of 8 does not split into 3 equal micro-batches"),
        ({"gpus": 2, "microbatches": 0}, r"--microbatches must be at least 1"),
        ({"gpus": 4, "pp": 3}, r"--pp 3 must be a positive divisor of --gpus 4"),
        ({"gpus": 4, "dp": 3}, r"--dp 3 must be a positive divisor of --gpus 4"),
        ({"gpus": 4, "pp": 2, "dp": 1}, r"--pp 2 x --dp 1 = 2, but --gpus is 4"),
        ({"gpus": 2, "schedule": "zerobubble"}, r"Unknown schedule 'zerobubble'"),
    ],
)
def test_bad_options(gpt: Model, options: dict[str, object], pattern: str) -> None:
    options.setdefault("microbatches", 2)
    with pytest.raises(AutopartitionError, match=pattern):
        gpt.compile(**options)


def test_unknown_device(gpt: Model) -> None:
    with pytest.raises(AutopartitionError, match="Unknown device 'v100'"):
        compile(gpt.module, gpt.inputs, gpus=2, microbatches=2, device="v100")


def test_inputs_with_different_batch_sizes() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.sum() + b.sum()

    with pytest.raises(AutopartitionError, match="batch in dimension 0"):
        compile(Two(), (torch.randn(4, 2), torch.randn(3, 2)), gpus=1, microbatches=1, device="h100")


def test_more_stages_than_blocks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(AutopartitionError) as info:
        compile(model, (torch.randn(4, 4),), gpus=4, microbatches=1, device="h100", pp=4)
    message = str(info.value)
    assert "4 GPUs" in message
    assert "--pp 2" in message  # says what would work


# ----------------------------------------------------------------- symbolic trace


class DeviceAware(nn.Module):
    """Reads ``x.device`` early and uses it late (a common pattern for creating tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device
        h = self.a(x)
        return self.b(h) + torch.ones(64, device=device)


def test_symbolic_trace_with_non_tensor_value_across_stages() -> None:
    torch.manual_seed(0)
    model = DeviceAware()
    inputs = (torch.randn(BATCH, 64),)
    plan = compile(model, inputs, gpus=2, microbatches=2, device="h100", pp=2,
                   capture_method="symbolic_trace")
    assert plan.pp == 2
    assert plan.model.capture == "symbolic_trace"


# ----------------------------------------------------------------- internals


def test_each_shape_formulated_once_and_stage_code_only_for_the_chosen_plan(
    gpt: Model, gpt_auto: Plan, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"formulate": 0, "build_stage": 0}
    callers = {"formulate": scaledcosts, "build_stage": assemble}  # where each is looked up

    def counted(name: str) -> object:
        real = getattr(callers[name], name)

        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    for name in calls:
        monkeypatch.setattr(callers[name], name, counted(name))
    plan = gpt.compile(gpus=4, microbatches=2)
    assert plan == dataclasses.replace(gpt_auto, solver=dataclasses.replace(gpt_auto.solver, wall_s=plan.solver.wall_s))
    solved = [c for c in plan.candidates if c.step_s is not None]
    assert calls == {"formulate": len(solved), "build_stage": plan.pp}
    assert len(plan.stage_code) == plan.pp


def test_a_backward_boundary_is_an_internal_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    inputs = (torch.randn(2, 4),)
    gm = capture(model, inputs, method="symbolic_trace").graph_module
    propagate_values(gm, inputs)
    first, second = (n.name for n in compute_nodes(gm))
    with pytest.raises(InternalError, match="flows backward 1->0"):
        assemble._boundaries(gm, {first: 1, second: 0}, 2)


# ----------------------------------------------------------------- micro-batch sizes the graph differs at


class PosNet(nn.Module):
    """Position embeddings expanded to the batch only when it has several samples, as Hugging Face's mask code
    does: exported at one sample, the graph loses that ``expand`` and later nodes are renamed."""

    def __init__(self, d: int = 32, seq: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.pos = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        ids = torch.arange(s).unsqueeze(0)
        if b > 1:
            ids = ids.expand(b, -1)
        h = x + self.pos(ids).expand(b, -1, -1)
        for layer in self.layers:
            h = torch.relu(layer(h)) + h
        return h.sum(dim=(1, 2))


def _posnet() -> PosNet:
    torch.manual_seed(0)
    return PosNet()


def test_one_sample_micro_batches_are_planned_on_their_own_graph() -> None:
    """The export at one sample differs from the costed one (two samples); its nodes map onto the costed blocks."""
    from inprocess import run_stages

    model, inputs = _posnet(), (torch.randn(4, 16, 32),)
    graphs = {size: capture(model, (inputs[0][:size],), method="export").graph_module for size in (1, 2)}
    assert graph_fingerprint(graphs[1]) != graph_fingerprint(graphs[2])
    options = {"gpus": 2, "pp": 2, "microbatches": "auto", "schedule": "1f1b", "device": "h100",
               "capture_method": "export"}
    free = compile(model, inputs, **options)  # type: ignore[arg-type]
    memory = {c.microbatches: c.memory_bytes for c in free.candidates}
    assert memory[4] is not None and memory[2] is not None and memory[4] < memory[2]
    # 1F1B on 2 stages holds two micro-batches: under this cap only one-sample micro-batches fit.
    plan = compile(model, inputs, **options, memory_per_gpu=(memory[4] + memory[2]) / 2)  # type: ignore[arg-type]
    assert (plan.microbatches, plan.microbatch_size) == (4, 1)
    assert plan.model.fingerprint == graph_fingerprint(graphs[1])
    assert plan.model.inputs[0].shape == (1, 16, 32)
    assert [c.status for c in plan.candidates if c.microbatches == 4] == ["optimal"]
    # It runs: every stage rebuilt from the graph at one sample gives the model's own loss and gradients.
    loss, grads = run_stages(plan, _posnet, inputs, loss_fn=lambda out, _target: out.sum())
    reference = _posnet()
    expected = reference(*inputs).sum() / 4
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-4)


def test_a_size_that_cannot_be_captured_is_skipped_not_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every simulated candidate at a size whose capture fails: skipped with the reason, and the next best drafted."""
    from partitioner.errors import CaptureError
    from partitioner.search import layouts as search
    from partitioner.search import planner

    real = planner.capture

    def capture_but_not_16(model: nn.Module, inputs: object, **kwargs: object) -> object:
        if isinstance(inputs, tuple) and inputs[0].shape[0] == 16:
            raise CaptureError("no graph at 16 samples (test)")
        return real(model, inputs, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "capture", capture_but_not_16)
    monkeypatch.setattr(search, "SIMULATED_CANDIDATES", 1)  # the whole-batch micro-batch alone is simulated
    model, inputs = _posnet(), (torch.randn(16, 16, 32),)
    plan = compile(model, inputs, gpus=2, pp=2, microbatches="auto", schedule="1f1b", device="h100",
                   capture_method="export")
    rows = {c.microbatches: c for c in plan.candidates}
    assert rows[1].status == "skipped"
    assert "cannot be planned at 16 samples per micro-batch: no graph at 16 samples (test)" in rows[1].note
    assert plan.microbatches != 1 and plan.stages
