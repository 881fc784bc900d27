"""A synthetic but realistic region and a stream of Nova outcomes over it.

Shared by ``crs-consumer-demo seed`` / ``demo``, the docker-compose seeding service and
the benchmarks, so that "the demo scenario" means one thing everywhere. Deterministic for
a given seed. Objects are plain API-server JSON (valid under the upstream CRD schemas),
each labelled as the demo's own (:data:`MANAGED_BY` = :data:`DEMO_OWNER`): the only
objects :mod:`crs_demo.seeding` ever replaces or deletes.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEMO_OWNER",
    "MANAGED_BY",
    "Region",
    "ScenarioEvent",
    "build_region",
    "events",
    "nova_request",
]

MANAGED_BY = "app.kubernetes.io/managed-by"
DEMO_OWNER = "crs-consumer-demo"
# The demo runs with CRS_MAX_EVENT_BYTES=DEMO_MAX_EVENT_BYTES; its oversized poison is
# larger than that, yet below the broker's default 1 MiB record limit.
DEMO_MAX_EVENT_BYTES = 256 * 1024
OVERSIZED_BYTES = 300_000
_TS = "2026-01-01T00:00:00Z"
_CR_LABEL = "reservations.cortex.cloud/type"
GiB = 1024**3


def ready_conditions(status: str = "True", reason: str = "Demo") -> list[dict[str, Any]]:
    """A ``Ready`` condition list, complete as the upstream schemas require."""
    return [
        {
            "type": "Ready",
            "status": status,
            "reason": reason,
            "message": "",
            "lastTransitionTime": _TS,
        }
    ]


# The spec fields the upstream Hypervisor schema requires; the service reads none of them.
HYPERVISOR_SPEC: dict[str, Any] = {
    "aggregates": [],
    "allowedProjects": [],
    "createCertManagerCertificate": False,
    "customTraits": [],
    "evacuateOnReboot": False,
    "highAvailability": False,
    "installCertificate": False,
    "lifecycleEnabled": False,
    "reboot": False,
    "skipTests": True,
}


def _meta(name: str, **labels: str) -> dict[str, Any]:
    return {"name": name, "labels": {MANAGED_BY: DEMO_OWNER, **labels}}


def hypervisor(
    name: str, memory_gib: int, allocated_gib: int, effective_gib: int | None
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "capacity": {"memory": f"{memory_gib}Gi", "cpu": "128"},
        "allocation": {"memory": f"{allocated_gib}Gi", "cpu": "0"},
    }
    if effective_gib is not None:
        status["effectiveCapacity"] = {"memory": f"{effective_gib}Gi", "cpu": "256"}
    return {
        "apiVersion": "kvm.cloud.sap/v1",
        "kind": "Hypervisor",
        "metadata": _meta(name),
        "spec": dict(HYPERVISOR_SPEC),
        "status": status,
    }


def reservation(
    name: str,
    host: str,
    project: str,
    group: str,
    memory_gib: int,
    allocations: dict[str, int],
    ready: bool = True,
) -> dict[str, Any]:
    crr: dict[str, Any] = {"projectID": project, "resourceGroup": group}
    if allocations:
        crr["allocations"] = {
            vm: {"creationTimestamp": _TS, "resources": {"memory": f"{gib}Gi", "cpu": "2"}}
            for vm, gib in allocations.items()
        }
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "Reservation",
        "metadata": _meta(name, **{_CR_LABEL: "committed-resource"}),
        "spec": {
            "type": "CommittedResourceReservation",
            "targetHost": host,
            "resources": {"memory": f"{memory_gib}Gi", "cpu": "8"},
            "committedResourceReservation": crr,
        },
        "status": {"host": host, "conditions": ready_conditions("True" if ready else "False")},
    }


def committed_resource(
    name: str, project: str, group: str, state: str, amount: str, used: str
) -> dict[str, Any]:
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "CommittedResource",
        "metadata": _meta(name),
        "spec": {
            "amount": amount,
            "availabilityZone": "az-a",
            "commitmentUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
            "domainID": "demo-domain",
            "flavorGroupName": group,
            "projectID": project,
            "resourceType": "memory",
            "state": state,
        },
        "status": {"conditions": ready_conditions(), "usedResources": {"memory": used}},
    }


def _flavor(name: str, memory_mb: int, vcpus: int) -> dict[str, Any]:
    return {"name": name, "vcpus": vcpus, "memoryMB": memory_mb, "diskGB": 64}


def _group(name: str, flavors: list[dict[str, Any]], **ratio: int) -> dict[str, Any]:
    by_mem = sorted(flavors, key=lambda f: f["memoryMB"])
    return {
        "name": name,
        "flavors": flavors,
        "largestFlavor": by_mem[-1],
        "smallestFlavor": by_mem[0],
        **ratio,
    }


FLAVOR_GROUPS: list[dict[str, Any]] = [
    _group(
        "gp_v2",
        [
            _flavor("m2.small", 4096, 2),
            _flavor("m2.medium", 8192, 4),
            _flavor("m2.large", 16384, 8),
        ],
        ramCoreRatio=2048,
    ),
    _group("hana_v2", [_flavor("hana_s", 65536, 8), _flavor("hana_m", 131072, 16)]),
    _group("ssd_v1", [_flavor("s1.xl", 32768, 8)], ramCoreRatioMin=2048, ramCoreRatioMax=8192),
    # Inconsistent ratios: the service skips this group, so its flavor counts as PAYG.
    _group("broken_v1", [_flavor("broken.one", 2048, 1)], ramCoreRatio=1024, ramCoreRatioMin=512),
]
FLAVOR_MB = {f["name"]: f["memoryMB"] for g in FLAVOR_GROUPS for f in g["flavors"]}
FLAVOR_MB["legacy.tiny"] = 512


def knowledge(ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "Knowledge",
        "metadata": _meta("flavor-groups"),
        "spec": {"schedulingDomain": "nova", "recency": "60s"},
        "status": {
            "conditions": ready_conditions("True" if ready else "False"),
            "raw": {"features": FLAVOR_GROUPS},
            "rawLength": len(FLAVOR_GROUPS),
        },
    }


@dataclass
class Region:
    hypervisors: list[dict[str, Any]] = field(default_factory=list)
    reservations: list[dict[str, Any]] = field(default_factory=list)
    committed_resources: list[dict[str, Any]] = field(default_factory=list)
    knowledge: dict[str, Any] = field(default_factory=knowledge)
    hosts_by_az: dict[str, list[str]] = field(default_factory=dict)
    slot_hosts: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def objects(self) -> list[dict[str, Any]]:
        return [*self.hypervisors, *self.committed_resources, *self.reservations, self.knowledge]


def build_region(rng: random.Random, hosts_per_az: int = 20) -> Region:
    """60 hypervisors in 3 AZs, four projects, CRs in every state, slots of every kind."""
    region = Region()
    for az in ("a", "b", "c"):
        names = []
        for i in range(1, hosts_per_az + 1):
            name = f"nova-compute-{az}{i:02d}"
            memory = rng.choice([512, 768, 1024])
            effective = memory * 3 // 2 if i % 4 == 0 else None
            region.hypervisors.append(
                hypervisor(name, memory, rng.randrange(0, memory * 6 // 10, 16), effective)
            )
            names.append(name)
        region.hosts_by_az[az] = names
    a, b, c = (region.hosts_by_az[z] for z in "abc")

    crs = [
        ("alpha-gp", "p-alpha", "gp_v2", "confirmed", "512Gi", "96Gi"),
        ("alpha-hana", "p-alpha", "hana_v2", "guaranteed", "1Ti", "0"),
        ("beta-gp", "p-beta", "gp_v2", "confirmed", "64Gi", "64Gi"),  # exhausted
        ("beta-hana", "p-beta", "hana_v2", "pending", "512Gi", "0"),  # not active
        ("gamma-planned", "p-gamma", "gp_v2", "planned", "128Gi", "0"),
        ("gamma-superseded", "p-gamma", "gp_v2", "superseded", "128Gi", "0"),
        ("gamma-expired", "p-gamma", "gp_v2", "expired", "128Gi", "0"),
        ("delta-ssd", "p-delta", "ssd_v1", "confirmed", "256Gi", "32Gi"),
    ]
    region.committed_resources = [committed_resource(*cr) for cr in crs]

    def slots(project: str, group: str, hosts: list[str], gib: int, fill: float) -> None:
        region.slot_hosts[(project, group)] = hosts
        for n, host in enumerate(hosts):
            allocs: dict[str, int] = {}
            used = 0
            while used + 4 <= gib * fill and rng.random() < 0.7:
                allocs[str(uuid.UUID(int=rng.getrandbits(128)))] = 4
                used += 4
            ready = n % 7 != 6  # every seventh slot is not Ready: never counted
            region.reservations.append(
                reservation(
                    f"cr-{project}-{group}-{n:02d}".replace("_", "-"),
                    host, project, group, gib, allocs, ready,
                )
            )  # fmt: skip

    slots("p-alpha", "gp_v2", a[:14], 32, 0.5)
    slots("p-alpha", "hana_v2", b[:4], 128, 0.0)
    slots("p-beta", "gp_v2", a[14:16], 16, 1.0)
    slots("p-delta", "ssd_v1", c[:2], 64, 0.5)
    return region


def nova_request(
    *,
    instance_uuid: str,
    project_id: str,
    flavor: str,
    hosts: list[str],
    check_type: str | None = None,
    skip_tracking: bool = False,
) -> dict[str, Any]:
    """An ExternalSchedulerRequest shaped as Nova sends it (unused fields included)."""
    hints: dict[str, Any] = {"domain_name": ["demo-domain"]}
    if check_type is not None:
        hints["_nova_check_type"] = [check_type]
    memory_mb = FLAVOR_MB.get(flavor, 1024)
    return {
        "context": {"project_id": project_id, "request_id": f"req-{instance_uuid[:8]}"},
        "hosts": [{"host": h, "hypervisor_hostname": h} for h in hosts],
        "pipeline": "nova-external-scheduler",
        "live": check_type == "live_migrate",
        "rebuild": check_type == "rebuild",
        "resize": check_type == "resize",
        "vmware": False,
        "weights": {h: 1.0 for h in hosts},
        "options": {"skip_committed_resource_tracking": skip_tracking},
        "spec": {
            "nova_object.name": "RequestSpec",
            "nova_object.namespace": "nova",
            "nova_object.version": "1.14",
            "nova_object.changes": [],
            "nova_object.data": {
                "availability_zone": "az-a",
                "flavor": {
                    "nova_object.name": "Flavor",
                    "nova_object.namespace": "nova",
                    "nova_object.version": "1.2",
                    "nova_object.data": {
                        "name": flavor,
                        "memory_mb": memory_mb,
                        "vcpus": max(1, memory_mb // 2048),
                        "root_gb": 64,
                        "extra_specs": {"hw_rng:allowed": "True"},
                    },
                },
                "instance_uuid": instance_uuid,
                "num_instances": 1,
                "project_id": project_id,
                "scheduler_hints": hints,
                "user_id": "demo-user",
            },
        },
    }


@dataclass(frozen=True)
class ScenarioEvent:
    """One outcome to publish; ``expect`` is the class the scenario aims at (a label)."""

    expect: str
    decision: dict[str, Any] | None = None
    request: dict[str, Any] | None = None
    poison: bytes | None = None


_CHECK_TYPES = [None, None, None, "resize", "live_migrate", "evacuate", "rebuild"]


def events(region: Region, rng: random.Random, count: int) -> Iterator[ScenarioEvent]:
    """A mixed stream: every classification, PAYG, skipped and ~3% poison."""
    a, b, c = (region.hosts_by_az[z] for z in "abc")
    gp_slots = region.slot_hosts[("p-alpha", "gp_v2")]
    ssd_slots = region.slot_hosts[("p-delta", "ssd_v1")]
    kinds = [
        ("slot_used", 30), ("slot_missed", 10), ("no_cr", 12), ("payg", 8), ("skipped", 5),
        ("nh_no_cr", 8), ("nh_cr_exhausted", 8), ("nh_slot_exhausted", 8), ("nh_slot_blocked", 8),
        ("poison", 3),
    ]  # fmt: skip
    names = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    for _ in range(count):
        kind = rng.choices(names, weights)[0]
        vm = str(uuid.UUID(int=rng.getrandbits(128)))
        check = rng.choice(_CHECK_TYPES)
        if kind == "poison":
            yield ScenarioEvent("poison", poison=_poison(rng))
            continue
        project, flavor, hosts, target = "p-alpha", rng.choice(["m2.small", "m2.medium"]), a, None
        skip = False
        if kind == "slot_used":
            hosts = rng.sample(gp_slots, 3) + rng.sample(c, 2)
            target = hosts[0]
        elif kind == "slot_missed":
            hosts = rng.sample(c, 4)
            target = hosts[0]
        elif kind == "no_cr":
            project = rng.choice(["p-gamma", "p-beta"])
            hosts = rng.sample(a, 4)
            target = hosts[0]
        elif kind == "payg":
            flavor = rng.choice(["legacy.tiny", "broken.one"])
            hosts = rng.sample(b, 3)
            target = hosts[0]
        elif kind == "skipped":
            hosts = rng.sample(gp_slots, 2)
            target, skip = hosts[0], True
        elif kind == "nh_no_cr":
            project, hosts = "p-gamma", rng.sample(a, 5)
        elif kind == "nh_cr_exhausted":
            project, hosts = "p-beta", rng.sample(a, 5)
        elif kind == "nh_slot_exhausted":
            project, flavor, hosts = "p-delta", "s1.xl", rng.sample(b, 5)
        elif kind == "nh_slot_blocked":
            project, flavor = "p-delta", "s1.xl"
            hosts = ssd_slots[:1] + rng.sample(b, 3)
        request = nova_request(
            instance_uuid=vm,
            project_id=project,
            flavor=flavor,
            hosts=hosts,
            check_type=check,
            skip_tracking=skip,
        )
        ordered = hosts if target else []
        decision = {
            "name": f"nova-{vm[:8]}",
            "result": {"targetHost": target, "orderedHosts": ordered},
        }
        yield ScenarioEvent(kind, decision=decision, request=request)


def _poison(rng: random.Random) -> bytes:
    choice = rng.randrange(5)
    if choice == 0:
        return b"this is not json {"
    if choice == 1:
        return bytes(rng.getrandbits(8) for _ in range(64))
    if choice == 2:
        return (
            b'{"specversion":"1.0","id":"x","source":"demo","type":"com.example.other","data":{}}'
        )
    if choice == 3:
        return (
            b'{"specversion":"1.0","id":"y","source":"demo",'
            b'"type":"cortex.nova.scheduling_outcome.v1","data":{"decision":{"result":{}}}}'
        )
    return b'{"pad":"' + b"x" * OVERSIZED_BYTES + b'"}'
