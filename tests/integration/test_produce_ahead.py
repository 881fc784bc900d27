"""A placement's classification produced ahead of its write (CRS_TXN_PRODUCE_AHEAD_MS),
end to end: the service on the real broker, the real API server behind a proxy that
holds the placement's PATCH.

While the PATCH is held, the classification is already in the partition's open
transaction: a read_uncommitted reader of the output topic sees it, a read_committed one
does not. When the write is answered as told, that record is what gets committed, once.
When it is not answered within the window, or the write ends otherwise (a conflict: the
slot changed meanwhile), the transaction is aborted and the decision's own output is
committed afterwards: read_committed readers see exactly one classification, and it
says what was written.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from service.app.runtime import Runtime
from tests import e2e
from tests import factories as f
from tests.conftest import DevStack
from tests.hold_proxy import HoldProxy

pytestmark = pytest.mark.integration

SLOT = "slot-p1-hv1"


async def _uncommitted(boot: str, topic: str, expected: int) -> list[ConsumerRecord]:
    """Every record of ``topic`` (one partition), of open and aborted transactions too."""
    return await e2e.read_all(
        boot, topic, expected, timeout_s=20, isolation_level="read_uncommitted"
    )


def _ahead(runtime: Runtime, outcome: str) -> float:
    value = runtime.metrics.registry.get_sample_value(
        "crs_outputs_produced_ahead_total", {"outcome": outcome}
    )
    return value or 0.0


async def _until(check: Any, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("ending", ["as-told", "not-answered-in-time", "conflict"])
async def test_a_placements_output_is_produced_ahead_and_published_once(
    devstack: DevStack, clean_k8s: Any, new_topic: Any, tmp_path: Path, ending: str
) -> None:
    await e2e.seed_region(clean_k8s)
    topics = await e2e.new_topics(new_topic, 1)
    boot, out = devstack.kafka_bootstrap, topics["output"]
    upstream = int(devstack.apiserver.rsplit(":", 1)[1])
    window_ms = "300" if ending == "not-answered-in-time" else "600000"
    async with HoldProxy(upstream, devstack.run_dir / "pki") as proxy:
        cfg = e2e.config(
            devstack,
            topics,
            KUBECONFIG=str(proxy.kubeconfig(tmp_path / "held.kubeconfig")),
            CRS_K8S_TIMEOUT_S="600",  # the held PATCH must not time out and be re-sent
            CRS_TXN_PRODUCE_AHEAD_MS=window_ms,
        )
        async with e2e.running(cfg) as runtime:
            # A first event: the partition is taken over and the output topic known.
            await e2e.publish(
                boot, topics["input"], [e2e.good_record(*e2e.outcome(None, ["hv-3"]))]
            )
            assert len(await e2e.read_all(boot, out, 1, timeout_s=30)) == 1

            proxy.armed = True
            vm, decision, request = e2e.outcome("hv-1", ["hv-1"])
            await e2e.publish(boot, topics["input"], [e2e.good_record(vm, decision, request)])
            async with asyncio.timeout(30):
                await proxy.held_event.wait()
            held = time.monotonic()
            # The classification is in the open transaction before the write is answered.
            told = await _uncommitted(boot, out, 2)
            assert len(told) == 2
            assert (e2e.data_of(told[1])["instance_uuid"], e2e.data_of(told[1])["reservation"]) == (
                vm,
                SLOT,
            )
            # Not published. (Quick: the transaction opened ahead is aborted after 5 s
            # without a decision, which these cases must not meet.)
            assert len(await e2e.read_all(boot, out, 2, timeout_s=1)) == 1
            if ending == "not-answered-in-time":
                await _until(lambda: _ahead(runtime, "discarded") == 1, "never discarded")
                # By the 300 ms window, not the 5 s bound of the transaction opened ahead.
                assert time.monotonic() - held < 4
            if ending == "conflict":
                # The slot changes meanwhile: the held PATCH's resourceVersion is stale.
                await f.merge_patch(
                    clean_k8s, "reservations", SLOT, {"metadata": {"labels": {"touched": "yes"}}}
                )
            status = await proxy.release()
            assert status.startswith("HTTP/1.1 409" if ending == "conflict" else "HTTP/1.1 200")
            outputs = await e2e.read_all(boot, out, 2, timeout_s=30)
            await _until(
                lambda: runtime.stream is not None and runtime.stream.processed == 2, "not counted"
            )
            published, discarded = _ahead(runtime, "published"), _ahead(runtime, "discarded")

    assert len(outputs) == 2  # read_committed: the placement's classification once
    data = e2e.data_of(outputs[1])
    assert (data["instance_uuid"], data["allocation"], data["reservation"]) == (vm, "written", SLOT)
    slot = await f.get(clean_k8s, "reservations", SLOT)
    assert list(slot["spec"]["committedResourceReservation"]["allocations"]) == [vm]
    if ending == "as-told":
        assert (published, discarded) == (1, 0)
        assert len(await _uncommitted(boot, out, 3)) == 2  # produced once, never again
    else:
        assert (published, discarded) == (0, 1)
        assert len(await _uncommitted(boot, out, 3)) == 3  # the aborted one, then its own
