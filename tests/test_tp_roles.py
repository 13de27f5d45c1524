"""Tensor-parallel roles are written only where the split holds (issue 29, ``partitioner/graph/tensorparallel.py``).

A column's output is split by output features; the split must reach the row whole
through every op between them.  On small graphs: an MLP, attention with q, k, v
apart, a fused projection viewed as ``(B, T, H, 3 x head_dim)`` keep their roles; a
fused ``(B, T, 3, heads, head_dim)`` view (the issue's crash: "Cannot unflatten
unevenly sharded tensor"), a fused output cut into q, k, v (GPT-2's ``c_attn``), a
softmax over the features and a view merging the split into the sequence lose
theirs, with the reason, are priced whole and get no placement; a parameter read in
two places that would place it two ways (an embedding read again by ``h @ emb.weight.T``,
a layer read once inside a pair and once outside) keeps one placement: whole.
Spawned (one start of two ranks): the fused-qkv model and the matmul-head LM at
``--tp 2`` train as the whole model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tied_workers import Job, compare, plan_case, train_jobs
from torch import Tensor, nn

from partitioner.graph.capture import CallSpec, capture
from partitioner.graph.tensorparallel import TP_KEY, TPLayout, find_tensor_parallel
from partitioner.graph.values import propagate_values
from partitioner.modelfile import load_model_file
from partitioner.solve.tensorparallel import node_share
from runtime.parallel.tensorparallel import parameter_placements

MODELS = Path(__file__).parent / "models"
C, H, T = 16, 4, 6


def _layout(model: nn.Module, inputs: Any) -> tuple[TPLayout, torch.fx.GraphModule]:
    call, flat = CallSpec.of(inputs)
    captured = capture(model, flat, call=call)
    propagate_values(captured.graph_module, flat)
    return find_tensor_parallel(captured), captured.graph_module


class Attention(nn.Module):
    """Self-attention written one of several ways (``kind``); the row is ``proj``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B = x.shape[0]
        if self.kind == "apart":
            return tuple(m(x).view(B, T, H, C // H).transpose(1, 2) for m in (self.q, self.k, self.v))  # type: ignore[return-value]
        if self.kind == "fused (3, heads, head_dim)":
            qkv = self.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)  # (3, B, H, T, D)
            return qkv[0], qkv[1], qkv[2]
        if self.kind == "fused cut in thirds":  # GPT-2's c_attn
            q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
            return tuple(t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # type: ignore[return-value]
        if self.kind == "fused (heads, 3 x head_dim)":  # Megatron's layout: each head's q, k, v together
            q, k, v = self.qkv(x).view(B, T, H, 3 * (C // H)).split(C // H, dim=-1)  # 3 x (B, T, H, D)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        raise ValueError(self.kind)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._heads(x)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(x.shape[0], T, C))  # (B, T, C)


class MergedIntoSequence(nn.Module):
    """Heads folded into the sequence: the split dimension merged into the one before it."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x).view(x.shape[0], T, H, C // H).reshape(x.shape[0], T * H, C // H)  # (B, T x H, D)
        return self.down(torch.tanh(h).reshape(x.shape[0], T, C))


class SoftmaxOverFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.softmax(self.up(x), dim=-1))  # the softmax needs every feature


class ReusedColumn(nn.Module):
    """``up`` is a pair's column once, and once a plain projection whose output leaves: one placement only."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.down(F.gelu(self.up(x)))
        return h, self.up(h)


def _x() -> Tensor:
    return torch.randn(2, T, C)


def test_roles_hold_where_the_split_reaches_the_row_whole() -> None:
    for kind, heads in (("apart", (H, H)), ("fused (heads, 3 x head_dim)", (H, H))):
        layout, gm = _layout(Attention(kind), (_x(),))
        (pattern,) = layout.patterns
        assert (pattern.kind, pattern.heads, layout.dropped) == ("attention", heads, {}), kind
        assert TP_KEY in next(n for n in gm.graph.nodes if n.name == "proj").meta
    layout, _ = _layout(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), (torch.randn(2, 8),))
    assert [p.kind for p in layout.patterns] == ["mlp"] and not layout.whole


def test_a_split_that_does_not_survive_leaves_the_pair_whole_with_the_reason() -> None:
    cases: dict[str, tuple[nn.Module, str]] = {
        "fused (3, heads, head_dim)": (Attention("fused (3, heads, head_dim)"),
                                       r"views the split dimension \(48\) as \(3, \.\.\.\)"),
        "fused cut in thirds": (Attention("fused cut in thirds"), "cuts the split dimension into parts"),
        "softmax over the features": (SoftmaxOverFeatures(), "works along the split dimension"),
        "heads merged into the sequence": (MergedIntoSequence(), "merges the split dimension into the one before"),
    }
    for name, (model, why) in cases.items():
        layout, gm = _layout(model, (_x(),))
        assert layout.pairs == (), name
        (reason,) = layout.dropped.values()
        assert re.search(why, reason), (name, reason)
        assert why.split(" ")[0] in layout.reason or "no column/row pair keeps its split" in layout.reason
        # Whole at run time (no role, no placement) and priced whole (each GPU of the group runs it all).
        assert not any(TP_KEY in n.meta for n in gm.graph.nodes), name
        assert parameter_placements(gm, 2) == {}, name
        assert layout.whole and all(node_share(layout, n, 2, sequence_parallel=True) == 1 for n in layout.whole)
        assert "kept whole" in layout.summary() or "none" in layout.summary()


def test_a_parameter_read_two_ways_keeps_one_placement() -> None:
    lm = load_model_file(f"{MODELS / 'flinear_lm.py'}:build_matmul_head")
    layout, gm = _layout(lm.build(), lm.example_inputs(2))
    assert "emb.weight" not in layout.parameters and [p.kind for p in layout.patterns] == ["mlp"] * 4
    assert "emb.weight is read elsewhere" in next(iter(layout.dropped.values()))
    assert "emb.weight" not in parameter_placements(gm, 2)
    functional = load_model_file(str(MODELS / "flinear_lm.py"))  # F.linear(h, emb.weight): embedding and head
    layout, gm = _layout(functional.build(), functional.example_inputs(2))
    assert {p.kind for p in layout.patterns} == {"mlp", "embedding", "head"} and not layout.dropped
    from torch.distributed.tensor import Shard

    assert parameter_placements(gm, 2)["emb.weight"] == Shard(0)  # rows of the table and of the head alike
    layout, gm = _layout(ReusedColumn(), (_x(),))
    assert layout.pairs == () and "up.weight is read elsewhere" in next(iter(layout.dropped.values()))
    albert = load_model_file(str(MODELS / "albert_shared.py"))  # one layer at every depth: each call alike
    layout, gm = _layout(albert.build(), albert.example_inputs(2))
    assert [p.kind for p in layout.patterns] == ["mlp"] * 8 and not layout.dropped
    assert len({str(v) for k, v in parameter_placements(gm, 2).items() if k == "layer.up.weight"}) == 1


def test_fused_qkv_and_a_matmul_head_at_tp2_train_as_the_whole_model(tmp_path: Path) -> None:
    """The issue's crash: the fused (3, heads, head_dim) attention now runs whole, its MLP split."""
    cases = {"fused": str(MODELS / "fused_qkv.py"), "matmul head": f"{MODELS / 'flinear_lm.py'}:build_matmul_head"}
    jobs = []
    for k, spec in enumerate(cases.values()):
        plan = plan_case(spec, tmp_path / f"case{k}", pp=1, tp=2, schedule="1f1b")
        assert plan.tp == 2
        jobs.append((plan, spec, Job(str(tmp_path / f"case{k}"), spec)))
    records = train_jobs([job for *_, job in jobs], steps=3)
    for (plan, spec, _), ranks in zip(jobs, records, strict=True):
        diff = compare(plan, spec, ranks)
        print(f"{Path(spec).name} tp2: max diff {diff.largest():.1e}")
        assert diff.largest() <= 1e-5, (spec, diff)
