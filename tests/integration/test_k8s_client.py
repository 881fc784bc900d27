"""KubeClient against the real kube-apiserver: paging, decoding, errors, auth, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from service.crs.ports import (
    API_REQUEST_HOOK,
    ConflictError,
    ForbiddenError,
    InvalidError,
    NotFoundError,
    UnavailableError,
)
from service.k8s import (
    COMMITTED_RESOURCES,
    RESERVATIONS,
    K8sMetrics,
    KubeClient,
    ListClusterState,
)
from service.k8s.client import CALLS, FENCE_ANNOTATION, ResourceKind, WatchEvent
from service.k8s.errors import ResourceExpiredError
from service.k8s.transport import Transport
from service.model import CommittedResource, Reservation
from tests import factories as f
from tests.conftest import REPO, DevStack

MERGE = "application/merge-patch+json"


@pytest_asyncio.fixture
async def kube(clean_k8s: Any, devstack: DevStack) -> AsyncIterator[tuple[KubeClient, Any]]:
    registry = CollectorRegistry()
    async with await KubeClient.create(devstack.kubeconfig, metrics=K8sMetrics(registry)) as kc:
        yield kc, registry


def requests(registry: CollectorRegistry, verb: str, kind: str, code: str) -> float:
    value = registry.get_sample_value(
        "crs_k8s_requests_total", {"verb": verb, "kind": kind, "code": code}
    )
    return value or 0.0


async def stored_reservation(kc: KubeClient, api: Any) -> Reservation:
    """Reservation ``r-1`` created in the API server and read back (resourceVersion set)."""
    await f.create(api, f.reservation("r-1", host="h"))
    read = await kc.get_reservation("r-1")
    assert read is not None
    return read


def ca_file(devstack: DevStack) -> str:
    return str(devstack.run_dir / "pki" / "ca.crt")


async def test_paging_returns_every_object(kube: tuple[KubeClient, Any], clean_k8s: Any) -> None:
    kc, registry = kube
    co = client.CustomObjectsApi(clean_k8s)
    objs = [f.reservation(f"r-{i:02d}", host=f"h-{i % 3}") for i in range(23)]
    objs += [f.reservation(f"fo-{i}", host="h-0", label="failover") for i in range(4)]
    for o in objs:
        o.pop("status")
    await asyncio.gather(*(co.create_cluster_custom_object(*f.RES, o) for o in objs))

    got = await kc.list_reservations(limit=5)

    assert sorted(r.name for r in got) == [f"r-{i:02d}" for i in range(23)]
    assert requests(registry, "list", "reservations", "200") == 5  # ceil(23 / 5) pages
    everything = await kc.list_objects(RESERVATIONS, Reservation, limit=4)
    assert len(everything.items) == 27
    assert everything.resource_version


async def test_list_decodes_typed_objects(kube: tuple[KubeClient, Any], clean_k8s: Any) -> None:
    kc, _ = kube
    await asyncio.gather(
        f.create(clean_k8s, f.hypervisor("hv-1", memory="1Ti", allocated="300Gi")),
        f.create(clean_k8s, f.committed_resource("cr-1", amount="1280Gi", used="640Mi")),
        f.create(
            clean_k8s,
            f.reservation("r-1", host="hv-1", allocations={"vm-1": f.allocation("4Gi")}),
        ),
        f.create(clean_k8s, f.knowledge([f.flavor_group("g1", [f.flavor("m1", 2048, 1)])])),
    )
    (hv,) = await kc.list_hypervisors()
    assert hv.status.capacity is not None
    assert hv.status.capacity["memory"].value() == 1 << 40
    (cr,) = await kc.list_committed_resources()
    assert (cr.spec.project_id, cr.spec.state, str(cr.spec.amount)) == ("p1", "confirmed", "1280Gi")
    res = await kc.get_reservation("r-1")
    assert res is not None
    assert res.metadata.resource_version
    crr = res.spec.committed_resource_reservation
    assert crr is not None
    assert crr.allocations is not None
    assert "vm-1" in crr.allocations
    kn = await kc.get_knowledge()
    assert kn is not None
    assert kn.status.raw["features"][0]["name"] == "g1"


async def test_undecodable_list_item_is_skipped_not_fatal(kube: tuple[KubeClient, Any]) -> None:
    # The dev-stack schemas already reject a malformed quantity (422), so a bad object
    # cannot be stored here; a cluster with looser CRDs could hold one. Decode a list
    # body as the server would send it, with one such item among good ones.
    kc, _ = kube
    good = f.committed_resource("good")
    bad = f.committed_resource("bad")
    bad["spec"]["amount"] = "12 apples"
    body = json.dumps(
        {
            "kind": "CommittedResourceList",
            "metadata": {"resourceVersion": "7"},
            "items": [good, bad],
        }
    ).encode()
    skipped: list[tuple[str, str]] = []
    page = kc._decode_list(body, CommittedResource, COMMITTED_RESOURCES, skipped)
    assert [c.metadata.name for c in page.items or ()] == ["good"]
    assert page.metadata.resourceVersion == "7"
    # Named with where it failed (the invariant monitor counts such Reservations).
    assert skipped == [("bad", "$.spec.amount")]


async def test_watch_streams_typed_events_and_closes_on_exit(
    kube: tuple[KubeClient, Any], clean_k8s: Any
) -> None:
    kc, registry = kube
    co = client.CustomObjectsApi(clean_k8s)
    start = (await kc.list_objects(RESERVATIONS, Reservation)).resource_version
    seen: list[WatchEvent[Reservation]] = []
    async with kc.watch(RESERVATIONS, Reservation, resource_version=start, timeout_s=30) as events:
        # Counted once, when the headers arrived; the stream's lifetime is no latency.
        assert requests(registry, "watch", "reservations", "200") == 1
        await f.create(clean_k8s, f.reservation("w-1", host="h-1"))
        await co.patch_cluster_custom_object(
            *f.RES, "w-1", {"spec": {"targetHost": "h-2"}}, _content_type=MERGE
        )
        await co.delete_cluster_custom_object(*f.RES, "w-1")
        async with asyncio.timeout(15):
            async for event in events:
                if event.type != "BOOKMARK":
                    seen.append(event)
                if event.type == "DELETED":
                    break
    assert [e async for e in events] == []  # leaving the block closed the stream
    # Creating sets the status too (a second write), so there may be more MODIFIEDs.
    types = [e.type for e in seen]
    assert types[0] == "ADDED"
    assert types[-1] == "DELETED"
    assert set(types[1:-1]) == {"MODIFIED"}
    assert {e.name for e in seen} == {"w-1"}
    objects = [e.object for e in seen]
    assert all(o is not None for o in objects)
    last_modified = objects[-2]
    assert last_modified is not None
    assert last_modified.spec.target_host == "h-2"
    assert [e.resource_version for e in seen] == [
        o.metadata.resource_version for o in objects if o is not None
    ]


async def test_watch_from_an_expired_resource_version_raises_resource_expired(
    kube: tuple[KubeClient, Any],
) -> None:
    kc, _ = kube

    async def watch_from_1() -> None:
        async with kc.watch(RESERVATIONS, Reservation, resource_version="1", timeout_s=30) as ev:
            async with asyncio.timeout(15):
                async for _ in ev:
                    pass

    with pytest.raises(ResourceExpiredError) as exc:
        await watch_from_1()
    assert exc.value.status == 410
    assert exc.value.kind == "reservations"


async def test_undecodable_watch_object_counts_as_absent(kube: tuple[KubeClient, Any]) -> None:
    # As for a list (see above): the schemas reject such an object, so decode a line
    # as the server would send it.
    kc, _ = kube
    bad = f.committed_resource("bad")
    bad["spec"]["amount"] = "12 apples"
    bad["metadata"]["resourceVersion"] = "42"
    line = json.dumps({"type": "MODIFIED", "object": bad}).encode()
    stream = kc.watch(COMMITTED_RESOURCES, CommittedResource)
    assert stream._decode(line) == WatchEvent("MODIFIED", "bad", "42", None, "$.spec.amount")
    deleted = json.dumps({"type": "DELETED", "object": bad}).encode()
    assert stream._decode(deleted) == WatchEvent("DELETED", "bad", "42", None)
    with pytest.raises(UnavailableError, match="undecodable line"):
        stream._decode(line[:20])


async def test_get_missing_is_none_or_not_found(kube: tuple[KubeClient, Any]) -> None:
    kc, registry = kube
    assert await kc.get_reservation("missing") is None
    assert await kc.get_knowledge() is None
    with pytest.raises(NotFoundError) as exc:
        await kc.get_object(RESERVATIONS, "missing", Reservation)
    assert exc.value.status == 404
    assert exc.value.kind == "reservations"
    assert requests(registry, "get", "reservations", "404") == 2
    assert requests(registry, "get", "knowledges", "404") == 1


async def test_a_list_of_a_kind_not_served_is_unavailable_not_not_found(
    kube: tuple[KubeClient, Any],
) -> None:
    # A collection is never "absent": a 404 means its CRD is not installed (yet) or not
    # registered again after an API server restart. Waiting can fix that; dead-lettering
    # the event as k8s_error (what a NotFoundError leads to in list mode) cannot.
    kc, registry = kube
    kind = ResourceKind("cortex.cloud", "v1alpha1", "notservedyets")
    with pytest.raises(UnavailableError) as exc:
        await kc.list_objects(kind, Reservation)
    assert not isinstance(exc.value, NotFoundError)
    assert exc.value.retryable
    assert exc.value.status == 404
    assert requests(registry, "list", "notservedyets", "404") == 1


async def test_an_object_of_a_kind_not_served_is_unavailable_not_deleted(
    kube: tuple[KubeClient, Any], clean_k8s: Any
) -> None:
    # A GET or PATCH of one object answered 404 because its *kind* is not served (an API
    # server registering its CRDs after a restart, a version no longer served) meant
    # "this slot was deleted": a placement ended no_slot, a final outcome, instead of
    # being retried (found by review). The API server's Status names the object when the
    # object is what is missing; here it names nothing.
    kc, registry = kube
    read = await stored_reservation(kc, clean_k8s)
    unserved = ResourceKind("cortex.cloud", "v9notserved", "reservations")
    with pytest.raises(UnavailableError) as exc:
        await kc.get_object(unserved, "r-1", Reservation)
    assert not isinstance(exc.value, NotFoundError)
    assert exc.value.retryable
    assert exc.value.status == 404
    # The same for the guarded write, through the kind the client writes to.
    served_path = f"/{RESERVATIONS.version}/"
    monkey = kc._http.open

    async def open_unserved(method: str, path: str, **kw: Any) -> Any:
        return await monkey(method, path.replace(served_path, f"/{unserved.version}/"), **kw)

    kc._http.open = open_unserved  # type: ignore[method-assign]
    alloc: dict[str, object] = {"creationTimestamp": "2026-01-01T00:00:00Z", "resources": {}}
    with pytest.raises(UnavailableError) as exc:
        await kc.patch_allocation(read, "vm-1", alloc)
    assert not isinstance(exc.value, NotFoundError)
    assert requests(registry, "patch", "reservations", "404") == 1


async def test_patch_allocation_is_guarded_by_resource_version(
    kube: tuple[KubeClient, Any], clean_k8s: Any
) -> None:
    kc, registry = kube
    read = await stored_reservation(kc, clean_k8s)
    alloc: dict[str, object] = {
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "resources": {"memory": "4Gi", "cpu": "2"},
    }
    written = await kc.patch_allocation(read, "vm-1", alloc)
    crr = written.spec.committed_resource_reservation
    assert crr is not None
    assert crr.allocations is not None
    assert str(crr.allocations["vm-1"].resources["memory"]) == "4Gi"
    assert written.metadata.resource_version != read.metadata.resource_version

    with pytest.raises(ConflictError) as exc:  # ``read`` is stale now
        await kc.patch_allocation(read, "vm-2", alloc)
    assert exc.value.status == 409
    stored = await kc.get_reservation("r-1")
    assert stored is not None
    assert stored.spec.committed_resource_reservation is not None
    assert set(stored.spec.committed_resource_reservation.allocations or {}) == {"vm-1"}

    await client.CustomObjectsApi(clean_k8s).delete_cluster_custom_object(*f.RES, "r-1")
    with pytest.raises(NotFoundError):
        await kc.patch_allocation(stored, "vm-3", alloc)
    assert requests(registry, "patch", "reservations", "200") == 1
    assert requests(registry, "patch", "reservations", "409") == 1
    assert requests(registry, "patch", "reservations", "404") == 1


@pytest.mark.parametrize("max_writes", [2, 0])
async def test_max_writes_bounds_the_writes_in_flight(
    devstack: DevStack, clean_k8s: Any, monkeypatch: pytest.MonkeyPatch, max_writes: int
) -> None:
    """CRS_K8S_MAX_WRITES: eight concurrent guarded writes to eight slots of the real API
    server all land, at most ``max_writes`` of them in flight at once (0: no limit, and
    then more than two are); the API request hook is called as each one leaves."""
    in_flight = peak = 0
    real_open = Transport.open

    async def counted(self: Transport, method: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight, peak
        if method != "PATCH":
            return await real_open(self, method, *args, **kwargs)
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.05)  # long enough for every write to have been started
            return await real_open(self, method, *args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(Transport, "open", counted)
    names = [f"r-{i}" for i in range(8)]
    for name in names:
        await f.create(clean_k8s, f.reservation(name, host="h"))
    alloc: dict[str, object] = {"creationTimestamp": "2026-01-01T00:00:00Z", "resources": {}}
    async with await KubeClient.create(devstack.kubeconfig, max_writes=max_writes) as kc:
        slots = [await kc.get_reservation(name) for name in names]
        # The engine's hook is told when a write leaves, not while it waits for a slot.
        hooked: list[int] = []
        token = API_REQUEST_HOOK.set(lambda: hooked.append(in_flight))
        try:
            written = await asyncio.gather(
                *(
                    kc.patch_allocation(slot, f"vm-{i}", alloc)
                    for i, slot in enumerate(slots)
                    if slot
                )
            )
        finally:
            API_REQUEST_HOOK.reset(token)
        assert len(hooked) == len(names)
        assert sorted(w.name for w in written) == names
        for i, name in enumerate(names):
            stored = await kc.get_reservation(name)
            assert stored is not None
            assert stored.spec.committed_resource_reservation is not None
            assert set(stored.spec.committed_resource_reservation.allocations or {}) == {f"vm-{i}"}
    if max_writes:
        assert peak == max_writes
        assert max(hooked) < max_writes
    else:
        assert peak > 2


async def test_a_fence_outdates_every_write_guarded_by_an_older_version(
    kube: tuple[KubeClient, Any], clean_k8s: Any
) -> None:
    # What a takeover relies on: once the new owner fenced a slot, the previous owner's
    # write decided on the version before it fails its guard, however late it arrives;
    # the fence itself is guarded, and changes nothing of the slot but its version.
    kc, registry = kube
    read = await stored_reservation(kc, clean_k8s)
    fenced = await kc.fence_reservation(read)
    assert fenced.metadata.resource_version != read.metadata.resource_version
    assert fenced.spec == read.spec
    raw = await f.get(clean_k8s, "reservations", "r-1")
    assert set(raw["metadata"]["annotations"]) == {FENCE_ANNOTATION}
    again = await kc.fence_reservation(fenced)  # a second fence still changes the version
    assert again.metadata.resource_version != fenced.metadata.resource_version
    alloc: dict[str, object] = {"creationTimestamp": "2026-01-01T00:00:00Z"}
    with pytest.raises(ConflictError):
        await kc.patch_allocation(read, "vm-late", alloc)
    with pytest.raises(ConflictError):
        await kc.fence_reservation(fenced)  # guarded too
    stored = await kc.get_reservation("r-1")
    assert stored is not None
    assert stored.spec == read.spec
    assert requests(registry, "patch", "reservations", "200") == 2
    assert requests(registry, "patch", "reservations", "409") == 2


async def test_invalid_patch_is_invalid_error(kube: tuple[KubeClient, Any], clean_k8s: Any) -> None:
    kc, _ = kube
    read = await stored_reservation(kc, clean_k8s)
    with pytest.raises(InvalidError) as exc:
        await kc.patch_allocation(read, "vm-1", {"creationTimestamp": "not a time"})
    assert exc.value.status == 422
    assert not exc.value.retryable


# --- authentication and authorisation -----------------------------------------------------


async def test_token_without_rbac_is_forbidden(
    devstack: DevStack, service_account: tuple[str, str]
) -> None:
    _, token = service_account
    registry = CollectorRegistry()
    async with KubeClient.from_token(
        devstack.apiserver, ca_file(devstack), token, metrics=K8sMetrics(registry)
    ) as kc:
        with pytest.raises(ForbiddenError) as exc:
            await kc.list_reservations()
        assert exc.value.status == 403
        assert not exc.value.retryable
        with pytest.raises(ForbiddenError):
            await kc.get_knowledge()
    assert requests(registry, "list", "reservations", "403") == 1


async def test_refusal_series_exist_at_zero_before_the_first_call(
    kube: tuple[KubeClient, Any],
    clean_k8s: Any,
    devstack: DevStack,
    service_account: tuple[str, str],
) -> None:
    """A refusal's series must exist before the first refusal: CrsKubernetesForbidden
    takes increase() over it, and a series that appears with a burst of 403s already at
    its final value shows no increase. Here the very first PATCH of a client whose
    account may not patch (no RBAC at all; a Role without ``patch`` is refused alike): at 0
    in the registry before, 1 after."""
    admin, _ = kube
    read = await stored_reservation(admin, clean_k8s)
    _, token = service_account  # an account without any RBAC
    registry = CollectorRegistry()
    patch_403 = {"verb": "patch", "kind": "reservations", "code": "403"}
    async with KubeClient.from_token(
        devstack.apiserver, ca_file(devstack), token, metrics=K8sMetrics(registry)
    ) as kc:
        for verb, kind in CALLS:
            for code in ("401", "403"):
                labels = {"verb": verb, "kind": kind, "code": code}
                assert registry.get_sample_value("crs_k8s_requests_total", labels) == 0.0
        with pytest.raises(ForbiddenError):
            await kc.patch_allocation(read, "vm-1", {"resources": {"memory": "4Gi"}})
    assert registry.get_sample_value("crs_k8s_requests_total", patch_403) == 1.0
    # Only the calls the service makes (its ClusterRole): no series for others.
    other = {"verb": "patch", "kind": "hypervisors", "code": "403"}
    assert registry.get_sample_value("crs_k8s_requests_total", other) is None


async def test_bad_token_is_forbidden_401(devstack: DevStack) -> None:
    async with KubeClient.from_token(devstack.apiserver, ca_file(devstack), "garbage") as kc:
        with pytest.raises(ForbiddenError) as exc:
            await kc.list_hypervisors()
    assert exc.value.status == 401


async def test_every_request_calls_the_api_request_hook_first(
    kube: tuple[KubeClient, Any], clean_k8s: Any
) -> None:
    """The engine opens a partition's next transaction when a decision sends a request
    to the API server (service.crs.ports.API_REQUEST_HOOK): the client calls the hook
    before each request, a read and the guarded write alike, and nothing when unset."""
    kc, _ = kube
    read = await stored_reservation(kc, clean_k8s)  # outside the hook: not counted
    calls: list[str] = []
    token = API_REQUEST_HOOK.set(lambda: calls.append("request"))
    try:
        await kc.get_knowledge()
        alloc: dict[str, object] = {"creationTimestamp": "2026-01-01T00:00:00Z", "resources": {}}
        await kc.patch_allocation(read, "vm-1", alloc)
    finally:
        API_REQUEST_HOOK.reset(token)
    assert calls == ["request", "request"]


async def test_a_token_the_refresh_hook_replaces_is_sent_from_the_next_request(
    devstack: DevStack, service_account: tuple[str, str]
) -> None:
    """In-cluster, the service-account token rotates and kubernetes_asyncio's refresh
    hook re-reads it (a kubeconfig's exec plugin alike): the client sends its requests
    itself, so it must ask the configuration for the credentials on every request, not
    once. Here the hook swaps an unknown token (401) for a known account's (403: known,
    without RBAC)."""
    _, token = service_account
    async with KubeClient.from_token(devstack.apiserver, ca_file(devstack), "garbage") as kc:
        with pytest.raises(ForbiddenError) as exc:
            await kc.get_knowledge()
        assert exc.value.status == 401

        def rotate(cfg: Any) -> None:
            cfg.api_key["BearerToken"] = token

        kc.api_client.configuration.refresh_api_key_hook = rotate
        with pytest.raises(ForbiddenError) as exc:
            await kc.get_knowledge()
        assert exc.value.status == 403


async def test_deploy_clusterrole_grants_exactly_what_the_service_uses(
    devstack: DevStack, kube_api: Any, clean_k8s: Any, service_account: tuple[str, str]
) -> None:
    """The production ClusterRole (deploy/clusterrole.yaml) is enough for every call."""
    sa, token = service_account
    role = yaml.safe_load((REPO / "deploy" / "clusterrole.yaml").read_text())
    role = copy.deepcopy(role)
    role["metadata"] = {"name": f"{sa}-role"}
    rbac = client.RbacAuthorizationV1Api(kube_api)
    await rbac.create_cluster_role(role)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": f"{sa}-binding"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{sa}-role",
        },
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": "default"}],
    }
    await rbac.create_cluster_role_binding(binding)
    try:
        await f.create(clean_k8s, f.reservation("r-1", host="h"))
        async with KubeClient.from_token(devstack.apiserver, ca_file(devstack), token) as kc:
            state = ListClusterState(kc)
            for _ in range(50):  # RBAC changes reach the authorizer asynchronously
                try:
                    await state.snapshot(["h"], "p1")
                    break
                except ForbiddenError:
                    await asyncio.sleep(0.1)
            snap = await state.snapshot(["h"], "p1")
            assert snap.knowledge is None
            (res,) = await state.reservations_on_host("h")
            await state.patch_allocation(
                res,
                "vm-1",
                {"creationTimestamp": "2026-01-01T00:00:00Z", "resources": {"memory": "1Gi"}},
            )
    finally:
        await rbac.delete_cluster_role_binding(f"{sa}-binding")
        await rbac.delete_cluster_role(f"{sa}-role")


# --- unavailability -------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_refused_connection_is_unavailable(devstack: DevStack) -> None:
    registry = CollectorRegistry()
    server = f"https://127.0.0.1:{_closed_port()}"
    async with KubeClient.from_token(
        server, ca_file(devstack), "x", request_timeout_s=2.0, metrics=K8sMetrics(registry)
    ) as kc:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as exc:
            await kc.list_reservations()
        assert time.monotonic() - started < 2.5
    assert exc.value.retryable
    assert requests(registry, "list", "reservations", "error") == 1


async def test_unresponsive_server_times_out_as_unavailable(devstack: DevStack) -> None:
    """A server that accepts connections and then says nothing: bounded by the timeout."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        async with KubeClient.from_token(
            f"https://127.0.0.1:{port}", ca_file(devstack), "x", request_timeout_s=0.5
        ) as kc:
            started = time.monotonic()
            with pytest.raises(UnavailableError):
                await kc.get_reservation("r-1")
            with pytest.raises(UnavailableError):
                await kc.list_committed_resources()
            assert time.monotonic() - started < 2.0
    finally:
        for w in held:
            w.close()
        srv.close()
        with contextlib.suppress(Exception):
            await srv.wait_closed()


async def test_create_uses_kubeconfig_env(
    devstack: DevStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", devstack.kubeconfig)
    async with await KubeClient.create() as kc:
        assert await kc.get_reservation("does-not-exist") is None


async def test_create_without_kubeconfig_tries_in_cluster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    from kubernetes_asyncio.config import ConfigException

    with pytest.raises(ConfigException):
        await KubeClient.create()


async def test_requests_do_not_consult_proxy_variables_or_netrc(
    kube: tuple[KubeClient, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp with trust_env parses ~/.netrc and the proxy variables on every request
    (a fifth of the CPU at 100 PATCHes/s); the client turns that off."""
    import aiohttp.client

    calls = 0
    original = aiohttp.client.get_env_proxy_for_url

    def counting(url: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(url)

    monkeypatch.setattr(aiohttp.client, "get_env_proxy_for_url", counting)
    kc, _ = kube
    await kc.get_knowledge()
    assert calls == 0
