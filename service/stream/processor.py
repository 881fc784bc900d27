"""One input record in, exactly one record out: a classification or a dead letter.

The processor owns the per-event error policy. Bad input is poison and goes to the
dead-letter topic at once. A retryable failure (the cluster is unavailable) is handed
back to the consumer loop as :class:`RetryLater`, which pauses the partition and tries
the same offset again after a back-off; after ``max_attempts`` the event is dead-lettered
with the last error. Anything else unexpected is dead-lettered too (and logged as an
error): the service never crashes on one event and never drops one silently.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from service.crs import Recorder
from service.crs.outcome import Outcome
from service.crs.ports import ApiError, ForbiddenError
from service.stream.codec import (
    InputRef,
    Poison,
    dead_letter_headers,
    decode_input,
    encode_output,
)
from service.stream.metrics import StreamMetrics

__all__ = ["OutRecord", "Processor", "RetryLater"]

log = structlog.get_logger(__name__)

Headers = Sequence[tuple[str, bytes]]
REDRIVE_HEADER = "crs.redrive.count"


@dataclass(frozen=True, slots=True)
class OutRecord:
    """A record to produce, in the same transaction as its input's offset."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    dead_letter: bool = False


class RetryLater(Exception):
    """The event could not be processed now; try the same offset again later."""

    def __init__(self, error: BaseException, attempt: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.attempt = attempt


class Processor:
    def __init__(
        self,
        recorder: Recorder,
        metrics: StreamMetrics,
        *,
        output_topic: str,
        dlq_topic: str,
        max_event_bytes: int,
        max_attempts: int,
        max_dead_letter_value_bytes: int = 1_000_000,
    ) -> None:
        self._recorder = recorder
        self._metrics = metrics
        self._output_topic = output_topic
        self._dlq_topic = dlq_topic
        self._max_event_bytes = max_event_bytes
        self._max_attempts = max_attempts
        self._max_dead_letter_value = max_dead_letter_value_bytes

    async def process(
        self,
        ref: InputRef,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        *,
        attempt: int = 1,
    ) -> OutRecord:
        """Decide one record. Raises :class:`RetryLater` only; everything else is a record."""
        started = time.perf_counter()
        bound = log.bind(topic=ref.topic, partition=ref.partition, offset=ref.offset)
        try:
            event = decode_input(value, headers, max_bytes=self._max_event_bytes, key=key)
        except Poison as poison:
            bound.warning("dead_letter", code=poison.code, reason=poison.reason)
            return self._dead_letter(ref, key, value, headers, poison.code, poison.reason)

        request = event.data.request
        bound = bound.bind(event_id=event.id, instance_uuid=request.instance_uuid)
        try:
            outcome = await self._recorder.record(event.data.decision, request)
            encoded = encode_output(event, ref, outcome)
        except ApiError as exc:
            # 401/403 is a deployment problem (RBAC, credentials) that an operator fixes:
            # the events wait, paused, instead of all going to the dead-letter topic.
            retryable = exc.retryable or isinstance(exc, ForbiddenError)
            if retryable and attempt < self._max_attempts:
                bound.warning("retry_later", attempt=attempt, error=str(exc))
                reason = "k8s_unavailable" if exc.retryable else "k8s_forbidden"
                self._metrics.retries.labels(reason).inc()
                raise RetryLater(exc, attempt) from exc
            code = "retries_exhausted" if retryable else "k8s_error"
            bound.error("dead_letter", code=code, attempt=attempt, error=str(exc))
            return self._dead_letter(ref, key, value, headers, code, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug must cost one event, not the service
            bound.exception("dead_letter", code="internal_error")
            return self._dead_letter(
                ref, key, value, headers, "internal_error", f"{type(exc).__name__}: {exc}"
            )

        self._count(outcome)
        self._metrics.processing.observe(time.perf_counter() - started)
        bound.info(
            "classified",
            kind=outcome.kind,
            cr_slot=outcome.cr_slot,
            flavor_group=outcome.flavor_group,
            intent=outcome.intent,
            reservation=outcome.reservation,
            allocation=str(outcome.allocation),
        )
        return OutRecord(
            topic=self._output_topic,
            key=request.instance_uuid.encode() or key,
            value=encoded,
            headers=[("content-type", b"application/cloudevents+json")],
        )

    def _count(self, outcome: Outcome) -> None:
        self._metrics.events.labels(outcome.kind, outcome.cr_slot).inc()
        self._metrics.allocations.labels(str(outcome.allocation)).inc()
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
        # crs.redrive.count survives, so `dlq redrive` can refuse to loop a record forever.
        original = [
            (k, v) for k, v in (headers or []) if not k.startswith("crs.") or k == REDRIVE_HEADER
        ]
        extra = dead_letter_headers(code, reason, ref)
        if value is not None and len(value) > self._max_dead_letter_value:
            # Too large to produce (the broker's and producer's 1 MiB record limits): a
            # record that can never be sent would block its batch forever. The original
            # stays in the input topic at the coordinates the headers name.
            extra.append(("crs.value.omitted", str(len(value)).encode()))
            value = None
        return OutRecord(
            topic=self._dlq_topic,
            key=key,
            value=value,
            headers=original + extra,
            dead_letter=True,
        )
