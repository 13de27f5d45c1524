"""MegaScale's Megatron-LM baselines: 175B on 256 to 12,288 and 530B on 2,240 to 11,200 Ampere GPUs.

Jiang et al. 2024, "MegaScale: Scaling Large Language Model Training to More Than 10,000
GPUs" (NSDI 2024, arXiv:2402.15627), checked 2026-12-03 against a full-text transcription:

* Section 6.1: Megatron-LM (commit 285068c8) as the baseline, the interleaved schedule with
  6 stages per rank (175B) and 3 (530B), sequence 2,048, vocabulary 64,000; Table 1: 175B
  with 128 heads, hidden 12,288, 96 layers, tp 8 x pp 8; 530B with 160 heads, hidden
  20,480, 105 layers, tp 8 x pp 35.  Section 3.6: eight 200 Gb/s NICs per 8-GPU server
  (our ``a100``: 25 GB/s per GPU); "NVIDIA Ampere GPUs" (A100 assumed; the MFU check below
  uses its 312 TFLOP/s).
* Table 2 (strong scaling, 175B): Megatron-LM's iteration time at batch 768 on 256, 512, 768
  and 1,024 GPUs and at batch 6,144 on 3,072, 6,144, 8,192 and 12,288 GPUs.  Its MFU column
  is Korthikanti et al.'s model FLOPs (``6N + 12 l s h`` per token): 39.3k tokens/s on 256
  GPUs is 53.0% of 312 TFLOP/s, as printed.
* Figure 9 (weak scaling, 530B, batch = GPUs): Megatron-LM's MFU printed on its bars, 49.2%,
  48.8% and 48.2% on 2,240, 4,480 and 11,200 GPUs.

MegaScale's own rows are not used: it changes the model (parallel transformer block, sliding
window attention) and the optimizer (LAMB).  Not published: the micro-batch size (1
assumed), recomputation (unpublished: our planner's choice), precision (bf16 assumed).
"""

from __future__ import annotations

from tools.published._common import gpt_shape, layout
from tools.published.run import PublishedRun

__all__ = ["MEGASCALE_2024"]

_SRC = "Jiang et al. 2024, MegaScale (arXiv:2402.15627)"
_EQ7 = ("MFU: model FLOPs 6N + 12 l s h per token (= Korthikanti et al. Eq. 7), over the step, the GPUs and "
        "312 TFLOP/s")
_ASSUMED = "micro-batch 1, recomputation and precision not published (planner's choice; bf16)"


def _run(model: str, *, pp: int, chunks: int, gpus: int, batch: int, figure: float, mfu: bool, where: str,
         role: str = "held-out") -> PublishedRun:
    dp = gpus // (8 * pp)
    size = model.split("_")[1]
    return PublishedRun(
        f"megascale2024-{size}-{gpus}", f"tools/published_models.py:{model}", gpus, batch, 2048,
        layout(f"Megatron-LM TP8 PP{pp} ({chunks} chunks) DP{dp}", tp=8, pp=pp, dp=dp, microbatches=batch // dp,
               schedule="interleaved-1f1b", chunks=chunks, recompute="auto"),
        figure, "MFU" if mfu else "s/iteration", "bf16", "a100", True, "auto", role, f"{_SRC}, {where}",
        shape=gpt_shape(model), micro_batch=1, counts="model-eq7" if mfu else "seconds",
        counting=_EQ7 if mfu else "seconds per iteration (Table 2's iteration time)",
        framework="Megatron-LM (commit 285068c8)", peak_tflops=312.0, assumed=_ASSUMED, from_plot=mfu,
        note="Figure 9's bar labels" if mfu else "")


MEGASCALE_2024: tuple[PublishedRun, ...] = (
    _run("megascale_175b", pp=8, chunks=6, gpus=256, batch=768, figure=40.0, mfu=False, where="Table 2", role="fit"),
    _run("megascale_175b", pp=8, chunks=6, gpus=512, batch=768, figure=21.2, mfu=False, where="Table 2"),
    _run("megascale_175b", pp=8, chunks=6, gpus=768, batch=768, figure=15.2, mfu=False, where="Table 2"),
    _run("megascale_175b", pp=8, chunks=6, gpus=1024, batch=768, figure=11.9, mfu=False, where="Table 2"),
    _run("megascale_175b", pp=8, chunks=6, gpus=3072, batch=6144, figure=29.02, mfu=False, where="Table 2"),
    _run("megascale_175b", pp=8, chunks=6, gpus=6144, batch=6144, figure=14.78, mfu=False, where="Table 2"),
    _run("megascale_175b", pp=8, chunks=6, gpus=8192, batch=6144, figure=12.24, mfu=False, where="Table 2"),
    _run("megascale_175b", pp=8, chunks=6, gpus=12288, batch=6144, figure=8.57, mfu=False, where="Table 2"),
    _run("megascale_530b", pp=35, chunks=3, gpus=2240, batch=2240, figure=0.492, mfu=True, where="Figure 9"),
    _run("megascale_530b", pp=35, chunks=3, gpus=4480, batch=4480, figure=0.488, mfu=True, where="Figure 9"),
    _run("megascale_530b", pp=35, chunks=3, gpus=11200, batch=11200, figure=0.482, mfu=True, where="Figure 9"),
)
