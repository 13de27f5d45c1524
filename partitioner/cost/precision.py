"""Training precision and optimizer: the bytes a parameter and an activation cost.

Pure formulas, no torch, shared by the formulation (what the solver sees), the
simulator and the reports.  Graph costs are always taken in the model's own
dtype; a precision is applied afterwards, as a transform of those numbers, so
one costed graph serves every precision.

* ``fp32``: the model trains in its own dtype (float32 for the models this is
  for): weights, gradients and optimizer state at 4 bytes per element.
* ``bf16-mixed``: compute in bfloat16 under ``torch.autocast``, fp32 weights
  (the master copy; autocast keeps no second bf16 copy, a fully sharded stage
  gathers one: below), fp32 gradients and
  optimizer state (Micikevicius et al., "Mixed Precision Training", ICLR 2018).
  With Adam that is ``4 + 4 + 4 x 2 = 16`` bytes per parameter, the count of
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC 2020, section 3.1 (their 2 + 2 bytes of fp16 weights and
  gradients plus 12 of fp32 weights and moments come to the same 16).
  Activations are bf16: half the bytes of fp32 ones.
* ``bf16``: weights, gradients and optimizer state in bfloat16: ``2 + 2 + 2 x 2
  = 8`` bytes per parameter with Adam; activations bf16 too.
* ``fp8``: FP8 training of the linear layers, as torchao's float8 training
  (``convert_to_float8_training``) and Megatron-LM's ``--fp8-format`` do: the
  matmuls of linear layers (a node reading a 2-d parameter weight,
  :func:`partitioner.graph.fp8.fp8_matmuls`; not the LM head, the model's last
  linear layer, which torchtitan leaves in bf16) run on the device's FP8 peak
  (:func:`fp8_peak`); everything else (attention, norms, embeddings, the LM head)
  runs as under ``bf16-mixed``.  Weights, gradients and optimizer state are
  bf16-mixed's (fp32 master weights, fp32 gradients and Adam moments: 16 bytes
  per parameter): FP8 casts are made from them per step, not kept.  Activations
  are bf16 except the FP8 matmuls' inputs, saved for backward in FP8 (1 byte per
  element, :data:`FP8_SAVED_ITEMSIZE`), as Transformer Engine saves its FP8 casts
  (torchao saves the high-precision input and casts again in backward; the
  runtime, runtime/state/fp8.py, saves the FP8 cast as priced here).  Every FP8
  matmul also pays its casts, memory-bound: read the bf16 value, find its amax and
  write FP8, about :data:`FP8_CAST_BYTES` bytes per element of its input and
  weight in forward and of its output gradient in backward
  (:func:`fp8_cast_bytes`).  ``--fp8-recipe`` (:data:`FP8_RECIPES`) picks the
  scaling: ``tensorwise`` (one scale per tensor, the default), ``rowwise`` (one per
  row; :data:`FP8_RECIPE_EFFICIENCY`: assumed 0.9 of tensorwise's matmul speed, as
  torchao's float8 benchmarks show rowwise behind tensorwise) or ``mxfp8`` (one
  scale per 32 elements, Blackwell's block-scaled MXFP8 tensor cores only: a device
  whose ``peak_flops`` gives ``mxfp8``).

Optimizer state per parameter: Adam keeps two moments, SGD one momentum buffer
(``torch.optim.SGD`` with ``momentum > 0``).

Sharded replicas (a stage group's ``shard`` mode; Rajbhandari et al., SC 2020,
section 5 and Figure 1: with ``d`` replicas, 16 bytes per parameter for DDP,
``4 + 12/d`` with the optimizer state sharded, ``2 + 14/d`` with the gradients
too, ``16/d`` with everything, :func:`zero_bytes_per_parameter`).  Adapted to
these precisions (:func:`shard_state_bytes`, :func:`gathered_bytes`), with
``W``, ``G`` and ``S`` the bytes of a parameter's weight, gradient and optimizer
states as held (``G`` is also the reduce dtype's), ``C`` its weight in the
compute dtype (FSDP2's gathered copy; the backward's unsharded gradients come in
that dtype too):

* ``none`` (DDP): ``W + G + S``.
* ``optimizer``: ``W + G + S/d``.  The gradients stay whole: a pipeline
  accumulates them over every micro-batch of the step before the one
  reduce-scatter (ZeRO-2's ``G/d`` does not apply under gradient accumulation).
  bf16-mixed with Adam: ``8 + 8/d`` (our weights are the fp32 master copy, which
  the paper counts in its 12 bytes of optimizer state).
* ``full`` (FSDP2 ``fully_shard``; runtime/parallel/shard.py): ``(W + G + S)/d`` held.
  Under bf16-mixed every unit has FSDP2's ``MixedPrecisionPolicy(param_dtype=
  bfloat16, reduce_dtype=float32)``, as torchtitan: ``C`` = 2 bytes gathered
  (what the all-gathers move), gradients reduce-scattered in float32 (``G`` = 4,
  the reduce-scatter's input buffer in the reduce dtype: ``foreach_reduce`` in
  ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``); fp32 and bf16
  have no policy, ``C = W = G``.  Kept gathered (one unit per stage), beyond the
  shards (:func:`gathered_bytes`): the gathered weights ``C`` for the whole step
  (torch's pipelining keeps a stage gathered across micro-batches,
  ``set_reshard_after_backward(False)`` in ``torch/distributed/pipelining/stage.py``)
  and the gradients accumulated unsharded between the reduce-scatters
  (``set_requires_gradient_sync(False)``): under bf16-mixed FSDP2 upcasts each
  micro-batch's bf16 gradients into a float32 accumulator after its backward
  (``FSDPParam.to_accumulated_grad_if_needed`` and
  ``accumulate_unsharded_grad_if_needed`` in ``_fsdp_param.py``, called from
  ``FSDPParamGroup.post_backward``), so each backward also holds its own bf16
  gradients ``C`` beside the accumulator until it ends: ``C + G + C`` = 2 + 4 + 2
  = 8 at the end of each backward (6 between backwards); fp32 and bf16 accumulate
  in place, ``C + G``.  (At the step's end FSDP2 frees the weights before the
  reduce-scatter, whose input of ``G`` sits beside the accumulator: ``2 G``, no
  more.)  bf16-mixed with Adam: ``16/d + 8``, as before the policy; the policy
  halves the all-gather (``G + C`` = 6 bytes moved per step, not 8).
* ``full`` with ``reshard_after_forward`` (ZeRO-3, section 5.3 of the paper;
  Zhao et al., "PyTorch FSDP", VLDB 2023, section 3.2): ``(W + G + S)/d`` held,
  nothing else through the step (gradients are reduce-scattered after every
  micro-batch's backward into the sharded accumulation), plus a transient of
  FSDP2 units, one per layer (runtime/parallel/shard.py), at its largest at the end of a
  unit's backward (``FSDPParamGroup.pre_backward`` / ``_backward_prefetch`` and
  ``post_backward`` in ``_fsdp_param_group.py``): the unit in use gathered
  (``C``) with its unsharded gradients (``C``, the compute dtype), the next
  unit prefetched (``C``), and the previous unit's reduce-scatter input (``G``,
  the reduce dtype; ``reduce_scatter_max_input_buffers`` 1 keeps one), so
  ``3 C + G`` of the largest unit (:func:`zero3_transient_bytes`): 2 (W + G)
  under fp32 and bf16, 10 bytes per element under bf16-mixed.  Forward holds
  less (two units' ``C``).  bf16-mixed with Adam: ``16/d`` + that.
  (tests/test_shard_precision.py reads both transients off FSDP2's state on
  spawned ranks: equal to these formulas.)

Example: a 1.3B-parameter model's static state with Adam::

    >>> [static_bytes_per_element(p, OPTIMIZERS["adam"]) for p in PRECISIONS]
    [16, 16, 8, 16]
    >>> round(1.3e9 * static_bytes_per_element("bf16-mixed", 2) / 2**30, 1)  # GiB
    19.4
"""

from __future__ import annotations

import typing
from typing import Literal

from partitioner.errors import AutopartitionError

__all__ = [
    "DEFAULT_FP8_RECIPE",
    "DEFAULT_OPTIMIZER",
    "DEFAULT_PRECISION",
    "FP8_CAST_BYTES",
    "FP8_DTYPE",
    "FP8_RECIPES",
    "FP8_RECIPE_EFFICIENCY",
    "FP8_SAVED_ITEMSIZE",
    "OPTIMIZERS",
    "PRECISIONS",
    "Precision",
    "activation_scale",
    "check_fp8",
    "check_fp8_recipe",
    "check_optimizer",
    "check_precision",
    "compute_dtype",
    "fp8_cast_bytes",
    "fp8_gather_saving",
    "fp8_peak",
    "gathered_bytes",
    "gradient_bytes",
    "gradient_bytes_per_element",
    "runs_autocast",
    "shard_degree",
    "shard_footprint",
    "shard_state_bytes",
    "spans_nodes",
    "state_bytes",
    "static_bytes_per_element",
    "weight_bytes",
    "zero3_transient_bytes",
    "zero_bytes_per_parameter",
]

Precision = Literal["fp32", "bf16-mixed", "bf16", "fp8"]

# Every precision, in the order the command line lists them.
PRECISIONS: tuple[Precision, ...] = typing.get_args(Precision)
DEFAULT_PRECISION: Precision = "fp32"

# Optimizer name -> state tensors kept per parameter.
OPTIMIZERS: dict[str, int] = {"adam": 2, "sgd": 1}
DEFAULT_OPTIMIZER = "adam"

# fp8: everything but the FP8 matmuls computes as under bf16-mixed (their peak: fp8_peak).
_COMPUTE_DTYPE: dict[str, str] = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16", "fp8": "bfloat16"}
# Bytes per element of (weights and optimizer state, gradients).
_STATE_ITEMSIZE: dict[str, int] = {"fp32": 4, "bf16-mixed": 4, "bf16": 2, "fp8": 4}

# FP8 (precision "fp8"): the scaling recipes, the DeviceSpec.peak_flops key of the FP8 tensor-core peak
# (dense) and of the block-scaled MXFP8 one, bytes an FP8 matmul's saved input takes per element, and
# bytes a cast moves per element (read bf16, write fp8; its amax reduction reads the same bf16 again
# in the tensorwise recipe, fused into the cast by torch.compile, so not counted).
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "mxfp8")
DEFAULT_FP8_RECIPE = "tensorwise"
FP8_DTYPE = "float8_e4m3fn"
_MXFP8_PEAK = "mxfp8"
FP8_SAVED_ITEMSIZE = 1
FP8_CAST_BYTES = 3
# Share of tensorwise's FP8 matmul speed each recipe reaches (uncalibrated assumptions, docs/planning.md):
# rowwise scales each row (cuBLAS/CUTLASS row-scaled GEMMs with an epilogue per row), which torchao's float8
# training benchmarks put behind tensorwise; mxfp8 runs on Blackwell's block-scaled tensor cores at their peak.
FP8_RECIPE_EFFICIENCY: dict[str, float] = {"tensorwise": 1.0, "rowwise": 0.9, "mxfp8": 1.0}


def check_precision(name: str) -> Precision:
    """``name`` as a :data:`Precision`; an :class:`AutopartitionError` naming the choices otherwise.

    >>> check_precision("bf16-mixed")
    'bf16-mixed'
    >>> check_precision("fp16")
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: Unknown precision 'fp16'. Choose one of fp32 (...), bf16-mixed (...), bf16 (...) or fp8 (...).
    """
    if name not in PRECISIONS:
        raise AutopartitionError(
            f"Unknown precision {name!r}. Choose one of fp32 (weights, gradients, optimizer state and "
            "activations in float32), bf16-mixed (bfloat16 compute and activations under autocast, "
            "float32 weights, gradients and optimizer state), bf16 (everything in bfloat16) or fp8 "
            "(bf16-mixed with the linear layers' matmuls in FP8)."
        )
    return typing.cast(Precision, name)


def runs_autocast(precision: str) -> bool:
    """Does ``precision`` run stages under bfloat16 autocast with fp32 master weights (bf16-mixed, fp8)?

    >>> [runs_autocast(p) for p in PRECISIONS]
    [False, True, False, True]
    """
    return check_precision(precision) in ("bf16-mixed", "fp8")


def check_fp8_recipe(name: str) -> str:
    """``name`` if it is an FP8 scaling recipe; an :class:`AutopartitionError` naming the choices otherwise.

    >>> check_fp8_recipe("rowwise")
    'rowwise'
    >>> check_fp8_recipe("blockwise")
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: Unknown FP8 recipe 'blockwise'. Choose tensorwise (...), rowwise (...) or mxfp8 (...).
    """
    if name not in FP8_RECIPES:
        raise AutopartitionError(
            f"Unknown FP8 recipe {name!r}. Choose tensorwise (one scale per tensor, the default), rowwise "
            "(one scale per row) or mxfp8 (one scale per 32 elements, Blackwell GPUs only)."
        )
    return name


def fp8_peak(peak_flops: dict[str, float], recipe: str = DEFAULT_FP8_RECIPE) -> float | None:
    """The dense FP8 FLOP/s of a device's ``peak_flops`` under ``recipe``; ``None`` where it has none.

    >>> fp8_peak({"float32": 1.0, "float8_e4m3fn": 100.0}), fp8_peak({"float32": 1.0, "float8_e4m3fn": 100.0}, "rowwise")
    (100.0, 90.0)
    >>> fp8_peak({"float32": 1.0}) is None, fp8_peak({"float32": 1.0, "float8_e4m3fn": 100.0}, "mxfp8") is None
    (True, True)
    """
    key = _MXFP8_PEAK if check_fp8_recipe(recipe) == "mxfp8" else FP8_DTYPE
    peak = peak_flops.get(key)
    return None if peak is None else peak * FP8_RECIPE_EFFICIENCY[recipe]


def check_fp8(precision: str, recipe: str, *, device: str, peak_flops: dict[str, float],
              supported: typing.Iterable[str] = ()) -> None:
    """Refuse ``--precision fp8`` (with ``recipe``) on a device without that FP8 peak, naming the devices that have it.

    ``supported``: the device names to suggest (those of :data:`partitioner.cost.devices.DEVICES` with the peak).

    >>> check_fp8("fp8", "tensorwise", device="a100", peak_flops={"float32": 1.0}, supported=["h100"])
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: --precision fp8 needs FP8 tensor cores, which a100 has not (...). ...
    >>> check_fp8("bf16", "tensorwise", device="a100", peak_flops={"float32": 1.0})  # nothing to check
    """
    if check_precision(precision) != "fp8" or fp8_peak(peak_flops, recipe) is not None:
        return
    names = ", ".join(supported)
    if recipe == "mxfp8":
        raise AutopartitionError(
            f"--fp8-recipe mxfp8 needs block-scaled MXFP8 tensor cores (NVIDIA Blackwell), which {device} has not "
            f"(its peak_flops give no 'mxfp8'). Devices with them: {names or 'none known'}; on another FP8 GPU "
            "use --fp8-recipe tensorwise or rowwise.")
    raise AutopartitionError(
        f"--precision fp8 needs FP8 tensor cores, which {device} has not (no '{FP8_DTYPE}' peak in its "
        f"peak_flops; a measured device, cpu included, has none either). Devices with them: {names or 'none known'} "
        "(or a device file giving peak_flops.float8_e4m3fn); on this one plan with --precision bf16-mixed.")


def fp8_cast_bytes(io_elements: float, weight_elements: float) -> tuple[float, float]:
    """Bytes the FP8 casts of one matmul move, (forward, backward), from its elements read and written.

    ``io_elements``: its activation input and output (the node's bytes less its
    weights, per element); ``weight_elements`` its weight.  Forward casts the
    input and the weight, backward the output gradient (tensorwise reuses the
    forward's casts of input and weight, transposed), each at
    :data:`FP8_CAST_BYTES` per element.  Input and output are taken as equally
    large (the node's cost does not tell them apart; the total is exact).

    >>> fp8_cast_bytes(200, 50)  # 100 input + 50 weight elements forward, 100 output-gradient ones backward
    (450.0, 300.0)
    """
    half = io_elements / 2
    return FP8_CAST_BYTES * (half + weight_elements), FP8_CAST_BYTES * half


def check_optimizer(name: str) -> str:
    """``name`` if it is a known optimizer; an :class:`AutopartitionError` naming the choices otherwise.

    >>> check_optimizer("sgd"), OPTIMIZERS[check_optimizer("adam")]
    ('sgd', 2)
    >>> check_optimizer("lion")
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: Unknown optimizer 'lion'. Choose adam (...) or sgd (...). ...
    """
    if name not in OPTIMIZERS:
        raise AutopartitionError(
            f"Unknown optimizer {name!r}. Choose adam (two state tensors per parameter: the moments) "
            "or sgd (one: the momentum buffer). For another optimizer pass its state count "
            "(optimizer_states=N to compile())."
        )
    return name


def compute_dtype(precision: str) -> str:
    """The dtype floating-point ops run in, which picks the roofline peak (``DeviceSpec.peak``).

    >>> [compute_dtype(p) for p in PRECISIONS]
    ['float32', 'bfloat16', 'bfloat16', 'bfloat16']
    """
    return _COMPUTE_DTYPE[check_precision(precision)]


def static_bytes_per_element(precision: str, optimizer_states: int) -> int:
    """Bytes held for the whole step per parameter element: weight + gradient + optimizer states.

    >>> static_bytes_per_element("fp32", 2), static_bytes_per_element("bf16", 2)  # Adam
    (16, 8)
    >>> static_bytes_per_element("bf16-mixed", 1), static_bytes_per_element("bf16", 0)  # SGD; none
    (12, 4)
    """
    return _STATE_ITEMSIZE[check_precision(precision)] * (2 + optimizer_states)


def gradient_bytes_per_element(precision: str) -> int:
    """Bytes per parameter element that the data-parallel all-reduce moves (the gradient's dtype).

    >>> [gradient_bytes_per_element(p) for p in PRECISIONS]
    [4, 4, 2, 4]
    """
    return _STATE_ITEMSIZE[check_precision(precision)]


def activation_scale(precision: str, dtype: str) -> float:
    """Factor on the bytes of an activation costed in ``dtype``: 0.5 for float32 ones under bf16.

    Applies to bytes saved for backward, boundary tensors sent between stages
    and bytes ops move.  Integer tensors (token ids, indices) and tensors
    already in a 16-bit dtype keep their size.

    >>> activation_scale("bf16-mixed", "float32"), activation_scale("bf16", "int64")
    (0.5, 1.0)
    >>> activation_scale("fp32", "float32"), activation_scale("bf16", "bfloat16")
    (1.0, 1.0)
    """
    return 0.5 if check_precision(precision) != "fp32" and dtype == "float32" else 1.0


def state_bytes(precision: str, optimizer_states: int, *, elements: float, model_bytes: float) -> float:
    """Static bytes of parameters with ``elements`` elements that take ``model_bytes`` in the model's dtype.

    Under ``fp32`` the model trains in its own dtype: ``model_bytes x (2 +
    states)`` (16 bytes per element for a float32 model with Adam, and right
    for a model in another dtype too); under bf16 modes the precision fixes the
    bytes per element (:func:`static_bytes_per_element`).

    >>> state_bytes("fp32", 2, elements=10, model_bytes=40), state_bytes("bf16", 2, elements=10, model_bytes=40)
    (160, 80)
    >>> state_bytes("fp32", 1, elements=10, model_bytes=20)  # a bfloat16 model trained as it is, SGD
    60
    """
    if check_precision(precision) == "fp32":
        return model_bytes * (2 + optimizer_states)
    return elements * static_bytes_per_element(precision, optimizer_states)


def gradient_bytes(precision: str, *, elements: float, model_bytes: float) -> float:
    """Gradient bytes of those parameters, what one all-reduce moves (as :func:`state_bytes` decides).

    >>> gradient_bytes("fp32", elements=10, model_bytes=40), gradient_bytes("bf16", elements=10, model_bytes=40)
    (40, 20)
    """
    if check_precision(precision) == "fp32":
        return model_bytes
    return elements * gradient_bytes_per_element(precision)


def weight_bytes(precision: str, *, elements: float, model_bytes: float, compute: bool = False) -> float:
    """Bytes of those parameters' weights as held (the master copy); ``compute``: as FSDP2 gathers them.

    The held weights are what the broadcast after a ZeRO-1 optimizer step moves
    (shard "optimizer").  ``compute``: the copy a ``full`` stage's all-gathers
    move and hold, and the dtype of the unsharded gradients its backward
    computes: under bf16-mixed FSDP2's ``param_dtype`` bfloat16 (2 bytes per
    element; runtime/parallel/shard.py's ``fsdp_policy``), else the held weights (no
    policy).

    >>> weight_bytes("bf16-mixed", elements=10, model_bytes=40), weight_bytes("bf16-mixed", elements=10,
    ...     model_bytes=40, compute=True), weight_bytes("bf16", elements=10, model_bytes=20, compute=True)
    (40, 20, 20)
    >>> weight_bytes("fp32", elements=10, model_bytes=40, compute=True)
    40
    """
    if compute and _reduces_upcast(precision):
        return elements * 2  # bfloat16
    return gradient_bytes(precision, elements=elements, model_bytes=model_bytes)


def _reduces_upcast(precision: str) -> bool:
    """Does FSDP2 reduce and accumulate gradients in a wider dtype than it computes them in (bf16-mixed, fp8)?"""
    return runs_autocast(precision)


def shard_degree(shard: str, dp: int, gpus_per_node: int | None, *, span: str = "world") -> int:
    """Into how many shards a stage group of ``dp`` replicas splits its state under ``shard``.

    ``span`` (``full`` only): ``"world"``, every replica holds one shard;
    ``"node"``, HSDP: sharded over the group's replicas on one node, the nodes
    replicas of each other (torchtitan's ``dp_replicate x dp_shard`` mesh;
    runtime/parallel/shard.py builds the same), where the group spans whole nodes of
    ``gpus_per_node`` replicas (else as ``"world"``).  ``optimizer`` (ZeRO-1)
    shards over the whole group.

    >>> shard_degree("full", 16, 8), shard_degree("full", 16, 8, span="node"), shard_degree("full", 4, 8, span="node")
    (16, 8, 4)
    >>> shard_degree("optimizer", 16, 8, span="node")
    16
    """
    if shard == "full" and span == "node" and spans_nodes(dp, gpus_per_node):
        assert gpus_per_node is not None
        return gpus_per_node
    return dp


def spans_nodes(dp: int, gpus_per_node: int | None) -> bool:
    """Does a group of ``dp`` replicas span whole nodes of ``gpus_per_node`` (so HSDP differs from sharding over all)?

    >>> spans_nodes(16, 8), spans_nodes(8, 8), spans_nodes(12, 8), spans_nodes(16, None)
    (True, False, False, False)
    """
    return bool(gpus_per_node) and dp > gpus_per_node and dp % gpus_per_node == 0  # type: ignore[operator]


def shard_state_bytes(
    precision: str, optimizer_states: int, shard: str, replicas: int, *, elements: float, model_bytes: float
) -> float:
    """Bytes a replica holds for the whole step for those parameters when its group shards as ``shard``.

    ``none``: :func:`state_bytes`; ``optimizer``: the optimizer states over
    ``replicas``; ``full``: everything over ``replicas`` (the transient gathered
    weights and unsharded gradients are :func:`gathered_bytes`).  See the module
    docstring for the formulas and their sources.

    bf16-mixed with Adam, 8 replicas, per parameter element::

        >>> [shard_state_bytes("bf16-mixed", 2, m, 8, elements=1, model_bytes=4) for m in ("none", "optimizer", "full")]
        [16, 9.0, 2.0]
    """
    held = state_bytes(precision, optimizer_states, elements=elements, model_bytes=model_bytes)
    if shard == "none" or replicas <= 1:
        return held
    grads = gradient_bytes(precision, elements=elements, model_bytes=model_bytes)
    if shard == "optimizer":
        states = held - 2 * grads  # weight and gradient whole, the optimizer states sharded
        return 2 * grads + states / replicas
    if shard == "full":
        return held / replicas
    raise ValueError(f"shard is {shard!r}, expected none, optimizer or full")


def gathered_bytes(
    precision: str, *, elements: float, model_bytes: float, reshard_after_forward: bool = False
) -> float:
    """A fully sharded stage's bytes beyond its shards for those parameters, at their most during the step.

    Kept gathered (``reshard_after_forward`` False): the gathered weights in the
    compute dtype and the unsharded gradients accumulated over the micro-batches
    (in the reduce dtype), plus, where FSDP2 accumulates in a wider dtype than
    the backward computes (bf16-mixed), that backward's own gradients beside the
    accumulator until it ends: ``C + G + C`` (module docstring).  ZeRO-3 (True):
    none; its per-layer transient is :func:`zero3_transient_bytes`.

    >>> gathered_bytes("bf16-mixed", elements=1, model_bytes=4), gathered_bytes("fp32", elements=1, model_bytes=4)
    (8, 8)
    >>> gathered_bytes("bf16", elements=1, model_bytes=2)
    4
    >>> gathered_bytes("bf16-mixed", elements=1, model_bytes=4, reshard_after_forward=True)
    0.0
    """
    if reshard_after_forward:
        return 0.0
    grads = gradient_bytes(precision, elements=elements, model_bytes=model_bytes)
    gathered = weight_bytes(precision, elements=elements, model_bytes=model_bytes, compute=True)
    return gathered + grads + (gathered if _reduces_upcast(precision) else 0)


def fp8_gather_saving(precision: str, elements: float) -> float:
    """Bytes saved on ``elements`` a fully sharded stage gathers as their FP8 casts (1 byte each; tensorwise fp8)
    rather than as :func:`weight_bytes` ``compute`` gives them (bf16 under fp8: 2): in each all-gather and in
    each gathered copy held (:func:`gathered_bytes`' ``C``, :func:`zero3_transient_bytes`' two units' weights).
    The per-tensor scale (4 bytes a weight) is left out.

    >>> fp8_gather_saving("fp8", 1e9) / 1e9, fp8_gather_saving("fp8", 0)
    (1.0, 0.0)
    """
    return elements * (weight_bytes(precision, elements=1, model_bytes=4, compute=True) - 1) if elements else 0.0


def zero3_transient_bytes(precision: str, *, elements: float, model_bytes: float) -> float:
    """ZeRO-3's transient for its largest FSDP unit (those parameters): ``3 C + G``.

    At the end of a unit's backward FSDP2 holds that unit's gathered weights and
    its unsharded gradients (both in the compute dtype, ``C``), the next unit's
    weights, prefetched in its pre-backward (``_backward_prefetch``, ``C``), and
    the previous unit's reduce-scatter input, kept until this unit's reduce
    starts (``reduce_scatter_max_input_buffers`` 1; in the reduce dtype, ``G``):
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``.  That is
    ``2 (W + G)`` without a policy (fp32, bf16: 16 and 8 bytes per element) and
    ``2 + 2 + 2 + 4`` = 10 under bf16-mixed (bf16 gathered and computed, fp32
    reduced).  Forward needs less (two units' weights).

    >>> zero3_transient_bytes("bf16-mixed", elements=1e9, model_bytes=4e9) / 1e9  # GB
    10.0
    >>> zero3_transient_bytes("fp32", elements=1e9, model_bytes=4e9) / 1e9, zero3_transient_bytes("bf16",
    ...     elements=1e9, model_bytes=2e9) / 1e9
    (16.0, 8.0)
    """
    grads = gradient_bytes(precision, elements=elements, model_bytes=model_bytes)
    return 3 * weight_bytes(precision, elements=elements, model_bytes=model_bytes, compute=True) + grads


# The ZeRO paper's stages (section 5.1): P_os, P_os+g, P_os+g+p.
_ZERO_SHARDED = {"none": (), "optimizer": ("optimizer",), "optimizer+gradients": ("optimizer", "gradient"),
                 "full": ("optimizer", "gradient", "weight")}


def zero_bytes_per_parameter(
    stage: str, replicas: int, *, weight: float = 2, gradient: float = 2, optimizer: float = 12
) -> float:
    """Bytes per parameter of a ZeRO stage as the paper counts them (no gradient accumulation).

    Rajbhandari et al., SC 2020, section 5 and Figure 1: fp16 weights and
    gradients (2 + 2) and K = 12 bytes of fp32 master weights and Adam moments;
    ``stage`` is ``none`` (DDP), ``optimizer`` (P_os), ``optimizer+gradients``
    (P_os+g) or ``full`` (P_os+g+p).  Figure 1's 7.5B parameters on 64 GPUs::

        >>> [round(7.5e9 * zero_bytes_per_parameter(s, 64) / 1e9, 1)
        ...  for s in ("none", "optimizer", "optimizer+gradients", "full")]  # GB
        [120.0, 31.4, 16.6, 1.9]
    """
    if stage not in _ZERO_SHARDED:
        raise ValueError(f"stage is {stage!r}, expected one of {', '.join(_ZERO_SHARDED)}")
    sharded = _ZERO_SHARDED[stage]
    parts = {"weight": weight, "gradient": gradient, "optimizer": optimizer}
    return sum(v / replicas if k in sharded else v for k, v in parts.items())


def shard_footprint(precision: str, optimizer_states: int, shard: str, replicas: int) -> tuple[float, float]:
    """(bytes held through the step, bytes its collectives move) per parameter of a float32 model, kept gathered.

    Every cost of a mode is one of these two times the parameter count (the
    collectives' ring factor ``(D-1)/D`` and latency are the same for every
    mode), so a mode no better in either than another is never worth solving.
    DDP's all-reduce moves the gradients twice, a reduce-scatter and an
    all-gather once each; ``optimizer`` (ZeRO-1 over DDP) all-reduces the
    gradients and then broadcasts the updated weights (an all-gather's bytes).

    ``full``: a reduce-scatter of the gradients (reduce dtype) and an all-gather
    of the weights in the compute dtype (bf16 under bf16-mixed).

    >>> [shard_footprint("bf16-mixed", 2, m, 8) for m in ("none", "optimizer", "full")]
    [(16, 8), (9.0, 12), (10.0, 6)]
    >>> [shard_footprint("fp32", 2, m, 2) for m in ("none", "optimizer", "full")]
    [(16, 8), (12.0, 12), (16.0, 8)]
    """
    grads = gradient_bytes(precision, elements=1, model_bytes=4)
    if shard == "none" or replicas <= 1:
        return state_bytes(precision, optimizer_states, elements=1, model_bytes=4), 2 * grads
    held = shard_state_bytes(precision, optimizer_states, shard, replicas, elements=1, model_bytes=4)
    if shard == "full":
        return (held + gathered_bytes(precision, elements=1, model_bytes=4),
                grads + weight_bytes(precision, elements=1, model_bytes=4, compute=True))
    return held, 2 * grads + weight_bytes(precision, elements=1, model_bytes=4)
