"""A placement's classification produced into the transaction opened ahead while its
write is in flight (CRS_TXN_PRODUCE_AHEAD_MS), and discarded unless its decision
returns it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from service.stream.engine import StreamSettings
from service.stream.engine import transaction as transaction_module
from tests.fake_kafka import FakeBroker, FakeProducer
from tests.unit.engine.harness import (
    IN,
    TP0,
    Harness,
    ahead_count,
    gated_record,
    outputs,
    until,
)


async def _told(
    broker: FakeBroker, decided: bytes = b"v0", **settings: Any
) -> tuple[Harness, asyncio.Event, FakeProducer]:
    """One record (v0) whose decision tells its output ahead, then sends a request to
    the API server and waits on ``gate``; it is decided with value ``decided``."""
    return await gated_record(broker, requests_api=True, told_as=decided, **settings)


async def test_the_output_told_ahead_is_produced_before_the_decision_and_not_again(
    broker: FakeBroker,
) -> None:
    h, gate, producer = await _told(broker)
    await until(lambda: producer.calls == ["begin", "send", "offsets"])
    assert outputs(broker) == []  # in the open transaction, not published
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await until(lambda: ahead_count(h, "committed") == 1)
    assert producer.calls == ["begin", "send", "offsets", "commit"]  # only the end after it
    assert broker.committed[("g", TP0)].offset == 1
    await h.stop()


async def test_a_decision_that_ends_otherwise_discards_what_was_produced_ahead(
    broker: FakeBroker,
) -> None:
    # Another slot after a conflict, a failed write: the record told ahead must not be
    # published. The transaction that holds it is aborted and the decision's own output
    # committed in a new one.
    h, gate, producer = await _told(broker, decided=b"written-elsewhere")
    await until(lambda: producer.calls == ["begin", "send", "offsets"])
    gate.set()
    await until(lambda: outputs(broker) == [b"written-elsewhere"])
    await until(lambda: producer.calls[-1] == "commit")
    assert producer.calls[3:] == ["abort", "begin", "offsets", "send", "commit"]
    assert ahead_count(h, "aborted") == 1
    assert broker.committed[("g", TP0)].offset == 1
    await h.stop()


async def test_another_record_decided_meanwhile_is_not_held_for_the_write(
    broker: FakeBroker,
) -> None:
    # No batch barrier: a record of another key decided while the write is in flight
    # is committed at once (the transaction holding the output told ahead is aborted),
    # and the placement's output follows once it is decided, each exactly once.
    h, gate, producer = await _told(broker)
    await until(lambda: producer.calls == ["begin", "send", "offsets"])
    broker.append(IN, 0, b"k1", b"v1")
    await until(lambda: outputs(broker) == [b"v1"])
    assert ahead_count(h, "aborted") == 1
    gate.set()
    await until(lambda: outputs(broker) == [b"v1", b"v0"])
    await until(lambda: broker.committed[("g", TP0)].offset == 2)
    await h.stop()


async def test_an_output_produced_ahead_is_discarded_when_the_write_is_not_answered(
    broker: FakeBroker,
) -> None:
    # read_committed readers of the output partition wait behind the open
    # transaction's first record: after txn_produce_ahead_ms without a decision it is
    # aborted, and the output is produced after the decision as usual.
    h, gate, producer = await _told(broker, txn_produce_ahead_ms=50)
    await until(lambda: producer.calls == ["begin", "send", "offsets"])
    await until(lambda: "abort" in producer.calls)
    assert ahead_count(h, "aborted") == 1
    assert outputs(broker) == []
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await until(lambda: producer.calls[-1] == "commit")
    assert producer.calls.count("send") == 2  # ahead (aborted), then after the decision
    await h.stop()


async def test_nothing_is_produced_ahead_with_txn_produce_ahead_ms_0(
    broker: FakeBroker,
) -> None:
    h, gate, producer = await _told(broker, txn_produce_ahead_ms=0)
    await until(lambda: producer.calls == ["begin", "offsets"])
    gate.set()
    await until(lambda: outputs(broker) == [b"v0"])
    await until(lambda: producer.calls[-1] == "commit")
    assert producer.calls == ["begin", "offsets", "send", "commit"]
    await h.stop()


def test_the_shipped_window_is_short() -> None:
    # A reader of the output topic waits behind an output produced ahead at most this
    # long; it must stay far below txn_open_ahead_max_s (the open transaction's bound).
    s = StreamSettings(input_topic=IN, group_id="g")
    assert 0 < s.txn_produce_ahead_ms / 1000 < s.txn_open_ahead_max_s / 10


async def test_nothing_is_produced_ahead_while_another_record_is_undecided(
    broker: FakeBroker,
) -> None:
    # The other record would likely be decided first and the transaction aborted:
    # both go the usual way, nothing produced ahead, nothing discarded.
    h = Harness(broker)
    gates = {v: h.processor.gates.setdefault(v, asyncio.Event()) for v in (b"v0", b"v1")}
    h.processor.requests_api.add(b"v0")
    h.processor.told_ahead[b"v0"] = b"v0"
    broker.append(IN, 0, b"k1", b"v1")
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    producer: FakeProducer = (await h.part()).producer
    await until(lambda: producer.calls == ["begin", "offsets"])  # opened ahead, no send
    for gate in gates.values():
        gate.set()
    await until(lambda: sorted(outputs(broker)) == [b"v0", b"v1"])
    await until(lambda: producer.calls[-1] == "commit")
    assert producer.calls.count("send") == 2  # each once, after its decision
    ahead = h.metrics.produced_ahead
    assert (ahead.labels("published")._value.get(), ahead.labels("discarded")._value.get()) == (
        0,
        0,
    )
    await h.stop()


async def test_a_retried_decision_that_is_told_again_is_published_once(
    broker: FakeBroker,
) -> None:
    # Attempt 1 tells its output, which is produced ahead, then ends RetryLater (the API
    # server unavailable); attempt 2, within the window, tells another record (the same
    # classification, made again) and waits on its write. The first is in the
    # transaction and the decision can no longer return it: the second is not produced
    # ahead, the transaction is aborted, the decision's record published once.
    h = Harness(broker)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    h.processor.requests_api.add(b"v0")
    h.processor.told_ahead[b"v0"] = b"v0"
    h.processor.retries[b"v0"] = 1
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    part = await h.part()
    producer: FakeProducer = part.producer
    await until(lambda: producer.calls == ["begin", "send", "offsets"])
    gate.set()  # attempt 1 goes on to its RetryLater
    gate.clear()  # and attempt 2 waits here, told again
    await until(lambda: len(h.processor.calls) == 2 and not part.expected)
    gate.set()
    await until(lambda: producer.calls[-1] == "commit")
    assert outputs(broker) == [b"v0"]
    assert producer.calls.count("abort") == 1
    ahead = h.metrics.produced_ahead
    assert (ahead.labels("published")._value.get(), ahead.labels("discarded")._value.get()) == (
        0,
        1,
    )
    await h.stop()


async def test_right_after_a_commit_the_offsets_go_before_the_output_produced_ahead(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker answers a transaction's first request CONCURRENT_TRANSACTIONS while it
    # writes the previous one's markers, and aiokafka retries an output partition after
    # a fixed 20 ms, the group sooner: so the offsets first, then the output. "Right
    # after" is widened to 10 s here (see test_transaction.py).
    monkeypatch.setattr(transaction_module, "MARKERS_WINDOW_S", 10.0)
    h = Harness(broker, commit_burst=5, fetch_linger_ms=0)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: outputs(broker) == [b"v0"])
    producer: FakeProducer = (await h.part()).producer
    gate = h.processor.gates[b"v1"] = asyncio.Event()
    h.processor.requests_api.add(b"v1")
    h.processor.told_ahead[b"v1"] = b"v1"
    broker.append(IN, 0, b"k1", b"v1")
    await until(lambda: producer.calls[-3:] == ["begin", "offsets", "send"])
    gate.set()
    await until(lambda: outputs(broker) == [b"v0", b"v1"])
    await until(lambda: producer.calls[-1] == "commit")
    assert producer.calls[-4:] == ["begin", "offsets", "send", "commit"]
    await h.stop()
