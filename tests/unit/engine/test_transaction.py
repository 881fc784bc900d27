"""Transactions opened ahead while a partition waits on the API."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.structs import OffsetAndMetadata

from service.stream.engine import StreamSettings
from service.stream.engine import transaction as transaction_module
from tests.fake_kafka import FakeBroker, FakeProducer
from tests.unit.engine.harness import (
    IN,
    TP0,
    Harness,
    ahead_count,
    assert_held_at,
    gated_record,
    loop_turns,
    one_waiting_record,
    out_tp,
    outputs,
    until,
)


async def test_a_partition_waiting_on_the_api_opens_its_transaction_ahead(
    broker: FakeBroker,
) -> None:
    # The record is undecided (a PATCH in flight): the transaction is begun and its
    # offset sent meanwhile; after the decision only the output and the end remain.
    h, gate, producer = await one_waiting_record(broker)
    assert outputs(broker) == []
    assert ("g", TP0) not in broker.committed
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    assert producer.calls == ["begin", "offsets", "send", "commit"]  # the offset not again
    assert broker.committed[("g", TP0)].offset == 1
    # Counted once commit_transaction() has returned, a loop turn or two after the
    # fake broker shows the output.
    await until(lambda: ahead_count(h, "committed") == 1)
    await h.stop()


async def _undecided_for_a_minute(
    broker: FakeBroker, *, requests_api: bool
) -> tuple[Harness, asyncio.Event, FakeProducer]:
    """One record held undecided by its gate, with CRS_TXN_OPEN_AHEAD_MS at 60 s; its
    decision sends a request to the API server first if ``requests_api``."""
    return await gated_record(broker, requests_api=requests_api, txn_open_ahead_ms=60_000)


async def test_a_decision_that_sends_an_api_request_opens_the_transaction_at_once(
    broker: FakeBroker,
) -> None:
    # txn_open_ahead_ms is a guess at how long a decision that does not wait takes;
    # one that has sent a request to the API server (a PATCH) says so, and the
    # transaction is begun then, not once the guess has run out (60 s here).
    h, gate, producer = await _undecided_for_a_minute(broker, requests_api=True)
    await until(lambda: producer.calls == ["begin", "offsets"])
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await until(lambda: ahead_count(h, "committed") == 1)
    assert producer.calls == ["begin", "offsets", "send", "commit"]
    await h.stop()


async def test_a_decision_without_api_requests_waits_for_txn_open_ahead_ms(
    broker: FakeBroker,
) -> None:
    # The hook is the only early path: the same record with the guess at 60 s and no
    # API request is committed the usual way once decided, never opened ahead.
    h, gate, producer = await _undecided_for_a_minute(broker, requests_api=False)
    await until(lambda: h.processor.running == 1)
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    assert producer.calls[:2] == ["begin", "send"]
    assert ahead_count(h, "committed") == 0
    await h.stop()


async def test_a_transaction_opened_ahead_adds_the_waiting_records_output_partitions(
    broker: FakeBroker,
) -> None:
    # aiokafka would add the output partition when the output is sent: one round trip
    # after the decision. Added ahead, only the output and the end remain after it.
    broker.topic_partitions["out"] = 4
    h = Harness(broker)
    gates = {v: h.processor.gates.setdefault(v, asyncio.Event()) for v in (b"a0", b"b0")}
    broker.append(IN, 0, b"key-a", b"a0")
    broker.append(IN, 0, b"key-b", b"b0")
    await h.start(TP0)
    producer: FakeProducer = (await h.part()).producer
    await until(lambda: producer.calls == ["begin", "add", "add", "offsets"])
    assert sorted(producer.added) == sorted({out_tp(b"key-a"), out_tp(b"key-b")})
    for gate in gates.values():
        gate.set()
    await until(lambda: sorted(outputs(broker)) == [b"a0", b"b0"])
    assert producer.calls[4:] == ["send", "send", "commit"]
    assert broker.committed[("g", TP0)].offset == 2
    await h.stop()


async def test_right_after_a_commit_no_partition_is_added_ahead(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker answers a transaction's first request CONCURRENT_TRANSACTIONS while it
    # writes the previous one's markers; aiokafka retries the group sooner than a
    # partition, so a transaction opened right after a commit sends its offset first,
    # and its outputs add their partitions as usual. "Right after" is widened to 10 s
    # here: the real 20 ms was missed when the loop stalled on a busy machine.
    monkeypatch.setattr(transaction_module, "MARKERS_WINDOW_S", 10.0)
    broker.topic_partitions["out"] = 4
    h = Harness(broker, commit_burst=5, fetch_linger_ms=0)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0"])
    producer: FakeProducer = (await h.part()).producer
    h.processor.gates[b"v1"] = gate = asyncio.Event()
    broker.append(IN, 0, b"k1", b"v1")
    await until(lambda: producer.calls[-2:] == ["begin", "offsets"])
    gate.set()
    await until(lambda: outputs(broker) == [b"v0", b"v1"])
    assert producer.calls[-4:] == ["begin", "offsets", "send", "commit"]
    assert producer.added == []
    await h.stop()


async def test_no_output_partition_is_added_ahead_before_the_topic_is_known(
    broker: FakeBroker,
) -> None:
    h, gate, producer = await one_waiting_record(broker)  # no metadata for "out" yet
    assert producer.added == []
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await h.stop()


async def test_an_offset_that_moved_while_open_ahead_is_sent_again(broker: FakeBroker) -> None:
    h, gate, producer = await one_waiting_record(broker, b"x", b"x0")  # offset 1 sent ahead
    broker.append(IN, 0, b"y", b"y0")  # decided at once, behind the stuck x0
    await until(lambda: outputs(broker) == [b"y0"])
    assert producer.calls == ["begin", "offsets", "send", "offsets", "commit"]
    assert_held_at(broker, 0)
    gate.set()
    await until(lambda: len(outputs(broker)) == 2)
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 2


async def test_a_transaction_open_ahead_too_long_is_aborted(broker: FakeBroker) -> None:
    h = Harness(broker, txn_open_ahead_max_s=0.05)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: ahead_count(h, "aborted") >= 1)
    producer = h.service.partitions.owned[TP0].producer
    # Counted just before the abort is sent (in a task of its own): wait for the call.
    await until(lambda: "abort" in producer.calls)
    assert producer.calls[:3] == ["begin", "offsets", "abort"]
    assert ("g", TP0) not in broker.committed  # the offset sent ahead was not committed
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await h.stop()
    assert broker.committed[("g", TP0)].offset == 1
    assert h.counted() == 1


async def test_stopping_aborts_a_transaction_open_ahead(broker: FakeBroker) -> None:
    h, _, producer = await one_waiting_record(broker, stop_wait_s=0.05)  # never decided
    await h.stop()
    # Ended without committing the offset sent ahead: aborted, or (here, a partition
    # never committed before) committed at the undecided record itself.
    assert producer.calls[-1] in ("abort", "commit")
    assert not producer.in_transaction
    assert producer.stopped
    assert broker.committed.get(("g", TP0), OffsetAndMetadata(0, "")).offset == 0
    assert outputs(broker) == []


async def test_opening_ahead_can_be_turned_off(broker: FakeBroker) -> None:
    h = Harness(broker, txn_open_ahead_ms=0)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: h.processor.calls == [(0, 0)])
    # Past when the shipped setting would have opened it (every timer up to then has
    # fired on the virtual clock), and the fetch loop turned whole since.
    await asyncio.sleep(3 * StreamSettings.txn_open_ahead_ms / 1000)
    await loop_turns(h)
    assert h.service.partitions.owned[TP0].producer.calls == []
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    assert h.service.partitions.owned[TP0].producer.calls == ["begin", "send", "offsets", "commit"]
    await h.stop()
