"""Kubernetes ``resource.Quantity`` with the semantics of the Go implementation.

Why not floats: CR exhaustion is decided by comparing sums of amounts such as
"1.5Gi" against sums of used memory, and the reference does that with exact decimal
arithmetic. A float would flip the outcome at the boundary.

Representation: Go rounds every parsed quantity *away from zero* to nano precision
(10^-9) so that "if you want some resources, you get some", which makes the whole value
set exactly ``k * 10^-9`` for an integer ``k``. We store ``k`` (a Python int), so
equality, ordering, hashing and addition are plain integer operations: exact and fast.
The format (BinarySI / DecimalSI / DecimalExponent) is kept only to render ``str()``
the way Go's ``String()`` does; like in Go it never takes part in comparisons.

Deliberate deviations from Go (all outside anything a real cluster produces) are listed,
with the reasons, in ``docs/semantics.md``: values are unbounded Python ints (Go's
``Value()`` and ``NewQuantity(int64)`` would overflow int64), exponents above
``_MAX_EXPONENT`` are rejected instead of allocating gigantic integers, exponents beyond
32 bits are rejected (Go truncates them to int32), and a DecimalSI value whose exponent
has no SI suffix (beyond "E") renders as ``<n>e<exp>`` (Go drops the exponent).
"""

from __future__ import annotations

import enum
import functools
import re
from fractions import Fraction
from typing import Final

__all__ = [
    "Quantity",
    "QuantityError",
    "QuantityFormat",
    "format_binary_si",
    "format_decimal_si",
    "parse_quantity",
]


class QuantityError(ValueError):
    """Raised for a string that is not a valid quantity; ``.text`` is the offending input."""

    def __init__(
        self, text: object, reason: str = "quantities must match the regular expression"
    ) -> None:
        super().__init__(f"invalid quantity {text!r}: {reason}")
        self.text = text


class QuantityFormat(enum.IntEnum):
    """How Go would render the value; chosen from the suffix the value was parsed with."""

    DECIMAL_EXPONENT = 0
    BINARY_SI = 1
    DECIMAL_SI = 2


_NANO: Final = 10**9
# Go caps BinarySI amounts at the int64 maximum.
_MAX_BINARY_NANOS: Final = ((1 << 63) - 1) * _NANO
# Exponents beyond this would make us allocate enormous ints; no cluster sends them.
_MAX_EXPONENT: Final = 4096
_INT32_MAX: Final = (1 << 31) - 1

_QUANTITY_RE: Final = re.compile(
    r"([+-]?)([0-9]*)(?:\.([0-9]*))?"
    r"(?:([KMGTPE]i)|([numkMGTPE])|[eE]([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)))?"
)
_BINARY_SHIFT: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_EXP: Final = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX: Final = {v: k for k, v in _DECIMAL_EXP.items()} | {0: ""}
_BINARY_SUFFIX: Final = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def _ceil_div_abs(numerator: int, denominator: int) -> int:
    """Divide magnitudes rounding away from zero (Go's ``inf.RoundUp`` on |x|)."""
    q, r = divmod(abs(numerator), denominator)
    q += 1 if r else 0
    return -q if numerator < 0 else q


class Quantity:
    """An immutable, exact Kubernetes quantity. Build with :meth:`parse` or :meth:`from_int`."""

    __slots__ = ("_fmt", "_nanos", "_value")

    _nanos: int
    _fmt: QuantityFormat
    _value: int

    def __init__(self, nanos: int, fmt: QuantityFormat = QuantityFormat.DECIMAL_SI) -> None:
        object.__setattr__(self, "_nanos", nanos)
        object.__setattr__(self, "_fmt", fmt)
        # Precomputed: value() runs for every slot a query looks at, and parsed
        # quantities are shared through the parse cache, so this is paid once per string.
        object.__setattr__(self, "_value", -((-nanos) // _NANO))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Quantity is immutable")

    @staticmethod
    def parse(text: str) -> Quantity:
        """Parse a quantity string (cached: clusters repeat the same few strings a lot)."""
        return _parse_cached(text)

    @classmethod
    def from_int(cls, n: int, *, binary: bool = False) -> Quantity:
        """Like Go's ``NewQuantity(n, DecimalSI)`` (or ``BinarySI`` with ``binary=True``)."""
        fmt = QuantityFormat.BINARY_SI if binary else QuantityFormat.DECIMAL_SI
        return cls(int(n) * _NANO, fmt)

    @property
    def format(self) -> QuantityFormat:
        return self._fmt

    @property
    def nanos(self) -> int:
        """The exact value times 10^9 (an integer by construction)."""
        return self._nanos

    def as_fraction(self) -> Fraction:
        return Fraction(self._nanos, _NANO)

    def value(self) -> int:
        """Integer value rounded towards +infinity, like Go's ``Value()`` ("100m" -> 1)."""
        return self._value

    def is_zero(self) -> bool:
        return self._nanos == 0

    # Comparisons and arithmetic: value only, format ignored (as Go's Cmp/Equal).
    def __eq__(self, other: object) -> bool:
        if isinstance(other, Quantity):
            return self._nanos == other._nanos
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._nanos)

    def __lt__(self, other: Quantity) -> bool:
        return self._nanos < other._nanos

    def __le__(self, other: Quantity) -> bool:
        return self._nanos <= other._nanos

    def __gt__(self, other: Quantity) -> bool:
        return self._nanos > other._nanos

    def __ge__(self, other: Quantity) -> bool:
        return self._nanos >= other._nanos

    def __add__(self, other: Quantity) -> Quantity:
        if not isinstance(other, Quantity):
            return NotImplemented
        # Go's Add keeps the receiver's format unless the receiver is zero.
        fmt = other._fmt if self._nanos == 0 else self._fmt
        return Quantity(self._nanos + other._nanos, fmt)

    def __radd__(self, other: object) -> Quantity:
        # Lets the builtin sum() start from its int 0.
        if other == 0 and not isinstance(other, Quantity):
            return self
        return NotImplemented

    def __sub__(self, other: Quantity) -> Quantity:
        if not isinstance(other, Quantity):
            return NotImplemented
        return Quantity(self._nanos - other._nanos, self._fmt)

    def __neg__(self) -> Quantity:
        return Quantity(-self._nanos, self._fmt)

    def __bool__(self) -> bool:
        return self._nanos != 0

    def __repr__(self) -> str:
        return f"Quantity({str(self)!r})"

    def __str__(self) -> str:
        return _canonical(self._nanos, self._fmt)

    def __reduce__(self) -> tuple[type[Quantity], tuple[int, QuantityFormat]]:
        return (Quantity, (self._nanos, self._fmt))


ZERO: Final = Quantity(0)


def parse_quantity(text: str) -> Quantity:
    """Module-level alias of :meth:`Quantity.parse`."""
    return _parse_cached(text)


@functools.lru_cache(maxsize=65536)
def _parse_cached(text: str) -> Quantity:
    return _parse(text)


def _parse(text: str) -> Quantity:
    if not isinstance(text, str):
        raise QuantityError(text, "not a string")
    m = _QUANTITY_RE.fullmatch(text)
    if m is None:
        raise QuantityError(text)
    sign, whole, frac, bin_suffix, dec_suffix, exp_text = m.groups()
    frac = frac or ""
    if not whole and not frac:
        # The regex accepts "", "." and "+": the grammar requires at least one digit.
        raise QuantityError(text)

    mantissa = int(whole + frac) if (whole or frac) else 0
    scale10 = -len(frac)  # value = mantissa * 10^scale10 * 2^shift2
    shift2 = 0
    if bin_suffix is not None:
        shift2 = _BINARY_SHIFT[bin_suffix]
        fmt = QuantityFormat.BINARY_SI
    elif dec_suffix is not None:
        scale10 += _DECIMAL_EXP[dec_suffix]
        fmt = QuantityFormat.DECIMAL_SI
    elif exp_text is not None:
        scale10 += _parse_exponent(text, exp_text)
        fmt = QuantityFormat.DECIMAL_EXPONENT
    else:
        fmt = QuantityFormat.DECIMAL_SI

    if scale10 > _MAX_EXPONENT:
        raise QuantityError(text, "exponent too large")
    mantissa <<= shift2
    nano_scale = scale10 + 9
    if mantissa == 0:
        nanos = 0
    elif nano_scale >= 0:
        nanos = mantissa * 10**nano_scale
    elif -nano_scale > len(str(mantissa)):
        nanos = 1  # a positive value below one nano rounds up to 1n
    else:
        nanos = _ceil_div_abs(mantissa, 10**-nano_scale)

    if fmt is QuantityFormat.BINARY_SI:
        nanos = min(nanos, _MAX_BINARY_NANOS)
        if 0 < nanos < _NANO:
            fmt = QuantityFormat.DECIMAL_SI
    if sign == "-":
        nanos = -nanos
    return Quantity(nanos, fmt)


def _parse_exponent(text: str, exp_text: str) -> int:
    # Go parses the exponent as an int32; "1e1.5" matches the grammar but is rejected.
    try:
        exponent = int(exp_text)
    except ValueError:
        raise QuantityError(text, "exponent must be an integer") from None
    if abs(exponent) > _INT32_MAX:
        raise QuantityError(text, "exponent out of range")
    return exponent


def _remove_factors(value: int, base: int, limit: int | None = None) -> tuple[int, int]:
    times = 0
    while value % base == 0 and (limit is None or times < limit):
        value //= base
        times += 1
    return value, times


def _canonical(nanos: int, fmt: QuantityFormat) -> str:
    if nanos == 0:
        return "0"
    if fmt is QuantityFormat.BINARY_SI:
        # Go renders |x| < 1024 and values with a fractional part as DecimalSI.
        if -1024 * _NANO < nanos < 1024 * _NANO or nanos % _NANO:
            fmt = QuantityFormat.DECIMAL_SI
        else:
            sign = "-" if nanos < 0 else ""
            amount, times = _remove_factors(abs(nanos) // _NANO, 1024, len(_BINARY_SUFFIX) - 1)
            return f"{sign}{amount}{_BINARY_SUFFIX[times]}"

    sign = "-" if nanos < 0 else ""
    amount, times = _remove_factors(abs(nanos), 10)
    exponent = times - 9
    adjust = exponent % 3  # make the exponent a multiple of 3, growing the mantissa
    amount *= 10**adjust
    exponent -= adjust
    if fmt is QuantityFormat.DECIMAL_SI and exponent in _DECIMAL_SUFFIX:
        return f"{sign}{amount}{_DECIMAL_SUFFIX[exponent]}"
    return f"{sign}{amount}" + (f"e{exponent}" if exponent else "")


def format_binary_si(n_bytes: int) -> str:
    """Render a byte count as Go's ``NewQuantity(n, BinarySI).String()`` ("4Gi", "1500")."""
    return _canonical(int(n_bytes) * _NANO, QuantityFormat.BINARY_SI)


def format_decimal_si(n: int) -> str:
    """Render an integer as Go's ``NewQuantity(n, DecimalSI).String()`` ("100k", "1500").

    The canonical form moves trailing zeros into an SI suffix whose exponent is a multiple
    of 3 and as large as possible without a fraction: 1000 -> "1k", 1500 -> "1500",
    100000 -> "100k", 2000000 -> "2M".
    """
    return _canonical(int(n) * _NANO, QuantityFormat.DECIMAL_SI)
