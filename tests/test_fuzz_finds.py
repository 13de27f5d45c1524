"""What the model fuzzer found (issue 29), each fix proved in one process, without ranks.

The reproducers themselves (``tests/models/fuzz_*.py``) verify on CPU ranks in
``tests/test_fuzz.py``; these tests pin each fix where it lives:

* capture: a buffer written by an op reading it alone (``self.calls.add_(1)``) makes
  symbolic tracing step aside for ``torch.export`` (the model left as it was), and that
  write is a compute node; a model input written in place is read, after the write,
  through the op that wrote it;
* coarsen: a write with no reader stays with the value it writes, a buffer's writes and
  reads stay in one block, so a buffer updated and read side by side no longer refuses
  ``--pp 2``;
* meetings: a linear whose output is written in place right away gets its weight
  gradients under a split backward (and a graph that reads the value before writing it
  runs its backward whole);
* recompute: a recomputed layer with dropout runs under verify's p=0 mode too;
* tensor parallelism: writes through views and into buffers are rewritten before the
  graph runs on DTensors, and only LM-head outputs leave as vocabulary-parallel logits;
* planner: ``--tp 2 --shard optimizer`` with replicas is refused before solving.
"""

from __future__ import annotations

import copy
import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from partitioner.errors import AutopartitionError, CaptureError
from partitioner.graph.capture import capture, written_state_nodes
from partitioner.graph.ir import KIND_KEY
from partitioner.graph.meetings import mark_meetings
from partitioner.graph.splitbackward import SplitBackward
from partitioner.graph.tensorparallel import TP_KEY, TPRole
from partitioner.modelfile import ModelFile, load_model_file
from partitioner.solve.coarsen import coarsen
from runtime.execute.recompute import RunKind, run_block
from runtime.parallel.tensorparallel import (
    VOCABULARY_OUTPUTS,
    _rewrite,
    plain_write,
    replicated,
    replicated_gradients,
)
from runtime.verify import Derandomised

MODELS = Path(__file__).parent / "models"


def _model_file(name: str) -> ModelFile:
    return load_model_file(str(MODELS / f"{name}.py"))


# ------------------------------------------------------------------ capture


def test_a_buffer_written_alone_is_captured_by_export_and_tracing_leaves_the_model_as_it_was() -> None:
    model_file = _model_file("fuzz_buffer_update")
    model = model_file.build()
    before = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(CaptureError, match=r"buffers? .*calls.*symbolic tracing runs once"):
        capture(model, model_file.example_inputs(4), method="symbolic_trace")
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers()), "tracing trained the model"
    captured = capture(model, model_file.example_inputs(4))
    assert captured.method == "export"
    written = captured.written_buffers()
    assert set(written) == {"ema", "calls"} and len(written["ema"]) == 2  # mul_ then add_ on what mul_ returned
    nodes = captured.nodes()
    assert all(nodes[n].meta[KIND_KEY] == "compute" for names in written.values() for n in names)
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())


def test_an_input_written_in_place_is_read_through_the_op_that_wrote_it() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
            early = aux * 2  # before the write: the input as given
            aux.mul_(0.5)
            return self.fc(x) + aux + early

    captured = capture(Net(), (torch.randn(2, 3), torch.randn(2, 3)), method="symbolic_trace")
    nodes = captured.nodes()
    write = next(n for n in nodes.values() if n.target == "mul_")
    assert {u.name for u in nodes["aux"].users} == {"mul", "mul_"}  # the reader before the write keeps the input
    assert any(write in u.all_input_nodes for u in write.users)  # the one after reads the write
    x, aux = torch.randn(2, 3), torch.randn(2, 3)
    model = Net()
    want = model(x, aux.clone())
    assert torch.equal(capture(model, (x, aux.clone())).graph_module(x, aux.clone())[0], want)


# ------------------------------------------------------------------ coarsen


def _block_of(blocks: list[tuple[str, ...]]) -> dict[str, int]:
    return {name: i for i, block in enumerate(blocks) for name in block}


def test_a_write_nobody_reads_stays_in_the_block_of_what_it_writes() -> None:
    model_file = _model_file("fuzz_inplace_no_users")
    gm = capture(model_file.build(), model_file.example_inputs(4)).graph_module
    blocks = _block_of(coarsen(gm, max_blocks=64))  # every node its own block, but for what is pinned
    assert blocks["mul_"] == blocks["fc"], "y.mul_(0.5) could be cut from fc, whose output it writes"
    assert blocks["proj"] != blocks["fc"] != blocks["head"]


def test_a_buffer_written_and_read_side_by_side_stays_in_one_block() -> None:
    model_file = _model_file("fuzz_buffer_update")
    gm = capture(model_file.build(), model_file.example_inputs(4)).graph_module
    spans = written_state_nodes(gm)
    assert set(spans) == {"ema", "calls"} and len(spans["ema"]) >= 3  # decay, add, read
    blocks = _block_of(coarsen(gm, max_blocks=64))
    assert len({blocks[n] for n in spans["ema"]}) == 1
    assert len(set(blocks.values())) > 3, "only the buffer's nodes are pinned together"


# ------------------------------------------------------------------ split backward


class _WrittenOutput(nn.Module):
    def __init__(self, early_read: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.early_read = early_read

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.fc(h)
        early = y * 3 if self.early_read else 0
        y[:, 0].mul_(2.0)  # through a view: the output's history is rebased
        return self.head(torch.relu_(y) + early)


@pytest.mark.parametrize("early_read", [False, True])
def test_a_linear_whose_output_is_written_in_place_gets_its_weight_gradients_under_a_split_backward(
    early_read: bool,
) -> None:
    torch.manual_seed(0)
    model, x = _WrittenOutput(early_read), torch.randn(3, 5, 4)
    model(x.requires_grad_()).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gm = fx.symbolic_trace(model)
    marked = mark_meetings(gm, active=["h"])
    assert (marked.unsplit is not None) == early_read  # read before the write: no single edge, whole backward
    for p in gm.parameters():
        p.grad = None
    received = x.detach().requires_grad_()
    split = SplitBackward(unsplit=marked.unsplit)
    with split.recording(marked.log):
        (out,) = (gm(received),)
    split.backward_inputs([out], [torch.ones_like(out)], [received])
    split.backward_weights()
    got = {n: p.grad for n, p in gm.named_parameters() if p.grad is not None}
    assert set(got) == set(want) == {"fc.weight", "fc.bias", "head.weight", "head.bias"}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value)


# ------------------------------------------------------------------ recompute


@pytest.mark.parametrize("kind", ["whole", "ops"])
def test_a_recomputed_layer_with_dropout_runs_under_verifys_modes_too(kind: RunKind) -> None:
    conv = nn.Conv2d(4, 4, 3, padding=1)

    def layer(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(conv(F.dropout(h, p=0.2, training=True)))

    h = torch.randn(2, 4, 6, 6, requires_grad=True)
    with Derandomised():
        layer(h).sum().backward()
        want, h.grad = h.grad, None
        run_block(layer, [h], kind).sum().backward()  # was: CheckpointError, the recomputation drew a mask
    assert h.grad is not None and want is not None and torch.equal(h.grad, want)


# ------------------------------------------------------------------ tensor parallelism (the graph rewrite)


def test_tensor_parallel_rewrites_writes_into_views_and_buffers_and_marks_only_head_logits() -> None:
    class Net(nn.Module):
        ema: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.head = nn.Linear(4, 8)
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.fc(h)
            y[:, 0].mul_(2.0)
            self.ema.add_(y.detach().mean((0, 1)))
            z = torch.tanh(y) - self.ema
            return self.head(z), z.mean(-1)

    model = Net()
    twin = copy.deepcopy(model)
    gm = capture(model, (torch.randn(2, 3, 4),)).graph_module
    next(n for n in gm.graph.nodes if n.target == "head").meta[TP_KEY] = TPRole(0, "head", 8)
    _rewrite(gm)
    view = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert view.args[0].target is replicated, "the view written into is a view of the whole value"
    assert [n.target for n in gm.graph.nodes].count(replicated_gradients) == 1
    write = next(n for n in gm.graph.nodes if n.target == plain_write)
    assert write.args[0] == "add_" and str(write.args[1]) == "ema"
    tanh = next(n for n in gm.graph.nodes if n.target is torch.tanh)
    assert tanh.args[0].target == replicated_gradients  # read after the write, its gradient made whole
    assert gm.meta[VOCABULARY_OUTPUTS] == frozenset({0})  # the mean over the hidden dimension leaves whole
    x = torch.randn(2, 3, 4)
    for got, want in zip(gm(x), twin(x), strict=True):  # on plain tensors the rewrite computes as before
        torch.testing.assert_close(got, want)


def test_plain_write_writes_a_buffer_from_whole_values() -> None:
    buffer = torch.zeros(3)
    assert plain_write("add_", buffer, torch.ones(3)) is buffer
    assert plain_write("aten::mul_.Tensor", buffer, 2.0) is buffer and torch.equal(buffer, torch.full((3,), 2.0))


# ------------------------------------------------------------------ planner


def test_tensor_parallel_with_optimizer_sharded_replicas_is_refused_before_solving() -> None:
    from partitioner.search.planner import compile

    model_file = _model_file("fuzz_tp_optimizer_shard")
    with pytest.raises(AutopartitionError, match=r"--tp 2 with --shard optimizer.*--shard none, full or auto"):
        compile(model_file.build(), model_file.example_inputs(8), gpus=4, pp=1, dp=2, tp=2, shard="optimizer",
                microbatches=2, device="h100")


# ------------------------------------------------------------------ parameter hooks


def test_a_fully_sharded_stage_refuses_parameter_hooks_it_would_drop() -> None:
    from runtime.parallel.shard import shard_modules

    layer = nn.Linear(2, 2)
    layer.weight.register_hook(lambda g: g * 2)
    with pytest.raises(AutopartitionError, match=r"gradient hooks on weight.*--shard none or optimizer"):
        shard_modules([layer], [False], mesh=None)  # refused before FSDP2 touches it
