"""Messy input end to end: a Knowledge with nulls, as the real API server keeps it, and a
Nova request with null hosts/weights, classified by the running service.

``status.raw`` is a preserve-unknown-fields object, so the API server stores the nulls
another component writes there; the reference decodes each as Go's zero value and the
valid groups keep resolving. The allocation written for a flavor with 100,000 vCPUs
carries the reference's canonical quantity text, "100k".
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio

from tests import e2e, nova
from tests import factories as f
from tests.conftest import DevStack
from tests.integration.test_service_e2e import sample, scrape, wait_processed

pytestmark = pytest.mark.integration

MESSY_FEATURES: list[Any] = [
    f.flavor_group("g1", [f.flavor("m1.small", 4096, 2), f.flavor("m1.wide", 4096, 100000)]),
    None,
    {
        "name": "g2",
        "flavors": [None, f.flavor("m2.small", 4096, 2)],
        "largestFlavor": None,
        "smallestFlavor": None,
        "ramCoreRatio": None,
    },
    {"name": "g3", "flavors": None},
]


@pytest_asyncio.fixture
async def topics(new_topic: Any) -> dict[str, str]:
    return {
        "input": await new_topic("in", 1),
        "output": await new_topic("out", 1),
        "dlq": await new_topic("dlq", 1),
    }


async def seed(api: Any) -> None:
    for name in ("hv-1", "hv-2", "hv-3"):
        await f.create(api, f.hypervisor(name, memory="256Gi"))
    await f.create(api, f.knowledge(MESSY_FEATURES))
    for group in ("g1", "g2"):
        await f.create(
            api, f.committed_resource(f"cr-{group}", project="p1", group=group, amount="256Gi")
        )
        await f.create(
            api,
            f.reservation(f"slot-{group}", host="hv-1", project="p1", group=group, memory="64Gi"),
        )


def record(vm: str, target: str | None, hosts: list[str] | None, flavor: str, **extra: Any) -> Any:
    request = nova.request(vm, project_id="p1", flavor_name=flavor, hosts=hosts or [])
    request.update(extra)
    if hosts is None:
        request["hosts"] = None
    ordered = [target] if target else []
    return e2e.good_record(vm, nova.decision_dict(target, ordered), request)


@pytest.mark.parametrize("read_mode", ["watch", "list"])
async def test_knowledge_with_nulls_classifies_through_the_service(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str], read_mode: str
) -> None:
    await seed(clean_k8s)
    stored = await f.get(clean_k8s, "knowledges", "flavor-groups")
    features = stored["status"]["raw"]["features"]
    # The premise: the API server keeps the nulls inside status.raw.
    assert features[1] is None
    assert features[2]["flavors"][0] is None
    assert features[2]["smallestFlavor"] is None
    assert features[3]["flavors"] is None

    cases = {
        # vm: (record, expected kind, cr_slot, flavor_group)
        "vm-small": (
            record("vm-small", "hv-1", ["hv-1"], "m1.small"),
            ("placement", "slot_used", "g1"),
        ),
        "vm-wide": (
            record("vm-wide", "hv-1", ["hv-1"], "m1.wide"),
            ("placement", "slot_used", "g1"),
        ),
        "vm-g2": (
            record("vm-g2", None, ["hv-2", "hv-1"], "m2.small"),
            ("no_host_found", "slot_blocked", "g2"),
        ),
        "vm-payg": (
            record("vm-payg", "hv-1", ["hv-1"], "not-in-a-group"),
            ("placement", "payg", None),
        ),
        # A Go producer's nil slice and map: no host offered, nothing to weigh.
        "vm-nil": (
            record("vm-nil", None, None, "m1.small", weights=None),
            ("no_host_found", "slot_exhausted", "g1"),
        ),
    }
    cfg = e2e.config(devstack, topics, CRS_K8S_READ_MODE=read_mode)
    async with e2e.running(cfg) as runtime:
        await e2e.publish(
            devstack.kafka_bootstrap, topics["input"], [rec for rec, _ in cases.values()]
        )
        await wait_processed(runtime, len(cases))
        metrics = await scrape(runtime)

    outputs = await e2e.read_all(devstack.kafka_bootstrap, topics["output"], len(cases))
    got = {e2e.data_of(r)["instance_uuid"]: e2e.data_of(r) for r in outputs}
    assert len(outputs) == len(cases)
    for vm, (_, expected) in cases.items():
        d = got[vm]
        assert (d["kind"], d["cr_slot"], d["flavor_group"]) == expected, vm
    assert await e2e.read_all(devstack.kafka_bootstrap, topics["dlq"], 0, timeout_s=1) == []
    # Counter values only: the *_created series carry a timestamp, not a count.
    errors = {
        k: v
        for k, v in metrics.items()
        if ("cr_slot", "error") in k[1] and v and not k[0].endswith("_created")
    }
    assert errors == {}, errors
    placed = "cortex_nova_placement_total"
    assert sample(metrics, placed, flavor_group="g1", intent="Unknown", cr_slot="slot_used") == 2
    nhf = "cortex_nova_no_host_found_total"
    assert sample(metrics, nhf, flavor_group="g2", intent="Unknown", cr_slot="slot_blocked") == 1

    slot = await f.get(clean_k8s, "reservations", "slot-g1")
    allocations = slot["spec"]["committedResourceReservation"]["allocations"]
    assert allocations["vm-small"]["resources"] == {"memory": "4Gi", "cpu": "2"}
    # NewQuantity(100000, DecimalSI).String() in the reference.
    assert allocations["vm-wide"]["resources"] == {"memory": "4Gi", "cpu": "100k"}
