"""Where a record's latency goes inside ``python -m service run``: a tracer for trials.

Put this directory on ``PYTHONPATH`` and name an output prefix in ``CRS_TRACE_OUT``;
``bench_latency.py`` passes both to the service it starts (it passes its environment).
Python imports ``sitecustomize`` at start-up: in the service's process (and only there)
this wraps a few engine and client methods and, at exit, writes their timestamps to
``$CRS_TRACE_OUT.<pid>``. ``bench/stage_report.py $CRS_TRACE_OUT`` reads them. Wall
clock (``time.time``) throughout, so the records' own timestamps (the publisher's create
time) line up. For trials, never for the gate's figures: the wrappers cost CPU.

It also counts the Kafka requests the service sends, by type. The wrapped names are
private; ``tests/unit/test_stage_trace.py`` fails when one of them
is renamed, so the tracer does not silently measure nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import Counter
from typing import Any

# (module, class, method, kind) of what is timed; kinds are read by stage_report.py.
TARGETS = (
    ("service.stream.engine.service", "StreamService", "_feed", "fetched"),
    ("service.stream.engine.lanes", "KeyLanes", "_decide", "decided"),
    ("service.stream.engine.transaction", "Transactions", "_send", "sent"),
    ("service.stream.engine.committer", "Committer", "_open_ahead", "opened_ahead"),
    ("service.k8s.client", "KubeClient", "_request", "api_request"),
    ("aiokafka", "AIOKafkaProducer", "commit_transaction", "end_txn"),
)

_events: list[list[Any]] = []


def _wrap(cls: Any, name: str, kind: str) -> None:
    original = getattr(cls, name)
    now = time.time

    if kind == "fetched":

        def fetched(self: Any, part: Any, records: Any) -> Any:
            t = now()
            for r in records:
                _events.append([kind, r.partition, r.offset, r.timestamp / 1000, t])
            return original(self, part, records)

        setattr(cls, name, fetched)
        return

    async def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = now()
        # What the event is about: a record's offset, a commit's plan end, a request's verb.
        where: list[Any] = [0, 0]
        if kind == "decided":
            where = [args[1].partition, args[1].offset]
        elif kind == "sent":
            where = [args[0].tp.partition, args[1].offset, args[0].ahead is not None]
        elif kind == "opened_ahead":
            where = [args[0].tp.partition, 0]
        elif kind == "api_request":
            where = [args[0], 0]
        try:
            return await original(self, *args, **kwargs)
        finally:
            _events.append([kind, *where[:2], t, now(), *where[2:]])

    setattr(cls, name, timed)


def _count_requests() -> Counter[str]:
    """Kafka requests sent, by type (a transaction is four or five of them)."""
    from aiokafka.conn import AIOKafkaConnection

    counts: Counter[str] = Counter()
    original = AIOKafkaConnection.send

    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        counts[type(request).__name__] += 1
        return original(self, request, *args, **kwargs)

    AIOKafkaConnection.send = send  # type: ignore[method-assign]
    return counts


def _stream_metrics() -> list[Any]:
    """The engine's metrics, once it has made them (to read the produced-ahead counts)."""
    from service.stream.metrics import StreamMetrics

    made: list[Any] = []
    original = StreamMetrics.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    StreamMetrics.__init__ = init  # type: ignore[method-assign]
    return made


def _install() -> None:
    import importlib

    for module, cls, method, kind in TARGETS:
        _wrap(getattr(importlib.import_module(module), cls), method, kind)
    requests = _count_requests()
    metrics = _stream_metrics()

    def dump() -> None:
        ahead = {
            outcome: sum(m.produced_ahead.labels(outcome)._value.get() for m in metrics)
            for outcome in ("published", "discarded")
        }
        with open(f"{os.environ['CRS_TRACE_OUT']}.{os.getpid()}", "w") as out:
            json.dump(
                [*_events, ["kafka_requests", dict(requests)], ["produced_ahead", ahead]], out
            )

    atexit.register(dump)


if os.environ.get("CRS_TRACE_OUT") and sys.orig_argv[1:3] == ["-m", "service"]:
    _install()
