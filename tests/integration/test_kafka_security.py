"""The service against the secured broker, with exactly the documented least-privilege ACLs.

The broker (devstack/up --secure-kafka) authorizes with StandardAuthorizer and
``allow.everyone.if.no.acl.found=false``: the service's principals (the SCRAM user
``crs-sasl``, the certificate ``CN=crs-mtls``) can do nothing they are not granted. Each
test grants ``required_acls`` (the README's table) on fresh topic and group names, and
revokes them again afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import TransactionalIdAuthorizationFailed
from aiokafka.structs import ConsumerRecord, TopicPartition

from service.app.config import Config
from service.app.kafka_access import Acl, required_acls
from service.stream.engine import transactional_id_for
from tests import e2e
from tests.conftest import REPO, DevStack
from tests.secure_kafka import SecureKafka

PARTITIONS = 2


@pytest_asyncio.fixture
async def topics(secure_kafka: SecureKafka) -> AsyncIterator[dict[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    names = {"input": f"in-{suffix}", "output": f"out-{suffix}", "dlq": f"dlq-{suffix}"}
    await secure_kafka.create_topics(list(names.values()), PARTITIONS)
    try:
        yield names
    finally:
        await secure_kafka.delete_topics(list(names.values()))


def service_env(
    sk: SecureKafka, mode: str, topics: dict[str, str], devstack: DevStack
) -> dict[str, str]:
    return {
        **(sk.mtls_env() if mode == "mtls" else sk.sasl_env()),
        "KUBECONFIG": devstack.kubeconfig,
        "CRS_INPUT_TOPIC": topics["input"],
        "CRS_OUTPUT_TOPIC": topics["output"],
        "CRS_DLQ_TOPIC": topics["dlq"],
        # The transactional id is left to the service (<group>-<hostname>): the prefixed
        # ACL on the group id must cover it, as it covers <prefix>-<topic>-<partition>.
        "CRS_GROUP_ID": f"g-{topics['input']}",
        "CRS_HTTP_PORT": "0",
        "CRS_LOG_FORMAT": "json",
        # At-least-once: no transactions, so no TransactionalId ACL (and no Cluster one).
        **({"CRS_EXACTLY_ONCE": "false"} if mode == "sasl-at-least-once" else {}),
    }


def principal(sk: SecureKafka, mode: str) -> str:
    return sk.mtls_principal if mode == "mtls" else sk.sasl_principal


def crs(command: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CRS_"))}
    with log.open("ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "service", command],
            cwd=REPO,
            env={**base, **env},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


async def finished(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.args} did not finish within {timeout_s}s")
        await asyncio.sleep(0.1)
    return proc.returncode


async def publish_as_admin(
    sk: SecureKafka, topic: str, records: list[Any], partition: int | None = None
) -> None:
    producer = AIOKafkaProducer(**sk.admin_args(), acks="all")
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(
                topic, value, key=key, headers=headers, partition=partition
            )
    finally:
        await producer.stop()


async def read_as_admin(
    sk: SecureKafka, topic: str, expected: int, timeout_s: float = 60
) -> list[ConsumerRecord]:
    consumer = AIOKafkaConsumer(
        **sk.admin_args(), isolation_level="read_committed", enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < expected and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                out.extend(records)
        return out
    finally:
        await consumer.stop()


@pytest.mark.parametrize("mode", ["sasl", "mtls", "sasl-at-least-once"])
async def test_service_end_to_end_with_exactly_the_documented_acls(
    mode: str,
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    env = service_env(secure_kafka, mode, topics, devstack)
    acls = required_acls(Config.load(env=env))
    assert len(acls) == (4 if mode == "sasl-at-least-once" else 5)
    who = principal(secure_kafka, mode)
    await secure_kafka.grant(who, acls)
    log = tmp_path / "service.log"
    try:
        check = crs("check", env, log)
        assert await finished(check, 60) == 0, log.read_text()[-3000:]

        await e2e.seed_region(clean_k8s)
        vm_a, decision_a, request_a = e2e.outcome("hv-1", ["hv-1", "hv-2"])  # slot_used
        vm_b, decision_b, request_b = e2e.outcome(None, ["hv-3"], project="p3")  # no_cr
        records = [
            e2e.good_record(vm_a, decision_a, request_a),
            e2e.good_record(vm_b, decision_b, request_b),
            (b"poison", b"not json", []),  # the dead-letter topic is written too
        ]
        await publish_as_admin(secure_kafka, topics["input"], records)
        service = crs("run", env, log)
        try:
            outputs = await read_as_admin(secure_kafka, topics["output"], 2)
            dead = await read_as_admin(secure_kafka, topics["dlq"], 1)
        finally:
            service.terminate()
            code = await finished(service, 40)
        assert code == 0, log.read_text()[-3000:]
        assert {e2e.data_of(r)["instance_uuid"]: e2e.data_of(r)["cr_slot"] for r in outputs} == {
            vm_a: "slot_used",
            vm_b: "no_cr",
        }
        assert [r.value for r in dead] == [b"not json"]
        if mode == "sasl-at-least-once":
            return

        # The one prefixed ACL also covers partition-bound ids (<prefix>-<topic>-<partition>),
        # and the broker does enforce it: an id outside the prefix is refused.
        client_args = Config.load(env=env).kafka_client_args()
        bound = AIOKafkaProducer(
            **client_args, transactional_id=f"{env['CRS_GROUP_ID']}-{topics['input']}-0"
        )
        await bound.start()
        await bound.stop()
        outside = AIOKafkaProducer(**client_args, transactional_id=f"other-{topics['input']}-0")
        with pytest.raises(TransactionalIdAuthorizationFailed):
            await outside.start()
        await outside.stop()
    finally:
        await secure_kafka.revoke(who, acls)


def _without(acls: list[Acl], index: int) -> tuple[list[Acl], Acl]:
    return [a for i, a in enumerate(acls) if i != index], acls[index]


@pytest.mark.parametrize(
    "case", ["input-read", "output-write", "dlq-write", "group-read", "txn-write", "describe-only"]
)
async def test_without_any_one_acl_check_names_it_and_run_refuses_to_start(
    case: str,
    secure_kafka: SecureKafka,
    devstack: DevStack,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    env = service_env(secure_kafka, "sasl", topics, devstack)
    acls = required_acls(Config.load(env=env))
    cases = ["input-read", "output-write", "dlq-write", "group-read", "txn-write"]
    if case == "describe-only":
        # Describe instead of Read on the input: the topic is visible, not readable.
        granted, missing = _without(acls, 0)
        granted.append(Acl("Topic", topics["input"], "literal", "Describe"))
    else:
        granted, missing = _without(acls, cases.index(case))
    who = secure_kafka.sasl_principal
    await secure_kafka.grant(who, granted)
    check_log, run_log = tmp_path / "check.log", tmp_path / "run.log"
    try:
        check = crs("check", env, check_log)
        service = crs("run", env, run_log)
        check_code = await finished(check, 60)
        run_code = await finished(service, 60)
    finally:
        await secure_kafka.revoke(who, granted)
    check_out, run_out = check_log.read_text(), run_log.read_text()
    assert check_code == 1, check_out
    assert f"kafka: FAILED: missing ACL for {who}: {missing}" in check_out
    assert check_out.count("missing ACL") == 1, check_out
    assert run_code == 1, run_out[-3000:]
    assert "startup_failed" in run_out
    assert str(missing) in run_out
    assert "service_started" not in run_out


async def test_a_stop_ends_the_back_off_after_a_fetch_refused_by_a_revoked_acl(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    """The input topic's Read ACL revoked under a running replica: its fetches fail and it
    waits the longest back-off (CRS_RETRY_BACKOFF_MAX_S, here 60 s) between them, saying
    why. SIGTERM must end that wait at once, not after the shutdown budget's share for
    finishing work (21 of the default 30 s), which a kubelet would cut with SIGKILL."""
    env = {
        **service_env(secure_kafka, "sasl", topics, devstack),
        "CRS_RETRY_BACKOFF_MAX_S": "60",
        "CRS_LIVENESS_BOUND_S": "120",
    }
    acls = required_acls(Config.load(env=env))
    who = principal(secure_kafka, "sasl")
    read_input = [a for a in acls if a.resource_type == "Topic" and a.name == topics["input"]]
    assert [a.operation for a in read_input] == ["Read"], acls
    await secure_kafka.grant(who, acls)
    log = tmp_path / "service.log"
    try:
        await e2e.seed_region(clean_k8s)
        service = crs("run", env, log)
        try:
            # One event through: the replica is in its group and fetching.
            vm, decision, request = e2e.outcome(None, ["hv-3"], project="p3")
            await publish_as_admin(
                secure_kafka, topics["input"], [e2e.good_record(vm, decision, request)]
            )
            assert len(await read_as_admin(secure_kafka, topics["output"], 1)) == 1, (
                log.read_text()[-3000:]
            )
            await secure_kafka.revoke(who, read_input)
            deadline = time.monotonic() + 60
            while '"event":"fetch_failed"' not in log.read_text(errors="replace"):
                assert service.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, (
                    f"no fetch_failed after the revoke\n{log.read_text()[-3000:]}"
                )
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # well inside the 60 s back-off
            service.terminate()
            stopped = time.monotonic()
            code = await finished(service, 40)
            took = time.monotonic() - stopped
        finally:
            if service.poll() is None:
                service.kill()
                service.wait()
        text = log.read_text(errors="replace")
        assert "AuthorizationFailed" in text, text[-3000:]
        assert took < 10.0, f"stopped {took:.1f} s after SIGTERM\n{text[-3000:]}"
        assert code == 0, text[-3000:]
    finally:
        await secure_kafka.revoke(who, acls)


async def until_ready_is(
    port: int, status: int, cause: str, service: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + 30
    seen: tuple[int | None, str] = (0, "")
    while time.monotonic() < deadline:
        assert service.poll() is None, log.read_text()[-3000:]
        seen = await e2e.http_get(port, "/readyz")
        if seen[0] == status and cause in seen[1]:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"/readyz never {status} with {cause!r}: last {seen}")


@dataclass
class Serving:
    """The service running as the SASL user with exactly its documented ACLs."""

    secure_kafka: SecureKafka
    topics: dict[str, str]
    port: int
    log: Path
    service: subprocess.Popen[bytes]
    who: str
    acls: list[Acl]

    async def one_more_event(self, outputs: int, timeout_s: float = 60) -> None:
        """Publish an event; wait until the output topic holds ``outputs`` records."""
        event = e2e.good_record(*e2e.outcome(None, ["hv-3"], project="p3"))
        await publish_as_admin(self.secure_kafka, self.topics["input"], [event])
        found = await read_as_admin(self.secure_kafka, self.topics["output"], outputs, timeout_s)
        assert len(found) == outputs, self.log.read_text()[-3000:]

    async def ready_is(self, status: int, cause: str) -> None:
        await until_ready_is(self.port, status, cause, self.service, self.log)


@contextlib.asynccontextmanager
async def started(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
    **settings: str,
) -> AsyncIterator[Serving]:
    """The service started (``settings`` over the SASL user's); afterwards stopped (exit
    code 0 asserted) and the ACLs revoked again."""
    env = {
        **service_env(secure_kafka, "sasl", topics, devstack),
        "CRS_HTTP_PORT": str(e2e.free_port()),
        "CRS_RETRY_BACKOFF_MAX_S": "1",
        **settings,
    }
    acls = required_acls(Config.load(env=env))
    who = principal(secure_kafka, "sasl")
    await secure_kafka.grant(who, acls)
    log = tmp_path / "service.log"
    try:
        await e2e.seed_region(clean_k8s)
        service = crs("run", env, log)
        try:
            yield Serving(secure_kafka, topics, int(env["CRS_HTTP_PORT"]), log, service, who, acls)
        finally:
            service.terminate()
            code = await finished(service, 40)
        assert code == 0, log.read_text()[-3000:]
    finally:
        await secure_kafka.revoke(who, acls)


@contextlib.asynccontextmanager
async def serving(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> AsyncIterator[Serving]:
    """Started, one event through and ready (see started)."""
    async with started(secure_kafka, devstack, clean_k8s, topics, tmp_path) as s:
        await s.one_more_event(1)
        await s.ready_is(200, "assigned")
        yield s


async def test_readiness_follows_revoked_and_restored_acls(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    """/readyz tells the truth about authorisation on the real secured broker:
    the input's Read ACL revoked -> 503 "fetching from Kafka fails", restored -> events
    flow and 200; the output's Write ACL revoked -> the commit fails, 503 "stalled ...
    commit failing", which the partition's successful take-overs in between do not clear;
    restored -> the held event comes out once and 200."""
    async with serving(secure_kafka, devstack, clean_k8s, topics, tmp_path) as s:
        (read_input,) = [a for a in s.acls if a.name == topics["input"]]
        (write_output,) = [a for a in s.acls if a.name == topics["output"]]
        await secure_kafka.revoke(s.who, [read_input])
        await s.ready_is(503, "fetching from Kafka fails")
        await secure_kafka.grant(s.who, [read_input])
        await s.one_more_event(2)
        await s.ready_is(200, "assigned")

        await secure_kafka.revoke(s.who, [write_output])
        event = e2e.good_record(*e2e.outcome(None, ["hv-3"], project="p3"))
        await publish_as_admin(secure_kafka, topics["input"], [event])
        await s.ready_is(503, "commit failing")
        # Taken over again (the back-off is 1 s) and failing again: still not ready.
        acquired = s.log.read_text().count('"event":"partition_acquired"')
        deadline = time.monotonic() + 30
        while s.log.read_text().count('"event":"partition_acquired"') < acquired + 2:
            assert time.monotonic() < deadline, s.log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        status, body = await e2e.http_get(s.port, "/readyz")
        assert (status, "commit failing" in body) == (503, True), body
        await secure_kafka.grant(s.who, [write_output])
        outputs = await read_as_admin(secure_kafka, topics["output"], 3)
        await s.ready_is(200, "assigned")
        assert len(await read_as_admin(secure_kafka, topics["output"], 4, timeout_s=3)) == 3
        assert len(outputs) == 3


async def test_the_group_acl_revoked_under_a_running_replica_and_restored_is_recovered_from(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    """aiokafka's heartbeat task ends on its first GROUP_AUTHORIZATION_FAILED answer and
    is started again only by a rejoin, which nothing asks for any more: every getmany()
    raises the error again, the member drops out of its group and never rejoins, even
    once the ACL is back (found by review). Now the ended heartbeat ends the Kafka client,
    which is started afresh, and an authorization error met while restarting is waited
    out, not taken for a configuration error: the service ran with this configuration."""
    async with serving(secure_kafka, devstack, clean_k8s, topics, tmp_path) as s:
        (group_read,) = [a for a in s.acls if a.resource_type == "Group"]
        await secure_kafka.revoke(s.who, [group_read])
        # A heartbeat (every 3 s) is refused; then a restart meets the missing ACL.
        deadline = time.monotonic() + 30
        while "GroupAuthorizationFailed" not in s.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, s.log.read_text()[-3000:]
            assert s.service.poll() is None, s.log.read_text()[-3000:]
            await asyncio.sleep(0.2)

        def denied_restarts() -> int:
            retried = e2e.log_events(s.log, "startup_retrying")
            return sum("KafkaAccessDenied" in e["error"] for e in retried)

        # Two restarts refused for the missing ACL, each waited out: the process had two
        # chances to take the refusal for a configuration error and exit.
        deadline = time.monotonic() + 60
        while denied_restarts() < 2:
            assert time.monotonic() < deadline, s.log.read_text()[-3000:]
            assert s.service.poll() is None, s.log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        assert s.service.poll() is None, s.log.read_text()[-3000:]
        # The metrics outlive the restarts: what they say must follow /readyz, or
        # CrsNotReady stays silent while the replica waits for the ACL (found by review:
        # crs_ready stayed at 1, the health monitor was not running between attempts).
        status, body = await e2e.http_get(s.port, "/readyz")
        assert status == 503, body
        samples = await e2e.metrics_at(s.port)
        assert samples[("crs_ready", ())] == 0, body
        await secure_kafka.grant(s.who, [group_read])
        await s.one_more_event(2)
        await s.ready_is(200, "assigned")
    # The workload did what the test is about: the heartbeat's refusal ended the client,
    # and its restart met the missing ACL (and waited it out).
    ended = e2e.log_events(s.log, "kafka_client_ended")
    assert [e["task"] for e in ended][:1] == ["heartbeat"], ended
    retried = e2e.log_events(s.log, "startup_retrying")
    assert any("KafkaAccessDenied" in e["error"] for e in retried), retried
    # The attempts in between kept the watch caches: one initial LIST per kind in all.
    listed = [e["kind"] for e in e2e.log_events(s.log, "informer_listed") if e["initial"]]
    assert len(listed) == len(set(listed)), listed


async def test_a_password_file_rotated_while_the_broker_refuses_the_old_one_is_read_again(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    """A SASL password the broker refuses surfaces from aiokafka as a connection error
    and is retried; each attempt reads the configuration again, so the password file a
    Secret rotation rewrites is picked up without a restart of the process."""
    password_file = tmp_path / "password"
    password_file.write_text("not-the-password\n")
    settings = {"KAFKA_SASL_PASSWORD_FILE": str(password_file)}
    async with started(secure_kafka, devstack, clean_k8s, topics, tmp_path, **settings) as s:
        deadline = time.monotonic() + 30
        while len(e2e.log_events(s.log, "startup_retrying")) < 2:
            assert time.monotonic() < deadline, s.log.read_text()[-3000:]
            assert s.service.poll() is None, s.log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        assert not e2e.log_events(s.log, "service_started")
        real = Path(secure_kafka.env["CRS_SECURE_KAFKA_SASL_PASSWORD_FILE"])
        password_file.write_text(real.read_text())
        await s.ready_is(200, "assigned")
        await s.one_more_event(1)
    assert "not-the-password" not in s.log.read_text(), "a secret in the logs"


async def test_a_take_over_refused_past_the_session_timeout_holds_neither_group_nor_others(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    """Partition 1's transactional id denied (a DENY ACL wins over the prefixed ALLOW): its
    take-over fails for longer than the session timeout, as one waiting for a transaction
    coordinator still loading after a broker restart does. aiokafka sends no heartbeat
    while the assignment callback runs, so the take-over must go on outside it: the
    replica stays in its group (one assignment, no revoke over two session timeouts) and
    partition 0's events flow meanwhile. A second replica (another process) joins: the
    take-overs under way are revoked and called off, and the DENY lifted, partition 1 is
    taken over exactly once (a take-over left running after its revoke would take it over
    too, fencing the new owner), every input out once."""
    session_s = 6
    env = {
        **service_env(secure_kafka, "sasl", topics, devstack),
        "CRS_RETRY_BACKOFF_MAX_S": "1",
        "CRS_SESSION_TIMEOUT_MS": str(session_s * 1000),
        "CRS_REVOKE_WAIT_S": "2",
    }
    cfg = Config.load(env=env)
    acls = required_acls(cfg)
    who = principal(secure_kafka, "sasl")
    p1 = TopicPartition(topics["input"], 1)
    txn_id = transactional_id_for(cfg.effective_transactional_id_prefix, p1)
    denied = [Acl("TransactionalId", txn_id, "literal", "Write")]
    ports = [e2e.free_port(), e2e.free_port()]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]

    def events(n: int) -> list[Any]:
        return [e2e.good_record(*e2e.outcome(None, ["hv-3"], project="p3")) for _ in range(n)]

    def vms(records: list[Any]) -> list[str]:
        return sorted(key.decode() for key, _, _ in records)

    def out_vms(records: list[ConsumerRecord]) -> list[str]:
        return sorted(e2e.data_of(r)["instance_uuid"] for r in records)

    async def until_logged(i: int, event: str, n: int = 1) -> None:
        deadline = time.monotonic() + 60
        while len([e for e in e2e.log_events(logs[i], event) if e["partitions"]]) < n:
            assert time.monotonic() < deadline, f"{event} x{n}\n{logs[i].read_text()[-3000:]}"
            assert replicas[i].poll() is None, logs[i].read_text()[-3000:]
            await asyncio.sleep(0.2)

    await secure_kafka.grant(who, acls)
    await secure_kafka.grant(who, denied, "deny")
    replicas: list[subprocess.Popen[bytes]] = []
    published: list[Any] = []
    try:
        await e2e.seed_region(clean_k8s)
        for p in (0, 1):
            batch = events(5)
            await publish_as_admin(secure_kafka, topics["input"], batch, partition=p)
            published += batch
        replicas.append(crs("run", {**env, "CRS_HTTP_PORT": str(ports[0])}, logs[0]))
        try:
            # Partition 0 goes on while partition 1 cannot be taken over.
            out = await read_as_admin(secure_kafka, topics["output"], 5)
            assert out_vms(out) == vms(published[:5]), logs[0].read_text()[-3000:]
            await until_ready_is(ports[0], 503, "cannot take partition over", replicas[0], logs[0])
            # Two session timeouts of refused take-overs (at least five): time in which a
            # member that stopped heartbeating would have been dropped.
            ends = time.monotonic() + 2 * session_s
            while (
                time.monotonic() < ends
                or len(e2e.log_events(logs[0], "partition_acquire_failed")) < 5
            ):
                assert time.monotonic() < ends + 60, logs[0].read_text()[-3000:]
                assert replicas[0].poll() is None, logs[0].read_text()[-3000:]
                await asyncio.sleep(0.2)
            assert await secure_kafka.group_state(cfg.group_id) == ("Stable", 1)
            assert len(e2e.log_events(logs[0], "partitions_assigned")) == 1, logs[0].read_text()[
                -3000:
            ]
            # (A member's first join revokes nothing and logs an empty revoke.)
            assert not [
                e for e in e2e.log_events(logs[0], "partitions_revoking") if e["partitions"]
            ]
            failed = e2e.log_events(logs[0], "partition_acquire_failed")
            assert len(failed) >= 5, failed
            assert {f["partition"] for f in failed} == {1}, failed
            # Still a member serving partition 0, two session timeouts later.
            batch = events(3)
            await publish_as_admin(secure_kafka, topics["input"], batch, partition=0)
            published += batch
            out = await read_as_admin(secure_kafka, topics["output"], 8)
            assert len(out) == 8, logs[0].read_text()[-3000:]

            replicas.append(crs("run", {**env, "CRS_HTTP_PORT": str(ports[1])}, logs[1]))
            await until_logged(0, "partitions_revoking")
            await until_logged(1, "partitions_assigned")
            await until_logged(0, "partitions_assigned", 2)
            refused = [len(e2e.log_events(log, "partition_acquire_failed")) for log in logs]
            for p in (0, 1):
                batch = events(3)
                await publish_as_admin(secure_kafka, topics["input"], batch, partition=p)
                published += batch
            # Partition 1's new owner tried to take it over, and was refused, retrying.
            deadline = time.monotonic() + 30
            while not any(
                e["partition"] == 1
                for log, seen in zip(logs, refused, strict=True)
                for e in e2e.log_events(log, "partition_acquire_failed")[seen:]
            ):
                assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
                await asyncio.sleep(0.2)
            assert not [
                e
                for log in logs
                for e in e2e.log_events(log, "partition_acquired")
                if e["partition"] == 1
            ]
            await secure_kafka.revoke(who, denied, "deny")

            out = await read_as_admin(secure_kafka, topics["output"], len(published))
            assert out_vms(out) == vms(published), [log.read_text()[-2000:] for log in logs]
            for i, port in enumerate(ports):
                await until_ready_is(port, 200, "assigned", replicas[i], logs[i])
            extra = await read_as_admin(
                secure_kafka, topics["output"], len(published) + 1, timeout_s=3
            )
            assert len(extra) == len(published)
        finally:
            for replica in replicas:
                replica.terminate()
            codes = [await finished(replica, 40) for replica in replicas]
        taken_over = [
            e
            for log in logs
            for e in e2e.log_events(log, "partition_acquired")
            if e["partition"] == 1
        ]
        assert len(taken_over) == 1, taken_over
        assert not [e for log in logs for e in e2e.log_events(log, "partition_fenced")]
        assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
    finally:
        await secure_kafka.revoke(who, denied, "deny")
        await secure_kafka.revoke(who, acls)


async def test_a_take_over_refused_its_committed_offset_waits_instead_of_starting_over(
    secure_kafka: SecureKafka,
    devstack: DevStack,
    clean_k8s: Any,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    """OffsetFetch v2-v7 answers a group-level error (the coordinator loading or moving
    after a broker restart or fence, an authorization failure) with the error at the top
    of the response and no partition at all. aiokafka's fetch_committed_offsets reads only
    the partitions, so it returned "no committed offset", and a take-over started its
    partition over from the first record: whatever was committed came out a second time
    (stop 29's CI: 1,010 of 3,000 inputs twice after a broker freeze). Here a real broker
    answers GROUP_AUTHORIZATION_FAILED (a DENY of Describe on the group, which JoinGroup
    and Heartbeat do not need) while a foreign member's join and leave make the replica
    take its partitions over again: the take-overs must fail and wait (readiness says
    so), never start over; the DENY lifted, they go on from the committed offsets and
    every input comes out exactly once."""
    async with serving(secure_kafka, devstack, clean_k8s, topics, tmp_path) as s:
        published = 1
        for p in range(PARTITIONS):
            batch = [e2e.good_record(*e2e.outcome(None, ["hv-3"], project="p3")) for _ in range(3)]
            await publish_as_admin(secure_kafka, topics["input"], batch, partition=p)
            published += len(batch)
        # Out, so committed: each output is committed with its input's offset.
        outputs = await read_as_admin(secure_kafka, topics["output"], published)
        assert len(outputs) == published, s.log.read_text()[-3000:]
        per_partition = collections.Counter(e2e.data_of(r)["input"]["partition"] for r in outputs)

        group = f"g-{topics['input']}"
        describe = [Acl("Group", group, "literal", "Describe")]
        await secure_kafka.grant(s.who, describe, "deny")
        try:
            before = len(e2e.log_events(s.log, "partition_acquired"))
            # A foreign member joins (a rebalance: the replica's partitions revoked, one
            # assigned again), then leaves (both assigned): take-overs, offset fetches.
            other = AIOKafkaConsumer(
                topics["input"],
                **secure_kafka.admin_args(),
                group_id=group,
                enable_auto_commit=False,
            )
            await other.start()
            try:
                deadline = time.monotonic() + 60
                while len(e2e.log_events(s.log, "partitions_assigned")) < 2:
                    assert time.monotonic() < deadline, s.log.read_text()[-3000:]
                    await other.getmany(timeout_ms=200)  # a member, which reads nothing
                    other.pause(*other.assignment())
            finally:
                await other.stop()
            await s.ready_is(503, "cannot take partition over")
            deadline = time.monotonic() + 30
            while {
                e["partition"]
                for e in e2e.log_events(s.log, "partition_acquire_failed")
                if "GroupAuthorizationFailed" in e["error"]
            } != set(range(PARTITIONS)):
                assert time.monotonic() < deadline, s.log.read_text()[-3000:]
                await asyncio.sleep(0.2)
            # Not one take-over went ahead without its committed offset.
            acquired = e2e.log_events(s.log, "partition_acquired")[before:]
            assert not acquired, acquired
        finally:
            await secure_kafka.revoke(s.who, describe, "deny")
        await s.one_more_event(published + 1)
        await s.ready_is(200, "assigned")
        acquired = e2e.log_events(s.log, "partition_acquired")[before:]
        assert sorted(e["partition"] for e in acquired) == list(range(PARTITIONS)), acquired
        assert all(e["committed"] == per_partition[e["partition"]] for e in acquired), acquired
        outputs = await read_as_admin(secure_kafka, topics["output"], published + 2, 3)
        ids = [(r.partition, e2e.data_of(r)["input"]["offset"]) for r in outputs]
        assert len(outputs) == published + 1, (ids, s.log.read_text()[-3000:])
