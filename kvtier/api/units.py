"""Byte quantities read exactly as the Kubernetes API server reads them.

A size in a KVCacheTier, a Helm value or the agent's config must mean the same number of bytes
to kvtier as it does to the API server that stored it (`resource.ParseQuantity` in
k8s.io/apimachinery), so the grammar below is the documented one:

    <quantity>        ::= <signedNumber><suffix>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedInteger> | "E" <signedInteger>
    <signedNumber>    ::= <number> | <sign><number>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>

No spaces are allowed, `K` alone is not a suffix (only `k` and `Ki`), `1E` is an exa and `1E3`
is a thousand. A quantity's byte count is its value rounded up to a whole number, as
`Quantity.Value()` rounds it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_MULTIPLIERS: dict[str, Fraction] = {
    **{prefix: Fraction(10) ** (-3 * (3 - n)) for n, prefix in enumerate("num")},
    "": Fraction(1),
    **{prefix: Fraction(10) ** (3 * (n + 1)) for n, prefix in enumerate("kMGTPE")},
    **{f"{prefix}i": Fraction(2) ** (10 * (n + 1)) for n, prefix in enumerate("KMGTPE")},
}
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<suffix>[KMGTPE]i|[numkMGTPE])|[eE](?P<exponent>[+-]?[0-9]+))?"
)
# The API server refuses quantities whose value does not fit its int64 scaled arithmetic;
# a byte count beyond int64 cannot be a real size either.
_INT64_MAX = 2**63 - 1
# The one place kvtier is stricter than the API server: a hostile `1e999999999` would make an
# exact power of ten cost seconds and memory, and no size is outside ±1000 decimal places.
_MAX_EXPONENT = 1000


class QuantityError(ValueError):
    """A string that the Kubernetes API server would not accept as a quantity."""


def parse_quantity(text: str) -> Fraction:
    """The exact value of a Kubernetes quantity string."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise QuantityError(
            f"cannot read {text!r} as a Kubernetes quantity; write a number with an optional "
            "suffix (Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E) or exponent, e.g. 4Gi, 512Mi, "
            "1G, 2e9"
        )
    value = Fraction(match["number"])
    if match["exponent"] is None:
        return value * _MULTIPLIERS[match["suffix"] or ""]
    exponent = int(match["exponent"])
    if abs(exponent) > _MAX_EXPONENT:
        raise QuantityError(
            f"{text!r} has exponent {exponent}; kvtier reads exponents up to "
            f"±{_MAX_EXPONENT} (no size needs more), write the size with a suffix, e.g. 4Gi"
        )
    return value * Fraction(10) ** exponent


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
    exact = parse_quantity(value)
    count = math.ceil(exact) if exact > 0 else math.floor(exact)
    if abs(count) > _INT64_MAX:
        raise QuantityError(f"{value!r} is more bytes than a Kubernetes quantity can hold")
    return count


def format_bytes(n: float) -> str:
    """Render a byte count with a binary suffix, for tables and logs."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
