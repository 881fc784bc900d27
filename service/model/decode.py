"""The one decoding entry point for API-server and Kafka JSON.

Centralised so that every caller gets the same Quantity handling (int-or-string, like
Go's ``Quantity.UnmarshalJSON``), the same ``null`` rule as Go's ``encoding/json`` (see
:mod:`service.model.gonull`) and the same error contract: only :class:`DecodeError`
escapes, and it names the offending field so a dead-lettered event says what was wrong.
"""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar

import msgspec

from service.model.gonull import zero_nulls
from service.quantity import ZERO, Quantity, QuantityError

__all__ = ["DecodeError", "encode_k8s", "from_k8s", "to_k8s"]

T = TypeVar("T")

_PATH_RE = re.compile(r" - at `(?P<path>\$[^`]*)`$")


class DecodeError(ValueError):
    """An object did not match its schema; ``path`` is like ``$.spec.amount`` (or None)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is Quantity:
        if obj is None:
            # Go's Quantity.UnmarshalJSON turns null into the zero quantity.
            return ZERO
        if isinstance(obj, str):
            # Go's UnmarshalJSON trims surrounding whitespace before parsing.
            return Quantity.parse(obj.strip())
        if isinstance(obj, bool):  # bool is an int subclass; JSON true is not a quantity
            raise QuantityError(obj, "expected a string or a number")
        if isinstance(obj, int):
            return Quantity.from_int(obj)
        if isinstance(obj, float):
            # A JSON number such as 1.5 is parsed from its text in Go; repr round-trips.
            return Quantity.parse(repr(obj))
        if isinstance(obj, Quantity):
            return obj
        raise QuantityError(obj, "expected a string or a number")
    raise NotImplementedError(f"cannot decode {type_!r}")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Quantity):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj)!r}")


@functools.lru_cache(maxsize=64)
def _json_decoder(type_: Any) -> msgspec.json.Decoder[Any]:
    # One Decoder per target type: building it is the expensive part of decoding.
    return msgspec.json.Decoder(type_, dec_hook=_dec_hook)


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)


def _to_decode_error(exc: Exception) -> DecodeError:
    message = str(exc)
    m = _PATH_RE.search(message)
    if m is not None:
        return DecodeError(message, m.group("path"))
    # Malformed JSON and top-level type mismatches carry no field path.
    return DecodeError(message, "$" if isinstance(exc, msgspec.ValidationError) else None)


def from_k8s(obj: dict[str, Any] | bytes | bytearray | memoryview | str, type_: type[T]) -> T:
    """Decode API-server JSON (raw bytes, or an already-parsed dict) into ``type_``.

    A ``null`` decodes as Go's ``encoding/json`` decodes it (:mod:`service.model.gonull`).
    """
    try:
        try:
            if isinstance(obj, bytes | bytearray | memoryview | str):
                target: Any = type_
                result: T = _json_decoder(target).decode(obj)
                return result
            if isinstance(obj, dict):
                return msgspec.convert(obj, type_, dec_hook=_dec_hook)
        except msgspec.ValidationError:
            # The rare slow path: parse untyped, apply Go's null rule, validate again. A
            # document without nulls fails again with the same error.
            doc = msgspec.json.decode(obj) if not isinstance(obj, dict) else obj
            return msgspec.convert(zero_nulls(doc, type_), type_, dec_hook=_dec_hook)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _to_decode_error(exc) from exc
    except (QuantityError, ValueError, TypeError) as exc:  # defensive: never leak others
        raise DecodeError(str(exc)) from exc
    raise DecodeError(f"expected a JSON document or a dict, got {type(obj).__name__}", None)


def to_k8s(obj: Any) -> Any:
    """Builtin form (dicts/lists/str) of a model, Quantities as canonical strings."""
    return msgspec.to_builtins(obj, enc_hook=_enc_hook)


def encode_k8s(obj: Any) -> bytes:
    """JSON bytes of a model or of a :func:`to_k8s` structure."""
    return _ENCODER.encode(obj)
