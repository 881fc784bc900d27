"""``crs-consumer check`` against a broker that authenticates and authorizes.

A second, private KRaft broker (the dev stack's cached Kafka jars) with a SASL/PLAIN
listener and the StandardAuthorizer, on 127.0.0.1:$CRS_DEVSTACK_SECURE_KAFKA_PORT
(default: the dev stack's Kafka port + 10; its controller on the next port). Users:
``admin`` (super user, sets up topics and ACLs) and ``crs`` (what the service runs as).
A wrong password, no ACLs at all, and every ACL but the group's are each named in one
line per missing permission, as the broker answers them.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, DevStack

pytestmark = pytest.mark.integration

DEV_KAFKA_PORT = int(os.environ.get("CRS_DEVSTACK_KAFKA_PORT", "19092"))
PORT = int(os.environ.get("CRS_DEVSTACK_SECURE_KAFKA_PORT", str(DEV_KAFKA_PORT + 10)))
CONTROLLER_PORT = PORT + 1
CACHE = Path(
    os.environ.get(
        "CRS_DEVSTACK_CACHE",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "crs-devstack",
    )
)
LIBS = CACHE / "kafka-4.1.1" / "libs"
BOOTSTRAP = f"127.0.0.1:{PORT}"
TOPICS = {"input": "acl-in", "output": "acl-out", "dlq": "acl-dlq"}
GROUP = "acl-group"
TXN = "acl-txn"

# Kafka protocol constants (resource type, operation, permission, pattern)
TOPIC, GROUP_RES, TXN_RES = 2, 3, 5
READ, WRITE, DESCRIBE = 3, 4, 8
ALLOW, LITERAL, PREFIXED = 3, 3, 4


def _jaas() -> str:
    return (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        'username="admin" password="admin-pw" user_admin="admin-pw" user_crs="crs-pw";'
    )


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def secured_kafka(devstack: DevStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not (LIBS / "kafka_2.13-4.1.1.jar").exists():
        pytest.fail(f"no cached Kafka jars in {LIBS}: run devstack/up first", pytrace=False)
    if _port_open(PORT) or _port_open(CONTROLLER_PORT):
        pytest.fail(
            f"port {PORT} or {CONTROLLER_PORT} is in use: set CRS_DEVSTACK_SECURE_KAFKA_PORT"
        )
    work = tmp_path_factory.mktemp("secured-kafka")
    conf = work / "server.properties"
    conf.write_text(
        "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"listeners=SASL_PLAINTEXT://127.0.0.1:{PORT},CONTROLLER://127.0.0.1:{CONTROLLER_PORT}",
                f"advertised.listeners=SASL_PLAINTEXT://127.0.0.1:{PORT}",
                "controller.listener.names=CONTROLLER",
                f"controller.quorum.bootstrap.servers=127.0.0.1:{CONTROLLER_PORT}",
                "listener.security.protocol.map=SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name=SASL_PLAINTEXT",
                "sasl.enabled.mechanisms=PLAIN",
                "sasl.mechanism.inter.broker.protocol=PLAIN",
                f"listener.name.sasl_plaintext.plain.sasl.jaas.config={_jaas()}",
                "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                # the controller listener is plaintext inside this process: ANONYMOUS
                "super.users=User:admin;User:ANONYMOUS",
                f"log.dirs={work / 'data'}",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=1",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "transaction.state.log.num.partitions=1",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
                "group.initial.rebalance.delay.ms=0",
                "auto.create.topics.enable=false",
            ]
        )
        + "\n"
    )
    java = [
        "java",
        "-Xms64m",
        "-Xmx256m",
        "-XX:TieredStopAtLevel=1",
        f"-Dkafka.logs.dir={work}",
        f"-Dlog4j2.configurationFile=file:{REPO / 'devstack' / 'kafka' / 'log4j2.properties'}",
        "-cp",
        f"{LIBS}/*",
    ]
    # Kafka's Uuid.randomUuid() never starts an id with "-": the storage tool's parser
    # reads "-t -xyz" as a missing argument (one fresh clone's make test in 64 failed so).
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    fmt = subprocess.run(
        [
            *java,
            "kafka.tools.StorageTool",
            "format",
            "--standalone",
            "-t",
            cluster_id,
            "-c",
            str(conf),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if fmt.returncode != 0:
        pytest.fail(
            f"formatting the secured broker failed:\n{fmt.stdout}{fmt.stderr}", pytrace=False
        )
    with open(work / "stdout.log", "wb") as out:
        proc = subprocess.Popen(
            [*java, "kafka.Kafka", str(conf)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 120
        log = work / "kafka-server.log"
        while not (log.exists() and "Kafka Server started" in log.read_text(errors="replace")):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                pytest.fail(f"the secured broker did not start:\n{tail}", pytrace=False)
            time.sleep(0.3)
        _admin_setup()
        yield BOOTSTRAP
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _admin_args() -> dict[str, object]:
    return {
        "bootstrap_servers": BOOTSTRAP,
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "admin",
        "sasl_plain_password": "admin-pw",
    }


def _admin_setup() -> None:
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    async def setup() -> None:
        admin = AIOKafkaAdminClient(**_admin_args())
        await admin.start()
        try:
            await admin.create_topics([NewTopic(t, 1, 1) for t in TOPICS.values()])
        finally:
            await admin.close()

    asyncio.run(setup())


def grant(*acls: tuple[int, str, int]) -> None:
    """Give User:crs these (resource type, name, operation) permissions.

    A TransactionalId ACL is PREFIXED (ids are <prefix>-<topic>-<partition>), the rest
    literal."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.protocol.admin import CreateAclsRequest

    async def create() -> None:
        admin = AIOKafkaAdminClient(**_admin_args())
        await admin.start()
        try:
            for rtype, name, op in acls:
                pattern = PREFIXED if rtype == TXN_RES else LITERAL
                req = CreateAclsRequest(rtype, name, pattern, "User:crs", "*", op, ALLOW)
                resp = await admin._send_request(req)
                assert all(r[0] == 0 for r in resp.creation_responses), resp
        finally:
            await admin.close()

    asyncio.run(create())


def check(kubeconfig: str, password: str = "crs-pw") -> subprocess.CompletedProcess[str]:
    """``crs-consumer check`` against the secured broker; Kubernetes is the dev stack's, so
    what fails is Kafka's alone (check reports every dependency in one run)."""
    env = {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "KAFKA_BOOTSTRAP_SERVERS": BOOTSTRAP,
        "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "KAFKA_SASL_MECHANISM": "PLAIN",
        "KAFKA_SASL_USERNAME": "crs",
        "KAFKA_SASL_PASSWORD": password,
        "CRS_INPUT_TOPIC": TOPICS["input"],
        "CRS_OUTPUT_TOPIC": TOPICS["output"],
        "CRS_DLQ_TOPIC": TOPICS["dlq"],
        "CRS_GROUP_ID": GROUP,
        "CRS_TRANSACTIONAL_ID_PREFIX": TXN,
    }
    return subprocess.run(
        [sys.executable, "-m", "service", "check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )


def test_wrong_password_is_an_authentication_failure(
    secured_kafka: str, devstack: DevStack
) -> None:
    proc = check(devstack.kubeconfig, password="not-the-password")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kafka: FAILED to reach {secured_kafka}: authentication failed")
    assert "KAFKA_SASL_USERNAME=crs" in lines[0]
    assert "not-the-password" not in proc.stderr + proc.stdout


def test_no_acls_names_every_resource_not_missing_topics(
    secured_kafka: str, devstack: DevStack
) -> None:
    proc = check(devstack.kubeconfig)
    assert proc.returncode == 1
    err = proc.stderr
    lines = err.strip().splitlines()
    assert all(line.startswith("kafka: FAILED: missing ACL for User:crs: ") for line in lines)
    for topic in TOPICS.values():
        assert f"on Topic:{topic} (literal)" in err, err
    assert f"ALLOW Read on Group:{GROUP} (literal)" in err
    assert f"ALLOW Write on TransactionalId:{TXN} (prefix)" in err
    assert "topic(s) missing" not in err  # unauthorized is not "missing"


def test_every_acl_but_the_groups_is_one_line(secured_kafka: str, devstack: DevStack) -> None:
    grant(
        (TOPIC, TOPICS["input"], READ),
        (TOPIC, TOPICS["input"], DESCRIBE),
        (TOPIC, TOPICS["output"], WRITE),
        (TOPIC, TOPICS["output"], DESCRIBE),
        (TOPIC, TOPICS["dlq"], WRITE),
        (TOPIC, TOPICS["dlq"], DESCRIBE),
        (TXN_RES, TXN, WRITE),
    )
    proc = check(devstack.kubeconfig)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"kafka: FAILED: missing ACL for User:crs: ALLOW Read on Group:{GROUP} (literal): "
    )
    grant((GROUP_RES, GROUP, READ))
    proc = check(devstack.kubeconfig)
    assert proc.stdout.startswith(
        f"kafka: ok, {secured_kafka} (authorizer on, DescribeAcls not allowed"
    ), proc.stderr
