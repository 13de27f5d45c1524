"""Marking stage graphs for a split backward (:mod:`partitioner.graph.meetings`) on real models' stages (issue 18).

* Every stage of a CNN, two U-Nets, a ResNet, a ViT built on ``nn.MultiheadAttention``,
  a tied LM and MLPs is marked: the rewritten graph lints (each node after its
  arguments), computes what it did, reports every meeting op, and B then W gives
  a plain backward's gradients.  Parameter-holding modules other than Linear,
  LayerNorm and Embedding (Conv2d, GroupNorm, BatchNorm, MultiheadAttention) run
  through ``functional_call``, whose rewrite emitted the log's call before the
  aliases it reads.
* A graph the rewrite cannot handle keeps its captured code, and its backward
  runs whole in B (exact), with the reason.
* :func:`partitioner.graph.meetings.inputs_written_in_place` finds the inputs a stage writes in place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chunked import plan_schedule
from torch import fx, nn

from partitioner.graph import meetings
from partitioner.graph.capture import capture
from partitioner.graph.ir import dtype_from_name
from partitioner.graph.meetings import inputs_written_in_place, mark_meetings
from partitioner.graph.splitbackward import SplitBackward
from partitioner.modelfile import load_model_file
from runtime.execute.stage import LocalStage, build_local_stages

_MODELS = Path(__file__).parent / "models"
_EXAMPLES = Path(__file__).parent.parent / "examples"
_TOLERANCE = 1e-5

_SPECS = {
    "cnn": _EXAMPLES / "cnn.py",
    "unet_groupnorm": _MODELS / "unet_groupnorm.py",
    "bn_unet": _MODELS / "bn_unet.py",
    "resnet_inplace": _MODELS / "resnet_inplace.py",
    "small_vit": _MODELS / "small_vit.py",
    "tied_lm": _MODELS / "tied_lm.py",
    "mlp": _MODELS / "mlp.py",
    "skip_mlp": _MODELS / "skip_mlp.py",
}


def _stage_args(stage: LocalStage, micro: tuple[torch.Tensor, ...], names: list[str]) -> list[torch.Tensor]:
    """The stage's forward arguments: its model inputs, then random received boundaries (float ones need grad)."""
    g = torch.Generator().manual_seed(stage.plan.index)
    args = [micro[names.index(n)] for n in stage.signature.model_inputs]
    shapes = {b.producer: b for b in stage.plan.inputs}
    for name in stage.signature.received:
        b = shapes[name]
        dtype = dtype_from_name(b.dtype)
        if dtype.is_floating_point:
            args.append(torch.randn(b.shape, generator=g, dtype=dtype).requires_grad_())
        else:
            args.append(torch.zeros(b.shape, dtype=dtype))
    return args


def _backward(outputs: list[torch.Tensor], args: list[torch.Tensor], module: nn.Module, *,
              split: SplitBackward | None = None,
              weight_only: frozenset[int] = frozenset()) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """(gradient of each received argument, parameter gradients) for fixed random output gradients."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outputs]
    pairs = [(i, o, gr) for i, (o, gr) in enumerate(zip(outputs, grads)) if o.requires_grad]
    leaves = [a for a in args if a.requires_grad]
    if split is None:
        torch.autograd.backward([o for _, o, _ in pairs], [gr for _, _, gr in pairs])
        got: list[torch.Tensor | None] = [a.grad for a in leaves]
    else:
        kept = {i: k for k, (i, _, _) in enumerate(pairs)}
        got = split.backward_inputs([o for _, o, _ in pairs], [gr for _, _, gr in pairs], leaves,
                                    weight_only={kept[i] for i in weight_only if i in kept})
        split.backward_weights()
    return got, {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", list(_SPECS))
def test_every_stage_graph_marks_lints_and_splits_exactly(tmp_path: Path, model: str) -> None:
    spec = str(_SPECS[model])
    plan = plan_schedule(spec, tmp_path, ranks=3, microbatches=3, schedule="zb-h1", batch=6)
    mf = load_model_file(spec)
    every = range(len(plan.stages))
    plain_stages, marked_stages = build_local_stages(plan, mf.build(), every), build_local_stages(plan, mf.build(), every)
    inputs = mf.example_inputs(plan.microbatch_size)
    micro = tuple(inputs) if isinstance(inputs, tuple) else tuple(inputs.values())
    names = [t.name for t in plan.model.inputs]
    reported = 0
    for plain, stage in zip(plain_stages, marked_stages):
        gm = stage.module
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        args = _stage_args(stage, micro, names)
        active = [p for p, a in zip(placeholders, args) if a.requires_grad]

        marked = mark_meetings(gm, active=active)

        assert marked.unsplit is None, f"stage {stage.plan.index}: {marked.unsplit}"
        gm.graph.lint()
        reported += marked.meetings
        plain_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        want = list(plain.module(*plain_args))
        split = SplitBackward(unsplit=marked.unsplit)
        with split.recording(marked.log):
            got = list(gm(*args))
        for o, w in zip(got, want):
            torch.testing.assert_close(o, w, rtol=0, atol=0)
        assert len(split._meetings) == marked.meetings
        want_x, want_p = _backward(want, plain_args, plain.module)
        got_x, got_p = _backward(got, args, gm, split=split, weight_only=marked.weight_outputs)
        assert split.unsplit is None, split.unsplit
        for g, w in zip(got_x, want_x):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, rtol=0, atol=_TOLERANCE)
        assert got_p.keys() == want_p.keys(), f"stage {stage.plan.index}"
        for name, g in got_p.items():
            torch.testing.assert_close(g, want_p[name], rtol=0, atol=_TOLERANCE, msg=name)
    assert reported > 0, "no stage reads an activation with a weight: the test splits nothing"


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x)).flatten(2).transpose(1, 2)  # (B, HW, 4)
        return self.attn(h, h, h)[0]


def test_module_calls_become_aliased_calls_after_their_aliases() -> None:
    """A conv, a norm and an attention module: each call reports its output and its parameters' aliases."""
    torch.manual_seed(0)
    gm = fx.symbolic_trace(_Convs())
    x = torch.randn(2, 2, 3, 3, requires_grad=True)
    want = gm(x)
    marked = mark_meetings(gm, active=["x"])
    assert (marked.meetings, marked.unsplit) == (3, None)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    logs = [n for n in gm.graph.nodes if n.target == meetings.LOG_NAME]
    assert len(logs) == 3 and all(order[a] < order[log] for log in logs for a in log.all_input_nodes)
    sink: list[meetings.Meeting] = []
    with marked.log.listening(sink):
        torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
    assert [len(m.aliases) for m in sink] == [2, 2, 4]  # conv and norm: weight, bias; attention: 4 tensors


def test_a_graph_it_cannot_rewrite_keeps_its_code_and_runs_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
        raise NotImplementedError("no functional form")

    monkeypatch.setattr(meetings, "_functional", broken)
    torch.manual_seed(0)
    module = _Convs()
    gm = fx.symbolic_trace(module)
    code = gm.code
    marked = mark_meetings(gm, active=["x"])
    assert marked.unsplit is not None and "NotImplementedError: no functional form" in marked.unsplit
    assert marked.meetings == 0 and gm.code == code
    x = torch.randn(2, 2, 3, 3)
    leaf = x.clone().requires_grad_()
    split = SplitBackward(unsplit=marked.unsplit)
    with split.recording(marked.log):
        out = gm(leaf)
    (gx,) = split.backward_inputs([out], [torch.ones_like(out)], [leaf])
    got = {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}
    split.backward_weights()  # nothing left: B ran the whole backward
    reference = _Convs()
    reference.load_state_dict(module.state_dict())
    plain = x.clone().requires_grad_()
    reference(plain).sum().backward()
    assert gx is not None
    torch.testing.assert_close(gx, plain.grad, rtol=0, atol=_TOLERANCE)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=_TOLERANCE, msg=name)


# ------------------------------------------------------------------ inputs written in place


class _Writes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.soft = nn.ReLU()

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, e: torch.Tensor,
                f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        a = self.relu(a)  # an in-place module
        b.t().fill_(0.5)  # an in-place method on a view
        torch.relu_(c.view(-1)[:4])  # an in-place function on a view of a view
        torch.nn.functional.relu(d, True)  # inplace by position
        h = e * 2
        h.add_(1)  # writes a fresh tensor, not e
        h = self.soft(f) + g.contiguous()  # no write
        return a + b + c + d + h


def test_inputs_written_in_place() -> None:
    gm = fx.symbolic_trace(_Writes())
    assert inputs_written_in_place(gm) == {"a", "b", "c", "d"}
    xs = [torch.randn(3, 3) for _ in range(7)]
    exported = capture(_Writes(), tuple(xs), method="export").graph_module
    placeholders = [n.name for n in exported.graph.nodes if n.op == "placeholder"]
    assert inputs_written_in_place(exported) == set(placeholders[:4])
