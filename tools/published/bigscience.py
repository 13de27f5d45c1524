"""BLOOM's layout search and training run (BigScience, Megatron-DeepSpeed on Jean Zay's A100 80 GB).

Source: bigscience-workshop/bigscience, ``train/tr11-176B-ml/`` (checked 2026-12-03):

* ``README.md``: 48 nodes of 8 A100 80 GB (384 GPUs), NVLink inside a node, "4 OmniPath
  links" per node (4 x 100 Gb/s: our ``a100-opa``, 6.25 GB/s per GPU); the log line of
  iteration 85,376 (end of the first epoch, still on 48 nodes): 104.70 s per iteration,
  149.77 TFLOP/s.
* ``tr11-176B-ml.slurm``: TP 4, PP 12, micro-batch 2, batch 2,048, 70 layers, hidden 14,336,
  112 heads, sequence 2,048, vocabulary padded to 250,880, ALiBi, bf16,
  ``--checkpoint-activations`` (full recomputation), DeepSpeed ZeRO stage 0 with the BF16
  optimizer ("implements its own zero stage 1 equivalent": optimizer state sharded over the
  data-parallel ranks).
* ``chronicles-prequel.md``: the topology search on the same 48 nodes.  "GBS Variations"
  (2022-02-25): 72 layers, hidden 14,336, 64 heads (181B), batch 2,048, ZeRO-1, layouts
  from TP 2 x PP 24 to TP 8 x PP 6 and micro-batches 1 to 4; "Rebalancing layers"
  (2022-02-28, the BF16 optimizer from then on): the 70-layer 176B shape with 64 heads
  (and 112: BLOOM's), TP 8 x PP 12 against TP 4 x PP 12.  Each a single snapshot of the
  second iteration (the prequel says so: figures fluctuate a bit).

TFLOP/s are Megatron's Eq. 3 with the recomputed forward (``math/README.md``: "the hardware
TFLOPs ... using the 4*2 co-efficient"; Eq. 3 exactly since Megatron-DeepSpeed PR 251, before
these tables): 123.69 s for the 181B row of 2022-02-21 gives its printed 130.34 TFLOP/s with
V = 250,880.  The prequel's runs before 2022-02-28 accumulated gradients in fp16 (its
"Rebalancing layers" note); those are recorded as fp16.
"""

from __future__ import annotations

from tools.published._common import gpt_shape, layout
from tools.published.run import PublishedRun

__all__ = ["BIGSCIENCE"]

_PREQUEL = "BigScience tr11-176B-ml chronicles-prequel.md"
_EQ3 = ("Megatron TFLOP/s per GPU, Eq. 3 with the recomputed forward (24 x 4 B s l h^2 (1 + s/6h + V/16lh), "
        "V = 250,880), from the iteration time")


def _run(name: str, model: str, *, tp: int, pp: int, mbs: int, figure: float, date: str, precision: str,
         group: str, role: str = "held-out", where: str = "", note: str = "") -> PublishedRun:
    gpus, batch = 384, 2048
    dp = gpus // (tp * pp)
    return PublishedRun(
        name, f"tools/published_models.py:{model}", gpus, batch, 2048,
        layout(f"Megatron-DeepSpeed TP{tp} PP{pp} DP{dp} ZeRO-1", tp=tp, pp=pp, dp=dp,
               microbatches=batch // (dp * mbs), zero=1),
        figure, "TFLOP/s/GPU", precision, "a100-opa", True, "full", role,
        where or f"{_PREQUEL}, {date}", shape=gpt_shape(model), micro_batch=mbs, counts="megatron-eq3",
        counting=_EQ3, framework="Megatron-DeepSpeed (BigScience fork)", zero_stage=1, zero_ranks=dp, group=group,
        note=note or "second-iteration snapshot; DeepSpeed's pipeline schedule (1F1B)")


_G25, _G28 = "bigscience-181b-0225", "bigscience-176b-h64-0228"

BIGSCIENCE: tuple[PublishedRun, ...] = (
    _run("bloom-176b-training", "bloom_176b", tp=4, pp=12, mbs=2, figure=149.77, date="", precision="bf16",
         group="", role="fit", where="BigScience tr11-176B-ml README.md (iteration 85,376 log line) and slurm",
         note="the training run itself (BLOOM), iteration 85,376 on 48 nodes"),
    _run("bloom-181b-tp8-pp6-m4", "bloom_181b_h64", tp=8, pp=6, mbs=4, figure=141.27, date="2022-02-25",
         precision="fp16", group=_G25, role="fit"),
    _run("bloom-181b-tp8-pp12-m4", "bloom_181b_h64", tp=8, pp=12, mbs=4, figure=137.70, date="2022-02-25",
         precision="fp16", group=_G25),
    _run("bloom-181b-tp8-pp12-m2", "bloom_181b_h64", tp=8, pp=12, mbs=2, figure=125.15, date="2022-02-25",
         precision="fp16", group=_G25),
    _run("bloom-181b-tp4-pp12-m4", "bloom_181b_h64", tp=4, pp=12, mbs=4, figure=144.08, date="2022-02-25",
         precision="fp16", group=_G25),
    _run("bloom-181b-tp4-pp6-m2", "bloom_181b_h64", tp=4, pp=6, mbs=2, figure=144.31, date="2022-02-25",
         precision="fp16", group=_G25),
    _run("bloom-181b-tp2-pp12-m2", "bloom_181b_h64", tp=2, pp=12, mbs=2, figure=143.30, date="2022-02-25",
         precision="fp16", group=_G25),
    _run("bloom-181b-tp2-pp24-m1", "bloom_181b_h64", tp=2, pp=24, mbs=1, figure=134.88, date="2022-02-25",
         precision="fp16", group=_G25),
    _run("bloom-181b-tp4-pp24-m1", "bloom_181b_h64", tp=4, pp=24, mbs=1, figure=123.44, date="2022-02-25",
         precision="fp16", group=_G25),
    _run("bloom-176b-h64-tp8-pp12-m2", "bloom_176b_h64", tp=8, pp=12, mbs=2, figure=128.92, date="2022-02-28",
         precision="bf16", group=_G28),
    _run("bloom-176b-h64-tp4-pp12-m2", "bloom_176b_h64", tp=4, pp=12, mbs=2, figure=153.68, date="2022-02-28",
         precision="bf16", group=_G28),
    _run("bloom-176b-h64-tp4-pp12-m4", "bloom_176b_h64", tp=4, pp=12, mbs=4, figure=153.33, date="2022-02-28",
         precision="bf16", group=_G28),
    _run("bloom-176b-tp4-pp12-m2", "bloom_176b", tp=4, pp=12, mbs=2, figure=150.05, date="2022-02-28",
         precision="bf16", group="", note="BLOOM's shape (112 heads), second-iteration snapshot"),
)
