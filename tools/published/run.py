"""One published training run, and the rules that turn a step time into its figure.

:class:`PublishedRun` holds the model shape, GPUs, batch, micro-batch, layout as published
(degrees, schedule, ZeRO stage and over how many ranks, sequence parallelism), the
recomputation, precision and framework, the figure with its unit and exactly what it counts,
the source, and whether the figure was read off a plot.  ``layout`` holds the
:class:`partitioner.search.price.Layout` keywords the run is priced with (``gpus`` aside).

What a figure counts (:data:`COUNTS`; :func:`figure_from_step` applies it to a predicted step):

* ``tokens``: tokens per second per GPU, ``batch x seq / step / GPUs``.
* ``megatron-eq3``: Megatron's TFLOP/s per GPU, Narayanan et al. 2021 Eq. 3,
  ``24 f B s l h^2 (1 + s/6h + V/16lh)`` with ``f = 4`` when activations are recomputed (the
  paper's ``96``: the recomputed forward counted, hardware FLOPs under full recomputation)
  and ``f = 3`` without; only the GEMMs, a lower bound.
* ``model-eq7``: model FLOPs per step, Korthikanti et al. 2022 Eq. 7,
  ``72 B l s h^2 (1 + s/6h + V/12hl)`` (one forward and backward, no recomputation), as MFU:
  over the step, the GPUs and ``peak_tflops``.  MegaScale's MFU is the same count
  (``6N + 12 l s h`` per token, N with the embedding).
* ``ours``: the model FLOPs our own counter counts (``plan.predicted.model_flops``): for the
  Llama 3 paper's TFLOP/s, whose count the paper does not give.
* ``seconds``: seconds per iteration (the step itself).

>>> shape = ModelShape(layers=80, hidden=12288, heads=96, kv_heads=96, ffn=49152, vocab=51200, seq=2048)
>>> round(megatron_flops(shape, batch=2304, recompute=True) / (1536 * 148e12), 2)  # 145B: seconds at 148 TFLOP/s
24.82
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "COUNTS",
    "GENERATIONS",
    "ModelShape",
    "PublishedRun",
    "figure_from_step",
    "korthikanti_model_flops",
    "megatron_flops",
]

COUNTS: dict[str, str] = {
    "tokens": "tokens/s/GPU",
    "megatron-eq3": "TFLOP/s/GPU",
    "model-eq7": "MFU",
    "ours": "TFLOP/s/GPU",
    "seconds": "s/iteration",
}

# GPU generation of each device a run names (efficiencies are fitted per generation).
GENERATIONS: dict[str, str] = {
    "a100": "ampere", "a100-40gb": "ampere", "a100-opa": "ampere",
    "h100": "hopper", "h100-500w": "hopper", "h200": "hopper", "h800": "hopper",
    "b200": "blackwell", "gb200": "blackwell", "b300": "blackwell",
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Layers, hidden width, query and key/value heads, MLP width, vocabulary, sequence."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published run: model, GPUs, batch, layout as published, and what it measured.

    ``layout``: :class:`partitioner.search.price.Layout` keywords (``gpus`` aside): how the run
    is priced.  ``checkpointing``: what the run recomputed: ``"full"`` (every layer),
    ``"selective"`` (part of each layer: ``selective_share`` of its forward's FLOPs, priced
    between no and full recomputation by that share), ``"none"``, or ``"auto"`` (unpublished:
    our planner's choice).  ``role``: ``"fit"`` (efficiencies are fitted to it),
    ``"held-out"`` (checked, never fitted), FP8 runs alike.  ``unpriced``: why a run is
    listed, not priced (empty: priced).  ``unlimited``: priced without the memory limit, so that the
    plan keeps the published sharding where our memory model says it does not fit.

    ``micro_batch``: sequences per micro-batch; ``batch = dp x micro_batch x microbatches``.
    ``zero_stage`` / ``zero_ranks``: the ZeRO stage (FSDP FULL_SHARD 3, SHARD_GRAD_OP 2, a
    distributed optimizer 1) and how many ranks one copy of the state is sharded over
    (``dp``: across every replica, world-wide at tp = 1; fewer: HSDP).  ``counts``: a key of
    :data:`COUNTS`; ``counting``: in words, exactly what the figure counts.  ``group``: runs
    of one published comparison (same model and GPUs, another layout, schedule or
    recomputation) share it.  ``assumed``: what the source does not publish and the layout
    assumes.  ``from_plot``: the figure was read off a plot (less precise).  ``gpus_per_node``:
    GPUs per host (8 a DGX/HGX node, 4 a GB200 tray); ``nvlink_domain``: GPUs one NVLink domain
    joins across hosts (a GB200 NVL72 rack: up to 72; ``compile(nvlink_domain=...)``), None: the host.
    """

    name: str
    spec: str  # model file: the factory builds the shape on meta, inputs are (batch, seq) token ids
    gpus: int
    batch: int  # sequences per step, all replicas
    seq: int
    layout: dict[str, Any]
    figure: float  # as published, in ``unit``
    unit: str  # COUNTS[counts]
    precision: str  # "bf16", "fp16" or "fp8"
    device: str  # partitioner.cost.devices name of the machine it ran on
    compiled: bool  # torch.compile (or a framework's own fused kernels)
    checkpointing: str
    role: str
    source: str
    note: str = ""
    unlimited: bool = False
    shape: ModelShape | None = None
    micro_batch: int = 0
    counts: str = "tokens"
    counting: str = ""
    framework: str = ""
    zero_stage: int = 0
    zero_ranks: int = 1
    sequence_parallel: bool = False
    group: str = ""
    peak_tflops: float = 0.0  # the peak an MFU figure divides by
    selective_share: float = 0.0
    assumed: str = ""
    from_plot: bool = False
    gpus_per_node: int = 8
    nvlink_domain: int | None = None
    fp8_recipe: str = ""  # FP8 runs: the scaling priced (partitioner.cost.precision.FP8_RECIPES)
    unpriced: str = ""  # why the run is listed, not priced (empty: priced)

    @property
    def fp8(self) -> bool:
        """Whether the run trained its linear layers in FP8 (priced at ``--precision fp8``)."""
        return self.precision == "fp8"

    def cite(self) -> str:
        """The source with the figure, as a table cell.

        >>> from tools.published import run_named
        >>> run_named("8b-8-torchtitan").cite()
        'torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: 5,762 tokens/s/GPU, bf16'
        """
        return f"{self.source}: {self.figure:,.0f} {self.unit}, {self.precision}"

    @property
    def generation(self) -> str:
        return GENERATIONS[self.device]

    @property
    def microbatches(self) -> int:
        return int(self.layout["microbatches"])

    @property
    def shard_span(self) -> str:
        """``"world"`` (the state sharded across every replica), ``"node"`` (HSDP) or ``""`` (none)."""
        if self.zero_stage == 0:
            return ""
        return "world" if self.zero_ranks == self.layout["dp"] else "node"

    def describe(self) -> str:
        """The layout as published, short.

        >>> from tools.published import run_named
        >>> run_named("70b-256-torchtitan").describe()
        'TP8 PP1 DP32 ZeRO-3/32 M1 x 16 1f1b AC full'
        """
        lay = self.layout
        chunks = f"x{lay['chunks']}v" if lay.get("chunks") and lay["chunks"] > 1 else ""
        zero = f" ZeRO-{self.zero_stage}/{self.zero_ranks}" if self.zero_stage else ""
        sp = " SP" if self.sequence_parallel else ""
        ep = f" EP{lay['ep']}" if lay.get("ep", 1) > 1 else ""
        return (f"TP{lay['tp']} PP{lay['pp']}{chunks} DP{lay['dp']}{ep}{zero}{sp} M{lay['microbatches']} x "
                f"{self.micro_batch} {lay['schedule']} AC {self.checkpointing}")


def megatron_flops(shape: ModelShape, *, batch: int, recompute: bool) -> float:
    """FLOPs of one step by Narayanan et al. 2021, Eq. 3 (``f = 4`` recomputing, 3 not).

    >>> s = ModelShape(24, 2304, 24, 24, 9216, 51200, 2048)
    >>> round(megatron_flops(s, batch=512, recompute=True) / 1e15, 1)  # 1.7B, Table 1: PFLOP per step
    15.5
    """
    b, s, l, h, v = batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    f = 4 if recompute else 3
    return 24 * f * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def korthikanti_model_flops(shape: ModelShape, *, batch: int) -> float:
    """Model FLOPs of one step by Korthikanti et al. 2022, Eq. 7.

    >>> s = ModelShape(96, 12288, 96, 96, 49152, 51200, 2048)
    >>> round(korthikanti_model_flops(s, batch=64) / (13.75 * 64 * 312e12), 3)  # 175B: Table 5's MFU 51.4%
    0.514
    """
    b, s, l, h, v = batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    return 72 * b * l * s * h * h * (1 + s / (6 * h) + v / (12 * h * l))


def figure_from_step(run: PublishedRun, step_s: float, *, model_flops: float | None = None) -> float:
    """``run``'s figure, in its own unit and by its own count, for a step of ``step_s`` seconds.

    ``model_flops``: our counter's model FLOPs of one step (``counts == "ours"`` only).

    >>> from tools.published import run_named
    >>> r = run_named("megatron2021-t1-145b")
    >>> round(figure_from_step(r, 24.82), 1)  # TFLOP/s per GPU at a 24.82 s step
    148.0
    """
    if step_s <= 0:
        raise ValueError(f"{run.name}: a step of {step_s} s has no figure")
    if run.counts == "tokens":
        return run.batch * run.seq / step_s / run.gpus
    if run.counts == "seconds":
        return step_s
    if run.counts == "ours":
        if model_flops is None:
            raise ValueError(f"{run.name}: counts 'ours' needs our model FLOPs")
        return model_flops / step_s / run.gpus / 1e12
    if run.shape is None:
        raise ValueError(f"{run.name}: {run.counts!r} needs the model shape")
    if run.counts == "megatron-eq3":
        flops = megatron_flops(run.shape, batch=run.batch, recompute=run.checkpointing == "full")
        return flops / step_s / run.gpus / 1e12
    if run.counts == "model-eq7":
        return korthikanti_model_flops(run.shape, batch=run.batch) / step_s / run.gpus / (run.peak_tflops * 1e12)
    raise ValueError(f"{run.name}: unknown count {run.counts!r}; one of {', '.join(COUNTS)}")
