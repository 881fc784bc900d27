"""Counters that advance only when the outcome they count is committed.

The Recorder and the Processor count as they decide (the reference recorder does). In
the stream engine a decision is only final once its Kafka transaction commits: a batch
replayed after a failed commit, or dropped because its producer was fenced, would
otherwise be counted twice. Each record is processed in its own task with a
:func:`capture` buffer in its context; increments land in the buffer and the engine
applies them after the commit (:func:`apply`). Outside a capture (unit tests, tools) an
increment applies at once, so the wrapped counters behave like plain ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any, Protocol

__all__ = ["DeferredCounter", "Increments", "apply", "capture"]


class _Incrementable(Protocol):
    def inc(self, amount: float = 1) -> None: ...


Increments = list[tuple[_Incrementable, float]]

_buffer: ContextVar[Increments | None] = ContextVar("crs_deferred_increments", default=None)


class capture:
    """Collect the increments made in this context (and tasks it starts) into a list.

    A class, not a generator context manager: it is entered once per record, and the
    generator machinery cost more than the rest of it.
    """

    __slots__ = ("_buf", "_token")

    def __init__(self) -> None:
        self._buf: Increments = []

    def __enter__(self) -> Increments:
        self._token = _buffer.set(self._buf)
        return self._buf

    def __exit__(self, *exc: object) -> None:
        _buffer.reset(self._token)


def apply(batches: Iterable[Increments]) -> None:
    """Apply the captured increments of committed records, one ``inc`` per counter
    child: a commit holds hundreds of records counting into a handful of children, and
    every ``inc`` takes the child's lock."""
    totals: dict[_Incrementable, float] = {}
    for increments in batches:
        for child, amount in increments:
            totals[child] = totals.get(child, 0.0) + amount
    for child, amount in totals.items():
        child.inc(amount)


def _inc(target: _Incrementable, amount: float) -> None:
    buf = _buffer.get()
    if buf is None:
        target.inc(amount)
    else:
        buf.append((target, amount))


class _DeferredChild:
    __slots__ = ("_child",)

    def __init__(self, child: Any) -> None:
        self._child = child

    def labels(self, *args: str, **kwargs: str) -> _DeferredChild:
        return _DeferredChild(self._child.labels(*args, **kwargs))

    def inc(self, amount: float = 1) -> None:
        _inc(self._child, amount)

    def __getattr__(self, name: str) -> Any:  # _value etc. for tests and introspection
        return getattr(self._child, name)


class DeferredCounter:
    """A prometheus_client Counter whose increments follow :func:`capture`.

    Children are cached per label values: prometheus_client's ``labels()`` takes a lock
    and validates on every call (~8 µs), a noticeable share of an event's CPU.
    """

    __slots__ = ("_children", "counter")

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self._children: dict[Any, _DeferredChild] = {}

    def labels(self, *args: str, **kwargs: str) -> _DeferredChild:
        key = (args, tuple(sorted(kwargs.items()))) if kwargs else args
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _DeferredChild(self.counter.labels(*args, **kwargs))
        return child

    def inc(self, amount: float = 1) -> None:
        _inc(self.counter, amount)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.counter, name)
