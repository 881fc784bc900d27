"""The poison boundary is total: whatever a record holds, decoding ends in an event or Poison.

Property-based: arbitrary bytes, arbitrary JSON (deep, wide, huge numbers, unicode, nulls)
put in place of any field of a valid event and of the Nova request inside it, and
binary-mode CloudEvents headers with arbitrary bytes. ``decode_input`` raises only
:class:`Poison`; ``Processor.process`` only returns a record or raises ``RetryLater``.
"""

from __future__ import annotations

import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.stream import codec
from service.stream.codec import (
    INPUT_TYPE,
    INTERNAL_ERROR,
    POISON_CODES,
    InputEvent,
    InputRef,
    Poison,
    decode_input,
    encode_input,
)
from service.stream.metrics import StreamMetrics
from service.stream.processor import OutRecord, Processor, RetryLater
from tests import nova
from tests.unit.test_processor import VM, ScriptedRecorder, outcome

T = TypeVar("T")
REF = InputRef(topic="in", partition=1, offset=7)
CODES = {*POISON_CODES, INTERNAL_ERROR}
MAX_BYTES = 1_048_576
SLOT = "\u0000hole\u0000"  # a marker no real field holds; replaced by a JSON fragment


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that never really suspends (the fake recorder answers at once)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("the coroutine suspended")


def template(*, hints: bool = True) -> dict[str, Any]:
    request = nova.request(VM, hosts=["hv-1", "hv-2"])
    if hints:
        request["spec"]["nova_object.data"]["scheduler_hints"] = {"group": ["g"], "x": "y"}
    value, _ = encode_input(nova.decision_dict("hv-1"), request, event_id="ev-1")
    doc: dict[str, Any] = json.loads(value)
    return doc


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in ``doc`` (dict keys and list indexes), parents before children."""
    found: list[tuple[Any, ...]] = []
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    )
    for k, v in items:
        found.append((*prefix, k))
        found.extend(paths(v, (*prefix, k)))
    return found


TEMPLATE = template()
PATHS = paths(TEMPLATE)


def with_fragment(path: tuple[Any, ...], fragment: str) -> bytes:
    """The template with the JSON text ``fragment`` at ``path`` (raw, so any number fits)."""
    doc = json.loads(json.dumps(TEMPLATE))
    node = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = SLOT
    text = json.dumps(doc, ensure_ascii=False)
    return text.replace(json.dumps(SLOT, ensure_ascii=False), fragment).encode("utf-8", "replace")


def _deep(n: int, kind: str) -> str:
    if kind == "list":
        return "[" * n + "]" * n
    if kind == "dict":
        return '{"a":' * n + "null" + "}" * n
    return '[{"a":' * n + "1" + "}]" * n


scalars = st.one_of(
    st.just("null"),
    st.sampled_from(["true", "false", "0", "-1", "1.5e308", "1e400", "-0.0", '""']),
    st.integers(20, 6000).map(lambda n: "9" * n),  # beyond int64, up to 6,000 digits
    st.integers(20, 400).map(lambda n: "-1" + "0" * n + ".5e-" + "9" * 3),
    st.text(max_size=40).map(lambda s: json.dumps(s, ensure_ascii=False)),
    st.text(max_size=40).map(json.dumps),  # escaped, incl. lone surrogates
)
fragments = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(st.text(max_size=8), inner), max_size=6).map(
            lambda kvs: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in kvs) + "}"
        ),
    ),
    max_leaves=20,
) | st.builds(_deep, st.integers(900, 20_000), st.sampled_from(["list", "dict", "mixed"]))


def decode_outcome(value: bytes | None, headers: Any = None, key: bytes | None = None) -> str:
    """``ok`` or the poison code; any other exception fails the calling test."""
    try:
        decode_input(value, headers, max_bytes=MAX_BYTES, key=key)
    except Poison as poison:
        caught = poison
    else:
        return "ok"
    assert caught.code in CODES
    assert len(caught.reason.encode()) <= codec.MAX_REASON_BYTES
    return caught.code


def assert_dead_lettered(value: bytes | None, headers: Any, key: bytes | None) -> None:
    """The record is poison with a reason, and the processor dead-letters it so: the
    original value kept, the code and the reason in its headers."""
    code = decode_outcome(value, headers, key=key)
    assert code != "ok", value[:200] if value else value
    out = process(key, value, headers)
    assert out.dead_letter, out
    got = dict(out.headers)
    assert got["crs.error"].decode() == code
    assert got["crs.reason"].strip(), got
    assert out.value == value


# --- decode_input -----------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), fragment=fragments)
def test_any_json_in_any_field_is_an_event_or_poison_never_not_json(
    path: tuple[Any, ...], fragment: str
) -> None:
    code = decode_outcome(with_fragment(path, fragment))
    # Every document here is valid JSON: saying "not_json" would send the operator to
    # look for a syntax error that is not there.
    assert code != "not_json"


@pytest.mark.parametrize(
    "path",
    [
        (),  # the whole value
        ("data",),
        ("data", "request"),
        ("data", "request", "spec", "nova_object.data", "scheduler_hints"),
        ("data", "request", "spec", "nova_object.data", "scheduler_hints", "group"),
        ("data", "request", "hosts"),
        ("data", "decision", "result"),
        ("extension",),
    ],
)
@pytest.mark.parametrize("depth", [1000, 5000, 100_000])
def test_deep_nesting_anywhere_is_invalid_event(path: tuple[str, ...], depth: int) -> None:
    fragment = _deep(depth, "list")
    value = fragment.encode() if not path else with_fragment(path, fragment)
    assert decode_outcome(value) == "invalid_event"


@pytest.mark.parametrize(
    "path",
    [
        ("data", "request", "weights", "hv-1"),
        ("data", "request", "spec", "nova_object.data", "num_instances"),
        ("data", "request", "spec", "nova_object.data", "scheduler_hints", "x"),
        ("data", "request", "spec", "nova_object.data", "flavor", "nova_object.data", "memory_mb"),
    ],
)
def test_a_huge_integer_is_valid_json_so_invalid_event(path: tuple[str, ...]) -> None:
    assert decode_outcome(with_fragment(path, "9" * 5000)) == "invalid_event"


@settings(max_examples=200, deadline=None)
@given(path=st.sampled_from(PATHS))
def test_null_in_every_field_is_an_event_or_poison(path: tuple[Any, ...]) -> None:
    assert decode_outcome(with_fragment(path, "null")) in {"ok", *CODES} - {"not_json"}


# Arbitrary bytes, and arbitrary bytes behind a deep opening (the parser recurses first).
hostile_bytes = st.one_of(
    st.none(),
    st.binary(max_size=4096),
    st.builds(
        lambda n, opener, tail: opener * n + tail,
        st.integers(900, 50_000),
        st.sampled_from([b"[", b'{"a":', b'[{"a":']),
        st.binary(max_size=64),
    ),
)


@settings(max_examples=300, deadline=None)
@given(value=hostile_bytes, key=st.none() | st.binary(max_size=64))
def test_arbitrary_bytes_are_poison(value: bytes | None, key: bytes | None) -> None:
    # A valid event needs a CloudEvents envelope of the input type around a Nova decision
    # and request: bytes drawn at random, or an opening nested thousands deep, never are.
    assert_dead_lettered(value, None, key)


@settings(max_examples=300, deadline=None)
@given(
    value=hostile_bytes.filter(bool) | st.just(b'{"decision":{"result":{}},"request":{}}'),
    headers=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "content-type",
                    "ce_specversion",
                    "ce_type",
                    "ce_id",
                    "ce_source",
                    "ce_time",
                    "ce_subject",
                    "CE_Type",
                    "other",
                ]
            ),
            st.one_of(
                st.binary(max_size=64),
                st.sampled_from([b"1.0", INPUT_TYPE.encode(), b"application/json", b"\xff\xfe"]),
                st.none(),
            ),
        ),
        max_size=10,
    ),
)
def test_binary_mode_headers_with_arbitrary_bytes_are_poison(
    value: bytes, headers: list[tuple[str, bytes | None]]
) -> None:
    # Whatever the headers say, no value here is an event: arbitrary bytes, or a data
    # part whose request is empty (no spec, no instance).
    assert_dead_lettered(value, headers, None)


def test_bad_utf8_inside_a_string_is_not_json() -> None:
    value = with_fragment(("data", "request", "hosts", 0, "host"), '"hv-\udcff"')
    value = value.replace(b"hv-?", b"hv-\xff")
    assert b"\xff" in value
    assert decode_outcome(value) == "not_json"


@pytest.mark.parametrize("error", [MemoryError(), RecursionError("deep"), SystemError("bug")])
def test_any_exception_while_decoding_is_internal_error_poison(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    class Exploding:
        def decode(self, _: bytes) -> InputEvent:
            raise error

    monkeypatch.setattr(codec, "_INPUT_DECODER", Exploding())
    monkeypatch.setattr(codec, "_DATA_DECODER", Exploding())
    value, headers = encode_input(nova.decision_dict("hv-1"), nova.request(VM))
    code = decode_outcome(value, headers)
    if isinstance(error, RecursionError):
        assert code == "invalid_event"
    else:
        assert code == INTERNAL_ERROR


def test_a_900_kb_key_makes_a_bounded_reason() -> None:
    value, headers = encode_input(nova.decision_dict("hv-1"), nova.request(VM))
    with pytest.raises(Poison) as info:
        decode_input(value, headers, max_bytes=MAX_BYTES, key=b"k" * 900_000)
    assert info.value.code == "inconsistent_subject"
    assert len(info.value.reason.encode()) <= 512
    assert len(str(info.value).encode()) <= 600


def test_a_huge_subject_makes_a_bounded_reason() -> None:
    doc = template()
    doc["subject"] = "s" * 500_000
    with pytest.raises(Poison) as info:
        decode_input(json.dumps(doc).encode(), None, max_bytes=MAX_BYTES)
    assert info.value.code == "inconsistent_subject"
    assert len(info.value.reason.encode()) <= 512


# --- Processor.process ------------------------------------------------------------------


class AlwaysOk(ScriptedRecorder):
    async def _next(self, kind: str, decision: Any, request: Any) -> Any:
        return outcome(kind, "no_cr")


def processor() -> Processor:
    return Processor(
        AlwaysOk(),  # type: ignore[arg-type]
        StreamMetrics(),
        output_topic="out",
        dlq_topic="dlq",
        max_event_bytes=MAX_BYTES,
        max_attempts=3,
    )


PROC = processor()


def process(key: bytes | None, value: bytes | None, headers: Any) -> OutRecord:
    try:
        out = run(PROC.process(REF, key, value, headers))
    except RetryLater:  # the only exception allowed; the fake recorder never asks for it
        raise AssertionError("unexpected RetryLater") from None
    assert isinstance(out, OutRecord)
    if out.dead_letter:
        assert dict(out.headers)["crs.error"].decode() in CODES
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(PATHS),
    fragment=fragments,
    key=st.none() | st.just(VM.encode()) | st.binary(max_size=64),
)
def test_processor_returns_a_record_for_any_json(
    path: tuple[Any, ...], fragment: str, key: bytes | None
) -> None:
    value = with_fragment(path, fragment)
    out = process(key, value, [("content-type", b"application/cloudevents+json")])
    if out.dead_letter:
        assert out.value == value


@settings(max_examples=200, deadline=None)
@given(
    value=hostile_bytes,
    key=st.none() | st.binary(max_size=64),
    headers=st.none()
    | st.lists(
        st.tuples(
            st.sampled_from(["content-type", "ce_specversion", "ce_type", "ce_id", "crs.error"])
            | st.text(max_size=10),
            st.none() | st.binary(max_size=64),
        ),
        max_size=8,
    ),
)
def test_processor_returns_a_record_for_any_bytes(
    value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes | None]] | None
) -> None:
    process(key, value, headers)


def test_processor_turns_an_exception_while_decoding_into_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def explode(*_: Any, **__: Any) -> InputEvent:
        raise MemoryError

    monkeypatch.setattr("service.stream.processor.decode_input", explode)
    value, headers = encode_input(nova.decision_dict("hv-1"), nova.request(VM))
    out = process(VM.encode(), value, headers)
    assert out.dead_letter
    assert dict(out.headers)["crs.error"] == b"internal_error"
    assert out.value == value


def test_processor_survives_a_deep_event_end_to_end() -> None:
    path = ("data", "request", "spec", "nova_object.data", "scheduler_hints", "x")
    value = with_fragment(path, _deep(1000, "list"))
    out = process(VM.encode(), value, None)
    assert dict(out.headers)["crs.error"] == b"invalid_event"
    assert msgspec.json.decode(dict(out.headers)["crs.source.offset"]) == 7
