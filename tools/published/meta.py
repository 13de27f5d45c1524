"""Llama 3 on H100s: torchtitan's benchmarks, the Llama 3 paper, Megatron-Bridge (FP8, layouts only).

Sources (checked 2026-12-02; the two compiled torchtitan rows 2026-12-03):

* torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1, 3 and 5) and
  ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``: Grand Teton hosts, H100s with
  96 GB HBM2e at 2.4 TB/s and the default 500 W power limit, 400 Gb/s RDMA per GPU
  (our ``h100-500w``).  torchtitan reports tokens/s per GPU, read at the 90th iteration.
  FSDP2 shards over every data-parallel rank (ZeRO-3 across the replicas).
* Llama 3 paper (Dubey et al. 2024, arXiv:2407.21783), Table 4: 405B on 8,192 and
  16,384 H100s (700 W, 80 GB HBM3: our ``h100``), in TFLOP/s per GPU by a count the paper
  does not give (ours is used).
* Megatron-Bridge performance summary (DGX-H100): FP8 (FP8-CS: current, per-tensor scaling,
  priced as ``tensorwise``), priced at ``--precision fp8``.
* Megatron-Bridge ``docs/performance-summary.md``, 25.11 container (read from the copy in
  github.com/pufanyi/Megatron-Bridge, commit 21a2ced): the dense Llama 3 FP8 rows of DGX-H100,
  DGX-B200 and DGX-GB200 (:data:`BRIDGE_DENSE_FP8`).  Each Blackwell row has two figures:
  FP8-CS (``tensorwise``) and, in parentheses, FP8-MX (``mxfp8``, 32-element blocks), some
  with their own layout (the parenthesised cells).  FSDP 1 is Megatron-FSDP (ZeRO-3 over the
  replicas), FSDP 0 the distributed optimizer (ZeRO-1, assumed: the table does not say);
  recomputation is unpublished (our planner's choice).  Context parallelism CP2 is priced as
  twice the replicas on half-length sequences (the same tokens per step).  A GB200 tray has
  4 GPUs; its NVL72 NVLink domain is priced as up to 64 GPUs (``nvlink_domain``; assumed: a
  job's placement in the rack is not published).

>>> [r.name for r in META if not r.fp8][:2]
['8b-8-torchtitan', '8b-128-torchtitan']
>>> sorted({r.fp8_recipe for r in META + BRIDGE_DENSE_FP8 if r.fp8})
['mxfp8', 'tensorwise']
"""

from __future__ import annotations

from typing import Any

from tools.published._common import layout, llama_shape
from tools.published.run import PublishedRun

__all__ = ["BRIDGE_DENSE_FP8", "META"]

_TITAN_2412 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
_TITAN_ASYNC = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
_LLAMA3 = "Llama 3 paper (arXiv:2407.21783), Table 4"
_BRIDGE = "Megatron-Bridge performance summary (25.11, DGX-H100)"
_BRIDGE_DOC = "Megatron-Bridge docs/performance-summary.md, 25.11 container"
_TOK = "tokens per second per GPU as torchtitan logs it (read at the 90th iteration)"
_OURS = "TFLOP/s per GPU as the paper counts them (count not published: our counter's model FLOPs)"
_SAC = 0.5  # torchtitan's per-op SAC recomputes about half of the forward (tools/calibrate_published.py)


def _fsdp(dp: int, recompute: str = "full") -> dict[str, Any]:
    # torchtitan reshards after forward without pipeline stages (fsdp_reshard_after_forward "default"): ZeRO-3.
    return {"name": f"torchtitan FSDP{dp}", "tp": 1, "pp": 1, "dp": dp, "microbatches": 1, "schedule": "1f1b",
            "shard": "zero3", "recompute": recompute}


def _titan(name: str, size: str, gpus: int, batch: int, lay: dict[str, Any], figure: float, *, compiled: bool,
           checkpointing: str, role: str, source: str, note: str, precision: str = "bf16", seq: int = 8192,
           micro_batch: int = 1, group: str = "") -> PublishedRun:
    return PublishedRun(
        name, f"examples/llama.py:llama3_{size}", gpus, batch, seq, lay, figure, "tokens/s/GPU", precision,
        "h100-500w", compiled, checkpointing, role, source, note=note,
        shape=llama_shape(size, seq), micro_batch=micro_batch, counts="tokens", counting=_TOK,
        framework="torchtitan", zero_stage=3, zero_ranks=lay["dp"], group=group,
        selective_share=_SAC if checkpointing == "selective" else 0.0,
        fp8_recipe="tensorwise" if precision == "fp8" else "")  # torchao's default Float8 recipe


META: tuple[PublishedRun, ...] = (
    _titan("8b-8-torchtitan", "8b", 8, 16, _fsdp(8), 5762.0, compiled=False, checkpointing="selective", role="fit",
           source=f"{_TITAN_2412}, Table 1", note="local batch 2, no compile", micro_batch=2),
    _titan("8b-128-torchtitan", "8b", 128, 256, _fsdp(128), 5605.0, compiled=False, checkpointing="selective",
           role="held-out", source=f"{_TITAN_2412}, Table 3", micro_batch=2,
           note="local batch 2, no compile; torchtitan shards over all 128 GPUs, we price HSDP (8 per node)"),
    _titan("8b-64-torchtitan", "8b", 64, 96,
           {"name": "torchtitan TP8 FSDP8", "tp": 8, "pp": 1, "dp": 8, "microbatches": 1, "schedule": "1f1b",
            "shard": "zero3", "recompute": "full"},
           4378.0, compiled=True, checkpointing="selective", role="held-out", source=_TITAN_ASYNC,
           note="local batch 12, compile, vanilla TP", micro_batch=12),
    _titan("70b-256-torchtitan", "70b", 256, 512,
           {"name": "torchtitan TP8 FSDP32", "tp": 8, "pp": 1, "dp": 32, "microbatches": 1, "schedule": "1f1b",
            "shard": "zero3", "recompute": "full"},
           597.3, compiled=True, checkpointing="full", role="fit", source=_TITAN_ASYNC,
           note="local batch 16, compile, full AC, vanilla TP", micro_batch=16),
    PublishedRun(
        "405b-8k-llama3", "examples/llama.py:llama3_405b", 8192, 2048, 8192,
        {"name": "Llama 3 TP8 PP16 FSDP64", "tp": 8, "pp": 16, "dp": 64, "microbatches": 32,
         "schedule": "interleaved-1f1b", "chunks": 2, "shard": "full", "recompute": "auto"},
        430.0, "TFLOP/s/GPU", "bf16", "h100", True, "auto", "fit", f"{_LLAMA3}, 8,192 GPUs",
        note="32 sequences per replica; the paper's own interleaved schedule priced as interleaved 1F1B, "
             "2 stages per rank; parameters kept gathered from forward to backward, as the paper's FSDP",
        unlimited=True, shape=llama_shape("405b", 8192), micro_batch=1, counts="ours", counting=_OURS,
        framework="Meta's Llama 3 stack", zero_stage=3, zero_ranks=64,
        assumed="2 stages per rank (the paper's schedule tunes its own); recomputation unpublished"),
    PublishedRun(
        "405b-16k-llama3", "examples/llama.py:llama3_405b", 16384, 2048, 8192,
        {"name": "Llama 3 TP8 PP16 FSDP128", "tp": 8, "pp": 16, "dp": 128, "microbatches": 16,
         "schedule": "interleaved-1f1b", "chunks": 2, "shard": "full", "recompute": "auto"},
        400.0, "TFLOP/s/GPU", "bf16", "h100", True, "auto", "held-out", f"{_LLAMA3}, 16,384 GPUs",
        note="16 sequences per replica: the 8K layout twice as wide, parameters kept gathered as there",
        unlimited=True,
        shape=llama_shape("405b", 8192), micro_batch=1, counts="ours", counting=_OURS,
        framework="Meta's Llama 3 stack", zero_stage=3, zero_ranks=128,
        assumed="2 stages per rank (the paper's schedule tunes its own); recomputation unpublished"),
    PublishedRun(
        "70b-64-megatron", "examples/llama.py:llama3_70b", 64, 128, 8192,
        {"name": "Megatron-Bridge TP4 PP8 VP5 DP2", "tp": 4, "pp": 8, "dp": 2, "microbatches": 64,
         "schedule": "interleaved-1f1b", "chunks": 5, "shard": "optimizer", "recompute": "auto"},
        1602.0, "tokens/s/GPU", "fp8", "h100", True, "auto", "held-out", _BRIDGE,
        shape=llama_shape("70b", 8192), micro_batch=1, counts="tokens", counting=_TOK.replace("torchtitan", "NeMo"),
        framework="Megatron-Bridge", zero_stage=1, zero_ranks=2, fp8_recipe="tensorwise"),
    _titan("405b-512-torchtitan", "405b", 512, 256,
           {"name": "torchtitan TP8 PP8 FSDP8", "tp": 8, "pp": 8, "dp": 8, "microbatches": 32,
            "schedule": "interleaved-1f1b", "chunks": 2, "shard": "full", "recompute": "full"},
           128.0, compiled=True, checkpointing="full", role="held-out", precision="fp8",
           source=f"{_TITAN_2412}, Table 5 (Float8 + compile)", group="torchtitan-405b-512-schedule",
           note="with pipeline stages torchtitan keeps parameters gathered from forward to backward"),
    PublishedRun(
        "405b-1024-megatron", "examples/llama.py:llama3_405b", 1024, 1024, 4096,
        {"name": "Megatron-Bridge TP8 PP8 VP8 DP8 CP2", "tp": 8, "pp": 8, "dp": 16, "microbatches": 64,
         "schedule": "interleaved-1f1b", "chunks": 8, "shard": "optimizer", "recompute": "auto"},
        292.0, "tokens/s/GPU", "fp8", "h100", True, "auto", "held-out", _BRIDGE,
        note="CP2 priced as DP16 on 4,096-token halves of the published 512 x 8,192",
        shape=llama_shape("405b", 4096), micro_batch=1, counts="tokens", counting=_TOK.replace("torchtitan", "NeMo"),
        framework="Megatron-Bridge", zero_stage=1, zero_ranks=16, fp8_recipe="tensorwise"),
    # Added 2026-12-03.
    _titan("8b-8-torchtitan-compile", "8b", 8, 16, _fsdp(8), 6667.0, compiled=True, checkpointing="selective",
           role="held-out", source=f"{_TITAN_2412}, Table 1", note="local batch 2, torch.compile", micro_batch=2),
    _titan("8b-128-torchtitan-compile", "8b", 128, 256, _fsdp(128), 6514.0, compiled=True, checkpointing="selective",
           role="held-out", source=f"{_TITAN_2412}, Table 3", note="local batch 2, torch.compile", micro_batch=2),
    _titan("405b-512-torchtitan-1f1b", "405b", 512, 256,
           {**layout("torchtitan TP8 PP8 FSDP8 1F1B", tp=8, pp=8, dp=8, microbatches=32, zero=3), "shard": "full"},
           100.0, compiled=True, checkpointing="full", role="held-out", precision="fp8",
           source=f"{_TITAN_2412}, Table 5 (Float8 + compile + AsyncTP)", note="1F1B against interleaved 1F1B; with pipeline stages torchtitan keeps parameters gathered",
           group="torchtitan-405b-512-schedule"),
    # Added 2026-12-05: the rest of the page's Float8 rows (torchao Float8 tensorwise, torch.compile).
    _titan("8b-8-torchtitan-float8", "8b", 8, 16, _fsdp(8), 8532.0, compiled=True, checkpointing="selective",
           role="held-out", precision="fp8", source=f"{_TITAN_2412}, Table 1 (FSDP + torch.compile + Float8)",
           note="local batch 2", micro_batch=2),
    _titan("8b-128-torchtitan-float8", "8b", 128, 256, _fsdp(128), 8380.0, compiled=True,
           checkpointing="selective", role="held-out", precision="fp8",
           source=f"{_TITAN_2412}, Table 3 (FSDP + torch.compile + Float8)", note="local batch 2", micro_batch=2),
    _titan("70b-256-torchtitan-float8", "70b", 256, 512,
           {"name": "torchtitan TP8 FSDP32", "tp": 8, "pp": 1, "dp": 32, "microbatches": 1, "schedule": "1f1b",
            "shard": "zero3", "recompute": "full"},
           829.0, compiled=True, checkpointing="full", role="held-out", precision="fp8",
           source=f"{_TITAN_2412}, Table 4 (2D + torch.compile + Float8)", note="local batch 16, vanilla TP",
           micro_batch=16),
    _titan("405b-512-torchtitan-32k", "405b", 512, 64,
           {**layout("torchtitan TP8 PP8 FSDP8 1F1B, 32K", tp=8, pp=8, dp=8, microbatches=8, zero=3),
            "shard": "full"},
           76.0, compiled=True, checkpointing="full", role="held-out", precision="fp8", seq=32768,
           source=f"{_TITAN_2412}, Table 6, CP 1 (Float8 + compile + AsyncTP + 1F1B)",
           note="local batch 8 of 32,768 tokens; with pipeline stages torchtitan keeps parameters gathered"),
)


def _bridge(name: str, size: str, device: str, gpus: int, *, gbs: int, mbs: int, tp: int, pp: int, vp: int,
            cp: int, fsdp: bool, figure: float, recipe: str, role: str = "held-out", note: str = "",
            assumed: str = "") -> PublishedRun:
    # CP folded into DP: cp times the replicas on 1/cp of each sequence (the tokens per step unchanged).
    dp = gpus // (tp * pp * cp)
    replicas, seq = dp * cp, 8192 // cp
    batch = gbs * cp
    assert batch % (replicas * mbs) == 0, name
    lay = layout(f"Megatron-Bridge TP{tp} PP{pp} VP{vp} CP{cp} {'FSDP' if fsdp else 'DP'}{dp}", tp=tp, pp=pp,
                 dp=replicas, microbatches=batch // (replicas * mbs), schedule="interleaved-1f1b" if vp > 1 else "1f1b",
                 chunks=vp if vp > 1 else None, zero=3 if fsdp else 1, recompute="auto")
    gb200 = device == "gb200"
    return PublishedRun(
        name, f"examples/llama.py:llama3_{size}", gpus, batch, seq, lay, figure, "tokens/s/GPU", "fp8", device, True,
        "auto", role, f"{_BRIDGE_DOC}, DGX-{device.upper()}", note=note, shape=llama_shape(size, seq),
        micro_batch=mbs, counts="tokens", counting=_TOK.replace("torchtitan", "Megatron-Bridge"),
        framework="Megatron-Bridge", zero_stage=3 if fsdp else 1, zero_ranks=replicas, sequence_parallel=tp > 1,
        gpus_per_node=4 if gb200 else 8, nvlink_domain=min(64, gpus) if gb200 else None, fp8_recipe=recipe,
        assumed="; ".join(a for a in (
            f"CP{cp} priced as DP{replicas} on {seq:,}-token halves" if cp > 1 else "",
            "" if fsdp else "distributed optimizer (ZeRO-1)", "recomputation unpublished",
            f"one {min(64, gpus)}-GPU NVLink domain (NVL72)" if gb200 else "", assumed) if a))


# FP8-CS (tensorwise) and FP8-MX (mxfp8) figures of each Blackwell row; "fit" runs: at most a third of Blackwell's.
BRIDGE_DENSE_FP8: tuple[PublishedRun, ...] = (
    _bridge("8b-8-bridge-h100-fp8cs", "8b", "h100", 8, gbs=128, mbs=1, tp=1, pp=1, vp=1, cp=1, fsdp=True,
            figure=14451.0, recipe="tensorwise"),
    _bridge("8b-8-bridge-gb200-fp8cs", "8b", "gb200", 8, gbs=128, mbs=2, tp=1, pp=1, vp=1, cp=1, fsdp=False,
            figure=31508.0, recipe="tensorwise", role="fit"),
    _bridge("8b-8-bridge-gb200-mxfp8", "8b", "gb200", 8, gbs=128, mbs=2, tp=1, pp=1, vp=1, cp=1, fsdp=False,
            figure=29789.0, recipe="mxfp8"),
    _bridge("70b-64-bridge-gb200-fp8cs", "70b", "gb200", 64, gbs=128, mbs=2, tp=1, pp=1, vp=1, cp=1, fsdp=True,
            figure=4312.0, recipe="tensorwise"),
    _bridge("70b-64-bridge-gb200-mxfp8", "70b", "gb200", 64, gbs=128, mbs=2, tp=2, pp=4, vp=5, cp=1, fsdp=False,
            figure=3617.0, recipe="mxfp8", role="fit",
            note="the table's GA 16 does not match DP8 x MBS2 (GBS 128 needs 8): priced at 8",
            assumed="8 micro-batches per replica (the published GA 16 is inconsistent with GBS and MBS)"),
    _bridge("405b-128-bridge-gb200-fp8cs", "405b", "gb200", 128, gbs=64, mbs=1, tp=2, pp=1, vp=1, cp=1, fsdp=True,
            figure=706.0, recipe="tensorwise"),
    _bridge("405b-128-bridge-gb200-mxfp8", "405b", "gb200", 128, gbs=64, mbs=1, tp=4, pp=8, vp=8, cp=2, fsdp=False,
            figure=563.0, recipe="mxfp8"),
    _bridge("8b-8-bridge-b200-fp8cs", "8b", "b200", 8, gbs=128, mbs=2, tp=1, pp=1, vp=1, cp=1, fsdp=False,
            figure=30624.0, recipe="tensorwise"),
    _bridge("8b-8-bridge-b200-mxfp8", "8b", "b200", 8, gbs=128, mbs=2, tp=1, pp=1, vp=1, cp=1, fsdp=False,
            figure=29521.0, recipe="mxfp8"),
    _bridge("405b-128-bridge-b200-fp8cs", "405b", "b200", 128, gbs=64, mbs=1, tp=4, pp=8, vp=8, cp=2, fsdp=False,
            figure=661.0, recipe="tensorwise", role="fit"),
    _bridge("405b-128-bridge-b200-mxfp8", "405b", "b200", 128, gbs=64, mbs=1, tp=4, pp=8, vp=8, cp=2, fsdp=False,
            figure=624.0, recipe="mxfp8"),
)
