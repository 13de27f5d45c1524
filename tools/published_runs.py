"""Published H100 training runs: each layout as published, its measured throughput and the machine it ran on.

One list for both tools that price published layouts: ``tools/calibrate_published.py``
(predicted against measured, bf16 runs only, to set the roofline's efficiencies) and
``tools/bench_large.py --published`` (the same layouts beside the planner's own plans).

Sources (checked 2026-12-02):

* torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1 and 3) and
  ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``: Grand Teton hosts, H100s with
  96 GB HBM2e at 2.4 TB/s and the default 500 W power limit, 400 Gb/s RDMA per GPU
  (our ``h100-500w``).  torchtitan reports tokens/s per GPU.
* Llama 3 paper (Dubey et al. 2024, arXiv:2407.21783), Table 4: 405B on 8,192 and
  16,384 H100s (700 W, 80 GB HBM3: our ``h100``), in model TFLOP/s per GPU.
* Megatron-Bridge performance summary (DGX-H100): FP8 only, so not used to calibrate.

>>> [r.name for r in RUNS if r.role != "fp8"][:2]
['8b-8-torchtitan', '8b-128-torchtitan']
>>> sorted({r.role for r in RUNS})
['fit', 'fp8', 'held-out']
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RUNS", "PublishedRun", "run_named"]

_TITAN_2412 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
_TITAN_ASYNC = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
_LLAMA3 = "Llama 3 paper (arXiv:2407.21783), Table 4"
_BRIDGE = "Megatron-Bridge performance summary (25.11, DGX-H100)"


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published run: model, GPUs, batch, layout as published, and what it measured.

    ``layout``: :class:`partitioner.search.price.Layout` keywords (``gpus`` aside).
    ``checkpointing``: what the run recomputed: ``"selective"`` (torchtitan's per-op
    SAC: every other matmul and the ops between them, never attention; the layout
    recomputes fully, the layer boundaries SAC keeps too, and the calibration takes
    off the part SAC does not recompute), ``"full"``, ``"none"``, or ``"auto"``
    (unpublished: our planner's choice).
    ``role``: ``"fit"`` (the efficiencies are fitted to it), ``"held-out"`` (checked,
    not fitted) or ``"fp8"`` (FP8, which the cost model does not price: layouts only).
    ``unlimited``: priced without the memory limit, so that the plan keeps the
    published sharding where our memory model says it does not fit (the run did).
    """

    name: str
    spec: str  # model file: the factory builds the shape on meta, inputs are (batch, seq) token ids
    gpus: int
    batch: int  # sequences per step, all replicas
    seq: int
    layout: dict[str, Any]
    figure: float  # as published, in ``unit``
    unit: str  # "tokens/s/GPU" or "TFLOP/s/GPU" (model FLOPs, each by its own count)
    precision: str  # "bf16" or "fp8"
    device: str  # partitioner.cost.devices name of the machine it ran on
    compiled: bool  # torch.compile (or a framework's own fused kernels)
    checkpointing: str
    role: str
    source: str
    note: str = ""
    unlimited: bool = False

    def cite(self) -> str:
        """The source with the figure, as a table cell.

        >>> run_named("8b-8-torchtitan").cite()
        'torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: 5,762 tokens/s/GPU, bf16'
        """
        return f"{self.source}: {self.figure:,.0f} {self.unit}, {self.precision}"


def _fsdp(dp: int, recompute: str = "full") -> dict[str, Any]:
    return {"name": f"torchtitan FSDP{dp}", "tp": 1, "pp": 1, "dp": dp, "microbatches": 1, "schedule": "1f1b",
            "shard": "full", "recompute": recompute}


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "8b-8-torchtitan", "examples/llama.py:llama3_8b", 8, 16, 8192, _fsdp(8),
        5762.0, "tokens/s/GPU", "bf16", "h100-500w", False, "selective", "fit", f"{_TITAN_2412}, Table 1",
        note="local batch 2, no compile"),
    PublishedRun(
        "8b-128-torchtitan", "examples/llama.py:llama3_8b", 128, 256, 8192, _fsdp(128),
        5605.0, "tokens/s/GPU", "bf16", "h100-500w", False, "selective", "held-out", f"{_TITAN_2412}, Table 3",
        note="local batch 2, no compile; torchtitan shards over all 128 GPUs, we price HSDP (8 per node)"),
    PublishedRun(
        "8b-64-torchtitan", "examples/llama.py:llama3_8b", 64, 96, 8192,
        {"name": "torchtitan TP8 FSDP8", "tp": 8, "pp": 1, "dp": 8, "microbatches": 1, "schedule": "1f1b", "shard": "full",
         "recompute": "full"},
        4378.0, "tokens/s/GPU", "bf16", "h100-500w", True, "selective", "held-out", _TITAN_ASYNC,
        note="local batch 12, compile, vanilla TP"),
    PublishedRun(
        "70b-256-torchtitan", "examples/llama.py:llama3_70b", 256, 512, 8192,
        {"name": "torchtitan TP8 FSDP32", "tp": 8, "pp": 1, "dp": 32, "microbatches": 1, "schedule": "1f1b", "shard": "full",
         "recompute": "full"},
        597.3, "tokens/s/GPU", "bf16", "h100-500w", True, "full", "fit", _TITAN_ASYNC,
        note="local batch 16, compile, full AC, vanilla TP"),
    PublishedRun(
        "405b-8k-llama3", "examples/llama.py:llama3_405b", 8192, 2048, 8192,
        {"name": "Llama 3 TP8 PP16 FSDP64", "tp": 8, "pp": 16, "dp": 64, "microbatches": 32,
         "schedule": "interleaved-1f1b", "chunks": 2, "shard": "full", "recompute": "auto"},
        430.0, "TFLOP/s/GPU", "bf16", "h100", True, "auto", "fit", f"{_LLAMA3}, 8,192 GPUs",
        note="32 sequences per replica; the paper's own interleaved schedule priced as interleaved 1F1B, "
             "2 stages per rank; parameters kept gathered from forward to backward, as the paper's FSDP",
        unlimited=True),
    PublishedRun(
        "405b-16k-llama3", "examples/llama.py:llama3_405b", 16384, 2048, 8192,
        {"name": "Llama 3 TP8 PP16 FSDP128", "tp": 8, "pp": 16, "dp": 128, "microbatches": 16,
         "schedule": "interleaved-1f1b", "chunks": 2, "shard": "full", "recompute": "auto"},
        400.0, "TFLOP/s/GPU", "bf16", "h100", True, "auto", "held-out", f"{_LLAMA3}, 16,384 GPUs",
        note="16 sequences per replica: the 8K layout twice as wide", unlimited=True),
    PublishedRun(
        "70b-64-megatron", "examples/llama.py:llama3_70b", 64, 128, 8192,
        {"name": "Megatron-Bridge TP4 PP8 VP5 DP2", "tp": 4, "pp": 8, "dp": 2, "microbatches": 64,
         "schedule": "interleaved-1f1b", "chunks": 5, "shard": "optimizer", "recompute": "auto"},
        1602.0, "tokens/s/GPU", "fp8", "h100", True, "auto", "fp8", _BRIDGE),
    PublishedRun(
        "405b-512-torchtitan", "examples/llama.py:llama3_405b", 512, 256, 8192,
        {"name": "torchtitan TP8 PP8 FSDP8", "tp": 8, "pp": 8, "dp": 8, "microbatches": 32,
         "schedule": "interleaved-1f1b", "chunks": 2, "shard": "full", "recompute": "full"},
        128.0, "tokens/s/GPU", "fp8", "h100-500w", True, "full", "fp8", f"{_TITAN_2412}, Table 5 (Float8 + compile)"),
    PublishedRun(
        "405b-1024-megatron", "examples/llama.py:llama3_405b", 1024, 1024, 4096,
        {"name": "Megatron-Bridge TP8 PP8 VP8 DP8 CP2", "tp": 8, "pp": 8, "dp": 16, "microbatches": 64,
         "schedule": "interleaved-1f1b", "chunks": 8, "shard": "optimizer", "recompute": "auto"},
        292.0, "tokens/s/GPU", "fp8", "h100", True, "auto", "fp8", _BRIDGE,
        note="CP2 priced as DP16 on 4,096-token halves of the published 512 x 8,192"),
)


def run_named(name: str) -> PublishedRun:
    """The run called ``name``.

    >>> run_named("405b-8k-llama3").gpus
    8192
    """
    for run in RUNS:
        if run.name == name:
            return run
    raise KeyError(f"no published run {name!r}; runs: {', '.join(r.name for r in RUNS)}")
