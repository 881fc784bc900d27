"""The informer's newer-wins store (service/k8s/store.py)."""

from __future__ import annotations

from dataclasses import dataclass

from service.k8s.store import Store, is_newer
from service.model import ObjectMeta


@dataclass(frozen=True)
class Thing:
    metadata: ObjectMeta
    kept: bool = True


def thing(name: str, rv: int | str, *, kept: bool = True) -> Thing:
    return Thing(ObjectMeta(name=name, resource_version=str(rv)), kept)


def recording() -> tuple[Store[Thing], list[tuple[str | None, str | None]]]:
    changes: list[tuple[str | None, str | None]] = []

    def on_change(old: Thing | None, new: Thing | None) -> None:
        changes.append(
            (
                None if old is None else old.metadata.resource_version,
                None if new is None else new.metadata.resource_version,
            )
        )

    return Store(on_change, keep=lambda t: t.kept), changes


def test_newer_wins_and_every_change_is_reported_once() -> None:
    store, changes = recording()
    assert store.upsert(thing("a", 5))
    assert not store.upsert(thing("a", 5))  # the same version again
    assert not store.upsert(thing("a", 4))  # a lagging event
    assert store.upsert(thing("a", 7))
    assert not store.delete("a", "6")  # a delete older than what we hold (a recreation)
    assert store.delete("a", "8")
    assert not store.delete("a", "9")
    assert changes == [(None, "5"), ("5", "7"), ("7", None)]
    assert len(store) == 0


def test_an_object_leaving_the_filter_is_removed() -> None:
    store, changes = recording()
    assert not store.upsert(thing("a", 1, kept=False))  # never held: nothing to report
    assert store.upsert(thing("a", 2))
    assert store.upsert(thing("a", 3, kept=False))
    assert store.get("a") is None
    assert changes == [(None, "2"), ("2", None)]


def test_replace_is_a_diff_that_keeps_writes_newer_than_the_list() -> None:
    store, changes = recording()
    for t in (thing("same", 1), thing("changed", 2), thing("gone", 3), thing("ours", 30)):
        store.upsert(t)
    changes.clear()
    # The list's snapshot is at 20; "ours" was written after it (30) and is kept.
    changed, removed = store.replace(
        [thing("same", 1), thing("changed", 12), thing("new", 13)], "20"
    )
    assert (changed, removed) == (2, 1)
    assert sorted(changes, key=str) == sorted([("2", "12"), (None, "13"), ("3", None)], key=str)
    assert [n for n in ("same", "changed", "gone", "ours", "new") if store.get(n)] == [
        "same",
        "changed",
        "ours",
        "new",
    ]


def test_resource_versions_compare_as_numbers_else_a_different_one_wins() -> None:
    assert is_newer("10", "9")
    assert not is_newer("9", "10")
    assert not is_newer("7", "7")
    assert is_newer("opaque-b", "opaque-a")
    assert is_newer("5", None)
