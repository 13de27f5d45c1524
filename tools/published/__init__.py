"""Published training runs: each layout as published, its measured figure, the machine and the source.

One module per source, one :data:`RUNS` tuple for every tool that prices published layouts:
``tools/validate_published.py`` (every run, against its own figure), ``tools/calibrate_published.py``
(the Hopper calibration: :data:`CALIBRATION_RUNS`) and ``tools/bench_large.py --published``.

==================================  ====  ==========================================================
module                              runs  source
==================================  ====  ==========================================================
:mod:`tools.published.megatron`     32    Narayanan et al. 2021 (Tables 1, 2); Korthikanti et al. 2022
:mod:`tools.published.megascale`    11    Jiang et al. 2024, MegaScale (Megatron-LM baselines)
:mod:`tools.published.bigscience`   13    BigScience BLOOM training and its layout search
:mod:`tools.published.mosaicml`     18    MosaicML llm-foundry MPT benchmarks (FSDP)
:mod:`tools.published.meta`         23    torchtitan benchmarks, Llama 3 paper, Megatron-Bridge (FP8:
                                          H100, B200, GB200)
:mod:`tools.published.moe`          17    Mixture of experts: Megatron-MoE-ModelZoo (Qwen3-235B),
                                          Megatron-Bridge (GPT OSS 120B; FP8 DeepSeekV3, Qwen3),
                                          DeepSeek-V3 paper (FP8)
==================================  ====  ==========================================================

``role``: at most a third of the priced runs are ``"fit"`` (chosen across GPU generations and
layout kinds); the rest ``"held-out"``, FP8 runs alike (priced at ``--precision fp8`` with
their ``fp8_recipe``); a run with ``unpriced`` set is listed, not priced (FP8 mixture of experts).

>>> len(RUNS) >= 40, sorted({r.role for r in RUNS})
(True, ['fit', 'held-out'])
"""

from __future__ import annotations

from tools.published.bigscience import BIGSCIENCE
from tools.published.megascale import MEGASCALE_2024
from tools.published.megatron import KORTHIKANTI_2022, NARAYANAN_2021
from tools.published.meta import BRIDGE_DENSE_FP8, META
from tools.published.moe import DEEPSEEK_V3, MEGATRON_BRIDGE_MOE, MOE_MODELZOO
from tools.published.mosaicml import MOSAICML
from tools.published.run import (
    COUNTS,
    GENERATIONS,
    ModelShape,
    PublishedRun,
    figure_from_step,
    korthikanti_model_flops,
    megatron_flops,
)

__all__ = [
    "CALIBRATION_RUNS",
    "COUNTS",
    "GENERATIONS",
    "RUNS",
    "SOURCES",
    "ModelShape",
    "PublishedRun",
    "figure_from_step",
    "korthikanti_model_flops",
    "megatron_flops",
    "run_named",
]

# Independent sources (organisations and their publications) and their runs.
SOURCES: dict[str, tuple[PublishedRun, ...]] = {
    "NVIDIA: Narayanan et al. 2021": NARAYANAN_2021,
    "NVIDIA: Korthikanti et al. 2022": KORTHIKANTI_2022,
    "ByteDance: MegaScale 2024": MEGASCALE_2024,
    "BigScience: BLOOM": BIGSCIENCE,
    "MosaicML: llm-foundry": MOSAICML,
    "Meta: torchtitan, Llama 3 (and NVIDIA Megatron-Bridge FP8)": META,
    "NVIDIA: Megatron-MoE-ModelZoo (Qwen3-235B)": MOE_MODELZOO,
    "NVIDIA: Megatron-Bridge (mixture of experts)": MEGATRON_BRIDGE_MOE,
    "DeepSeek: DeepSeek-V3 report": DEEPSEEK_V3,
    "NVIDIA: Megatron-Bridge (dense FP8: H100, B200, GB200)": BRIDGE_DENSE_FP8,
}

RUNS: tuple[PublishedRun, ...] = tuple(run for runs in SOURCES.values() for run in runs)

# The runs tools/calibrate_published.py prices and fits the Hopper efficiencies to (issue 23's set).
CALIBRATION_RUNS: tuple[str, ...] = (
    "8b-8-torchtitan", "8b-128-torchtitan", "8b-64-torchtitan", "70b-256-torchtitan", "405b-8k-llama3",
    "405b-16k-llama3", "70b-64-megatron", "405b-512-torchtitan", "405b-1024-megatron",
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
