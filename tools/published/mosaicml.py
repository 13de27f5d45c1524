"""MPT training throughput with PyTorch FSDP over every GPU (MosaicML llm-foundry, Composer).

Source: mosaicml/llm-foundry ``scripts/train/benchmarking/README.md`` (commit 8c8dd48,
checked 2026-12-03), tables "H100 80GB BF16 (Large Scale, >= 128 GPUs)", "H100 80GB BF16",
"A100 80GB with 1600 Gbps node-node interconnect (RoCE)" and "A100 40GB with 1600 Gbps
node-node interconnect (RoCE)".  Each row: model, sequence, GPUs, micro-batch, gradient
accumulation, global batch, throughput (tokens/s per GPU, the figure used here), FSDP
sharding strategy (FULL_SHARD: ZeRO-3 over every GPU, tp = pp = 1; SHARD_GRAD_OP: ZeRO-2),
activation checkpointing (full, per block) and the mixed-precision mode (``DEFAULT``:
amp_bf16; ``PURE``: bf16 parameters, gradients and buffers).  The models
(``scripts/train/yamls/pretrain/mpt-*.yaml``): MPT with learned positions as long as the
sequence, flash attention, vocabulary 50,368; the table's NumParams match
``tools/published_models.py`` exactly.  The same README's MFU (``(6N + 12 l d s)`` per token
over 312 or 989 TFLOP/s) is noted, not used.

1600 Gb/s RoCE per 8-GPU node is 25 GB/s per GPU (our ``a100`` and ``a100-40gb``); the H100
tables do not state the network (``h100``: 400 Gb/s per GPU assumed).
"""

from __future__ import annotations

from tools.published._common import gpt_shape, layout
from tools.published.run import PublishedRun

__all__ = ["MOSAICML"]

_SRC = "llm-foundry scripts/train/benchmarking/README.md"
_TOK = "tokens per second per GPU (the table's Throughput (T/s/GPU)), steady state over a 12-step run"
_TABLES = {"h100-large": "H100 80GB BF16 (Large Scale)", "h100": "H100 80GB BF16",
           "a100": "A100 80GB (RoCE)", "a100-40gb": "A100 40GB (RoCE)"}


def _run(size: str, *, table: str, seq: int, gpus: int, mbs: int, accum: int, tokens: float, ac: bool,
         mfu: float, zero: int = 3, pure: bool = False, role: str = "held-out") -> PublishedRun:
    device = "h100" if table.startswith("h100") else table
    model = f"mpt_{size}" + (f"_s{seq}" if seq != 2048 else "")
    shard = "FULL_SHARD" if zero == 3 else "SHARD_GRAD_OP"
    return PublishedRun(
        f"mosaicml-{size}-{seq}-{gpus}-{device}", f"tools/published_models.py:{model}", gpus, gpus * mbs * accum, seq,
        layout(f"FSDP {shard} DP{gpus}", tp=1, pp=1, dp=gpus, microbatches=accum, zero=zero,
               recompute="full" if ac else "none"),
        tokens, "tokens/s/GPU", "bf16", device, False, "full" if ac else "none", role,
        f"{_SRC}, {_TABLES[table]}", shape=gpt_shape(f"mpt_{size}", seq), micro_batch=mbs, counts="tokens",
        counting=_TOK, framework="llm-foundry / Composer FSDP (torch 2.1)", zero_stage=zero, zero_ranks=gpus,
        note=f"{'PURE' if pure else 'DEFAULT (amp_bf16)'} mixed precision; {shard} over all {gpus} GPUs; "
             f"the table's MFU {mfu}%")


MOSAICML: tuple[PublishedRun, ...] = (
    _run("70b", table="h100-large", seq=2048, gpus=512, mbs=8, accum=1, tokens=1007, ac=True, mfu=41.25, role="fit"),
    _run("70b", table="h100-large", seq=2048, gpus=128, mbs=8, accum=1, tokens=1058, ac=True, mfu=43.36),
    _run("13b", table="h100-large", seq=2048, gpus=512, mbs=16, accum=1, tokens=4952, ac=True, mfu=41.12),
    _run("7b", table="h100-large", seq=2048, gpus=128, mbs=6, accum=1, tokens=10475, ac=False, mfu=45.71),
    _run("3b", table="h100-large", seq=2048, gpus=512, mbs=8, accum=1, tokens=21664, ac=False, mfu=39.24, zero=2),
    _run("70b", table="h100", seq=2048, gpus=64, mbs=8, accum=4, tokens=1039, ac=True, mfu=42.57),
    _run("30b", table="h100", seq=2048, gpus=8, mbs=3, accum=21, tokens=2002, ac=True, mfu=38.11),
    _run("7b", table="h100", seq=2048, gpus=8, mbs=6, accum=1, tokens=10643, ac=False, mfu=46.44, role="fit"),
    _run("7b", table="h100", seq=8192, gpus=8, mbs=8, accum=2, tokens=6935, ac=True, mfu=37.14),
    _run("13b", table="h100", seq=2048, gpus=8, mbs=2, accum=1, tokens=4792, ac=False, mfu=39.79),
    _run("70b", table="a100", seq=2048, gpus=64, mbs=8, accum=4, tokens=410, ac=True, mfu=53.33, pure=True,
         role="fit"),
    _run("30b", table="a100", seq=2048, gpus=8, mbs=3, accum=21, tokens=916, ac=True, mfu=55.3),
    _run("7b", table="a100", seq=2048, gpus=8, mbs=6, accum=2, tokens=4641, ac=False, mfu=64.23, role="fit"),
    _run("13b", table="a100", seq=8192, gpus=8, mbs=5, accum=3, tokens=1795, ac=True, mfu=56.07),
    _run("70b", table="a100-40gb", seq=2048, gpus=128, mbs=4, accum=1, tokens=376, ac=True, mfu=48.91, pure=True),
    _run("13b", table="a100-40gb", seq=2048, gpus=64, mbs=16, accum=1, tokens=1976, ac=True, mfu=52.04, pure=True,
         role="fit"),
    _run("7b", table="a100-40gb", seq=2048, gpus=128, mbs=18, accum=1, tokens=3623, ac=True, mfu=50.14, pure=True),
    _run("3b", table="a100-40gb", seq=2048, gpus=128, mbs=6, accum=1, tokens=9538, ac=False, mfu=54.8, pure=True),
)
