"""The demo's seeding on the real API server: it only ever replaces objects it owns.

``crs-consumer-demo seed`` once deleted the ``flavor-groups`` Knowledge unconditionally;
run against a real cluster it would have wiped the production flavor groups. Now every
object it creates is labelled as its own, only such objects are deleted, and an object it
would create that exists without the label makes it refuse before changing anything.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from crs_demo import scenario
from crs_demo.seeding import ForeignObjectsError, is_own, write_region
from service.k8s import KubeClient
from tests import factories as f
from tests.conftest import REPO, DevStack

OWN = {scenario.MANAGED_BY: scenario.DEMO_OWNER}


@pytest_asyncio.fixture
async def kube(devstack: DevStack, clean_k8s: Any) -> AsyncIterator[KubeClient]:
    async with await KubeClient.create(devstack.kubeconfig) as kube:
        yield kube


def region() -> scenario.Region:
    return scenario.build_region(random.Random(7))


def labelled(obj: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    obj["metadata"]["labels"] = {**(obj["metadata"].get("labels") or {}), **labels}
    return obj


async def names(api: Any, plural: str) -> set[str]:
    g, v, p = f.PLURAL_TO_GVP[plural]
    listed = await client.CustomObjectsApi(api).list_cluster_custom_object(g, v, p)
    return {o["metadata"]["name"] for o in listed["items"]}


async def test_an_unlabelled_flavor_groups_knowledge_survives_seeding(
    kube: KubeClient, clean_k8s: Any
) -> None:
    theirs = await f.create(clean_k8s, f.knowledge([f.flavor_group("prod", [f.flavor("p", 1, 1)])]))

    with pytest.raises(ForeignObjectsError, match="knowledges/flavor-groups"):
        await write_region(kube, region())

    after = await f.get(clean_k8s, "knowledges", "flavor-groups")
    assert after["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert after["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"]
    assert after["status"]["raw"] == theirs["status"]["raw"]
    # Refused before changing anything: nothing of the region was created either.
    assert await names(clean_k8s, "hypervisors") == set()


async def test_seeding_replaces_only_its_own_objects(kube: KubeClient, clean_k8s: Any) -> None:
    await f.create(clean_k8s, f.hypervisor("hv-foreign"))
    await f.create(clean_k8s, f.reservation("res-foreign", host="hv-foreign"))
    await f.create(clean_k8s, f.knowledge([], name="other-knowledge"))
    # Leftovers of earlier demo runs: the current label and the legacy one.
    await f.create(clean_k8s, labelled(f.hypervisor("hv-old-demo"), OWN))
    await f.create(clean_k8s, labelled(f.hypervisor("hv-legacy-demo"), {"crs-demo": "true"}))

    reg = region()
    await write_region(kube, reg)
    await write_region(kube, reg)  # repeatable: the second run replaces the first

    hypervisors = await names(clean_k8s, "hypervisors")
    assert {"hv-foreign"} <= hypervisors
    assert not {"hv-old-demo", "hv-legacy-demo"} & hypervisors
    assert hypervisors - {"hv-foreign"} == {h["metadata"]["name"] for h in reg.hypervisors}
    assert "res-foreign" in await names(clean_k8s, "reservations")
    assert await names(clean_k8s, "knowledges") == {"other-knowledge", "flavor-groups"}
    for obj in reg.objects():
        stored = await f.get(clean_k8s, f.gvp_of(obj)[2], obj["metadata"]["name"])
        assert is_own(stored), obj["metadata"]["name"]
    knowledge = await f.get(clean_k8s, "knowledges", "flavor-groups")
    assert knowledge["status"]["rawLength"] == len(scenario.FLAVOR_GROUPS)


async def test_seed_command_refuses_in_one_line_and_exits_1(
    devstack: DevStack, clean_k8s: Any
) -> None:
    theirs = await f.create(clean_k8s, f.knowledge([]))
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "crs_demo", "seed"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={
            **os.environ,
            "KUBECONFIG": devstack.kubeconfig,
            "KAFKA_BOOTSTRAP_SERVERS": devstack.kafka_bootstrap,
        },
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("crs-consumer-demo: refusing to seed"), proc.stderr
    after = await f.get(clean_k8s, "knowledges", "flavor-groups")
    assert after["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"]
