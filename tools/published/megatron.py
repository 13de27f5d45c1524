"""Megatron-LM on Selene's DGX A100 80 GB (NVLink inside nodes, 8 HDR 200 Gb/s NICs per node): two papers.

**Narayanan et al. 2021**, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21, arXiv:2104.04473), checked 2026-12-03 against a full-text
transcription of the paper and NVIDIA/Megatron-LM's README image ``images/cases_april2021.png``
(commit 50a4b5f) for Table 1:

* Table 1 (weak scaling, 1.7B to 1T): layers, hidden, heads, tp, pp, micro-batch, batch and
  interleaving are NVIDIA/Megatron-LM ``examples/academic_paper_scripts/sc21/run_table_1.sh``
  (``--num-layers-per-virtual-pipeline-stage``: 76B 5 of 15 layers per rank, 3 chunks;
  145B and 310B 2 chunks; 530B 1 of 3, 3 chunks; 1T none), with ``--fp16`` and
  ``--activations-checkpoint-method uniform`` (full recomputation) from its ``CONFIG.sh``.
  The figure is TFLOP/s per GPU by the paper's Eq. 3 (which counts the recomputed
  forward), end to end (data loading, optimizer, logging included).
* Table 2 (ZeRO-3 without model parallelism against PTD-P, 175B and 530B): ZeRO-3 through
  DeepSpeed in the Megatron codebase, tp = pp = 1, every GPU a replica, so ZeRO-3 shards
  over all of them (world-wide); micro-batch 4, 2, 1 so that each GPU runs one micro-batch.
  PTD-P: model-parallel size 96 (tp 8 x pp 12) and 280 (tp 8 x pp 35), micro-batch 1.  Same
  Eq. 3 TFLOP/s.  Not published: the recomputation (full assumed: Eq. 3 assumes it, and
  175B's activations at 4 sequences per GPU exceed 80 GB without it) and PTD-P's schedule
  (interleaved assumed, as the sc21 scripts run tp 8 x pp 12 (Figures 12, 18: 4 chunks) and
  tp 8 x pp 35 (Table 1: 3 chunks)).  Five pairs share GPUs: 175B on 384, 768 and 1,536;
  530B on 1,120 and 2,240 (the 640-GPU ZeRO-3 row has no PTD-P partner).

**Korthikanti et al. 2022**, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), checked against a full-text transcription (Tables 3 and 5, section 6.3,
abstract) and NVIDIA/Megatron-LM's README at commit 2e90a34 (the MFU and HFU of Table 5):

* Table 3 configurations (no data parallelism; 22B tp 8, 175B tp 8 x pp 8, 530B tp 8 x pp 35,
  1T tp 8 x pp 64, micro-batch 4, 1, 1, 1), the interleaved schedule with 3 stages per rank
  for 175B and 530B (section 6), sequence 2,048, vocabulary 51,200.
* Table 5: seconds per iteration with full recomputation (without sequence parallelism) and
  with "present work" (sequence parallelism and selective recomputation: the attention's
  ``QK^T``, softmax, dropout and ``@V``, ``s / (6h + s)`` of a layer's forward FLOPs,
  Appendix A).
* Section 6.3 and the abstract: the 530B model at 8-way data parallelism on 2,240 GPUs,
  batch 2,240: 39.15 s (MFU 54.2%) with the present work, MFU 42.1% with full
  recomputation (MFU by Eq. 7 over the A100's 312 TFLOP/s).
"""

from __future__ import annotations

from tools.published._common import gpt_shape, layout
from tools.published.run import PublishedRun

__all__ = ["KORTHIKANTI_2022", "NARAYANAN_2021"]

_N21 = "Narayanan et al. 2021 (arXiv:2104.04473)"
_K22 = "Korthikanti et al. 2022 (arXiv:2205.05198)"
_EQ3 = ("Megatron TFLOP/s per GPU, Eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) per step (GEMMs only; the "
        "recomputed forward counted: hardware FLOPs under full recomputation), end to end")
_EQ7 = ("MFU: model FLOPs per step by Eq. 7, 72 B l s h^2 (1 + s/6h + V/12hl) (no recomputation counted), over "
        "the step, the GPUs and 312 TFLOP/s")
_SEL = "sequence parallelism and selective recomputation (attention core: s/(6h+s) of the forward FLOPs)"


def _t1(size: str, model: str, *, tp: int, pp: int, gpus: int, batch: int, mbs: int, tflops: float,
        chunks: int | None, role: str) -> PublishedRun:
    dp = gpus // (tp * pp)
    micro = batch // (dp * mbs)
    schedule = "interleaved-1f1b" if chunks else "1f1b"
    name = f"Megatron TP{tp} PP{pp}{f' ({chunks} chunks)' if chunks else ''} DP{dp}"
    return PublishedRun(
        f"megatron2021-t1-{size}", f"tools/published_models.py:{model}", gpus, batch, 2048,
        layout(name, tp=tp, pp=pp, dp=dp, microbatches=micro, schedule=schedule, chunks=chunks),
        tflops, "TFLOP/s/GPU", "fp16", "a100", True, "full", role, f"{_N21}, Table 1",
        shape=gpt_shape(model), micro_batch=mbs, counts="megatron-eq3", counting=_EQ3,
        framework="Megatron-LM (2021)", note="micro-batch, heads and interleaving from the sc21 run_table_1.sh")


def _zero3(model: str, size: str, *, gpus: int, batch: int, mbs: int, tflops: float, group: str,
           role: str = "held-out") -> PublishedRun:
    return PublishedRun(
        f"megatron2021-t2-zero3-{size}-{gpus}", f"tools/published_models.py:{model}", gpus, batch, 2048,
        {**layout(f"ZeRO-3 DP{gpus}", tp=1, pp=1, dp=gpus, microbatches=batch // (gpus * mbs), zero=3),
         "zero3_unit": "module"},  # DeepSpeed's ZeRO-3 gathers each parameter-owning module on its own
        tflops, "TFLOP/s/GPU", "fp16", "a100", True, "full", role, f"{_N21}, Table 2",
        shape=gpt_shape(model), micro_batch=mbs, counts="megatron-eq3", counting=_EQ3,
        framework="Megatron-LM + DeepSpeed ZeRO-3", zero_stage=3, zero_ranks=gpus, group=group,
        assumed="full recomputation (not stated; Eq. 3 assumes it)",
        note="ZeRO-3 over every GPU (tp = 1): world-wide sharding, not HSDP")


def _ptdp(model: str, size: str, *, gpus: int, batch: int, tflops: float, pp: int, chunks: int, group: str,
          role: str = "held-out") -> PublishedRun:
    dp = gpus // (8 * pp)
    return PublishedRun(
        f"megatron2021-t2-ptdp-{size}-{gpus}", f"tools/published_models.py:{model}", gpus, batch, 2048,
        layout(f"PTD-P TP8 PP{pp} ({chunks} chunks) DP{dp}", tp=8, pp=pp, dp=dp, microbatches=batch // dp,
               schedule="interleaved-1f1b", chunks=chunks),
        tflops, "TFLOP/s/GPU", "fp16", "a100", True, "full", role, f"{_N21}, Table 2",
        shape=gpt_shape(model), micro_batch=1, counts="megatron-eq3", counting=_EQ3,
        framework="Megatron-LM (2021)", group=group,
        assumed=f"interleaved schedule with {chunks} chunks (as the sc21 scripts at this tp x pp); full recomputation")


NARAYANAN_2021: tuple[PublishedRun, ...] = (
    _t1("1.7b", "megatron_1_7b", tp=1, pp=1, gpus=32, batch=512, mbs=16, tflops=137, chunks=None, role="fit"),
    _t1("3.6b", "megatron_3_6b", tp=2, pp=1, gpus=64, batch=512, mbs=16, tflops=138, chunks=None, role="held-out"),
    _t1("7.5b", "megatron_7_5b", tp=4, pp=1, gpus=128, batch=512, mbs=16, tflops=142, chunks=None, role="held-out"),
    _t1("18b", "megatron_18b", tp=8, pp=1, gpus=256, batch=1024, mbs=8, tflops=135, chunks=None, role="fit"),
    _t1("39b", "megatron_39b", tp=8, pp=2, gpus=512, batch=1536, mbs=4, tflops=138, chunks=None, role="held-out"),
    _t1("76b", "megatron_76b", tp=8, pp=4, gpus=1024, batch=1792, mbs=2, tflops=140, chunks=3, role="held-out"),
    _t1("145b", "megatron_145b", tp=8, pp=8, gpus=1536, batch=2304, mbs=2, tflops=148, chunks=2, role="fit"),
    _t1("310b", "megatron_310b", tp=8, pp=16, gpus=1920, batch=2160, mbs=1, tflops=155, chunks=2, role="held-out"),
    _t1("530b", "megatron_530b", tp=8, pp=35, gpus=2520, batch=2520, mbs=1, tflops=163, chunks=3, role="held-out"),
    _t1("1t", "megatron_1t", tp=8, pp=64, gpus=3072, batch=3072, mbs=1, tflops=163, chunks=None, role="fit"),
    _zero3("megatron_175b", "175b", gpus=384, batch=1536, mbs=4, tflops=144, group="megatron2021-175b-384", role="fit"),
    _zero3("megatron_175b", "175b", gpus=768, batch=1536, mbs=2, tflops=88, group="megatron2021-175b-768"),
    _zero3("megatron_175b", "175b", gpus=1536, batch=1536, mbs=1, tflops=44, group="megatron2021-175b-1536"),
    _zero3("megatron_530b", "530b", gpus=640, batch=2560, mbs=4, tflops=138, group=""),
    _zero3("megatron_530b", "530b", gpus=1120, batch=2240, mbs=2, tflops=98, group="megatron2021-530b-1120"),
    _zero3("megatron_530b", "530b", gpus=2240, batch=2240, mbs=1, tflops=48, group="megatron2021-530b-2240"),
    _ptdp("megatron_175b", "175b", gpus=384, batch=1536, tflops=153, pp=12, chunks=4, group="megatron2021-175b-384"),
    _ptdp("megatron_175b", "175b", gpus=768, batch=1536, tflops=149, pp=12, chunks=4, group="megatron2021-175b-768",
          role="fit"),
    _ptdp("megatron_175b", "175b", gpus=1536, batch=1536, tflops=141, pp=12, chunks=4, group="megatron2021-175b-1536"),
    _ptdp("megatron_530b", "530b", gpus=560, batch=2240, tflops=171, pp=35, chunks=3, group=""),
    _ptdp("megatron_530b", "530b", gpus=1120, batch=2240, tflops=167, pp=35, chunks=3, group="megatron2021-530b-1120"),
    _ptdp("megatron_530b", "530b", gpus=2240, batch=2240, tflops=159, pp=35, chunks=3, group="megatron2021-530b-2240"),
)


def _k22(size: str, model: str, mode: str, *, pp: int, batch: int, mbs: int, figure: float, chunks: int | None,
         gpus: int | None = None, mfu: bool = False, role: str = "held-out") -> PublishedRun:
    gpus = gpus or 8 * pp
    dp = gpus // (8 * pp)
    shape = gpt_shape(model)
    selective = mode == "selective"
    name = f"Megatron TP8 PP{pp}{f' ({chunks} chunks)' if chunks else ''} DP{dp}{' SP' if selective else ''}"
    recompute = "none" if selective else "full"  # selective: priced between none and full (selective_share)
    where = "section 6.3 and abstract" if gpus != 8 * pp else "Tables 3 and 5"
    return PublishedRun(
        f"korthikanti2022-{size}{'-' + str(gpus) if gpus != 8 * pp else ''}-{mode}", f"tools/published_models.py:{model}",
        gpus, batch, 2048,
        layout(name, tp=8, pp=pp, dp=dp, microbatches=batch // (dp * mbs),
               schedule="interleaved-1f1b" if chunks else "1f1b", chunks=chunks, recompute=recompute),
        figure, "MFU" if mfu else "s/iteration", "bf16", "a100", True, mode, role, f"{_K22}, {where}",
        shape=shape, micro_batch=mbs, counts="model-eq7" if mfu else "seconds",
        counting=_EQ7 if mfu else "seconds per iteration, end to end",
        framework="Megatron-LM (2022)", sequence_parallel=selective, peak_tflops=312.0,
        selective_share=shape.seq / (6 * shape.hidden + shape.seq) if selective else 0.0,
        group=f"korthikanti2022-{size}-{gpus}",
        note=(_SEL if selective else "full recomputation, no sequence parallelism")
        + "; precision: 'mixed precision' (16-bit type not stated)")


KORTHIKANTI_2022: tuple[PublishedRun, ...] = (
    _k22("22b", "korthikanti_22b", "full", pp=1, batch=4, mbs=4, figure=1.42, chunks=None),
    _k22("22b", "korthikanti_22b", "selective", pp=1, batch=4, mbs=4, figure=1.10, chunks=None, role="fit"),
    _k22("175b", "megatron_175b", "full", pp=8, batch=64, mbs=1, figure=18.13, chunks=3, role="fit"),
    _k22("175b", "megatron_175b", "selective", pp=8, batch=64, mbs=1, figure=13.75, chunks=3),
    _k22("530b", "megatron_530b", "full", pp=35, batch=280, mbs=1, figure=49.05, chunks=3),
    _k22("530b", "megatron_530b", "selective", pp=35, batch=280, mbs=1, figure=37.83, chunks=3, role="fit"),
    _k22("1t", "megatron_1t", "full", pp=64, batch=512, mbs=1, figure=94.42, chunks=None),
    _k22("1t", "megatron_1t", "selective", pp=64, batch=512, mbs=1, figure=71.49, chunks=None),
    _k22("530b", "megatron_530b", "full", pp=35, batch=2240, mbs=1, figure=0.421, chunks=3, gpus=2240, mfu=True),
    _k22("530b", "megatron_530b", "selective", pp=35, batch=2240, mbs=1, figure=39.15, chunks=3, gpus=2240),
)
