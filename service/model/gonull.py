"""Go's ``encoding/json`` rule for ``null``, for the documents Go programs write and read.

The reference decodes every input with ``encoding/json``, where ``null`` never fails: it
sets a pointer, slice, map or interface to nil and leaves any other value untouched, so a
field that is ``null`` ends up holding its zero value, exactly as if it were absent. Inside
a list or a map there is no "absent": a ``null`` element or map value *is* an element, the
zero value of the element type (a ``null`` Reservation allocation is an allocation, a
``null`` flavor is a flavor named ""). Go producers write nil slices and maps as ``null``,
and the API server keeps nulls in preserve-unknown-fields objects such as
``Knowledge.status.raw``, so both shapes reach this service.

Two mechanisms give the typed models the same behaviour:

* :data:`GoNull` marks a field (or a list element / map value type) of a *Nova* model whose
  ``null`` becomes the zero value. msgspec sees ``X | None``; the model's
  ``__post_init__`` replaces the None (see :mod:`service.model.nova`). These types are
  decoded by the Kafka codec's own msgspec decoder, so the rule has to live in the types.
* :func:`zero_nulls` rewrites an already-parsed document for any msgspec type. The
  Kubernetes decoder (:func:`service.model.from_k8s`) uses it only after a strict decode
  failed, so the common case (no nulls) stays a single C-level decode.

Type mismatches stay errors, as in Go (``"vcpus": "4"`` or ``-1`` for a ``uint64``), and
so do numbers wider than the Go field: :data:`Uint64` and :data:`Int64` carry the bounds
that ``encoding/json`` enforces (``UnmarshalTypeError`` beyond them).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Annotated, Any, Final, TypeVar

import msgspec
import msgspec.inspect as mi

__all__ = ["GO_NULL", "UINT64_MAX", "GoNull", "Int64", "Uint64", "check_uint64", "zero_nulls"]

T = TypeVar("T")

# Go's integer widths (int is 64 bits on the platforms the reference runs on). msgspec
# takes no bound beyond int64, so a struct with Uint64 fields calls check_uint64 on them in
# its __post_init__ (a ValueError there is a ValidationError of the decode).
UINT64_MAX: Final = 2**64 - 1
Uint64 = Annotated[int, msgspec.Meta(ge=0, extra_json_schema={"maximum": UINT64_MAX})]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def check_uint64(*values: int | None) -> None:
    """Refuse what ``encoding/json`` refuses for a ``uint64`` field: a number above 2^64 - 1."""
    for value in values:
        if value is not None and value > UINT64_MAX:
            raise ValueError("number overflows uint64")  # not the number: it may be huge


class _GoNullMarker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "GO_NULL"


GO_NULL: Final = _GoNullMarker()

if TYPE_CHECKING:
    # Type checkers see the value type only: after __post_init__ the None is gone.
    GoNull = Annotated[T, "null decodes as the zero value"]
else:
    GoNull = Annotated[T | None, GO_NULL]


def zero_nulls(doc: Any, type_: Any) -> Any:
    """``doc`` (builtins) with every ``null`` turned into what Go would decode for ``type_``.

    A null struct field is dropped (the model's default is Go's zero value) unless the
    field itself is optional; a null list element or map value becomes the zero value of
    the element type. Values of the wrong type are left alone for msgspec to reject.
    """
    return _zero_nulls(doc, _type_info(type_))


@functools.lru_cache(maxsize=256)
def _type_info(type_: Any) -> mi.Type:
    return mi.type_info(type_)


@functools.lru_cache(maxsize=256)
def _fields_by_wire_name(struct: type[msgspec.Struct]) -> dict[str, mi.Field]:
    info = _type_info(struct)
    assert isinstance(info, mi.StructType)
    return {f.encode_name: f for f in info.fields}


def _nullable(t: mi.Type) -> bool:
    return isinstance(t, mi.NoneType | mi.AnyType) or (
        isinstance(t, mi.UnionType) and any(isinstance(m, mi.NoneType) for m in t.types)
    )


def _zero_nulls(doc: Any, t: mi.Type) -> Any:
    if isinstance(t, mi.UnionType):
        if doc is None and _nullable(t):
            return None
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        return _zero_nulls(doc, members[0]) if len(members) == 1 else doc
    if doc is None:
        return _zero(t)
    if isinstance(t, mi.StructType) and isinstance(doc, dict):
        fields = _fields_by_wire_name(t.cls)
        out: dict[str, Any] = {}
        for key, value in doc.items():
            field = fields.get(key)
            if field is None:
                out[key] = value  # unknown keys are ignored by the decoder anyway
            elif value is None and not _nullable(field.type):
                if field.required:
                    out[key] = _zero(field.type)
                # else: absent, so the default (the zero value) applies
            else:
                out[key] = _zero_nulls(value, field.type)
        return out
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        if isinstance(doc, list):
            return [_zero_nulls(item, t.item_type) for item in doc]
        return doc
    if isinstance(t, mi.DictType) and isinstance(doc, dict):
        return {key: _zero_nulls(value, t.value_type) for key, value in doc.items()}
    return doc


def _zero(t: mi.Type) -> Any:
    """The document Go's zero value of ``t`` corresponds to (None where it has none)."""
    if isinstance(t, mi.StrType):
        return ""
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.IntType):
        return 0
    if isinstance(t, mi.FloatType):
        return 0.0
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        return []
    if isinstance(t, mi.DictType):
        return {}
    if isinstance(t, mi.StructType):
        return {f.encode_name: _zero(f.type) for f in t.fields if f.required}
    # Quantity (a custom type: the decode hook maps None to zero, as Go's UnmarshalJSON
    # does), optional and Any-typed values: null is their zero value.
    return None
