"""Kubernetes quantity grammar, exact arithmetic and Go-compatible rendering."""

from __future__ import annotations

import math
import pickle
import re
import time
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.quantity import (
    Quantity,
    QuantityError,
    QuantityFormat,
    format_binary_si,
    parse_quantity,
)

# The CRD pattern, used as an independent oracle for what the grammar accepts.
CRD_PATTERN = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

VALID = [
    ("8Gi", Fraction(8 * 2**30)),
    ("4096Mi", Fraction(4096 * 2**20)),
    ("1.5Gi", Fraction(3 * 2**29)),
    ("1Ki", Fraction(1024)),
    ("1Ti", Fraction(2**40)),
    ("1Pi", Fraction(2**50)),
    ("1Ei", Fraction(2**60)),
    ("100m", Fraction(1, 10)),
    ("1n", Fraction(1, 10**9)),
    ("5u", Fraction(5, 10**6)),
    ("12k", Fraction(12000)),
    ("3M", Fraction(3 * 10**6)),
    ("2G", Fraction(2 * 10**9)),
    ("1T", Fraction(10**12)),
    ("1P", Fraction(10**15)),
    ("1E", Fraction(10**18)),
    ("1e3", Fraction(1000)),
    ("1E3", Fraction(1000)),
    ("1e+3", Fraction(1000)),
    ("25e-1", Fraction(5, 2)),
    ("1.5e2", Fraction(150)),
    ("1.5", Fraction(3, 2)),
    ("-1.5", Fraction(-3, 2)),
    ("+7", Fraction(7)),
    ("5.", Fraction(5)),
    (".5", Fraction(1, 2)),
    ("0", Fraction(0)),
    ("-0", Fraction(0)),
    ("0.000", Fraction(0)),
    ("007", Fraction(7)),
    ("-2Mi", Fraction(-2 * 2**20)),
]


@pytest.mark.parametrize(("text", "expected"), VALID, ids=[t for t, _ in VALID])
def test_parse_valid(text: str, expected: Fraction) -> None:
    assert CRD_PATTERN.match(text), "test table must only hold grammar-valid strings"
    assert Quantity.parse(text).as_fraction() == expected


INVALID = [
    "",
    ".",
    "+",
    "-",
    "Gi",
    "1e",
    "1.5.5",
    "1 ",
    " 1",
    "1Gib",
    "1i",
    "1ki",
    "1KI",
    "abc",
    "1,5",
    "1e1.5",  # grammar-valid exponent, but Go requires an integer exponent
    "2e.0",
    "0x10",
    "1e99999",  # exponent too large to materialise
]


@pytest.mark.parametrize("text", INVALID, ids=[repr(t) for t in INVALID])
def test_parse_invalid_raises_with_text(text: str) -> None:
    with pytest.raises(QuantityError) as info:
        Quantity.parse(text)
    assert info.value.text == text
    assert isinstance(info.value, ValueError)
    assert repr(text) in str(info.value)


def test_parse_rejects_non_string() -> None:
    with pytest.raises(QuantityError):
        parse_quantity(12)  # type: ignore[arg-type]


VALUE_CEIL = [
    ("1.5", 2),
    ("100m", 1),
    ("-1.5", -1),
    ("-100m", 0),
    ("0.5", 1),
    ("1", 1),
    ("8Gi", 8 * 2**30),
    ("1.5Gi", 1610612736),
    ("1n", 1),
    ("999999999n", 1),
    ("1000000001n", 2),
    ("0", 0),
]


@pytest.mark.parametrize(("text", "expected"), VALUE_CEIL, ids=[t for t, _ in VALUE_CEIL])
def test_value_rounds_towards_positive_infinity(text: str, expected: int) -> None:
    assert Quantity.parse(text).value() == expected


SUB_NANO = [
    ("1e-10", Fraction(1, 10**9)),
    ("0.0000000001", Fraction(1, 10**9)),
    ("1.0000000001", Fraction(10**9 + 1, 10**9)),
    ("-1e-10", Fraction(-1, 10**9)),
    ("1e-400", Fraction(1, 10**9)),
]


@pytest.mark.parametrize(("text", "expected"), SUB_NANO, ids=[t for t, _ in SUB_NANO])
def test_sub_nano_precision_rounds_away_from_zero_like_go(text: str, expected: Fraction) -> None:
    assert Quantity.parse(text).as_fraction() == expected


CANONICAL = [
    ("8Gi", "8Gi"),
    ("4096Mi", "4Gi"),
    ("1.5Gi", "1536Mi"),
    ("0.5Gi", "512Mi"),
    ("1.5Ki", "1536"),
    ("0.1Ki", "102400m"),
    ("1000", "1k"),
    ("1024", "1024"),
    ("100m", "100m"),
    ("0.5", "500m"),
    ("1.5", "1500m"),
    ("-1.5", "-1500m"),
    ("1e3", "1e3"),
    ("12e2", "1200"),
    ("1E", "1E"),
    ("1000E", "1e21"),
    ("0Gi", "0"),
    ("-0", "0"),
    ("-2Mi", "-2Mi"),
    ("2n", "2n"),
    ("1e-10", "1e-9"),
    ("12k", "12k"),
]


@pytest.mark.parametrize(("text", "expected"), CANONICAL, ids=[t for t, _ in CANONICAL])
def test_str_is_go_canonical(text: str, expected: str) -> None:
    q = Quantity.parse(text)
    assert str(q) == expected
    assert Quantity.parse(str(q)) == q


BINARY_SI = [
    (4 * 2**30, "4Gi"),
    (4095 * 2**20, "4095Mi"),
    (1536 * 2**20, "1536Mi"),
    (0, "0"),
    (1024, "1Ki"),
    (1023, "1023"),
    (1500, "1500"),
    (1, "1"),
    (2**60, "1Ei"),
    (-2048, "-2Ki"),
]


@pytest.mark.parametrize(("n", "expected"), BINARY_SI, ids=[s for _, s in BINARY_SI])
def test_format_binary_si(n: int, expected: str) -> None:
    assert format_binary_si(n) == expected
    assert str(Quantity.from_int(n, binary=True)) == expected
    assert Quantity.parse(expected).value() == n


def test_binary_si_beyond_ei_and_int64_cap() -> None:
    assert format_binary_si(2**70) == "1024Ei"
    # Go caps parsed BinarySI amounts at the int64 maximum; decimal ones are not capped.
    assert Quantity.parse("1024Ei").value() == (1 << 63) - 1
    assert Quantity.parse("-1024Ei").value() == -((1 << 63) - 1)
    assert Quantity.parse("10000E").value() == 10**22


def test_from_int_decimal_and_binary() -> None:
    assert str(Quantity.from_int(2)) == "2"
    assert str(Quantity.from_int(2000)) == "2k"
    assert Quantity.from_int(2).format is QuantityFormat.DECIMAL_SI
    assert Quantity.from_int(4096, binary=True).format is QuantityFormat.BINARY_SI
    assert Quantity.from_int(5).value() == 5


def test_equality_ignores_format_and_hash_agrees() -> None:
    a, b = Quantity.parse("1Ki"), Quantity.parse("1024")
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, Quantity.parse("1.024k")}) == 1
    assert a != Quantity.parse("1k")
    assert a != "1Ki"


def test_ordering_and_arithmetic_are_exact() -> None:
    third = [Quantity.parse("0.1"), Quantity.parse("0.2")]
    assert sum(third) == Quantity.parse("0.3")  # 0.1 + 0.2 == 0.3, unlike floats
    assert Quantity.parse("1.5Gi") < Quantity.parse("1537Mi")
    assert Quantity.parse("1.5Gi") <= Quantity.parse("1536Mi")
    assert Quantity.parse("2") > Quantity.parse("1999m")
    assert Quantity.parse("2") >= Quantity.parse("2000m")
    assert Quantity.parse("1Gi") - Quantity.parse("512Mi") == Quantity.parse("512Mi")
    assert -Quantity.parse("1") == Quantity.parse("-1")
    assert not Quantity.parse("0")
    assert Quantity.parse("1n")


def test_add_keeps_receiver_format_unless_zero() -> None:
    binary = Quantity.parse("1Gi")
    decimal = Quantity.parse("1k")
    assert (binary + decimal).format is QuantityFormat.BINARY_SI
    assert (Quantity.parse("0") + binary).format is QuantityFormat.BINARY_SI


def test_immutable_and_picklable() -> None:
    q = Quantity.parse("3Gi")
    with pytest.raises(AttributeError):
        q._nanos = 5  # type: ignore[misc]
    clone = pickle.loads(pickle.dumps(q))
    assert clone == q
    assert str(clone) == "3Gi"


def test_repr() -> None:
    assert repr(Quantity.parse("1536Mi")) == "Quantity('1536Mi')"


def test_parsing_is_fast() -> None:
    texts = [f"{i % 5000}Mi" for i in range(250_000)]
    start = time.perf_counter()
    for text in texts:
        Quantity.parse(text)
    assert time.perf_counter() - start < 2.0


# --- property tests -----------------------------------------------------------------

_SUFFIX_FACTOR = {
    "": Fraction(1),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}


def _nano_round(x: Fraction) -> Fraction:
    """Go's parse rounding: |x| up to a multiple of 10^-9, sign kept."""
    scaled = abs(x) * 10**9
    rounded = math.ceil(scaled)
    return Fraction(rounded if x >= 0 else -rounded, 10**9)


@st.composite
def quantity_strings(draw: st.DrawFn) -> tuple[str, Fraction]:
    sign = draw(st.sampled_from(["", "+", "-"]))
    whole = draw(st.integers(min_value=0, max_value=10**12))
    frac_digits = draw(st.text("0123456789", max_size=12))
    kind = draw(st.sampled_from(["suffix", "exponent"]))
    if kind == "suffix":
        suffix = draw(st.sampled_from(sorted(_SUFFIX_FACTOR)))
        factor = _SUFFIX_FACTOR[suffix]
    else:
        exp = draw(st.integers(min_value=-20, max_value=20))
        suffix = f"e{exp}"
        factor = Fraction(10) ** exp
    number = f"{whole}.{frac_digits}" if frac_digits else str(whole)
    value = Fraction(int(f"{whole}{frac_digits}"), 10 ** len(frac_digits)) * factor
    if sign == "-":
        value = -value
    return f"{sign}{number}{suffix}", value


@given(quantity_strings())
def test_parse_agrees_with_exact_fraction_arithmetic(case: tuple[str, Fraction]) -> None:
    text, exact = case
    assert CRD_PATTERN.match(text)
    q = Quantity.parse(text)
    expected = _nano_round(exact)
    if text.endswith("i"):
        # Go caps BinarySI values at the int64 maximum.
        cap = Fraction((1 << 63) - 1)
        expected = max(min(expected, cap), -cap)
    assert q.as_fraction() == expected
    assert q.value() == math.ceil(expected)


@given(quantity_strings())
def test_canonical_string_round_trips(case: tuple[str, Fraction]) -> None:
    q = Quantity.parse(case[0])
    again = Quantity.parse(str(q))
    assert again == q
    assert str(again) == str(q)


@given(quantity_strings(), quantity_strings())
def test_ordering_and_sum_agree_with_fractions(
    a: tuple[str, Fraction], b: tuple[str, Fraction]
) -> None:
    qa, qb = Quantity.parse(a[0]), Quantity.parse(b[0])
    fa, fb = qa.as_fraction(), qb.as_fraction()
    assert (qa < qb) == (fa < fb)
    assert (qa == qb) == (fa == fb)
    assert (qa >= qb) == (fa >= fb)
    assert (qa + qb).as_fraction() == fa + fb


@given(st.integers(min_value=-(2**62), max_value=2**62))
def test_binary_si_round_trip(n: int) -> None:
    text = format_binary_si(n)
    assert Quantity.parse(text).value() == n
