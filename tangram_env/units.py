"""Human units for configuration: durations ("500ms", "5m") and sizes ("2GiB", "512MB")."""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import BeforeValidator

_DURATION = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "": 1.0}
_SIZE = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}  # fmt: skip
# A sign is read, so that "-5" reaches the setting's own bound ("greater than 0"), which names it.
_NUMBER_UNIT = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def _split(text: str) -> tuple[float, str]:
    match = _NUMBER_UNIT.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a number with an optional unit")
    return float(match.group(1)), match.group(2).lower()


def _finite(value: float, what: str) -> float:
    # inf and nan come from TOML (inf, nan) and JSON (Infinity, NaN); both would pass a bound such as
    # gt=0 or mean "never" where the setting has no such meaning.
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return value


def parse_duration(value: str | float | int) -> float:
    """Seconds from a number (seconds) or a string such as ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"``.

    Signed: a negative duration is left to the caller's bound. NaN and infinity are refused.
    """
    if isinstance(value, int | float):
        return _finite(float(value), "a duration")
    number, unit = _split(value)
    if unit not in _DURATION:
        raise ValueError(f"unknown duration unit {unit!r} in {value!r}; use one of ms, s, m, h")
    return number * _DURATION[unit]


def _size_number(value: str | float | int) -> tuple[float, str]:
    number, unit = (float(value), "") if isinstance(value, int | float) else _split(value)
    _finite(number, "a size")
    if number < 0 and not isinstance(value, int | float):
        # Refused here rather than by a bound: not every caller of these parsers has one.
        raise ValueError(f"a size cannot be negative, got {value!r}")
    return number, unit


def parse_size(value: str | float | int) -> int:
    """Bytes from a number (bytes) or a string such as ``"512MB"``, ``"2GiB"``, ``"64k"``."""
    number, unit = _size_number(value)
    if unit not in _SIZE:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use e.g. KiB, MiB, GiB, MB, GB")
    return int(number * _SIZE[unit])


def parse_size_mb(value: str | float | int) -> int:
    """Mebibytes from a number or a bare numeric string (already MiB: ``"1024"`` -> 1024, as a CLI flag
    reads) or a size string (``"2GiB"`` -> 2048).
    """
    number, unit = _size_number(value)
    if not unit:
        return int(number)
    return parse_size(value) // 2**20


#: Pydantic field types that accept human units; none takes NaN or infinity.
Seconds = Annotated[float, BeforeValidator(parse_duration)]
Bytes = Annotated[int, BeforeValidator(parse_size)]
MiB = Annotated[int, BeforeValidator(parse_size_mb)]
