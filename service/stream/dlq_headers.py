"""The dead-letter wire contract: the names of the ``crs.*`` headers, spelled once.

A dead letter (or its stub) carries these beside the input's own headers; the processor
writes them (:mod:`service.stream.codec`, :mod:`service.stream.processor`) and
``crs-consumer dlq`` reads them (:mod:`service.app.dlq`). Consumers of the dead-letter
topic outside this repository depend on the same names: change none lightly.
"""

from __future__ import annotations

__all__ = [
    "ERROR",
    "HEADERS_OMITTED",
    "HEADERS_TRUNCATED",
    "KEY_SIZE",
    "KEY_TRUNCATED",
    "PREFIX",
    "REASON",
    "REDRIVE_COUNT",
    "SOURCE_OFFSET",
    "SOURCE_PARTITION",
    "SOURCE_TOPIC",
    "STUB",
    "STUB_ERROR",
    "VALUE_OMITTED",
    "VALUE_SHA256",
    "VALUE_SIZE",
]

# Every header of ours starts so; an input's own headers with it are replaced.
PREFIX = "crs."

# Why: the poison code and a bounded reason.
ERROR = "crs.error"
REASON = "crs.reason"
# Where the input lies (the original stays there until the topic's retention).
SOURCE_TOPIC = "crs.source.topic"
SOURCE_PARTITION = "crs.source.partition"
SOURCE_OFFSET = "crs.source.offset"
# Survives dead-lettering, so `crs-consumer dlq redrive` can refuse to loop a record.
REDRIVE_COUNT = "crs.redrive.count"
# A stub (the full dead letter was refused): the sizes and digest of what it stands for.
STUB = "crs.stub"
STUB_ERROR = "crs.stub.error"
KEY_SIZE = "crs.key.size"
VALUE_SIZE = "crs.value.size"
VALUE_SHA256 = "crs.value.sha256"
# What a dead letter cut or left out to fit its bounds.
KEY_TRUNCATED = "crs.key.truncated"
HEADERS_TRUNCATED = "crs.headers.truncated"
HEADERS_OMITTED = "crs.headers.omitted"
VALUE_OMITTED = "crs.value.omitted"
