"""Builders for the four custom resources, valid under the upstream CRD schemas.

Every object built here is accepted by upstream Cortex's CRD manifests (required fields
included; tests/integration/test_crd_compat.py checks it against CRS_UPSTREAM_CRDS), so
tests that use them also prove the project's own schemas accept what upstream accepts.
``create`` writes the status through the status subresource, because the API server drops
``.status`` on create for such CRDs.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from kubernetes_asyncio import client

from crs_demo.scenario import HYPERVISOR_SPEC, ready_conditions
from service.k8s import RESOURCE_KINDS

# (group, version, plural) of each kind, from the service's one definition of the four.
GVP = {kind: (k.group, k.version, k.plural) for kind, k in RESOURCE_KINDS.items()}
HV, RES, CR, KN = GVP["Hypervisor"], GVP["Reservation"], GVP["CommittedResource"], GVP["Knowledge"]
PLURAL_TO_GVP = {gvp[2]: gvp for gvp in GVP.values()}
CR_LABEL = "reservations.cortex.cloud/type"
TS = "2026-01-01T00:00:00Z"


def ready(status: str = "True") -> list[dict[str, Any]]:
    return ready_conditions(status, reason="Test")


def hypervisor(
    name: str,
    *,
    memory: str = "256Gi",
    allocated: str = "0",
    effective: str | None = None,
    cpu: str = "64",
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "capacity": {"memory": memory, "cpu": cpu},
        "allocation": {"memory": allocated, "cpu": "0"},
    }
    if effective is not None:
        status["effectiveCapacity"] = {"memory": effective, "cpu": cpu}
    return {
        "apiVersion": "kvm.cloud.sap/v1",
        "kind": "Hypervisor",
        "metadata": {"name": name},
        "spec": dict(HYPERVISOR_SPEC),
        "status": status,
    }


def allocation(memory: str, cpu: str = "2", ts: str = TS) -> dict[str, Any]:
    return {"creationTimestamp": ts, "resources": {"memory": memory, "cpu": cpu}}


def reservation(
    name: str,
    *,
    host: str,
    project: str = "p1",
    group: str = "g1",
    memory: str = "8Gi",
    allocations: dict[str, Any] | None = None,
    is_ready: bool = True,
    label: str = "committed-resource",
) -> dict[str, Any]:
    crr: dict[str, Any] = {"projectID": project, "resourceGroup": group}
    if allocations:
        crr["allocations"] = allocations
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "Reservation",
        "metadata": {"name": name, "labels": {CR_LABEL: label}},
        "spec": {
            "type": "CommittedResourceReservation",
            "targetHost": host,
            "resources": {"memory": memory, "cpu": "4"},
            "committedResourceReservation": crr,
        },
        "status": {"host": host, "conditions": ready("True" if is_ready else "False")},
    }


def committed_resource(
    name: str,
    *,
    project: str = "p1",
    group: str = "g1",
    amount: str = "64Gi",
    used: str | None = "0",
    state: str = "confirmed",
) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": ready()}
    if used is not None:
        status["usedResources"] = {"memory": used}
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "CommittedResource",
        "metadata": {"name": name},
        "spec": {
            "amount": amount,
            "availabilityZone": "az-1",
            "commitmentUUID": f"uuid-{name}",
            "domainID": "d1",
            "flavorGroupName": group,
            "projectID": project,
            "resourceType": "memory",
            "state": state,
        },
        "status": status,
    }


def flavor(name: str, memory_mb: int, vcpus: int) -> dict[str, Any]:
    return {"name": name, "vcpus": vcpus, "memoryMB": memory_mb, "diskGB": 64}


def flavor_group(name: str, flavors: list[dict[str, Any]]) -> dict[str, Any]:
    by_mem = sorted(flavors, key=lambda f: f["memoryMB"])
    return {
        "name": name,
        "flavors": flavors,
        "largestFlavor": by_mem[-1],
        "smallestFlavor": by_mem[0],
    }


def knowledge(
    features: list[dict[str, Any]], *, name: str = "flavor-groups", is_ready: bool = True
) -> dict[str, Any]:
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "Knowledge",
        "metadata": {"name": name},
        "spec": {"schedulingDomain": "nova", "recency": "60s"},
        "status": {
            "conditions": ready("True" if is_ready else "False"),
            "raw": {"features": features},
            "rawLength": len(features),
        },
    }


def gvp_of(obj: dict[str, Any]) -> tuple[str, str, str]:
    group, version = obj["apiVersion"].split("/")
    return group, version, RESOURCE_KINDS[obj["kind"]].plural


async def create(api: Any, obj: dict[str, Any], *, group: str | None = None) -> dict[str, Any]:
    """Create ``obj`` and then write its status; returns the stored object.

    ``group`` overrides the API group (used to install the same object under the upstream
    schema registered at a different group).
    """
    co = client.CustomObjectsApi(api)
    g, v, p = gvp_of(obj)
    g = group or g
    body = copy.deepcopy(obj)
    body["apiVersion"] = f"{g}/{v}"
    status = body.pop("status", None)
    stored: dict[str, Any] = await co.create_cluster_custom_object(g, v, p, body)
    if status is not None:
        stored["status"] = status
        stored = await co.replace_cluster_custom_object_status(
            g, v, p, body["metadata"]["name"], stored
        )
    return stored


async def get(api: Any, plural: str, name: str) -> dict[str, Any]:
    g, v, p = PLURAL_TO_GVP[plural]
    co = client.CustomObjectsApi(api)
    obj: dict[str, Any] = await co.get_cluster_custom_object(g, v, p, name)
    return obj


async def merge_patch(api: Any, plural: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    """An unguarded merge patch, as another writer (an operator, a controller) sends it."""
    g, v, p = PLURAL_TO_GVP[plural]
    co = client.CustomObjectsApi(api)
    obj: dict[str, Any] = await co.patch_cluster_custom_object(
        g, v, p, name, patch, _content_type="application/merge-patch+json"
    )
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
