"""Units: sizes people type, and bytes, seconds and counts written for people."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from partitioner import cli, units
from partitioner.report import figures, table
from partitioner.units import (
    GIB,
    MIB,
    byte_unit,
    format_bytes,
    format_count,
    format_ms,
    format_seconds,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("80gib", 80 * 2**30), ("80GB", 80e9),
     ("512MiB", 512 * 2**20), ("1.5KiB", 1536), ("2TiB", 2 * 2**40), ("1TB", 1e12), ("3kB", 3000),
     ("1.5e9B", 1.5e9), ("7B", 7), (" 4 MB ", 4e6), (".5GiB", 2**29),
     # A lone letter is binary, as nvidia-smi and torch.cuda mean it (issue 10: "80G" was refused).
     ("80G", 80 * 2**30), ("80g", 80 * 2**30), ("512M", 512 * 2**20), ("4K", 4096), ("1T", 2**40),
     ("1.5 G", 1.5 * 2**30)],
)
def test_parse_size(text: str, size: float) -> None:
    assert parse_size(text) == size


def test_g_gb_and_gib() -> None:
    """G and GiB are the same (2^30); GB is 10^9, about 7% less."""
    assert parse_size("80G") == parse_size("80GiB") == 80 * GIB
    assert parse_size("80GB") == 80e9 < parse_size("80G")
    assert "80G or 80GiB = 80 x 2^30 bytes, 80GB = 80 x 10^9" in units.SIZE_HELP


@pytest.mark.parametrize("text", ["80 potatoes", "lots", "", "GiB", "-1GiB", "1,5GiB", "80GiBs", "80Gi"])
def test_parse_size_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match="cannot read .* as a memory size; write a number with a unit"):
        parse_size(text)


@pytest.mark.parametrize("text", ["80", "100", "1.5e9", " 40 ", "0"])
def test_parse_size_refuses_a_bare_number(text: str) -> None:
    """A bare 80 silently meant 80 bytes (issue 10): now it asks for a unit, naming the choices."""
    number = text.strip()
    with pytest.raises(ValueError, match=f"'{number}' has no unit; write {number}G \\(GiB, 2\\^30 bytes\\), "
                       f"{number}GB \\(10\\^9 bytes\\)"):
        parse_size(text)


def test_plural() -> None:
    assert [units.plural(n, "stage") for n in (0, 1, 2)] == ["0 stages", "1 stage", "2 stages"]
    assert units.plural(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert units.plural(3, "micro-batch", "micro-batches") == "3 micro-batches"


@pytest.mark.parametrize("text", ["0GiB", "0.0MB", "0G"])
def test_parse_size_refuses_zero(text: str) -> None:
    with pytest.raises(ValueError, match="memory size must be positive"):
        parse_size(text)


@pytest.mark.parametrize("size", [1, 512, 1536, 3 * MIB, 80 * GIB, 2 * 2**40])  # parse_size stops at TiB
def test_binary_sizes_round_trip(size: int) -> None:
    """What format_bytes writes for an exact binary size, parse_size reads back (units joined)."""
    text = format_bytes(size)
    assert parse_size(text.replace(" ", "")) == size


@pytest.mark.parametrize("size", [1000, 123_456_789, 81_604_378_624])
def test_round_trip_within_three_digits(size: int) -> None:
    assert parse_size(format_bytes(size).replace(" ", "")) == pytest.approx(size, rel=5e-3)


@pytest.mark.parametrize(
    ("largest", "unit"),
    [(0, (1, "B")), (1023, (1, "B")), (1024, (1024, "KiB")), (5 * MIB, (MIB, "MiB")),
     (80 * GIB, (GIB, "GiB")), (3 * 2**40, (2**40, "TiB")), (2**70, (2**50, "PiB")), (-4096, (1024, "KiB"))],
)
def test_byte_unit(largest: float, unit: tuple[float, str]) -> None:
    assert byte_unit(largest) == unit


def test_format_bytes_nan_and_infinity() -> None:
    assert format_bytes(float("nan")) == "? B"
    assert format_bytes(float("inf")) == "inf PiB"


def test_format_bytes_stays_in_the_unit_it_rounds_up_to() -> None:
    # 1023.99 KiB rounds to 1024 at three digits: the unit is chosen before rounding, as before.
    assert format_bytes(1024 * 1024 - 1) == "1024 KiB"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.009, "9 ms"), (0.0123456, "12.35 ms"), (1.5, "1500 ms"), (2.5e-7, "0.00025 ms"), (0, "0 ms")],
)
def test_format_ms(seconds: float, text: str) -> None:
    assert format_ms(seconds) == text


def test_format_ms_digits() -> None:
    assert format_ms(0.0123456, digits=3) == "12.3 ms"


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0"), (999, "999"), (1000, "1.00K"), (1500, "1.50K"), (999_999, "1000K"), (124_439_808, "124M"),
     (7_000_000_000, "7.00B")],
)
def test_format_count(n: int, text: str) -> None:
    assert format_count(n) == text


def test_format_seconds_hours() -> None:
    assert format_seconds(3 * 3600 + 125) == "3 h 2 min"
    assert format_seconds(float("nan")) == "? s"


def test_old_homes_are_the_same_functions() -> None:
    """table, figures and cli keep their public names, now the ones from partitioner.units."""
    assert table.format_bytes is format_bytes and table.format_seconds is format_seconds
    assert figures.byte_unit is byte_unit
    assert cli.parse_size is parse_size


def test_pure_modules_import_without_torch() -> None:
    """units, commcost and defaults (and the solver's problem) load where torch cannot be imported."""
    code = textwrap.dedent(f"""
        import sys, types
        sys.modules["torch"] = None  # any `import torch` now fails
        package = types.ModuleType("partitioner")  # skip partitioner/__init__, which imports the planner
        package.__path__ = [{str(Path(units.__file__).parent)!r}]
        sys.modules["partitioner"] = package
        import partitioner.cost.comm, partitioner.defaults, partitioner.solve.problem, partitioner.units
        print(partitioner.units.format_bytes(partitioner.units.parse_size("1GiB")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1.00 GiB"
