"""A Kafka credential rotated under load, on the secured broker.

The service runs as a real process (``python -m service run``) with its credential in a
Secret-like volume (tests.secret_volume: the kubelet's ``..data`` symlink swap): an mTLS
user's certificate, encrypted key and key password, or a SCRAM user's password. While
input records arrive steadily, the volume first gets content that does not load (which
must not disturb the running clients), then the new credential:

* mTLS: a new certificate from the dev CA, with another subject and serial. Once the
  service has rebuilt its clients, the old subject's ACLs are deleted: with
  ``allow.everyone.if.no.acl.found=false`` every later output proves the new
  certificate is the one in use.
* SASL: the user's password changed on the broker (as Strimzi's User Operator does),
  then in the volume; the old password opens no connection any more, so the rebuilt
  clients can only be using the new one.

Every input must come out exactly once (read_committed).

Names (topics, group, subjects) are fresh per run, and the ACLs and topics are deleted
afterwards, so a rerun or a concurrent test on the shared broker does not interfere.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from service.app.config import Config
from service.app.kafka_access import Acl, required_acls
from tests import e2e
from tests.conftest import REPO, DevStack
from tests.integration.test_kafka_security import finished, read_as_admin
from tests.secret_volume import SecretVolume
from tests.secure_kafka import SecureKafka

PARTITIONS = 2
RECORDS = 900
RATE = 60.0  # records/s: the rotation happens in the middle of a steady stream


@pytest_asyncio.fixture
async def topics(secure_kafka: SecureKafka) -> AsyncIterator[dict[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    names = {"input": f"rot-in-{suffix}", "output": f"rot-out-{suffix}", "dlq": f"rot-dlq-{suffix}"}
    await secure_kafka.create_topics(list(names.values()), PARTITIONS)
    try:
        yield names
    finally:
        await secure_kafka.delete_topics(list(names.values()))


class Publisher:
    """Publishes RECORDS inputs at RATE as the admin user; each one's (partition, offset)."""

    def __init__(self, sk: SecureKafka, topic: str) -> None:
        self.sk, self.topic = sk, topic
        self.sent: list[Any] = []  # delivery futures, in order
        self.vms: list[str] = []

    async def run(self) -> None:
        producer = AIOKafkaProducer(**self.sk.admin_args(), acks="all")
        await producer.start()
        try:
            start = time.monotonic()
            for i in range(RECORDS):
                # Skipped by its request: classified without reading the cluster, so the
                # shared kube-apiserver's content (other tests wipe it) cannot matter.
                vm, decision, request = e2e.outcome("hv-1", ["hv-1"], skip=True)
                key, value, headers = e2e.good_record(vm, decision, request)
                self.sent.append(await producer.send(self.topic, value, key=key, headers=headers))
                self.vms.append(vm)
                await asyncio.sleep(max(0.0, start + (i + 1) / RATE - time.monotonic()))
            await asyncio.gather(*self.sent)
        finally:
            await producer.stop()

    async def reached(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.sent) < n:
            assert time.monotonic() < deadline, f"published {len(self.sent)} of {n}"
            await asyncio.sleep(0.05)


def spawn(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CRS_"))}
    with log.open("ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "service", "run"],
            cwd=REPO,
            env={**base, **env},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


async def logged(log: Path, event: str, count: int = 1, timeout_s: float = 60) -> dict[str, Any]:
    """The ``count``-th ``event`` in the service's log, waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = e2e.log_events(log, event)
        if len(events) >= count:
            return events[count - 1]
        assert time.monotonic() < deadline, f"no {event} #{count}:\n{log.read_text()[-4000:]}"
        await asyncio.sleep(0.1)


class Identity:
    """The service's Kafka identity in a Secret volume, as Strimzi's User Operator keeps it:
    an mTLS user (certificate, encrypted key, key password) or a SCRAM user (password),
    with what a rotation changes and how a half-written Secret looks."""

    def __init__(self, sk: SecureKafka, mode: str, volume: SecretVolume) -> None:
        self.sk, self.mode, self.volume = sk, mode, volume
        self.acls: list[Acl] = []
        self.current: dict[str, bytes] = {}  # the volume's content in use
        self.next: dict[str, bytes] = {}  # the rotation's
        run = uuid.uuid4().hex[:8]
        if mode == "mtls":
            # The new certificate has another subject, so that the old one's ACLs can be
            # deleted: Kafka has no revocation list, and a certificate of the same
            # subject would be accepted either way.
            self.names = (f"crs-rot-{run}-a", f"crs-rot-{run}-b")
            self.principals = [f"User:CN={n}" for n in self.names]
            self.changed = [
                "KAFKA_SSL_CERTFILE",
                "KAFKA_SSL_KEYFILE",
                "KAFKA_SSL_KEY_PASSWORD_FILE",
            ]
        else:
            # One user whose password changes on the broker: the old one is refused.
            self.names = (f"crs-rot-{run}", f"crs-rot-{run}")
            self.principals = [f"User:{self.names[0]}"]
            self.changed = ["KAFKA_SASL_PASSWORD_FILE"]

    async def first(self) -> None:
        if self.mode == "mtls":
            self.current = self.sk.issue_client_cert(self.names[0])
        else:
            self.current = {"password": uuid.uuid4().hex.encode()}
            await self.sk.set_scram_password(self.names[0], self.current["password"].decode())
        self.volume.publish(self.current)

    def env(self) -> dict[str, str]:
        v = self.volume
        if self.mode == "mtls":
            return {
                "KAFKA_BOOTSTRAP_SERVERS": self.sk.env["CRS_SECURE_KAFKA_MTLS_BOOTSTRAP"],
                "KAFKA_SECURITY_PROTOCOL": "SSL",
                "KAFKA_SSL_CAFILE": self.sk.env["CRS_SECURE_KAFKA_CA"],
                "KAFKA_SSL_CERTFILE": v.path("user.crt"),
                "KAFKA_SSL_KEYFILE": v.path("user.key"),
                "KAFKA_SSL_KEY_PASSWORD_FILE": v.path("user.password"),
            }
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.sk.sasl_bootstrap,
            "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "KAFKA_SASL_USERNAME": self.names[0],
            "KAFKA_SASL_PASSWORD_FILE": v.path("password"),
            "KAFKA_SSL_CAFILE": self.sk.env["CRS_SECURE_KAFKA_CA"],
        }

    def half_written(self) -> str:
        """Publish a Secret that does not load; the variable it breaks."""
        if self.mode == "mtls":
            self.next = self.sk.issue_client_cert(self.names[1])
            self.volume.publish({**self.current, "user.crt": self.next["user.crt"][:500]})
            return "KAFKA_SSL_CERTFILE"
        self.volume.publish({"password": b""})  # an empty password is none: required
        return "KAFKA_SASL_PASSWORD_FILE"

    async def rotate(self) -> None:
        if self.mode == "sasl":
            self.next = {"password": uuid.uuid4().hex.encode()}
            # The broker first: from here the old password opens no new connection.
            await self.sk.set_scram_password(self.names[0], self.next["password"].decode())
        self.volume.publish(self.next)

    async def retire_old(self) -> None:
        """After the rebuild: the old identity can do nothing any more."""
        if self.mode == "mtls":
            await self.sk.revoke(self.principals[0], self.acls)

    async def forget(self) -> None:
        for principal in self.principals:
            await self.sk.revoke(principal, self.acls)
        if self.mode == "sasl":
            await self.sk.set_scram_password(self.names[0], None)


@pytest.mark.parametrize("mode", ["mtls", "sasl"])
async def test_a_credential_rotated_under_load_is_used_and_no_output_is_lost_or_doubled(
    mode: str,
    secure_kafka: SecureKafka,
    devstack: DevStack,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    sk = secure_kafka
    identity = Identity(sk, mode, SecretVolume(tmp_path / "kafka-user"))
    await identity.first()
    env = {
        **identity.env(),
        "KUBECONFIG": devstack.kubeconfig,
        "CRS_INPUT_TOPIC": topics["input"],
        "CRS_OUTPUT_TOPIC": topics["output"],
        "CRS_DLQ_TOPIC": topics["dlq"],
        "CRS_GROUP_ID": f"g-{topics['input']}",
        "CRS_HTTP_PORT": "0",
        "CRS_LOG_FORMAT": "json",
        "CRS_SECRET_RELOAD_INTERVAL_S": "1",
    }
    identity.acls = acls = required_acls(Config.load(env=env))
    for principal in identity.principals:
        await sk.grant(principal, acls)
    log = tmp_path / "service.log"
    publisher = Publisher(sk, topics["input"])
    publishing: asyncio.Task[None] | None = None
    service = spawn(env, log)
    try:
        started = await logged(log, "service_started")
        publishing = asyncio.create_task(publisher.run())
        await publisher.reached(RECORDS // 5)

        # Half-written: the clients at work are kept; it is said once, counted, and not
        # acted on.
        broken = identity.half_written()
        invalid = await logged(log, "secret_reload_invalid", timeout_s=20)
        assert any(f.startswith(f"{broken}=") for f in invalid["files"]), invalid
        refused = await e2e.metrics_at(started["http_port"])
        assert refused[("crs_secret_files_refused", ())] == 1
        await publisher.reached(2 * RECORDS // 5)
        assert e2e.log_events(log, "kafka_clients_rebuilding") == []

        await identity.rotate()
        rebuilding = await logged(log, "kafka_clients_rebuilding", timeout_s=20)
        assert sorted(f.split("=")[0] for f in rebuilding["files"]) == identity.changed
        await logged(log, "service_started", count=2)
        # From here on only the new credential can do anything.
        await identity.retire_old()
        rotated_at = len(publisher.sent)
        assert rotated_at < RECORDS, "the stream ended before the rotation: raise RECORDS"

        await asyncio.wait_for(publishing, 120)
        deliveries: list[RecordMetadata] = [f.result() for f in publisher.sent]
        outputs = await read_as_admin(sk, topics["output"], RECORDS, timeout_s=90)
        # A duplicate would arrive after the last expected output: read a little longer.
        await asyncio.sleep(1)
        outputs = await read_as_admin(sk, topics["output"], RECORDS + 1, timeout_s=3)

        metrics = await e2e.metrics_at(started["http_port"])
    finally:
        if publishing is not None and not publishing.done():
            publishing.cancel()
        service.terminate()
        code = await finished(service, 60)
        await identity.forget()
    assert code == 0, log.read_text()[-4000:]

    expected = {(d.partition, d.offset) for d in deliveries}
    seen = collections.Counter(
        (e2e.data_of(r)["input"]["partition"], e2e.data_of(r)["input"]["offset"]) for r in outputs
    )
    twice = sorted(k for k, n in seen.items() if n > 1)
    missing = sorted(expected - set(seen))
    assert not twice, f"{len(twice)} inputs came out more than once: {twice[:10]}"
    assert not missing, f"{len(missing)} inputs never came out: {missing[:10]}"
    assert set(seen) == expected
    assert {e2e.data_of(r)["instance_uuid"] for r in outputs} == set(publisher.vms)
    assert {e2e.data_of(r)["cr_slot"] for r in outputs} == {"skipped"}

    def sample(name: str, **labels: str) -> float:
        return metrics.get((name, tuple(sorted(labels.items()))), -1.0)

    assert sample("crs_secret_reloads_total", result="applied") == 1
    assert sample("crs_secret_reloads_total", result="invalid") == 1
    assert sample("crs_secret_files_refused") == 0  # the rotation loaded
    assert sample("crs_kafka_client_restarts_total") == 0  # a rebuild, not a failure
    # One rebuild, no other start: the old clients left before the new ones joined.
    assert len(e2e.log_events(log, "service_started")) == 2
    assert e2e.log_events(log, "startup_retrying") == []
    assert e2e.log_events(log, "partition_fenced") == []
