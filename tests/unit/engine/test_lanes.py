"""Key lanes: concurrency across keys, order within a key, retries, stub dead letters."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from service.stream.codec import InputRef, encode_input
from service.stream.engine import lanes as lanes_module
from service.stream.engine import ownership as ownership_module
from tests import e2e
from tests.fake_kafka import FakeBroker
from tests.unit.engine.harness import (
    IN,
    TP0,
    TP1,
    Harness,
    assert_held_at,
    loop_turns,
    outputs,
    until,
)


async def test_different_keys_run_concurrently_and_one_key_in_order(broker: FakeBroker) -> None:
    h = Harness(broker)
    gate = h.processor.gates[b"a0"] = asyncio.Event()
    for v in (b"a0", b"b0", b"a1", b"b1", b"a2"):
        broker.append(IN, 0, v[:1], v)
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"b0", b"b1"])
    assert (0, 2) not in h.processor.calls  # a1 waits for a0: same key
    gate.set()
    await until(lambda: len(outputs(broker)) == 5)
    assert [v for v in outputs(broker) if v.startswith(b"a")] == [b"a0", b"a1", b"a2"]
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 5


async def test_a_stuck_record_holds_neither_other_keys_nor_other_partitions(
    broker: FakeBroker,
) -> None:
    h = Harness(broker)
    gate = h.processor.gates[b"x0"] = asyncio.Event()
    broker.append(IN, 0, b"x", b"x0")
    broker.append(IN, 0, b"y", b"y0")
    broker.append(IN, 1, b"z", b"z0")
    await h.start(TP0, TP1)
    await until(lambda: sorted(outputs(broker)) == [b"y0", b"z0"])
    # The committed offset stays at the stuck record; the metadata says 1 is done.
    assert_held_at(broker, 0)
    gate.set()
    await until(lambda: len(outputs(broker)) == 3)
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 2


async def test_a_record_without_a_key_takes_the_lane_of_its_instance_uuid(
    broker: FakeBroker,
) -> None:
    # One VM's events stay in order whether or not (and in whichever case) the producer
    # keyed them: the lane of a keyless record is its event's instance UUID.
    h = Harness(broker)
    vm, other = str(uuid.uuid4()), str(uuid.uuid4())
    values = []
    for instance in (vm, vm, other):
        _, decision, request = e2e.outcome("hv-1", ["hv-1"], vm=instance)
        values.append(encode_input(decision, request)[0])
    gate = h.processor.gates[values[0]] = asyncio.Event()
    broker.append(IN, 0, vm.upper().encode(), values[0])  # keyed, upper case
    broker.append(IN, 0, None, values[1])  # the same VM, no key
    broker.append(IN, 0, None, values[2])  # another VM, no key
    await h.start(TP0)
    await until(lambda: outputs(broker) == [values[2]])
    assert (0, 1) not in h.processor.calls  # waits behind its VM's first event
    gate.set()
    await until(lambda: len(outputs(broker)) == 3)
    assert outputs(broker) == [values[2], values[0], values[1]]
    await h.stop()


async def test_an_oversized_record_without_a_key_is_not_parsed_for_its_lane(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keying an unkeyed record by its instance UUID decodes it in the fetch loop; one
    # above the event size limit is dead-lettered unread, so it must not be parsed here.
    parsed: list[int] = []
    real = lanes_module.decode_input

    def counting(value: Any, headers: Any, **kwargs: Any) -> Any:
        if len(value) <= kwargs["max_bytes"]:  # above it, decode_input refuses unread
            parsed.append(len(value))
        return real(value, headers, **kwargs)

    monkeypatch.setattr(lanes_module, "decode_input", counting)
    h = Harness(broker, max_event_bytes=3000)
    _, decision, request = e2e.outcome("hv-1", ["hv-1"])
    small = encode_input(decision, request)[0]
    broker.append(IN, 0, None, small)
    broker.append(IN, 0, None, b"[" + b"{}," * 2000 + b"{}]")
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 2)
    await h.stop()
    assert parsed == [len(small)]


async def test_key_concurrency_is_bounded(broker: FakeBroker) -> None:
    h = Harness(broker, key_concurrency=3)
    gate = h.gated_records(8)
    await h.start(TP0)
    await until(lambda: h.processor.running == 3)
    # All eight fetched and the fetch loop two whole turns on: the other five had their
    # chance to start.
    await until(lambda: h.consumer.positions[TP0] == 8)
    await loop_turns(h)
    assert h.processor.max_running == 3
    gate.set()
    await until(lambda: len(outputs(broker)) == 8)
    await h.stop()


async def test_retry_later_waits_in_its_lane_only(broker: FakeBroker) -> None:
    h = Harness(broker)
    h.processor.retries[b"slow"] = 2
    broker.append(IN, 0, b"s", b"slow")
    broker.append(IN, 0, b"f", b"fast")
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 2)
    # Counted once the commit's await returns, a loop turn after the fake broker shows
    # the outputs: waiting for the outputs alone raced with it (one failure under load).
    await until(lambda: h.counted() == 2)
    await h.stop()
    assert outputs(broker)[0] == b"fast"
    assert h.processor.calls.count((0, 0)) == 3
    assert h.counted() == 2


async def test_an_output_too_large_for_the_broker_becomes_a_stub_dead_letter(
    broker: FakeBroker,
) -> None:
    h = Harness(broker)
    broker.max_value_bytes = 1000
    broker.append(IN, 0, b"k", b"x" * 5000)
    broker.append(IN, 0, b"j", b"small")
    await h.start(TP0)
    await until(lambda: len(broker.outputs) == 2)
    await h.stop()
    stub = next(r for r in broker.outputs if r.topic == "dlq")
    headers = dict(stub.headers)
    assert headers["crs.stub"] == b"true"
    assert headers["crs.source.offset"] == b"0"
    assert headers["crs.value.size"] == b"5000"
    assert headers["crs.error"] == b"output_rejected"
    assert stub.value is None
    assert h.metrics.commit_failures.labels("record_too_large")._value.get() == 1
    # Counted where it went: a dead letter (the classification was made, and is counted).
    assert h.metrics.dead_letters.labels("output_rejected")._value.get() == 1


async def test_a_rejected_stub_stalls_the_partition_instead_of_looping(
    broker: FakeBroker,
) -> None:
    h = Harness(broker, retry_backoff_max_s=0.2)
    broker.max_value_bytes = 10  # not even a stub fits: a broken topic configuration
    broker.append(IN, 0, b"k", b"x" * 50)
    await h.start(TP0)
    await until(lambda: bool(h.service.stalled()))
    # Taken over and its commit tried three times (back-off up to 0.2 s): the stub is
    # not stubbed again.
    await until(lambda: h.metrics.retries.labels("kafka_commit")._value.get() >= 3)
    assert h.metrics.commit_failures.labels("record_too_large")._value.get() == 1
    assert h.metrics.stalled.labels(IN, "0")._value.get() == 1
    await h.stop()


async def test_thousands_of_waiting_lanes_drain_without_recursion(broker: FakeBroker) -> None:
    # key_concurrency 1 and a stuck first key: every other key queues as "ready", and
    # then finishes eagerly, one after another, once the slot frees.
    h = Harness(broker, key_concurrency=1, max_in_flight=5000, max_batch=5000)
    gate = h.processor.gates[b"first"] = asyncio.Event()
    broker.append(IN, 0, b"k", b"first")
    broker.append_numbered(IN, 0, range(3000))
    await h.start(TP0)
    await until(lambda: len(h.service.partitions.owned[TP0].ready) == 3000)
    gate.set()
    await until(lambda: len(outputs(broker)) == 3001, limit_s=10)
    await h.stop()


async def test_a_lane_worker_that_crashes_does_not_orphan_its_key(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ownership_module.Ledger.complete
    crashed: list[bool] = []

    def complete_once(ledger: Any, offset: int, done: Any) -> None:
        if offset == 0 and not crashed:
            crashed.append(True)
            raise RuntimeError("a bug")
        real(ledger, offset, done)

    monkeypatch.setattr(ownership_module.Ledger, "complete", complete_once)
    h = Harness(broker)
    for v in (b"x0", b"y0", b"x1"):
        broker.append(IN, 0, v[:1], v)
    await h.start(TP0)
    await until(lambda: ("g", TP0) in broker.committed)
    await until(lambda: broker.committed[("g", TP0)].offset == 3)
    assert crashed
    assert sorted(outputs(broker)) == [b"x0", b"x1", b"y0"]  # each once
    await h.stop()


async def test_a_cancelled_error_leaking_out_of_processing_is_the_records_stub(
    broker: FakeBroker,
) -> None:
    # Not a cancel of the worker: a bug in a callee. As any processing error, the record
    # becomes an internal_error stub; ending the worker instead re-took the partition and
    # met the same record again, for good, and held the other keys' commits.
    h = Harness(broker)
    process = h.processor.process

    async def leaking(ref: InputRef, key: Any, value: Any, headers: Any, **kw: Any) -> Any:
        if value == b"x0":
            raise asyncio.CancelledError
        return await process(ref, key, value, headers, **kw)

    h.processor.process = leaking  # type: ignore[method-assign]
    for v in (b"x0", b"y0", b"y1"):
        broker.append(IN, 0, v[:1], v)
    await h.start(TP0)
    await until(lambda: ("g", TP0) in broker.committed)
    await until(lambda: broker.committed[("g", TP0)].offset == 3)
    (stub,) = [r for r in broker.outputs if r.topic == "dlq"]
    assert dict(stub.headers)["crs.error"] == b"internal_error"
    assert [r.value for r in broker.outputs if r.topic == "out"] == [b"y0", b"y1"]
    await h.stop()


async def test_a_record_the_client_cannot_read_is_one_stub_dead_letter(
    broker: FakeBroker,
) -> None:
    # service/stream/unreadable.py hands such a record out instead of raising; the engine
    # publishes a stub for it (code unreadable) in the partition's order and goes on.
    h = Harness(broker)
    broker.append(IN, 0, b"k", b"v0")
    broker.append_unreadable(IN, 0, "UnicodeDecodeError: invalid start byte")
    broker.append(IN, 0, b"k", b"v2")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0", b"v2"])
    await until(lambda: broker.committed[("g", TP0)].offset == 3)
    (stub,) = [r for r in broker.outputs if r.topic == "dlq"]
    headers = dict(stub.headers)
    assert headers["crs.error"] == b"unreadable"
    assert headers["crs.stub"] == b"true"
    assert headers["crs.source.offset"] == b"1"
    assert headers["crs.reason"] == b"UnicodeDecodeError: invalid start byte"
    assert (0, 1) not in h.processor.calls
    await until(lambda: h.metrics.dead_letters.labels("unreadable")._value.get() == 1)
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


async def test_idle_lane_workers_end_and_a_later_record_still_runs(broker: FakeBroker) -> None:
    # A burst staffs a worker per waiting key; once idle for _WORKER_IDLE_S they end
    # (no task per key left behind), and the next record is taken all the same.
    h = Harness(broker)
    gate = h.gated_records(8)
    await h.start(TP0)
    await until(lambda: h.processor.running == 8)
    part = await h.part()
    assert len(part.tasks) >= 8
    gate.set()
    await until(lambda: len(outputs(broker)) == 8)
    await asyncio.sleep(lanes_module._WORKER_IDLE_S - 1)
    assert len(part.tasks) >= 1  # idle, not yet ended
    await until(lambda: not part.tasks, limit_s=2)
    broker.append(IN, 0, b"late", b"late")
    await until(lambda: len(outputs(broker)) == 9)
    await h.stop()
