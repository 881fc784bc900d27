"""The facade's fetch loop: pacing, back-pressure, failing fetches, ended clients."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaError

from service.stream.engine import (
    KafkaClientEnded,
)
from tests.fake_kafka import FakeBroker
from tests.unit.engine.harness import IN, TP0, Harness, lag, loop_turns, now, outputs, until


async def test_fetch_linger_paces_fetches_that_bring_records_only(broker: FakeBroker) -> None:
    h = Harness(broker, fetch_linger_ms=150)
    await h.start(TP0)
    await h.part()
    for i in range(3):  # each fetch brings one record: the next waits out the linger
        broker.append(IN, 0, b"k%d" % i, b"v%d" % i)
        await until(lambda n=i + 1: len(outputs(broker)) == n, limit_s=2)  # type: ignore[misc]
    await loop_turns(h, 5)  # idle: empty fetches (poll_timeout_ms = 20 ms)
    await h.stop()
    calls, returns = h.consumer.asked_at, h.consumer.returned
    after_records = [
        calls[k + 1] - returned
        for k, (returned, n) in enumerate(returns)
        if n and k + 1 < len(calls)
    ]
    assert len(after_records) >= 2
    assert min(after_records) >= 0.14  # the next fetch waited out the linger
    after_empty = [
        calls[k + 1] - t for k, (t, n) in enumerate(returns) if not n and k + 1 < len(calls)
    ]
    assert after_empty
    assert min(after_empty) < 0.05  # an empty fetch is followed at once


async def test_backpressure_stops_asking_for_the_partition_without_pausing_it(
    broker: FakeBroker,
) -> None:
    # Not consumer.pause(): aiokafka drops a paused partition's fetched records and
    # fetches them again on resume.
    h = Harness(broker, max_in_flight=4, max_batch=2)
    gate = h.gated_records(10)
    await h.start(TP0)
    await until(lambda: h.service.partitions.owned[TP0].backpressured)
    asked = len(h.consumer.asked)
    await loop_turns(h, 3)  # the loop had turns to ask for it
    assert all(TP0 not in a for a in h.consumer.asked[asked:])
    assert TP0 not in h.consumer.paused()
    assert h.processor.max_running <= 4
    gate.set()
    await until(lambda: len(outputs(broker)) == 10)
    # Lifted once the commit has returned, which the outputs may be seen before.
    await until(lambda: not h.service.partitions.owned[TP0].backpressured)
    await h.stop()


async def test_a_bound_of_one_record_in_flight_keeps_the_partition_flowing(
    broker: FakeBroker,
) -> None:
    # CRS_MAX_IN_FLIGHT=1 (strictly one record at a time) is a valid setting: the
    # backpressure it sets after each record must lift once that record is committed,
    # not wait for the keep-alive's one record per poll_keepalive_s.
    h = Harness(broker, max_in_flight=1, poll_keepalive_s=60.0)
    broker.append(IN, 0, b"k0", b"v0")
    await h.start(TP0)
    await until(lambda: len(outputs(broker)) == 1)
    broker.append(IN, 0, b"k1", b"v1")
    await until(lambda: len(outputs(broker)) == 2, limit_s=3.0)
    # Lifted once the commit has returned, which the outputs may be seen before (a busy
    # CI machine saw it still set).
    await until(lambda: not h.service.partitions.owned[TP0].backpressured)
    await h.stop()


async def test_a_partition_full_for_long_is_still_asked_for_one_record_now_and_then(
    broker: FakeBroker,
) -> None:
    # aiokafka makes a member leave the group when getmany() was not called for
    # max_poll_interval_ms; a full partition must not stop the calls for that long.
    h = Harness(broker, max_in_flight=4, max_batch=2, poll_keepalive_s=0.05)
    gate = h.gated_records(40)
    await h.start(TP0)
    await until(lambda: h.service.partitions.owned[TP0].backpressured)
    calls, started = len(h.consumer.asked), now()
    await until(lambda: len(h.consumer.asked) - calls >= 6)  # kept asking while full
    in_flight, elapsed = (
        h.service.partitions.owned[TP0].ledger.in_flight,
        now() - started,
    )
    assert in_flight <= 4 + 1 + elapsed / 0.05  # one record per keep-alive at most
    gate.set()
    await until(lambda: len(outputs(broker)) == 40)
    await h.stop()


async def test_a_stop_during_a_fetch_back_off_ends_the_loop_at_once(broker: FakeBroker) -> None:
    # Fetches failing (an ACL revoked, the broker away) sleep the back-off, up to
    # CRS_RETRY_BACKOFF_MAX_S; a SIGTERM must not wait that out of the shutdown budget.
    h = Harness(broker, retry_backoff_s=20.0, retry_backoff_max_s=20.0)
    broker.fail_fetches = [KafkaConnectionError("broker away (fake)")] * 3
    await h.start(TP0)
    await until(lambda: h.service.fetch_error is not None)
    started = now()
    await h.stop()
    assert now() - started < 1.0


async def test_a_failing_fetch_keeps_the_loop_turning_and_says_why(broker: FakeBroker) -> None:
    from aiokafka.errors import GroupAuthorizationFailedError

    h = Harness(broker, retry_backoff_max_s=0.05)
    broker.fail_fetches = [KafkaConnectionError("gone"), GroupAuthorizationFailedError()]
    broker.append(IN, 0, b"k", b"v")
    await h.start(TP0)
    await until(lambda: h.service.fetch_error is not None)
    await until(lambda: outputs(broker) == [b"v"])
    assert h.service.fetch_error is None  # cleared by the first good fetch
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


@pytest.mark.parametrize(
    "task",
    ["_coordination_task", "_heartbeat_task", "_commit_refresh_task", "fetching", "metadata"],
)
async def test_an_ended_client_task_commits_the_work_in_hand_and_ends_run(
    broker: FakeBroker, task: str
) -> None:
    # aiokafka starts none of its consumer tasks again on its own. Once a group task has
    # ended every getmany() raises: the loop retried that for good, up and never fetching
    # again (tests/integration/test_foreign_group_member.py: coordination;
    # test_kafka_security.py, the group ACL revoked for a moment: heartbeat). Once the
    # fetch task has, getmany() returns nothing, for good, and nothing looked wrong.
    h = Harness(broker, stop_wait_s=5.0)
    gate = h.processor.gates[b"v1"] = asyncio.Event()
    broker.append_numbered(IN, 0, range(3))
    await h.start(TP0)
    await until(lambda: sorted(outputs(broker)) == [b"v0", b"v2"])
    if task == "fetching":
        h.consumer._fetcher.error_future.set_exception(
            KafkaError("Unexpected error during data retrieval")
        )
    elif task == "metadata":  # nothing raised: fetches return nothing, for good
        h.consumer._client._sync_task.set_exception(RuntimeError("Unexpected error during"))
        broker.data.set()
    else:
        h.consumer._coordinator.end_task(task, KafkaError("Unexpected error during coordination"))
    await until(lambda: h.service.fetch_error is not None)
    assert not h.task.done()  # type: ignore[union-attr]
    gate.set()  # the record in hand is finished and committed before run() ends
    with pytest.raises(KafkaClientEnded, match="Unexpected error during"):
        await asyncio.wait_for(h.task, 5)  # type: ignore[arg-type]
    assert sorted(outputs(broker)) == [b"v0", b"v1", b"v2"]
    assert broker.committed[("g", TP0)].offset == 3
    await h.service.close()
    # Its connections are closed too (aiokafka's stop() raises before it closes them
    # when the fetch task ended): one set left open per restart otherwise.
    assert h.consumer._client.closed


async def test_a_heartbeat_ended_during_a_rebalance_is_left_to_aiokafka(
    broker: FakeBroker,
) -> None:
    # aiokafka drops a heartbeat task that ended while it rejoins and starts a new one
    # after the join: no sign of trouble reaches getmany(), so the client goes on.
    h = await Harness.published(broker)
    ended = asyncio.get_running_loop().create_future()
    ended.set_exception(KafkaError("Heartbeat failed"))
    h.consumer._coordinator._heartbeat_task = ended
    await loop_turns(h, 3)  # fetches that returned nothing, with the ended task in place
    h.consumer._coordinator._heartbeat_task = None  # the rejoin dropped it
    broker.append(IN, 0, b"k", b"v1")
    await until(lambda: outputs(broker) == [b"v0", b"v1"])
    assert not h.task.done()  # type: ignore[union-attr]
    assert h.service.fetch_error is None
    await h.stop()


@pytest.mark.parametrize("received_before", [1, 0], ids=["later-fetch", "first-fetch"])
async def test_records_a_failing_fetch_drained_and_dropped_are_fetched_again(
    broker: FakeBroker, received_before: int
) -> None:
    # aiokafka's getmany() moves each partition's position as it drains it and raises
    # when a later one fails to parse: the records drained first are gone from the
    # client. Before the rewind they were committed past without an output. And an error
    # that is not a KafkaError ended run(), and with it the process. first-fetch: a
    # partition without a committed offset that has received nothing yet, where the
    # rewind first had no offset to go back to (review).
    h = Harness(broker, retry_backoff_max_s=0.05)
    values = [b"v%d" % i for i in range(4)]
    for v in values[:received_before]:
        broker.append(IN, 0, b"k", v)
    await h.start(TP0)
    await until(lambda: outputs(broker) == values[:received_before])
    broker.fail_after_draining = [ValueError("a batch header that does not parse (fake)")]
    for v in values[received_before:]:
        broker.append(IN, 0, b"k", v)
    await until(lambda: outputs(broker) == values)
    assert not broker.fail_after_draining  # the failure did happen
    await until(lambda: broker.committed[("g", TP0)].offset == 4)
    assert not h.task.done()  # type: ignore[union-attr]
    await h.stop()


async def test_a_member_without_partitions_still_takes_the_group_errors(
    broker: FakeBroker,
) -> None:
    # aiokafka's group coordinator waits until the user has taken a group error (from
    # getmany) before it joins again: a fetch loop that stopped asking while it had no
    # partition left the member without any for good (seen after a broker restart).

    h = Harness(broker, retry_backoff_max_s=0.05)
    broker.fail_fetches = [KafkaError("SyncGroup: GroupLoadInProgressError")]
    await h.start()  # no partition assigned
    await until(lambda: not broker.fail_fetches)
    await until(lambda: h.service.fetch_error is None)  # asked again, and it worked
    await h.stop()


async def test_a_closed_engine_leaves_no_partition_series_behind(broker: FakeBroker) -> None:
    # The metrics outlive the engine when the Kafka clients restart in-process: the old
    # engine's partitions must not stay on /metrics (a lag, a stall) as if still held.
    h = Harness(broker)
    gate = h.processor.gates[b"v0"] = asyncio.Event()
    broker.append(IN, 0, b"k", b"v0")
    await h.start(TP0)
    await until(lambda: lag(h) == 1)
    h.service._table.stalled[TP0] = "commit failing"
    h.metrics.stalled.labels(IN, "0").set(1)
    gate.set()
    await h.stop()
    names = {s.name for f in h.metrics.registry.collect() for s in f.samples}
    per_partition = {"crs_consumer_lag", "crs_partition_stalled", "crs_partition_in_flight"}
    assert not names & per_partition, names & per_partition
    assert h.metrics.assigned._value.get() == 0
