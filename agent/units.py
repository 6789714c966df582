"""Byte quantities written the way Kubernetes users write them (`4Gi`, `512Mi`, `1G`)."""

from __future__ import annotations

import re

_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_QUANTITY = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([kKMGT]i?)?\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Parse an integer byte count or a Kubernetes quantity string into bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a byte size, not a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected a whole number of bytes, got {value}")
        return int(value)
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(
            f"cannot read {value!r} as a size; write bytes (1048576) or a quantity (1Mi, 4Gi)"
        )
    number, suffix = match.group(1), match.group(2) or ""
    return int(float(number) * _SUFFIXES[suffix])


def format_bytes(n: float) -> str:
    """Render a byte count with a binary suffix, for tables and logs."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
