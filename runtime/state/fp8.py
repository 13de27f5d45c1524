"""FP8 training of the linear layers' matmuls (``--precision fp8``): the stage graphs rewritten.

The planner priced the nodes :func:`partitioner.graph.fp8.fp8_matmuls` finds in the
whole captured graph; here the same nodes of each stage's ``fx.GraphModule`` become
calls of :func:`fp8_linear`, a scaled FP8 matmul (``torch._scaled_mm``) with its own
autograd, as torchao's ``Float8Linear`` (tensorwise recipe) computes it:

* forward: the input and the weight cast to ``float8_e4m3fn``, each with a scale
  from its amax (``amax / 448``); ``y = (x_fp8 @ w_fp8^T) * s_x * s_w``, out in the
  compute dtype (bf16 under autocast, else the input's), plus the bias;
* backward: the output gradient cast to ``float8_e5m2`` (``amax / 57344``);
  ``dx = g_fp8 @ w_fp8`` and ``dw = g_fp8^T @ x_fp8``, each a scaled matmul, out in
  the input's and the weight's dtypes.

Saved for backward: the input's FP8 cast and its scale (1 byte per element, what the
planner counts, partitioner/cost/precision.py) and the weight itself (a parameter:
no activation memory; cast again in backward, to the same bits).  ``rowwise``
scales each row of the left operand and each column of the right one along the
contracted dimension (the saved FP8 input, scaled per row for the forward, is
dequantised and cast again per column for the weight gradient: the price of not
keeping it in bf16).  ``mxfp8`` needs Blackwell's block-scaled kernels and is not
run here.

The verify reference runs the whole captured graph through the same rewrite
(:func:`convert_graph`), so both sides quantise alike.

Under tensor parallelism (``tp > 1``) the stage graph runs on DTensors (:mod:`runtime.parallel.tensorparallel`):
:func:`fp8_linear` then runs the same scaled matmuls on each rank's local shards, with every
amax that spans a split dimension all-reduced (max) over the tensor-parallel group first, as
torchao's Float8 with tensor parallelism does.  A column-parallel linear (weight split by
output rows) reads its input whole; a row-parallel one (weight split by input features) reads
it split along features and leaves a pending sum.  Each FP8 cast is then bit for bit the
unpartitioned model's (a max is exact, whatever the order), and only the float32 sums of the
matmuls (the row-parallel partial sums) are added in another order: ``verify``'s reference adds
them in the ranks' order (:mod:`runtime.parallel.splitorder`).

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> from partitioner.graph.fp8 import fp8_matmuls
    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    >>> gm = capture(m, (torch.randn(4, 32),)).graph_module
    >>> convert_graph(gm, fp8_matmuls(gm))
    1
    >>> x = torch.randn(4, 32)
    >>> bool((gm(x)[0] - m(x)).abs().max() < 0.1)  # FP8 rounding: close to the float32 model, not equal
    True
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from partitioner.errors import AutopartitionError
from partitioner.graph.fp8 import FP8Matmul
from partitioner.graph.ir import KIND_KEY

__all__ = ["RUNNABLE_RECIPES", "autocast_operand", "convert_graph", "fp8_linear", "quantize", "scaled_mm"]

# Recipes this runtime runs (mxfp8 needs Blackwell's block-scaled _scaled_mm layouts).
RUNNABLE_RECIPES = ("tensorwise", "rowwise")
_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2
_EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale
_aten = torch.ops.aten
# Matmul targets whose activation is their first operand (addmm's is its second).
_LINEAR_FIRST = {torch.nn.functional.linear, torch._C._nn.linear, _aten.linear.default, _aten.mm.default,
                 _aten.matmul.default, torch.matmul, torch.mm, operator.matmul}


def quantize(t: torch.Tensor, dtype: torch.dtype, *, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-d) as ``dtype`` and its scale (float32): ``t ~ q * scale``; per row (``dim=1``) or column (0), or whole.

    >>> q, s = quantize(torch.tensor([[1.0, -448.0], [2.0, 0.5]]), torch.float8_e4m3fn)
    >>> q.dtype, float(s), q.float().tolist()
    (torch.float8_e4m3fn, 1.0, [[1.0, -448.0], [2.0, 0.5]])
    """
    limit = torch.finfo(dtype).max
    wide = t.float()
    amax = wide.abs().amax() if dim is None else wide.abs().amax(dim=dim, keepdim=True)
    scale = amax.clamp(min=_EPS) / limit
    q = (wide / scale).clamp(-limit, limit).to(dtype)
    return q, scale


def _quantize_split(t: torch.Tensor, dtype: torch.dtype, *, dim: int | None, split: int | None,
                    group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of a local shard of a tensor split along its dimension ``split`` (None: whole) over
    ``group``: an amax that spans the split dimension all-reduced (max) first, so the cast is the whole tensor's."""
    if split is None or (dim is not None and dim != split):
        return quantize(t, dtype, dim=dim)
    limit = torch.finfo(dtype).max
    wide = t.float()
    amax = wide.abs().amax() if dim is None else wide.abs().amax(dim=dim, keepdim=True)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax.clamp(min=_EPS) / limit
    return (wide / scale).clamp(-limit, limit).to(dtype), scale


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype, *, rowwise: bool,
               out_dtype: torch.dtype, a_q: tuple[torch.Tensor, torch.Tensor] | None = None,
               b_q: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``a @ b`` (2-d) in FP8: ``a`` scaled per row (or whole) and ``b`` per column, as ``torch._scaled_mm`` takes them.

    ``a_q``, ``b_q``: an operand already quantised (its FP8 cast and scale).  ``_scaled_mm`` wants the left
    operand row-major and the right one column-major; it writes float32 or bf16 (a float64
    result is computed in float32).
    """
    qa, sa = a_q if a_q is not None else quantize(a, a_dtype, dim=1 if rowwise else None)
    qb, sb = b_q if b_q is not None else quantize(b, b_dtype, dim=0 if rowwise else None)
    out = out_dtype if out_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    m, n = qa.shape[0], qb.shape[1]
    # cuBLASLt's FP8 GEMMs take dimensions in multiples of 16: pad with zeros (a token count need not be one).
    qa, qb = _padded(qa), _padded(qb)
    sa, sb = _padded_scale(sa, qa.shape[0], rows=True), _padded_scale(sb, qb.shape[1], rows=False)
    result = torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out)
    result = result[:m, :n]
    return result if result.dtype == out_dtype else result.to(out_dtype)


def _pad16(size: int) -> int:
    return -size % 16


def _padded(q: torch.Tensor) -> torch.Tensor:
    """``q`` (FP8) padded with zeros to multiples of 16 in both dimensions (bit pattern 0 is +0.0)."""
    if not (_pad16(q.shape[0]) or _pad16(q.shape[1])):
        return q
    bits = torch.nn.functional.pad(q.view(torch.uint8), (0, _pad16(q.shape[1]), 0, _pad16(q.shape[0])))
    return bits.view(q.dtype)


def _padded_scale(scale: torch.Tensor, size: int, *, rows: bool) -> torch.Tensor:
    """A per-row (``rows``) or per-column scale padded with ones to ``size`` entries; a tensorwise one as it is."""
    if scale.numel() == 1:
        return scale
    have = scale.shape[0] if rows else scale.shape[1]
    if have == size:
        return scale
    pad = (0, 0, 0, size - have) if rows else (0, size - have)
    return torch.nn.functional.pad(scale, pad, value=1.0)


class _FP8Linear(torch.autograd.Function):
    """``x @ w^T`` in FP8 (module docstring); ``w`` is ``[out, in]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, rowwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq = quantize(x2, _E4M3, dim=1 if rowwise else None)
        wq = _gathered_cast(w)
        y = scaled_mm(x2, w.t(), _E4M3, _E4M3, rowwise=rowwise, out_dtype=out_dtype, a_q=xq,
                       b_q=None if wq is None else (wq[0].t(), wq[1]))
        ctx.save_for_backward(xq[0], xq[1], w)  # the input as its FP8 cast (1 byte per element)
        ctx.rowwise, ctx.x_shape, ctx.x_dtype = rowwise, x.shape, x.dtype
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        xq, xs, w = ctx.saved_tensors
        rowwise = ctx.rowwise
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g2, w, _E5M2, _E4M3, rowwise=rowwise, out_dtype=ctx.x_dtype,
                                b_q=_gathered_cast(w)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # tensorwise: the forward's cast as it is; rowwise: dequantised and cast again per column
            x2 = xq.float() * xs
            grad_w = scaled_mm(g2.t(), x2, _E5M2, _E4M3, rowwise=rowwise, out_dtype=w.dtype,
                                b_q=None if rowwise else (xq, xs))
        return grad_x, grad_w, None, None


def _gathered_cast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A weight FSDP2 gathered as its tensorwise FP8 cast (:mod:`runtime.parallel.fp8_gather`): that cast, else None."""
    cast_of = getattr(w, "fp8_cast", None)
    return None if cast_of is None else cast(tuple[torch.Tensor, torch.Tensor], cast_of())


def _axis(labels: str, split: str | None) -> int | None:
    """The dimension of a 2-d operand (its dimensions named by ``labels``, e.g. ``"mk"``) that ``split`` names."""
    return labels.index(split) if split is not None and split in labels else None


class _FP8LinearShard(torch.autograd.Function):
    """:class:`_FP8Linear` on one rank's shards: ``x`` ``[m, k]``, ``w`` ``[n, k]``, one of ``m``, ``n``, ``k``
    split over ``group`` (``split``; None: neither).  Every amax over a split dimension is all-reduced, so the
    casts are the whole tensors'; a split ``k`` (row parallel) leaves the output a pending sum, and a split ``n``
    (column parallel) the input gradient, as a split ``m`` the weight gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, rowwise: bool, out_dtype: torch.dtype,  # type: ignore[override]
                split: str | None, group: dist.ProcessGroup | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq = _quantize_split(x2, _E4M3, dim=1 if rowwise else None, split=_axis("mk", split), group=group)
        wt = w.t()
        wq = _quantize_split(wt, _E4M3, dim=0 if rowwise else None, split=_axis("kn", split), group=group)
        y = scaled_mm(x2, wt, _E4M3, _E4M3, rowwise=rowwise, out_dtype=out_dtype, a_q=xq, b_q=wq)
        ctx.save_for_backward(xq[0], xq[1], w)
        ctx.rowwise, ctx.x_shape, ctx.x_dtype, ctx.split, ctx.group = rowwise, x.shape, x.dtype, split, group
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        xq, xs, w = ctx.saved_tensors
        rowwise, split, group = ctx.rowwise, ctx.split, ctx.group
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = _quantize_split(g2, _E5M2, dim=1 if rowwise else None, split=_axis("mn", split), group=group)
            wq = _quantize_split(w, _E4M3, dim=0 if rowwise else None, split=_axis("nk", split), group=group)
            grad_x = scaled_mm(g2, w, _E5M2, _E4M3, rowwise=rowwise, out_dtype=ctx.x_dtype, a_q=gq,
                                b_q=wq).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gt = g2.t()
            gq = _quantize_split(gt, _E5M2, dim=1 if rowwise else None, split=_axis("nm", split), group=group)
            if rowwise:  # dequantised and cast again per column, as _FP8Linear does
                xcast = _quantize_split(xq.float() * xs, _E4M3, dim=0, split=_axis("mk", split), group=group)
            else:
                xcast = (xq, xs)  # its scale is already the whole input's
            grad_w = scaled_mm(gt, xq, _E5M2, _E4M3, rowwise=rowwise, out_dtype=w.dtype, a_q=gq, b_q=xcast)
        return grad_x, grad_w, None, None, None, None


def _fp8_linear_tp(x: torch.Tensor, w: torch.Tensor, *, rowwise: bool, out_dtype: torch.dtype) -> DTensor:
    """``x @ w^T`` in FP8 where ``x`` or ``w`` is a DTensor (tensor parallelism): the local shards' scaled matmuls.

    The weight's placement picks the split: ``Shard(0)`` (column: the input made whole, the output split by
    features), ``Shard(1)`` (row: the input split by features, the output a pending sum), replicated (the input
    as it is split along its tokens, or whole).
    """
    mesh = w.device_mesh if isinstance(w, DTensor) else cast(DTensor, x).device_mesh
    if mesh.ndim != 1:
        raise AutopartitionError(
            f"fp8_linear runs on DTensors over a 1-d tensor-parallel mesh, not over {mesh.ndim} dimensions "
            f"({mesh.mesh_dim_names}): plan such a stage with --precision bf16-mixed, or without tensor parallelism.")

    def whole(t: torch.Tensor) -> DTensor:
        return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()], run_check=False)

    xd, wd = whole(x), whole(w)
    last = xd.dim() - 1
    pw = wd.placements[0]
    if not (pw.is_replicate() or isinstance(pw, Shard)):  # a pending sum: made whole
        wd, pw = wd.redistribute(mesh, [Replicate()]), Replicate()
    split: str | None
    want: Placement
    out: Placement
    px = xd.placements[0]
    if isinstance(pw, Shard) and pw.dim == 0:  # column parallel
        split, want, out = "n", Replicate(), Shard(last)
    elif isinstance(pw, Shard):  # row parallel
        split, want, out = "k", Shard(last), Partial()
    elif isinstance(px, Shard) and px.dim % xd.dim() != last:  # a replicated weight on tokens split
        split, want, out = "m", Shard(px.dim % xd.dim()), Shard(px.dim % xd.dim())
    else:
        split, want, out = None, Replicate(), Replicate()
    if xd.placements[0] != want:
        xd = xd.redistribute(mesh, [want])
    # The local gradients that are pending sums say so: a whole input read by split columns, a whole weight
    # read by split tokens.
    x_local = xd.to_local(grad_placements=[Partial()] if split == "n" else None)
    w_local = wd.to_local(grad_placements=[Partial()] if split == "m" else None)
    y = _FP8LinearShard.apply(x_local, w_local, rowwise, out_dtype, split, mesh.get_group())
    shape = torch.Size([*xd.shape[:-1], wd.shape[0]])
    return DTensor.from_local(y, mesh, [out], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def autocast_operand(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """The weight an FP8 matmul of ``x`` casts, and its output dtype: under autocast the weight's autocast (bf16)
    value and autocast's dtype, else ``w`` and ``x``'s dtype.

    One rule wherever the weight lives (as torchao under FSDP2's bf16 policy): FSDP2 gathers that bf16 value, so
    whole, sharded and tensor-parallel ranks and the verify reference cast the same bits; the weight's gradient
    is computed in bf16, as autocast's.
    """
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return w, x.dtype
    dtype = torch.get_autocast_dtype(device)
    return w.to(dtype), dtype


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               recipe: str = "tensorwise", transposed: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmul in FP8 (module docstring); ``transposed``: ``x @ weight``.

    Under autocast the result is in autocast's dtype (bf16, as autocast's linear), else in ``x``'s.

    >>> x, w = torch.randn(8, 32), torch.randn(16, 32)
    >>> y = fp8_linear(x, w)
    >>> y.shape, bool(((y - x @ w.t()).abs().max() / (x @ w.t()).abs().max()) < 0.1)
    (torch.Size([8, 16]), True)
    """
    if recipe not in RUNNABLE_RECIPES:
        raise AutopartitionError(
            f"FP8 recipe {recipe!r} is not run by this runtime (it runs {' and '.join(RUNNABLE_RECIPES)}): "
            "re-plan with --fp8-recipe tensorwise or rowwise.")
    w, out_dtype = autocast_operand(x, weight.t() if transposed else weight)
    with torch.autocast(x.device.type, enabled=False):
        if isinstance(x, DTensor) or isinstance(w, DTensor):  # tensor parallel: on each rank's shards
            y = _fp8_linear_tp(x, w, rowwise=recipe == "rowwise", out_dtype=out_dtype)
        else:
            y = _FP8Linear.apply(x, w, recipe == "rowwise", out_dtype)
        return y if bias is None else y + bias.to(y.dtype)


def convert_graph(gm: fx.GraphModule, matmuls: Mapping[str, FP8Matmul], *, recipe: str = "tensorwise") -> int:
    """Rewrite the nodes of ``gm`` named in ``matmuls`` into :func:`fp8_linear` calls, in place; how many.

    ``matmuls``: :func:`partitioner.graph.fp8.fp8_matmuls` of the whole captured
    graph (a stage holds some of them, under the same names).  The activation is
    the node's own operand; weight and bias are read by name (a stage holds its
    parameters under their model names).
    """
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        match = matmuls.get(node.name)
        if match is None:
            continue
        if node.op == "call_module" or node.target in _LINEAR_FIRST:
            x = node.args[0]
        else:  # addmm(bias, x, w)
            x = node.args[1] if len(node.args) == 3 else node.args[0]
        with graph.inserting_before(node):
            weight = graph.get_attr(match.weight)
            bias = graph.get_attr(match.bias) if match.bias is not None else None
            new = graph.call_function(fp8_linear, (x, weight, bias),
                                      {"recipe": recipe, "transposed": match.transposed})
        for read in (weight, bias):  # parameters, as tensor parallelism's split finds them (ir.node_parameters)
            if read is not None:
                read.meta[KIND_KEY] = "parameter"
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done += 1
    graph.lint()
    gm.recompile()
    return done

