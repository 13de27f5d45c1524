"""Models without real weights: counting on fake tensors, meta-built models, timing layer by layer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _examples import example
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import partitioner
from partitioner.cli import main
from partitioner.cost import nodes as cost
from partitioner.errors import AutopartitionError
from partitioner.graph.capture import CapturedModel, capture
from partitioner.graph.ir import layer_of
from partitioner.graph.meta import layers
from partitioner.graph.values import propagate_values

ROOT = Path(__file__).resolve().parent.parent
gpt = example("gpt")
CONFIG = gpt.GPTConfig(n_layer=3)


def _real() -> nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(CONFIG)


def _meta() -> nn.Module:
    with torch.device("meta"):
        return gpt.GPT(CONFIG)


def _captured(model: nn.Module, inputs: tuple[torch.Tensor, ...], method: str) -> CapturedModel:
    captured = capture(model, inputs, method=method)  # type: ignore[arg-type]
    propagate_values(captured.graph_module, inputs)
    return captured


def _meta_inputs(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(x, device="meta") for x in inputs)


# ----------------------------------------------------------------- counting (--device h100)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
@pytest.mark.parametrize("meta_inputs", [False, True])
def test_meta_and_real_models_count_the_same(method: str, meta_inputs: bool) -> None:
    inputs = gpt.example_inputs(4)
    real = cost.profile(_captured(_real(), inputs, method), inputs, measure=False)
    meta_in = _meta_inputs(inputs) if meta_inputs else inputs
    meta = cost.profile(_captured(_meta(), meta_in, method), meta_in, measure=False)
    assert meta == real
    assert sum(c.forward_flops for c in real.values()) > 0


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_counting_runs_no_real_op_on_the_weights(method: str) -> None:
    """Counting reads no weight: no aten op sees a real tensor the size of a weight (nothing is copied)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    inputs = (torch.randn(8, 64),)
    captured = _captured(model, inputs, method)
    with _RealOps(min_numel=64 * 64) as spy:
        costs = cost.profile(captured, inputs, measure=False)
    assert spy.ops == []
    assert costs[next(iter(costs))].forward_flops == 2 * 8 * 64 * 64


def test_counting_at_the_micro_batch_size_is_exact() -> None:
    """Counted at the real size, tensors that do not grow with the batch (positions, masks) are not scaled."""
    inputs = gpt.example_inputs(4)
    captured = _captured(_real(), inputs, "symbolic_trace")
    costs = cost.profile(captured, inputs, measure=False)
    seq, width = inputs[0].shape[1], CONFIG.n_embd
    assert costs["arange"].io_bytes == seq * 8  # (T,) int64, whatever the batch
    assert costs["wpe"].io_bytes == (seq * 8 + CONFIG.block_size * width * 4 + seq * width * 4)


def test_compile_plans_meta_and_real_models_alike() -> None:
    inputs = gpt.example_inputs(16)
    plans = [partitioner.compile(model, x, gpus=4, microbatches=4, device="h100")
             for model, x in ((_real(), inputs), (_meta(), inputs), (_meta(), _meta_inputs(inputs)))]
    real, *metas = plans
    for plan in metas:
        assert (plan.pp, plan.dp) == (real.pp, real.dp)
        assert [s.nodes for s in plan.stages] == [s.nodes for s in real.stages]
        assert plan.predicted.step_s == pytest.approx(real.predicted.step_s, rel=1e-12)
        assert plan.model.parameter_bytes == real.model.parameter_bytes


def test_counting_a_2gb_meta_model_allocates_nothing() -> None:
    """fp32 weights of 2.1 GB built on meta: capture, values and counting stay far below that."""
    script = textwrap.dedent("""
        import resource, time, torch
        from torch import nn
        from partitioner.graph.capture import capture
        from partitioner.cost.nodes import profile
        from partitioner.graph.values import propagate_values
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(8)])
        assert sum(p.nbytes for p in model.parameters()) > 2 * 1024**3
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        x = (torch.randn(4, 8192),)
        captured = capture(model, x)
        propagate_values(captured.graph_module, x)
        costs = profile(captured, x, measure=False)
        assert sum(c.forward_flops for c in costs.values()) == 8 * 2 * 4 * 8192 * 8192
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(f"{grown:.0f} {time.perf_counter() - start:.2f}")
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    grown_mib, seconds = (float(v) for v in done.stdout.split())
    assert grown_mib < 200, f"peak RSS grew {grown_mib:.0f} MiB while counting"
    assert seconds < 5


def test_capture_and_values_on_meta_parameters_and_inputs() -> None:
    inputs = _meta_inputs(gpt.example_inputs(4))
    for method in ("symbolic_trace", "export"):
        captured = _captured(_meta(), inputs, method)
        (out,) = captured.output_nodes
        assert captured.nodes()[out].meta["val"].shape == (4, gpt.SEQ_LEN, CONFIG.vocab_size)


# ----------------------------------------------------------------- layers


def test_layer_of_and_repeated_layer_signatures() -> None:
    assert layer_of("blocks.2.attn.c_attn") == "blocks.2"
    assert layer_of("model.layers.10.mlp") == "model.layers.10"
    assert layer_of("lm_head") == "lm_head"
    inputs = gpt.example_inputs(4)
    for method in ("symbolic_trace", "export"):
        found = {layer.path: layer for layer in layers(_captured(_meta(), inputs, method).graph_module)}
        assert {"blocks.0", "blocks.1", "blocks.2", "wte", "ln_f"} <= set(found)
        assert found["blocks.0"].signature == found["blocks.1"].signature == found["blocks.2"].signature
        assert len(found["blocks.0"].nodes) == len(found["blocks.2"].nodes)
        assert found["wte"].signature != found["ln_f"].signature


def test_a_different_layer_is_not_taken_for_a_repeat() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    found = layers(_captured(model, (torch.randn(2, 8),), "symbolic_trace").graph_module)
    assert [layer.path for layer in found] == ["0", "1", "2"]
    assert found[0].signature == found[1].signature != found[2].signature


# ----------------------------------------------------------------- timing a meta model (--device cpu)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_repeated_layer_is_timed_once(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    materialise = cost.materialise

    def spy(gm: Any, owner: str, device: torch.device) -> dict[str, torch.Tensor]:
        made.append(owner)
        return materialise(gm, owner, device)

    monkeypatch.setattr(cost, "materialise", spy)
    inputs = gpt.example_inputs(4)
    model = _meta()
    captured = _captured(model, inputs, method)
    costs = cost.profile(captured, inputs, measure=True, warmup=0, repeats=1)
    assert {layer_of(owner) for owner in made} >= {"blocks.0", "lm_head"}
    assert not any(layer_of(owner) in ("blocks.1", "blocks.2") for owner in made), made
    found = {layer.path: layer for layer in layers(captured.graph_module)}
    for first, later in zip(found["blocks.0"].nodes, found["blocks.2"].nodes):
        assert costs[later] == costs[first]
    assert all(c.forward_s > 0 for n, c in costs.items() if n in found["blocks.0"].nodes and c.forward_flops > 0)
    counted = cost.profile(captured, inputs, measure=False)
    assert {n: c.forward_flops for n, c in costs.items()} == {n: c.forward_flops for n, c in counted.items()}
    assert all(p.is_meta for p in model.parameters())  # the model is left on meta


def test_meta_model_plans_measured_on_cpu() -> None:
    inputs = gpt.example_inputs(16)
    target = gpt.example_target(16)
    plan = partitioner.compile(_meta(), inputs, gpus=2, microbatches=4, device="cpu", pp=2,
                               loss_fn=gpt.loss_fn, target=target)
    assert plan.pp == 2 and plan.device.endswith("(measured)")
    assert plan.predicted.step_s > 0


class _Buckets(nn.Module):
    """Divides token ids by an integer buffer: its zero placeholder makes the layer fail."""

    width: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 8)
        self.register_buffer("width", torch.tensor(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(torch.div(ids, self.width, rounding_mode="floor"))


_BUCKETS_FILE = """
import torch
from torch import nn

class Buckets(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 8)
        self.register_buffer("width", torch.tensor(4))

    def forward(self, ids):
        return self.emb(torch.div(ids, self.width, rounding_mode="floor"))

def build_model():
    with torch.device("meta"):
        return Buckets()

def example_inputs(batch_size=8):
    return (torch.randint(0, 16, (batch_size, 3)),)
"""


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_unmaterialisable_meta_model_says_why_and_what_to_do(method: str) -> None:
    with torch.device("meta"):
        model = _Buckets()
    inputs = (torch.randint(0, 16, (8, 3)),)
    plan = partitioner.compile(model, inputs, gpus=1, microbatches=2, device="h100", capture_method=method)  # type: ignore[arg-type]
    assert plan.pp == 1  # counting needs no values
    with pytest.raises(AutopartitionError, match="failed on those values") as info:
        partitioner.compile(model, inputs, gpus=1, microbatches=2, device="cpu", capture_method=method)  # type: ignore[arg-type]
    message = str(info.value)
    assert "--device h100" in message and "meta" in message and "\n" not in message


def test_cli_exit_2_for_unmaterialisable_meta_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_file = tmp_path / "buckets.py"
    model_file.write_text(_BUCKETS_FILE)
    code = main([str(model_file), "--gpus", "1", "--batch-size", "4", "--microbatches", "2", "--device", "cpu",
                 "--out", str(tmp_path / "plan")])
    assert code == 2
    assert "--device h100" in capsys.readouterr().err


def test_time_loss_on_meta_model_uses_placeholder_outputs() -> None:
    inputs = gpt.example_inputs(4)
    captured = _captured(_meta(), inputs, "symbolic_trace")
    forward_s, backward_s = cost.time_loss(captured, inputs, gpt.loss_fn, gpt.example_target(4), repeats=1)
    assert forward_s > 0 and backward_s > 0


# ----------------------------------------------------------------- ops without a fake kernel torch has


class _CountsPerExpert(nn.Module):
    """Counts tokens per expert with ``histc`` on integer ids, as Hugging Face MoE layers do off the CPU."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(8, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).topk(2, dim=-1).indices.reshape(-1)
        counts = torch.histc(chosen.int(), bins=self.experts, min=0, max=self.experts - 1)
        return x * torch.cumsum(counts, dim=0, dtype=torch.int32)[-1]


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_histc_on_integer_ids_captures_and_counts_on_meta(method: str) -> None:
    """Issue 32: torch's meta kernel refuses integer histc on a fake CPU tensor (DeepSeek-V3 on meta failed)."""
    from torch._subclasses import fake_impls

    with torch.device("meta"):
        model = _CountsPerExpert()
    inputs = (torch.randn(6, 8),)  # CPU inputs: the fakes claim the CPU
    captured = _captured(model, inputs, method)
    (histc,) = [n for n in captured.graph_module.graph.nodes if "histc" in str(n.target)]
    assert histc.meta["autopartition_value"].shape == (4,) and histc.meta["autopartition_value"].dtype == "int32"
    assert set(cost.profile(captured, inputs, measure=False)) >= {histc.name}
    assert torch.ops.aten.histc.default not in fake_impls.op_implementations_dict  # in force for the run only
    plan = partitioner.compile(model, inputs, gpus=1, microbatches=1, device="h100", capture_method=method)  # type: ignore[arg-type]
    assert plan.pp == 1 and all(p.is_meta for p in model.parameters())


# ----------------------------------------------------------------- helpers


class _RealOps(TorchDispatchMode):
    """Records aten ops that read a real (neither fake nor meta) tensor of at least ``min_numel`` elements."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and not t.is_meta
                    and t.numel() >= self.min_numel):
                self.ops.append(str(func))
                break
        return func(*args, **kwargs)


def test_node_costs_are_plain_values() -> None:
    """Costs hold numbers only (no tensors), so a fake-counted cost outlives its fake tensors."""
    inputs = gpt.example_inputs(2)
    costs = cost.profile(_captured(_meta(), inputs, "export"), inputs, measure=False)
    for value in costs.values():
        assert all(not isinstance(v, torch.Tensor) for v in dataclasses.astuple(value))
