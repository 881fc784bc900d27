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
from typing import Any, TextIO

import msgspec
import structlog

__all__ = ["configure_logging"]

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
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # Client libraries are chatty at INFO (every rebalance step, every connection).
    for noisy in ("aiokafka", "kafka", "kubernetes_asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, numeric))
