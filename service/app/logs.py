"""structlog set-up: JSON lines for machines, a readable console form for people.

The service's own log lines go from structlog straight to the stream (a filtering bound
logger over a print logger, JSON encoded by msgspec): one line per event is written on
the hot path, and the standard-library logging machinery in between cost more than the
rest of an event's processing. Standard-library logging (aiokafka, kubernetes_asyncio,
aiohttp) is routed through the same renderer, so one stream carries everything in one
format.

Every line is bounded, whatever a caller passes: values derived from input are cut at
the call site (to a few hundred bytes, ``service.stream.codec.clip``), and as a backstop
:func:`bound_values` cuts any string value to :data:`MAX_VALUE_CHARS` (a traceback to
:data:`MAX_EXCEPTION_CHARS`, keeping its start and its end, where the error is), and the
renderer replaces a line that still exceeds :data:`MAX_LINE_BYTES` by a short one that
says so. A 900 KB record key can never become a 900 KB log line.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import msgspec
import structlog

__all__ = [
    "MAX_EXCEPTION_CHARS",
    "MAX_LINE_BYTES",
    "MAX_VALUE_CHARS",
    "RepeatFilter",
    "bound_values",
    "configure_logging",
]

MAX_VALUE_CHARS = 1024
MAX_EXCEPTION_CHARS = 8192
MAX_LINE_BYTES = 16 * 1024
# Kept whole when a line is replaced for being too long: they say what and where.
_ESSENTIAL = ("event", "level", "timestamp", "logger", "topic", "partition", "offset", "code")

_SMALL_TYPES = frozenset({int, float, bool, type(None)})

_encoder = msgspec.json.Encoder(enc_hook=str)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = f"...[{len(text) - limit} chars cut]..."
    half = (limit - len(marker)) // 2
    return text[:half] + marker + text[-half:]


def bound_values(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: cut every long string (and bytes) value of a log line."""
    # On the hot path (one line per event): short strings and numbers cost one check.
    for name, value in event_dict.items():
        if type(value) in _SMALL_TYPES:
            continue
        if isinstance(value, str):
            if len(value) > MAX_VALUE_CHARS:
                limit = MAX_EXCEPTION_CHARS if name in ("exception", "stack") else MAX_VALUE_CHARS
                event_dict[name] = _cut(value, limit)
        elif isinstance(value, bytes | bytearray | memoryview):
            event_dict[name] = _cut(repr(bytes(value[: MAX_VALUE_CHARS + 1])), MAX_VALUE_CHARS)
    return event_dict


def _dumps(obj: Any, **_: Any) -> str:
    try:
        line = _encoder.encode(obj)
    except Exception as exc:  # e.g. a lone surrogate: the line must still be written
        obj = {k: repr(v)[:MAX_VALUE_CHARS] for k, v in obj.items()}
        obj["log_encoding_error"] = type(exc).__name__
        line = _encoder.encode(obj)
    if len(line) <= MAX_LINE_BYTES:
        return line.decode()
    # Too many (or too large) fields got past bound_values: keep what locates the event.
    short: dict[str, Any] = {k: str(obj[k])[:256] for k in _ESSENTIAL if k in obj}
    short["line_cut_bytes"] = len(line)
    return _encoder.encode(short).decode()


def configure_logging(level: str = "INFO", fmt: str = "json", stream: TextIO | None = None) -> None:
    out = stream or sys.stderr
    numeric = logging.getLevelName(level)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    else:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer(serializer=_dumps)
    shared.append(bound_values)

    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write (and one syscall) per line: PrintLogger's print() writes the line and
        # its newline separately, two syscalls per line on an unbuffered stream.
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(allow=["repeated"]),
                *shared,
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # Client libraries are chatty at INFO (every rebalance step, every connection).
    for noisy in ("aiokafka", "kafka", "kubernetes_asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, numeric))


class RepeatFilter(logging.Filter):
    """Collapse library log storms: an identical line at most once per ``interval_s``.

    Client libraries log every failed reconnect (aiokafka: dozens of ERROR lines a
    second while a broker is down). The first occurrence of a line passes; identical
    ones (same logger, level and message) within the interval are counted and dropped;
    the first one after the interval passes with ``repeated`` = how many were dropped.
    Only standard-library records pass through here: the service's own structlog lines
    are already one per event.
    """

    def __init__(
        self,
        interval_s: float = 30.0,
        *,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        # key -> (time the line last passed, occurrences dropped since)
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed library call: let the formatter report it
            return True
        key = (record.name, record.levelno, message[:500])
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self._interval_s:
            self._seen[key] = (seen[0], seen[1] + 1)
            return False
        if seen is not None and seen[1]:
            record.repeated = seen[1]
        if seen is None and len(self._seen) >= self._max_keys:
            self._prune(now)
        self._seen[key] = (now, 0)
        return True

    def _prune(self, now: float) -> None:
        expired = [k for k, (t, _) in self._seen.items() if now - t >= self._interval_s]
        for k in expired:
            del self._seen[k]
        if len(self._seen) >= self._max_keys:
            # Still full of live keys: forget the oldest half rather than grow unbounded.
            oldest = sorted(self._seen, key=lambda k: self._seen[k][0])
            for k in oldest[: len(oldest) // 2]:
                del self._seen[k]
