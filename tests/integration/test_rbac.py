"""The production RBAC (deploy/) proven against the real kube-apiserver.

The Namespace, ServiceAccount, ClusterRole and ClusterRoleBinding are loaded from the
manifests in deploy/ and installed under test names (cluster-scoped names get a random
suffix, so concurrent runs on one API server do not clash); the binding is pointed at the
test ServiceAccount. A token for that account comes from the TokenRequest API, and the
service's own Kubernetes client runs with it:

* a full recorder scenario works in both read modes (``ListClusterState`` and the watch
  cache ``WatchClusterState``): a slot_used placement writes its allocation, a replay is
  idempotent, a no-host-found is classified, and no request is refused;
* everything beyond the role is refused with 403: deleting or creating a Reservation,
  patching a Hypervisor or a CommittedResource, writing Reservation status, reading
  Secrets, listing ConfigMaps, granting itself more rights.

There is no controller-manager in the dev stack, so a deleted Namespace never finishes
terminating: the test Namespace has a fixed name, is created idempotently and stays;
everything else is deleted again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from service.crs import Recorder, new_no_host_found_counter, new_placement_counter
from service.crs.outcome import AllocationStatus
from service.crs.ports import ForbiddenError
from service.k8s import K8sMetrics, KubeClient, ListClusterState
from service.k8s.cache import WatchClusterState
from tests import factories as f
from tests import nova
from tests.conftest import REPO, DevStack

DEPLOY = REPO / "deploy"
NAMESPACE = "crs-rbac-test"  # fixed: namespaces never finish deleting in the dev stack
MERGE = "application/merge-patch+json"
HOST, OTHER = "rbac-host-a", "rbac-host-b"
PROJECT, GROUP = "p1", "g1"
NOW = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
UUID_LIST = "aaaaaaaa-0000-4000-8000-000000000001"
UUID_WATCH = "aaaaaaaa-0000-4000-8000-000000000002"


def manifest(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text())
    return doc


@dataclass(frozen=True)
class Identity:
    """The test ServiceAccount, bound to (a copy of) the production ClusterRole."""

    namespace: str
    service_account: str
    role: str
    binding: str
    token: str
    server: str
    ca_file: str

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    def client(self, registry: CollectorRegistry | None = None) -> KubeClient:
        return KubeClient.from_token(
            self.server,
            self.ca_file,
            self.token,
            metrics=K8sMetrics(registry) if registry is not None else None,
        )


async def _retry(call: Callable[[], Awaitable[Any]], *, on: tuple[int, ...]) -> Any:
    """``call()``, retried for up to 10 s while the API answers one of the ``on`` codes."""
    for _ in range(100):
        try:
            return await call()
        except ApiException as exc:
            if exc.status not in on:
                raise
        await asyncio.sleep(0.1)
    return await call()


@pytest_asyncio.fixture(scope="module")
async def identity(devstack: DevStack, kube_api: Any) -> AsyncIterator[Identity]:
    core = client.CoreV1Api(kube_api)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    suffix = uuid.uuid4().hex[:8]

    ns = manifest("namespace.yaml")
    assert ns["kind"] == "Namespace"
    ns["metadata"]["name"] = NAMESPACE
    try:
        await core.create_namespace(ns)
    except ApiException as exc:
        if exc.status != 409:  # exists from an earlier run: fine
            raise

    sa = manifest("serviceaccount.yaml")
    assert sa["kind"] == "ServiceAccount"
    sa_name = f"{sa['metadata']['name']}-{suffix}"
    sa["metadata"] |= {"name": sa_name, "namespace": NAMESPACE}

    role = manifest("clusterrole.yaml")
    assert role["kind"] == "ClusterRole"
    role_name = f"{role['metadata']['name']}-test-{suffix}"
    role["metadata"]["name"] = role_name

    binding = manifest("clusterrolebinding.yaml")
    assert binding["kind"] == "ClusterRoleBinding"
    assert binding["roleRef"]["name"] == manifest("clusterrole.yaml")["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount"
    binding_name = f"{binding['metadata']['name']}-test-{suffix}"
    binding["metadata"]["name"] = binding_name
    binding["roleRef"]["name"] = role_name
    subject |= {"name": sa_name, "namespace": NAMESPACE}

    # The namespace may still be reaching the admission plugin's cache: retry 404/403.
    await _retry(lambda: core.create_namespaced_service_account(NAMESPACE, sa), on=(403, 404))
    try:
        await rbac.create_cluster_role(role)
        await rbac.create_cluster_role_binding(binding)
        tr = await core.create_namespaced_service_account_token(
            sa_name,
            NAMESPACE,
            client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
            ),
        )
        ident = Identity(
            namespace=NAMESPACE,
            service_account=sa_name,
            role=role_name,
            binding=binding_name,
            token=tr.status.token,
            server=devstack.apiserver,
            ca_file=str(Path(devstack.run_dir) / "pki" / "ca.crt"),
        )
        # RBAC changes reach the authorizer asynchronously: wait until the role applies.
        async with ident.client() as kc:
            for _ in range(100):
                try:
                    await kc.list_reservations(limit=1)
                    break
                except ForbiddenError:
                    await asyncio.sleep(0.1)
            else:
                pytest.fail("the ClusterRoleBinding never took effect")
        yield ident
    finally:
        for delete, name in (
            (rbac.delete_cluster_role_binding, binding_name),
            (rbac.delete_cluster_role, role_name),
        ):
            try:
                await delete(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        await core.delete_namespaced_service_account(sa_name, NAMESPACE)


def knowledge() -> dict[str, Any]:
    return f.knowledge(
        [f.flavor_group(GROUP, [f.flavor("m1.large", 4096, 2), f.flavor("m1.xlarge", 8192, 4)])]
    )


async def seed_world(api: Any) -> None:
    objs = [
        knowledge(),
        f.committed_resource("rbac-cr", project=PROJECT, group=GROUP, amount="64Gi"),
        f.hypervisor(HOST),
        f.hypervisor(OTHER),
        f.reservation("rbac-slot", host=HOST, project=PROJECT, group=GROUP, memory="16Gi"),
    ]
    await asyncio.gather(*(f.create(api, o) for o in objs))


def recorder(state: Any, counters: tuple[Any, Any]) -> Recorder:
    placement, no_host_found = counters
    return Recorder(state, placement, no_host_found, clock=lambda: NOW)


async def place(rec: Recorder, instance: str) -> Any:
    request = nova.parse_request(
        nova.request(instance, project_id=PROJECT, flavor_name="m1.large", hosts=[HOST])
    )
    return await rec.record_placement(nova.decision(HOST, [HOST]), request)


async def no_host(rec: Recorder, instance: str) -> Any:
    request = nova.parse_request(
        nova.request(instance, project_id=PROJECT, flavor_name="m1.large", hosts=[HOST, OTHER])
    )
    return await rec.record_no_host_found(nova.decision(None, []), request)


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels.values()): s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name == name
    }


async def allocations(api: Any) -> dict[str, Any]:
    obj = await f.get(api, "reservations", "rbac-slot")
    crr = obj["spec"]["committedResourceReservation"]
    result: dict[str, Any] = crr.get("allocations") or {}
    return result


async def test_service_identity_runs_the_full_scenario(identity: Identity, clean_k8s: Any) -> None:
    await seed_world(clean_k8s)
    registry = CollectorRegistry()
    counter_registry = CollectorRegistry()
    counters = (
        new_placement_counter(counter_registry),
        new_no_host_found_counter(counter_registry),
    )
    async with identity.client(registry) as kc:
        # List mode: per-request reads, a guarded patch.
        rec = recorder(ListClusterState(kc), counters)
        out = await place(rec, UUID_LIST)
        assert (out.cr_slot, out.allocation, out.reservation) == (
            "slot_used",
            AllocationStatus.WRITTEN,
            "rbac-slot",
        )
        nhf = await no_host(rec, "aaaaaaaa-0000-4000-8000-0000000000f1")
        assert nhf.cr_slot == "slot_blocked"

        # Watch mode: the informers LIST and WATCH all four kinds with the same identity.
        cache = WatchClusterState(kc)
        await cache.start()
        try:
            assert await cache.wait_synced(timeout=15)
            assert cache.ready()[0], cache.ready()
            wrec = recorder(cache, counters)
            out = await place(wrec, UUID_WATCH)
            assert (out.cr_slot, out.allocation, out.reservation) == (
                "slot_used",
                AllocationStatus.WRITTEN,
                "rbac-slot",
            )
            again = await place(wrec, UUID_LIST)  # replay of the list-mode placement
            assert again.allocation is AllocationStatus.ALREADY_PRESENT
            nhf = await no_host(wrec, "aaaaaaaa-0000-4000-8000-0000000000f2")
            assert nhf.cr_slot == "slot_blocked"
        finally:
            await cache.stop()

    stored = await allocations(clean_k8s)
    assert set(stored) == {UUID_LIST, UUID_WATCH}
    assert stored[UUID_WATCH]["resources"] == {"memory": "4Gi", "cpu": "2"}

    requests = samples(registry, "crs_k8s_requests_total")  # (verb, kind, code) -> n
    assert not [k for k, n in requests.items() if k[2] in {"401", "403"} and n], requests
    for plural in ("hypervisors", "reservations", "committedresources", "knowledges"):
        assert requests.get(("list", plural, "200"), 0) >= 1, (plural, requests)
    assert requests.get(("patch", "reservations", "200"), 0) == 2
    placements = samples(counter_registry, "cortex_nova_placement_total")
    assert placements == {(GROUP, "Unknown", "slot_used"): 3.0}
    assert samples(counter_registry, "cortex_nova_no_host_found_total") == {
        ("slot_blocked", GROUP, "Unknown"): 2.0
    }


# --- everything beyond the role ------------------------------------------------------------

Call = Callable[[Any], Awaitable[Any]]


def _co(api: Any) -> Any:
    return client.CustomObjectsApi(api)


def _core(api: Any) -> Any:
    return client.CoreV1Api(api)


def _new_reservation() -> dict[str, Any]:
    body = f.reservation("rbac-intruder", host=HOST)
    body.pop("status")
    return body


DENIED: dict[str, Call] = {
    "delete reservation": lambda api: _co(api).delete_cluster_custom_object(*f.RES, "rbac-slot"),
    "delete all reservations": lambda api: _co(api).delete_collection_cluster_custom_object(*f.RES),
    "create reservation": lambda api: _co(api).create_cluster_custom_object(
        *f.RES, _new_reservation()
    ),
    "patch hypervisor": lambda api: _co(api).patch_cluster_custom_object(
        *f.HV, HOST, {"metadata": {"labels": {"x": "y"}}}, _content_type=MERGE
    ),
    "patch committed resource": lambda api: _co(api).patch_cluster_custom_object(
        *f.CR, "rbac-cr", {"spec": {"amount": "1Ti"}}, _content_type=MERGE
    ),
    "patch reservation status": lambda api: _co(api).patch_cluster_custom_object_status(
        *f.RES, "rbac-slot", {"status": {"host": "elsewhere"}}, _content_type=MERGE
    ),
    "replace reservation status": lambda api: _replace_status(api),
    "read secret": lambda api: _core(api).read_namespaced_secret("any", NAMESPACE),
    "list secrets": lambda api: _core(api).list_secret_for_all_namespaces(),
    "list configmaps": lambda api: _core(api).list_namespaced_config_map(NAMESPACE),
    "list configmaps cluster-wide": lambda api: _core(api).list_config_map_for_all_namespaces(),
    "grant itself cluster-admin": lambda api: client.RbacAuthorizationV1Api(
        api
    ).create_cluster_role_binding(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "rbac-test-escalation"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin",
            },
            "subjects": [{"kind": "User", "name": "nobody"}],
        }
    ),
}


async def _replace_status(api: Any) -> Any:
    # A full object as the service could read it (it may GET reservations): only the
    # write of the status subresource is refused.
    current = await _co(api).get_cluster_custom_object(*f.RES, "rbac-slot")
    current["status"]["host"] = "elsewhere"
    return await _co(api).replace_cluster_custom_object_status(*f.RES, "rbac-slot", current)


@pytest.mark.parametrize("action", list(DENIED))
async def test_anything_beyond_the_role_is_forbidden(
    identity: Identity, clean_k8s: Any, action: str
) -> None:
    await seed_world(clean_k8s)
    before = {
        plural: (await f.get(clean_k8s, plural, name))["metadata"]["resourceVersion"]
        for plural, name in (
            ("reservations", "rbac-slot"),
            ("hypervisors", HOST),
            ("committedresources", "rbac-cr"),
        )
    }
    async with identity.client() as kc:
        with pytest.raises(ApiException) as exc:
            await DENIED[action](kc.api_client)
    assert exc.value.status == 403, exc.value
    # Refused by RBAC for this very identity (not by a missing object or a bad token).
    assert identity.username in exc.value.body
    assert "forbidden" in exc.value.body
    after = {
        plural: (await f.get(clean_k8s, plural, name))["metadata"]["resourceVersion"]
        for plural, name in (
            ("reservations", "rbac-slot"),
            ("hypervisors", HOST),
            ("committedresources", "rbac-cr"),
        )
    }
    assert after == before  # nothing changed
    co = client.CustomObjectsApi(clean_k8s)
    listed = await co.list_cluster_custom_object(*f.RES)
    assert [r["metadata"]["name"] for r in listed["items"]] == ["rbac-slot"]
