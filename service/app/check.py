"""``crs-consumer check``: can this configuration work, here and now?

Prints one line per dependency and exits non-zero with a one-line reason on the first
failure, so it serves as a Kubernetes init step or a first debugging command.
"""

from __future__ import annotations

import asyncio
import sys

from service.app.config import Config
from service.app.kafka_access import missing_acls

__all__ = ["run_check"]


async def run_check(config: Config) -> int:
    from aiokafka.admin import AIOKafkaAdminClient

    from service.k8s import KubeClient
    from service.k8s.client import COMMITTED_RESOURCES, HYPERVISORS, RESERVATIONS

    admin = AIOKafkaAdminClient(**config.kafka_client_args(), request_timeout_ms=10000)
    try:
        await asyncio.wait_for(admin.start(), 15)
        topics = set(await asyncio.wait_for(admin.list_topics(), 15))
    except Exception as exc:  # any failure is the answer; the type says which
        print(
            f"kafka: FAILED to reach {config.bootstrap_servers}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    finally:
        await admin.close()
    try:
        denied = await missing_acls(config)
    except Exception as exc:
        print(f"kafka: FAILED to check ACLs: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if denied:
        who = f"User:{config.sasl_username}" if config.sasl_username else "this client's principal"
        for acl, why in denied:
            print(f"kafka: FAILED: missing ACL for {who}: {acl}: {why}", file=sys.stderr)
        return 1
    # Outputs to a missing topic would stall every commit (unless the brokers create
    # topics on first use); a missing input topic only means nothing was published yet.
    missing = [t for t in (config.output_topic, config.dlq_topic) if t not in topics]
    if missing and not await _auto_create(admin_args=config.kafka_client_args()):
        print(f"kafka: FAILED: output topic(s) missing: {', '.join(missing)}", file=sys.stderr)
        return 1
    note = (
        ""
        if config.input_topic in topics
        else f" (input topic {config.input_topic} not created yet)"
    )
    print(f"kafka: ok, {config.bootstrap_servers}{note}")

    try:
        client = await KubeClient.create(config.kubeconfig, request_timeout_s=config.k8s_timeout_s)
    except Exception as exc:  # a bad kubeconfig or missing service account
        print(f"kubernetes: FAILED to configure: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    try:
        knowledge = await client.get_knowledge()
        for kind in (HYPERVISORS, RESERVATIONS, COMMITTED_RESOURCES):
            await client.probe_list(kind)
    except Exception as exc:  # unreachable, forbidden, CRDs missing
        print(f"kubernetes: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    kn = "present" if knowledge is not None else "MISSING (placements will count cr_slot=error)"
    print(f"kubernetes: ok, Knowledge flavor-groups {kn}")
    return 0


async def _auto_create(admin_args: dict[str, object]) -> bool:
    """Whether the brokers create topics on first use (auto.create.topics.enable)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(**admin_args, request_timeout_ms=10000)
    try:
        await admin.start()
        brokers = [b.nodeId for b in admin._client.cluster.brokers()]
        described = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.BROKER, str(brokers[0]))]
        )
        for response in described:
            for resource in response.resources:
                for entry in resource[4]:
                    if entry[0] == "auto.create.topics.enable":
                        return str(entry[1]).lower() == "true"
        return False
    except Exception:  # unknown: be strict and report the missing topics
        return False
    finally:
        await admin.close()
