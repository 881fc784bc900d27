"""Which Kafka ACLs the service needs, and which of them this client's principal lacks.

The least-privilege set (README, "Kafka ACLs") is derived from the configuration by
``required_acls``. ``missing_acls`` asks the brokers, without side effects, whether each
one is granted: topic operations from a Metadata v8 request with
``include_topic_authorized_operations`` (the broker answers with the operations this
principal may perform on each topic; no topic is created), the group and the
transactional id by locating their coordinators (FindCoordinator needs Describe, which
Read on the group and Write on the transactional id imply). Nothing joins the group or
initialises a producer, so a probe never disturbs or fences running replicas.

Limits: for the group and the transactional id the probe sees Describe, so an operator
who grants Describe instead of Read/Write passes the check and fails at ``run``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import structlog
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.coordination import FindCoordinatorRequest
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String

from service.app.config import Config

__all__ = ["Acl", "KafkaAccessDenied", "ensure_access", "missing_acls", "required_acls"]

log = structlog.get_logger(__name__)

# Kafka protocol codes (org.apache.kafka.common.acl.AclOperation, protocol.Errors).
_OPERATION_BIT = {"Read": 3, "Write": 4, "Describe": 8}
_TOPIC_AUTHORIZATION_FAILED = 29
_GROUP_AUTHORIZATION_FAILED = 30
_TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
_UNKNOWN_TOPIC = 3
_COORDINATOR_GROUP, _COORDINATOR_TRANSACTION = 0, 1


@dataclass(frozen=True)
class Acl:
    """One ALLOW rule the service's principal needs (host: any)."""

    resource_type: str  # Topic, Group, TransactionalId (as kafka-acls and Strimzi name them)
    name: str
    pattern: str  # literal or prefix
    operation: str

    def __str__(self) -> str:
        return f"ALLOW {self.operation} on {self.resource_type}:{self.name} ({self.pattern})"


def transactional_id_prefix(config: Config) -> str:
    """The PREFIXED TransactionalId ACL's name: ``CRS_TRANSACTIONAL_ID_PREFIX``.

    Transactional ids are bound to input partitions,
    ``<CRS_TRANSACTIONAL_ID_PREFIX>-<topic>-<partition>``, the prefix defaulting to the
    group id; the ACL's name is the prefix itself.
    """
    return config.effective_transactional_id_prefix


def required_acls(config: Config) -> list[Acl]:
    acls = [
        Acl("Topic", config.input_topic, "literal", "Read"),
        Acl("Topic", config.output_topic, "literal", "Write"),
        Acl("Topic", config.dlq_topic, "literal", "Write"),
        Acl("Group", config.group_id, "literal", "Read"),
    ]
    if config.exactly_once:
        acls.append(Acl("TransactionalId", transactional_id_prefix(config), "prefix", "Write"))
    return acls


# ---------------------------------------------------------------- Metadata v8
# aiokafka speaks Metadata up to v5; v8 adds the authorized operations per topic.


class _MetadataResponseV8(Response):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", Array(("node_id", Int32), ("host", String("utf-8")), ("port", Int32),
                          ("rack", String("utf-8")))),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        ("topics", Array(
            ("error_code", Int16),
            ("name", String("utf-8")),
            ("is_internal", Boolean),
            ("partitions", Array(
                ("error_code", Int16), ("partition_index", Int32), ("leader_id", Int32),
                ("leader_epoch", Int32), ("replica_nodes", Array(Int32)),
                ("isr_nodes", Array(Int32)), ("offline_replicas", Array(Int32)),
            )),
            ("topic_authorized_operations", Int32),
        )),
        ("cluster_authorized_operations", Int32),
    )  # fmt: skip


class _MetadataRequestV8Struct(RequestStruct):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponseV8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class _MetadataRequestV8(Request[_MetadataRequestV8Struct]):  # type: ignore[misc]
    API_KEY = 3

    def __init__(self, topics: list[str]) -> None:
        self._topics = topics

    def build(self, request_struct_class: type[_MetadataRequestV8Struct]) -> Any:
        # No auto-creation: a probe must not create the topics it asks about.
        return request_struct_class(self._topics, False, False, True)


async def missing_acls(config: Config, *, timeout_s: float = 15.0) -> list[tuple[Acl, str]]:
    """The required ACLs the brokers deny this client, each with what the broker said.

    Raises on connection or authentication failures (no answer about ACLs is possible).
    An absent topic is not an ACL problem and is not reported here.
    """
    client = AIOKafkaClient(**config.kafka_client_args(), request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        node = client.get_random_node()
        missing: list[tuple[Acl, str]] = []
        acls = required_acls(config)
        topic_acls = [a for a in acls if a.resource_type == "Topic"]
        meta = await client.send(node, _MetadataRequestV8([a.name for a in topic_acls]))
        by_name = {t[1]: t for t in meta.topics}
        for acl in topic_acls:
            error, _, _, _, ops = by_name[acl.name]
            if error == _TOPIC_AUTHORIZATION_FAILED:
                missing.append((acl, "TOPIC_AUTHORIZATION_FAILED (not even Describe)"))
            elif error == _UNKNOWN_TOPIC:
                continue
            elif not ops >> _OPERATION_BIT[acl.operation] & 1:
                missing.append((acl, f"{acl.operation} is not among the granted operations"))
        group = next(a for a in acls if a.resource_type == "Group")
        error = await _coordinator_error(client, node, group.name, _COORDINATOR_GROUP)
        if error == _GROUP_AUTHORIZATION_FAILED:
            missing.append((group, "GROUP_AUTHORIZATION_FAILED"))
        if config.exactly_once:
            acl = next(a for a in acls if a.resource_type == "TransactionalId")
            # The id of the input's partition 0; any id under the prefix would do.
            tid = f"{config.effective_transactional_id_prefix}-{config.input_topic}-0"
            error = await _coordinator_error(client, node, tid, _COORDINATOR_TRANSACTION)
            if error == _TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
                missing.append((acl, f"TRANSACTIONAL_ID_AUTHORIZATION_FAILED for {tid[:120]}"))
        return missing
    finally:
        await client.close()


async def _coordinator_error(client: AIOKafkaClient, node: int, key: str, kind: int) -> int:
    response = await client.send(node, FindCoordinatorRequest(key, kind))
    return int(response.error_code)


class KafkaAccessDenied(RuntimeError):
    """The brokers deny required ACLs; the message names each one."""

    def __init__(self, missing: list[tuple[Acl, str]]) -> None:
        self.missing = missing
        super().__init__("missing Kafka ACLs: " + "; ".join(f"{a} [{why}]" for a, why in missing))


async def ensure_access(config: Config) -> None:
    """Refuse to start without the required ACLs, naming them (``run``'s pre-flight).

    Unreachable brokers are not this check's verdict: the consumer's own start reports
    (and, where it can, rides out) those.
    """
    try:
        missing = await missing_acls(config)
    except Exception as exc:  # unreachable or authentication failed: reported by the consumer
        log.warning("kafka_access_not_checked", error=f"{type(exc).__name__}: {exc}"[:300])
        return
    if missing:
        raise KafkaAccessDenied(missing)
