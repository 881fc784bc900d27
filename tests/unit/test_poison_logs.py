"""Hostile input never makes a long log line, and a replayed dead letter is logged once."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from service.app import logs
from service.app.logs import configure_logging
from service.crs.ports import UnavailableError
from service.stream import processor as processor_module
from service.stream.codec import InputRef, encode_input
from service.stream.metrics import StreamMetrics
from service.stream.processor import Processor, RetryLater
from tests import nova
from tests.unit.test_poison_boundary import run
from tests.unit.test_processor import VM, ScriptedRecorder, outcome

# No line may be longer, traceback included; a value taken from input is a few hundred
# bytes at most.
LINE_BOUND = 16 * 1024
VALUE_BOUND = 600
BIG = 900_000


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    configure_logging("DEBUG", "json", stream=out)
    # The module's logger may have been cached under an earlier configuration.
    monkeypatch.setattr(processor_module, "log", structlog.get_logger(processor_module.__name__))
    yield out
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def valid(**kw: Any) -> tuple[bytes, list[tuple[str, bytes]]]:
    return encode_input(nova.decision_dict("hv-1"), nova.request(VM), **kw)


def structured(**fields: Any) -> bytes:
    value, _ = valid()
    doc = json.loads(value)
    doc.update(fields)
    return json.dumps(doc).encode()


def binary_headers(**override: bytes) -> list[tuple[str, bytes]]:
    _, headers = valid(binary=True)
    named = dict(headers)
    named.update(override)
    return list(named.items())


def hostile() -> list[tuple[bytes | None, bytes | None, Any]]:
    """(key, value, headers) of records whose text would end up in log lines."""
    value, headers = valid()
    binary_value, _ = valid(binary=True)
    return [
        (b"k" * BIG, value, headers),  # inconsistent_subject, key in the reason
        (None, structured(subject="s" * BIG), None),  # inconsistent_subject, subject
        (None, structured(specversion="v" * BIG), None),  # unsupported_specversion
        (None, structured(type="t" * BIG), None),  # unknown_type
        (None, structured(specversion=["x" * 1000] * 900), None),
        (None, binary_value, binary_headers(ce_specversion=b"1" * BIG)),
        (None, binary_value, binary_headers(ce_type=b"t" * BIG)),
        (None, binary_value, [*binary_headers(), ("ce_id", b"\xff" * BIG)]),  # read, bad
        (None, b"[" * 100_000, None),
        (None, b'{"a":' + b"9" * BIG + b"}", None),
        (None, b'"' + b"\xff" * BIG + b'"', None),
        (b"\xff" * BIG, value, [("h" * BIG, b"v" * BIG)]),
        # Valid, so classified: its id and instance UUID are logged.
        (None, structured(id="i" * BIG, subject=None), None),
    ]


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    text = out.getvalue()
    raw = text.splitlines()
    assert raw, "nothing was logged"
    too_long = [len(line) for line in raw if len(line.encode()) > LINE_BOUND]
    assert not too_long, f"log lines of {too_long} bytes"
    parsed = [json.loads(line) for line in raw]
    for line in parsed:
        for name, value in line.items():
            if name != "exception":
                assert len(str(value).encode()) <= VALUE_BOUND, (name, str(value)[:200])
    return parsed


def make(recorder: ScriptedRecorder) -> Processor:
    return Processor(
        recorder,  # type: ignore[arg-type]
        StreamMetrics(),
        output_topic="out",
        dlq_topic="dlq",
        max_event_bytes=2_000_000,
        max_attempts=2,
    )


class Echo(ScriptedRecorder):
    async def _next(self, kind: str, decision: Any, request: Any) -> Any:
        return outcome(kind, "no_cr")


def test_no_log_line_from_hostile_input_is_long(captured: io.StringIO) -> None:
    proc = make(Echo())
    for offset, (key, value, headers) in enumerate(hostile()):
        run(proc.process(InputRef(topic="in", partition=0, offset=offset), key, value, headers))
    parsed = lines(captured)
    events = [line["event"] for line in parsed]
    assert events.count("dead_letter") == len(hostile()) - 1
    assert events.count("classified") == 1


def test_errors_with_huge_messages_make_bounded_lines(captured: io.StringIO) -> None:
    value, headers = valid()
    huge = "x" * BIG
    proc = make(
        ScriptedRecorder(
            UnavailableError(huge, status=503),
            UnavailableError(huge, status=503),
            ValueError(huge),
        )
    )
    ref = InputRef(topic="in", partition=0, offset=1)
    with pytest.raises(RetryLater):
        run(proc.process(ref, VM.encode(), value, headers, attempt=1))
    run(proc.process(ref, VM.encode(), value, headers, attempt=2))  # retries_exhausted
    other = InputRef(topic="in", partition=0, offset=2)
    run(proc.process(other, VM.encode(), value, headers))
    parsed = lines(captured)
    assert [line.get("code") for line in parsed] == [None, "retries_exhausted", "internal_error"]
    assert "ValueError" in parsed[-1]["exception"]
    assert len(parsed[-1]["exception"]) <= logs.MAX_EXCEPTION_CHARS


def test_a_replayed_dead_letter_is_logged_once(captured: io.StringIO) -> None:
    proc = make(Echo())
    ref = InputRef(topic="in", partition=0, offset=9)
    for _ in range(3):  # the batch was replayed twice after failed commits
        out = run(proc.process(ref, b"k", b"not json", None))
        assert out.dead_letter
    warnings = [line for line in lines(captured) if line["level"] == "warning"]
    assert len(warnings) == 1


def test_the_renderer_cuts_what_callers_did_not(captured: io.StringIO) -> None:
    log = structlog.get_logger("test")
    log.warning("library_said", **{f"f{i}": "v" * 1000 for i in range(100)}, blob=b"b" * BIG)
    try:
        raise KeyError("k" * BIG)
    except KeyError:
        log.exception("failed", partition=3)
    logging.getLogger("aiokafka").warning("record %s", "r" * BIG)
    raw = captured.getvalue().splitlines()
    assert len(raw) == 3
    assert all(len(line.encode()) <= LINE_BOUND for line in raw)
    first, second, third = (json.loads(line) for line in raw)
    assert first["event"] == "library_said"
    assert first["line_cut_bytes"] > LINE_BOUND
    assert second["partition"] == 3
    assert second["exception"].startswith("Traceback")
    assert second["exception"].rstrip().endswith("kkk'")  # the end names the error
    assert third["logger"] == "aiokafka"
    assert len(third["event"]) <= logs.MAX_VALUE_CHARS


def test_at_info_only_classifications_that_touched_the_cluster_are_logged(
    captured: io.StringIO,
) -> None:
    import msgspec

    from service.crs.outcome import AllocationStatus

    configure_logging("INFO", "json", stream=captured)
    routine = msgspec.structs.replace(
        outcome("no_host_found", "slot_exhausted"), allocation=AllocationStatus.NOT_APPLICABLE
    )
    written = outcome()  # slot_used, allocation written
    proc = make(ScriptedRecorder(routine, written))
    value, headers = valid()
    for offset in range(2):
        ref = InputRef(topic="in", partition=0, offset=offset)
        run(proc.process(ref, VM.encode(), value, headers))
    classified = [line for line in lines(captured) if line["event"] == "classified"]
    assert [line["allocation"] for line in classified] == ["written"]
    # The one line of a cluster change locates it: the event, the host, the slot, the races.
    (line,) = classified
    assert (line["partition"], line["offset"], line["instance_uuid"]) == (0, 1, VM)
    assert (line["host"], line["reservation"], line["conflicts"]) == (
        written.target_host,
        written.reservation,
        written.conflicts,
    )
