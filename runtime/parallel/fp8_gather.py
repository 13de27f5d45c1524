"""FSDP2 all-gathers FP8 weights (tensorwise): torchao's ``enable_fsdp_float8_all_gather``, on FSDP2's extension hooks.

A fully sharded stage (``shard`` ``full``, :mod:`runtime.parallel.shard`) gathers its parameters
before each forward (and, under ZeRO-3, each backward).  An FP8 linear's weight
(:func:`runtime.state.fp8.fp8_linear`, tensorwise recipe) is read only through its FP8 cast, so
FSDP2 can gather that cast instead, 1 byte per element instead of bf16's 2: each replica casts its
shard with the whole weight's scale (its amax all-reduced (max) over the shard group) and FSDP2
all-gathers the FP8 bytes; the gathered parameter is a :class:`Float8Gathered`, the FP8 weight and
its scale, which :func:`~runtime.state.fp8.fp8_linear` multiplies as it is.  A cast is elementwise
once the scale is the whole weight's, so the gathered bytes are the whole weight's cast, bit for
bit: the same training as without it.

The hooks are FSDP2's all-gather extensions, ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``
on the sharded parameter's local tensor (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
torch 2.13's five-argument signature).  torchao makes the parameter a tensor subclass that
carries them through every op (the optimizer's, checkpoints'); here they are bound to the plain
local tensor FSDP2 already made, so the optimizer, clipping and checkpoints see plain shards, and
FSDP2 is told once (``FSDPParam._init_extensions``, which it otherwise runs only as it shards).  An
operation that replaces a shard's tensor object (``load_state_dict(assign=True)``) drops its hooks:
that weight is then gathered in bf16, as without them, with the same numbers.  The scales of a
step are precomputed by :class:`FP8Gathers` in one all-reduce.

Example (the gathered weight: views keep the cast, any other op reads its value)::

    >>> w = Float8Gathered(torch.tensor([[1.0, -448.0]]).to(torch.float8_e4m3fn), torch.tensor(0.5), torch.float32)
    >>> w.t().fp8_cast()[0].shape, float(w.t().fp8_cast()[1]), (w * 2).tolist()
    (torch.Size([2, 1]), 0.5, [[1.0, -448.0]])
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils._pytree import tree_map

__all__ = ["FP8Gathers", "Float8Gathered", "enable_fp8_all_gather", "fp8_gathered_weights"]

_aten = torch.ops.aten
_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(_E4M3).max
_EPS = 1e-12  # runtime.state.fp8's amax floor
# What enable_fp8_all_gather reads of FSDP2's FSDPParam (methods and properties; instance fields are checked as used).
_FSDP_PARAM_ATTRIBUTES = ("_init_extensions", "_sharded_local_tensor")


class Float8Gathered(torch.Tensor):
    """A gathered weight held as its FP8 (e4m3) tensorwise cast: ``data * scale`` in ``dtype`` (FSDP2's parameter
    dtype).  :func:`runtime.state.fp8.fp8_linear` reads ``data`` and ``scale``; any other op sees the dequantised
    value (views and transposes keep the cast)."""

    data_fp8: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Float8Gathered:  # noqa: PYI034
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.data_fp8 = data
        self.scale = scale

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"Float8Gathered(shape={tuple(self.shape)}, dtype={self.dtype}, scale={float(self.scale):.3g})"

    def fp8_cast(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight and its scale, as :func:`runtime.state.fp8.quantize` of the whole weight gives them."""
        return self.data_fp8, self.scale

    def dequantised(self) -> torch.Tensor:
        return (self.data_fp8.float() * self.scale).to(self.dtype)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["data_fp8", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], dtype: Any, size: Any, stride: Any) -> Float8Gathered:
        return Float8Gathered(inner["data_fp8"], inner["scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _KEEPS_CAST:
            first = args[0]
            return Float8Gathered(func(first.data_fp8, *args[1:], **kwargs), first.scale, first.dtype)
        if func is _aten.as_strided.default and tuple(args[1]) == tuple(args[0].shape):
            return Float8Gathered(args[0].data_fp8, args[0].scale, args[0].dtype)

        def plain(t: Any) -> Any:
            return t.dequantised() if isinstance(t, Float8Gathered) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


_KEEPS_CAST = {_aten.detach.default, _aten.alias.default, _aten.t.default, _aten.transpose.int,
               _aten.view.default, _aten._unsafe_view.default}


def _amax(local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest |value| of a shard as the weight is computed with (``dtype``: bf16 under FSDP2's policy,
    runtime/state/fp8.py's rule); 0 for an empty shard."""
    wide = local.detach().to(dtype).float()
    return wide.abs().amax() if wide.numel() else wide.new_zeros(())


class FP8Gathers:
    """This rank's weights FSDP2 gathers as FP8 casts (:func:`enable_fp8_all_gather`), and their scales.

    :meth:`precompute` (before a training step's first forward) all-reduces every weight's amax at once, one
    collective per step, as torchao's ``precompute_float8_dynamic_scale_for_fsdp``; :meth:`forget` (after the
    step's last backward, before the optimizer moves the weights) drops them.  A gather without a precomputed
    scale (an evaluation) all-reduces its weight's amax itself.  Every rank of a shard group holds the same
    weights and calls these at the same points, so the collectives match.
    """

    def __init__(self) -> None:
        self._shards: list[tuple[torch.Tensor, torch.dtype, dist.ProcessGroup]] = []
        self._scales: dict[int, torch.Tensor] = {}  # id of a shard -> its weight's scale, this step

    def __len__(self) -> int:
        return len(self._shards)

    def add(self, local: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
        self._shards.append((local, dtype, group))
        local.fsdp_pre_all_gather = functools.partial(self._pre_all_gather, local)  # type: ignore[attr-defined]
        local.fsdp_post_all_gather = _post_all_gather  # type: ignore[attr-defined]

    def precompute(self) -> None:
        if not self._shards:
            return
        with torch.no_grad(), torch.autocast(self._shards[0][0].device.type, enabled=False):
            amaxes = torch.stack([_amax(local, dtype) for local, dtype, _ in self._shards])
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self._shards[0][2])  # one shard group per rank
            scales = amaxes.clamp(min=_EPS) / _E4M3_MAX
        self._scales = {id(local): scale for (local, _, _), scale in zip(self._shards, scales, strict=True)}

    def forget(self) -> None:
        self._scales = {}

    def _pre_all_gather(self, local: torch.Tensor, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                        module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """FSDP2's ``fsdp_pre_all_gather`` of the shard ``local``: its FP8 cast with the whole weight's scale, as
        bytes (every backend gathers uint8) padded to FSDP2's shard size; the scale and the whole size as
        metadata."""
        dtype = mp_policy.param_dtype or local.dtype
        with torch.no_grad(), torch.autocast(local.device.type, enabled=False):  # FSDP2 gathers under autocast
            scale = self._scales.get(id(local))
            if scale is None:
                amax = _amax(local, dtype)
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
                scale = amax.clamp(min=_EPS) / _E4M3_MAX
            wide = local.detach().to(dtype).float()
            q = (wide / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3).view(torch.uint8)
            rows = math.ceil(outer_size[0] / mesh.size())  # FSDP2 pads every shard to this many rows
            if q.shape[0] != rows:
                padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.uint8, device=q.device)
                padded[: q.shape[0]] = q
                q = padded
        return (q,), (scale, outer_size)


def _post_all_gather(outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    """FSDP2's ``fsdp_post_all_gather``: the gathered bytes as a :class:`Float8Gathered` (a view of FSDP2's buffer,
    which it frees and refills); ``out``: the one made at the first gather, given its new scale."""
    (gathered,) = outputs
    scale, size = metadata
    if out is not None:  # FSDP2 gathered into the same buffer again: only the scale is new
        if not isinstance(out, Float8Gathered):
            raise TypeError(f"FSDP2 gathered an FP8 weight into {type(out).__name__}, not the Float8Gathered made "
                            "at its first gather: report this (its gathered parameter was replaced).")
        out.scale = scale
        return None
    return Float8Gathered(gathered.view(_E4M3)[: size[0]], scale, param_dtype), (gathered,)


def fp8_gathered_weights(stages: Sequence[fx.GraphModule]) -> set[tuple[int, str]]:
    """The weights of ``stages`` read once, by one tensorwise :func:`~runtime.state.fp8.fp8_linear` call, as its
    weight: (id of the owning module, attribute name), which FSDP2's sharding keeps (it swaps the parameters).

    A weight read more than once (a layer reused across depth, as ALBERT's) is gathered in bf16: with its FP8
    cast gathered, such a stage under ``full`` sharding trained off the whole graph (loss by 1.4e-3 on
    tests/models/albert_shared.py, pp 2 x dp 2); the cause was not found, so those weights keep the plain path."""
    from runtime.state.fp8 import fp8_linear

    reads: dict[tuple[int, str], bool] = {}
    for stage in stages:
        for node in stage.graph.nodes:
            if node.op != "get_attr" or not node.users:  # a read the FP8 rewrite left unused
                continue
            path, _, name = str(node.target).rpartition(".")
            owner = stage.get_submodule(path)
            if not isinstance(getattr(owner, name, None), nn.Parameter):
                continue
            key = (id(owner), name)
            only = all(u.op == "call_function" and u.target is fp8_linear and u.args[1] is node
                       and u.kwargs.get("recipe", "tensorwise") == "tensorwise" for u in node.users)
            reads[key] = key not in reads and len(node.users) == 1 and only
    return {key for key, only in reads.items() if only}


def enable_fp8_all_gather(units: Sequence[nn.Module], weights: set[tuple[int, str]]) -> FP8Gathers:
    """Make FSDP2 gather each of ``weights`` (:func:`fp8_gathered_weights`) in ``units`` (FSDP2 units, sharded) as
    its FP8 cast.  Call it once their shards hold their storage (after
    :func:`~runtime.parallel.shard.fill_shards`): the hooks live on the shards' tensors."""
    from torch.distributed.fsdp import FSDPModule

    try:  # FSDP2 internals (torch 2.13): another torch gathers bf16, the same numbers, and says so
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        missing = [a for a in _FSDP_PARAM_ATTRIBUTES if not hasattr(FSDPParam, a)]
    except ImportError as err:
        missing = [str(err)]
    if missing and weights:
        warnings.warn(f"FSDP2 of torch {torch.__version__} lacks what the FP8 all-gather binds to ({', '.join(missing)}): "
                      "the FP8 linears' weights are gathered in bf16 (the same training, twice the bytes the plan "
                      "priced).", RuntimeWarning, stacklevel=2)
        return FP8Gathers()
    gathers = FP8Gathers()
    for unit in units:
        for module in unit.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    info = fsdp_param._module_info
                    if (id(info.module), info.param_name) not in weights or info.shared_modules \
                            or fsdp_param._unsharded_dtensor_spec is not None:  # tied, or tensor parallel
                        continue
                    local = fsdp_param._sharded_local_tensor
                    gathers.add(local, fsdp_param.mp_policy.param_dtype or local.dtype,
                                cast(FSDPMeshInfo, group.mesh_info).shard_process_group)
                    fsdp_param._init_extensions()  # FSDP2 looks for the hooks once, as it shards the parameter
    return gathers
