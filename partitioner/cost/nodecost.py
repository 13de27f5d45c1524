"""One node's cost as plain numbers, the roofline that prices it on a GPU, and a split backward's overhead.

Torch-free on purpose: the cost pass (:mod:`partitioner.cost.nodes`,
:mod:`partitioner.cost.measured`, :mod:`partitioner.cost.splitcost`) fills these in
with torch, and the solver's formulation (:mod:`partitioner.solve.formulate`)
reads them without it.

Times for a GPU we are not on come from :func:`predicted_times`, a roofline:
``max(FLOPs / peak, bytes / bandwidth) + launch overhead`` (Williams et al.,
"Roofline", CACM 2009), with the peaks in :mod:`partitioner.cost.devices`.

Example::

    >>> import dataclasses
    >>> from partitioner.cost.devices import device_spec
    >>> bare = dataclasses.replace(device_spec("h100"), efficiency=())  # the datasheet's roofline
    >>> forward, backward = predicted_times(NodeCost(0.0, 0.0, 989e9, 1978e9, 0, 0, "bfloat16"), bare)
    >>> round(forward * 1e3, 3), round(backward * 1e3, 3)   # 1 ms and 2 ms of FLOPs at 989 TFLOP/s, + launch
    (1.005, 2.005)
    >>> matmul = NodeCost(0.0, 0.0, 989e9, 1978e9, 0, 0, "bfloat16", weight_bytes=1)
    >>> round(predicted_times(matmul, device_spec("h100"))[0] * 1e3, 3)  # at the fitted share of the peak (0.538)
    1.864
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from partitioner.cost.devices import DeviceSpec

__all__ = ["OP_CLASSES", "NodeCost", "SplitOverhead", "gemm_waves", "op_class", "predicted_times", "wave_efficiency"]

# Op classes a device's efficiencies are given for (DeviceSpec.efficiency).
OP_CLASSES = ("matmul", "attention", "memory")


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """Per-micro-batch cost of one node (times are measured or zero)."""

    forward_s: float
    backward_s: float
    forward_flops: float
    backward_flops: float
    saved_bytes: int  # activations kept for backward
    io_bytes: int  # tensor bytes read and written by the forward, weights included
    dtype: str  # dtype of the output, chooses the peak for predictions
    weight_bytes: int = 0  # parameter bytes read (part of io_bytes; independent of the batch)
    saved_float32_bytes: int | None = None  # the float32 part of saved_bytes (None: not known)
    weight_backward_s: float = 0.0  # measured: the backward to the node's parameters alone (W)
    writes_in_place: bool = False  # the node writes one of its inputs in place (ReLU(inplace=True), x += y)
    # A matrix product with a weight: (M, N, K) of its forward, ``x (M, K) @ w (K, N)`` (M counts every
    # row, batch dimensions folded in); () when the node is none or its shape is not known.
    gemm: tuple[int, ...] = ()


def op_class(cost: NodeCost) -> str:
    """Which efficiency prices ``cost``'s FLOPs: ``matmul`` (reads weights), ``attention`` (FLOPs without).

    Memory-bound work is priced with the ``memory`` efficiency of the bandwidth whatever the class.

    >>> op_class(NodeCost(0, 0, 1e9, 2e9, 0, 10, "bfloat16", weight_bytes=8)), op_class(NodeCost(0, 0, 1e9, 0, 0, 10, "bfloat16"))
    ('matmul', 'attention')
    """
    return "matmul" if cost.weight_bytes > 0 else "attention"


def predicted_times(cost: NodeCost, spec: DeviceSpec) -> tuple[float, float]:
    """Roofline forward and backward seconds of one node on ``spec``, each peak scaled by its efficiency.

    A matrix product with a known shape (``cost.gemm``) on a device with ``sm_count`` also
    pays its wave quantization (:func:`gemm_waves`): its forward and its backward's two
    products (input and weight gradients) each use only part of their last wave.
    """
    if cost.forward_flops == 0 and cost.io_bytes == 0:
        return 0.0, 0.0  # views and other metadata-only ops
    peak = spec.peak(cost.dtype) * spec.efficiency_of(op_class(cost))
    waves_f, waves_b = gemm_waves(cost.gemm, spec.sm_count)
    bandwidth = spec.memory_bandwidth * spec.efficiency_of("memory")
    forward = max(cost.forward_flops / (peak * waves_f), cost.io_bytes / bandwidth) + spec.kernel_overhead
    # Backward reads the saved activations and the output gradient, writes input gradients.
    backward = 0.0
    if cost.backward_flops > 0 or cost.saved_bytes > 0:
        backward = max(cost.backward_flops / (peak * waves_b), 2 * cost.io_bytes / bandwidth) + spec.kernel_overhead
    return forward, backward


# Output tiles (rows x columns) a GEMM library picks among for large bf16 products; it takes the one
# that wastes least (NVIDIA, "Matrix Multiplication Background User's Guide": tile and wave quantization).
_TILES = ((128, 128), (128, 256), (256, 128))


def wave_efficiency(m: int, n: int, sms: int) -> float:
    """The share of ``sms`` streaming multiprocessors' tile work that an ``m x n`` output really needs.

    Each SM computes one output tile at a time; ``ceil(tiles / sms)`` waves run, the
    last one partly idle, and edge tiles partly empty (tile quantization).  The best of
    :data:`_TILES` is taken.  A product too small to fill one wave of the smallest tiles
    is left at 1.0: its time is mostly the launch overhead the roofline adds, and the
    library splits its inner dimension to fill the SMs (split-K).  ``sms`` 0: no such model (1.0).

    >>> wave_efficiency(8192, 8192, 108)  # 2,048 tiles of 128 x 256: 19 waves of 108, the last nearly full
    0.998...
    >>> round(wave_efficiency(4096, 1792, 108), 3), round(wave_efficiency(4096, 3584, 108), 3)
    (0.83, 0.922)
    >>> wave_efficiency(64, 512, 108)  # 4 tiles: less than a wave
    1.0
    """
    if sms <= 0 or m <= 0 or n <= 0 or math.ceil(m / 128) * math.ceil(n / 128) <= sms:
        return 1.0
    best = 0.0
    for rows, cols in _TILES:
        tiles = math.ceil(m / rows) * math.ceil(n / cols)
        waves = math.ceil(tiles / sms)
        best = max(best, m * n / (waves * sms * rows * cols))
    return min(1.0, best)


def gemm_waves(gemm: tuple[int, ...], sms: int) -> tuple[float, float]:
    """(forward, backward) wave efficiency of a product ``(M, N, K)``: the forward's ``M x N`` output, and the mean
    of the backward's input gradient (``M x K``) and weight gradient (``N x K``), each half the backward's FLOPs.

    >>> gemm_waves((), 108), gemm_waves((4096, 1792, 14336), 0)
    ((1.0, 1.0), (1.0, 1.0))
    """
    if len(gemm) != 3 or sms <= 0:
        return 1.0, 1.0
    m, n, k = gemm
    forward = wave_efficiency(m, n, sms)
    # Two products of equal FLOPs: the time is their sum, so the efficiency is the harmonic mean.
    backward = 2 / (1 / wave_efficiency(m, k, sms) + 1 / wave_efficiency(n, k, sms))
    return forward, backward


class SplitOverhead(NamedTuple):
    per_op_s: float  # host seconds per meeting op, whatever its size
    share: float  # and this share of the op's own forward + backward seconds
    forward_part: float = 0.0  # the part of it spent in F
    weight_part: float = 0.0  # and in W (the rest in B)

    def seconds(self, op_s: float) -> float:
        """Extra seconds a split backward costs an op whose forward + backward take ``op_s``.

        >>> SplitOverhead(5e-5, 0.25).seconds(4e-4)
        0.00015000000000000001
        """
        return self.per_op_s + self.share * op_s
