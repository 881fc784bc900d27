"""Shared plumbing of the service benchmarks (bench_throughput, bench_placements, ...).

Endpoints come from the environment only (``KAFKA_BOOTSTRAP_SERVERS``, ``KUBECONFIG``),
so the scripts run against any dev stack: ``set -a && . devstack/run/env && set +a``.

The benchmark cluster is a deterministic family of sizes: ``n`` hypervisors
``hv-00000..``, five committed-resource Reservations per host (slot 0 of every host
belongs to project ``p-bench``, 1 TiB, for placements; slots 1-4 to ``p-0000..``), one
CommittedResource per project and the demo ``flavor-groups`` Knowledge. Every object
carries the label ``crs-bench=true``; a marker Knowledge records the size seeded, so a
script asking for the size already there seeds nothing, one asking for more only adds
the missing hosts, and one asking for less wipes the bench objects (one deletecollection
per kind) and seeds afresh. Objects without the label are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import ssl
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from _verdict import WorkloadError, check_workload
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from crs_demo import scenario
from service.app.config import Config
from service.app.logs import configure_logging
from service.app.runtime import Runtime
from service.k8s import KubeClient
from service.stream.codec import encode_input
from service.stream.processor import Processor

GiB = 1024**3
BENCH_LABEL = "crs-bench"
SELECTOR = f"{BENCH_LABEL}=true"
MARKER = "crs-bench-marker"
RES_PER_HOST = 5
PROJECTS = 1000
PLACEMENT_PROJECT = "p-bench"
KINDS = {
    "hypervisors": ("kvm.cloud.sap", "v1"),
    "reservations": ("cortex.cloud", "v1alpha1"),
    "committedresources": ("cortex.cloud", "v1alpha1"),
    "knowledges": ("cortex.cloud", "v1alpha1"),
}
MERGE = "application/merge-patch+json"

Record = tuple[bytes | None, bytes, list[tuple[str, bytes]], int | None]  # key, value, hdrs, part


# --------------------------------------------------------------------------- environment


def env_endpoints() -> tuple[str, str]:
    """(bootstrap servers, kubeconfig) from the environment; exits with a hint if unset."""
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    kubeconfig = os.environ.get("KUBECONFIG")
    if not bootstrap or not kubeconfig:
        sys.exit(
            "KAFKA_BOOTSTRAP_SERVERS and KUBECONFIG must be set: "
            "devstack/up && set -a && . devstack/run/env && set +a"
        )
    return bootstrap, kubeconfig


def load() -> str:
    """The machine load (1/5/15-minute averages), printed next to every figure."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cpus)"


def quiet_logging() -> None:
    """The service's own JSON logging at INFO, rendered but written to /dev/null.

    The per-event log lines are part of the service's cost, so they are formatted as in
    production; only the terminal is spared.
    """
    configure_logging("INFO", "json", stream=open(os.devnull, "w"))  # noqa: SIM115


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; values need not be sorted."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


# --------------------------------------------------------------------------- Kafka


async def create_topics(bootstrap: str, partitions: dict[str, int]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, n, 1) for t, n in partitions.items()])
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, topics: Sequence[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(list(topics))
    except Exception as exc:  # best effort: leftovers only cost disk
        print(f"  (could not delete topics: {exc})")
    finally:
        await admin.close()


def topic_name(prefix: str) -> str:
    return f"bench-{prefix}-{uuid.uuid4().hex[:8]}"


async def publish(bootstrap: str, topic: str, records: Iterable[Record]) -> int:
    """Publish (acks=all, batched), in chunks so memory stays bounded; returns the count."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=20, max_batch_size=512 * 1024
    )
    await producer.start()
    n = 0
    try:
        pending: list[Any] = []
        for key, value, headers, partition in records:
            pending.append(
                await producer.send(topic, value, key=key, headers=headers, partition=partition)
            )
            n += 1
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return n


# --------------------------------------------------------------------------- events


def host(i: int) -> str:
    return f"hv-{i:05d}"


def project(i: int) -> str:
    return f"p-{i % PROJECTS:04d}"


def _vm(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def outcome_record(
    rng: random.Random,
    *,
    project_id: str,
    hosts: list[str],
    target: str | None,
    flavor: str = "m2.small",
    partition: int | None = None,
) -> Record:
    """One input record: a Nova outcome (CloudEvent, structured mode) keyed by the VM."""
    vm = _vm(rng)
    request = scenario.nova_request(
        instance_uuid=vm, project_id=project_id, flavor=flavor, hosts=hosts
    )
    decision = {
        "name": f"nova-{vm[:8]}",
        "result": {"targetHost": target, "orderedHosts": hosts if target else []},
    }
    value, headers = encode_input(decision, request, event_id=vm)
    return vm.encode(), value, headers, partition


def no_host_found(rng: random.Random, n_hv: int, n_hosts: int = 10) -> Record:
    """A no-host-found outcome of a project with an active, non-exhausted CR whose slots
    are (almost always) on none of the input hosts: the classifier queries every host."""
    hosts = [host(i) for i in rng.sample(range(n_hv), n_hosts)]
    return outcome_record(
        rng, project_id=project(rng.randrange(PROJECTS)), hosts=hosts, target=None
    )


def slot_missed(rng: random.Random, n_hv: int, n_hosts: int = 10) -> Record:
    """A placement that writes nothing (the project's slots are elsewhere): slot_missed.

    The project is drawn among those without a slot on the hosts: a random one had a
    gp_v2 slot on one of 20 hosts for about 3 % of the placements, each a PATCH in a
    stream meant to be read-only (found by checking the benchmark's outcome mix)."""
    picked = rng.sample(range(n_hv), n_hosts)
    taken = {owner for i in picked for owner, group, _ in slot_owners(i) if group == "gp_v2"}
    project_id = project(rng.randrange(PROJECTS))
    while project_id in taken:
        project_id = project(rng.randrange(PROJECTS))
    hosts = [host(i) for i in picked]
    return outcome_record(rng, project_id=project_id, hosts=hosts, target=hosts[0])


def slot_used(rng: random.Random, target: int, n_hv: int, partition: int | None = None) -> Record:
    """A placement on ``hv-target`` of project p-bench (1 TiB slot there): one patch."""
    others = [host(i) for i in rng.sample(range(n_hv), 3) if i != target]
    hosts = [host(target), *others[:2]]
    return outcome_record(
        rng, project_id=PLACEMENT_PROJECT, hosts=hosts, target=hosts[0], partition=partition
    )


# --------------------------------------------------------------------------- cluster


def _label(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["labels"][BENCH_LABEL] = "true"
    return obj


def slot_owners(i: int) -> list[tuple[str, str, int]]:
    """(project, flavor group, GiB) of the slots of ``hv-i`` after the p-bench one."""
    return [
        (project(i * 4 + j), *(("gp_v2", 32) if j % 2 else ("hana_v2", 128)))
        for j in range(1, RES_PER_HOST)
    ]


def host_objects(i: int) -> list[dict[str, Any]]:
    """Hypervisor ``hv-i`` and its five Reservations (API-server JSON, with status)."""
    rng = random.Random(i)
    objs = [_label(scenario.hypervisor(host(i), 1024, rng.randrange(0, 600, 16), None))]
    objs.append(
        _label(
            scenario.reservation(
                f"res-{i:05d}-0", host(i), PLACEMENT_PROJECT, "gp_v2", 1024, {}, True
            )
        )
    )
    for j, (owner, group, gib) in enumerate(slot_owners(i), start=1):
        objs.append(
            _label(scenario.reservation(f"res-{i:05d}-{j}", host(i), owner, group, gib, {}, True))
        )
    return objs


def shared_objects() -> list[dict[str, Any]]:
    """CommittedResources (one per project, active, room left) and the Knowledge."""
    objs = [
        _label(
            scenario.committed_resource(
                f"cr-{project(k)}", project(k), "gp_v2", "confirmed", "512Gi", "96Gi"
            )
        )
        for k in range(PROJECTS)
    ]
    objs.append(
        _label(
            scenario.committed_resource(
                "cr-p-bench", PLACEMENT_PROJECT, "gp_v2", "confirmed", "100Pi", "0"
            )
        )
    )
    objs.append(_label(scenario.knowledge()))
    return objs


def _plural(obj: dict[str, Any]) -> str:
    return {
        "Hypervisor": "hypervisors",
        "Reservation": "reservations",
        "CommittedResource": "committedresources",
        "Knowledge": "knowledges",
    }[obj["kind"]]


@dataclass
class SeedReport:
    hypervisors: int
    created: int = 0
    create_s: float = 0.0
    status_s: float = 0.0
    wiped: bool = False

    @property
    def total_s(self) -> float:
        return self.create_s + self.status_s

    def __str__(self) -> str:
        if not self.created:
            return f"cluster of {self.hypervisors} hypervisors already seeded"
        rate = self.created / self.total_s if self.total_s else 0.0
        wiped = ", after a wipe" if self.wiped else ""
        return (
            f"seeded {self.created} objects (to {self.hypervisors} hypervisors, "
            f"{self.hypervisors * RES_PER_HOST} reservations{wiped})"
            f" in {self.total_s:.1f}s: creates {self.create_s:.1f}s + status writes "
            f"{self.status_s:.1f}s, {rate:.0f} objects/s"
        )


def allocations_of(obj: dict[str, Any]) -> dict[str, Any]:
    """A Reservation's allocations by VM ({} when it has none), from its API JSON."""
    spec = obj.get("spec") or {}
    return (spec.get("committedResourceReservation") or {}).get("allocations") or {}


class Cluster:
    """Seeding and resetting the benchmark cluster through the API server.

    Plain aiohttp with the kubeconfig's credentials: kubernetes_asyncio's per-request
    serialisation costs about half the client CPU, which would make seeding twice as long.
    """

    def __init__(self, kube: KubeClient, concurrency: int = 48) -> None:
        cfg = kube.api_client.configuration
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        headers = {"Content-Type": "application/json"}
        token = (cfg.api_key or {}).get("BearerToken") or (cfg.api_key or {}).get("authorization")
        if token:
            headers["Authorization"] = token if " " in token else f"Bearer {token}"
        self.kube = kube
        self.base = cfg.host.rstrip("/")
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx, limit=concurrency), headers=headers
        )
        self.sem = asyncio.Semaphore(concurrency)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, kubeconfig: str) -> AsyncIterator[Cluster]:
        kube = await KubeClient.create(kubeconfig, request_timeout_s=120)
        cluster = cls(kube)
        try:
            yield cluster
        finally:
            await cluster.session.close()
            await kube.close()

    def url(self, plural: str, name: str = "", sub: str = "") -> str:
        g, v = KINDS[plural]
        return "/".join(p for p in (f"{self.base}/apis/{g}/{v}/{plural}", name, sub) if p)

    async def call(
        self, method: str, url: str, body: Any = None, content_type: str | None = None
    ) -> tuple[int, bytes]:
        """One request (retried on 429/5xx); returns (status, body)."""
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if content_type else None
        status, text = 0, b""
        async with self.sem:
            for attempt in range(6):
                async with self.session.request(method, url, data=data, headers=headers) as r:
                    status, text = r.status, await r.read()
                if status != 429 and status < 500:
                    break
                await asyncio.sleep(0.2 * 2**attempt)
        return status, text

    async def marker(self) -> int | None:
        status, body = await self.call("GET", self.url("knowledges", MARKER))
        if status == 404:
            return None
        ann = json.loads(body)["metadata"].get("annotations") or {}
        return int(ann.get("crs-bench/hypervisors", "-1"))

    async def _set_marker(self, n: int | None) -> None:
        await self.call("DELETE", self.url("knowledges", MARKER))
        if n is not None:
            g, v = KINDS["knowledges"]
            body = {
                "apiVersion": f"{g}/{v}",
                "kind": "Knowledge",
                "metadata": {
                    "name": MARKER,
                    "labels": {BENCH_LABEL: "true"},
                    "annotations": {"crs-bench/hypervisors": str(n)},
                },
                "spec": {"schedulingDomain": "nova", "recency": "60s"},
            }
            status, text = await self.call("POST", self.url("knowledges"), body)
            assert status < 300, (status, text[:300])

    async def wipe(self) -> None:
        """Delete every bench object (labelled ``crs-bench=true``), one request per kind."""
        await self._set_marker(None)
        for plural in KINDS:
            status, text = await self.call(
                "DELETE", self.url(plural) + f"?labelSelector={BENCH_LABEL}%3Dtrue"
            )
            assert status < 300, (plural, status, text[:300])

    async def _create(self, obj: dict[str, Any]) -> None:
        plural = _plural(obj)
        body = {k: val for k, val in obj.items() if k != "status"}
        status, text = await self.call("POST", self.url(plural), body)
        if status == 409 and plural == "knowledges":  # someone else's flavor-groups
            patch = {"metadata": {"labels": obj["metadata"]["labels"]}, "spec": obj["spec"]}
            url = self.url(plural, obj["metadata"]["name"])
            status, text = await self.call("PATCH", url, patch, MERGE)
        assert status < 300 or status == 409, (status, text[:300])

    async def _status(self, obj: dict[str, Any]) -> None:
        url = self.url(_plural(obj), obj["metadata"]["name"], "status")
        status, text = await self.call("PATCH", url, {"status": obj["status"]}, MERGE)
        assert status < 300, (status, text[:300])

    async def ensure(self, n_hv: int) -> SeedReport:
        """Make the bench cluster exactly ``n_hv`` hypervisors (see the module docstring):
        concurrent creates (semaphore), then concurrent status writes; both timed."""
        report = SeedReport(n_hv)
        current = await self.marker()
        if current is not None and not await self._intact(current):
            current = None  # someone deleted bench objects (a test's clean-up): seed afresh
        if current == n_hv:
            return report
        objs: list[dict[str, Any]] = []
        if current is None or current > n_hv:
            await self.wipe()
            report.wiped = True
            objs.extend(shared_objects())
            start = 0
        else:
            await self._set_marker(None)
            start = current
        for i in range(start, n_hv):
            objs.extend(host_objects(i))
        t = time.perf_counter()
        await asyncio.gather(*(self._create(o) for o in objs))
        report.create_s = time.perf_counter() - t
        t = time.perf_counter()
        await asyncio.gather(*(self._status(o) for o in objs if "status" in o))
        report.status_s = time.perf_counter() - t
        report.created = len(objs)
        await self._set_marker(n_hv)
        return report

    async def _intact(self, n_hv: int) -> bool:
        """The marker's cluster is still there: its first and last host's objects exist."""
        for i in {0, max(n_hv - 1, 0)}:
            for o in host_objects(i):
                status, _ = await self.call("GET", self.url(_plural(o), o["metadata"]["name"]))
                if status != 200:
                    return False
        return True

    async def allocations(self, name: str) -> dict[str, Any]:
        """The allocations of Reservation ``name`` by VM ({} when it has none or is not
        found): what a benchmark checks its writes against."""
        status, raw = await self.call("GET", self.url("reservations", name))
        return allocations_of(json.loads(raw)) if status == 200 else {}

    async def clear_allocations(self, names: Iterable[str]) -> None:
        """Remove the allocations of these Reservations (so repeated runs write alike)."""
        body = {"spec": {"committedResourceReservation": {"allocations": None}}}
        answers = await asyncio.gather(
            *(self.call("PATCH", self.url("reservations", n), body, MERGE) for n in names)
        )
        # A slot left full would let the next run's check count the last run's writes.
        failed = [status for status, _ in answers if status != 200]
        if failed:
            raise WorkloadError(f"clearing allocations: {len(failed)} PATCHes answered {failed[0]}")


# --------------------------------------------------------------------------- the service


class Timed:
    """Wraps ``Processor.process`` (class-level, bench-only) to time every call.

    ``spans`` holds (start, end) perf_counter pairs of each call: the time from the
    consume loop handing the record to the processor until its outcome record exists
    (decode, snapshot, classify, any patch, encode, log line). ``first`` is the start of
    the first call.
    """

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._orig: Any = None

    def install(self) -> None:
        orig = self._orig = Processor.process
        spans = self.spans

        async def process(self_: Processor, *args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return await orig(self_, *args, **kw)
            finally:
                spans.append((t, time.perf_counter()))

        Processor.process = process  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._orig is not None:
            Processor.process = self._orig  # type: ignore[method-assign]

    @property
    def first(self) -> float:
        return self.spans[0][0] if self.spans else float("inf")


def service_config(
    bootstrap: str, kubeconfig: str, topics: dict[str, str], tag: str, **extra: str
) -> Config:
    """The service's configuration for a run: defaults (watch mode, exactly-once, batch
    500) except the topics, a fresh group and transactional id, and any port."""
    fresh = f"{tag}-{uuid.uuid4().hex[:8]}"
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "KUBECONFIG": kubeconfig,
        "CRS_INPUT_TOPIC": topics["input"],
        "CRS_OUTPUT_TOPIC": topics["output"],
        "CRS_DLQ_TOPIC": topics["dlq"],
        "CRS_GROUP_ID": f"g-{fresh}",
        "CRS_HTTP_PORT": "0",
        "CRS_K8S_READ_MODE": "watch",
        "CRS_EXACTLY_ONCE": "true",
        # Experiments: BENCH_CRS_X=v in the benchmark's environment sets CRS_X=v for the
        # service under test (the service's own CRS_* are not passed: the dev stack's
        # env file must not change what a benchmark measures).
        **{
            k.removeprefix("BENCH_"): v for k, v in os.environ.items() if k.startswith("BENCH_CRS_")
        },
        **extra,
    }
    return Config.load(env=env)


@contextlib.asynccontextmanager
async def running_service(cfg: Config) -> AsyncIterator[tuple[Runtime, float]]:
    """Runtime in-process, consume loop running; yields (runtime, time the cache synced)."""
    runtime = Runtime(cfg)
    await runtime.start()
    task = asyncio.create_task(runtime.run())
    try:
        await runtime.state.wait_synced()
        yield runtime, time.perf_counter()
    finally:
        runtime.request_stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 60)
        await runtime.stop()


async def wait_processed(runtime: Runtime, n: int, timeout_s: float) -> float:
    """Wait until ``n`` events are committed; returns the perf_counter time it happened."""
    assert runtime.stream is not None
    deadline = time.monotonic() + timeout_s
    while runtime.stream.processed < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{runtime.stream.processed}/{n} processed in {timeout_s}s")
        await asyncio.sleep(0.005)
    return time.perf_counter()


def k8s_reads(runtime: Runtime) -> dict[str, float]:
    """``crs_k8s_requests_total`` summed by verb (from the service's own registry)."""
    out: dict[str, float] = {}
    for family in runtime.metrics.registry.collect():
        for s in family.samples:
            if s.name == "crs_k8s_requests_total":
                out[s.labels["verb"]] = out.get(s.labels["verb"], 0.0) + s.value
    return out


def outcomes(source: Runtime | str) -> dict[str, float]:
    """What the service made of its committed events (an in-process runtime's registry,
    or the text of a replica's /metrics): ``kind/cr_slot`` from ``crs_events_total``
    and ``dead_letter/<code>`` from ``crs_dead_letters_total``."""
    families = (
        text_string_to_metric_families(source)
        if isinstance(source, str)
        else source.metrics.registry.collect()
    )
    out: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            if s.name == "crs_events_total" and s.value:
                key = f"{s.labels['kind']}/{s.labels['cr_slot']}"
            elif s.name == "crs_dead_letters_total" and s.value:
                key = f"dead_letter/{s.labels['code']}"
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def check_mix(got: dict[str, float], n: int, want: dict[str, float]) -> None:
    """Check the outcomes of a run of ``n`` events against the mix the benchmark
    describes: ``want`` maps outcomes (``kind/cr_slot``; several joined by ``|`` count
    together) to their expected share. Any other outcome (a dead letter, say) fails, so
    does a share off by more than sampling explains (4 standard deviations, or 2 points),
    so does a total other than ``n``."""
    total = sum(got.values())
    check_workload(total == n, f"{total:.0f} outcomes counted for {n} events: {got}")
    known = {key for group in want for key in group.split("|")}
    stray = {k: v for k, v in got.items() if k not in known}
    check_workload(not stray, f"outcomes the workload does not make: {stray} (of {n})")
    for group, share in want.items():
        seen = sum(got.get(k, 0.0) for k in group.split("|")) / n
        slack = max(0.02, 4 * (share * (1 - share) / n) ** 0.5)
        check_workload(
            abs(seen - share) <= slack,
            f"{group}: {seen:.1%} of {n} events, expected {share:.0%} (all outcomes: {got})",
        )


def sample_sum(runtime: Runtime, name: str) -> float:
    return sum(
        float(s.value)
        for family in runtime.metrics.registry.collect()
        for s in family.samples
        if s.name == name
    )


# --------------------------------------------------------------------------- processes
#
# The engine benchmarks (bench_latency, bench_placements, bench_cpu) run the service and
# its raw reference loops as separate processes and judge them only from the outside:
# the group's committed offsets, what a read_committed reader sees, the objects in the
# API server and the process's CPU times in /proc. Nothing depends on the engine's
# internals, so the same scripts measure the engine before and after a rewrite.

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent


# The dev stack's pid files (devstack/up writes them), for the benchmarks that freeze or
# kill one of its servers.
DEVSTACK_RUN_DIR = Path(os.environ.get("CRS_DEVSTACK_RUN_DIR", REPO_DIR / "devstack" / "run"))


def devstack_pid(server: str) -> int:
    """The pid of a dev stack server (``kafka``, ``kube-apiserver``, ``etcd``)."""
    return int((DEVSTACK_RUN_DIR / f"{server}.pid").read_text())


async def devstack_up() -> None:
    """Run ``devstack/up`` (it starts whatever is down); RuntimeError if it fails."""
    import subprocess

    up = await asyncio.create_subprocess_exec(
        str(REPO_DIR / "devstack" / "up"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, err = await up.communicate()
    if up.returncode != 0:
        raise RuntimeError(f"devstack/up could not restart the broker: {err.decode()[-500:]}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service_env(cfg: Config, **extra: str) -> dict[str, str]:
    """The environment of ``python -m service run`` for ``cfg`` (plus ``extra``)."""
    return {**os.environ, **cfg.to_env(), **extra}


def spawn(args: Sequence[str], env: dict[str, str] | None, log_path: str) -> Any:
    """A child process (stdout+stderr to ``log_path``), in its own process group."""
    import subprocess

    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(args),
            cwd=REPO_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def spawn_service(cfg: Config, log_path: str, **extra: str) -> Any:
    return spawn([sys.executable, "-m", "service", "run"], service_env(cfg, **extra), log_path)


def stop_process(proc: Any, timeout_s: float = 40) -> int:
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return int(proc.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        return int(proc.wait(timeout=10))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Which process plays which part in a benchmark, by a marker in its command line.
ROLES = (
    ("kube-apiserver", "apiserver"),
    ("kafka.Kafka", "kafka"),
    ("crs-devstack/etcd", "etcd"),
    ("-m service run", "service"),
    ("raw_eos.py", "raw"),
    ("bench/", "bench"),
)


def cpu_by_role(skip: int | None = None) -> dict[str, float]:
    """CPU seconds so far of each role's processes (summed; the calling script is "bench"
    unless its pid is ``skip``)."""
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == skip:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            role = next((r for marker, r in ROLES if marker in cmd), None)
            if role is not None:
                out[role] = out.get(role, 0.0) + cpu_seconds(int(entry.name))
        except OSError:  # the process ended meanwhile
            continue
    return out


def cores_between(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, float]:
    """Average cores each role used between two ``cpu_by_role`` samples."""
    return {k: (v - before.get(k, 0.0)) / max(seconds, 1e-9) for k, v in after.items()}


@dataclass(frozen=True)
class RequestStats:
    """One verb's Kubernetes requests as the service's /metrics counts them."""

    count: int
    ok: int  # answered 2xx
    mean_s: float
    p99_le_s: float  # the histogram bucket holding the 99th percentile (an upper bound)


def request_stats(metrics_text: str, verb: str, kind: str = "reservations") -> RequestStats:
    """``verb`` requests on ``kind`` from the service's Prometheus text (empty: zeros)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: list[tuple[float, float]] = []
    count = total = ok = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for smp in family.samples:
            if smp.labels.get("verb") != verb or smp.labels.get("kind") != kind:
                continue
            if smp.name == "crs_k8s_request_duration_seconds_bucket":
                buckets.append((float(smp.labels["le"]), smp.value))
            elif smp.name == "crs_k8s_request_duration_seconds_count":
                count = smp.value
            elif smp.name == "crs_k8s_request_duration_seconds_sum":
                total = smp.value
            elif smp.name == "crs_k8s_requests_total" and smp.labels.get("code", "").startswith(
                "2"
            ):
                ok += smp.value
    p99 = next((le for le, n in sorted(buckets) if n >= 0.99 * count), float("inf"))
    return RequestStats(int(count), int(ok), total / count if count else 0.0, p99)


async def http_text(url: str, timeout_s: float = 10.0) -> str:
    """The body of a GET that must answer 200 (e.g. a /metrics scrape)."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.get(url) as resp,
    ):
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: {resp.status}")
        return await resp.text()


async def wait_http_ok(url: str, timeout_s: float, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited ({proc.returncode}) before {url} was OK")
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        return
                    last = f"{r.status} {(await r.text())[:200]}"
            except aiohttp.ClientError as exc:
                last = str(exc)
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not OK after {timeout_s}s: {last}")


async def group_state(bootstrap: str, group: str) -> tuple[str, int]:
    """(state, members) of a consumer group; ("unknown", 0) while it cannot be read."""
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([group])
        _error, _gid, state, _ptype, _protocol, members, *_ = response.groups[0]
        return str(state), len(members)
    except KafkaError:
        return "unknown", 0
    finally:
        await admin.close()


async def wait_group_stable(bootstrap: str, group: str, members: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    seen: tuple[str, int] = ("", 0)
    while time.monotonic() < deadline:
        seen = await group_state(bootstrap, group)
        if seen == ("Stable", members):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"group {group}: not Stable with {members} members after {timeout_s}s")


async def wait_committed(
    bootstrap: str, group: str, topic: str, n: int, timeout_s: float, proc: Any = None
) -> float:
    """Wait until ``group`` has committed ``n`` records of ``topic`` (offsets summed over
    partitions; the input topics here are not transactional, so offsets count records).
    Returns the perf_counter time it was seen; raises when it does not happen."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        done = 0
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited ({proc.returncode}); {done}/{n} committed")
            found = await admin.list_consumer_group_offsets(group)
            done = sum(m.offset for tp, m in found.items() if tp.topic == topic and m.offset > 0)
            if done >= n:
                return time.perf_counter()
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{done}/{n} records of {topic} committed in {timeout_s}s")
    finally:
        await admin.close()


class OutputReader:
    """A read_committed reader of one topic that stamps the arrival of each record by key
    (``time.monotonic``); values are kept for the workload checks."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        self.seen: dict[bytes, float] = {}
        self.values: list[bytes] = []
        self.count = 0
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            isolation_level="read_committed",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            fetch_max_wait_ms=50,
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        self._consumer.assign(self._tps)
        await self._consumer.seek_to_beginning(*self._tps)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            batch = await self._consumer.getmany(timeout_ms=100)
            now = time.monotonic()
            for records in batch.values():
                for r in records:
                    self.count += 1
                    self.values.append(r.value)
                    if r.key is not None:
                        self.seen.setdefault(bytes(r.key), now)

    async def wait_for(self, keys: Iterable[bytes], timeout_s: float) -> bool:
        wanted = set(keys)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if wanted.issubset(self.seen):
                return True
            await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()


def proxied_kubeconfig(kubeconfig: str, port: int, path: str) -> str:
    """A copy of ``kubeconfig`` whose server is ``https://127.0.0.1:port`` (the proxy)."""
    import re

    text = Path(kubeconfig).read_text()
    text, n = re.subn(r"server: https://[^\s]+", f"server: https://127.0.0.1:{port}", text)
    if n != 1:
        raise ValueError(f"expected one server in {kubeconfig}, found {n}")
    Path(path).write_text(text)
    return path


def apiserver_address(kubeconfig: str) -> tuple[str, int]:
    import re

    found = re.search(r"server: https://([^:\s]+):(\d+)", Path(kubeconfig).read_text())
    if found is None:
        raise ValueError(f"no https server with a port in {kubeconfig}")
    return found.group(1), int(found.group(2))


@contextlib.asynccontextmanager
async def delay_proxy_process(
    upstream: tuple[str, int], one_way_ms: float, log_path: str
) -> AsyncIterator[int]:
    """bench/delay_proxy.py as a child process; yields the port it listens on."""
    proc = spawn(
        [
            sys.executable,
            str(BENCH_DIR / "delay_proxy.py"),
            "--upstream",
            f"{upstream[0]}:{upstream[1]}",
            "--one-way-ms",
            str(one_way_ms),
        ],
        None,
        log_path,
    )
    try:
        deadline = time.monotonic() + 15
        port = 0
        while not port:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"delay proxy did not start: {Path(log_path).read_text()}")
            for line in Path(log_path).read_text().splitlines():
                if " -> " in line:
                    port = int(line.split()[0].rsplit(":", 1)[1])
            await asyncio.sleep(0.05)
        yield port
    finally:
        stop_process(proc, timeout_s=5)


def raw_eos_args(
    bootstrap: str, input_topic: str, output_topic: str, group: str, max_batch: int = 500
) -> list[str]:
    """The command line of the raw EOS pass-through loop (bench/raw_eos.py)."""
    return [
        sys.executable,
        str(BENCH_DIR / "raw_eos.py"),
        "--bootstrap",
        bootstrap,
        "--input",
        input_topic,
        "--output",
        output_topic,
        "--group",
        group,
        "--max-batch",
        str(max_batch),
    ]


async def publish_paced(
    bootstrap: str, topic: str, records: Sequence[Record], rate: float
) -> dict[bytes, float]:
    """Publish at ``rate`` records/s; returns each key's send time (``time.monotonic``).

    Sends are not awaited one by one (that would cap the rate at one round trip per
    record); the deliveries are awaited at the end, and any failure raises."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    sent: dict[bytes, float] = {}
    futures: list[Any] = []
    try:
        t0 = time.monotonic()
        for i, (key, value, headers, partition) in enumerate(records):
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            assert key is not None
            sent[key] = time.monotonic()
            futures.append(
                await producer.send(topic, value, key=key, headers=headers, partition=partition)
            )
        achieved = len(records) / max(time.monotonic() - t0, 1e-9)
        await asyncio.gather(*futures)
        if achieved < 0.9 * rate:
            raise RuntimeError(f"published at {achieved:.0f}/s, wanted {rate:.0f}/s")
    finally:
        await producer.stop()
    return sent
