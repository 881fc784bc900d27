"""structlog set-up: JSON lines for machines, a readable console form for people.

The service's own log lines go from structlog straight to the stream (a filtering bound
logger over a print logger, JSON encoded by msgspec): one line per event is written on
the hot path, and the standard-library logging machinery in between cost more than the
rest of an event's processing. Standard-library logging (aiokafka, kubernetes_asyncio,
aiohttp) is routed through the same renderer, so one stream carries everything in one
format.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import msgspec
import structlog

__all__ = ["RepeatFilter", "configure_logging"]

_encoder = msgspec.json.Encoder(enc_hook=str)


def _dumps(obj: Any, **_: Any) -> str:
    return _encoder.encode(obj).decode()


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

    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),
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
