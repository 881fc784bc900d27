"""Shared fixtures.

Integration tests (marked ``integration``: those using the ``devstack`` fixture, most of
tests/integration) talk to the real dev stack: an Apache Kafka broker and a kube-apiserver
with the CRDs installed, brought up once per session by ``devstack/up``. A dev stack that
cannot start fails the session loudly; it never turns into skipped tests.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from hypothesis import settings

from service.k8s import RESOURCE_KINDS

# No per-example deadline (Hypothesis' default is 200 ms): the properties are about
# results, and one garbage collection or preemption on a loaded CI machine is not a
# failure of them.
settings.register_profile("crs", deadline=None)
settings.load_profile("crs")

REPO = Path(__file__).resolve().parents[1]

# The four kinds the service reads, as (group, version, plural), from their one definition.
KINDS = {k.plural: (k.group, k.version, k.plural) for k in RESOURCE_KINDS.values()}


@dataclass(frozen=True)
class DevStack:
    kafka_bootstrap: str
    kubeconfig: str
    apiserver: str
    run_dir: Path
    env: dict[str, str]


# What a test needs, by the fixtures it uses (the markers are registered in pyproject.toml):
# ``integration`` the dev stack (its fixtures all start from ``devstack``), ``helm`` the
# chart tool (``helm_built``). ``promtool`` is set by the modules that run it. A test
# under tests/integration that renders a chart or reads a file needs neither stack nor
# marker, so ``pytest -m integration`` selects what talks to the stack and nothing else.
NEEDS = {"devstack": "integration", "helm_built": "helm"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in NEEDS.items():
            uses = fixture in getattr(item, "fixturenames", ())
            if uses:
                item.add_marker(marker)
            elif item.get_closest_marker(marker) is not None:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked {marker} but does not use the {fixture} fixture"
                )


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


@pytest.fixture(scope="session")
def devstack() -> DevStack:
    """Bring the dev stack up (idempotent) and describe where it is."""
    proc = subprocess.run(
        [str(REPO / "devstack" / "up")],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"devstack/up failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False
        )
    run_dir = Path(os.environ.get("CRS_DEVSTACK_RUN_DIR", REPO / "devstack" / "run"))
    env = read_env_file(run_dir / "env")
    return DevStack(
        kafka_bootstrap=env["KAFKA_BOOTSTRAP_SERVERS"],
        kubeconfig=env["KUBECONFIG"],
        apiserver=env["CRS_DEVSTACK_APISERVER"],
        run_dir=run_dir,
        env=env,
    )


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A Kafka topic name no other test uses."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"t-{base}-{uuid.uuid4().hex[:8]}"


@pytest_asyncio.fixture
async def new_topic(devstack: DevStack) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Factory: create a fresh topic with N partitions; deleted again after the test."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=devstack.kafka_bootstrap)
    await admin.start()
    created: list[str] = []

    async def make(prefix: str = "t", partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        await admin.create_topics([NewTopic(name, partitions, 1)])
        created.append(name)
        return name

    try:
        yield make
    finally:
        if created:
            try:
                await admin.delete_topics(created)
            finally:
                await admin.close()
        else:
            await admin.close()


@pytest_asyncio.fixture(scope="session")
async def kube_api(devstack: DevStack) -> AsyncIterator[object]:
    """An admin kubernetes_asyncio ApiClient for test setup and assertions."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=devstack.kubeconfig, client_configuration=cfg)
    api = client.ApiClient(configuration=cfg)
    try:
        yield api
        # Some modules share objects between their tests and never wipe them (the
        # flavor-groups Knowledge of test_watch_cache): the session leaves the cluster as
        # empty as it found it, so e.g. `make demo` afterwards finds no foreign objects.
        await delete_all_custom_objects(api)
    finally:
        await api.close()


async def delete_all_custom_objects(api: object) -> None:
    from kubernetes_asyncio import client

    co = client.CustomObjectsApi(api)
    for group, version, plural in KINDS.values():
        await co.delete_collection_cluster_custom_object(group, version, plural)


@pytest_asyncio.fixture
async def clean_k8s(kube_api: object) -> AsyncIterator[object]:
    """A cluster with none of the four kinds in it, before and after the test."""
    await delete_all_custom_objects(kube_api)
    try:
        yield kube_api
    finally:
        await delete_all_custom_objects(kube_api)


@pytest.fixture(scope="session")
def secure_kafka(devstack: DevStack) -> object:
    """The secured broker (SASL_SSL + mTLS + ACLs), started on first use; a
    ``tests.secure_kafka.SecureKafka``."""
    from tests.secure_kafka import SecureKafka

    proc = subprocess.run(
        [str(REPO / "devstack" / "up"), "--secure-kafka"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"devstack/up --secure-kafka failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    return SecureKafka(read_env_file(devstack.run_dir / "secure-kafka" / "env"))


@pytest_asyncio.fixture
async def service_account(kube_api: object) -> AsyncIterator[tuple[str, str]]:
    """A fresh ServiceAccount with no permissions, and a token for it."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(kube_api)
    name = f"crs-test-{uuid.uuid4().hex[:8]}"
    await core.create_namespaced_service_account(
        "default", client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
    )
    try:
        tr = await core.create_namespaced_service_account_token(
            name,
            "default",
            client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
            ),
        )
        yield name, tr.status.token
    finally:
        await core.delete_namespaced_service_account(name, "default")
