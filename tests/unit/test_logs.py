"""Logs are one JSON object per line, for the service's own lines and for libraries'."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from service.app.logs import configure_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_with_context_for_own_and_library_logs(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    log = structlog.get_logger("test-json").bind(event_id="e-1", partition=3, offset=42)
    log.info("classified", instance_uuid="vm-1", cr_slot="slot_used")
    log.debug("not shown at INFO")
    logging.getLogger("aiokafka.consumer").warning("rebalance %s", "started")
    logging.getLogger("aiokafka.consumer").info("chatty library line, filtered")

    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    own, lib = lines
    assert own["event"] == "classified"
    assert own["level"] == "info"
    assert (own["event_id"], own["partition"], own["offset"]) == ("e-1", 3, 42)
    assert own["instance_uuid"] == "vm-1"
    assert own["timestamp"].endswith("Z")
    assert lib["event"] == "rebalance started"
    assert lib["logger"] == "aiokafka.consumer"
    assert lib["level"] == "warning"


class _Writes(io.StringIO):
    """A stream that counts its writes: each is a syscall on the service's stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


def test_each_line_is_one_write(restore_logging: None) -> None:
    out = _Writes()
    configure_logging("INFO", "json", stream=out)
    log = structlog.get_logger("test-writes")
    log.info("allocation_written", reservation="r-1")
    log.info("classified", instance_uuid="vm-1")
    assert out.getvalue().count("\n") == 2
    assert out.writes == 2


def test_exceptions_are_rendered_into_the_json_line(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    try:
        raise ValueError("boom")
    except ValueError:
        structlog.get_logger("test-exc").exception("dead_letter", code="internal_error")
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["code"] == "internal_error"
    assert "ValueError: boom" in record["exception"]


def test_console_format_is_human_readable(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("DEBUG", "console", stream=out)
    structlog.get_logger("test-console").debug("hello", who="operator")
    text = out.getvalue()
    assert "hello" in text
    assert "who=operator" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_identical_library_lines_collapse_with_a_count(restore_logging: None) -> None:
    from service.app.logs import RepeatFilter

    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    now = [0.0]
    handler = logging.getLogger().handlers[0]
    handler.filters[:] = [RepeatFilter(30.0, clock=lambda: now[0])]
    lib = logging.getLogger("aiokafka.conn")
    for i in range(200):  # a broker outage: 200 identical errors in 20 s
        now[0] = i * 0.1
        lib.error("Unable connect to node with id %s", 1)
    lib.error("another message")  # a different line is not held back
    now[0] = 31.0
    lib.error("Unable connect to node with id %s", 1)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["event"], x.get("repeated")) for x in lines] == [
        ("Unable connect to node with id 1", None),
        ("another message", None),
        ("Unable connect to node with id 1", 199),
    ]


def test_repeat_filter_memory_is_bounded() -> None:
    from service.app.logs import RepeatFilter

    f = RepeatFilter(30.0, max_keys=10, clock=lambda: 0.0)
    for i in range(100):
        record = logging.LogRecord("lib", logging.ERROR, __file__, 1, f"line {i}", None, None)
        assert f.filter(record)
    assert len(f._seen) <= 10
