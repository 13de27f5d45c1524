"""Training precision and optimizer: the bytes a parameter and an activation cost.

Pure formulas, no torch, shared by the formulation (what the solver sees), the
simulator and the reports.  Graph costs are always taken in the model's own
dtype; a precision is applied afterwards, as a transform of those numbers, so
one costed graph serves every precision.

* ``fp32``: the model trains in its own dtype (float32 for the models this is
  for): weights, gradients and optimizer state at 4 bytes per element.
* ``bf16-mixed``: compute in bfloat16 under ``torch.autocast``, fp32 weights
  (the master copy; autocast keeps no second bf16 copy), fp32 gradients and
  optimizer state (Micikevicius et al., "Mixed Precision Training", ICLR 2018).
  With Adam that is ``4 + 4 + 4 x 2 = 16`` bytes per parameter, the count of
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC 2020, section 3.1 (their 2 + 2 bytes of fp16 weights and
  gradients plus 12 of fp32 weights and moments come to the same 16).
  Activations are bf16: half the bytes of fp32 ones.
* ``bf16``: weights, gradients and optimizer state in bfloat16: ``2 + 2 + 2 x 2
  = 8`` bytes per parameter with Adam; activations bf16 too.

Optimizer state per parameter: Adam keeps two moments, SGD one momentum buffer
(``torch.optim.SGD`` with ``momentum > 0``).

Example: a 1.3B-parameter model's static state with Adam::

    >>> [static_bytes_per_element(p, OPTIMIZERS["adam"]) for p in PRECISIONS]
    [16, 16, 8]
    >>> round(1.3e9 * static_bytes_per_element("bf16-mixed", 2) / 2**30, 1)  # GiB
    19.4
"""

from __future__ import annotations

import typing
from typing import Literal

from partitioner.errors import AutopartitionError

__all__ = [
    "DEFAULT_OPTIMIZER",
    "DEFAULT_PRECISION",
    "OPTIMIZERS",
    "PRECISIONS",
    "Precision",
    "activation_scale",
    "check_optimizer",
    "check_precision",
    "compute_dtype",
    "gradient_bytes",
    "gradient_bytes_per_element",
    "state_bytes",
    "static_bytes_per_element",
]

Precision = Literal["fp32", "bf16-mixed", "bf16"]

# Every precision, in the order the command line lists them.
PRECISIONS: tuple[Precision, ...] = typing.get_args(Precision)
DEFAULT_PRECISION: Precision = "fp32"

# Optimizer name -> state tensors kept per parameter.
OPTIMIZERS: dict[str, int] = {"adam": 2, "sgd": 1}
DEFAULT_OPTIMIZER = "adam"

_COMPUTE_DTYPE: dict[str, str] = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}
# Bytes per element of (weights and optimizer state, gradients).
_STATE_ITEMSIZE: dict[str, int] = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}


def check_precision(name: str) -> Precision:
    """``name`` as a :data:`Precision`; an :class:`AutopartitionError` naming the choices otherwise.

    >>> check_precision("bf16-mixed")
    'bf16-mixed'
    >>> check_precision("fp16")
    Traceback (most recent call last):
    ...
    partitioner.errors.AutopartitionError: Unknown precision 'fp16'. Choose one of fp32 (...), bf16-mixed (...) or bf16 (...).
    """
    if name not in PRECISIONS:
        raise AutopartitionError(
            f"Unknown precision {name!r}. Choose one of fp32 (weights, gradients, optimizer state and "
            "activations in float32), bf16-mixed (bfloat16 compute and activations under autocast, "
            "float32 weights, gradients and optimizer state) or bf16 (everything in bfloat16)."
        )
    return typing.cast(Precision, name)


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
    ['float32', 'bfloat16', 'bfloat16']
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
    [4, 4, 2]
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
