"""Poison never stops the service: two replicas (separate processes) on the real stack.

Hostile records of every kind the README's dead-letter section lists, interleaved with
good events: no replica exits, each hostile record is in the dead-letter topic exactly
once with a ``crs.error`` header, each good event is classified exactly once (read with
``read_committed``), and no log line of either replica is long. Plus start-up: a broker
that is not there yet is waited for; a configuration error exits at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c

from service.stream.codec import encode_input
from tests import e2e
from tests.conftest import DevStack
from tests.integration import test_engine_faults as faults
from tests.integration.test_service_resilience import (
    PARTITIONS,
    placements,
    seed_capacity,
    service_topics,
    stop,
)

MiB = 1_048_576
LOG_LINE_BOUND = 16 * 1024
CASE = "test.case"  # a header naming the hostile kind; decoding ignores it

Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


def _good(hosts: list[str]) -> tuple[str, dict[str, Any]]:
    vm, decision, request = e2e.outcome(hosts[0], hosts[:2])
    value, _ = encode_input(decision, request)
    return vm, json.loads(value)


def _put(doc: dict[str, Any], path: str, fragment: str) -> bytes:
    """``doc`` with the raw JSON text ``fragment`` at the dotted ``path``."""
    node = doc
    steps = path.split("/")
    for step in steps[:-1]:
        node = node[int(step)] if isinstance(node, list) else node[step]
    node[steps[-1]] = "@@HOLE@@"
    return json.dumps(doc).replace('"@@HOLE@@"', fragment).encode()


def hostile_records(hosts: list[str]) -> list[tuple[str, str, Record]]:
    """(case name, expected crs.error, record) for each hostile kind."""
    ce = [("content-type", b"application/cloudevents+json")]
    spec = "data/request/spec/nova_object.data"
    deep = "[" * 1000 + "]" * 1000
    out: list[tuple[str, str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []

    def add(name: str, code: str, path: str | None, fragment: str, key: bool = True) -> None:
        vm, doc = _good(hosts)
        value = fragment.encode() if path is None else _put(doc, path, fragment)
        out.append((name, code, vm.encode() if key else None, value, list(ce)))

    add("deep-whole-value", "invalid_event", None, deep, key=False)
    add("deep-scheduler-hints", "invalid_event", f"{spec}/scheduler_hints", '{"g":' + deep + "}")
    add("deep-hosts", "invalid_event", "data/request/hosts", deep)
    add("huge-int-weights", "invalid_event", "data/request/weights", '{"h":' + "9" * 5000 + "}")
    add("huge-int-memory", "invalid_event", f"{spec}/flavor/nova_object.data/memory_mb", "9" * 5000)
    add(
        "deep-dict-context",
        "invalid_event",
        "data/request/context",
        '{"a":' * 2000 + "1" + "}" * 2000,
    )
    add("huge-float-weights", "invalid_event", "data/request/weights", '{"h": 1e999999}')
    # (A lone surrogate escape, "hv-\\ud800", is not hostile either: valid JSON, read as
    # U+FFFD as Go reads it; tests/unit/test_events.py.)
    add("null-request", "invalid_event", "data/request", "null")
    add("null-decision", "invalid_event", "data/decision", "null")
    # ("hosts": null is not hostile: a Go encoder writes a nil slice so, and the reference
    # reads it as empty; tests/integration/test_parity.py classifies such an event.)
    add("null-spec", "invalid_event", "data/request/spec", "null")
    add("null-instance-uuid", "invalid_event", f"{spec}/instance_uuid", "null")
    add("wrong-type-hosts", "invalid_event", "data/request/hosts", '"hv-1"')
    add("wrong-type-memory", "invalid_event", f"{spec}/flavor/nova_object.data/memory_mb", '"4G"')
    add("wrong-type-uuid", "invalid_event", f"{spec}/instance_uuid", "42")
    add("wrong-type-target", "invalid_event", "data/decision/result/targetHost", "[1]")
    add("unknown-type", "unknown_type", "type", '"com.example.other"')
    add("old-specversion", "unsupported_specversion", "specversion", '"0.3"')
    add("nan", "not_json", "data/request/weights", '{"h": NaN}')
    add("truncated-json", "not_json", None, '{"specversion": "1.0", "id": ', key=False)

    # Bad UTF-8 inside a string.
    vm, doc = _good(hosts)
    value = _put(doc, "data/request/hosts/0/host", '"hv-@@BAD@@"').replace(b"@@BAD@@", b"\xff\xfe")
    out.append(("bad-utf8", "not_json", vm.encode(), value, list(ce)))
    # A 900 KB key: named in the reason (cut), the dead letter's key cut to 4 KiB.
    vm, doc = _good(hosts)
    out.append(("key-900kb", "inconsistent_subject", b"k" * 900_000, json.dumps(doc).encode(), ce))
    # A 500 KB subject.
    vm, doc = _good(hosts)
    doc["subject"] = "s" * 500_000
    out.append(("subject-500kb", "inconsistent_subject", vm.encode(), json.dumps(doc).encode(), ce))
    # Near 1 MB with big headers: the input just fits the producer's limit, the dead letter
    # (input plus crs.* headers) would not.
    big_headers = [("trace", b"t" * 3000), ("baggage", b"b" * 4000), *ce]
    near = b"{" + b"x" * (MiB - 7400)
    assert MiB - 400 < record_bytes(b"k" * 36, near, [*big_headers, (CASE, b"near-1mb")]) <= MiB
    out.append(("near-1mb", "not_json", b"k" * 36, near, big_headers))
    # Empty value (a tombstone).
    out.append(("tombstone", "empty_value", b"some-vm", None, []))
    # Binary mode: garbage headers and values.
    vm, decision, request = e2e.outcome(hosts[0], hosts[:2])
    data, headers = encode_input(decision, request, binary=True)
    out.append(("binary-garbage-value", "not_json", vm.encode(), b"\x00\xff" * 100, headers))
    out.append(("binary-deep-value", "invalid_event", vm.encode(), deep.encode(), headers))
    garbage = [(n, b"\xff\x00\xfe") if n == "ce_type" else (n, v) for n, v in headers]
    out.append(("binary-bad-ce-type", "invalid_event", vm.encode(), data, garbage))
    huge = [(n, b"1" * 200_000) if n == "ce_specversion" else (n, v) for n, v in headers]
    out.append(("binary-huge-specversion", "unsupported_specversion", vm.encode(), data, huge))
    no_id = [(n, v) for n, v in headers if n != "ce_id"]
    out.append(("binary-no-id", "invalid_event", vm.encode(), data, no_id))
    other = [(n, b"x.y") if n == "ce_type" else (n, v) for n, v in headers]
    out.append(("binary-other-type", "unknown_type", None, data, other))

    return [
        (name, code, (key, value, [*hs, (CASE, name.encode())]))
        for name, code, key, value, hs in out
    ]


def record_bytes(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers))


def long_log_lines(path: Path) -> list[int]:
    return [len(line) for line in path.read_bytes().splitlines() if len(line) > LOG_LINE_BOUND]


async def test_hostile_records_never_stop_two_replicas(
    devstack: DevStack, clean_k8s: Any, new_topic: Any, tmp_path: Path
) -> None:
    hosts = await seed_capacity(clean_k8s, hosts=8)
    topics = await service_topics(new_topic)
    good, vms = placements(hosts, 30)
    hostile = hostile_records(hosts)
    assert len(hostile) >= 30
    # Interleaved: a good event between any two hostile ones, all partitions mixed.
    records: list[Any] = []
    for i in range(max(len(good), len(hostile))):
        if i < len(hostile):
            records.append(hostile[i][2])
        if i < len(good):
            records.append(good[i])
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    replicas = [
        e2e.spawn(e2e.config(devstack, topics, CRS_MAX_BATCH="10"), str(log)) for log in logs
    ]

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    try:
        await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)
        started = time.monotonic()
        dead = await e2e.read_all(
            devstack.kafka_bootstrap, topics["dlq"], len(hostile), timeout_s=45
        )
        outputs = await e2e.read_all(
            devstack.kafka_bootstrap,
            topics["output"],
            len(good),
            partitions=PARTITIONS,
            timeout_s=20,
        )
        elapsed = time.monotonic() - started
        alive = [proc.poll() is None for proc in replicas]
        assert all(alive), f"a replica exited: {[p.returncode for p in replicas]}\n{tails()}"
    finally:
        codes = [stop(proc) for proc in replicas]
    assert codes == [0, 0], tails()

    # Every hostile record in the dead-letter topic exactly once, with its code.
    expected = {name: code for name, code, _ in hostile}
    found = collections.Counter()
    for record in dead:
        headers = dict(record.headers)
        assert record_bytes(record.key, record.value, list(record.headers)) <= MiB
        name = headers[CASE].decode()
        found[name] += 1
        assert headers["crs.error"].decode() == expected[name], (name, headers.get("crs.reason"))
    missing = sorted(set(expected) - set(found))
    assert not missing, (
        f"hostile records not dead-lettered: {missing} (in {elapsed:.1f} s)\n{tails()}"
    )
    assert all(n == 1 for n in found.values()), f"dead-lettered twice: {found}"
    assert len(dead) == len(hostile)
    by_name = {dict(r.headers)[CASE].decode(): r for r in dead}
    near = dict(by_name["near-1mb"].headers)
    assert by_name["near-1mb"].value is None
    assert near["crs.value.omitted"] == str(MiB - 7400 + 1).encode()
    assert by_name["key-900kb"].key == b"k" * 4096
    assert dict(by_name["key-900kb"].headers)["crs.key.truncated"] == b"900000"

    # Every good event classified exactly once.
    datas = [e2e.data_of(r) for r in outputs]
    inputs = collections.Counter((d["input"]["partition"], d["input"]["offset"]) for d in datas)
    assert all(n == 1 for n in inputs.values()), "an input classified twice"
    assert sorted(d["instance_uuid"] for d in datas) == sorted(vms)
    assert not [p.name for p in logs if long_log_lines(p)], "a log line over 16 KiB"


BAD_NAME = "crs-test-bad-name"


async def publish_unreadable_batch(
    bootstrap: str, topic: str, records: list[Any], bad: int
) -> None:
    """One batch on partition 0 whose record ``bad`` has a header name that is not UTF-8.

    Go clients (sarama, franz-go) and the broker take header names as bytes; aiokafka
    decodes them strictly. aiokafka's producer only writes str names, so the batch is
    built with a placeholder name, the placeholder's first byte is replaced with 0xff and
    the batch's CRC-32C (over everything after the CRC field) is computed again.
    """
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        batch = producer.create_batch()
        for i, (key, value, headers) in enumerate(records):
            extra = [(BAD_NAME, b"x")] if i == bad else []
            assert batch.append(key=key, value=value, timestamp=None, headers=headers + extra)
        buf = batch._build()
        at = bytes(buf).index(BAD_NAME.encode())
        buf[at] = 0xFF
        struct.pack_into(">I", buf, 17, calc_crc32c(bytes(buf[21:])))
        await (await producer.send_batch(batch, topic, partition=0))
    finally:
        await producer.stop()


async def publish_compressed(bootstrap: str, topic: str, records: list[Any], codec: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", compression_type=codec)
    await producer.start()
    try:
        futures = [await producer.send(topic, v, key=k, headers=h) for k, v, h in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def test_records_the_kafka_client_cannot_read_become_stubs_and_stop_no_replica(
    devstack: DevStack, clean_k8s: Any, new_topic: Any, tmp_path: Path
) -> None:
    """A header name that is not UTF-8 made aiokafka raise out of getmany(): the consume
    loop ended, the process exited, and every replica that took the partition over did
    the same (found by review). The records of other partitions drained in the same
    getmany() call were lost with it. And input compressed with lz4, snappy or zstd (a
    producer setting) could not be read at all: aiokafka needs cramjam for them."""
    hosts = await seed_capacity(clean_k8s, hosts=8)
    topics = await service_topics(new_topic)
    batch, _ = placements(hosts, 4)
    good, vms = placements(hosts, 40)
    codecs = ("gzip", "lz4", "snappy", "zstd")
    compressed = {codec: placements(hosts, 10) for codec in codecs}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    cfg = e2e.config(devstack, topics, CRS_MAX_BATCH="10")
    replicas = [e2e.spawn(cfg, str(log)) for log in logs]

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    bootstrap = devstack.kafka_bootstrap
    try:
        # Offsets 0-3 of partition 0: record 1 unreadable, and with it the rest of its
        # batch (aiokafka cannot read past it); record 0 reads fine.
        await publish_unreadable_batch(bootstrap, topics["input"], batch, bad=1)
        await e2e.publish(bootstrap, topics["input"], good)
        for codec, (records, _) in compressed.items():
            await publish_compressed(bootstrap, topics["input"], records, codec)
        expected = 1 + len(good) + sum(len(r) for r, _ in compressed.values())
        dead = await e2e.read_all(bootstrap, topics["dlq"], 3, timeout_s=45)
        outputs = await e2e.read_all(
            bootstrap, topics["output"], expected, partitions=PARTITIONS, timeout_s=45
        )
        alive = [proc.poll() is None for proc in replicas]
        assert all(alive), f"a replica exited: {[p.returncode for p in replicas]}\n{tails()}"
        ends = await faults.end_offsets(bootstrap, topics["input"], PARTITIONS)
        committed = await e2e.committed_offsets(bootstrap, cfg.group_id, topics["input"])
        assert committed == ends
    finally:
        codes = [stop(proc) for proc in replicas]
    assert codes == [0, 0], tails()

    stubs = sorted(
        (dict(r.headers)["crs.source.partition"], dict(r.headers)["crs.source.offset"])
        for r in dead
    )
    assert stubs == [(b"0", b"1"), (b"0", b"2"), (b"0", b"3")], stubs
    for record in dead:
        headers = dict(record.headers)
        assert headers["crs.error"] == b"unreadable", headers
        assert headers["crs.stub"] == b"true"
        assert b"UnicodeDecodeError" in headers["crs.reason"], headers["crs.reason"]
        assert record.value is None
    datas = [e2e.data_of(r) for r in outputs]
    inputs = collections.Counter((d["input"]["partition"], d["input"]["offset"]) for d in datas)
    assert all(n == 1 for n in inputs.values()), "an input classified twice"
    by_offset = {(d["input"]["partition"], d["input"]["offset"]): d["instance_uuid"] for d in datas}
    assert by_offset.get((0, 0)) == batch[0][0].decode(), "the record before it was lost"
    want = {batch[0][0].decode(), *vms, *(vm for _, v in compressed.values() for vm in v)}
    got = set(by_offset.values())
    assert got == want, (sorted(want - got)[:5], sorted(got - want)[:5], tails())
    # Each readable record classified exactly once: one output per readable input (the
    # set equality above would also hold with one VM's output standing for two records).
    assert len(datas) == len(inputs) == expected, (len(datas), len(inputs), expected)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _forward(target: str, port: int) -> asyncio.Server:
    """A TCP forwarder 127.0.0.1:port -> target (the broker), for bootstrap connections."""
    host, tport = target.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(tport))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def test_startup_waits_for_kafka_and_exits_on_configuration_errors(
    devstack: DevStack, clean_k8s: Any, new_topic: Any, tmp_path: Path
) -> None:
    hosts = await seed_capacity(clean_k8s, hosts=2)
    topics = await service_topics(new_topic)
    log = tmp_path / "service.log"

    # A missing file is caught before anything starts: exit 2, one line naming it.
    missing = e2e.config(devstack, topics, KUBECONFIG=str(tmp_path / "missing"))
    proc = e2e.spawn(missing, str(log))
    assert proc.wait(timeout=30) == 2, log.read_text()
    assert f"KUBECONFIG={tmp_path / 'missing'}: no such file" in log.read_text()
    # A configuration error found while starting (a kubeconfig that is not one): exit 1 at
    # once, saying so, instead of retrying as if the API server were just unreachable.
    invalid = tmp_path / "invalid-kubeconfig"
    invalid.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    broken = e2e.config(devstack, topics, KUBECONFIG=str(invalid))
    proc = e2e.spawn(broken, str(log))
    assert proc.wait(timeout=30) == 1, log.read_text()
    failed = [json.loads(line) for line in log.read_text().splitlines() if "startup_failed" in line]
    assert failed, log.read_text()[-2000:]
    assert "configuration" in failed[0]["hint"]

    # The broker is not reachable yet: the service waits and retries, then starts.
    port = _free_port()
    cfg = e2e.config(
        devstack,
        topics,
        KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{port}",
        CRS_RETRY_BACKOFF_S="0.2",
        CRS_RETRY_BACKOFF_MAX_S="1",
    )
    proc = e2e.spawn(cfg, str(log))
    server: asyncio.Server | None = None
    try:
        deadline = time.monotonic() + 40
        while log.read_text().count('"startup_retrying"') < 2:
            assert proc.poll() is None, f"exited on a transient error:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        server = await _forward(devstack.kafka_bootstrap, port)
        records, vms = placements(hosts, 3)
        await e2e.publish(devstack.kafka_bootstrap, topics["input"], records)
        outputs = await e2e.read_all(
            devstack.kafka_bootstrap, topics["output"], 3, partitions=PARTITIONS, timeout_s=40
        )
        assert {e2e.data_of(r)["instance_uuid"] for r in outputs} == vms, log.read_text()[-3000:]
    finally:
        code = stop(proc)
        if server is not None:
            server.close()
    assert code == 0, log.read_text()[-3000:]
    retry = next(json.loads(x) for x in log.read_text().splitlines() if "startup_retrying" in x)
    assert retry["level"] == "warning"
    assert "KafkaConnectionError" in retry["error"]
    assert retry["retry_in_s"] > 0
