"""Writing the demo region into a cluster, touching only objects the demo owns.

Every object the scenario builds is labelled ``app.kubernetes.io/managed-by=
crs-consumer-demo``. Seeding deletes only objects carrying that label (or ``crs-demo=true``,
the label of demo runs before it), and it refuses, before changing anything, when an
object it would create already exists without the label: a cluster's own
``flavor-groups`` Knowledge, for instance, is never replaced or deleted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kubernetes_asyncio import client as k8s_client

from crs_demo import scenario
from service.k8s import RESOURCE_KINDS, KubeClient

__all__ = ["OWN_SELECTORS", "ForeignObjectsError", "is_own", "set_knowledge_ready", "write_region"]

_LEGACY_LABEL: Final = "crs-demo"
# Label selectors of the objects the demo may delete: its own, current and legacy.
OWN_SELECTORS: Final = (f"{scenario.MANAGED_BY}={scenario.DEMO_OWNER}", f"{_LEGACY_LABEL}=true")
_CONCURRENCY: Final = 16
_NAMES_SHOWN: Final = 5


class ForeignObjectsError(RuntimeError):
    """Objects the demo would create already exist and are not the demo's."""

    def __init__(self, names: Sequence[str]) -> None:
        shown = ", ".join(names[:_NAMES_SHOWN]) + (" ..." if len(names) > _NAMES_SHOWN else "")
        super().__init__(
            f"refusing to seed: {len(names)} object(s) the demo would create exist without "
            f"the label {OWN_SELECTORS[0]} ({shown}); the demo never replaces objects it did "
            "not create: use another cluster, or delete them yourself if they are disposable"
        )
        self.names = list(names)


def is_own(obj: Mapping[str, Any]) -> bool:
    """Whether a stored object carries the demo's label (current or legacy)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return bool(
        labels.get(scenario.MANAGED_BY) == scenario.DEMO_OWNER
        or labels.get(_LEGACY_LABEL) == "true"
    )


def _where(obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
    kind = RESOURCE_KINDS[obj["kind"]]
    return kind.group, kind.version, kind.plural, obj["metadata"]["name"]


async def write_region(kube: KubeClient, region: scenario.Region) -> None:
    """Replace the demo's objects: delete the previous run's, create this run's.

    Raises :class:`ForeignObjectsError`, having changed nothing, when an object of the
    region exists without the demo's label.
    """
    co = k8s_client.CustomObjectsApi(kube.api_client)
    objects = region.objects()
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def get(obj: Mapping[str, Any]) -> dict[str, Any] | None:
        group, version, plural, name = _where(obj)
        try:
            found: dict[str, Any] = await co.get_cluster_custom_object(group, version, plural, name)
        except k8s_client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def stored(obj: Mapping[str, Any]) -> dict[str, Any] | None:
        async with sem:
            return await get(obj)

    existing = await asyncio.gather(*(stored(o) for o in objects))
    foreign = [
        f"{RESOURCE_KINDS[o['kind']].plural}/{o['metadata']['name']}"
        for o, found in zip(objects, existing, strict=True)
        if found is not None and not is_own(found)
    ]
    if foreign:
        raise ForeignObjectsError(foreign)

    for kind in RESOURCE_KINDS.values():
        for selector in OWN_SELECTORS:
            await co.delete_collection_cluster_custom_object(
                kind.group, kind.version, kind.plural, label_selector=selector
            )

    async def create(obj: dict[str, Any]) -> None:
        group, version, plural, name = _where(obj)
        body = dict(obj)
        status = body.pop("status", None)
        async with sem:
            for _ in range(50):  # the deletion of the previous run may still be finishing
                try:
                    created = await co.create_cluster_custom_object(group, version, plural, body)
                    break
                except k8s_client.exceptions.ApiException as exc:
                    if exc.status != 409:
                        raise
                found = await get(obj)
                if found is not None and not is_own(found):  # created meanwhile by another
                    raise ForeignObjectsError([f"{plural}/{name}"])
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{plural}/{name} still exists after its deletion")
            if status is not None:
                created["status"] = status
                await co.replace_cluster_custom_object_status(group, version, plural, name, created)

    await asyncio.gather(*(create(o) for o in objects))


async def set_knowledge_ready(kube: KubeClient, ready: bool) -> None:
    """Flip the Ready condition of the demo's flavor-groups Knowledge (after seeding)."""
    co: Any = k8s_client.CustomObjectsApi(kube.api_client)  # _content_type is untyped upstream
    kind = RESOURCE_KINDS["Knowledge"]
    patch = {"status": {"conditions": scenario.knowledge(ready)["status"]["conditions"]}}
    await co.patch_cluster_custom_object_status(
        kind.group, kind.version, kind.plural, "flavor-groups", patch,
        _content_type="application/merge-patch+json",
    )  # fmt: skip
