"""The newer-wins object store of one informer: what it holds, and what it tells its owner.

Every change (a watch event, our own write, a fresh read, a relist) is applied only if
its resourceVersion is newer than what the store holds, so a watch event that lags
behind our own write cannot roll the object back (read-your-writes). Each applied
change is reported synchronously to ``on_change(old, new)`` (``old`` None for an add,
``new`` None for a delete), so the owner's indexes change in the same step as the store
and no reader ever sees the two disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from service.k8s.client import K8sObject

__all__ = ["Store", "is_newer", "rv_int"]

T = TypeVar("T", bound=K8sObject)


def rv_int(rv: str | None) -> int | None:
    """A resourceVersion as a number, None when it is absent or not one."""
    if not rv:
        return None
    try:
        return int(rv)
    except ValueError:
        return None


def is_newer(candidate: str | None, current: str | None) -> bool:
    """Whether ``candidate`` is a strictly newer resourceVersion than ``current``.

    Kubernetes documents resourceVersions as opaque, but etcd-backed servers hand out
    monotonic integers and client-go's own caches rely on comparing them. When either
    does not parse the fallback is "a different version wins" (the plain informer
    rule: the last thing delivered is the truth); equal strings are never newer.
    """
    if candidate == current:
        return False
    a, b = rv_int(candidate), rv_int(current)
    if a is None or b is None:
        return True
    return a > b


def _rv_of(obj: K8sObject) -> str | None:
    return obj.metadata.resource_version


def _name_of(obj: K8sObject) -> str:
    return obj.metadata.name or ""


class Store(Generic[T]):
    """Objects of one kind by name, newer resourceVersion wins.

    ``keep`` filters client-side: objects it rejects are treated as absent (a change
    that takes an object out of the filter removes it).
    """

    def __init__(
        self,
        on_change: Callable[[T | None, T | None], None],
        *,
        keep: Callable[[T], bool] | None = None,
    ) -> None:
        self._objects: dict[str, T] = {}
        self._on_change = on_change
        self._keep = keep

    def get(self, name: str) -> T | None:
        return self._objects.get(name)

    def __len__(self) -> int:
        return len(self._objects)

    def upsert(self, obj: T) -> bool:
        """Add or replace ``obj`` unless the held version is as new; whether it changed."""
        name = _name_of(obj)
        old = self._objects.get(name)
        if old is not None and not is_newer(_rv_of(obj), _rv_of(old)):
            return False
        if self._keep is not None and not self._keep(obj):
            if old is None:
                return False
            del self._objects[name]
            self._on_change(old, None)
            return True
        self._objects[name] = obj
        self._on_change(old, obj)
        return True

    def delete(self, name: str, rv: str | None) -> bool:
        """Remove ``name`` as of version ``rv`` (None: unconditionally); whether it changed."""
        old = self._objects.get(name)
        if old is None:
            return False
        if rv and not is_newer(rv, _rv_of(old)):
            return False  # we hold a version written after this delete (a recreation)
        del self._objects[name]
        self._on_change(old, None)
        return True

    def replace(self, items: Iterable[T], list_rv: str) -> tuple[int, int]:
        """Make the store equal to a LIST, as a diff; returns (changed, removed).

        Objects we hold at a version newer than the list (our own write landed after the
        list's snapshot) are kept: the watch from ``list_rv`` will deliver the truth.
        """
        seen: set[str] = set()
        changed = 0
        for obj in items:
            seen.add(_name_of(obj))
            if self.upsert(obj):
                changed += 1
        list_n = rv_int(list_rv)
        removed = 0
        for name in [n for n in self._objects if n not in seen]:
            held = rv_int(_rv_of(self._objects[name]))
            if list_n is not None and held is not None and held > list_n:
                continue
            old = self._objects.pop(name)
            self._on_change(old, None)
            removed += 1
        return changed, removed
