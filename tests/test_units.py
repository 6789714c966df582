"""Sizes mean what the Kubernetes API server means by them.

`reference_quantity` follows the hand-written scanner of apimachinery's `parseQuantityString`
and its suffixer (`resource/quantity.go`, `resource/suffix.go`) character by character: sign,
integer digits, optional `.` and fraction digits, then a suffix made of the characters
`eEinumkKMGTP`, optionally a sign and digits, interpreted as a binary or decimal SI suffix or as
a decimal exponent. kvtier's regex-based parser must agree with it on every string.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from kvtier.api.units import QuantityError, parse_bytes, parse_quantity

ROOT = Path(__file__).resolve().parent.parent
_SUFFIX_CHARS = "eEinumkKMGTP"
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def reference_quantity(text: str) -> Fraction | None:
    """The value apimachinery's scanner gives `text`, or None where it reports an error.

    Exponents beyond kvtier's ±1000 are left out by the callers (see `reference_exponent`)."""
    pos, end = 0, len(text)
    if end == 0:
        return None
    sign = 1
    if text[pos] in "+-":
        sign = -1 if text[pos] == "-" else 1
        pos += 1
    start = pos
    while pos < end and text[pos].isdigit():
        pos += 1
    whole = text[start:pos]
    fraction = ""
    if pos < end and text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos].isdigit():
            pos += 1
        fraction = text[start:pos]
    if not whole and not fraction:
        return None
    suffix_start = pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and text[pos] in "+-":
        pos += 1
    while pos < end and text[pos].isdigit():
        pos += 1
    if pos != end:
        return None
    suffix = text[suffix_start:]
    value = Fraction(int(whole or "0")) + (
        Fraction(int(fraction), 10 ** len(fraction)) if fraction else 0
    )
    if suffix in _BINARY:
        return sign * value * 2 ** _BINARY[suffix]
    if suffix in _DECIMAL:
        return sign * value * Fraction(10) ** _DECIMAL[suffix]
    exponent = reference_exponent(text)
    if exponent is not None:
        return sign * value * Fraction(10) ** exponent
    return None


def reference_exponent(text: str) -> int | None:
    match = re.search(r"[0-9.][eE]([+-]?[0-9]+)$", text)
    return int(match.group(1)) if match else None


def kvtier_reads(text: str) -> Fraction | None:
    try:
        return parse_quantity(text)
    except QuantityError:
        return None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4Gi", 4 << 30),
        ("512Mi", 512 << 20),
        ("1G", 10**9),
        ("1.5Ki", 1536),
        ("1Pi", 1 << 50),
        ("1Ei", 1 << 60),
        ("2P", 2 * 10**15),
        ("1E", 10**18),  # a suffix, not an exponent
        ("1E3", 1000),  # an exponent
        ("2e9", 2 * 10**9),
        ("12e-1", 2),  # 1.2 bytes, rounded up as Quantity.Value() rounds
        ("1500m", 2),
        ("100n", 1),
        (".5Gi", 1 << 29),
        ("5.", 5),
        ("+1k", 1000),
        ("-1k", -1000),
    ],
)
def test_documented_quantities(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["1K", "1Kib", "4 Gi", " 4Gi", "Gi", "1e", "1e1.5", "1.5.5", "--1", ".", "", "1b"]
)
def test_strings_the_api_server_refuses(text: str) -> None:
    with pytest.raises(QuantityError, match="Kubernetes quantity"):
        parse_bytes(text)


def test_agrees_with_the_api_server_scanner_on_every_short_string() -> None:
    alphabet = "019.+-eEKMGiPnm "
    checked = 0
    for length in range(1, 5):
        for chars in itertools.product(alphabet, repeat=length):
            text = "".join(chars)
            assert kvtier_reads(text) == reference_quantity(text), text
            checked += 1
    assert checked > 60_000


def test_agrees_with_the_api_server_scanner_on_random_strings() -> None:
    rng = random.Random(7)
    alphabet = "0123456789.+-eEinumkKMGTP"
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10)))
        exponent = reference_exponent(text)
        if exponent is not None and abs(exponent) > 1000:
            assert kvtier_reads(text) is None, text
            continue
        assert kvtier_reads(text) == reference_quantity(text), text


def test_hostile_exponents_are_refused_at_once() -> None:
    for text in ("1e-999999999", "0e999999999", "1e999999999"):
        with pytest.raises(QuantityError, match="exponents up to"):
            parse_bytes(text)
    assert parse_bytes("1e-1000") == 1
    with pytest.raises(QuantityError, match="more bytes"):
        parse_bytes("1e1000")
    assert parse_bytes("9223372036854775807") == 2**63 - 1
    with pytest.raises(QuantityError, match="more bytes"):
        parse_bytes("8Ei")


def test_every_size_the_crd_admits_parses_to_the_same_bytes() -> None:
    """The CRD's size pattern is a subset of the quantity grammar: whatever the API server
    stores in a KVCacheTier, the agent and operator read as the same positive byte count."""
    crd = yaml.safe_load((ROOT / "crds" / "kvcachetier.yaml").read_text())
    patterns = {
        value
        for value in _walk(crd, "pattern")
        if isinstance(value, str) and value.startswith("^([1-9]")
    }
    assert len(patterns) == 1
    size = re.compile(patterns.pop())
    rng = random.Random(11)
    admitted = 0
    for _ in range(5_000):
        number = rng.choice(["0", "1", "7", "10", "250"]) + rng.choice(["", ".5", ".25", ".0"])
        text = number + rng.choice(["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "P"])
        if size.fullmatch(text) is None:
            continue
        admitted += 1
        reference = reference_quantity(text)
        assert reference is not None
        if reference >= 2**63:
            with pytest.raises(QuantityError, match="more bytes"):
                parse_bytes(text)
        else:
            assert parse_bytes(text) == math.ceil(reference) > 0
    assert admitted > 1_000


def _walk(node: object, key: str) -> list[object]:
    if isinstance(node, dict):
        found = [node[key]] if key in node else []
        return found + [v for child in node.values() for v in _walk(child, key)]
    if isinstance(node, list):
        return [v for child in node for v in _walk(child, key)]
    return []
