"""Mixture-of-experts runs: Megatron-MoE-ModelZoo (Qwen3-235B), Megatron-Bridge (GPT-OSS; FP8), DeepSeek-V3.

Sources (read 2026-12-05):

* Megatron-MoE-ModelZoo (github.com/yanring/Megatron-MoE-ModelZoo,
  ``best_practice/Qwen3/readme.md``, commit c1ad0b5): Qwen3-235B-A22B on 256 H100s (NVLink 4,
  InfiniBand 8 x 50 GB/s per node), BF16, sequence 4,096, global batch 2,048, five layouts,
  each with its "Step time (sec)" (``counts="seconds"``: the step itself, no FLOP count).
  The model config (``model_configs/benchmarking/Qwen3-235B-A22B.yaml``) runs Megatron's
  distributed optimizer (ZeRO-1 over the data-parallel ranks), sequence parallelism and
  expert tensor parallelism 1.  The readme's Qwen3-Next-80B-A3B row has no model file here.
* Megatron-Bridge ``docs/performance-summary.md`` (NeMo 25.11 container tables; read from the
  copy in github.com/pufanyi/Megatron-Bridge, commit 21a2ced): tokens/s per GPU.  GPT OSS 120B
  is its only BF16 mixture-of-experts row (DGX-H100, DGX-B200, DGX-GB200; 64 GPUs each): held
  out.  DeepSeekV3 and Qwen3 rows are FP8 (``unpriced``: listed, not priced, as long as bf16
  mixture-of-experts pricing is about 2x off).  The summary notes
  that its MoE benchmarks force-balance the tokens over the experts (dropless).  DGX-GB300 rows
  are left out (no ``gb300`` device).
* DeepSeek-V3 Technical Report (DeepSeek-AI 2024, arXiv:2412.19437): 2,048 H800s, PP16,
  EP64 over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism, DualPipe, sequence
  4,096, batch 15,360 (after the ramp), FP8; "180K H800 GPU hours" per trillion tokens
  (section 1) is ``1e12 / (180e3 x 3600)`` = 1,543 tokens/s per GPU.

How Megatron's expert parallelism maps to ours: Megatron folds EP over TP x CP x DP
(``EP x ETP x EDP = TP x CP x DP``, here ETP 1), so its EP may exceed DP; our ``ep`` groups
whole data-parallel replicas (each a tensor-parallel group) and must divide ``dp``.

* The ModelZoo rows (all TP2 or TP4) are priced with TP folded into DP: the planner refuses
  ``--tp > 1`` for ``Qwen3MoeForCausalLM`` ("no column/row pair of linear layers": its
  per-head q/k norms and its experts, which are not ``nn.Linear``, leave no pair to split).
  So ``tp x dp`` one-GPU replicas, ``tp`` times fewer micro-batches each (the batch and each
  GPU's tokens per step unchanged), and EP exactly as published, which then divides the
  replicas and spans the same GPUs as Megatron's (ETP 1).  What this leaves out: tensor
  parallelism's all-reduces and its smaller GEMMs (optimistic), the attention weights not
  divided by TP (more memory), and twice the pipeline bubble (fewer micro-batches).  Flagged
  in ``assumed``.
* The other rows keep the published TP; where EP > DP they are priced at the largest divisor
  of ``dp`` that divides the experts, flagged in ``assumed`` ("EP folded over TP"); only FP8
  rows (not priced) need it.

The cost model prices the default all-to-all dispatcher, not overlapped with compute, with a
busiest expert 1.25 x the mean: DeepEP and Megatron's 1F1B all-to-all overlap are noted, not
priced.

``ModelShape.ffn`` of a mixture-of-experts run is one routed expert's width.

>>> len(MOE), sorted({r.role for r in MOE})
(17, ['held-out'])
>>> sum(bool(r.unpriced) for r in MOE)
9
>>> [(r.layout["dp"], r.layout["ep"]) for r in MOE if r.group == "modelzoo-qwen3-235b-256"]
[(32, 32), (32, 32), (256, 8), (8, 8), (32, 8)]
"""

from __future__ import annotations

from tools.published._common import layout
from tools.published.run import ModelShape, PublishedRun

__all__ = ["DEEPSEEK_V3", "MEGATRON_BRIDGE_MOE", "MOE", "MOE_MODELZOO", "fold_ep"]

_ZOO = "Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (c1ad0b5)"
_BRIDGE = "Megatron-Bridge docs/performance-summary.md, 25.11 container"
_DSV3 = "DeepSeek-V3 Technical Report (arXiv:2412.19437), sections 1 and 3.2"
_SECONDS = "seconds per iteration as the readme's 'Step time (sec)' column prints it (global batch 2,048 x 4,096)"
_TOK = "tokens per second per GPU as Megatron-Bridge logs it (global batch x sequence / step / GPUs)"
_DSV3_COUNT = ("tokens per second per GPU implied by '180K H800 GPU hours' per trillion training tokens: "
               "1e12 / (180e3 x 3600)")
# Megatron's selective recomputation of the norms and the MoE activation ("norm, act"): elementwise ops, a few
# percent of the forward's time (assumed; their FLOPs are nearly none).
_NORM_ACT = 0.05

_QWEN3_235B = ModelShape(layers=94, hidden=4096, heads=64, kv_heads=4, ffn=1536, vocab=151936, seq=4096)
_QWEN3_30B = ModelShape(layers=48, hidden=2048, heads=32, kv_heads=4, ffn=768, vocab=151936, seq=4096)
_GPT_OSS = ModelShape(layers=36, hidden=2880, heads=64, kv_heads=8, ffn=2880, vocab=201088, seq=4096)
_DEEPSEEK_V3 = ModelShape(layers=61, hidden=7168, heads=128, kv_heads=128, ffn=2048, vocab=129280, seq=4096)
# Why the FP8 mixture-of-experts rows are listed, not priced: the bf16 ones land 2x off (GPT OSS, Qwen3: the
# all-to-all and the expert GEMMs; docs/accuracy.md), so their FP8 errors would say nothing about FP8.
_MOE_FP8 = "FP8 MoE: listed, not priced (bf16 MoE pricing is still about 2x off)"
_EXPERTS = {"qwen3": 128, "gpt-oss": 128, "deepseek-v3": 256}


def fold_ep(ep: int, dp: int, experts: int) -> int:
    """Our expert-parallel degree for Megatron's ``ep``: itself where it divides ``dp``, else the largest that does.

    The largest divisor of ``dp`` that also divides ``experts`` and ``ep``.

    >>> fold_ep(8, 128, 128), fold_ep(32, 16, 128), fold_ep(8, 4, 128), fold_ep(64, 32, 128)
    (8, 16, 4, 32)
    """
    return max(e for e in range(1, min(ep, dp) + 1) if dp % e == 0 and experts % e == 0 and ep % e == 0)


def _folded(ep: int, dp: int, family: str) -> tuple[int, str]:
    ours = fold_ep(ep, dp, _EXPERTS[family])
    if ours == ep:
        return ours, ""
    return ours, f"EP folded over TP: EP{ep} > DP{dp}, priced as EP {ours} over DP"


def _zoo(name: str, *, tp: int, pp: int, vpp: int, dp: int, ep: int, mbs: int, ga: int, recompute: str,
         step: float, note: str, fsdp: bool = False) -> PublishedRun:
    # The planner refuses --tp > 1 for Qwen3MoeForCausalLM ("no column/row pair of linear layers"), so TP is
    # folded into DP: tp x dp replicas of one GPU, tp times fewer micro-batches each (the batch and each GPU's
    # tokens per step unchanged), and Megatron's EP (over TP x DP, ETP 1) kept as published.
    replicas, microbatches = tp * dp, ga // tp
    assert ga % tp == 0 and replicas % ep == 0, name
    checkpointing = {"norm, act": "selective", "full": "full", "": "none"}[recompute]
    schedule = "interleaved-1f1b" if vpp > 1 else "1f1b"
    lay = layout(f"ModelZoo TP{tp} PP{pp} VPP{vpp} DP{dp} EP{ep}", tp=1, pp=pp, dp=replicas,
                 microbatches=microbatches, schedule=schedule, chunks=vpp if vpp > 1 else None,
                 zero=3 if fsdp else 1, recompute="full" if checkpointing == "selective" else checkpointing, ep=ep)
    folded = (f"TP{tp} folded into DP: priced as TP1 DP{replicas} x {microbatches} micro-batches, EP{ep} as "
              "published (the planner finds no tensor-parallel split of Qwen3-MoE)")
    return PublishedRun(
        name, "examples/moe.py:qwen3_235b_a22b", 256, 2048, 4096, lay, step, "s/iteration", "bf16", "h100", True,
        checkpointing, "held-out", f"{_ZOO}, TP{tp} PP{pp} EP{ep} row", note=note, shape=_QWEN3_235B,
        micro_batch=mbs, counts="seconds", counting=_SECONDS, framework="Megatron-LM (Megatron-Core MoE)",
        zero_stage=3 if fsdp else 1, zero_ranks=replicas, sequence_parallel=tp > 1,
        group="modelzoo-qwen3-235b-256", selective_share=_NORM_ACT if checkpointing == "selective" else 0.0,
        assumed="; ".join(a for a in (folded, "norm + activation recomputation priced as 5% of full"
                                      if checkpointing == "selective" else "") if a))


MOE_MODELZOO: tuple[PublishedRun, ...] = (
    _zoo("qwen3-235b-256-zoo-ep32-deepep", tp=2, pp=8, vpp=4, dp=16, ep=32, mbs=1, ga=128, recompute="norm, act",
         step=19.7, note="cross-node EP32, DeepEP dispatcher (priced as the plain all-to-all), 245 TFLOP/s/GPU"),
    _zoo("qwen3-235b-256-zoo-ep32-overlap", tp=2, pp=8, vpp=4, dp=16, ep=32, mbs=1, ga=128, recompute="norm, act",
         step=17.6, note="the row above with 1F1B all-to-all overlap (not priced: our all-to-alls never overlap), "
                         "DeepEP, 276 TFLOP/s/GPU"),
    _zoo("qwen3-235b-256-zoo-ep8-fsdp", tp=2, pp=1, vpp=1, dp=128, ep=8, mbs=4, ga=4, recompute="full", step=17.6,
         fsdp=True, note="intra-node EP8, Megatron-FSDP over the 128 replicas (ZeRO-3), DeepEP, 'disable log "
                         "para norm', 276 TFLOP/s/GPU"),
    _zoo("qwen3-235b-256-zoo-ep8-pp32-a2a", tp=2, pp=32, vpp=3, dp=4, ep=8, mbs=1, ga=512, recompute="norm, act",
         step=24.2, note="intra-node EP8, all-to-all dispatcher, 94 layers over 96 virtual stages, 200 TFLOP/s/GPU"),
    _zoo("qwen3-235b-256-zoo-tp4-ep8", tp=4, pp=8, vpp=4, dp=8, ep=8, mbs=1, ga=256, recompute="", step=29.0,
         note="EP8 (x EDP4 over TP4 x DP8), DeepEP, no recomputation, 167 TFLOP/s/GPU"),
)


def _bridge(name: str, spec: str, shape: ModelShape, family: str, device: str, gpus: int, *, gbs: int, mbs: int,
            tp: int, pp: int, vp: int, ep: int, figure: float, precision: str, note: str = "",
            assumed: str = "", gpus_per_node: int = 8, nvlink_domain: int | None = None) -> PublishedRun:
    dp = gpus // (tp * pp)
    ours, folded = _folded(ep, dp, family)
    lay = layout(f"Megatron-Bridge TP{tp} PP{pp} VP{vp} EP{ep}", tp=tp, pp=pp, dp=dp, microbatches=gbs // (dp * mbs),
                 schedule="interleaved-1f1b" if vp > 1 else "1f1b", chunks=vp if vp > 1 else None, zero=1,
                 recompute="auto", ep=ours)
    return PublishedRun(
        name, spec, gpus, gbs, 4096, lay, figure, "tokens/s/GPU", precision, device, True, "auto",
        "held-out", f"{_BRIDGE}, DGX-{device.upper()}", note=note, shape=shape,
        micro_batch=mbs, counts="tokens", counting=_TOK, framework="Megatron-Bridge", zero_stage=1, zero_ranks=dp,
        sequence_parallel=tp > 1, gpus_per_node=gpus_per_node, nvlink_domain=nvlink_domain,
        fp8_recipe=("mxfp8" if device in ("b200", "gb200") else "tensorwise") if precision == "fp8" else "",
        unpriced=_MOE_FP8 if precision == "fp8" else "",
        assumed="; ".join(a for a in (folded, "distributed optimizer (ZeRO-1) and recomputation unpublished",
                                      assumed) if a))


_OSS = ("examples/moe.py:gpt_oss_120b", _GPT_OSS, "gpt-oss")
_Q30 = ("examples/moe.py:qwen3_30b_a3b", _QWEN3_30B, "qwen3")
_Q235 = ("examples/moe.py:qwen3_235b_a22b", _QWEN3_235B, "qwen3")
_DS = ("examples/deepseek_v3.py:deepseek_v3_671b", _DEEPSEEK_V3, "deepseek-v3")

MEGATRON_BRIDGE_MOE: tuple[PublishedRun, ...] = (
    _bridge("gpt-oss-120b-64-bridge-h100", *_OSS, "h100", 64, gbs=512, mbs=4, tp=1, pp=4, vp=1, ep=8, figure=5630.0,
            precision="bf16", note="the table's GA 2 does not match PP4 (DP16 x MBS4 x 8 = GBS 512): priced at 8",
            assumed="8 micro-batches per replica (the published GA 2 is inconsistent with GBS, MBS and PP)"),
    _bridge("gpt-oss-120b-64-bridge-b200", *_OSS, "b200", 64, gbs=512, mbs=4, tp=1, pp=1, vp=1, ep=8, figure=8213.0,
            precision="bf16", note="B200 uncalibrated: the bare datasheet roofline"),
    _bridge("gpt-oss-120b-64-bridge-gb200", *_OSS, "gb200", 64, gbs=512, mbs=4, tp=1, pp=1, vp=1, ep=64,
            figure=15754.0, precision="bf16", gpus_per_node=4, nvlink_domain=64,
            note="GB200 uncalibrated; the 64 GPUs priced as one NVLink domain (one NVL72 rack)",
            assumed="all 64 GPUs in one NVL72 NVLink domain"),
    _bridge("deepseek-v3-256-bridge-gb200-fp8", *_DS, "gb200", 256, gbs=2048, mbs=1, tp=1, pp=4, vp=4, ep=64,
            figure=3653.0, precision="fp8", note="FP8-MX; the table's GA cell reads '32 64': 32 matches GBS",
            assumed="32 micro-batches"),
    _bridge("deepseek-v3-256-bridge-b200-fp8", *_DS, "b200", 256, gbs=2048, mbs=1, tp=1, pp=16, vp=1, ep=8,
            figure=2139.0, precision="fp8", note="FP8-MX"),
    _bridge("qwen3-30b-8-bridge-gb200-fp8", *_Q30, "gb200", 8, gbs=512, mbs=4, tp=1, pp=1, vp=1, ep=8,
            figure=23766.0, precision="fp8", note="FP8-MX"),
    _bridge("qwen3-30b-8-bridge-b200-fp8", *_Q30, "b200", 8, gbs=512, mbs=1, tp=1, pp=1, vp=1, ep=8,
            figure=9299.0, precision="fp8", note="FP8-MX"),
    _bridge("qwen3-30b-16-bridge-h100-fp8", *_Q30, "h100", 16, gbs=512, mbs=2, tp=1, pp=2, vp=24, ep=8,
            figure=5275.0, precision="fp8", note="FP8-CS"),
    _bridge("qwen3-235b-64-bridge-gb200-fp8", *_Q235, "gb200", 64, gbs=1024, mbs=1, tp=2, pp=1, vp=1, ep=64,
            figure=4366.0, precision="fp8", note="FP8-MX"),
    _bridge("qwen3-235b-64-bridge-b200-fp8", *_Q235, "b200", 64, gbs=1024, mbs=1, tp=1, pp=8, vp=2, ep=8,
            figure=3269.0, precision="fp8", note="FP8-MX"),
    _bridge("qwen3-235b-256-bridge-h100-fp8", *_Q235, "h100", 256, gbs=2048, mbs=1, tp=2, pp=8, vp=4, ep=32,
            figure=1575.0, precision="fp8",
            note="FP8-CS; the 25.11 row lacks its GBS cell (its cells are shifted): GBS 2,048 as the 25.09 row",
            assumed="global batch 2,048 (the row's GBS cell is missing)"),
)

DEEPSEEK_V3: tuple[PublishedRun, ...] = (
    PublishedRun(
        "deepseek-v3-2048-h800-fp8", "examples/deepseek_v3.py:deepseek_v3_671b", 2048, 15360, 4096,
        layout("DeepSeek-V3 PP16 EP64 DP128 (DualPipe)", tp=1, pp=16, dp=128, microbatches=120, zero=1,
               recompute="auto", ep=64),
        1e12 / (180e3 * 3600), "tokens/s/GPU", "fp8", "h800", True, "selective", "held-out", _DSV3,
        note="FP8 mixed precision, DualPipe (listed as 1F1B), EP64 over 8 nodes; recomputes RMSNorm and the MLA "
             "up-projections (section 3.3.3)",
        shape=_DEEPSEEK_V3, micro_batch=1, counts="tokens", counting=_DSV3_COUNT,
        framework="DeepSeek's HAI-LLM", zero_stage=1, zero_ranks=128, selective_share=_NORM_ACT,
        assumed="micro-batch 1 (120 per replica) and the recomputed share unpublished",
        fp8_recipe="tensorwise", unpriced=_MOE_FP8 + "; DeepSeek's 1 x 128 / 128 x 128 block scaling has no recipe here"),
)

MOE: tuple[PublishedRun, ...] = MOE_MODELZOO + MEGATRON_BRIDGE_MOE + DEEPSEEK_V3
