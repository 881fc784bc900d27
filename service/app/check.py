"""``crs-consumer check``: can this configuration work, here and now?

Prints one line per dependency and exits non-zero with a one-line reason on the first
failure, so it serves as a Kubernetes init step or a first debugging command.
"""

from __future__ import annotations

import asyncio
import sys

from service.app.config import Config

__all__ = ["run_check"]


async def run_check(config: Config) -> int:
    from aiokafka.admin import AIOKafkaAdminClient

    from service.k8s import KubeClient

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
    missing = [t for t in (config.input_topic,) if t not in topics]
    note = f" (input topic {missing[0]} does not exist yet)" if missing else ""
    print(f"kafka: ok, {config.bootstrap_servers}{note}")

    try:
        client = await KubeClient.create(config.kubeconfig, request_timeout_s=config.k8s_timeout_s)
    except Exception as exc:  # a bad kubeconfig or missing service account
        print(f"kubernetes: FAILED to configure: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    try:
        knowledge = await client.get_knowledge()
        await client.list_reservations(limit=1)
    except Exception as exc:  # unreachable, forbidden, CRDs missing
        print(f"kubernetes: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    kn = "present" if knowledge is not None else "MISSING (placements will count cr_slot=error)"
    print(f"kubernetes: ok, Knowledge flavor-groups {kn}")
    return 0
