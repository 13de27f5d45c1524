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
from typing import NamedTuple

from partitioner.cost.devices import DeviceSpec

__all__ = ["OP_CLASSES", "NodeCost", "SplitOverhead", "op_class", "predicted_times"]

# Op classes a device's efficiencies are given for (DeviceSpec.efficiency); "fp8-matmul" (a linear layer's
# matmul under --precision fp8) falls back to "matmul" where a device gives none (DeviceSpec.efficiency_of).
OP_CLASSES = ("matmul", "attention", "memory", "fp8-matmul")
_FP8 = "float8_e4m3fn"  # partitioner.cost.precision.FP8_DTYPE: the dtype an FP8 matmul's cost carries


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
    # A linear layer's matmul that --precision fp8 runs in FP8 (partitioner.graph.fp8.fp8_matmuls marks it)
    fp8_matmul: bool = False


def op_class(cost: NodeCost) -> str:
    """Which efficiency prices ``cost``'s FLOPs: ``matmul`` (reads weights), ``attention`` (FLOPs without),
    ``fp8-matmul`` (a matmul run in FP8: its own share of the FP8 peak).

    Memory-bound work is priced with the ``memory`` efficiency of the bandwidth whatever the class.

    >>> op_class(NodeCost(0, 0, 1e9, 2e9, 0, 10, "bfloat16", weight_bytes=8)), op_class(NodeCost(0, 0, 1e9, 0, 0, 10, "bfloat16"))
    ('matmul', 'attention')
    """
    if cost.weight_bytes > 0:
        return "fp8-matmul" if cost.dtype == _FP8 else "matmul"
    return "attention"


def predicted_times(cost: NodeCost, spec: DeviceSpec) -> tuple[float, float]:
    """Roofline forward and backward seconds of one node on ``spec``, each peak scaled by its efficiency."""
    if cost.forward_flops == 0 and cost.io_bytes == 0:
        return 0.0, 0.0  # views and other metadata-only ops
    peak = spec.peak(cost.dtype) * spec.efficiency_of(op_class(cost))
    bandwidth = spec.memory_bandwidth * spec.efficiency_of("memory")
    forward = max(cost.forward_flops / peak, cost.io_bytes / bandwidth) + spec.kernel_overhead
    # Backward reads the saved activations and the output gradient, writes input gradients.
    backward = 0.0
    if cost.backward_flops > 0 or cost.saved_bytes > 0:
        backward = max(cost.backward_flops / peak, 2 * cost.io_bytes / bandwidth) + spec.kernel_overhead
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
