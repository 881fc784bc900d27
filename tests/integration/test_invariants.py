"""The allocation invariant monitor on the real stack: each violation planted by hand,
seen on a running service's /metrics and in ``crs-consumer audit`` (report and exit
code), and a clean cluster reporting nothing.

What the dev stack's CRD (schemas/crds/, the upstream schema's validation) lets through
decides what can be planted as ``allocation_malformed``: a missing ``creationTimestamp``
and free text there are refused by the API server (``required``, ``format: date-time``),
so the planted ones are a negative memory, an allocation without memory, a timestamp the
API server's date-time check accepts but Go's RFC 3339 parser (metav1.Time) does not
(lower-case ``t``/``z``), and a memory quantity that matches the CRD's pattern but that
the service's model cannot hold (``1e5000``: the Reservation does not decode; the
informer and the audit's LIST report it).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from tests import e2e
from tests import factories as f
from tests.conftest import DevStack

KINDS = (
    "vm_in_multiple_slots",
    "slot_overfilled",
    "allocation_malformed",
    "allocation_without_host",
)
GRACE_S = 3
MERGE = "application/merge-patch+json"
OLD = (datetime.now(UTC) - timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")


def alloc(memory: str | None = "4Gi", ts: str = OLD, cpu: str = "2") -> dict[str, Any]:
    resources = {"cpu": cpu} if memory is None else {"memory": memory, "cpu": cpu}
    return {"creationTimestamp": ts, "resources": resources}


async def gauge(port: int) -> dict[str, float]:
    samples = await e2e.metrics_at(port)
    return {
        kind: samples[("crs_allocation_invariant_violations", (("kind", kind),))] for kind in KINDS
    }


async def gauge_becomes(port: int, want: dict[str, float], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while (got := await gauge(port)) != want:
        assert time.monotonic() < deadline, f"gauge {got}, expected {want}"
        await asyncio.sleep(0.2)


@pytest.fixture
async def topics(new_topic: Any) -> dict[str, str]:
    return await e2e.new_topics(new_topic, 1)


async def test_planted_violations_show_on_the_gauge_and_in_the_audit(
    devstack: DevStack, clean_k8s: Any, topics: dict[str, str]
) -> None:
    api = clean_k8s
    # A clean cluster (a slot with allocations, full but not overfilled): nothing found.
    await f.create(
        api, f.reservation("ok", host="hv-1", allocations={"vm-ok": alloc(), "vm-ok2": alloc()})
    )
    clean = await asyncio.to_thread(e2e.audit, devstack.kubeconfig)
    assert clean.returncode == 0, (clean.stdout, clean.stderr)
    assert "1 committed-resource reservations checked" in clean.stdout
    assert "vm_in_multiple_slots=0, slot_overfilled=0" in clean.stdout

    cfg = e2e.config(devstack, topics, CRS_INVARIANT_GRACE_S=str(GRACE_S))
    async with e2e.running(cfg) as runtime:
        assert runtime.http is not None
        port = runtime.http.port
        await gauge_becomes(port, dict.fromkeys(KINDS, 0.0))
        planted = [
            f.reservation("over", host="hv-1", allocations={f"vm-o{i}": alloc() for i in range(3)}),
            f.reservation("neg", host="hv-1", allocations={"vm-n": alloc("-1Gi")}),
            f.reservation("nomem", host="hv-1", allocations={"vm-m": alloc(None)}),
            f.reservation("lowts", host="hv-1", allocations={"vm-t": alloc(ts=OLD.lower())}),
            f.reservation("huge", host="hv-1", allocations={"vm-h": alloc("1e5000")}),
            f.reservation("nohost", host="", allocations={"vm-x": alloc()}),
            # Listed twice since two hours (by its timestamps), and twice just now.
            f.reservation("dup-a", host="hv-1", allocations={"vm-dup": alloc("1Gi")}),
            f.reservation("fresh-a", host="hv-2", allocations={"vm-fresh": alloc("1Gi")}),
        ]
        versions = {}
        for obj in planted:
            made = await f.create(api, obj)
            versions[made["metadata"]["name"]] = made["metadata"]["resourceVersion"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await gauge_becomes(
            port,
            {
                "vm_in_multiple_slots": 0.0,
                "slot_overfilled": 1.0,
                "allocation_malformed": 4.0,
                "allocation_without_host": 1.0,
            },
        )
        # The second listings, last: from here on no watch event happens, and the
        # duplicates must still show once the grace has passed (the monitor's tick).
        await f.create(
            api, f.reservation("dup-b", host="hv-2", allocations={"vm-dup": alloc("1Gi")})
        )
        await f.create(
            api,
            f.reservation("fresh-b", host="hv-1", allocations={"vm-fresh": alloc("1Gi", ts=now)}),
        )
        created = time.monotonic()
        await asyncio.sleep(GRACE_S / 2)
        assert (await gauge(port))["vm_in_multiple_slots"] == 0.0  # within the grace
        await gauge_becomes(
            port,
            {
                "vm_in_multiple_slots": 2.0,
                "slot_overfilled": 1.0,
                "allocation_malformed": 4.0,
                "allocation_without_host": 1.0,
            },
        )
        assert time.monotonic() - created >= GRACE_S

        # The audit: one-shot, its grace (900 s) counted from the timestamps: vm-fresh,
        # listed twice since a moment, is not reported; the rest is.
        found = await asyncio.to_thread(e2e.audit, devstack.kubeconfig, "--json")
        assert found.returncode == 1, (found.stdout, found.stderr)
        doc = json.loads(found.stdout)
        assert doc["checked"] == 11
        assert doc["grace_from"] == "creationTimestamp"
        assert doc["counts"] == {
            "vm_in_multiple_slots": 1,
            "slot_overfilled": 1,
            "allocation_malformed": 4,
            "allocation_without_host": 1,
        }
        got = {(v["kind"], v["object"]): v for v in doc["violations"]}
        assert set(got) == {
            ("vm_in_multiple_slots", "vm-dup"),
            ("slot_overfilled", "over"),
            ("allocation_malformed", "neg"),
            ("allocation_malformed", "nomem"),
            ("allocation_malformed", "lowts"),
            ("allocation_malformed", "huge"),
            ("allocation_without_host", "nohost"),
        }
        assert got[("vm_in_multiple_slots", "vm-dup")]["reservations"] == ["dup-a", "dup-b"]
        assert "is negative" in got[("allocation_malformed", "neg")]["detail"]
        assert "memory missing" in got[("allocation_malformed", "nomem")]["detail"]
        assert "not RFC 3339" in got[("allocation_malformed", "lowts")]["detail"]
        assert "does not decode" in got[("allocation_malformed", "huge")]["detail"]
        table = await asyncio.to_thread(e2e.audit, devstack.kubeconfig)
        assert table.returncode == 1
        assert table.stdout.splitlines()[0].split() == ["KIND", "OBJECT", "RESERVATIONS", "DETAIL"]
        assert "vm-dup" in table.stdout
        assert "dup-a,dup-b" in table.stdout

        # The runbook's fix: remove the entry by hand with a guarded merge patch. The
        # monitor sees the duplicate resolved. Neither the service nor the audit wrote
        # to any other planted Reservation (their resourceVersions are as created).
        co = client.CustomObjectsApi(api)
        dup_b = await f.get(api, "reservations", "dup-b")
        body = {
            "metadata": {"resourceVersion": dup_b["metadata"]["resourceVersion"]},
            "spec": {"committedResourceReservation": {"allocations": {"vm-dup": None}}},
        }
        await co.patch_cluster_custom_object(
            "cortex.cloud", "v1alpha1", "reservations", "dup-b", body, _content_type=MERGE
        )
        await gauge_becomes(
            port,
            {
                "vm_in_multiple_slots": 1.0,  # vm-fresh
                "slot_overfilled": 1.0,
                "allocation_malformed": 4.0,
                "allocation_without_host": 1.0,
            },
        )
        for name, rv in versions.items():
            assert (await f.get(api, "reservations", name))["metadata"]["resourceVersion"] == rv


def test_the_audit_says_in_one_line_when_the_api_server_cannot_be_reached(
    devstack: DevStack, tmp_path: Path
) -> None:
    broken = tmp_path / "kubeconfig"
    broken.write_text(
        Path(devstack.kubeconfig).read_text().replace(devstack.apiserver, "https://127.0.0.1:1")
    )
    proc = e2e.audit(str(broken))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("crs-consumer audit: FAILED: listing reservations: cannot reach")
    assert proc.stdout == ""


def test_the_audit_refuses_a_missing_kubeconfig(tmp_path: Path) -> None:
    proc = e2e.audit(str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "no such file" in proc.stderr
