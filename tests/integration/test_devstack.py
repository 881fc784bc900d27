"""Acceptance of the dev stack: real Kafka transactions and real API-server semantics."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from tests.conftest import REPO, DevStack

GROUP, VERSION, PLURAL = "cortex.cloud", "v1alpha1", "reservations"
MERGE = "application/merge-patch+json"


def reservation(
    name: str, *, rtype: str = "CommittedResourceReservation", label: str = "committed-resource"
) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Reservation",
        "metadata": {"name": name, "labels": {"reservations.cortex.cloud/type": label}},
        "spec": {
            "type": rtype,
            "targetHost": "host-a",
            "resources": {"memory": "8Gi", "cpu": "4"},
            "committedResourceReservation": {"projectID": "p1", "resourceGroup": "g1"},
        },
    }


async def test_transactions_read_committed_sees_only_committed(
    devstack: DevStack, new_topic: Any
) -> None:
    topic = await new_topic("txn")
    producer = AIOKafkaProducer(
        bootstrap_servers=devstack.kafka_bootstrap, transactional_id=f"tx-{uuid.uuid4().hex}"
    )
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, b"committed-1")
            await producer.send_and_wait(topic, b"committed-2")
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"aborted")
        await producer.abort_transaction()
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        bootstrap_servers=devstack.kafka_bootstrap,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        seen: list[bytes] = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            seen.extend(m.value for m in batch.get(tp, []))
    finally:
        await consumer.stop()
    assert seen == [b"committed-1", b"committed-2"]


async def test_guarded_merge_patch_conflicts_on_stale_resource_version(clean_k8s: Any) -> None:
    co = client.CustomObjectsApi(clean_k8s)
    created = await co.create_cluster_custom_object(GROUP, VERSION, PLURAL, reservation("rv-test"))
    stale = created["metadata"]["resourceVersion"]
    changed = await co.patch_cluster_custom_object(
        GROUP,
        VERSION,
        PLURAL,
        "rv-test",
        {"metadata": {"labels": {"touched": "yes"}}},
        _content_type=MERGE,
    )
    current = changed["metadata"]["resourceVersion"]
    assert current != stale

    def guarded(rv: str) -> dict[str, Any]:
        return {
            "metadata": {"resourceVersion": rv},
            "spec": {
                "committedResourceReservation": {
                    "allocations": {
                        "vm-1": {
                            "creationTimestamp": "2026-01-01T00:00:00Z",
                            "resources": {"memory": "4Gi", "cpu": "2"},
                        }
                    }
                }
            },
        }

    with pytest.raises(ApiException) as exc:
        await co.patch_cluster_custom_object(
            GROUP, VERSION, PLURAL, "rv-test", guarded(stale), _content_type=MERGE
        )
    assert exc.value.status == 409

    ok = await co.patch_cluster_custom_object(
        GROUP, VERSION, PLURAL, "rv-test", guarded(current), _content_type=MERGE
    )
    assert (
        ok["spec"]["committedResourceReservation"]["allocations"]["vm-1"]["resources"]["memory"]
        == "4Gi"
    )
    assert ok["metadata"]["resourceVersion"] != current


async def test_schema_validation_rejects_type_outside_enum(clean_k8s: Any) -> None:
    co = client.CustomObjectsApi(clean_k8s)
    with pytest.raises(ApiException) as exc:
        await co.create_cluster_custom_object(
            GROUP, VERSION, PLURAL, reservation("bad", rtype="Bogus")
        )
    assert exc.value.status == 422
    assert "spec.type" in exc.value.body


async def test_label_selector_filters_server_side(clean_k8s: Any) -> None:
    co = client.CustomObjectsApi(clean_k8s)
    await co.create_cluster_custom_object(GROUP, VERSION, PLURAL, reservation("cr-1"))
    await co.create_cluster_custom_object(GROUP, VERSION, PLURAL, reservation("cr-2"))
    await co.create_cluster_custom_object(
        GROUP,
        VERSION,
        PLURAL,
        reservation("failover-1", rtype="FailoverReservation", label="failover"),
    )
    listed = await co.list_cluster_custom_object(
        GROUP, VERSION, PLURAL, label_selector="reservations.cortex.cloud/type=committed-resource"
    )
    assert sorted(i["metadata"]["name"] for i in listed["items"]) == ["cr-1", "cr-2"]
    everything = await co.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    assert len(everything["items"]) == 3


def test_up_is_idempotent_and_status_reports_every_server(devstack: DevStack) -> None:
    again = subprocess.run(
        [str(REPO / "devstack" / "up")], capture_output=True, text=True, check=False, timeout=300
    )
    assert again.returncode == 0, again.stderr
    status = subprocess.run(
        [str(REPO / "devstack" / "status")], capture_output=True, text=True, check=False
    )
    assert status.returncode == 0, status.stdout
    for server in ("etcd", "kube-apiserver", "kafka"):
        assert any(
            line.startswith(server) and " up " in line for line in status.stdout.splitlines()
        ), status.stdout
    env = (devstack.run_dir / "env").read_text()
    assert f"KAFKA_BOOTSTRAP_SERVERS={devstack.kafka_bootstrap}" in env
    assert f"KUBECONFIG={devstack.kubeconfig}" in env
    assert Path(devstack.kubeconfig).is_absolute()


def test_missing_prerequisite_is_one_clear_line(tmp_path: Path) -> None:
    # A PATH with just enough to run the script, but no java: up must name java and how to
    # install it, in one line, instead of failing somewhere later with a stack trace.
    for tool in ("bash", "dirname"):
        found = shutil.which(tool)
        assert found is not None
        (tmp_path / tool).symlink_to(found)
    proc = subprocess.run(
        [str(tmp_path / "bash"), str(REPO / "devstack" / "up")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "missing prerequisite 'java'" in lines[0]
    assert "apt-get install" in lines[0]


def test_up_runs_again_with_its_own_env_sourced(devstack: DevStack) -> None:
    # `make demo` and users source run/env and may run up again from that shell: no
    # variable written there may change what up does.
    env = {**os.environ, **devstack.env}
    again = subprocess.run(
        [str(REPO / "devstack" / "up")], capture_output=True, text=True, check=False, env=env
    )
    assert again.returncode == 0, again.stderr
