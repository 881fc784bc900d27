"""A take-over cannot put a VM into a second slot, whatever the timing of the previous
owner's write (issue 36), on the real broker and API server with two replica processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests import e2e
from tests import factories as f
from tests.conftest import DevStack
from tests.hold_proxy import HoldProxy
from tests.integration.test_engine_faults import Replicas, replicas, topics_for, wait_group

pytestmark = pytest.mark.integration

__all__ = ["replicas"]  # the fixture, shared with the engine's fault tests


async def seed_two_slots(api: Any) -> None:
    """hv-1 with p1's slot-a (16Gi) and slot-b (no memory yet, so never picked)."""
    await f.create(api, f.hypervisor("hv-1", memory="256Gi"))
    await f.create(api, f.knowledge([f.flavor_group("g1", [f.flavor("m1.small", 4096, 2)])]))
    await f.create(api, f.committed_resource("cr-p1", project="p1", amount="256Gi", used="0"))
    await f.create(api, f.reservation("slot-a", host="hv-1", project="p1", memory="16Gi"))
    await f.create(api, f.reservation("slot-b", host="hv-1", project="p1", memory="0"))


SENTINEL = {"creationTimestamp": "2026-01-01T00:00:00Z", "resources": {"memory": "1Gi"}}


async def owner_of_the_partition(ports: dict[str, int], r: Replicas) -> str:
    """The replica that owns the topic's one partition once the group has settled."""
    deadline = time.monotonic() + 60
    while True:
        owned = {
            name: (await e2e.metrics_at(port)).get(("crs_assigned_partitions", ()), 0.0)
            for name, port in ports.items()
        }
        if sorted(owned.values()) == [0.0, 1.0]:
            return next(name for name, n in owned.items() if n == 1.0)
        assert time.monotonic() < deadline, f"no single owner: {owned}\n{r.logs()}"
        await asyncio.sleep(0.2)


async def test_a_write_held_in_flight_across_a_takeover_cannot_land_a_second_allocation(
    devstack: DevStack,
    clean_k8s: Any,
    new_topic: Any,
    replicas: Replicas,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The owner's guarded PATCH of slot-a is held on its way to the API server, then the
    owner is SIGKILLed. The other replica takes the partition over and replays the
    placement while another actor has grown slot-b, which now wins the tie (smaller
    remaining): slot-b is written. Then the held bytes reach the API server.

    Without the take-over fence (checked once by reverting Recorder._claim_slot's replay
    branch to a plain re-read): the held PATCH answers 200 and the VM is in slot-a and
    slot-b. With it: the survivor fenced both candidates before deciding, the held PATCH
    answers 409, the VM is in slot-b only, and neither the audit nor the survivor's
    invariant monitor finds a VM in two slots.
    """
    await seed_two_slots(clean_k8s)
    topics = topics_for(monkeypatch, await e2e.new_topics(new_topic, 1))
    boot = devstack.kafka_bootstrap
    group = f"g-{topics['input']}"
    upstream = int(devstack.apiserver.rsplit(":", 1)[1])
    pki = devstack.run_dir / "pki"
    ports = {name: e2e.free_port() for name in ("a", "b")}
    async with HoldProxy(upstream, pki) as proxy_a, HoldProxy(upstream, pki) as proxy_b:
        proxies = {"a": proxy_a, "b": proxy_b}
        for name, proxy in proxies.items():
            # Each replica behind a proxy of its own (only the owner's is armed). Its own
            # request timeout far beyond the test: its client must not give up and
            # re-send the write on another connection before it is killed.
            replicas.spawn(
                name,
                topics,
                KUBECONFIG=str(proxy.kubeconfig(tmp_path / f"{name}.kubeconfig")),
                CRS_K8S_TIMEOUT_S="600",
                CRS_HTTP_PORT=str(ports[name]),
                CRS_INVARIANT_GRACE_S="0",  # a VM in two slots shows at once
            )
        for name in proxies:
            await replicas.synced(name)
        await wait_group(boot, group, 2, timeout_s=60)
        owner = await owner_of_the_partition(ports, replicas)
        other = "b" if owner == "a" else "a"

        proxies[owner].armed = True
        vm, decision, request = e2e.outcome("hv-1", ["hv-1"])
        await e2e.publish(boot, topics["input"], [e2e.good_record(vm, decision, request)])
        async with asyncio.timeout(60):
            await proxies[owner].held_event.wait()
        os.kill(replicas.procs[owner].pid, signal.SIGKILL)
        replicas.procs[owner].wait(timeout=10)
        del replicas.procs[owner]  # dead on purpose: not a failure of assert_running

        # Another actor (an operator, Cortex's commitments controller) grows slot-b.
        await f.merge_patch(
            clean_k8s, "reservations", "slot-b", {"spec": {"resources": {"memory": "8Gi"}}}
        )

        (out,) = await e2e.read_all(boot, topics["output"], 1, timeout_s=90)
        decided = e2e.data_of(out)
        answer = await proxies[owner].release()
        slots = {n: await f.get(clean_k8s, "reservations", n) for n in ("slot-a", "slot-b")}
        holding = [
            n
            for n, obj in slots.items()
            if vm in (obj["spec"]["committedResourceReservation"].get("allocations") or {})
        ]
        assert (decided["allocation"], decided["reservation"]) == ("written", "slot-b"), decided
        assert holding == ["slot-b"], f"the VM is in {holding}; the held PATCH answered {answer!r}"
        assert " 409 " in answer, answer
        # The invariant monitor agrees, in both its forms. The one-shot audit reads the API:
        clean = await asyncio.to_thread(e2e.audit, devstack.kubeconfig, "--json", grace_s="0")
        assert clean.returncode == 0, (clean.stdout, clean.stderr)
        # The survivor's gauge, once it has had its chance: a VM planted in both slots after
        # the release shows, and it is the only one (its watches go through its proxy,
        # hence inside this block).
        sentinel = {
            "spec": {"committedResourceReservation": {"allocations": {"vm-sentinel": SENTINEL}}}
        }
        for name in ("slot-a", "slot-b"):
            await f.merge_patch(clean_k8s, "reservations", name, sentinel)
        duplicated = ("crs_allocation_invariant_violations", (("kind", "vm_in_multiple_slots"),))
        deadline = time.monotonic() + 30
        while (seen := (await e2e.metrics_at(ports[other])).get(duplicated, 0.0)) < 1:
            assert time.monotonic() < deadline, (
                f"the monitor never saw the sentinel\n{replicas.logs()}"
            )
            await asyncio.sleep(0.2)
        assert seen == 1, f"{seen} VMs in more than one slot"

    survivor_log = (replicas.log_dir / f"{other}.log").read_text(errors="replace")
    assert "never retrieved" not in survivor_log
