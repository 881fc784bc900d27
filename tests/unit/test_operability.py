"""Operability pieces without I/O: zero-initialised series, build info, DLQ filters and
redrive headers, the redrive count surviving a second dead-lettering, --version."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from service.app.check import file_problems
from service.app.cli import main, until_signalled
from service.app.config import Config
from service.app.dlq import DlqFilter, DlqRecord, parse_time, redrive_headers
from service.stream.codec import InputRef
from service.stream.metrics import StreamMetrics, service_version
from service.stream.processor import Processor
from tests.conftest import REPO


def _series(metrics: StreamMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_known_label_sets_exist_at_zero_before_any_event() -> None:
    text = _series(StreamMetrics())
    for line in (
        'crs_retries_total{reason="k8s_unavailable"} 0.0',
        'crs_retries_total{reason="k8s_forbidden"} 0.0',
        'crs_retries_total{reason="kafka_commit"} 0.0',
        'crs_dead_letters_total{code="retries_exhausted"} 0.0',
        'crs_dead_letters_total{code="not_json"} 0.0',
        'crs_allocations_total{status="failed"} 0.0',
        'crs_events_total{cr_slot="slot_used",kind="placement"} 0.0',
        'crs_commit_failures_total{reason="transient"} 0.0',
        "crs_fenced_total 0.0",
        'crs_dependency_up{dependency="kafka"} 0.0',
        'crs_dependency_up{dependency="kubernetes"} 0.0',
    ):
        assert line in text, line


def test_build_info_and_process_series() -> None:
    text = _series(StreamMetrics())
    assert 'crs_build_info{python="' in text
    assert f'version="{service_version()}"' in text
    assert "process_cpu_seconds_total" in text
    assert "python_gc_objects_collected_total" in text


def test_stalled_partition_series_goes_with_the_partition() -> None:
    m = StreamMetrics()
    m.stalled.labels("in", "3").set(1)
    assert 'crs_partition_stalled{partition="3",topic="in"} 1.0' in _series(m)
    m.forget_partition("in", 3)
    assert 'partition="3"' not in _series(m)


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"crs-consumer {service_version()}"


def _record(**kw: object) -> DlqRecord:
    base: dict[str, object] = {
        "partition": 0,
        "offset": 10,
        "timestamp_ms": parse_time("2026-01-01T10:00:00Z"),
        "key": b"vm",
        "value": b"{}",
        "headers": (
            ("ce_id", b"1"),
            ("crs.error", b"retries_exhausted"),
            ("crs.reason", b"timed out"),
            ("crs.source.offset", b"4"),
        ),
    }
    base.update(kw)
    return DlqRecord(**base)  # type: ignore[arg-type]


def test_filters_by_code_time_partition_and_offsets() -> None:
    r = _record()
    assert DlqFilter().matches(r)
    assert DlqFilter(codes=frozenset({"retries_exhausted"})).matches(r)
    assert not DlqFilter(codes=frozenset({"not_json"})).matches(r)
    assert DlqFilter(since_ms=parse_time("2026-01-01T10:00:00")).matches(r)
    assert not DlqFilter(since_ms=parse_time("2026-01-01T10:00:01Z")).matches(r)
    assert not DlqFilter(until_ms=parse_time("2026-01-01T09:59:59Z")).matches(r)
    assert not DlqFilter(partition=1).matches(r)
    assert DlqFilter(from_offset=10, to_offset=10).matches(r)
    assert not DlqFilter(from_offset=11).matches(r)
    assert not DlqFilter(to_offset=9).matches(r)


def test_redrive_headers_drop_crs_headers_and_count_up() -> None:
    assert redrive_headers(_record()) == [("ce_id", b"1"), ("crs.redrive.count", b"1")]
    again = _record(headers=(("crs.redrive.count", b"2"), ("crs.error", b"k8s_error")))
    assert again.redrive_count == 2
    assert redrive_headers(again) == [("crs.redrive.count", b"3")]
    assert _record(headers=(("crs.redrive.count", b"junk"),)).redrive_count == 0
    # A header without value (Kafka allows it; the processor keeps the input's redrive
    # count as it is): dlq redrive raised AttributeError and aborted the whole run.
    null = _record(headers=(("crs.redrive.count", None), ("t", None)))
    assert null.redrive_count == 0
    assert null.header("t") is None
    assert redrive_headers(null) == [("t", None), ("crs.redrive.count", b"1")]


def test_the_dead_letters_of_one_input_share_an_identity_its_copies_keep() -> None:
    first = _record()
    # Its redriven copy, dead-lettered again elsewhere: what the redrive sent unchanged.
    copy = _record(
        partition=2,
        offset=90,
        headers=(
            *redrive_headers(first),
            ("crs.error", b"k8s_error"),
            ("crs.source.offset", b"77"),
        ),
    )
    assert copy.identity == first.identity
    # Another input: another key, value or non-crs header (a binary-mode ce_id).
    assert _record(key=b"vm2").identity != first.identity
    assert _record(value=b"{ }").identity != first.identity
    other_id = (("ce_id", b"2"), ("crs.error", b"retries_exhausted"))
    assert _record(headers=other_id).identity != first.identity
    # A tombstone input (empty_value) is one input like any other: its dead letters
    # share an identity (its redrives used to double as before, found by review).
    assert _record(value=None).identity == _record(value=None, offset=11).identity
    # A stub or a value left out (both refused): only itself.
    for marker in ("crs.stub", "crs.value.omitted"):
        flagged = ((marker, b"1"),)
        assert (
            _record(value=None, headers=flagged).identity
            != _record(value=None, headers=flagged, offset=11).identity
        )


async def test_a_redriven_record_keeps_its_count_when_dead_lettered_again() -> None:
    proc = Processor(
        None,  # type: ignore[arg-type]  # poison never reaches the recorder
        StreamMetrics(),
        output_topic="out",
        dlq_topic="dlq",
        max_event_bytes=1024,
        max_attempts=3,
    )
    ref = InputRef(topic="in", partition=0, offset=7)
    out = await proc.process(ref, b"k", b"not json", [("crs.redrive.count", b"2"), ("t", b"x")])
    headers = dict(out.headers)
    assert out.dead_letter
    assert headers["crs.redrive.count"] == b"2"
    assert headers["t"] == b"x"
    assert headers["crs.error"] == b"not_json"

    # Input headers that fill the headers' budget must not push the redrive headers
    # out: a record whose count was dropped would start again at 0 and loop for ever.
    full = [(f"h{i}", b"v" * 200) for i in range(400)]
    out = await proc.process(ref, b"k", b"not json", [*full, ("crs.redrive.count", b"2")])
    headers = dict(out.headers)
    assert "crs.headers.omitted" in headers  # the budget was full
    assert headers["crs.redrive.count"] == b"2"
    # From input, so bounded: a long value is dropped, and of repeats the first is kept.
    out = await proc.process(ref, b"k", b"not json", [("crs.redrive.count", b"9" * 10_000)])
    assert "crs.redrive.count" not in dict(out.headers)
    repeated = [("crs.redrive.count", b"%d" % i) for i in range(1, 5000)]
    out = await proc.process(ref, b"k", b"not json", repeated)
    assert [v for k, v in out.headers if k == "crs.redrive.count"] == [b"1"]


def test_kafka_causes_without_a_secured_dev_broker_are_named() -> None:
    """A listener demanding a client certificate is not part of the dev stack: that
    classification is checked here on the client's own error (with the SASL one); the
    other causes are reproduced for real in test_check_diagnosis.py and
    test_check_acls.py."""
    import ssl

    from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed

    from service.app.check import diagnose_kafka
    from service.app.config import Config

    cfg = Config.load(
        env={
            "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "KAFKA_SASL_USERNAME": "crs",
            "KAFKA_SASL_PASSWORD": "pw-1",
        }
    )
    generic = KafkaConnectionError("Unable to bootstrap")
    auth = diagnose_kafka([SaslAuthenticationFailed("bad"), generic], cfg)
    assert auth.startswith("authentication failed for KAFKA_SASL_USERNAME=crs")
    assert "pw-1" not in auth
    mtls = ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert")
    mtls.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert "client certificate" in diagnose_kafka([mtls, generic], cfg)
    assert diagnose_kafka([generic], cfg) == "KafkaConnectionError: Unable to bootstrap"


class _SilentDlqConsumer:
    """A dead-letter topic of one partition with 5 records a broker never hands out."""

    def __init__(self, **kw: object) -> None:
        self._client = self
        self.polls = 0

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def fetch_all_metadata(self) -> Any:
        return self

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    def assign(self, tps: Any) -> None: ...

    async def seek_to_beginning(self, *tps: Any) -> None: ...

    async def end_offsets(self, tps: Any) -> dict[Any, int]:
        return dict.fromkeys(tps, 5)

    async def getmany(self, *tps: Any, **kw: Any) -> dict[Any, list[Any]]:
        self.polls += 1
        return {}

    async def position(self, tp: Any) -> int:
        return 0


async def test_a_read_that_never_reached_the_end_is_incomplete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A broker slow to answer (a TLS connect, a leader election): the read gave up after
    # 2 s of empty polls and the redrive reported "read 0" with exit 0 (found by review).
    import aiokafka

    from service.app import dlq

    made: list[_SilentDlqConsumer] = []

    def consumer(**kw: object) -> _SilentDlqConsumer:
        made.append(_SilentDlqConsumer(**kw))
        return made[-1]

    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", consumer)
    monkeypatch.setattr(dlq, "_IDLE_POLLS", 3)
    read, complete = await dlq.read_dlq(Config.load(env={}), max_records=10, visit=print)
    assert (read, complete) == (0, False)
    assert made[0].polls == 3
    out = io.StringIO()
    flt = dlq.DlqFilter()
    code = await dlq.redrive(
        Config.load(env={}), flt=flt, max_records=10, max_redrives=3, dry_run=True, out=out
    )
    assert code == dlq.INCOMPLETE
    assert "incomplete" in out.getvalue()
    # list too: its summary is partial.
    out = io.StringIO()
    code = await dlq.list_dlq(Config.load(env={}), flt=flt, max_records=10, as_json=True, out=out)
    assert code == dlq.INCOMPLETE
    assert '"truncated": true' in out.getvalue()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--code", "retries_exhaustd"], "unknown --code retries_exhaustd"),
        (["--max-records", "0"], "--max-records must be at least 1"),
        (["--max-redrives", "0"], "--max-redrives must be at least 1"),
        (
            ["--since", "2026-01-02T00:00:00Z", "--until", "2026-01-01T00:00:00Z"],
            "--since is after",
        ),
        (["--from-offset", "9", "--to-offset", "3"], "--from-offset is after"),
    ],
)
def test_a_dlq_command_line_that_would_match_nothing_is_refused(
    args: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, each ran (against the broker) and reported "0 match", exit 0: a typo in a
    # code during an incident looked like an empty dead-letter topic.
    assert main(["dlq", "redrive", "--dry-run", *args]) == 2
    assert problem in capsys.readouterr().err


def test_dlq_does_not_check_a_kubeconfig_it_never_uses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # dlq reads and writes Kafka only: a stale KUBECONFIG in the operator's shell refused
    # it with exit 2. The unknown code stops it before any broker is contacted; that is
    # what it must report, not the kubeconfig.
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/x")
    monkeypatch.delenv("KAFKA_SSL_CAFILE", raising=False)
    assert main(["dlq", "list", "--code", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "KUBECONFIG" not in err
    assert "unknown --code bogus" in err


def test_a_kubeconfig_list_is_accepted_as_the_client_merges_it(tmp_path: Path) -> None:
    # The Kubernetes client (kubernetes_asyncio) merges a KUBECONFIG of several files as
    # kubectl does; each named file is still checked.
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_text("{}")
    second.write_text("{}")
    both = f"{first}{os.pathsep}{second}"
    assert file_problems(Config.load(env={"KUBECONFIG": both})) == []
    second.unlink()
    assert file_problems(Config.load(env={"KUBECONFIG": both})) == [
        f"kubernetes: KUBECONFIG={both}: {second}: no such file"
    ]


class _DlqConsumer(_SilentDlqConsumer):
    """A dead-letter topic of one partition holding ``records`` (aiokafka's shape)."""

    def __init__(self, records: list[Any]) -> None:
        super().__init__()
        self.records, self.at = records, 0

    async def end_offsets(self, tps: Any) -> dict[Any, int]:
        return dict.fromkeys(tps, len(self.records))

    async def getmany(self, *tps: Any, max_records: int = 500, **kw: Any) -> dict[Any, list[Any]]:
        batch = self.records[self.at : self.at + max_records]
        self.at += len(batch)
        return {tps[0]: batch} if batch else {}

    async def position(self, tp: Any) -> int:
        return self.at


async def test_an_events_latest_dead_letter_decides_even_when_the_filter_leaves_it_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The event's first dead letter is retries_exhausted; its redriven copy failed again
    # as k8s_error. `--code retries_exhausted` must not send the first one once more: it
    # was redriven already, and its copy's dead letter is the event's latest.
    from types import SimpleNamespace

    import aiokafka

    from service.app import dlq

    def rec(offset: int, code: bytes, *extra: tuple[str, bytes]) -> Any:
        headers = [
            ("crs.error", code),
            ("crs.source.topic", b"nova.scheduling-outcomes"),
            ("crs.source.partition", b"0"),
            ("crs.source.offset", str(5 + offset).encode()),
            *extra,
        ]
        return SimpleNamespace(
            offset=offset, timestamp=1000 + offset, key=b"vm", value=b"{}", headers=headers
        )

    copy = (("crs.redrive.count", b"1"),)
    records = [rec(0, b"retries_exhausted"), rec(1, b"k8s_error", *copy)]
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda **kw: _DlqConsumer(records))
    config = Config.load(env={})
    assert config.input_topic == "nova.scheduling-outcomes"

    async def dry(**kw: Any) -> str:
        out = io.StringIO()
        flt = dlq.DlqFilter(**kw)
        code = await dlq.redrive(
            config, flt=flt, max_records=10, max_redrives=3, dry_run=True, out=out
        )
        assert code == 0
        return out.getvalue()

    only_first = await dry(codes=frozenset({"retries_exhausted"}))
    assert "would redrive 0, refused 1" in only_first, only_first
    assert "refused p0:0 (retries_exhausted): superseded by its later dead letter p0:1" in (
        only_first
    )
    both = await dry()
    assert "would redrive p0:1 (k8s_error)" in both, both
    assert "would redrive 1, refused 1" in both, both


class _MarkedDlqConsumer(_DlqConsumer):
    """As written by the service: the records, then a transaction's commit marker."""

    async def end_offsets(self, tps: Any) -> dict[Any, int]:
        return dict.fromkeys(tps, len(self.records) + 1)

    async def getmany(self, *tps: Any, **kw: Any) -> dict[Any, list[Any]]:
        if self.at >= len(self.records):
            self.at = len(self.records) + 1  # past the marker, no record returned
            return {}
        return await super().getmany(*tps, **kw)


async def test_a_read_stopped_at_the_limit_with_only_a_marker_left_is_complete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --max-records equal to the number of dead letters stopped before the commit marker
    # after them, and the run was reported incomplete (found by review).
    from types import SimpleNamespace

    import aiokafka

    from service.app import dlq

    records = [
        SimpleNamespace(offset=i, timestamp=i, key=b"k", value=b"{}", headers=[]) for i in range(3)
    ]
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda **kw: _MarkedDlqConsumer(records))
    seen: list[Any] = []
    assert await dlq.read_dlq(Config.load(env={}), max_records=3, visit=seen.append) == (3, True)
    assert len(seen) == 3
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda **kw: _MarkedDlqConsumer(records))
    assert await dlq.read_dlq(Config.load(env={}), max_records=2, visit=seen.append) == (2, False)


async def test_sigterm_cancels_a_dlq_command_so_its_transaction_is_aborted() -> None:
    # Python's default SIGTERM ends the process on the spot: a redrive so killed left its
    # transaction open on the input (every event behind it held back from the service
    # for up to 15 minutes). Cancelled instead, the transaction's context aborts it.

    unwound: list[str] = []

    async def redrive() -> int:
        try:
            await asyncio.sleep(10)
        finally:
            unwound.append("aborted")  # where aiokafka's transaction context aborts
        return 0

    asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
    assert await until_signalled(redrive()) == 128 + signal.SIGTERM
    assert unwound == ["aborted"]
    # The handlers are gone again: the process's own signal handling is restored.
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler)


async def test_an_ignored_sighup_stays_ignored_under_a_dlq_command() -> None:
    # `nohup crs-consumer dlq redrive ... &` then logging out: the SIGHUP nohup ignores
    # must not abort the run, and the process's handler is the same afterwards.
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:

        async def redrive() -> int:
            await asyncio.sleep(0.2)
            return 0

        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGHUP)
        assert await until_signalled(redrive()) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


async def test_a_redrive_producer_that_fails_to_start_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every non-dry run starts its producer now (to end a killed run's transaction): one
    # that failed to start (the broker unreachable) was left to the garbage collector,
    # with its connections, and an "Unclosed AIOKafkaProducer" error after the FAILED line.
    import aiokafka

    from service.app import dlq

    calls: list[str] = []

    class Unreachable:
        def __init__(self, **kw: object) -> None:
            pass

        async def start(self) -> None:
            calls.append("start")
            raise aiokafka.errors.KafkaConnectionError("unreachable")

        async def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setattr(aiokafka, "AIOKafkaProducer", Unreachable)
    with pytest.raises(aiokafka.errors.KafkaConnectionError):
        await dlq.redrive(
            Config.load(env={}), flt=DlqFilter(), max_records=10, max_redrives=3, dry_run=False
        )
    assert calls == ["start", "stop"]


class _CommittingProducer:
    """aiokafka's transactional producer as a redrive uses it, with its commit shielded
    from a cancel (the EndTxn goes on) and taking ``commit_s`` (None: never answered)."""

    def __init__(
        self, commit_s: float | None, stop_s: float = 0.0, signal_in_stop: bool = False
    ) -> None:
        self.commit_s = commit_s
        self.stop_s = stop_s
        self.signal_in_stop = signal_in_stop  # a SIGTERM once stop() is under way
        self.calls: list[str] = []

    async def begin_transaction(self) -> None:
        self.calls.append("begin")

    async def send(self, *args: Any, **kwargs: Any) -> asyncio.Future[None]:
        self.calls.append("send")
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sent.set_result(None)
        return sent

    async def commit_transaction(self) -> None:
        self.calls.append("commit")

        async def end_txn() -> None:
            if self.commit_s is None:
                await asyncio.Event().wait()
            await asyncio.sleep(self.commit_s or 0)
            self.calls.append("committed")

        await asyncio.shield(asyncio.ensure_future(end_txn()))

    async def abort_transaction(self) -> None:
        self.calls.append("abort")

    async def stop(self) -> None:
        self.calls.append("stop")
        if self.signal_in_stop:
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(self.stop_s)
        except asyncio.CancelledError:
            self.calls.append("stop cancelled")
            raise


async def _redrive_signalled_while_committing(
    monkeypatch: pytest.MonkeyPatch, producer: _CommittingProducer
) -> tuple[int, str]:
    from service.app import dlq

    async def started(config: Config) -> _CommittingProducer:
        return producer

    async def one_dead_letter(config: Config, *, max_records: int, visit: Any, **_: Any) -> Any:
        visit(dlq.DlqRecord(0, 0, 1, b"vm", b"{}", (("crs.error", b"k8s_error"),)))
        return 1, True

    monkeypatch.setattr(dlq, "_transactional_producer", started)
    monkeypatch.setattr(dlq, "read_dlq", one_dead_letter)
    loop = asyncio.get_running_loop()
    sent = loop.create_future()

    original = producer.commit_transaction

    async def commit() -> None:  # SIGTERM once the EndTxn is on its way
        loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)
        sent.set_result(None)
        await original()

    producer.commit_transaction = commit  # type: ignore[method-assign]
    out = io.StringIO()
    work = dlq.redrive(
        Config.load(env={}), flt=DlqFilter(), max_records=10, max_redrives=3, dry_run=False, out=out
    )
    code = await until_signalled(work)
    assert sent.done()
    return code, out.getvalue()


async def test_a_signal_during_the_commit_waits_for_it_and_says_it_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The commit went on under aiokafka's shield while the tool said nothing was sent
    # (found by review): a rerun then sent every record twice.
    producer = _CommittingProducer(commit_s=0.3)
    code, out = await _redrive_signalled_while_committing(monkeypatch, producer)
    assert code == 128 + signal.SIGTERM
    assert producer.calls == ["begin", "send", "commit", "committed", "stop"]
    assert "redriven 1, refused 0" in out, out


async def test_a_commit_not_confirmed_after_a_signal_is_reported_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from service.app import dlq

    monkeypatch.setattr(dlq, "_COMMIT_WAIT_S", 0.2)
    producer = _CommittingProducer(commit_s=None)
    with pytest.raises(dlq.CommitOutcomeUnknown, match="may or may not have been sent"):
        await _redrive_signalled_while_committing(monkeypatch, producer)
    assert "abort" not in producer.calls
    assert producer.calls[-1] == "stop"


async def test_a_redrive_selecting_more_than_it_may_hold_sends_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every selected record was held in memory for the one transaction, without bound:
    # gigabytes after an outage, and an OOM kill left the transaction open on the input
    # for 15 minutes (found by review).
    from service.app import dlq

    code = (("crs.error", b"k8s_error"),)
    kept_values: list[int] = []

    async def dead_letters(config: Config, *, max_records: int, visit: Any, **_: Any) -> Any:
        for i in range(50):
            visit(dlq.DlqRecord(0, i, i, b"vm-%d" % i, b"x" * 1000, code))
        # What the redrive still holds once past the bound: no value kept beyond it.
        kept_values.append(sum(1 for r in gc_records() if r.value))
        return 50, True

    def gc_records() -> list[dlq.DlqRecord]:
        import gc

        return [o for o in gc.get_objects() if isinstance(o, dlq.DlqRecord)]

    started: list[str] = []

    async def producer(config: Config) -> _CommittingProducer:
        started.append("start")
        return _CommittingProducer(commit_s=0)

    monkeypatch.setattr(dlq, "read_dlq", dead_letters)
    monkeypatch.setattr(dlq, "_transactional_producer", producer)
    out = io.StringIO()
    result = await dlq.redrive(
        Config.load(env={}),
        flt=DlqFilter(),
        max_records=100,
        max_redrives=3,
        dry_run=False,
        max_send_bytes=10_000,
        out=out,
    )
    assert result == dlq.INCOMPLETE
    assert "too much for one run, nothing sent (read 50)" in out.getvalue(), out.getvalue()
    assert "redriven" not in out.getvalue()
    assert "would redrive" not in out.getvalue()  # no partial listing or count
    assert kept_values[0] <= 10  # ~1 KB each: no more than the bound's worth
    # Within the bound the same records are sent.
    out = io.StringIO()
    config = Config.load(env={})
    result = await dlq.redrive(
        config, flt=DlqFilter(), max_records=100, max_redrives=3, dry_run=False, out=out
    )
    assert result == 0
    assert "redriven 50, refused 0" in out.getvalue(), out.getvalue()


def test_max_send_bytes_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dlq", "redrive", "--max-send-bytes", "0"]) == 2
    assert "--max-send-bytes must be at least 1" in capsys.readouterr().err


async def test_dlq_list_escapes_and_bounds_codes_from_foreign_writers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # crs.error was printed raw: a record from another writer could carry terminal escape
    # sequences, and every distinct code got its own line (found by review).
    from types import SimpleNamespace

    import aiokafka

    from service.app import dlq

    def rec(offset: int, code: bytes) -> Any:
        headers = [("crs.error", code)]
        return SimpleNamespace(
            offset=offset, timestamp=offset, key=b"k", value=b"{}", headers=headers
        )

    records = [rec(0, b"\x1b]0;owned\x07\x1b[2J")]
    records += [rec(1 + i, b"code-%d" % i) for i in range(150)]
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda **kw: _DlqConsumer(records))
    out = io.StringIO()
    flt = DlqFilter()
    assert (
        await dlq.list_dlq(Config.load(env={}), flt=flt, max_records=500, as_json=False, out=out)
        == 0
    )
    text = out.getvalue()
    assert "\x1b" not in text
    assert "\\x1b]0;owned" in text  # shown escaped
    assert text.count("first ") == 101  # 100 codes, then the rest together
    assert "(other codes): 51" in text


async def test_a_dead_letter_without_a_value_is_not_redriven(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An input with neither key nor value is dead-lettered keyed by its coordinates:
    # redriven, that made-up key was published as the input's (found by review). Without
    # a value it would only come back as empty_value anyway.
    from types import SimpleNamespace

    import aiokafka

    from service.app import dlq

    headers = [("crs.error", b"empty_value"), ("crs.source.topic", b"nova.scheduling-outcomes")]
    records = [
        SimpleNamespace(
            offset=0, timestamp=0, key=b"nova.scheduling-outcomes/3/41", value=None, headers=headers
        )
    ]
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda **kw: _DlqConsumer(records))
    out = io.StringIO()
    code = await dlq.redrive(
        Config.load(env={}), flt=DlqFilter(), max_records=10, max_redrives=3, dry_run=True, out=out
    )
    assert code == 0
    assert "would redrive 0, refused 1" in out.getvalue(), out.getvalue()
    assert "no value" in out.getvalue()


async def test_a_dlq_partition_the_topic_does_not_have_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `--partition 99` read every partition, matched nothing and exited 0: a typo looked
    # like an empty dead-letter topic (found by review).
    import aiokafka

    from service.app import dlq

    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda **kw: _DlqConsumer([]))
    with pytest.raises(LookupError, match="has no partition 99"):
        await dlq.read_dlq(Config.load(env={}), max_records=10, visit=print, partition=99)


def test_flags_are_not_abbreviated_and_their_values_not_echoed_in_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # An ambiguous prefix echoed its whole argument: `--sasl-passw=hunter2` put the
    # password on stderr (found by review).
    with pytest.raises(SystemExit):
        main(["dlq", "list", "--sasl-passw=hunter2"])
    err = capsys.readouterr().err
    assert "hunter2" not in err
    assert "--sasl-passw=..." in err  # still named
    with pytest.raises(SystemExit):
        main(["run", "--bootstrap-servrs=h:1"])
    assert "--bootstrap-servrs=..." in capsys.readouterr().err


async def test_a_dlq_topic_not_found_may_be_one_the_account_may_not_describe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A metadata request for all topics leaves out those the account may not Describe:
    # "does not exist" alone sent the operator looking for a topic that is there.
    import aiokafka

    from service.app import dlq

    class Absent(_DlqConsumer):
        def partitions_for_topic(self, topic: str) -> set[int]:
            return set()

    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda **kw: Absent([]))
    with pytest.raises(LookupError, match="does not exist, or this Kafka account may not"):
        await dlq.read_dlq(Config.load(env={}), max_records=10, visit=print)


async def test_a_redrive_whose_superseded_dead_letters_fit_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two dead letters of one input, 6 KB each, under a 10 KB bound: only the later is
    # held, yet the bound was checked before the earlier one was let go (found by review).
    from service.app import dlq

    code = (("crs.error", b"k8s_error"),)
    copy = (*code, ("crs.redrive.count", b"1"))

    async def two_of_one_input(config: Config, *, max_records: int, visit: Any, **_: Any) -> Any:
        visit(dlq.DlqRecord(0, 0, 1, b"vm", b"x" * 6000, code))
        visit(dlq.DlqRecord(0, 1, 2, b"vm", b"x" * 6000, copy))
        return 2, True

    monkeypatch.setattr(dlq, "read_dlq", two_of_one_input)
    out = io.StringIO()
    result = await dlq.redrive(
        Config.load(env={}),
        flt=DlqFilter(),
        max_records=10,
        max_redrives=3,
        dry_run=True,
        max_send_bytes=10_000,
        out=out,
    )
    assert result == 0, out.getvalue()
    assert "would redrive p0:1" in out.getvalue()


async def test_redrive_reads_every_partition_whatever_partition_selects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An input's later dead letter (its copy's) can be on another partition; reading only
    # --partition's, redrive sent the input again (found by review).
    from service.app import dlq

    asked: list[dict[str, Any]] = []

    async def read(config: Config, *, max_records: int, visit: Any, **kw: Any) -> Any:
        asked.append(kw)
        return 0, True

    monkeypatch.setattr(dlq, "read_dlq", read)
    flt = DlqFilter(partition=3)
    config = Config.load(env={})
    await dlq.redrive(config, flt=flt, max_records=10, max_redrives=3, dry_run=True)
    await dlq.list_dlq(config, flt=flt, max_records=10, as_json=True, out=io.StringIO())
    assert asked == [{"partition": 3, "narrow": False}, {"partition": 3}]


async def test_a_second_signal_while_waiting_for_the_commit_says_the_outcome_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SIGTERM, then SIGHUP (a terminal closed) during the wait: the tool said nothing
    # was sent while the shielded EndTxn went on (found by review).
    # The SIGHUP is sent once the SIGTERM has cancelled the run (this task, the one
    # until_signalled cancels), not from a timer: a loop stalled on a busy machine could
    # fire a timer before the commit or merge its cancel with the SIGTERM's.
    run = asyncio.current_task()
    assert run is not None

    async def hang_up_once_terminated() -> None:
        for _ in range(6000):  # 30 s at most
            if run.cancelling():
                os.kill(os.getpid(), signal.SIGHUP)
                return
            await asyncio.sleep(0.005)

    second = asyncio.create_task(hang_up_once_terminated())
    producer = _CommittingProducer(commit_s=None)
    with pytest.raises(Exception, match="may or may not have been sent") as raised:
        await _redrive_signalled_while_committing(monkeypatch, producer)
    await second
    from service.app import dlq

    assert isinstance(raised.value, dlq.CommitOutcomeUnknown)


async def test_a_signal_while_stopping_after_an_unknown_commit_still_says_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A third signal during the producer's stop cut off the CommitOutcomeUnknown on its
    # way out, and the tool said that nothing was sent (left in stop 27).
    # Each signal sent from where it must land (timers could merge two cancels into one
    # when the loop stalls, as it did in a full run): SIGTERM once the commit is under
    # way, the commit not confirmed within the wait, SIGTERM again once stop() runs.
    from service.app import dlq

    monkeypatch.setattr(dlq, "_COMMIT_WAIT_S", 0.2)
    producer = _CommittingProducer(commit_s=None, stop_s=2.0, signal_in_stop=True)
    with pytest.raises(dlq.CommitOutcomeUnknown, match="may or may not have been sent"):
        await _redrive_signalled_while_committing(monkeypatch, producer)
    assert producer.calls[-2:] == ["stop", "stop cancelled"]  # the signal came in stop()


_CTRL_C = """
import asyncio, os, signal, sys
from service.app.cli import until_signalled

# As in a terminal, whatever the test runner's own SIGINT disposition (a background job
# of a non-interactive shell ignores it, and the child would inherit that).
signal.signal(signal.SIGINT, signal.default_int_handler)

async def work() -> int:
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, os.kill, os.getpid(), signal.SIGINT)
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        if {presses} == 1:
            raise
        # The second press once the first was taken: like a redrive waiting for its
        # commit's outcome.
        loop.call_later(0.2, os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            raise RuntimeError("may or may not have been sent") from None
    return 0

try:
    sys.exit(asyncio.run(until_signalled(work(), note="; nothing was sent")))
except Exception as exc:  # as _run_dlq
    print(f"FAILED: {{exc}}", file=sys.stderr)
    sys.exit(1)
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_under_a_dlq_command_is_said_not_a_traceback(presses: int) -> None:
    # asyncio.run cancels on the first Ctrl-C and raises KeyboardInterrupt out of the loop
    # on the second: a second Ctrl-C while a redrive waited for its commit's outcome gave
    # a traceback instead of "may or may not have been sent" (found by review). Its own
    # process: under asyncio.run, as the command runs.
    import subprocess
    import sys

    script = _CTRL_C.format(presses=presses)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert "Traceback" not in done.stderr, done.stderr
    if presses == 1:
        assert done.returncode == 128 + signal.SIGINT, done.stderr
        assert "stopped by SIGINT; nothing was sent" in done.stderr
    else:
        assert done.returncode == 1, done.stderr
        assert "FAILED: may or may not have been sent" in done.stderr


async def test_a_dlq_read_whose_consumer_fails_to_start_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The consumer was started outside its try: a broker that could not be reached left
    # it to the garbage collector ("Unclosed AIOKafkaConsumer" after the FAILED line).
    import aiokafka

    from service.app import dlq

    calls: list[str] = []

    class Unreachable:
        def __init__(self, **kw: object) -> None:
            pass

        async def start(self) -> None:
            calls.append("start")
            raise aiokafka.errors.KafkaConnectionError("unreachable")

        async def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", Unreachable)
    with pytest.raises(aiokafka.errors.KafkaConnectionError):
        await dlq.list_dlq(Config.load(env={}), flt=DlqFilter(), max_records=10, as_json=False)
    assert calls == ["start", "stop"]


def test_a_dlq_failure_is_said_once_in_plain_words() -> None:
    # Nothing listens on port 1: the same diagnosis as `check`, one line, no class names,
    # and nothing else on stderr (no aiokafka log line, no unclosed-client warning).
    proc = subprocess.run(
        [sys.executable, "-m", "service", "dlq", "list"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"},
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "crs-consumer dlq list: FAILED: connection refused: nothing listens there "
        "(check KAFKA_BOOTSTRAP_SERVERS)"
    ]


def test_a_dlq_failure_other_than_kafka_is_its_message() -> None:
    from service.app import dlq

    config = Config.load(env={})
    lookup = LookupError("dead-letter topic x has no partition 9 (it has 0-2)")
    assert dlq.failure(lookup, [], config) == "dead-letter topic x has no partition 9 (it has 0-2)"
