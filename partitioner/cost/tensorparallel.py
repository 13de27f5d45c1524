"""Tensor parallelism's cost model: compute, weights, activations and collectives per tensor-parallel degree.

Pure numbers, no torch.  A tensor-parallel (TP) group of ``tp`` GPUs splits each
column/row pair of linear layers (Megatron-LM: Shoeybi et al., "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism",
arXiv:1909.08053, section 3): the first linear of a pair is split by columns
(its output features: the MLP's hidden units, attention's heads), the second by
rows (its input features), so what runs between them (the activation, the
attention of each head) needs no communication.  What that costs and saves:

* **Compute and weights**: a split node's FLOPs, time and parameters are
  divided by ``tp`` (:func:`split_seconds`, :func:`split_bytes`); a node that is
  replicated (norms, residual adds) runs whole on every GPU of the group, unless
  sequence parallelism splits it along the sequence (below).  Grouped-query
  attention with fewer key/value heads than ``tp`` replicates them: each GPU
  computes the one key/value head its query heads read, ``1 / kv_heads`` of
  the key/value projections (:func:`head_share`; Megatron-LM's
  ``num_query_groups``).
* **Communication** (Megatron, section 3, figure 3): each pair has an
  all-reduce of the ``b x s x h`` output after the row-parallel linear in the
  forward (operator ``g``) and one of the input gradient before the
  column-parallel linear in the backward (operator ``f``): two per transformer
  layer in each direction (attention and MLP).  With sequence parallelism
  (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", arXiv:2205.05198, section 4.2.2) each all-reduce becomes an
  all-gather before the pair and a reduce-scatter after it: the same bytes over
  the ring (a ring all-reduce *is* a reduce-scatter and an all-gather,
  :mod:`partitioner.cost.comm`), so the same time (:func:`pair_seconds`).
  The group stays inside one node (NVLink; ``cost.comm.link(spec)``), and the
  collectives sit on the critical path: each one's output is the next op's
  input, and Megatron-LM overlaps none of them by default (its
  ``--tp-comm-overlap`` needs Transformer Engine's userbuffers; Korthikanti et
  al. price them unoverlapped too).
* **Activations** (Korthikanti et al., section 4, equations 1-5): per
  transformer layer, with ``a`` heads and 16-bit activations,
  ``s b h (34 + 5 a s / h)`` bytes without tensor parallelism,
  ``s b h (10 + 24 / t + 5 a s / (h t))`` with it (the ``10`` are the norms'
  and dropouts' inputs, replicated) and ``s b h / t (34 + 5 a s / h)`` with
  sequence parallelism as well (:func:`layer_activation_bytes`).  The planner
  does not use these closed forms: it divides the saved bytes of each node of
  the captured graph by its own share (:mod:`partitioner.solve.tensorparallel`),
  which gives the same terms for a Megatron layer and also covers what the
  formula leaves out (flash attention's missing ``5 a s / h``, SwiGLU's third
  matrix); the formula is the check (``tests/test_tp_cost.py``).
* **Vocabulary** (Megatron, section 3): the embedding is split by vocabulary
  rows (an all-reduce of its output in the forward: a reduce-scatter with
  sequence parallelism), the output head by vocabulary columns, and the
  cross-entropy computed on the split logits (``loss_parallel``: three
  all-reduces of ``b x s`` numbers, the maximum, the target logit and the sum of
  exponentials; the head's input gradient is all-reduced in the backward).  A
  vocabulary that does not divide is padded to a multiple of ``tp``
  (Megatron-LM's ``make_vocab_size_divisible_by``; :func:`padded_units`).

    >>> from partitioner.cost.comm import Link
    >>> nvlink = Link(450e9, 10e-6)
    >>> f, b = layer_comm_seconds(1, 4096, 8192, tp=8, link=nvlink, itemsize=2)
    >>> round(f * 1e3, 3), f == b     # 2 all-reduces of 64 MiB over 8 GPUs, each way
    (0.802, True)
"""

from __future__ import annotations

import math

from partitioner.cost.comm import Link
from partitioner.graph.tensorparallel import degrees  # the rule lives with the patterns it reads

__all__ = [
    "LOSS_PARALLEL_ALLREDUCES",
    "PAIRS_PER_LAYER",
    "degrees",
    "head_share",
    "layer_activation_bytes",
    "layer_comm_seconds",
    "loss_parallel_seconds",
    "padded_units",
    "pair_seconds",
    "split_bytes",
    "split_seconds",
]

PAIRS_PER_LAYER = 2  # attention and MLP: two column/row pairs per transformer layer (Megatron, figure 3)

# Megatron's vocab-parallel cross-entropy: all-reduce (max) of the logits' maximum, then (sum) of the
# target's logit and of the exponentials' sum, each b x s numbers (megatron/core/tensor_parallel/cross_entropy.py).
LOSS_PARALLEL_ALLREDUCES = 3


def split_seconds(seconds: float, share: float) -> float:
    """Time of a node whose work is divided ``share`` ways (its FLOPs and bytes split evenly).

    The roofline is linear in FLOPs and bytes; per-kernel overheads do not shrink, which a
    measured or calibrated cost would show and this ignores (Megatron, section 5.1, reports 77%
    weak-scaling efficiency at 8-way TP on DGX-2 nodes, much of it from the collectives priced below).

    >>> split_seconds(8e-3, 4)
    0.002
    """
    if share < 1:
        raise ValueError(f"share is {share}, expected at least 1")
    return seconds / share


def split_bytes(nbytes: float, share: float) -> float:
    """Bytes one GPU holds of a tensor divided ``share`` ways (a weight, a saved activation).

    >>> split_bytes(1024, 8)
    128.0
    """
    if share < 1:
        raise ValueError(f"share is {share}, expected at least 1")
    return nbytes / share


def head_share(tp: int, units: int) -> int:
    """How many ways a split with ``units`` heads (or columns) is divided at ``tp``: ``tp``, or fewer heads.

    Key/value heads of grouped-query attention are replicated when there are
    fewer than ``tp`` (each GPU computes the head its query heads read):
    ``min(tp, units)``, which needs ``tp`` to be a multiple of ``units``.

    >>> head_share(8, 64), head_share(8, 8), head_share(8, 2), head_share(4, 8)
    (8, 8, 2, 4)
    """
    if units % tp and tp % units:
        raise ValueError(f"{units} heads are neither split nor replicated evenly over tp={tp}")
    return min(tp, units)


def padded_units(units: int, tp: int) -> int:
    """``units`` (a vocabulary) padded up to a multiple of ``tp``, as Megatron-LM pads it.

    >>> padded_units(50257, 8), padded_units(128256, 8)
    (50264, 128256)
    """
    return math.ceil(units / tp) * tp




def pair_seconds(nbytes: float, tp: int, link: Link, *, sequence_parallel: bool = False) -> float:
    """One direction of one column/row pair's collective: a ring all-reduce of ``nbytes`` over ``tp`` GPUs.

    ``nbytes``: the pair's ``b x s x h`` activation (its output in the forward,
    its input's gradient in the backward).  With sequence parallelism, an
    all-gather plus a reduce-scatter (Korthikanti et al., section 4.2.2): the
    same bandwidth term, twice the ring's ``tp - 1`` latencies per message, as
    a ring all-reduce (:class:`~partitioner.cost.comm.Link`).

    >>> nvlink = Link(450e9, 10e-6)
    >>> pair_seconds(64 * 2**20, 8, nvlink) == pair_seconds(64 * 2**20, 8, nvlink, sequence_parallel=True)
    True
    >>> pair_seconds(1e6, 1, nvlink)
    0.0
    """
    if tp <= 1:
        return 0.0
    if sequence_parallel:
        return 2 * link.shard_seconds(nbytes, tp)
    return link.allreduce_seconds(nbytes, tp)


def layer_comm_seconds(
    b: int, s: int, h: int, *, tp: int, link: Link, itemsize: int = 2, sequence_parallel: bool = False
) -> tuple[float, float]:
    """(forward, backward) collective seconds of one transformer layer at ``tp`` (Megatron: 2 each way).

    >>> nvlink = Link(450e9, 10e-6)
    >>> layer_comm_seconds(1, 2048, 4096, tp=1, link=nvlink)
    (0.0, 0.0)
    """
    one = pair_seconds(b * s * h * itemsize, tp, link, sequence_parallel=sequence_parallel)
    return PAIRS_PER_LAYER * one, PAIRS_PER_LAYER * one


def loss_parallel_seconds(b: int, s: int, *, tp: int, link: Link, itemsize: int = 4) -> float:
    """Forward collectives of a vocabulary-parallel cross-entropy: three all-reduces of ``b x s`` numbers.

    >>> round(loss_parallel_seconds(1, 4096, tp=8, link=Link(450e9, 10e-6)) * 1e6, 1)  # latency-bound
    420.2
    """
    if tp <= 1:
        return 0.0
    return LOSS_PARALLEL_ALLREDUCES * link.allreduce_seconds(b * s * itemsize, tp)


def layer_activation_bytes(
    s: int, b: int, h: int, a: int, *, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes one transformer layer keeps for backward per GPU (Korthikanti et al. 2022, section 4).

    16-bit activations, a GPT layer (4h MLP, dropout, softmax attention kept):
    equation 1 ``s b h (34 + 5 a s / h)`` without tensor parallelism, equation 2
    ``s b h (10 + 24/t + 5 a s / (h t))`` with it, equation 4 ``s b h / t (34 + 5 a s / h)``
    with sequence parallelism; ``recompute="selective"`` drops the attention
    core's ``5 a s / h`` (equation 5 with sequence parallelism: ``34 s b h / t``);
    ``"full"`` keeps only the layer's input, ``2 s b h`` (``/ t`` with sequence
    parallelism: section 5).

    >>> s, b, h, a = 2048, 1, 12288, 96      # GPT-3 175B, one sequence
    >>> round(layer_activation_bytes(s, b, h, a) / 2**20)
    2736
    >>> round(layer_activation_bytes(s, b, h, a, tp=8) / 2**20), round(layer_activation_bytes(s, b, h, a, tp=8, sequence_parallel=True) / 2**20)
    (552, 342)
    >>> round(layer_activation_bytes(s, b, h, a, tp=8, sequence_parallel=True, recompute="selective") / 2**20)
    102
    """
    sbh = s * b * h
    attention = 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if recompute == "selective":
        attention = 0.0
    elif recompute != "none":
        raise ValueError(f"recompute is {recompute!r}, expected none, selective or full")
    if sequence_parallel:
        return sbh / tp * (34 + attention)
    return sbh * (10 + 24 / tp + attention / tp)
