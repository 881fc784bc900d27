"""Micro-benchmark of the pure CR core: decode, index, classify.

Run: ``.venv/bin/python bench/bench_core.py [--requests N] [--repetitions R] [--seed S]``

Builds two synthetic clusters in one process, a large one (10,000 hypervisors, 50,000
reservations) and a small one (100 hypervisors, 500 reservations), both decoded through
``from_k8s`` from API-shaped dicts, with 5 slots per host and the *same*
CommittedResources. Both then classify the same request stream (the same project/group
sequence, 20 random candidate hosts of their own cluster each) with both classifiers.
After a warm-up, the repetitions alternate between the clusters so that load drift on a
shared machine hits both alike; each repetition's median and p99 are kept, and the
report gives the median over repetitions and the per-repetition ratio large/small. That
ratio shows whether a query's cost depends on the cluster size (the goal is <= 1.3).
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _verdict import check_workload, finish, goals

# Submodules, not the package: the script also runs against older trees for before/after.
from service.crs.classify import classify_no_host_found, classify_placement
from service.crs.commitments import active_commitments
from service.crs.evaluator import (
    HostSlots,
    SlotEvaluator,
    hv_free_memory,
    is_slot,
    reservation_remaining_memory,
)
from service.model import (
    CommittedResource,
    CrSlot,
    Hypervisor,
    Reservation,
    from_k8s,
)

GI = 2**30
PROJECTS = 2000
GROUPS = 8
LABEL = {"reservations.cortex.cloud/type": "committed-resource"}
READY = [
    {
        "type": "Ready",
        "status": "True",
        "reason": "Ready",
        "message": "",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
]


def hv_dict(i: int, rng: random.Random) -> dict[str, Any]:
    status: dict[str, Any] = {
        "capacity": {"memory": "1Ti", "cpu": "128"},
        "allocation": {"memory": f"{rng.randint(0, 900)}Gi", "cpu": str(rng.randint(0, 100))},
    }
    if i % 3 == 0:
        status["effectiveCapacity"] = {"memory": "900Gi", "cpu": "120"}
    return {
        "apiVersion": "kvm.cloud.sap/v1",
        "kind": "Hypervisor",
        "metadata": {"name": f"node-{i:05d}"},
        "status": status,
    }


def res_dict(i: int, n_hosts: int, rng: random.Random) -> dict[str, Any]:
    size = rng.choice([16, 32, 64, 128])
    allocations = {
        f"vm-{i}-{j}": {
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "resources": {
                "memory": rng.choice([4 * GI, 8 * GI, 16 * GI]),
                "cpu": rng.choice([1, 2, 4]),
            },
        }
        for j in range(rng.randint(0, 3))
    }
    return {
        "apiVersion": "cortex.cloud/v1alpha1",
        "kind": "Reservation",
        "metadata": {"name": f"cr-slot-{i:06d}", "labels": LABEL, "resourceVersion": str(i)},
        "spec": {
            "type": "CommittedResourceReservation",
            "targetHost": f"node-{rng.randrange(n_hosts):05d}",
            "resources": {"memory": f"{size}Gi", "cpu": str(size // 4)},
            "committedResourceReservation": {
                "projectID": f"project-{rng.randrange(PROJECTS)}",
                "resourceGroup": f"group-{rng.randrange(GROUPS)}",
                "allocations": allocations or None,
            },
        },
        "status": {"conditions": READY, "host": "x"},
    }


def cr_dict(project: int, group: int, rng: random.Random) -> dict[str, Any]:
    amount = rng.choice([256, 512, 1024])
    return {
        "spec": {
            "projectID": f"project-{project}",
            "flavorGroupName": f"group-{group}",
            "state": rng.choice(["confirmed", "guaranteed"]),
            "amount": f"{amount}Gi",
            "resourceType": "memory",
        },
        "status": {"usedResources": {"memory": f"{amount // 2}Gi"}},
    }


@dataclass
class Cluster:
    evaluator: SlotEvaluator
    crs_index: dict[tuple[str, str], list[CommittedResource]]
    hosts: list[str]
    build_seconds: float
    # The per-host indexes a watch cache holds, for the per-request constructor paths.
    free: dict[str, int]
    slots_by_host: dict[str, list[Reservation]]


def build(n_hv: int, n_res: int, seed: int) -> Cluster:
    rng = random.Random(seed)
    hv_raw = [hv_dict(i, rng) for i in range(n_hv)]
    res_raw = [res_dict(i, n_hv, rng) for i in range(n_res)]
    # Own generator: every cluster size gets exactly the same CommittedResources.
    cr_rng = random.Random(seed + 7)
    cr_raw = [
        cr_dict(p, g, cr_rng)
        for p in range(PROJECTS)
        for g in range(GROUPS)
        if cr_rng.random() < 0.5
    ]

    start = time.perf_counter()
    hvs = [from_k8s(d, Hypervisor) for d in hv_raw]
    reservations = [from_k8s(d, Reservation) for d in res_raw]
    crs = [from_k8s(d, CommittedResource) for d in cr_raw]
    evaluator = SlotEvaluator.from_objects(hvs, reservations)
    free = {h.metadata.name or "": hv_free_memory(h) for h in hvs}
    slots_by_host: dict[str, list[Reservation]] = {}
    for r in reservations:
        if is_slot(r):
            slots_by_host.setdefault(r.spec.target_host, []).append(r)
    # A watch cache keeps CRs indexed by (project, group); the request then reads one list.
    crs_index: dict[tuple[str, str], list[CommittedResource]] = {}
    for cr in crs:
        crs_index.setdefault((cr.spec.project_id, cr.spec.flavor_group_name), []).append(cr)
    elapsed = time.perf_counter() - start
    hosts = [h.metadata.name or "" for h in hvs]
    return Cluster(evaluator, crs_index, hosts, elapsed, free, slots_by_host)


Request = tuple[str, str, list[str]]


def make_requests(
    cluster: Cluster, groups: Sequence[tuple[str, str]], hosts_per_request: int, seed: int
) -> list[Request]:
    """One request per (project, group), each naming random hosts of ``cluster``.

    Each request's host strings are fresh copies, as they would be when decoded from a
    scheduler event (not the very objects the indexes hold as keys).
    """
    rng = random.Random(seed)
    return [
        (project, group, ["".join(h) for h in rng.sample(cluster.hosts, hosts_per_request)])
        for project, group in groups
    ]


Mode = Callable[[Cluster, list[str]], SlotEvaluator] | None


def per_request_ctor(cluster: Cluster, hosts: list[str]) -> SlotEvaluator:
    """List mode: summarise the request's hosts' Reservation lists for every request."""
    free, by_host = cluster.free, cluster.slots_by_host
    return SlotEvaluator(
        {h: free[h] for h in hosts if h in free},
        {h: HostSlots.from_reservations(by_host[h]) for h in hosts if h in by_host},
    )


def per_request_host_slots(cluster: Cluster, hosts: list[str]) -> SlotEvaluator:
    """Watch mode: the request's hosts' HostSlots as the cache keeps them."""
    free, by_host, ev = cluster.free, cluster.slots_by_host, cluster.evaluator
    return SlotEvaluator(
        {h: free[h] for h in hosts if h in free},
        {h: ev.host_slots(h) for h in hosts if h in by_host},
    )


Outcome = tuple[CrSlot, CrSlot]  # (placement, no-host-found) of one request


def classify_requests(
    cluster: Cluster, requests: Sequence[Request], mode: Mode = None
) -> tuple[list[float], list[Outcome]]:
    """Time both classifiers per request, in microseconds; and their results, which
    :func:`check_outcomes` checks (a classifier that returned early would look fast).

    Every request's project has an active, non-exhausted CR and (with 16,000
    project/group pairs over 5 slots a host) almost never a slot on its hosts: the
    worst case, where both classifiers look at every one of the 20 hosts. With a
    ``mode``, each request first builds its own evaluator over its hosts (timed too).
    """
    timings: list[float] = []
    outcomes: list[Outcome] = []
    ev = cluster.evaluator
    crs_index = cluster.crs_index
    clock = time.perf_counter_ns
    for project, group, hosts in requests:
        t0 = clock()
        if mode is not None:
            ev = mode(cluster, hosts)
        active = active_commitments(crs_index.get((project, group), ()), project, group)
        placed = classify_placement(ev, active, hosts, project, group)
        refused = classify_no_host_found(active, ev, hosts, project, group, 8 * GI)
        timings.append((clock() - t0) / 1000.0)
        outcomes.append((placed, refused))
    return timings, outcomes


def reference_placement(cluster: Cluster, project: str, group: str, hosts: Sequence[str]) -> CrSlot:
    """The placement's outcome read from the raw Reservations, not through the index
    the classifiers use: slot_used iff a slot of (project, group) on one of ``hosts``
    has memory left (every request's project has an active CR with room)."""
    used = any(
        r.spec.committed_resource_reservation is not None
        and r.spec.committed_resource_reservation.matches_group(project, group)
        and reservation_remaining_memory(r) > 0
        for h in hosts
        for r in cluster.slots_by_host.get(h, ())
    )
    return CrSlot.SLOT_USED if used else CrSlot.SLOT_MISSED


def check_outcomes(run: Run, outcomes: list[Outcome], *, reference: bool) -> None:
    """The workload the timings describe: every request has an active CR with room, so
    the placement is slot_used or slot_missed and the no-host-found slot_blocked or
    slot_exhausted; with ``reference``, each placement as read from the raw objects;
    and slot_missed for most requests (the worst case: every host looked at)."""
    label = run.label
    check_workload(
        len(outcomes) == len(run.requests),
        f"{label}: {len(outcomes)} results for {len(run.requests)} requests",
    )
    placed = {o[0] for o in outcomes}
    refused = {o[1] for o in outcomes}
    check_workload(
        placed <= {CrSlot.SLOT_USED, CrSlot.SLOT_MISSED},
        f"{label}: placements classified {sorted(placed)}, expected slot_used/slot_missed",
    )
    check_workload(
        refused <= {CrSlot.SLOT_BLOCKED, CrSlot.SLOT_EXHAUSTED},
        f"{label}: no-host-found classified {sorted(refused)}, "
        "expected slot_blocked/slot_exhausted",
    )
    if reference:
        for (project, group, hosts), (p, _) in zip(run.requests, outcomes, strict=True):
            want = reference_placement(run.cluster, project, group, hosts)
            check_workload(p == want, f"{label}: {project}/{group} classified {p}, not {want}")
    missed = sum(o[0] == CrSlot.SLOT_MISSED for o in outcomes) / len(outcomes)
    check_workload(
        missed >= 0.9, f"{label}: {missed:.1%} slot_missed, expected >= 90 % (the worst case)"
    )


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def retained_bytes(n_hv: int, n_res: int, seed: int) -> int:
    gc.collect()
    tracemalloc.start()
    cluster = build(n_hv, n_res, seed)
    # Drop the raw dicts (already unreachable) and measure what the decoded state keeps.
    gc.collect()
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del cluster
    return current


@dataclass
class Run:
    label: str
    cluster: Cluster
    requests: list[Request]
    mode: Mode
    medians: list[float]
    p99s: list[float]
    outcomes: list[Outcome] | None = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=5_000, help="per repetition")
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--hosts-per-request", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-memory", action="store_true", help="skip the tracemalloc pass")
    args = parser.parse_args()

    print(f"python {sys.version.split()[0]}")
    large = build(10_000, 50_000, args.seed)
    small = build(100, 500, args.seed)
    # Control: the large cluster, but requests name only its first 100 hosts. Same code,
    # same slots per request; only the memory the requests touch shrinks.
    hot100 = Cluster(
        large.evaluator,
        large.crs_index,
        large.hosts[:100],
        large.build_seconds,
        large.free,
        large.slots_by_host,
    )
    # The request stream: projects/groups that hold an active CR, the same for all runs.
    rng = random.Random(args.seed + 1)
    with_cr = sorted(large.crs_index)
    assert with_cr == sorted(small.crs_index)
    groups = [rng.choice(with_cr) for _ in range(args.requests)]
    warm_groups = [rng.choice(with_cr) for _ in range(args.warmup)]
    plans: list[tuple[str, Cluster, Mode]] = [
        ("large", large, None),
        ("large-hot100", hot100, None),
        ("small", small, None),
        # The per-request evaluators of list mode (summarised per request) and of
        # watch mode (the cache's summaries), over the request's hosts.
        ("large/ctor", large, per_request_ctor),
        ("small/ctor", small, per_request_ctor),
        ("large/hslots", large, per_request_host_slots),
        ("small/hslots", small, per_request_host_slots),
    ]
    # Same hosts for a cluster whatever the mode: only the evaluator differs.
    seeds = {id(large): args.seed + 2, id(hot100): args.seed + 3, id(small): args.seed + 4}
    runs = [
        Run(
            label,
            cluster,
            make_requests(cluster, groups, args.hosts_per_request, seeds[id(cluster)]),
            mode,
            [],
            [],
        )
        for label, cluster, mode in plans
    ]
    # What a long-running service does after its initial LIST: move the (acyclic,
    # long-lived) cache out of the collector's way so a full collection does not land
    # in the middle of a request.
    gc.collect()
    gc.freeze()
    for run in runs:
        warm = make_requests(run.cluster, warm_groups, args.hosts_per_request, 0)
        classify_requests(run.cluster, warm, run.mode)
    for _ in range(args.repetitions):
        for run in runs:
            timings, outcomes = classify_requests(run.cluster, run.requests, run.mode)
            run.medians.append(statistics.median(timings))
            run.p99s.append(p99(timings))
            # Every repetition, and every evaluator of a cluster, must say the same: the
            # first is checked against the raw objects, the others against it.
            first = next(
                (o.outcomes for o in runs if o.cluster is run.cluster and o.outcomes), None
            )
            check_outcomes(run, outcomes, reference=first is None)
            check_workload(
                first is None or first == outcomes,
                f"{run.label}: results differ from those of the same requests before",
            )
            run.outcomes = outcomes

    print(
        f"{args.repetitions} repetitions x {args.requests} requests of "
        f"{args.hosts_per_request} hosts, both classifiers; median over repetitions "
        f"[min..max of the repetitions' medians]"
    )
    by_label = {run.label: run for run in runs}
    for run in runs:
        n_hv = len(run.cluster.hosts) if run.label != "large-hot100" else 10_000
        print(
            f"{run.label:>13}: {n_hv:>6} hypervisors | build {run.cluster.build_seconds:.2f} s | "
            f"per request median {statistics.median(run.medians):.1f} us "
            f"[{min(run.medians):.1f}..{max(run.medians):.1f}], "
            f"p99 {statistics.median(run.p99s):.1f} us "
            f"[{min(run.p99s):.1f}..{max(run.p99s):.1f}]"
        )
    pairs = [("large", "small"), ("large-hot100", "small"), ("large/ctor", "small/ctor")]
    pairs.append(("large/hslots", "small/hslots"))
    ratios_ok: dict[str, bool] = {}
    for label, base_label in pairs:
        run, base = by_label[label], by_label[base_label]
        med_ratios = [a / b for a, b in zip(run.medians, base.medians, strict=True)]
        p99_ratios = [a / b for a, b in zip(run.p99s, base.p99s, strict=True)]
        print(
            f"ratio {label}/{base_label} per repetition: "
            f"median {statistics.median(med_ratios):.2f} "
            f"[{min(med_ratios):.2f}..{max(med_ratios):.2f}], "
            f"p99 {statistics.median(p99_ratios):.2f} "
            f"[{min(p99_ratios):.2f}..{max(p99_ratios):.2f}]"
            + (" (goal <= 1.3)" if (label, base_label) == ("large", "small") else "")
        )
        if (label, base_label) == ("large", "small"):
            # The goal is the service's path; the per-request rows are for comparison
            # (BENCHMARKS.md: only the flat index meets it).
            ratios_ok["median ratio large/small <= 1.3"] = statistics.median(med_ratios) <= 1.3
    del runs, by_label, run, base, large, small, hot100
    gc.unfreeze()
    gc.collect()

    if not args.skip_memory:
        retained = retained_bytes(10_000, 50_000, args.seed)
        print(
            f"retained by decoded large cluster + indexes (tracemalloc): {retained / 2**20:.1f} MiB"
        )
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak RSS of the whole run (ru_maxrss, includes raw dicts): {maxrss_kib / 1024:.1f} MiB")
    return goals(ratios_ok)


if __name__ == "__main__":
    finish(main)
