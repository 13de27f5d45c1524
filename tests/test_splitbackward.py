"""The split backward (B now, W later) on marked stage graphs equals a plain backward.

* :func:`partitioner.graph.meetings.mark_meetings` finds the ops where weights meet
  activations in symbolic-traced and exported graphs, rewrites leaf modules to
  their functional forms, and leaves what the module computes unchanged;
* :class:`partitioner.graph.splitbackward.SplitBackward`: B then W gives a plain
  backward's gradients, B runs no weight-gradient matrix product and W no
  input-gradient one, and a weight it cannot see falls back to a whole backward
  in B (exact, with the reason).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner.graph.meetings import mark_meetings
from partitioner.graph.splitbackward import SplitBackward

TOLERANCE = 1e-5


class _Counting(TorchDispatchMode):
    """Counts aten ops by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Double(torch.autograd.Function):
    """An op the marking cannot see into; on an activation alone it is harmless."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class _Scale(torch.autograd.Function):
    """Mixes an activation and a weight inside one autograd node."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


_HIDDEN = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(1)))


@fx.wrap
def _double(x: torch.Tensor) -> torch.Tensor:
    return _Double.apply(x)


@fx.wrap
def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _Scale.apply(x, w)


@fx.wrap
def _scale_hidden(x: torch.Tensor) -> torch.Tensor:
    return _Scale.apply(x, _HIDDEN)  # reads a weight the graph does not pass it


class _Block(torch.nn.Module):
    """Linears (one used twice), a norm, a parameter-only branch, and an output of parameters alone."""

    def __init__(self, hidden: str = "none") -> None:
        super().__init__()
        self.hidden = hidden
        self.scale = torch.nn.Parameter(torch.randn(4))
        self.inp = torch.nn.Linear(4, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.gain = torch.nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hidden == "activation only":
            x = _double(x)
        elif self.hidden == "weight passed":
            x = _scale(x, self.scale)
        elif self.hidden == "weight hidden":
            x = _scale_hidden(x)
        h = torch.tanh(self.inp(x))
        h = self.mid(h) + self.mid(h * 2)  # one weight at two ops
        h = self.norm(h) * (self.gain * 2) + self.inp.weight.sum()
        h += self.mid.bias  # activation and weight meet
        return h, self.inp(z)  # the second depends on parameters alone (z needs no gradient)


def _plain(block: torch.nn.Module, x: torch.Tensor, z: torch.Tensor,
           grads: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    leaf = x.clone().requires_grad_()
    torch.autograd.backward(list(block(leaf, z)), grads)
    assert leaf.grad is not None
    named = [*block.named_parameters(), ("_HIDDEN", _HIDDEN)]
    got = {n: p.grad.clone() for n, p in named if p.grad is not None}
    block.zero_grad(set_to_none=True)
    _HIDDEN.grad = None
    return leaf.grad, got


def _split(gm: fx.GraphModule, x: torch.Tensor, z: torch.Tensor, grads: list[torch.Tensor]) -> tuple[
        torch.Tensor, SplitBackward, collections.Counter[str], collections.Counter[str], dict[str, torch.Tensor]]:
    marked = mark_meetings(gm, active=[next(iter(gm.graph.nodes)).name])
    leaf = x.clone().requires_grad_()
    split = SplitBackward(unsplit=marked.unsplit)
    with split.recording(marked.log):
        outputs = gm(leaf, z)
    with _Counting() as b:
        (gx,) = split.backward_inputs(list(outputs), grads, [leaf], weight_only=marked.weight_outputs)
    assert gx is not None
    with _Counting() as w:
        split.backward_weights()
    named = [*gm.named_parameters(), ("_HIDDEN", _HIDDEN)]
    got = {n: p.grad.clone() for n, p in named if p.grad is not None}
    _HIDDEN.grad = None
    return gx, split, b.ops, w.ops, got


def _inputs() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return torch.randn(3, 4), torch.randn(3, 4), [torch.randn(3, 6), torch.randn(3, 6)]


def test_marking_finds_the_meetings_and_keeps_the_function() -> None:
    torch.manual_seed(0)
    block = _Block()
    gm = fx.symbolic_trace(block)
    x, z, _ = _inputs()
    want = gm(x, z)
    marked = mark_meetings(gm, active=["x"])
    # inp(x), mid(h), mid(h * 2), norm(h), `* gain`, `+ weight.sum()`, `+= bias`; inp(z) reads no activation.
    assert marked.meetings == 7
    assert marked.weight_outputs == {1}
    assert marked.unsplit is None
    # Leaf modules at meetings became functional calls; inp(z), weights alone, stays a module call.
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target != "_autopartition_meetings"] \
        == ["inp"]
    for got, expected in zip(gm(x, z), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="marked already"):
        mark_meetings(gm, active=["x"])


def test_b_then_w_equals_a_plain_backward_and_b_skips_weight_products() -> None:
    torch.manual_seed(0)
    block = _Block()
    x, z, grads = _inputs()
    want_x, want = _plain(block, x, z, grads)

    gx, split, b_ops, w_ops, got = _split(fx.symbolic_trace(block), x, z, grads)

    assert split.unsplit is None
    torch.testing.assert_close(gx, want_x, rtol=0, atol=TOLERANCE)
    assert set(got) == set(want)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=TOLERANCE, msg=name)
    # B: the input gradients of the three linears on the activation path (mid twice, inp once);
    # W: their three weight gradients and the one of inp(z).  No product runs twice.
    assert b_ops["mm"] == 3, b_ops
    assert w_ops["mm"] == 4, w_ops


def test_w_takes_linear_and_norm_gradients_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """W calls autograd once per other meeting op (`* gain`, `+ weight.sum()`, `+= bias`), never for the
    three linears and the norm, whose weight gradients it computes from their input and output gradient."""
    torch.manual_seed(0)
    block = _Block()
    x, z, grads = _inputs()
    calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    gm = fx.symbolic_trace(block)
    marked = mark_meetings(gm, active=["x"])
    split = SplitBackward(unsplit=marked.unsplit)
    leaf = x.clone().requires_grad_()
    with split.recording(marked.log):
        outputs = gm(leaf, z)
    split.backward_inputs(list(outputs), grads, [leaf], weight_only=marked.weight_outputs)
    calls.clear()
    split.backward_weights()
    assert len(calls) == 3


def test_an_exported_graph_splits_the_same() -> None:
    """Exported graphs hold aten ops on parameters read by get_attr: the same meetings, the same gradients."""
    from partitioner.graph.capture import capture

    torch.manual_seed(0)
    block = _Block()
    x, z, grads = _inputs()
    want_x, want = _plain(block, x, z, grads)
    gm = capture(block, (x, z), method="export").graph_module

    gx, split, b_ops, w_ops, got = _split(gm, x, z, grads)

    assert split.unsplit is None
    torch.testing.assert_close(gx, want_x, rtol=0, atol=TOLERANCE)
    assert len(got) == len(want)
    for g, name in zip(sorted(got.values(), key=lambda t: t.sum().item()),
                       sorted(want, key=lambda n: want[n].sum().item())):
        torch.testing.assert_close(g, want[name], rtol=0, atol=TOLERANCE, msg=name)
    assert w_ops["mm"] + w_ops["addmm"] >= 4 and b_ops["mm"] + b_ops["addmm"] <= 3, (b_ops, w_ops)


@pytest.mark.parametrize("hidden", ["activation only", "weight passed", "weight hidden"])
def test_custom_autograd_functions(hidden: str) -> None:
    """A Function on an activation alone, or passed its weight, splits; one reading a weight it is not passed runs whole in B."""
    torch.manual_seed(0)
    block = _Block(hidden)
    x, z, grads = _inputs()
    want_x, want = _plain(block, x, z, grads)

    gx, split, _, w_ops, got = _split(fx.symbolic_trace(block), x, z, grads)

    if hidden == "weight hidden":
        assert split.unsplit is not None and "a parameter of shape (4,)" in split.unsplit, split.unsplit
        assert w_ops["mm"] == 0, w_ops
    else:
        assert split.unsplit is None and w_ops["mm"] == 4, w_ops
    torch.testing.assert_close(gx, want_x, rtol=0, atol=TOLERANCE)
    assert set(got) == set(want)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=TOLERANCE, msg=name)


def test_a_weight_written_in_place_by_an_activation_runs_whole() -> None:
    class _Writes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            v = self.w * 1.0
            v.add_(x.sum(0))  # an activation written into a weight-side tensor
            return x * v

    gm = fx.symbolic_trace(_Writes())
    marked = mark_meetings(gm, active=["x"])
    assert marked.unsplit is not None and "writes an activation into a weight-side tensor" in marked.unsplit


class _ConvNorm(torch.nn.Module):
    """Convolution, GroupNorm, BatchNorm: modules the marking runs through ``functional_call``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(torch.relu(self.gn(self.conv(x))))


def test_convolutions_and_norms_split_exactly() -> None:
    torch.manual_seed(0)
    block = _ConvNorm()
    gm = fx.symbolic_trace(_ConvNorm())
    gm.load_state_dict(block.state_dict())
    x, grad = torch.randn(3, 2, 4, 4), torch.randn(3, 4, 4, 4)
    plain = x.clone().requires_grad_()
    block(plain).backward(grad)
    marked = mark_meetings(gm, active=["x"])
    assert (marked.meetings, marked.unsplit) == (3, None)
    leaf = x.clone().requires_grad_()
    split = SplitBackward(unsplit=marked.unsplit)
    with split.recording(marked.log):
        out = gm(leaf)
    (gx,) = split.backward_inputs([out], [grad], [leaf])
    assert gx is not None and all(p.grad is None for p in gm.parameters())  # B: no parameter gradient
    split.backward_weights()
    torch.testing.assert_close(gx, plain.grad, rtol=0, atol=TOLERANCE)
    for (name, p), q in zip(gm.named_parameters(), block.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOLERANCE, msg=name)


def test_without_inputs_needing_a_gradient_w_does_the_whole_backward() -> None:
    """An only stage (or a first one): B computes nothing, W every parameter gradient."""
    torch.manual_seed(0)
    gm = fx.symbolic_trace(_ConvNorm())
    marked = mark_meetings(gm, active=[])
    split = SplitBackward(unsplit=marked.unsplit)
    with split.recording(marked.log):
        loss = gm(torch.randn(3, 2, 4, 4)).square().mean()  # the loss, outside the graph
    assert split.backward_inputs([loss], [None], []) == []
    assert all(p.grad is None for p in gm.parameters()) and split.unsplit is None
    split.backward_weights()
    assert all(p.grad is not None for p in gm.parameters())
