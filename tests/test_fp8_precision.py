"""--precision fp8 (issue 33): bytes, peaks and refusals; the planner's FP8 matmuls; the runtime's FP8 matmuls.

Planned: the linear layers' matmuls at the device's FP8 peak plus their casts, their
inputs saved in FP8, state as bf16-mixed.  Run: the same nodes of each stage graph
rewritten into scaled FP8 matmuls, and ``verify`` against the whole graph run through
the same rewrite.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from _examples import example
from torch import nn

from partitioner.cli import main
from partitioner.cost.devices import DEVICES
from partitioner.cost.nodecost import NodeCost
from partitioner.cost.precision import (
    FP8_DTYPE,
    PRECISIONS,
    check_precision,
    compute_dtype,
    fp8_cast_bytes,
    fp8_peak,
    gradient_bytes_per_element,
    runs_autocast,
    static_bytes_per_element,
)
from partitioner.errors import AutopartitionError
from partitioner.graph.capture import capture
from partitioner.graph.fp8 import fp8_matmuls
from partitioner.plan import Plan
from partitioner.schedule.simulate import stage_static_bytes
from partitioner.search.planner import compile
from partitioner.solve.formulate import at_precision, node_times
from runtime.state.fp8 import convert_graph, fp8_linear, quantize

ROOT = Path(__file__).resolve().parents[1]
gpt = example("gpt")

# ------------------------------------------------------------------ pure functions


def test_fp8_keeps_bf16_mixed_state_and_compute() -> None:
    assert "fp8" in PRECISIONS and check_precision("fp8") == "fp8"
    assert static_bytes_per_element("fp8", 2) == static_bytes_per_element("bf16-mixed", 2) == 16
    assert gradient_bytes_per_element("fp8") == 4 and compute_dtype("fp8") == "bfloat16"
    assert runs_autocast("fp8") and runs_autocast("bf16-mixed") and not runs_autocast("bf16")


@pytest.mark.parametrize(("device", "peak"), [
    ("h100", 1979e12), ("h200", 1979e12), ("h800", 1979e12), ("b200", 4.5e15), ("gb200", 5e15), ("b300", 4.5e15),
    ("mi300x", 2614.9e12), ("mi325x", 2614.9e12), ("mi355x", 5e15), ("l40s", 733e12),
    ("a100", None), ("a100-40gb", None), ("cpu", None),
])
def test_fp8_peaks(device: str, peak: float | None) -> None:
    assert fp8_peak(DEVICES[device].peak_flops) == peak
    if peak is not None:
        assert fp8_peak(DEVICES[device].peak_flops, "rowwise") == pytest.approx(0.9 * peak)
        assert peak > DEVICES[device].peak("bfloat16")  # FP8 tensor cores are faster than bf16 ones


def test_mxfp8_only_on_blackwell() -> None:
    assert sorted(n for n, s in DEVICES.items() if fp8_peak(s.peak_flops, "mxfp8")) == ["b200", "b300", "gb200"]


def test_cast_bytes() -> None:
    # 1000 input + 1000 output elements, 500 weight ones: forward casts input and weight, backward the gradient.
    assert fp8_cast_bytes(2000, 500) == (3 * 1500, 3 * 1000)


def test_an_fp8_matmul_is_priced_at_the_fp8_peak_plus_its_casts() -> None:
    big = NodeCost(0.0, 0.0, 2 * 8192 * 4096 * 4096, 4 * 8192 * 4096 * 4096, 8192 * 4096 * 4,
                   4 * (8192 * 4096 * 2 + 4096 * 4096), "float32", weight_bytes=4 * 4096 * 4096)
    h100 = DEVICES["h100"]
    bf16 = node_times({"mm": big}, h100, precision="bf16-mixed")["mm"]
    fp8 = node_times({"mm": dataclasses.replace(big, fp8_matmul=True)}, h100, precision="fp8")["mm"]
    # Matmul-bound: about twice as fast (1979 against 989 TFLOP/s), less the casts.
    assert 0.5 < fp8[0] / bf16[0] < 0.65 and 0.5 < fp8[1] / bf16[1] < 0.65
    rowwise = node_times({"mm": dataclasses.replace(big, fp8_matmul=True)}, h100, precision="fp8",
                         fp8_recipe="rowwise")["mm"]
    assert rowwise[0] > fp8[0]
    # A node not marked is bf16-mixed's under fp8; a small matmul loses to its casts' launches.
    assert node_times({"mm": big}, h100, precision="fp8")["mm"] == bf16
    small = NodeCost(0.0, 0.0, 2 * 64 * 64 * 64, 4 * 64 * 64 * 64, 64 * 64 * 4, 4 * 3 * 64 * 64, "float32",
                     weight_bytes=4 * 64 * 64)
    assert node_times({"mm": dataclasses.replace(small, fp8_matmul=True)}, h100, precision="fp8")["mm"][0] > \
        node_times({"mm": small}, h100, precision="bf16-mixed")["mm"][0]


def test_an_fp8_matmul_saves_its_input_in_fp8() -> None:
    c = NodeCost(0.0, 0.0, 1e9, 2e9, 4000, 10000, "float32", weight_bytes=400, saved_float32_bytes=4000)
    assert at_precision(c, "bf16-mixed").saved_bytes == 2000
    f = at_precision(dataclasses.replace(c, fp8_matmul=True), "fp8")
    assert f.dtype == FP8_DTYPE and f.saved_bytes == 1000 and f.io_bytes == 5000
    assert at_precision(dataclasses.replace(c, fp8_matmul=True), "bf16-mixed").dtype == "bfloat16"


# ------------------------------------------------------------------ which nodes


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_the_linear_layers_but_the_head_are_found(method: str) -> None:
    model = gpt.build_model()
    gm = capture(model, gpt.example_inputs(2), method=method).graph_module  # type: ignore[arg-type]
    found = fp8_matmuls(gm)
    weights = sorted(m.weight for m in found.values())
    assert len(found) == 16  # 4 layers x (qkv, attention out, MLP in, MLP out); attention's matmuls are not
    assert all(".attn." in w or ".mlp." in w for w in weights) and "lm_head.weight" not in weights


class _Forms(nn.Module):
    """Linear layers written every way the recogniser reads, and two it must not take."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(32, 16))  # [out, in]
        self.b = nn.Parameter(torch.randn(32, 32))  # [in, out]
        self.bias = nn.Parameter(torch.randn(48))
        self.c = nn.Parameter(torch.randn(48, 32))
        self.odd = nn.Parameter(torch.randn(24, 48))  # 24 is no multiple of 16: not FP8
        self.head = nn.Linear(48, 16)  # the last linear layer: bf16

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = nn.functional.linear(x, self.a)
        h = h @ self.b
        h = torch.addmm(self.bias, h, self.c.t())
        h = h @ h.t() @ h  # activation x activation: not a linear layer
        return self.head(h), nn.functional.linear(h, self.odd)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_every_form_of_a_linear_layer(method: str) -> None:
    torch.manual_seed(0)
    model = _Forms()
    x = torch.randn(8, 16)
    gm = capture(model, (x,), method=method).graph_module  # type: ignore[arg-type]
    found = fp8_matmuls(gm)
    assert sorted(m.weight for m in found.values()) == ["a", "b", "c"], found
    assert {m.weight: m.transposed for m in found.values()} == {"a": False, "b": True, "c": False}
    assert [m.bias for m in found.values() if m.weight == "c"] == ["bias"]
    want = model(x)[0]
    assert convert_graph(gm, found) == 3
    got = gm(x)[0].detach()
    want = want.detach()
    assert got.shape == want.shape and not torch.equal(got, want)  # FP8 rounding shows
    assert float((got - want).abs().max() / want.abs().max()) < 0.2


# ------------------------------------------------------------------ refusals


def test_fp8_is_refused_where_there_are_no_fp8_tensor_cores() -> None:
    model, x = gpt.build_model(), gpt.example_inputs(4)
    for device in ("a100", "cpu"):
        with pytest.raises(AutopartitionError, match="fp8") as err:
            compile(model, x, gpus=1, device=device, precision="fp8", microbatches=2)
        assert "h100" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(AutopartitionError, match="mxfp8.*Blackwell.*b200"):
        compile(model, x, gpus=1, device="h100", precision="fp8", fp8_recipe="mxfp8", microbatches=2)
    with pytest.raises(AutopartitionError, match="Unknown FP8 recipe"):
        compile(model, x, gpus=1, device="h100", precision="fp8", fp8_recipe="blockwise", microbatches=2)


def test_the_command_line_takes_fp8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    code = main([str(ROOT / "examples" / "gpt.py"), "--gpus", "2", "--batch-size", "8", "--microbatches", "2",
                 "--device", "h100", "--precision", "fp8", "--fp8-recipe", "rowwise", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    plan = Plan.load(out)
    assert (plan.precision, plan.fp8_recipe) == ("fp8", "rowwise")
    assert main([str(ROOT / "examples" / "gpt.py"), "--gpus", "1", "--device", "a100", "--precision", "fp8",
                 "--quiet"]) == 2
    assert "FP8 tensor cores" in capsys.readouterr().err


# ------------------------------------------------------------------ planned


def _wide_gpt() -> nn.Module:
    with torch.device("meta"):
        return gpt.GPT(gpt.GPTConfig(n_embd=1024, n_layer=2, n_head=16))


def test_fp8_plans_a_faster_step_with_the_same_state() -> None:
    model, x = _wide_gpt(), gpt.example_inputs(256)  # 8192 tokens a micro-batch: matmul-bound
    plans = {p: compile(model, x, gpus=1, device="h100", precision=p, microbatches=1, schedule="gpipe")
             for p in ("bf16-mixed", "fp8")}
    bf16, fp8 = plans["bf16-mixed"], plans["fp8"]
    assert fp8.predicted.step_s < 0.85 * bf16.predicted.step_s
    assert stage_static_bytes(fp8) == stage_static_bytes(bf16)  # fp32 master weights, gradients, Adam: 16 B each
    # The FP8 matmuls' inputs are saved in 1 byte, not bf16's 2: less activation memory, not less than half.
    a8, a16 = fp8.stages[0].predicted.activation_bytes, bf16.stages[0].predicted.activation_bytes
    assert 0.5 * a16 < a8 < a16
    assert fp8.precision == "fp8" and fp8.fp8_recipe == "tensorwise"
    assert Plan.from_json(fp8.to_json()).precision == "fp8"
    # MFU is over the 16-bit peak (one peak for FP8 and bf16 matmuls): the report says so for the FP8 plan only.
    from partitioner.report.table import assumptions
    mfu = {p: dict(assumptions(plan))["MFU"] for p, plan in plans.items()}
    assert "16-bit peak" in mfu["fp8"] and "16-bit" not in mfu["bf16-mixed"]


def test_an_fp8_plan_that_does_not_fit_says_what_would() -> None:
    with pytest.raises(AutopartitionError) as err:
        compile(_wide_gpt(), gpt.example_inputs(256), gpus=1, device="h100", precision="fp8", microbatches=1,
                schedule="gpipe", recompute="none", memory_per_gpu=2**28)
    assert "fp8" in str(err.value)


# ------------------------------------------------------------------ run


@pytest.mark.parametrize(("batch", "k", "n"), [((4, 8), 32, 48), ((5, 3), 40, 24)])  # the second one padded
def test_fp8_linear_is_a_scaled_matmul_of_the_fp8_casts(batch: tuple[int, int], k: int, n: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(*batch, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True)
    y = fp8_linear(x, w, b)
    (qx, sx), (qw, sw) = quantize(x.detach().reshape(-1, k), torch.float8_e4m3fn), quantize(w.detach(),
                                                                                            torch.float8_e4m3fn)
    want = (qx.float() * sx) @ (qw.float() * sw).t() + b.detach()
    assert torch.allclose(y.reshape(-1, n), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(y)
    y.backward(grad)
    qg, sg = quantize(grad.reshape(-1, n), torch.float8_e5m2)
    g = qg.float() * sg
    assert torch.allclose(x.grad.reshape(-1, k), g @ (qw.float() * sw), rtol=1e-5, atol=1e-5)  # type: ignore[union-attr]
    assert torch.allclose(w.grad, g.t() @ (qx.float() * sx), rtol=1e-5, atol=1e-4)  # type: ignore[arg-type]
    assert torch.allclose(b.grad, grad.reshape(-1, n).sum(0))  # type: ignore[arg-type]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp8_linear(x, w, b).dtype == torch.bfloat16  # as autocast's linear


def test_rowwise_scales_each_row() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    x[0] *= 1e5  # one large row: tensorwise scaling pushes the others into FP8 subnormals, rowwise does not
    w = torch.randn(16, 32)
    want = x @ w.t()
    err = {r: float((fp8_linear(x, w, recipe=r) - want)[1:].abs().max() / want[1:].abs().max())
           for r in ("tensorwise", "rowwise")}
    assert err["rowwise"] < 0.1 < err["tensorwise"], err


def test_fp8_linear_saves_its_input_in_fp8() -> None:
    x = torch.randn(64, 32, requires_grad=True)
    w = nn.Parameter(torch.randn(16, 32))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fp8_linear(x, w)
    activations = [t for t in saved if t is not w and t.numel() > 1]
    assert [(t.dtype, t.shape) for t in activations] == [(torch.float8_e4m3fn, torch.Size([64, 32]))]


def test_the_verify_reference_runs_the_fp8_matmuls(tmp_path: Path) -> None:
    """The reference differs from the float32 model: a rank without the FP8 matmuls would not match it."""
    from runtime.verify import _fp8_reference

    torch.manual_seed(0)
    model = gpt.build_model()
    plan = compile(model, gpt.example_inputs(8), gpus=1, device="h100", precision="fp8", microbatches=2)
    x = gpt.example_inputs(4)
    reference, _ = _fp8_reference(plan, model)
    got, want = reference(*x), model(*x)
    assert got.shape == want.shape and float((got - want).detach().abs().max()) > 1e-3


def test_a_tensor_parallel_fp8_reference_computes_the_split_layers_per_rank() -> None:
    """Under tp 2 the reference runs each split layer as its ranks do (runtime.parallel.splitorder): the same
    function as the tp 1 reference, up to float32 order and the FP8 steps it moves."""
    from runtime.parallel.splitorder import VocabularyParallelLoss, split_column, split_row
    from runtime.verify import _fp8_reference

    torch.manual_seed(0)
    model = gpt.build_model()
    plans = {tp: compile(model, gpt.example_inputs(8), gpus=tp, device="h100", precision="fp8", tp=tp,
                         microbatches=2, gpus_per_node=tp) for tp in (1, 2)}
    (whole, _), (split, loss) = (_fp8_reference(plans[tp], model) for tp in (1, 2))
    targets = [n.target for n in split.gm.graph.nodes]  # type: ignore[union-attr]
    assert targets.count(split_column) == 5 and targets.count(split_row) == 4  # 4 MLPs and the LM head
    assert isinstance(loss, VocabularyParallelLoss) and loss.vocabulary == gpt.GPTConfig().vocab_size
    x = gpt.example_inputs(4)
    got, want = split(*x).detach(), whole(*x).detach()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-3  # the FP8 matmuls themselves differ by ~5%


def _verify(tmp_path: Path, schedule: str, *, pp: int, dp: int, microbatches: int, tp: int = 1,
            recipe: str = "tensorwise", steps: int = 2, model: str = "gpt", shard: str = "none") -> None:
    """Verify an fp8 plan; ``shard``: every stage ``none``, ``full`` (FSDP2, kept gathered) or ``zero3`` (FSDP2,
    resharded after forward), ``hsdp-zero3`` (zero3 sharded inside nodes of 2 GPUs, replicated across them)."""
    from partitioner.modelfile import load_model_file
    from runtime.verify import verify

    spec = str(ROOT / "examples" / f"{model}.py")
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    assert model_file.example_target is not None
    plan = compile(model_file.build(), model_file.example_inputs(8), gpus=pp * dp * tp, device="h100",
                   precision="fp8", fp8_recipe=recipe, schedule=schedule, loss_fn=model_file.loss_fn,
                   target=model_file.example_target(8), pp=pp, dp=dp, tp=tp, microbatches=microbatches,
                   gpus_per_node=2 if shard.startswith("hsdp") else max(tp, 1))
    assert (plan.tp, plan.pp, plan.fp8_recipe) == (tp, pp, recipe)
    if shard != "none":
        plan = dataclasses.replace(plan, stages=tuple(
            dataclasses.replace(s, shard="full", reshard_after_forward=shard.endswith("zero3"),
                                shard_span="node" if shard.startswith("hsdp") else "world")
            for s in plan.stages))
    plan.save(tmp_path)
    result = verify(tmp_path, spec, steps=steps)
    assert result.ok, result.report()
    assert result.max_grad_diff < 1e-6, result.report()


@pytest.mark.slow
def test_verify_fp8_pp2_dp2_1f1b(tmp_path: Path) -> None:
    _verify(tmp_path, "1f1b", pp=2, dp=2, microbatches=2)


# FSDP2 (issue: FP8 with sharded replicas): the FP8 casts read the gathered weights, which must be the whole ones.
@pytest.mark.slow
@pytest.mark.parametrize(("pp", "dp", "shard"), [(2, 2, "full"), (2, 2, "zero3"), (1, 4, "hsdp-zero3"),
                                                 pytest.param(1, 4, "zero3", marks=pytest.mark.exhaustive)])
def test_verify_fp8_fully_sharded(tmp_path: Path, pp: int, dp: int, shard: str) -> None:
    _verify(tmp_path, "1f1b", pp=pp, dp=dp, microbatches=2, shard=shard)


@pytest.mark.exhaustive  # the slow tier keeps zbv under tp and FSDP2 under 1f1b
def test_verify_fp8_fully_sharded_zbv(tmp_path: Path) -> None:  # W's weight gradients on the FP8-gathered weights
    _verify(tmp_path, "zbv", pp=2, dp=2, microbatches=4, shard="full", model="llama")


@pytest.mark.slow
def test_verify_fp8_zbv(tmp_path: Path) -> None:
    _verify(tmp_path, "zbv", pp=2, dp=1, microbatches=4)


# Tensor-parallel FP8 (tp 2 x pp 2): every FP8 cast of a rank's shards is the whole tensor's (amaxes all-reduced),
# but the ranks add some float32 sums in another order (row-parallel partial products, a column's input gradient,
# the vocabulary-parallel loss); a last-bit difference landing on an FP8 rounding boundary would move that element
# one FP8 step and the gradients below it by ~1e-3.  verify's reference therefore adds those sums in the ranks'
# order (runtime/parallel/splitorder.py; tests/test_fp8_tensor_parallel.py checks it bit for bit), and a pair kept
# whole (GPT's fused c_attn) runs whole on every rank: every step matches to 1e-6, tensorwise and rowwise.
# Measured over 4 steps at 5 learning rates (gpt, 1f1b): 8 of 20 steps matched before, 20 of 20 now.
@pytest.mark.slow
def test_verify_fp8_tp2_pp2_1f1b(tmp_path: Path) -> None:
    _verify(tmp_path, "1f1b", pp=2, dp=1, tp=2, microbatches=2, steps=3)


@pytest.mark.slow
def test_verify_fp8_tp2_pp2_1f1b_rowwise(tmp_path: Path) -> None:
    _verify(tmp_path, "1f1b", pp=2, dp=1, tp=2, microbatches=2, steps=3, recipe="rowwise")


@pytest.mark.slow
def test_verify_fp8_tp2_pp2_zbv(tmp_path: Path) -> None:
    _verify(tmp_path, "zbv", pp=2, dp=1, tp=2, microbatches=4, steps=2, model="llama")


def test_fp8_plans_tensor_parallel_layouts() -> None:
    model = gpt.build_model()
    plan = compile(model, gpt.example_inputs(8), gpus=2, device="h100", precision="fp8", tp=2, microbatches=2,
                   gpus_per_node=2)
    assert (plan.tp, plan.precision) == (2, "fp8")


@pytest.mark.slow  # spawns ranks
def test_fp8_pipeline_equals_the_whole_graph_in_fp8(tmp_path: Path) -> None:
    """An fp8 plan run as planned (autocast, FP8 matmuls) on pp 2 x dp 2 ranks: the same training as the whole
    captured graph converted alike, and not the same as bf16-mixed (the FP8 matmuls ran)."""
    from runtime_workers import plan_model, reference_run  # type: ignore[import-not-found]

    plan = plan_model(_MLP, tmp_path, pp=2, dp=2, microbatches=2, precision="fp8")
    ranks = _train_three_steps(plan, tmp_path)
    assert all(set(r["dtypes"].values()) == {"bfloat16"} for r in ranks)
    same = reference_run(_MLP, dp=2, microbatches=2, steps=3, lr=0.1, precision="fp8")
    assert _largest_difference(ranks, same) <= 1e-6
    bf16 = reference_run(_MLP, dp=2, microbatches=2, steps=3, lr=0.1, precision="bf16-mixed")
    assert _largest_difference(ranks, bf16) > 1e-4


_MLP = str(ROOT / "tests" / "models" / "mlp.py")


def _train_three_steps(plan: Plan, tmp_path: Path) -> list[dict[str, Any]]:
    """Each rank's record of 3 training steps of the plan saved in ``tmp_path`` (tests/models/mlp.py, lr 0.1)."""
    from rank_workers import spawn_and_wait  # type: ignore[import-not-found]  # tests/models, on sys.path
    from runtime_workers import train_worker  # type: ignore[import-not-found]

    from runtime.verify import free_port

    out = tmp_path / "out"
    out.mkdir()
    codes = spawn_and_wait(train_worker, plan.gpus, (plan.gpus, free_port(), str(tmp_path), _MLP, str(out),
                                                     {"steps": 3, "lr": 0.1}), limit_s=120)
    assert codes == [0] * plan.gpus
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(plan.gpus)]


def _largest_difference(ranks: list[dict[str, Any]], want: dict[str, Any]) -> float:
    """The largest difference of the ranks' losses and final state from a reference run's."""
    losses = max(abs(a - b) for r in ranks if r["losses"][0] is not None
                 for a, b in zip(r["losses"], want["losses"], strict=True))
    state = max(float((r["state"][k].float() - want["state"][k]).abs().max()) for r in ranks for k in r["state"])
    return max(losses, state)


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize("reshard", [False, True], ids=["full", "zero3"])
def test_fp8_fully_sharded_training_equals_the_whole_graph_in_fp8(tmp_path: Path, reshard: bool) -> None:
    """FSDP2 gathers the weights in bfloat16 (its mixed-precision policy); under autocast every FP8 weight cast
    reads the weight's bfloat16 value (runtime/state/fp8.py), so the sharded ranks train exactly as the whole
    graph in one process with float32 weights.  The MLP's other ops are the FP8 matmuls' bias adds and the
    head, an autocast matmul: both read bfloat16 weights either way."""
    from runtime_workers import reference_run  # type: ignore[import-not-found]
    from shard_workers import plan_sharded  # type: ignore[import-not-found]

    plan = plan_sharded(_MLP, tmp_path, schedule="1f1b", shard="full", reshard_after_forward=reshard,
                        precision="fp8")
    ranks = _train_three_steps(plan, tmp_path)
    assert all(r["parameter_dtypes"] == ["torch.float32"] for r in ranks)
    assert all(any(m.startswith("FSDP") for m in r["runtime_modules"]) for r in ranks), ranks[0]["runtime_modules"]
    want = reference_run(_MLP, dp=2, microbatches=2, steps=3, lr=0.1, precision="fp8")
    assert _largest_difference(ranks, want) <= 1e-6


def test_fully_sharded_fp8_weights_are_gathered_at_one_byte_per_element() -> None:
    """A tensorwise fp8 plan's fully sharded stages gather the FP8 linears' weights as their FP8 casts
    (runtime/parallel/fp8_gather.py): the ZeRO-3 and kept-gathered all-gathers priced at 1 byte per element."""
    from partitioner.cost.comm import link
    from partitioner.solve.formulate import GraphCosts, formulate, zero3_costs

    graph = GraphCosts(blocks=(("a",), ("b",)), node_time_s={"a": 3e-4, "b": 3e-4},
                       node_forward_s={"a": 1e-4, "b": 1e-4}, node_saved_bytes={"a": 0, "b": 0},
                       node_output_bytes={"a": 0, "b": 0},
                       parameter_bytes={"layers.0.w": 4 * 10**8, "layers.1.w": 4 * 10**8},
                       parameter_elements={"layers.0.w": 10**8, "layers.1.w": 10**8},
                       block_parameters=(("layers.0.w",), ("layers.1.w",)), edges=((0, 1),), block_sends=(0, 0))
    fp8 = dataclasses.replace(graph, fp8_gathered=frozenset({"layers.0.w"}))
    spec = DEVICES["h100"]
    on = link(spec)
    z = {name: zero3_costs(g, dp=2, spec=spec, precision="fp8", gpus_per_node=8)
         for name, g in (("bf16", graph), ("fp8", fp8))}
    assert z["bf16"].first_gather_s == pytest.approx(on.shard_seconds(2e8, 2))
    assert z["fp8"].first_gather_s == pytest.approx(on.shard_seconds(1e8, 2))
    assert z["fp8"].forward_s[0] <= z["bf16"].forward_s[0] and z["fp8"].forward_s[1] == z["bf16"].forward_s[1]
    # Not under bf16-mixed (no FP8 casts to gather).
    assert zero3_costs(fp8, dp=2, spec=spec, precision="bf16-mixed", gpus_per_node=8) == \
        zero3_costs(graph, dp=2, spec=spec, precision="bf16-mixed", gpus_per_node=8)
    # Kept gathered: each step's all-gather moves layers.0.w in 1 byte per element, the gradients' reduce-scatter
    # in float32 as before.
    kept = {name: formulate(g, dp=2, spec=spec, memory_limit=80e9, shard="full", precision="fp8")
            for name, g in (("bf16", graph), ("fp8", fp8))}
    assert kept["bf16"].allreduce_s[0] == pytest.approx(on.shard_seconds(4e8, 2, messages=0)
                                                        + on.shard_seconds(2e8, 2, messages=0))
    assert kept["fp8"].allreduce_s[0] == pytest.approx(on.shard_seconds(4e8, 2, messages=0)
                                                       + on.shard_seconds(1e8, 2, messages=0))
    assert kept["fp8"].allreduce_s[1] == kept["bf16"].allreduce_s[1]


def test_fully_sharded_fp8_weights_are_held_gathered_at_one_byte_per_element() -> None:
    """A fully sharded stage holds its gathered FP8 weights as their 1-byte casts: kept gathered, in its static
    bytes; ZeRO-3, in its largest unit's transient (its weights and the next unit's)."""
    from partitioner.solve.formulate import GraphCosts, formulate, zero3_costs

    graph = GraphCosts(blocks=(("a",), ("b",)), node_time_s={"a": 3e-4, "b": 3e-4},
                       node_forward_s={"a": 1e-4, "b": 1e-4}, node_saved_bytes={"a": 0, "b": 0},
                       node_output_bytes={"a": 0, "b": 0},
                       parameter_bytes={"layers.0.w": 4 * 10**8, "layers.1.w": 2 * 10**8},
                       parameter_elements={"layers.0.w": 10**8, "layers.1.w": 5 * 10**7},
                       block_parameters=(("layers.0.w",), ("layers.1.w",)), edges=((0, 1),), block_sends=(0, 0))
    fp8 = dataclasses.replace(graph, fp8_gathered=frozenset({"layers.0.w"}))
    spec = DEVICES["h100"]
    kept = {name: formulate(g, dp=2, spec=spec, memory_limit=80e9, shard="full", precision="fp8")
            for name, g in (("bf16", graph), ("fp8", fp8))}
    assert kept["bf16"].static_bytes[0] - kept["fp8"].static_bytes[0] == pytest.approx(1e8)  # 1 byte less each
    assert kept["fp8"].static_bytes[1] == kept["bf16"].static_bytes[1]
    z = {name: zero3_costs(g, dp=2, spec=spec, precision="fp8", gpus_per_node=8)
         for name, g in (("bf16", graph), ("fp8", fp8))}
    assert z["bf16"].transient_bytes - z["fp8"].transient_bytes == pytest.approx(2e8)  # two units' weights
    for shard in ("full", "zero3"):  # bf16-mixed gathers no FP8 casts
        assert formulate(fp8, dp=2, spec=spec, memory_limit=80e9, shard=shard, precision="bf16-mixed") == \
            formulate(graph, dp=2, spec=spec, memory_limit=80e9, shard=shard, precision="bf16-mixed")


@pytest.mark.parametrize("shard", ["full", "zero3"])
def test_fully_sharded_fp8_plans_predict_their_fp8_gathers_memory(shard: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensorwise fp8 plan with fully sharded stages predicts less peak memory than the same plan gathering
    every weight in bf16 (no fp8_only_weights), and the simulator agrees; rowwise and tp 2 plans gather bf16."""
    import partitioner.graph.fp8 as graph_fp8
    from partitioner.schedule.simulate import simulate

    def peaks(recipe: str, tp: int, *, bf16_gathers: bool) -> tuple[float, ...]:
        with monkeypatch.context() as m:
            if bf16_gathers:
                m.setattr(graph_fp8, "fp8_only_weights", lambda gm, matmuls=None: frozenset())
            plan = compile(gpt.build_model(), gpt.example_inputs(8), gpus=2 * tp, device="h100", precision="fp8",
                           fp8_recipe=recipe, microbatches=2, pp=1, dp=2, tp=tp, shard=shard)
        assert all(s.shard == "full" and s.reshard_after_forward == (shard == "zero3") for s in plan.stages)
        assert simulate(plan).peak_memory_bytes == pytest.approx(plan.predicted.peak_memory_bytes)
        return plan.predicted.peak_memory_bytes

    fp8, bf16 = peaks("tensorwise", 1, bf16_gathers=False), peaks("tensorwise", 1, bf16_gathers=True)
    assert all(a < b for a, b in zip(fp8, bf16, strict=True)), (fp8, bf16)
    for recipe, tp in (("rowwise", 1), ("tensorwise", 2)):
        assert peaks(recipe, tp, bf16_gathers=False) == peaks(recipe, tp, bf16_gathers=True)


@pytest.mark.parametrize("shard", ["full", "zero3"])
def test_the_link_bound_counts_fp8_gathers_at_one_byte(shard: str) -> None:
    """The bound a plan is checked against moves the FP8-gathered weights at 1 byte per element, as the plan's
    own gathers are priced: with them at bf16's 2 the bound is higher, and a link-bound plan could beat it."""
    from partitioner.schedule.bounds import step_bounds

    plan = compile(gpt.build_model(), gpt.example_inputs(8), gpus=2, device="h100", precision="fp8",
                   microbatches=2, pp=1, dp=2, shard=shard)
    assert all(s.predicted.fp8_gathered_elements > 0 for s in plan.stages)
    bf16 = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, predicted=dataclasses.replace(s.predicted, fp8_gathered_elements=0.0))
        for s in plan.stages))
    ours, theirs = step_bounds(plan), step_bounds(bf16)
    assert sum(ours.links_s.values()) < sum(theirs.links_s.values())
    assert plan.predicted.step_s >= max(ours.compute_s, *ours.links_s.values())


class _ReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(32, 16))
        self.b = nn.Parameter(torch.randn(32, 32))
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x, self.a)
        h = nn.functional.linear(h, self.b) + self.b.sum()  # b is read by more than its FP8 matmul
        return self.head(h)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_the_planner_finds_the_weights_gathered_as_fp8(method: str) -> None:
    from partitioner.graph.fp8 import fp8_only_weights

    gm = capture(gpt.build_model(), gpt.example_inputs(2), method=method).graph_module  # type: ignore[arg-type]
    found = fp8_only_weights(gm)
    assert found == {m.weight for m in fp8_matmuls(gm).values()} and len(found) == 16
    gm = capture(_ReadTwice(), (torch.randn(8, 16),), method=method).graph_module  # type: ignore[arg-type]
    assert sorted(m.weight for m in fp8_matmuls(gm).values()) == ["a", "b"]
    assert sorted(fp8_only_weights(gm)) == ["a"]  # b: gathered in bf16


def test_the_report_says_fp8_weights_are_gathered_in_fp8() -> None:
    from partitioner.report.table import shard_summary

    plan = compile(gpt.build_model(), gpt.example_inputs(8), gpus=2, device="h100", precision="fp8", microbatches=2,
                   pp=1, dp=2)
    full = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard="full") for s in plan.stages))
    assert "all-gathered as their FP8 casts (1 byte per element" in shard_summary(full)
    assert "8 gathered during the step" in shard_summary(full) and "7 gathered for them" in shard_summary(full)
    assert "FP8 casts" not in shard_summary(dataclasses.replace(full, fp8_recipe="rowwise"))
    assert "FP8 casts" not in shard_summary(plan)  # not sharded


class _Reused(nn.Module):
    """One linear layer applied twice (a layer reused across depth) and one applied once."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(32, 32)
        self.once = nn.Linear(32, 32)
        self.last = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.once(torch.relu(self.shared(torch.relu(self.shared(x)))))
        return self.head(torch.relu(self.last(torch.relu(h))))


def test_a_weight_read_by_two_fp8_matmuls_is_gathered_in_bf16() -> None:
    """Planner and runtime agree: only a weight one FP8 matmul reads is gathered as its FP8 cast."""
    from partitioner.graph.fp8 import fp8_only_weights
    from runtime.parallel.fp8_gather import fp8_gathered_weights
    from runtime.state.fp8 import convert_graph

    gm = capture(_Reused(), (torch.randn(4, 32),)).graph_module
    assert fp8_only_weights(gm) == {"once.weight"}
    convert_graph(gm, fp8_matmuls(gm))
    assert fp8_gathered_weights([gm]) == {(id(gm.get_submodule("once")), "weight")}


@pytest.mark.slow  # spawns ranks
def test_verify_fp8_fully_sharded_with_a_layer_reused_across_depth(tmp_path: Path) -> None:
    """ALBERT's one layer applied at every depth, pp 2 x dp 2 kept gathered: trains as the whole graph."""
    from partitioner.modelfile import load_model_file
    from runtime.verify import verify

    spec = str(ROOT / "tests" / "models" / "albert_shared.py")
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    plan = compile(model_file.build(), model_file.example_inputs(8), gpus=4, device="h100", precision="fp8",
                   loss_fn=model_file.loss_fn, target=model_file.example_target(8) if model_file.example_target
                   else None, pp=2, dp=2, microbatches=2, schedule="1f1b", shard="full")
    plan.save(tmp_path)
    result = verify(tmp_path, spec, steps=2)
    assert result.ok, result.report()
