"""The project's CRD schemas accept everything the upstream schemas accept (fields used).

The upstream manifests are installed into the same API server under a renamed group
(``upstream.<group>``), so one object can be submitted to both schemas and both verdicts
come from the real server's validation, not from a re-implementation of it.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from service.k8s import RESOURCE_KINDS
from tests import factories as f
from tests.conftest import REPO
from tests.upstream import UPSTREAM_CRDS

PREFIX = "upstream."


def renamed(crd: dict[str, Any]) -> dict[str, Any]:
    crd = copy.deepcopy(crd)
    crd["spec"]["group"] = PREFIX + crd["spec"]["group"]
    crd["metadata"] = {"name": f"{crd['spec']['names']['plural']}.{crd['spec']['group']}"}
    return crd


async def install(api: Any, crd: dict[str, Any]) -> None:
    """Install once; the upstream manifests do not change within a run."""
    ext = client.ApiextensionsV1Api(api)
    name = crd["metadata"]["name"]
    try:
        await ext.create_custom_resource_definition(crd)
    except ApiException as e:
        if e.status != 409:
            raise
    for _ in range(100):
        got = await ext.read_custom_resource_definition(name)
        conds = got.status.conditions or []
        if any(c.type == "Established" and c.status == "True" for c in conds):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} not established")


def upstream_crds() -> list[dict[str, Any]]:
    """Cortex's CRD manifests (CRS_UPSTREAM_CRDS), or a skip naming the variable."""
    return [yaml.safe_load(p.read_text()) for p in sorted(UPSTREAM_CRDS.path().glob("*.yaml"))]


def identity(crd: dict[str, Any]) -> dict[str, Any]:
    """What a client addresses: names, scope, and the served and stored versions."""
    spec = crd["spec"]
    return {
        "name": crd["metadata"]["name"],
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "plural": spec["names"]["plural"],
        "scope": spec["scope"],
        "versions": sorted(
            (v["name"], v["served"], v["storage"], "status" in v.get("subresources", {}))
            for v in spec["versions"]
        ),
    }


@pytest_asyncio.fixture
async def upstream_installed(clean_k8s: Any) -> Any:
    wanted = [c for c in upstream_crds() if c["spec"]["names"]["plural"] in f.PLURAL_TO_GVP]
    assert len(wanted) == 4, "upstream CRDs for the four kinds must be present"
    for crd in wanted:
        await install(clean_k8s, renamed(crd))
    yield clean_k8s
    co = client.CustomObjectsApi(clean_k8s)
    for g, v, p in f.PLURAL_TO_GVP.values():
        await co.delete_collection_cluster_custom_object(PREFIX + g, v, p)


SAMPLES = [
    f.hypervisor("hv-1"),
    f.hypervisor("hv-2", memory="1Ti", allocated="300Gi", effective="1536Gi"),
    f.reservation("r-empty", host="hv-1"),
    f.reservation(
        "r-alloc",
        host="hv-1",
        memory="16Gi",
        allocations={"vm-1": f.allocation("4Gi"), "vm-2": f.allocation("4294967296", "2")},
    ),
    f.reservation("r-notready", host="hv-2", is_ready=False),
    f.committed_resource("cr-1", amount="1280Gi", used="640Mi"),
    f.committed_resource("cr-2", state="pending", used=None),
    f.knowledge(
        [
            f.flavor_group("g1", [f.flavor("m1.small", 2048, 1), f.flavor("m1.large", 8192, 4)]),
            {**f.flavor_group("g2", [f.flavor("hana", 2032, 2)]), "ramCoreRatio": 1016},
        ]
    ),
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: f"{o['kind']}-{o['metadata']['name']}")
async def test_object_accepted_by_upstream_is_accepted_by_project_schema(
    upstream_installed: Any, obj: dict[str, Any]
) -> None:
    group = obj["apiVersion"].split("/")[0]
    up = await f.create(upstream_installed, obj, group=PREFIX + group)
    ours = await f.create(upstream_installed, obj)
    # What was sent survives both schemas: nothing is pruned or rewritten (upstream may add
    # defaults of its own, which the comparison ignores).
    for part in ("spec", "status"):
        if part in obj:
            assert_contains(up[part], obj[part])
            assert_contains(ours[part], obj[part])


def assert_contains(actual: Any, expected: Any, path: str = "$") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        for key, value in expected.items():
            assert key in actual, f"{path}.{key} was pruned"
            assert_contains(actual[key], value, f"{path}.{key}")
    else:
        assert actual == expected, path


async def test_written_allocation_passes_upstream_schema(upstream_installed: Any) -> None:
    """The exact patch shape the service sends is valid under the upstream schema."""
    res = f.reservation("r-patch", host="hv-1")
    stored = await f.create(upstream_installed, res, group=PREFIX + "cortex.cloud")
    co = client.CustomObjectsApi(upstream_installed)
    patch = {
        "metadata": {"resourceVersion": stored["metadata"]["resourceVersion"]},
        "spec": {
            "committedResourceReservation": {
                "allocations": {
                    "vm-9": {
                        "creationTimestamp": "2026-12-02T10:11:12Z",
                        "resources": {"memory": "4Gi", "cpu": "2"},
                    }
                }
            }
        },
    }
    out = await co.patch_cluster_custom_object(
        PREFIX + "cortex.cloud",
        "v1alpha1",
        "reservations",
        "r-patch",
        patch,
        _content_type="application/merge-patch+json",
    )
    assert out["spec"]["committedResourceReservation"]["allocations"]["vm-9"]["resources"] == {
        "memory": "4Gi",
        "cpu": "2",
    }


def test_project_crds_cover_the_same_kinds_as_upstream() -> None:
    """Each of the project's cut-down CRDs is addressed as upstream's, for the kinds read."""
    ours = {
        c["metadata"]["name"]: identity(c)
        for c in (yaml.safe_load(p.read_text()) for p in (REPO / "schemas" / "crds").glob("*.yaml"))
    }
    read = {(k.group, k.plural) for k in RESOURCE_KINDS.values()}
    upstream = {
        c["metadata"]["name"]: identity(c)
        for c in upstream_crds()
        if (c["spec"]["group"], c["spec"]["names"]["plural"]) in read
    }
    assert len(upstream) == len(RESOURCE_KINDS), "an upstream CRD of a kind read is missing"
    assert ours == upstream
