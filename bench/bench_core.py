"""Micro-benchmark of the pure CR core: decode, index, classify.

Run: ``.venv/bin/python bench/bench_core.py [--requests N] [--seed S]``

Builds a synthetic cluster (10,000 hypervisors, 50,000 reservations, decoded through
``from_k8s`` from API-shaped dicts), classifies requests of 20 candidate hosts with both
classifiers, and repeats the classification on a 100-hypervisor cluster. The per-request
ratio between the two shows whether a query's cost depends on the cluster size (it must
not: the goal is <= 1.3).
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.crs import (
    SlotEvaluator,
    active_commitments,
    classify_no_host_found,
    classify_placement,
)
from service.model import (
    CommittedResource,
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


def build(n_hv: int, n_res: int, seed: int) -> Cluster:
    rng = random.Random(seed)
    hv_raw = [hv_dict(i, rng) for i in range(n_hv)]
    res_raw = [res_dict(i, n_hv, rng) for i in range(n_res)]
    cr_raw = [
        cr_dict(p, g, rng) for p in range(PROJECTS) for g in range(GROUPS) if rng.random() < 0.5
    ]

    start = time.perf_counter()
    hvs = [from_k8s(d, Hypervisor) for d in hv_raw]
    reservations = [from_k8s(d, Reservation) for d in res_raw]
    crs = [from_k8s(d, CommittedResource) for d in cr_raw]
    evaluator = SlotEvaluator.from_objects(hvs, reservations)
    # A watch cache keeps CRs indexed by (project, group); the request then reads one list.
    crs_index: dict[tuple[str, str], list[CommittedResource]] = {}
    for cr in crs:
        crs_index.setdefault((cr.spec.project_id, cr.spec.flavor_group_name), []).append(cr)
    elapsed = time.perf_counter() - start
    return Cluster(evaluator, crs_index, [h.metadata.name or "" for h in hvs], elapsed)


def classify_requests(
    cluster: Cluster, n_requests: int, hosts_per_request: int, seed: int
) -> list[float]:
    """Time both classifiers per request.

    Every request's project has an active, non-exhausted CR and (with 16,000
    project/group pairs over 5 slots a host) almost never a slot on its hosts: the
    worst case, where both classifiers look at every slot of every one of the 20 hosts.
    """
    rng = random.Random(seed)
    with_cr = sorted(cluster.crs_index)
    requests = []
    for _ in range(n_requests):
        project, group = rng.choice(with_cr)
        requests.append((project, group, rng.sample(cluster.hosts, hosts_per_request)))
    timings: list[float] = []
    ev = cluster.evaluator
    for project, group, hosts in requests:
        t0 = time.perf_counter_ns()
        active = active_commitments(cluster.crs_index.get((project, group), ()), project, group)
        classify_placement(ev, active, hosts, project, group)
        classify_no_host_found(active, ev, hosts, project, group, 8 * GI)
        timings.append((time.perf_counter_ns() - t0) / 1000.0)
    return timings


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--hosts-per-request", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-memory", action="store_true", help="skip the tracemalloc pass")
    args = parser.parse_args()

    print(f"python {sys.version.split()[0]}")
    results: dict[str, tuple[float, float]] = {}
    runs = (
        ("large", 10_000, 50_000, None),
        # Control: the large cluster, but requests only name its first 100 hosts. Same
        # code, same object count per request; only the memory the run touches shrinks.
        ("large-hot100", 10_000, 50_000, 100),
        ("small", 100, 500, None),
    )
    for label, n_hv, n_res, host_limit in runs:
        cluster = build(n_hv, n_res, args.seed)
        if host_limit is not None:
            cluster.hosts = cluster.hosts[:host_limit]
        # What a long-running service does after its initial LIST: move the (acyclic,
        # long-lived) cache out of the collector's way so a full collection does not
        # land in the middle of a request.
        gc.collect()
        gc.freeze()
        # Warm-up pass so every run is measured with warm caches, then the real run.
        classify_requests(cluster, 500, args.hosts_per_request, args.seed + 1)
        timings = classify_requests(cluster, args.requests, args.hosts_per_request, args.seed + 2)
        med, tail = statistics.median(timings), p99(timings)
        results[label] = (med, tail)
        print(
            f"{label:>12}: {n_hv:>6} hypervisors, {n_res:>6} reservations | "
            f"build {cluster.build_seconds:.2f} s | "
            f"per request ({args.hosts_per_request} hosts, both classifiers): "
            f"median {med:.1f} us, p99 {tail:.1f} us"
        )
        del cluster
        gc.unfreeze()
        gc.collect()

    for num in ("large", "large-hot100"):
        ratio_med = results[num][0] / results["small"][0]
        ratio_p99 = results[num][1] / results["small"][1]
        print(f"ratio {num}/small: median {ratio_med:.2f}, p99 {ratio_p99:.2f} (goal <= 1.3)")

    if not args.skip_memory:
        retained = retained_bytes(10_000, 50_000, args.seed)
        print(
            f"retained by decoded large cluster + indexes (tracemalloc): {retained / 2**20:.1f} MiB"
        )
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak RSS of the whole run (ru_maxrss, includes raw dicts): {maxrss_kib / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
