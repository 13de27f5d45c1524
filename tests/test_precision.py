"""Precision and optimizer formulas: bytes per parameter and per activation, by hand."""

from __future__ import annotations

import pytest

from partitioner.cost.precision import (
    OPTIMIZERS,
    PRECISIONS,
    activation_scale,
    check_optimizer,
    check_precision,
    compute_dtype,
    gradient_bytes,
    gradient_bytes_per_element,
    state_bytes,
    static_bytes_per_element,
)
from partitioner.errors import AutopartitionError


@pytest.mark.parametrize(
    ("precision", "optimizer", "expected"),
    [
        ("fp32", "adam", 4 + 4 + 2 * 4),  # 16: weight, gradient, two moments
        ("bf16-mixed", "adam", 4 + 4 + 2 * 4),  # 16: fp32 master weights, ZeRO sec. 3.1's count
        ("bf16", "adam", 2 + 2 + 2 * 2),  # 8
        ("fp32", "sgd", 4 + 4 + 4),  # 12: one momentum buffer
        ("bf16-mixed", "sgd", 12),
        ("bf16", "sgd", 2 + 2 + 2),  # 6
    ],
)
def test_static_bytes_per_element(precision: str, optimizer: str, expected: int) -> None:
    assert static_bytes_per_element(precision, OPTIMIZERS[optimizer]) == expected


def test_optimizer_states_and_defaults() -> None:
    assert OPTIMIZERS == {"adam": 2, "sgd": 1}
    assert PRECISIONS == ("fp32", "bf16-mixed", "bf16", "fp8")
    assert static_bytes_per_element("fp32", 0) == 8  # plain SGD without momentum: weight + gradient


def test_gradients_and_compute_dtype() -> None:
    assert [gradient_bytes_per_element(p) for p in PRECISIONS] == [4, 4, 2, 4]
    assert [compute_dtype(p) for p in PRECISIONS] == ["float32", "bfloat16", "bfloat16", "bfloat16"]


def test_activation_scale_halves_only_float32_under_bf16() -> None:
    for precision in ("bf16-mixed", "bf16"):
        assert activation_scale(precision, "float32") == 0.5
        for dtype in ("int64", "bool", "bfloat16", "float16", "float64", ""):
            assert activation_scale(precision, dtype) == 1.0
    assert activation_scale("fp32", "float32") == 1.0


def test_state_bytes_by_hand() -> None:
    # 1,000 float32 parameters (4,000 bytes) with Adam.
    assert state_bytes("fp32", 2, elements=1000, model_bytes=4000) == 16_000
    assert state_bytes("bf16-mixed", 2, elements=1000, model_bytes=4000) == 16_000
    assert state_bytes("bf16", 2, elements=1000, model_bytes=4000) == 8_000
    assert state_bytes("bf16", 1, elements=1000, model_bytes=4000) == 6_000
    assert gradient_bytes("bf16-mixed", elements=1000, model_bytes=4000) == 4000
    assert gradient_bytes("bf16", elements=1000, model_bytes=4000) == 2000
    # fp32 trains the model as it is: a bfloat16 model keeps its 2-byte elements.
    assert state_bytes("fp32", 2, elements=1000, model_bytes=2000) == 8_000
    assert gradient_bytes("fp32", elements=1000, model_bytes=2000) == 2000


def test_unknown_names_are_user_errors_naming_the_choices() -> None:
    with pytest.raises(AutopartitionError) as precision:
        check_precision("fp16")
    message = str(precision.value)
    assert "'fp16'" in message and all(p in message for p in PRECISIONS) and "\n" not in message
    with pytest.raises(AutopartitionError) as optimizer:
        check_optimizer("adamw")
    message = str(optimizer.value)
    assert "'adamw'" in message and all(o in message for o in OPTIMIZERS) and "\n" not in message
    with pytest.raises(AutopartitionError):
        static_bytes_per_element("bf32", 2)
    assert check_precision("bf16") == "bf16" and check_optimizer("adam") == "adam"

