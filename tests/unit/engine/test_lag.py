"""Lag and held-transaction gauges."""

from __future__ import annotations

import asyncio

from tests.fake_kafka import FakeBroker
from tests.unit.engine.harness import IN, TP0, TP1, Harness, lag, loop_turns, outputs, until


async def test_lag_is_reported_from_assignment_on(broker: FakeBroker) -> None:
    h = Harness(broker)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    for i in range(3):
        broker.append(IN, 0, b"k", b"v%d" % i)
    await h.start(TP0)
    assert lag(h) == 3
    gate.set()
    await until(lambda: lag(h) == 0)
    await h.stop()


async def test_a_transaction_held_open_on_the_input_is_shown_while_the_lag_reads_0(
    broker: FakeBroker,
) -> None:
    # A producer killed mid-transaction (a dlq redrive): the records behind its first one
    # are invisible to a read_committed consumer, and the lag, measured to the last stable
    # offset, reads 0. How long that offset has not moved is what shows it.
    h = await Harness.published(broker)
    h.consumer.open_transaction_at[TP0] = 1
    broker.append(IN, 0, b"k", b"v1")  # the open transaction's record
    broker.append(IN, 0, b"k", b"v2")  # a producer's record behind it

    def stuck() -> float | None:
        return h.metrics.registry.get_sample_value(
            "crs_input_stable_offset_stuck_seconds", {"topic": IN, "partition": "0"}
        )

    await until(lambda: (stuck() or 0.0) > 0.2)
    assert outputs(broker) == [b"v0"]
    assert (
        h.metrics.registry.get_sample_value("crs_consumer_lag", {"topic": IN, "partition": "0"})
        == 0
    )
    del h.consumer.open_transaction_at[TP0]  # aborted (here: as if committed)
    broker.append(IN, 0, b"k", b"v3")
    await until(lambda: stuck() == 0.0 and len(outputs(broker)) == 4)
    await h.stop()


async def test_a_partition_not_fetched_is_not_shown_as_held_by_a_transaction(
    broker: FakeBroker,
) -> None:
    # aiokafka learns the high watermark and the last stable offset from fetch answers
    # only: a partition left out by backpressure (records stuck on the Kubernetes API)
    # keeps those of its last fetch, which saw a transaction that has since ended. Its
    # gauge climbed for as long as the outage lasted (CrsInputTransactionOpen firing).
    h = Harness(broker, max_in_flight=2, poll_keepalive_s=600.0)
    gate = h.gated_records(2)
    await h.service.start()
    h.consumer.open_transaction_at[TP0] = 2
    broker.append(IN, 0, b"t", b"t2")  # the open transaction's record
    await h.consumer.assign([TP0])
    h.task = asyncio.create_task(h.service.run())
    await until(
        lambda: TP0 in h.service.partitions.owned and h.service.partitions.owned[TP0].backpressured
    )
    del h.consumer.open_transaction_at[TP0]  # it commits; the partition is not fetched
    h.consumer.poll_age_s = 60.0  # the last fetch answer: a minute ago
    await loop_turns(h, 3)  # the gauge updated after the change
    assert h.metrics.registry.get_sample_value(
        "crs_input_stable_offset_stuck_seconds", {"topic": IN, "partition": "0"}
    ) in (None, 0.0)
    h.consumer.poll_age_s = 0.0
    gate.set()
    await until(lambda: len(outputs(broker)) == 3)
    await h.stop()


async def test_the_offset_reset_series_exists_from_take_over(broker: FakeBroker) -> None:
    # increase() over a counter whose series appears at 1 is 0: CrsOffsetReset would miss
    # a partition's first reset, usually its only one.
    h = Harness(broker)
    await h.start(TP0)
    await h.part()
    assert (
        h.metrics.registry.get_sample_value(
            "crs_offset_resets_total", {"topic": IN, "partition": "0"}
        )
        == 0.0
    )
    await h.stop()


async def test_lag_keeps_growing_while_the_partition_is_left_out_by_backpressure(
    broker: FakeBroker,
) -> None:
    # aiokafka learns the last stable offset from fetch responses only, and a partition
    # left out of getmany() (full: records stuck on the Kubernetes API) is not fetched.
    # Its lag must still follow the backlog (read with ListOffsets now and then), or the
    # lag alert cannot fire during the very outage that builds the backlog.
    h = Harness(broker, max_in_flight=4, max_batch=2, lag_refresh_s=0.05)
    gate = asyncio.Event()
    for i in range(60):
        h.processor.gates[b"v%d" % i] = gate
    broker.append_numbered(IN, 0, range(10))
    await h.start(TP0)
    await until(lambda: h.service.partitions.owned[TP0].backpressured)
    broker.append_numbered(IN, 0, range(10, 60))
    await until(lambda: lag(h) == 60)
    gate.set()
    await until(lambda: lag(h) == 0)
    await h.stop()


async def test_lag_is_zero_once_a_transactional_input_is_processed(broker: FakeBroker) -> None:
    # Each transaction of a transactional producer ends with a marker that takes an
    # offset and is never handed out: the committed offset stops on it, one short of
    # the end. With everything processed the lag is 0 (the fetch position), not 1.
    h = Harness(broker)
    broker.append_numbered(IN, 0, range(3))
    broker.append_marker(IN, 0)
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 3)
    await until(lambda: lag(h) == 0)
    await h.stop()


async def test_lag_never_waits_for_a_position_being_reset(broker: FakeBroker) -> None:
    # aiokafka's position() waits for an offset reset (request_timeout_ms, again and
    # again): the lag must not ask it, or the consume loop would stand still meanwhile.
    h = Harness(broker)
    broker.append_numbered(IN, 0, range(3))
    broker.append_marker(IN, 0)
    broker.append(IN, 1, b"k", b"w")
    await h.start(TP0, TP1)
    await until(lambda: len(outputs(broker)) == 4)
    h.consumer.awaiting_reset.add(TP0)
    await until(lambda: lag(h) == 1)  # the committed's
    turned = h.service.last_loop
    await until(lambda: h.service.last_loop > turned + 0.5)  # the loop keeps turning
    h.consumer.awaiting_reset.clear()
    await until(lambda: lag(h) == 0)
    await h.stop()
