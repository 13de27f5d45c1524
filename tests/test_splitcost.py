"""partitioner/cost/splitcost.py: the split backward's cost, fitted from chains at two sizes, and where it is spent."""

from __future__ import annotations

import pytest
import torch

from partitioner.cost import splitcost
from partitioner.cost.nodecost import SplitOverhead
from partitioner.cost.splitcost import split_overhead


def test_the_fit_separates_host_time_from_the_share_and_finds_each_part(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small chain: 30 us extra on a 20 us op; large: 330 us extra on a 1,020 us op.
    # share = (330 - 30) / (1020 - 20) = 0.3; per op = 30 - 0.3 x 20 = 24 us.
    # Of the 360 us extra in all, 36 in F (a tenth) and 252 in W (seven tenths).
    chains = {splitcost._SMALL: splitcost._Extra(30e-6, 20e-6, 6e-6, 24e-6),
              splitcost._LARGE: splitcost._Extra(330e-6, 1020e-6, 30e-6, 228e-6)}
    monkeypatch.setattr(splitcost, "_extra_per_op",
                        lambda device, width, rows, **_: chains[(width, rows)])
    found = split_overhead(torch.device("cpu"), trials=1)
    assert found.per_op_s == pytest.approx(24e-6)
    assert found.share == pytest.approx(0.3)
    assert found.forward_part == pytest.approx(0.1)
    assert found.weight_part == pytest.approx(0.7)
    assert found.seconds(1e-3) == pytest.approx(324e-6)


def test_an_outlier_trial_does_not_set_the_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    trials = iter([SplitOverhead(20e-6, 0.3, 0.1, 0.7), SplitOverhead(90e-6, 2.5, 0.0, 0.2),
                   SplitOverhead(30e-6, 0.2, 0.2, 0.6)])
    monkeypatch.setattr(splitcost, "_estimate", lambda device, **_: next(trials))
    assert split_overhead(torch.device("cpu"), trials=3) == pytest.approx((30e-6, 0.3, 0.1, 0.6))


def test_parts_never_exceed_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Noise can make the measured F and W extras add up to more than the whole extra: W gives way.
    chains = {splitcost._SMALL: splitcost._Extra(10e-6, 20e-6, 8e-6, 10e-6),
              splitcost._LARGE: splitcost._Extra(100e-6, 1000e-6, 50e-6, 200e-6)}
    monkeypatch.setattr(splitcost, "_extra_per_op", lambda device, width, rows, **_: chains[(width, rows)])
    found = split_overhead(torch.device("cpu"), trials=1)
    assert found.forward_part == pytest.approx(58 / 110)
    assert found.forward_part + found.weight_part == pytest.approx(1.0)


def test_a_real_measurement_is_a_cost_with_parts() -> None:
    found = split_overhead(torch.device("cpu"), layers=2, repeats=2, trials=1)
    assert found.per_op_s >= 0 and found.share >= 0
    assert 0 <= found.forward_part and 0 <= found.weight_part and found.forward_part + found.weight_part <= 1
