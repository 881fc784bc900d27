"""service/stream/unreadable.py on batches parsed by aiokafka's own (C) record parser.

Each batch is built with aiokafka's batch builder and then broken the way a foreign
producer or a bad disk breaks it; the fetcher's per-partition iterator is aiokafka's,
with the service's replacement installed. The real-broker test is
tests/integration/test_poison_service.py::test_records_the_kafka_client_cannot_read_become_stubs_and_stop_no_replica.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import TopicPartition

from service.stream import unreadable
from service.stream.unreadable import UnreadableRecord

TP = TopicPartition("in", 0)
BAD = "crs-test-bad-name"
CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def batch(n: int, *, bad: int | None = None, base: int = 0, codec: int = 0) -> bytearray:
    """``n`` records at offsets ``base``..; record ``bad`` with a header name that is not
    UTF-8 (its first byte replaced by 0xff, the CRC computed again)."""
    builder = DefaultRecordBatchBuilder(2, codec, 0, -1, -1, -1, 1 << 20)
    for i in range(n):
        headers = [(BAD, b"x")] if i == bad else [("h", b"v")]
        assert builder.append(i, 0, b"k%d" % i, b"v%d" % i, headers) is not None
    buf = builder.build()
    struct.pack_into(">q", buf, 0, base)
    if bad is not None:
        buf[bytes(buf).index(BAD.encode())] = 0xFF
        struct.pack_into(">I", buf, 17, calc_crc32c(bytes(buf[21:])))
    return buf


def records(raw: bytes, fetch_offset: int = 0) -> Any:
    unreadable.install()
    return fetcher.PartitionRecords(
        TP, MemoryRecords(bytes(raw)), [], fetch_offset, None, None, True, READ_UNCOMMITTED
    )


def offsets(found: list[Any]) -> list[tuple[int, bool]]:
    return [(r.offset, isinstance(r, UnreadableRecord)) for r in found]


def test_aiokafka_alone_raises_out_of_the_fetch_on_a_header_name_that_is_not_utf8() -> None:
    # Why the module exists: the error names no offset, and it comes back on every fetch.
    unreadable.install()
    original = fetcher.PartitionRecords.__mro__[1]  # aiokafka's own class
    assert original.__module__ == "aiokafka.consumer.fetcher"
    it = original(
        TP, MemoryRecords(bytes(batch(3, bad=1))), [], 0, None, None, True, READ_UNCOMMITTED
    )
    assert next(it).offset == 0
    with pytest.raises(UnicodeDecodeError):
        next(it)


def test_the_bad_record_and_the_rest_of_its_batch_come_out_unreadable() -> None:
    raw = batch(4, bad=1) + batch(2, base=4)
    parts = records(raw)
    found = list(parts)
    assert offsets(found) == [(0, False), (1, True), (2, True), (3, True)]
    assert (found[1].key, found[1].value, found[1].headers) == (None, None, ())
    assert found[1].reason.startswith("UnicodeDecodeError: ")
    assert len(found[1].reason) <= 200
    # The fetch goes on after the batch (aiokafka fetches the next one from here).
    assert parts.next_fetch_offset == 4


def test_a_fetch_from_inside_the_batch_names_only_offsets_from_there_on() -> None:
    # A new owner whose committed offset is 2 (offsets 0-1 were done before): the bad
    # record is below the fetch position, its batch is read and skipped up to it.
    found = list(records(batch(4, bad=1), fetch_offset=2))
    assert offsets(found) == [(2, True), (3, True)]


def test_a_batch_whose_crc_does_not_match_still_raises() -> None:
    # The CRC covers the batch's offsets: with a corrupt last offset delta, stubs named
    # a thousand offsets past the batch (review). And a mismatch may heal on a retry.
    raw = batch(3, base=10)
    raw[-1] ^= 0x01  # a flipped bit in the last record's value
    with pytest.raises(CorruptRecordException):
        list(records(raw, fetch_offset=10))


def test_max_records_resumes_among_the_unreadable_offsets() -> None:
    # FetchResult.getall(max_records) stops mid-way and takes the position from the
    # iterator: the next call must go on with the next offset, none twice.
    parts = records(batch(4, bad=0))
    first = [next(parts), next(parts)]
    assert [r.offset for r in first] == [0, 1]
    assert parts.next_fetch_offset == 2
    assert [r.offset for r in parts] == [2, 3]


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_compressed_batches_are_read(codec: str) -> None:
    # lz4, snappy and zstd need cramjam (aiokafka's extras in pyproject.toml); without
    # it every such batch would be unreadable.
    found = list(records(batch(3, codec=CODECS[codec])))
    assert offsets(found) == [(0, False), (1, False), (2, False)]
    assert [r.value for r in found] == [b"v0", b"v1", b"v2"]


def test_an_error_before_the_batch_is_known_still_raises() -> None:
    # Nothing to name: the engine's failed-fetch path (rewind, back-off, /readyz).
    raw = batch(2)
    struct.pack_into(">i", raw, 8, 5)  # a batch length shorter than any batch
    with pytest.raises(CorruptRecordException):
        list(records(raw))


def test_install_is_idempotent_and_used_by_the_fetcher() -> None:
    unreadable.install()
    replaced = fetcher.PartitionRecords
    unreadable.install()
    assert fetcher.PartitionRecords is replaced
    assert replaced.__name__ == "_TolerantPartitionRecords"
