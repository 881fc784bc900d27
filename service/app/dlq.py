"""``crs-consumer dlq list | redrive``: what is in the dead-letter topic, and bringing it back.

Both read the dead-letter topic from its beginning up to the end offsets taken at start
(``read_committed``, no consumer group: nothing is committed, the topic is not changed).

``redrive`` re-publishes each selected dead letter to the input topic: the original key,
value and headers (the ``crs.*`` headers of the dead letter dropped), plus
``crs.redrive.count`` (previous count + 1). The processor keeps that header when it
dead-letters the record again, so a record already redriven ``max_redrives`` times is
refused instead of circling forever. Of the dead letters of one input (the same key,
value and non-``crs`` headers: the first one and those of its redriven copies) only the
latest is redriven: the earlier ones were redriven already, and sending them again
would double the copies with every run. A run that did not read the topic to its end
sends nothing (a later dead letter of a selected input may lie beyond). All records of
one run are sent in one Kafka transaction under a transactional id of the tool's own: a
run that fails half-way sends nothing, and a second run overlapping it fences it.
Re-publishing a record that then succeeds is safe to repeat: the replayed input's
classification has the same event id and the slot write is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple, TextIO

from service.app.config import Config
from service.stream import aiokafka_internals
from service.stream import dlq_headers as H

__all__ = [
    "INCOMPLETE",
    "DlqFilter",
    "DlqRecord",
    "list_dlq",
    "parse_time",
    "read_dlq",
    "redrive",
    "redrive_headers",
    "redrive_transactional_id",
]

_SAMPLE_CHARS = 200
# Distinct crs.error codes `list` summarises one by one; the rest are counted together
# (the service writes a few dozen; a foreign writer could write any number).
_MAX_CODES = 100
_OTHER_CODES = "(other codes)"
_SAMPLES_PER_CODE = 3
# Empty polls in a row (500 ms each) after which the read gives up on the partitions not
# yet at their end offset (a broker that stopped answering). Transaction markers do not
# hold a read up: the position moves past them without a record being returned.
_IDLE_POLLS = 20
# The exit code of a read that stopped before the end of the topic (--max-records, or
# the broker silent for _IDLE_POLLS polls): list's summary is partial, redrive sent nothing.
INCOMPLETE = 3
_TRANSACTION_TIMEOUT_MS = 900_000
# What a redrive may hold and send in its one transaction by default (--max-send-bytes).
DEFAULT_MAX_SEND_BYTES = 256 << 20
# How long a redrive stopped by a signal while committing waits for the commit's outcome
# (a pod's default grace period is 30 s).
_COMMIT_WAIT_S = 20.0


@dataclass(frozen=True)
class DlqRecord:
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]  # Kafka allows a header without value

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return None if v is None else v.decode("utf-8", errors="replace")
        return None

    @property
    def code(self) -> str:
        return self.header(H.ERROR) or "unknown"

    @property
    def size(self) -> int:
        """Bytes of key, value and headers (what a redrive holds and sends of it)."""
        total = len(self.key or b"") + len(self.value or b"")
        return total + sum(len(k) + len(v or b"") for k, v in self.headers)

    @property
    def identity(self) -> str:
        """What all dead letters of one input have in common (the first one and those of
        its redriven copies): its key, value and non-``crs`` headers, which a redrive
        sends unchanged. Content, not a header: a header any producer can set could
        make one input's dead letter supersede another's. Without a value (a stub, a
        value left out; both refused): the dead letter alone."""
        if self.header(H.STUB) is not None or self.header(H.VALUE_OMITTED) is not None:
            return f"dead letter {self.partition}/{self.offset}"
        h = hashlib.sha256()
        for part in (self.key, self.value):
            h.update(b"-" if part is None else b"+%d:" % len(part) + part)
        for k, v in self.headers:
            if not k.startswith(H.PREFIX):
                name = k.encode("utf-8", errors="surrogateescape")
                h.update(b"h%d:" % len(name) + name)
                h.update(b"-" if v is None else b"+%d:" % len(v) + v)
        return h.hexdigest()

    @property
    def redrive_count(self) -> int:
        raw = self.header(H.REDRIVE_COUNT)
        try:
            return max(0, int(raw)) if raw is not None else 0
        except ValueError:
            return 0


@dataclass(frozen=True)
class DlqFilter:
    codes: frozenset[str] = frozenset()
    since_ms: int | None = None
    until_ms: int | None = None
    partition: int | None = None
    from_offset: int | None = None
    to_offset: int | None = None

    def matches(self, r: DlqRecord) -> bool:
        if self.codes and r.code not in self.codes:
            return False
        if self.since_ms is not None and r.timestamp_ms < self.since_ms:
            return False
        if self.until_ms is not None and r.timestamp_ms > self.until_ms:
            return False
        if self.partition is not None and r.partition != self.partition:
            return False
        if self.from_offset is not None and r.offset < self.from_offset:
            return False
        return not (self.to_offset is not None and r.offset > self.to_offset)


def redrive_headers(r: DlqRecord) -> list[tuple[str, bytes | None]]:
    """The original headers without ``crs.*``, plus the incremented redrive count."""
    kept = [(k, v) for k, v in r.headers if not k.startswith(H.PREFIX)]
    kept.append((H.REDRIVE_COUNT, str(r.redrive_count + 1).encode("ascii")))
    return kept


async def read_dlq(
    config: Config,
    *,
    max_records: int,
    visit: Callable[[DlqRecord], None],
    partition: int | None = None,
    narrow: bool = True,
) -> tuple[int, bool]:
    """Call ``visit`` for each dead letter up to the end offsets at start; returns the
    number read (at most ``max_records``) and whether every partition was read to its
    end offset. ``partition``: LookupError if the topic has none such, and (``narrow``)
    only that one is read."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    consumer = AIOKafkaConsumer(
        **config.kafka_client_args(),
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
    )
    read = 0
    try:
        await consumer.start()  # inside: a failed start's connections are closed below
        # An assign-only consumer tracks no topics; ask the cluster directly.
        cluster = await aiokafka_internals.fetch_all_metadata(consumer)
        parts = cluster.partitions_for_topic(config.dlq_topic)
        if not parts:
            # A metadata request for all topics leaves out those the account may not
            # Describe: both look the same from here.
            raise LookupError(
                f"dead-letter topic {config.dlq_topic} does not exist, or this Kafka "
                "account may not Describe it"
            )
        if partition is not None:
            if partition not in parts:
                raise LookupError(
                    f"dead-letter topic {config.dlq_topic} has no partition {partition} "
                    f"(it has 0-{max(parts)})"
                )
            if narrow:
                parts = {partition}
        tps = [TopicPartition(config.dlq_topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if end[tp] > 0}

        async def settle() -> None:
            """Drop the partitions read to their end offset from ``pending``."""
            for tp in list(pending):
                if await consumer.position(tp) >= end[tp]:
                    pending.discard(tp)

        idle = 0
        while pending and read < max_records:
            batch = await consumer.getmany(
                *pending, timeout_ms=500, max_records=min(500, max_records - read)
            )
            idle = 0 if any(batch.values()) else idle + 1
            for tp, records in batch.items():
                for rec in records:
                    if rec.offset >= end[tp] or read >= max_records:
                        continue
                    read += 1
                    visit(
                        DlqRecord(
                            partition=tp.partition,
                            offset=rec.offset,
                            timestamp_ms=rec.timestamp,
                            key=rec.key,
                            value=rec.value,
                            headers=tuple(rec.headers or ()),
                        )
                    )
            await settle()
            if idle >= _IDLE_POLLS:
                break
        if pending and read >= max_records:
            # Stopped at the limit: complete all the same if nothing but the commit
            # marker after the last record is left (the service writes transactions).
            more = await consumer.getmany(*pending, timeout_ms=500, max_records=1)
            if not any(rec.offset < end[tp] for tp, recs in more.items() for rec in recs):
                await settle()
        complete = not pending
    finally:
        await consumer.stop()
    return read, complete


@dataclass
class _CodeSummary:
    count: int = 0
    first_ms: int | None = None
    last_ms: int | None = None
    offsets: dict[int, list[int]] = field(default_factory=dict)  # partition -> [min, max]
    samples: list[str] = field(default_factory=list)

    def add(self, r: DlqRecord) -> None:
        self.count += 1
        self.first_ms = (
            r.timestamp_ms if self.first_ms is None else min(self.first_ms, r.timestamp_ms)
        )
        self.last_ms = r.timestamp_ms if self.last_ms is None else max(self.last_ms, r.timestamp_ms)
        span = self.offsets.setdefault(r.partition, [r.offset, r.offset])
        span[0], span[1] = min(span[0], r.offset), max(span[1], r.offset)
        reason = (r.header(H.REASON) or "")[:_SAMPLE_CHARS]
        if len(self.samples) < _SAMPLES_PER_CODE and reason not in self.samples:
            self.samples.append(reason)

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "first": _iso(self.first_ms),
            "last": _iso(self.last_ms),
            "offsets": {str(p): {"from": a, "to": b} for p, (a, b) in sorted(self.offsets.items())},
            "sample_reasons": self.samples,
        }


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return (
        datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    )


def parse_time(raw: str) -> int:
    """ISO 8601 (``2026-01-01T10:00:00Z``; no zone = UTC) to epoch milliseconds."""
    value = datetime.fromisoformat(raw.strip().replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return int(value.timestamp() * 1000)


async def list_dlq(
    config: Config, *, flt: DlqFilter, max_records: int, as_json: bool, out: TextIO = sys.stdout
) -> int:
    summary: dict[str, _CodeSummary] = {}

    def visit(r: DlqRecord) -> None:
        if flt.matches(r):
            code = r.code
            if code not in summary and len(summary) >= _MAX_CODES:
                # Codes come from the records' headers: any writer's, not only ours.
                code = _OTHER_CODES
            summary.setdefault(code, _CodeSummary()).add(r)

    read, complete = await read_dlq(
        config, max_records=max_records, visit=visit, partition=flt.partition
    )
    total = sum(s.count for s in summary.values())
    if as_json:
        doc = {
            "topic": config.dlq_topic,
            "read": read,
            "matching": total,
            "truncated": not complete,
            "codes": {c: s.as_dict() for c, s in sorted(summary.items())},
        }
        print(json.dumps(doc, indent=2), file=out)
        return 0 if complete else INCOMPLETE
    more = "" if complete else " (incomplete: stopped before the end of the topic)"
    print(f"{config.dlq_topic}: {total} dead letters match of {read} read{more}", file=out)
    for code, s in sorted(summary.items(), key=lambda kv: -kv[1].count):
        offsets = ", ".join(f"p{p}:{a}-{b}" for p, (a, b) in sorted(s.offsets.items()))
        print(
            f"  {_shown(code)}: {s.count}  first {_iso(s.first_ms)}  last {_iso(s.last_ms)}  "
            f"offsets {offsets}",
            file=out,
        )
        for sample in s.samples:
            print(f"      e.g. {sample!r}", file=out)
    return 0 if complete else INCOMPLETE


async def redrive(
    config: Config,
    *,
    flt: DlqFilter,
    max_records: int,
    max_redrives: int,
    dry_run: bool,
    max_send_bytes: int = DEFAULT_MAX_SEND_BYTES,
    out: TextIO = sys.stdout,
) -> int:
    """Returns the exit code: 0, or :data:`INCOMPLETE` (nothing sent) when the read
    stopped before the end of the topic (what lies beyond was not looked at) or the
    records to send would hold more than ``max_send_bytes``."""
    # identity -> its latest dead letter so far: where it is, and the record if it matches
    # the filter (only then is its value kept, for the send).
    latest: dict[str, tuple[_Position, DlqRecord | None]] = {}
    # The bytes of the records kept for the send. They are held until the one transaction
    # that sends them all: an unbounded selection (100,000 dead letters of 20 KB after an
    # outage) took gigabytes, and an OOM kill left that transaction open on the input for
    # its 15 minutes (found by review). Past the bound no more is kept and nothing is sent.
    held = 0
    too_much = False
    # (partition, offset, code, why): no values kept for records that are not sent.
    refused: list[tuple[int, int, str, str]] = []

    def refuse(r: DlqRecord) -> str | None:
        if r.header(H.SOURCE_TOPIC) not in (None, config.input_topic):
            return f"from another topic ({_shown(r.header(H.SOURCE_TOPIC) or '')})"
        if r.redrive_count >= max_redrives:
            return f"redriven {r.redrive_count} times (--max-redrives)"
        if r.header(H.VALUE_OMITTED) is not None:
            return "value omitted (too large); the original is in the input topic"
        if r.header(H.STUB) is not None:
            # A stub (its dead letter was refused by the topic) has no value: sent back it
            # would only come back as empty_value. The original is in the input topic.
            return "a stub without the value; the original is in the input topic"
        if r.header(H.KEY_TRUNCATED) is not None:
            # The cut key would land on another partition, out of the key's order.
            return "key cut short; the original is in the input topic"
        if r.header(H.HEADERS_TRUNCATED) or r.header(H.HEADERS_OMITTED):
            return "headers cut short or left out; the original is in the input topic"
        if r.value is None:
            # The input had no value (a tombstone): it would come back as empty_value, and
            # one without a key either has a made-up key here (its coordinates).
            return "no value; sent back it would be an empty_value dead letter again"
        return None

    def visit(r: DlqRecord) -> None:
        # The latest dead letter of an event decides, whether or not it matches the
        # filter: it is the one to send if any (its redrive count is the highest), and
        # it supersedes the earlier ones. An earlier one that matches (say
        # retries_exhausted, when the event's latest is k8s_error) was redriven already.
        nonlocal held, too_much
        identity = r.identity  # a hash of the whole record: once
        new = (_Position.of(r), r if flt.matches(r) and not too_much else None)
        entry, earlier = new, latest.get(identity)
        if earlier is not None and earlier[0] > entry[0]:
            entry, earlier = earlier, entry
        latest[identity] = entry
        if earlier is not None and (old := earlier[1]) is not None:
            if earlier is not new:
                held -= old.size  # no longer held: superseded by ``r``
            later = entry[0]
            why = f"superseded by its later dead letter p{later.partition}:{later.offset}"
            refused.append((old.partition, old.offset, old.code, why))
        if entry is new and r is new[1]:
            held += r.size
            # For good: from here on no value is kept, so nothing can be sent.
            too_much = held > max_send_bytes

    # Started first, whether or not anything will be sent: its InitProducerId aborts the
    # open transaction of an earlier run that was killed while sending, which would
    # otherwise hold every input event behind it back from the service for up to
    # _TRANSACTION_TIMEOUT_MS. Running the tool again is how that is ended.
    producer = None if dry_run else await _transactional_producer(config)
    unknown: str | None = None  # what CommitOutcomeUnknown said (a str: no reference cycle)
    try:
        if producer is not None:
            print(f"transactional id {redrive_transactional_id(config)}", file=out)
        # Every partition, whatever --partition says: an input's later dead letter (its
        # copy's, which can land on another partition) decides whether it is sent.
        read, complete = await read_dlq(
            config, max_records=max_records, visit=visit, partition=flt.partition, narrow=False
        )
        selected: list[DlqRecord] = []
        for _, r in sorted(latest.values(), key=lambda e: (e[0].partition, e[0].offset)):
            if r is None:
                continue
            why = refuse(r)
            if why is None:
                selected.append(r)
            else:
                refused.append((r.partition, r.offset, r.code, why))
        refused.sort()
        for partition, offset, code, why in refused[:20]:
            print(f"refused p{partition}:{offset} ({_shown(code)}): {why}", file=out)
        if len(refused) > 20:
            print(f"refused {len(refused) - 20} more", file=out)
        # Cut short, a later dead letter of a selected input may lie beyond: sending the one
        # at hand would redrive that input once more. Nothing is sent then.
        send = complete and not too_much and producer is not None
        if too_much:
            # Past the bound nothing more was kept: the selection listed would be partial.
            selected = []
        if not send:
            for r in selected[:20]:
                print(f"would redrive p{r.partition}:{r.offset} ({_shown(r.code)})", file=out)
        interrupted = False
        if send and selected:
            try:
                interrupted = await _publish(producer, config, selected)
            except CommitOutcomeUnknown as exc:
                unknown = str(exc)
                raise
        verb = "redriven" if send else "would redrive"
        if not too_much:
            print(
                f"{verb} {len(selected)}, refused {len(refused)}, read {read} "
                f"from {config.dlq_topic} to {config.input_topic}",
                file=out,
            )
        if interrupted:
            # The signal that came during the commit, now that it is known to have landed
            # (until_signalled reports it and exits 128 + its number).
            raise asyncio.CancelledError
        if too_much:
            print(
                f"too much for one run, nothing sent (read {read}): the selected records hold "
                f"more than --max-send-bytes {max_send_bytes}; narrow the selection (--code, "
                "--partition, --from-offset/--to-offset, --since/--until) and run it once "
                "per part",
                file=out,
            )
        if not complete:
            print(
                f"incomplete, nothing sent: stopped after --max-records {max_records} or "
                f"{_IDLE_POLLS // 2} s without a record before the end of the topic; raise "
                "--max-records (a later dead letter of an input may lie beyond)",
                file=out,
            )
        return INCOMPLETE if too_much or not complete else 0
    finally:
        if producer is not None:
            try:
                await producer.stop()
            except asyncio.CancelledError:
                # Another signal while stopping must not replace the news that the
                # records may have been sent with "nothing was sent".
                if unknown is not None:
                    raise CommitOutcomeUnknown(unknown) from None
                raise
            except Exception:  # the run's own outcome is what matters here
                pass


def _shown(text: str, limit: int = 60) -> str:
    """An input-derived value for the terminal: escaped, bounded."""
    return ascii(text)[1:-1][:limit]


class _Position(NamedTuple):
    """Where a dead letter is, ordered so that of two dead letters of one input the
    later compares greater: more redrives, then time."""

    redrive_count: int
    timestamp_ms: int
    partition: int
    offset: int

    @classmethod
    def of(cls, r: DlqRecord) -> _Position:
        return cls(r.redrive_count, r.timestamp_ms, r.partition, r.offset)


def failure(exc: BaseException, errors: Sequence[BaseException], config: Config) -> str:
    """Why a dlq run failed, in plain words and once: a Kafka failure diagnosed as ``check``
    does (from the client's own logged ``errors``), anything else by its message."""
    from aiokafka.errors import KafkaError

    from service.app.check import diagnose_kafka

    if isinstance(exc, KafkaError | OSError | TimeoutError):
        return diagnose_kafka([*errors, exc], config)
    return str(exc) or type(exc).__name__


def redrive_transactional_id(config: Config) -> str:
    """The tool's own transactional id, one per input topic: two runs at once fence each
    other (the later one wins) instead of both sending. Under the service's prefix, so the
    prefixed TransactionalId ACL a deployment has for the service covers it."""
    return f"{config.effective_transactional_id_prefix}-dlq-redrive-{config.input_topic}"


async def _transactional_producer(config: Config) -> Any:
    """The tool's producer, started: InitProducerId under its own id fences an earlier
    run and aborts that run's open transaction."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        **config.kafka_client_args(),
        transactional_id=redrive_transactional_id(config),
        # A large run (up to --max-records records of up to a megabyte) can outlast
        # aiokafka's 60 s: the broker's default cap (transaction.max.timeout.ms).
        transaction_timeout_ms=_TRANSACTION_TIMEOUT_MS,
        enable_idempotence=True,
        acks="all",
    )
    try:
        await producer.start()
    except BaseException:
        # Half-started (the broker unreachable, a signal during InitProducerId): its
        # connections are closed here, not left to the garbage collector's warning.
        with contextlib.suppress(Exception):
            await producer.stop()
        raise
    return producer


class CommitOutcomeUnknown(Exception):
    """A signal came while the redrive's commit was under way, and the broker did not
    confirm it within :data:`_COMMIT_WAIT_S`."""


async def _publish(producer: Any, config: Config, records: Sequence[DlqRecord]) -> bool:
    """All of ``records`` in one transaction: on any failure none is visible to the
    service (it reads read_committed), so the run can simply be repeated.

    Returns whether a signal (a cancel) came while the commit was under way: the commit
    was then seen through, and the records were sent.
    """
    await producer.begin_transaction()
    try:
        futures = [
            await producer.send(
                config.input_topic, key=r.key, value=r.value, headers=redrive_headers(r)
            )
            for r in records
        ]
        await asyncio.gather(*futures)
    except BaseException:
        # Not committed (a failure, or a signal while sending): aborted, nothing visible.
        with contextlib.suppress(Exception):
            await producer.abort_transaction()
        raise
    # Once its EndTxn is on its way, a commit cannot be called back: aiokafka shields it
    # from a cancel, and the producer's stop() afterwards may or may not cut it off. A
    # signal now waits for the outcome instead, so that what the tool says is true: sent
    # (the summary line is printed), or not known (the operator must look before running
    # it again, which would send every record twice).
    commit = asyncio.ensure_future(producer.commit_transaction())
    try:
        await asyncio.shield(commit)
    except asyncio.CancelledError:
        if commit.cancelled():
            raise
        try:
            await asyncio.wait_for(asyncio.shield(commit), _COMMIT_WAIT_S)
        except (TimeoutError, asyncio.CancelledError):  # not in time, or a second signal
            commit.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise CommitOutcomeUnknown(
                f"stopped by a signal while committing, and the commit was not confirmed "
                f"(within {_COMMIT_WAIT_S:.0f} s, or before another signal came): the "
                f"{len(records)} records may or may not "
                f"have been sent to {config.input_topic}; look for them (header "
                f"{H.REDRIVE_COUNT}) before running redrive again"
            ) from None
        return True
    return False
