"""One input record in, exactly one record out: a classification or a dead letter.

The processor owns the per-event error policy. Bad input is poison and goes to the
dead-letter topic at once. A retryable failure (the cluster is unavailable) is handed
back to the consumer loop as :class:`RetryLater`, which pauses the partition and tries
the same offset again after a back-off; after ``max_attempts`` the event is dead-lettered
with the last error. Anything else unexpected is dead-lettered too (and logged as an
error): the service never crashes on one event and never drops one silently.
:meth:`Processor.process` returns a record or raises :class:`RetryLater`, nothing else.

Dead letters always fit the producer's record limit (:class:`DeadLetterBounds`): key,
headers and reason are bounded, and the value is left out when it would not fit. Should
the broker refuse one anyway, :func:`stub_dead_letter` gives the small record to publish
instead (coordinates, sizes, a hash of the value). Each dead letter is logged once,
however often its batch is replayed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from service.crs import Recorder
from service.crs.outcome import AllocationStatus, Outcome
from service.crs.ports import OUTCOME_HOOK, ApiError, ForbiddenError
from service.stream import dlq_headers as H
from service.stream.codec import (
    INTERNAL_ERROR,
    MAX_LOGGED_BYTES,
    MAX_REASON_BYTES,
    InputRef,
    Poison,
    clip,
    dead_letter_headers,
    decode_input,
    encode_output,
)
from service.stream.metrics import StreamMetrics

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "EXPECTED_OUTPUT",
    "DeadLetterBounds",
    "DeadLetterSource",
    "OutRecord",
    "Processor",
    "RetryLater",
    "record_size",
    "stub_dead_letter",
]

log = structlog.get_logger(__name__)


class _RecordLog:
    """One record's logger, bound (coordinates, then event id and instance UUID) only
    when a line is actually written."""

    __slots__ = ("event_id", "instance_uuid", "ref")

    def __init__(self, ref: InputRef) -> None:
        self.ref = ref
        self.event_id: str | None = None
        self.instance_uuid = ""

    def logger(self) -> Any:
        ref = self.ref
        bound = log.bind(topic=ref.topic, partition=ref.partition, offset=ref.offset)
        if self.event_id is not None:
            bound = bound.bind(event_id=clip(self.event_id), instance_uuid=clip(self.instance_uuid))
        return bound


Headers = Sequence[tuple[str, bytes | None]]

# Survives dead-lettering (see service.stream.dlq_headers); the name dlq imports.
REDRIVE_HEADER = H.REDRIVE_COUNT
# Bound on the kept count's value: it comes from input (any producer can set it).
_REDRIVE_VALUE_BYTES = 20

# aiokafka's default ``max_request_size``: the producer refuses a larger record outright.
DEFAULT_MAX_RECORD_BYTES = 1_048_576

# Room kept below ``max_record_bytes`` beyond :func:`record_size` (itself an upper bound
# of aiokafka's own estimate): a dead letter that just fits is one config change away
# from not fitting.
_MARGIN_BYTES = 512
# A record batch header (61 bytes) plus the fixed part of one record (aiokafka: 21).
_RECORD_OVERHEAD = 61 + 21
# The stub keeps a key only when it is this short (an instance UUID is 36 bytes).
_STUB_KEY_BYTES = 128
_STUB_REASON_BYTES = MAX_LOGGED_BYTES
# Dead letters already logged, per input coordinate: a replayed batch does not re-log them.
_LOGGED_MEMORY = 4096


def _varint_size(n: int) -> int:
    # Kafka's zig-zag varint of a non-negative length: 7 bits per byte.
    n <<= 1
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def record_size(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    """Bytes one record takes in a produce request, overhead included (an upper bound).

    Mirrors aiokafka's ``estimate_size_in_bytes``, the figure the producer compares with
    ``max_request_size`` before sending.
    """
    size = _RECORD_OVERHEAD + _varint_size(len(headers))
    for part in (key, value):
        size += 1 if part is None else _varint_size(len(part)) + len(part)
    for name, raw in headers:
        n = len(name.encode("utf-8", errors="replace"))
        size += _varint_size(n) + n
        size += 1 if raw is None else _varint_size(len(raw)) + len(raw)
    return size


@dataclass(frozen=True, slots=True)
class DeadLetterBounds:
    """How much of an input a dead letter carries, settled from the producer's limit.

    With the default 1 MiB: key 4 KiB, each original header value 4 KiB, all original
    headers 64 KiB, the reason 1 KiB; the value is kept whole when the record still fits
    ``max_record_bytes`` minus a margin, and left out otherwise.
    """

    max_record_bytes: int
    key_bytes: int
    header_name_bytes: int
    header_value_bytes: int
    headers_bytes: int
    reason_bytes: int

    @classmethod
    def for_max_record_bytes(cls, max_record_bytes: int) -> DeadLetterBounds:
        if max_record_bytes < 16 * 1024:
            raise ValueError(f"max_record_bytes {max_record_bytes} is below 16 KiB")
        m = max_record_bytes
        return cls(
            max_record_bytes=m,
            key_bytes=min(4096, m // 256),
            header_name_bytes=256,
            header_value_bytes=min(4096, m // 256),
            headers_bytes=min(64 * 1024, m // 16),
            reason_bytes=min(MAX_REASON_BYTES, m // 64),
        )

    @property
    def budget(self) -> int:
        """The most a dead letter may take by :func:`record_size`."""
        return self.max_record_bytes - _MARGIN_BYTES


@dataclass(frozen=True, slots=True)
class DeadLetterSource:
    """What a dead letter is about: enough to build its stub (:func:`stub_dead_letter`).

    ``key`` and ``value`` are the input's own objects (references, not copies).
    """

    ref: InputRef
    code: str
    reason: str
    key: bytes | None
    value: bytes | None


class OutRecord(msgspec.Struct, frozen=True):
    """A record to produce, in the same transaction as its input's offset.

    A dead letter carries its ``source``, from which :func:`stub_dead_letter` builds the
    small record to publish instead when the broker rejects the dead letter itself.
    A msgspec Struct (like Outcome, Snapshot): one is built per event, in 0.1 µs
    against a frozen dataclass's 0.9.
    """

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    dead_letter: bool = False
    source: DeadLetterSource | None = None


# Set by the engine for its decisions: told (input offset, record) the classification a
# placement will have if its guarded write succeeds, before the write is sent
# (ports.OUTCOME_HOOK), so the engine can produce it into the partition's open transaction
# while the write is in flight. When the decision ends with that outcome, process()
# returns the very record it was told; anything else (another slot after a conflict, a
# failed write, a retry) is a different record, and the engine discards what it produced
# ahead.
EXPECTED_OUTPUT: ContextVar[Callable[[int, OutRecord], None] | None] = ContextVar(
    "crs_expected_output", default=None
)


def stub_dead_letter(out: OutRecord, *, error: str | None = None) -> OutRecord:
    """The stub to publish when the dead letter ``out`` cannot be produced at all.

    For a dead letter that fits the producer's limit but that the broker still rejects
    (e.g. the dead-letter topic has a lower ``max.message.bytes``, or the record is
    invalid for it): rather than replaying the batch forever, the engine publishes this
    instead. No value and no original headers; the key only if it is at most 128 bytes.
    Headers: ``crs.error``, ``crs.reason`` (at most 256 bytes), ``crs.source.topic``,
    ``crs.source.partition``, ``crs.source.offset``, ``crs.stub`` (``true``),
    ``crs.key.size`` (absent without a key), ``crs.value.size`` and ``crs.value.sha256``
    (hex; both absent without a value), and ``crs.stub.error`` (``error``: why the full
    dead letter was refused, at most 256 bytes) when given. Well under 2 KiB. The
    original stays in the input topic at the coordinates the headers name (until the
    topic's retention removes it).
    """
    src = out.source
    if not out.dead_letter or src is None:
        raise ValueError("only a dead letter built by the Processor has a stub")
    key = src.key if src.key is not None and len(src.key) <= _STUB_KEY_BYTES else None
    headers = dead_letter_headers(src.code, clip(src.reason, _STUB_REASON_BYTES), src.ref)
    headers.append((H.STUB, b"true"))
    if src.key is not None:
        headers.append((H.KEY_SIZE, str(len(src.key)).encode()))
    if src.value is not None:
        headers.append((H.VALUE_SIZE, str(len(src.value)).encode()))
        headers.append((H.VALUE_SHA256, hashlib.sha256(src.value).hexdigest().encode()))
    if error is not None:
        headers.append((H.STUB_ERROR, clip(error, _STUB_REASON_BYTES).encode("utf-8")))
    return OutRecord(
        topic=out.topic,
        key=_key_or_coordinates(key, None, src.ref),
        value=None,
        headers=headers,
        dead_letter=True,
        source=src,
    )


def _key_or_coordinates(key: bytes | None, value: bytes | None, ref: InputRef) -> bytes | None:
    """A Kafka record needs a key or a value (aiokafka refuses neither): a dead letter
    that has neither is keyed by its source coordinates ``topic/partition/offset``."""
    if key is None and value is None:
        return f"{ref.topic}/{ref.partition}/{ref.offset}".encode()
    return key


def build_dead_letter(
    topic: str,
    source: DeadLetterSource,
    headers: Headers | None,
    bounds: DeadLetterBounds,
    *,
    max_value_bytes: int | None = None,
) -> OutRecord:
    """The dead letter for ``source``: the input's key, value and headers, within ``bounds``.

    What does not fit is cut or left out, and a ``crs.*`` header says so:
    ``crs.key.truncated`` (the key's original size; the key keeps its first bytes),
    ``crs.headers.truncated`` (how many original header values were cut),
    ``crs.headers.omitted`` (how many original headers were left out: name too long, or
    over the total), ``crs.value.omitted`` (the value's size; the value is left out).
    """
    key = source.key
    extra = dead_letter_headers(source.code, clip(source.reason, bounds.reason_bytes), source.ref)
    if key is not None and len(key) > bounds.key_bytes:
        extra.append((H.KEY_TRUNCATED, str(len(key)).encode()))
        key = bytes(key[: bounds.key_bytes])
    kept: list[tuple[str, bytes]] = []
    count: bytes | None = None  # the input's redrive count, kept (see below)
    used = cut = omitted = 0
    for name, raw in headers or ():
        if not isinstance(name, str):
            continue
        if name == REDRIVE_HEADER:
            # Outside the headers' budget (when the input's own headers fill it, dropping
            # the count would let a record loop for ever), so bounded: the first valid one
            # (a value of at most _REDRIVE_VALUE_BYTES) only.
            if count is None and raw is not None and len(raw) <= _REDRIVE_VALUE_BYTES:
                count = bytes(raw)
            continue
        if name.startswith(H.PREFIX):
            continue  # ours are replaced (a re-dead-lettered record gets fresh ones)
        try:
            name_bytes = len(name.encode("utf-8"))
        except UnicodeEncodeError:
            omitted += 1
            continue
        if name_bytes > bounds.header_name_bytes:
            omitted += 1
            continue
        if raw is not None and len(raw) > bounds.header_value_bytes:
            raw = bytes(raw[: bounds.header_value_bytes])
            cut += 1
        size = name_bytes + (0 if raw is None else len(raw)) + 10
        if used + size > bounds.headers_bytes:
            omitted += 1
            continue
        used += size
        kept.append((name, raw))  # type: ignore[arg-type]  # Kafka allows null values
    if count is not None:
        extra.append((REDRIVE_HEADER, count))
    if cut:
        extra.append((H.HEADERS_TRUNCATED, str(cut).encode()))
    if omitted:
        extra.append((H.HEADERS_OMITTED, str(omitted).encode()))
    value = source.value
    if value is not None:
        # The value is kept whole or not at all: a cut value is neither the input nor
        # parseable, and the original stays in the input topic at the named coordinates.
        room = bounds.budget - record_size(key, None, [*kept, *extra]) - 32
        too_big = max_value_bytes is not None and len(value) > max_value_bytes
        if too_big or len(value) + _varint_size(len(value)) > room:
            extra.append((H.VALUE_OMITTED, str(len(value)).encode()))
            value = None
    return OutRecord(
        topic=topic,
        key=_key_or_coordinates(key, value, source.ref),
        value=value,
        headers=kept + extra,
        dead_letter=True,
        source=source,
    )


class _LoggedOnce:
    """Remembers the last few thousand dead letters logged (LRU)."""

    def __init__(self, size: int = _LOGGED_MEMORY) -> None:
        self._size = size
        self._seen: OrderedDict[tuple[str, int, int, str], None] = OrderedDict()

    def first_time(self, ref: InputRef, code: str) -> bool:
        key = (ref.topic, ref.partition, ref.offset, code)
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True


class RetryLater(Exception):
    """The event could not be processed now; try the same offset again later."""

    def __init__(self, error: BaseException, attempt: int) -> None:
        super().__init__(clip(str(error)))
        self.error = error
        self.attempt = attempt


class Processor:
    """Decides one record at a time; see the module docstring for the policy.

    ``max_record_bytes`` is the producer's ``max_request_size``: every dead letter is
    bounded to fit it (:class:`DeadLetterBounds`). ``max_dead_letter_value_bytes``
    optionally lowers the largest value a dead letter carries.
    """

    def __init__(
        self,
        recorder: Recorder,
        metrics: StreamMetrics,
        *,
        output_topic: str,
        dlq_topic: str,
        max_event_bytes: int,
        max_attempts: int,
        max_dead_letter_value_bytes: int | None = None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self._recorder = recorder
        self._metrics = metrics
        self._output_topic = output_topic
        self._dlq_topic = dlq_topic
        self._max_event_bytes = max_event_bytes
        self._max_attempts = max_attempts
        self._max_dead_letter_value = max_dead_letter_value_bytes
        self.bounds = DeadLetterBounds.for_max_record_bytes(max_record_bytes)
        # Read once: the level is configured before the service is built, and asking the
        # logger per event cost 1-2 % of an event.
        self._debug = bool(log.is_enabled_for(logging.DEBUG))
        self._logged = _LoggedOnce()

    @property
    def dlq_topic(self) -> str:
        return self._dlq_topic

    @property
    def output_topic(self) -> str:
        """Where classifications go, keyed by instance UUID (the engine adds the partition
        of a waiting record's key to a transaction opened ahead)."""
        return self._output_topic

    async def process(
        self,
        ref: InputRef,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        *,
        attempt: int = 1,
        replay: bool = False,
    ) -> OutRecord:
        """Decide one record. Raises :class:`RetryLater` only; everything else is a record.

        ``replay``: the record may have been processed before, by the partition's previous
        owner (the Recorder then re-reads the candidate slots before a write).
        """
        try:
            return await self._process(ref, key, value, headers, attempt, replay)
        except RetryLater:
            raise
        except Exception as exc:  # a bug in the error handling itself: still one record
            with contextlib.suppress(Exception):
                log.exception(
                    "dead_letter_fallback",
                    topic=ref.topic,
                    partition=ref.partition,
                    offset=ref.offset,
                    code=INTERNAL_ERROR,
                )
            # The stub: the smallest dead letter, with the fewest ways to fail.
            return self.stub(ref, key, value, INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")

    def stub(
        self,
        ref: InputRef,
        key: bytes | None,
        value: bytes | None,
        code: str,
        reason: str,
        *,
        error: str | None = None,
    ) -> OutRecord:
        """A stub dead letter for the input at ``ref`` (see :func:`stub_dead_letter`).

        For what never became a full dead letter: a bug while deciding, or a
        classification the output topic refused. Counted as a dead letter of ``code``.
        """
        self._metrics.dead_letters.labels(code).inc()
        source = DeadLetterSource(ref, code, clip(reason), key, value)
        out = OutRecord(self._dlq_topic, None, None, [], dead_letter=True, source=source)
        return stub_dead_letter(out, error=error)

    async def _process(
        self,
        ref: InputRef,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        attempt: int,
        replay: bool,
    ) -> OutRecord:
        started = time.perf_counter()
        # Bound only where a line is written: binding per event was 4 % of an event's CPU.
        bound = _RecordLog(ref)
        try:
            try:
                event = decode_input(value, headers, max_bytes=self._max_event_bytes, key=key)
            except Poison:
                raise
            except Exception as exc:  # decode_input promises Poison only; a bug breaks that
                raise Poison.internal_error(exc) from exc
        except Poison as poison:
            if self._logged.first_time(ref, poison.code):
                if poison.internal:
                    bound.logger().error(
                        "dead_letter", code=poison.code, reason=poison.reason, exc_info=poison
                    )
                else:
                    bound.logger().warning("dead_letter", code=poison.code, reason=poison.reason)
            return self._dead_letter(ref, key, value, headers, poison.code, poison.reason)

        request = event.data.request
        bound.event_id, bound.instance_uuid = event.id, request.instance_uuid
        out_key = request.instance_uuid.encode() or key
        expected: list[tuple[Outcome, OutRecord]] = []  # (outcome, its record) told ahead
        ahead = EXPECTED_OUTPUT.get()
        token = None
        if ahead is not None and event.data.decision.result.target_host is not None:

            def expect(outcome: Outcome) -> None:
                told = self._classification(encode_output(event, ref, outcome), out_key)
                expected[:] = [(outcome, told)]
                ahead(ref.offset, told)

            token = OUTCOME_HOOK.set(expect)
        try:
            try:
                outcome = await self._recorder.record(
                    event.data.decision, request, replay=replay, placed_at=event.time
                )
            finally:
                if token is not None:
                    OUTCOME_HOOK.reset(token)
            if expected and expected[0][0] == outcome:
                # The record the engine was told ahead (and may have produced): the same
                # object back says so (an equal one would be produced again).
                out = expected[0][1]
            else:
                out = self._classification(encode_output(event, ref, outcome), out_key)
        except ApiError as exc:
            # 401/403 is a deployment problem (RBAC, credentials) that an operator fixes:
            # the events wait in their lanes (retried like an outage, up to max_attempts)
            # instead of all going to the dead-letter topic.
            retryable = exc.retryable or isinstance(exc, ForbiddenError)
            error = clip(f"{type(exc).__name__}: {exc}")
            if retryable and attempt < self._max_attempts:
                bound.logger().warning("retry_later", attempt=attempt, error=error)
                reason = "k8s_unavailable" if exc.retryable else "k8s_forbidden"
                self._metrics.retries.labels(reason).inc()
                raise RetryLater(exc, attempt) from exc
            code = "retries_exhausted" if retryable else "k8s_error"
            if self._logged.first_time(ref, code):
                bound.logger().error("dead_letter", code=code, attempt=attempt, error=error)
            return self._dead_letter(ref, key, value, headers, code, error)
        except Exception as exc:  # a bug must cost one event, not the service
            code = "internal_error"  # the same code as a failure while decoding
            if self._logged.first_time(ref, code):
                bound.logger().exception("dead_letter", code=code)
            reason = clip(f"{type(exc).__name__}: {exc}")
            return self._dead_letter(ref, key, value, headers, code, reason)

        self._count(outcome)
        self._metrics.processing.observe(time.perf_counter() - started)
        # Every classification is in the output topic and the counters; a log line per
        # event at info would double the CPU of a routine event (~16 µs of ~25). Info is
        # kept for what changed the cluster or failed to: a written or failed allocation,
        # in this one line (the recorder's own is at debug); the rest at debug, and only
        # built when debug is on.
        written = outcome.allocation in (AllocationStatus.WRITTEN, AllocationStatus.FAILED)
        if written or self._debug:
            (bound.logger().info if written else bound.logger().debug)(
                "classified",
                kind=outcome.kind,
                cr_slot=outcome.cr_slot,
                flavor_group=outcome.flavor_group,
                intent=outcome.intent,
                host=outcome.target_host,
                reservation=outcome.reservation,
                allocation=outcome.allocation,
                conflicts=outcome.conflicts,
            )
        return out

    def _classification(self, value: bytes, key: bytes | None) -> OutRecord:
        return OutRecord(
            topic=self._output_topic,
            key=key,
            value=value,
            headers=[("content-type", b"application/cloudevents+json")],
        )

    def _count(self, outcome: Outcome) -> None:
        self._metrics.events.labels(outcome.kind, outcome.cr_slot).inc()
        self._metrics.allocations.labels(outcome.allocation).inc()
        if outcome.conflicts:
            self._metrics.conflicts.inc(outcome.conflicts)

    def _dead_letter(
        self,
        ref: InputRef,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        code: str,
        reason: str,
    ) -> OutRecord:
        self._metrics.dead_letters.labels(code).inc()
        source = DeadLetterSource(ref=ref, code=code, reason=reason, key=key, value=value)
        return build_dead_letter(
            self._dlq_topic,
            source,
            headers,
            self.bounds,
            max_value_bytes=self._max_dead_letter_value,
        )
