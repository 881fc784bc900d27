"""Cost of the allocation invariant monitor (issue 36): per watch event, and a full audit.

In-process, on generated objects (no dev stack): ``n`` hypervisors' worth of committed-
resource Reservations (5 per host, as bench/_common.py seeds them) with ``--vms`` VMs
each, plus a known set of planted violations (VMs listed twice, overfilled slots,
malformed allocations, slots without a host). Measured:

1. **Per watch event**: µs per changed Reservation fed to ``InvariantIndex.update``
   (what ``WatchClusterState._on_reservation`` adds per event): a placement written into
   a slot (one VM more) and taken out again, on a cluster of 5,000 and of 50,000
   Reservations. Goal: the cost does not grow with the cluster (ratio ≤ 1.5).
2. **The periodic tick** (``evaluate``): µs per tick with the planted duplicates.
3. **The full audit** at 10,000 hypervisors / 50,000 Reservations: decoding the LIST
   pages (JSON bytes, 500 per page, as the API server sends them) plus the index and the
   violations. Goal: ≤ 5 s. The API round trips of a real LIST are not included (the
   shared dev stack is not seeded with 50,000 Reservations for this; see BENCHMARKS.md
   for what a 50,000-object LIST costs the watch cache).
4. The index's memory at 50,000 Reservations (tracemalloc).

Times are CPU time of this process (``time.process_time``): the machine may be shared.
Every run checks its workload: the planted violations are found, exactly, at both sizes
and by the audit. Exits 1 when a check or a goal fails.

    .venv/bin/python bench/bench_invariants.py [--hosts 10000] [--vms 4] [--events 4000]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.crs.invariants import KINDS, InvariantIndex, Kind, audit
from service.model import Reservation, from_k8s
from service.model.decode import encode_k8s

RES_PER_HOST = 5
PAGE = 500
TS = "2026-01-01T00:00:00Z"
PLANTED = 10  # of each kind
GOAL_RATIO = 1.5
GOAL_AUDIT_S = 5.0


class _Page(msgspec.Struct):
    items: list[Reservation] = []


def vm(i: int, j: int) -> str:
    return str(uuid.UUID(int=(i << 16) + j))


def reservation(i: int, vms: int, *, host: str | None = None) -> dict[str, Any]:
    """Reservation ``i`` (host i // 5): a 32Gi slot with ``vms`` VMs of 4Gi."""
    allocs = {
        vm(i, j): {"creationTimestamp": TS, "resources": {"memory": "4Gi", "cpu": "2"}}
        for j in range(vms)
    }
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "Reservation",
        "metadata": {
            "name": f"res-{i:06d}",
            "resourceVersion": str(1000 + i),
            "labels": {"reservations.cortex.cloud/type": "committed-resource"},
        },
        "spec": {
            "type": "CommittedResourceReservation",
            "targetHost": f"hv-{i // RES_PER_HOST:05d}" if host is None else host,
            "resources": {"memory": "32Gi", "cpu": "16"},
            "committedResourceReservation": {
                "projectID": f"p-{i % 1000:04d}",
                "resourceGroup": "gp_v2",
                "allocations": allocs,
            },
        },
        "status": {"host": f"hv-{i // RES_PER_HOST:05d}"},
    }


def cluster(n_res: int, vms: int) -> list[dict[str, Any]]:
    """``n_res`` Reservations, the first 4 * PLANTED of them in violation (one kind per
    group of PLANTED): VMs listed twice, overfilled, malformed, without host."""
    objs = [reservation(i, vms) for i in range(n_res)]
    for k in range(PLANTED):
        # vm_in_multiple_slots: reservation k also lists a VM of one in the middle.
        objs[k]["spec"]["committedResourceReservation"]["allocations"][vm(k + n_res // 2, 0)] = {
            "creationTimestamp": TS,
            "resources": {"memory": "1Gi"},
        }
        # slot_overfilled: 9 VMs of 4Gi in a 32Gi slot (36 - 4 >= 32).
        o = objs[PLANTED + k]
        o["spec"]["committedResourceReservation"]["allocations"] = {
            vm(PLANTED + k, j): {"creationTimestamp": TS, "resources": {"memory": "4Gi"}}
            for j in range(9)
        }
        # allocation_malformed: no creationTimestamp.
        m = objs[2 * PLANTED + k]["spec"]["committedResourceReservation"]["allocations"]
        m[vm(2 * PLANTED + k, 0)] = {"resources": {"memory": "4Gi"}}
        # allocation_without_host.
        objs[3 * PLANTED + k]["spec"]["targetHost"] = ""
    return objs


def decoded(objs: list[dict[str, Any]]) -> list[Reservation]:
    return [from_k8s(o, Reservation) for o in objs]


def check(index: InvariantIndex, n_res: int, what: str) -> list[str]:
    want = dict.fromkeys(KINDS, PLANTED)
    got = index.counts()
    if got != want:
        return [f"{what}: found {dict(got)}, planted {PLANTED} of each kind"]
    dup = index.violations(Kind.VM_IN_MULTIPLE_SLOTS)
    if [v.object for v in dup] != sorted(vm(k + n_res // 2, 0) for k in range(PLANTED)):
        return [f"{what}: the wrong VMs in multiple slots"]
    return []


def per_event_us(n_res: int, vms: int, events: int, repeats: int = 9) -> tuple[float, list[str]]:
    """Median over ``repeats`` of the µs per update, on an index of ``n_res``."""
    objs = cluster(n_res, vms)
    items = decoded(objs)
    index = InvariantIndex(grace_s=0)
    for r in items:
        index.put(r)
    index.evaluate()
    problems = check(index, n_res, f"{n_res} reservations")
    # The events: a placement written into a slot (one VM more), then taken out again,
    # on as many distinct Reservations at both sizes (each touched once per pass), spread
    # over the whole cluster (not one hot object).
    # Not the planted ones: they stay as planted (checked before and after).
    first = 4 * PLANTED
    if events > n_res - first:
        raise ValueError("--events must not exceed the smaller cluster's reservations")
    step = (n_res - first) // events
    targets = [first + i * step for i in range(events)]
    grown = []
    for i in targets:
        o = reservation(i, vms + 1)
        o["metadata"]["resourceVersion"] = str(10**9 + i)
        grown.append(from_k8s(o, Reservation))
    back = [items[i] for i in targets]
    gc.collect()
    gc.freeze()  # as the service does once its cache has synced (runtime._heap_keeper)
    runs = []
    index.touched = 0
    try:
        for _ in range(repeats):
            started = time.process_time()
            for old, new in zip(back, grown, strict=True):
                index.update(old, new)
            for old, new in zip(grown, back, strict=True):
                index.update(old, new)
            runs.append((time.process_time() - started) / (2 * events) * 1e6)
    finally:
        gc.unfreeze()
    # The work counted, not timed: each update adds or removes the one VM that changed
    # at any cluster size.
    per_update = index.touched / (2 * events * repeats)
    print(f"    ({n_res} reservations: {per_update:.4f} VM entries touched per update)")
    if per_update != 1.0:
        problems.append(f"{n_res}: {per_update:.4f} VM entries touched per update, expected 1")
    index.evaluate()
    problems += check(index, n_res, f"{n_res} reservations after the events")
    return statistics.median(runs), problems


def tick_us(index: InvariantIndex, repeats: int = 1000) -> float:
    started = time.process_time()
    for _ in range(repeats):
        index.evaluate()
    return (time.process_time() - started) / repeats * 1e6


def full_audit(n_res: int, vms: int) -> tuple[float, float, float, int, InvariantIndex]:
    """Seconds to decode the LIST pages, to build and evaluate the index; the index."""
    objs = cluster(n_res, vms)
    pages = [encode_k8s({"items": objs[i : i + PAGE]}) for i in range(0, n_res, PAGE)]
    started = time.process_time()
    items: list[Reservation] = []
    for raw in pages:
        items.extend(from_k8s(raw, _Page).items)
    decoded_at = time.process_time()
    index = audit(items, grace_s=900, now=time.time())
    found = [v for kind in KINDS for v in index.violations(kind)]
    done = time.process_time()
    return decoded_at - started, done - decoded_at, done - started, len(found), index


def index_memory(n_res: int, vms: int) -> float:
    items = decoded(cluster(n_res, vms))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = InvariantIndex()
    for r in items:
        index.put(r)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(index) == n_res
    return (after - before) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=10_000, help="hypervisors (5 slots each)")
    parser.add_argument("--vms", type=int, default=4, help="VMs per slot")
    parser.add_argument(
        "--events",
        type=int,
        default=4_000,
        help="distinct Reservations updated per pass (at most the smaller cluster's size)",
    )
    args = parser.parse_args()
    big = args.hosts * RES_PER_HOST
    small = big // 10
    problems: list[str] = []

    print(
        f"per watch event ({args.vms} VMs per slot, {args.events} slots x 2 updates, "
        "median of 9 passes):"
    )
    small_us, p = per_event_us(small, args.vms, args.events)
    problems += p
    big_us, p = per_event_us(big, args.vms, args.events)
    problems += p
    ratio = big_us / small_us
    print(f"  {small:>6} reservations: {small_us:6.2f} us CPU per changed Reservation")
    print(f"  {big:>6} reservations: {big_us:6.2f} us CPU per changed Reservation")
    print(f"  ratio {ratio:.2f} (goal <= {GOAL_RATIO})")
    if ratio > GOAL_RATIO:
        problems.append(f"per-event cost grows with the cluster: ratio {ratio:.2f}")

    decode_s, index_s, total_s, found, index = full_audit(big, args.vms)
    problems += check(index, big, "audit")
    if found != 4 * PLANTED:
        problems.append(f"audit: {found} violations listed, {4 * PLANTED} planted")
    print(f"full audit of {big} reservations ({args.hosts} hosts), in-process:")
    print(f"  decode the LIST pages: {decode_s:.2f} s; index + violations: {index_s:.2f} s (CPU)")
    print(f"  total {total_s:.2f} s CPU (goal <= {GOAL_AUDIT_S} s)")
    if total_s > GOAL_AUDIT_S:
        problems.append(f"audit of {big} took {total_s:.2f} s")

    live = InvariantIndex(grace_s=0)
    for r in decoded(cluster(big, args.vms)):
        live.put(r)
    print(f"tick (evaluate) with {PLANTED} VMs listed twice: {tick_us(live):.1f} us CPU")
    print(f"index memory at {big} reservations: {index_memory(big, args.vms):.1f} MiB")

    for line in problems:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
