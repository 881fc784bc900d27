"""Records the Kafka client cannot read become records the engine can dead-letter.

aiokafka parses a fetched batch lazily, inside ``getmany()``. A record it cannot parse
raises out of ``getmany()`` with an error that names neither partition nor offset: a
header name that is not UTF-8 (Go clients and the broker take names as bytes; aiokafka
decodes them strictly: ``UnicodeDecodeError``), a compression codec it cannot decode, a
batch whose CRC does not match. Two things then go wrong, both measured:

* the same record raises again on every fetch, for every replica that owns the
  partition (the service used to exit on it); the partition never moves again;
* ``getmany()`` drains partition after partition, moving each one's fetch position as it
  goes, and builds the result only at the end: the records of partitions drained before
  the failing one in that call are lost (their positions have moved past them).

:func:`install` replaces the fetcher's per-partition record iterator (aiokafka's
``PartitionRecords``) with one that catches the error where it happens, where the batch
is known. The record that failed and the rest of its batch (aiokafka cannot read past it
within the batch) come out as :class:`UnreadableRecord`, one per offset, which the engine
turns into stub dead letters (code ``unreadable``) committed like any other output; the
fetch goes on after the batch. Nothing raises out of ``getmany()``, so nothing else is
lost. Two errors still raise: one before the batch's offsets are known (a batch header
that does not parse, a legacy v0/v1 batch), and a CRC mismatch, whose batch header is
not to be trusted and which may heal on a retry. The engine handles those as a failed
fetch (back-off, the cause in /readyz) and rewinds its partitions to the offsets it has
received (see ``StreamService.run``). In a compacted topic the rest of a batch may name
offsets that were compacted away: each still gets its stub.

The replacement subclasses aiokafka's own class (reached through
:mod:`service.stream.aiokafka_internals`, which pins what it assumes) and keeps its logic (aborted
transactions, control batches, compaction); it only wraps the batches it reads. Written
against aiokafka 0.14 (pinned in requirements.lock); ``tests/unit/test_unreadable.py``
runs it on batches parsed by aiokafka's real (C) record parser.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import CorruptRecordException
from aiokafka.structs import ConsumerRecord

from service.stream import aiokafka_internals

__all__ = ["UnreadableRecord", "install"]

_REASON_CHARS = 200


@dataclass
class UnreadableRecord(ConsumerRecord[bytes, bytes]):  # type: ignore[misc]  # untyped library
    """An offset the client could not read: no key, value or headers, only why."""

    reason: str = ""

    @classmethod
    def at(cls, topic: str, partition: int, offset: int, reason: str) -> UnreadableRecord:
        return cls(topic, partition, offset, -1, 0, None, None, None, -1, -1, (), reason=reason)


class _Batch:
    """One fetched batch, as aiokafka's iterator uses it, remembering the last offset
    read from it (records below the fetch position are read and skipped too)."""

    __slots__ = ("_batch", "_iter", "last_read")

    def __init__(self, batch: Any) -> None:
        self._batch = batch
        self._iter: Any = None
        self.last_read: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __iter__(self) -> _Batch:
        self._iter = iter(self._batch)  # a compressed batch is decompressed here
        return self

    def __next__(self) -> Any:
        record = next(self._iter if self._iter is not None else iter(self))
        self.last_read = record.offset
        return record


class _Batches:
    """aiokafka's MemoryRecords, handing out :class:`_Batch` wrappers."""

    __slots__ = ("_records", "current")

    def __init__(self, records: Any) -> None:
        self._records = records
        self.current: _Batch | None = None

    def has_next(self) -> bool:
        self.current = None  # the last batch was read to its end
        return bool(self._records.has_next())

    def next_batch(self) -> _Batch | None:
        self.current = None  # a batch header that does not parse: no offsets to name
        batch = self._records.next_batch()
        self.current = None if batch is None else _Batch(batch)
        return self.current

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())


class _TolerantPartitionRecords(aiokafka_internals.PartitionRecordsBase):  # type: ignore[misc]
    next_fetch_offset: int  # aiokafka's: where the partition's next fetch starts

    def __init__(self, tp: Any, records: Any, *args: Any) -> None:
        self._batches = _Batches(records)
        super().__init__(tp, self._batches, *args)

    def _unpack_records(self) -> Iterator[ConsumerRecord[Any, Any]]:
        inner = super()._unpack_records()
        while True:
            try:
                record = next(inner)
            except StopIteration:
                return
            except CorruptRecordException:
                # The CRC covers the batch's own offset fields: its range is not to be
                # trusted (a corrupt last offset delta named a thousand offsets beyond
                # the log end), and a mismatch may be transient (one bad replica before
                # a leader change). The engine's failed-fetch path: retried, /readyz.
                raise
            except Exception as exc:
                batch = self._batches.current
                try:
                    end = int(batch.next_offset) if batch is not None else None
                    base = int(batch.base_offset) if batch is not None else None
                except Exception:  # e.g. a legacy (v0/v1) batch: nothing to name
                    end = base = None
                if batch is None or end is None or base is None:
                    raise  # no offset to name: the engine's failed-fetch path
                first = max(
                    base if batch.last_read is None else batch.last_read + 1, self.next_fetch_offset
                )
                if first >= end:
                    raise
                reason = f"{type(exc).__name__}: {exc}"[:_REASON_CHARS]
                for offset in range(first, end):
                    # Before handing it out: getall() stops after max_records and takes
                    # the position from here, so the next call resumes at the next one.
                    self.next_fetch_offset = offset + 1
                    yield UnreadableRecord.at(self._tp.topic, self._tp.partition, offset, reason)
                # The rest of this fetch is read again from the next batch on.
                self.next_fetch_offset = max(self.next_fetch_offset, end)
                return
            yield record


def install() -> None:
    """Make aiokafka's fetcher build :class:`_TolerantPartitionRecords` (idempotent)."""
    aiokafka_internals.install_partition_records(_TolerantPartitionRecords)
