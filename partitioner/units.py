"""Units: reading sizes people type and writing bytes, seconds and counts for people to read.

One home for every unit conversion in the text a plan shows (the stage table,
``report.md``, the figures' axes) and for the sizes the command line reads, so
that "MiB" means the same thing everywhere.  Pure Python: no torch.

Example::

    >>> parse_size("80GiB") == 80 * GIB
    True
    >>> format_bytes(parse_size("512MiB")), format_seconds(0.0123), format_ms(0.009)
    ('512 MiB', '12.3 ms', '9 ms')
"""

from __future__ import annotations

import math
import os
import re

__all__ = [
    "GIB",
    "MIB",
    "SIZE_HELP",
    "byte_unit",
    "env_seconds",
    "format_bytes",
    "format_count",
    "format_ms",
    "format_seconds",
    "parse_size",
    "plural",
]

MIB = 2**20
GIB = 2**30

# Binary units, smallest first: the ladder format_bytes and byte_unit climb.
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# What parse_size accepts after the number (lower case): SI for "GB", IEC for "GiB", and a
# lone letter ("80G") as binary, as nvidia-smi, torch.cuda and most people mean it.
_SIZE_UNITS = {
    "b": 1,
    **{f"{p}b": 10 ** (3 * i) for i, p in enumerate("kmgt", start=1)},
    **{f"{p}ib": 2 ** (10 * i) for i, p in enumerate("kmgt", start=1)},
    **{p: 2 ** (10 * i) for i, p in enumerate("kmgt", start=1)},
}
SIZE_HELP = "80G or 80GiB = 80 x 2^30 bytes, 80GB = 80 x 10^9; also K, M, T (a bare number is refused)"

# (below, multiplier, unit): a duration under ``below`` seconds is shown as seconds x multiplier.
_TIME_UNITS = ((1e-6, 1e9, "ns"), (1e-3, 1e6, "µs"), (1.0, 1e3, "ms"), (60.0, 1.0, "s"))
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> float:
    """A memory size in bytes: ``80G`` / ``80GiB`` (binary), ``40GB`` (decimal), ``512M``, ``1024B``.

    A lone unit letter is binary (``G`` = GiB), as ``nvidia-smi`` and most people mean it;
    ``GB`` is 10^9.  A bare number is refused rather than read as bytes: ``80`` almost
    certainly meant 80 GiB, and a cap of 80 bytes fits nothing.

    >>> parse_size("80G") == parse_size("80GiB") == 80 * 1024**3, parse_size("40GB"), parse_size("1.5KiB")
    (True, 40000000000.0, 1536.0)
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is not None and unit == "":
        raise ValueError(
            f"{text.strip()!r} has no unit; write {match.group(1)}G (GiB, 2^30 bytes), "
            f"{match.group(1)}GB (10^9 bytes), {match.group(1)}M or {match.group(1)}B"
        )
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; write a number with a unit such as "
            "80G (= 80GiB), 40GB, 512MiB or 1024B"
        )
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1.

    >>> plural(1, "stage"), plural(4, "replica"), plural(2, "micro-batch", "micro-batches")
    ('1 stage', '4 replicas', '2 micro-batches')
    """
    return f"{n} {word if n == 1 else many or word + 's'}"


def byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, name) of the binary unit that shows ``largest`` bytes readably.

    For a figure's axis, where every value shares the unit of the largest one.

    >>> byte_unit(3 * 2**30), byte_unit(1023)
    ((1073741824, 'GiB'), (1, 'B'))
    """
    power = 0
    while power + 1 < len(_BINARY) and abs(largest) >= 1024 ** (power + 1):
        power += 1
    return 1024**power, _BINARY[power]


def format_bytes(n: float) -> str:
    """Bytes in binary units with three significant digits.

    >>> [format_bytes(n) for n in (0, 512, 1536, 80 * 1024**3, -2048)]
    ['0 B', '512 B', '1.50 KiB', '80.0 GiB', '-2.00 KiB']
    """
    if math.isnan(n):
        return "? B"
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    divisor, unit = byte_unit(value)
    if divisor == 1:
        return f"{sign}{value:.0f} B"
    return f"{sign}{_three_digits(value / divisor)} {unit}"


def format_seconds(s: float) -> str:
    """A duration in the unit that suits it: ns, µs, ms, s, or minutes and seconds.

    >>> [format_seconds(s) for s in (0, 2.5e-6, 0.0123, 4.0, 200, 7300)]
    ['0 s', '2.50 µs', '12.3 ms', '4.00 s', '3 min 20 s', '2 h 1 min']
    """
    if math.isnan(s):
        return "? s"
    if s < 0:
        return "-" + format_seconds(-s)
    if s == 0:
        return "0 s"
    for below, multiplier, unit in _TIME_UNITS:
        if s < below:
            return f"{_three_digits(s * multiplier)} {unit}"
    minutes, seconds = divmod(round(s), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def format_ms(seconds: float, *, digits: int = 4) -> str:
    """Seconds as milliseconds with ``digits`` significant digits: one unit for a whole report.

    >>> format_ms(0.009), format_ms(0.0123456), format_ms(0.0123456, digits=3)
    ('9 ms', '12.35 ms', '12.3 ms')
    """
    return f"{seconds * 1e3:.{digits}g} ms"


def format_count(n: int) -> str:
    """A count with a K / M / B suffix and three significant digits (parameters).

    >>> [format_count(n) for n in (2, 1500, 124_439_808, 7_000_000_000)]
    ['2', '1.50K', '124M', '7.00B']
    """
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{_three_digits(n / scale)}{suffix}"
    return str(n)


def _three_digits(value: float) -> str:
    if round(value, 2) < 10:
        return f"{value:.2f}"
    if round(value, 1) < 100:
        return f"{value:.1f}"
    return f"{value:.0f}"


def env_seconds(name: str, default: float, *, what: str, example: float, zero: bool = False) -> float:
    """Seconds from environment variable ``name`` (``default`` when unset), positive (or 0 with ``zero``).

    ``what`` says what the seconds are for, in the error a bad value gets.

    >>> env_seconds("AUTOPARTITION_UNSET_EXAMPLE", 30.0, what="to wait", example=60)
    30.0
    """
    from partitioner.errors import AutopartitionError

    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 if zero else value > 0):
        raise AutopartitionError(f"{name}={text!r}: give the seconds {what}, e.g. {name}={example:g}.")
    return value
