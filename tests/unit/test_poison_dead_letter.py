"""Dead letters always fit the producer's limit; the stub fits whatever the broker allows.

The size is checked with aiokafka's own estimate, the figure its producer compares with
``max_request_size`` before it sends (``MessageSizeTooLargeError`` otherwise).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.stream.codec import InputRef, encode_input
from service.stream.metrics import StreamMetrics
from service.stream.processor import (
    DEFAULT_MAX_RECORD_BYTES,
    OutRecord,
    Processor,
    record_size,
    stub_dead_letter,
)
from tests import nova
from tests.unit.test_poison_boundary import run
from tests.unit.test_processor import VM, ScriptedRecorder

REF = InputRef(topic="in", partition=2, offset=1234567)
MiB = 1_048_576


def processor(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Processor:
    return Processor(
        ScriptedRecorder(),  # type: ignore[arg-type]
        StreamMetrics(),
        output_topic="out",
        dlq_topic="dlq",
        max_event_bytes=MiB,
        max_attempts=3,
        max_record_bytes=max_record_bytes,
    )


def kafka_size(out: OutRecord) -> int:
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(out.key, out.value, out.headers))


def dead_letter(proc: Processor, key: bytes | None, value: bytes | None, headers: Any) -> OutRecord:
    out = run(proc.process(REF, key, value, headers))
    assert out.dead_letter
    return out


sizes = st.one_of(
    st.sampled_from([0, 36, 4096, 4097, 65_536, 500_000, 900_000, MiB - 8000, MiB - 100, MiB]),
    st.integers(0, 5000),
    st.integers(0, MiB + 16),
)
header = st.tuples(
    st.one_of(st.text(min_size=1, max_size=20), st.integers(1, 400).map(lambda n: "h" * n)),
    st.one_of(st.none(), sizes.map(lambda n: b"v" * n)),
)


@pytest.mark.parametrize("max_record_bytes", [DEFAULT_MAX_RECORD_BYTES, 64 * 1024, 5 * MiB])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(st.none(), sizes.map(lambda n: b"k" * n)),
    value=st.one_of(st.none(), sizes.map(lambda n: b"{" + b"x" * n)),
    headers=st.lists(header, max_size=40) | st.integers(0, 20_000).map(lambda n: [("h", b"")] * n),
)
def test_dead_letter_always_fits_the_producer_limit(
    max_record_bytes: int,
    key: bytes | None,
    value: bytes | None,
    headers: list[tuple[str, bytes | None]],
) -> None:
    proc = processor(max_record_bytes)
    out = dead_letter(proc, key, value, headers)
    size = kafka_size(out)
    assert size <= max_record_bytes - 256
    assert record_size(out.key, out.value, out.headers) >= size  # ours is the upper bound
    got = dict(out.headers)
    assert got["crs.source.offset"] == b"1234567"
    assert len(got["crs.reason"]) <= 1024
    if out.value is None and value is not None:
        assert got["crs.value.omitted"] == str(len(value)).encode()
    if key is not None and out.key != key:
        assert got["crs.key.truncated"] == str(len(key)).encode()
        assert key.startswith(out.key or b"")
    stub = stub_dead_letter(out, error="MessageSizeTooLargeError: " + "e" * 5000)
    assert kafka_size(stub) < 2048
    # aiokafka refuses a record with neither key nor value (an AssertionError, which
    # would replay the partition forever): both always carry one.
    assert out.key is not None or out.value is not None
    assert stub.key is not None or stub.value is not None


def test_a_near_1_mb_input_whose_dead_letter_would_overflow_keeps_its_coordinates() -> None:
    # The input just fits 1 MiB with its headers; adding the crs.* headers would not.
    headers = [("trace", b"t" * 3000), ("baggage", b"b" * 4000)]
    value = b"{" + b"x" * (MiB - 7300)
    source = OutRecord(topic="in", key=VM.encode(), value=value, headers=headers)
    assert DEFAULT_MAX_RECORD_BYTES - 200 < kafka_size(source) <= DEFAULT_MAX_RECORD_BYTES
    out = dead_letter(processor(), VM.encode(), value, headers)
    assert kafka_size(out) <= DEFAULT_MAX_RECORD_BYTES
    got = dict(out.headers)
    assert got["crs.error"] == b"not_json"
    assert out.value is None
    assert got["crs.value.omitted"] == str(len(value)).encode()
    assert (got["trace"], got["baggage"]) == (b"t" * 3000, b"b" * 4000)
    assert out.key == VM.encode()


def test_big_original_headers_are_cut_so_the_value_fits() -> None:
    headers = [("baggage", b"b" * 40_000), *[(f"h{i}", b"v" * 1000) for i in range(100)]]
    value = b"{" + b"x" * 900_000
    out = dead_letter(processor(), VM.encode(), value, headers)
    got = dict(out.headers)
    assert out.value == value
    assert got["baggage"] == b"b" * 4096  # each value: at most 4 KiB
    assert got["crs.headers.truncated"] == b"1"
    # All original headers together: at most 64 KiB; the rest is left out and counted.
    assert 0 < int(got["crs.headers.omitted"]) < 100
    assert sum(len(n) + len(v or b"") for n, v in out.headers) < 66 * 1024 + 2048


def test_a_900_kb_key_is_cut_and_the_value_kept() -> None:
    value, headers = encode_input(nova.decision_dict("hv-1"), nova.request(VM))
    key = b"k" * 900_000
    out = dead_letter(processor(), key, value, headers)
    got = dict(out.headers)
    assert got["crs.error"] == b"inconsistent_subject"
    assert out.key == key[:4096]
    assert got["crs.key.truncated"] == b"900000"
    assert out.value == value
    assert len(got["crs.reason"]) <= 512


def test_small_dead_letters_are_the_input_byte_for_byte() -> None:
    headers = [("trace", b"t-1"), ("crs.error", b"old"), ("n", None)]
    out = dead_letter(processor(), b"key", b"\x00garbage", headers)
    assert (out.key, out.value) == (b"key", b"\x00garbage")
    assert out.headers[:2] == [("trace", b"t-1"), ("n", None)]
    names = [name for name, _ in out.headers]
    assert names.count("crs.error") == 1
    assert not any(n in names for n in ("crs.key.truncated", "crs.headers.omitted"))


def test_the_stub_names_the_source_sizes_and_hash() -> None:
    value = b"\xff" * 500_000
    out = dead_letter(processor(), VM.encode(), value, [("trace", b"t")])
    stub = stub_dead_letter(out, error="RecordTooLarge")
    assert (stub.topic, stub.key, stub.value, stub.dead_letter) == ("dlq", VM.encode(), None, True)
    assert dict(stub.headers) == {
        "crs.error": b"not_json",
        "crs.reason": dict(out.headers)["crs.reason"],
        "crs.source.topic": b"in",
        "crs.source.partition": b"2",
        "crs.source.offset": b"1234567",
        "crs.stub": b"true",
        "crs.key.size": b"36",
        "crs.value.size": b"500000",
        "crs.value.sha256": hashlib.sha256(value).hexdigest().encode(),
        "crs.stub.error": b"RecordTooLarge",
    }
    long_key = dead_letter(processor(), b"k" * 900_000, None, None)
    stub = stub_dead_letter(long_key)
    # Too long to keep, and a record needs a key or a value: keyed by its coordinates.
    assert stub.key == b"in/2/1234567"
    assert dict(stub.headers)["crs.key.size"] == b"900000"
    assert "crs.value.sha256" not in dict(stub.headers)


def test_only_a_dead_letter_has_a_stub() -> None:
    with pytest.raises(ValueError, match="dead letter"):
        stub_dead_letter(OutRecord(topic="out", key=None, value=b"{}", headers=[]))


def test_a_limit_too_small_for_any_dead_letter_is_refused() -> None:
    with pytest.raises(ValueError, match="16 KiB"):
        processor(8 * 1024)


def test_a_bug_while_building_the_dead_letter_still_yields_a_stub(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*_: Any, **__: Any) -> OutRecord:
        raise RuntimeError("bug in the dead-letter builder")

    monkeypatch.setattr("service.stream.processor.build_dead_letter", broken)
    out = dead_letter(processor(), b"key", b"not json", [("trace", b"t")])
    got = dict(out.headers)
    assert (out.topic, out.value, got["crs.stub"]) == ("dlq", None, b"true")
    assert got["crs.error"] == b"internal_error"
    assert b"RuntimeError" in got["crs.reason"]
    assert got["crs.value.sha256"] == hashlib.sha256(b"not json").hexdigest().encode()
