"""Runtime.stop: every started part is closed, in order, whatever fails on the way; and
run_service's restart of an ended Kafka client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from service.app import runtime as runtime_module
from service.app.config import Config
from service.app.runtime import Runtime
from service.k8s.cache import WatchClusterState
from service.stream.engine import KafkaClientEnded
from service.stream.metrics import StreamMetrics


class Part:
    """Stands for one started part; records when it is closed, optionally failing."""

    def __init__(self, name: str, closed: list[str], fail: bool = False) -> None:
        self.name, self.closed, self.fail = name, closed, fail

    async def close(self) -> None:
        self.closed.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed to close")

    stop = close


class FakeWatchState(WatchClusterState):
    """Only the lifecycle of a watch cache (stop), without informers."""

    def __init__(self, part: Part) -> None:
        self._part = part

    async def stop(self) -> None:
        await self._part.close()


def runtime_with_parts(closed: list[str], failing: set[str]) -> tuple[Runtime, asyncio.Task[Any]]:
    runtime = Runtime(Config.load(env={}))
    parts = {n: Part(n, closed, n in failing) for n in ("stream", "state", "client", "http")}
    fake: Any = runtime
    fake.stream, fake.client, fake.http = parts["stream"], parts["client"], parts["http"]
    fake.state = FakeWatchState(parts["state"])
    task = asyncio.create_task(asyncio.sleep(3600), name="watchdog")
    runtime._tasks.append(task)
    return runtime, task


async def test_stop_closes_every_part_in_reverse_start_order() -> None:
    closed: list[str] = []
    runtime, task = runtime_with_parts(closed, failing=set())
    await runtime.stop()
    assert closed == ["stream", "state", "client", "http"]
    assert task.cancelled()


@pytest.mark.parametrize("failing", ["stream", "state", "client", "http"])
async def test_one_close_raising_does_not_keep_the_others_open(failing: str) -> None:
    closed: list[str] = []
    runtime, task = runtime_with_parts(closed, failing={failing})
    with pytest.raises(RuntimeError, match=f"{failing} failed to close"):
        await runtime.stop()
    assert closed == ["stream", "state", "client", "http"]
    assert task.cancelled()


async def test_every_close_raising_still_closes_all() -> None:
    closed: list[str] = []
    runtime, task = runtime_with_parts(closed, failing={"stream", "state", "client", "http"})
    with pytest.raises(RuntimeError, match="failed to close"):
        await runtime.stop()
    assert closed == ["stream", "state", "client", "http"]
    assert task.cancelled()


async def test_stop_before_start_closes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []

    async def close(part: str, _: Any) -> None:
        closed.append(part)

    monkeypatch.setattr(runtime_module, "_close", close)
    runtime = Runtime(Config.load(env={}))
    tasks_before = asyncio.all_tasks()
    await runtime.stop()
    assert closed == []
    # Nor did it open anything on the way (a part, a task).
    assert asyncio.all_tasks() == tasks_before
    parts = (runtime.stream, runtime.http, runtime.client, runtime.state, runtime.kafka_probe)
    assert parts == (None,) * 5


async def test_heap_keeper_freezes_the_heap_once_the_cache_has_synced() -> None:
    # A full collection walked the ~100,000 objects of the watch cache (55-60 ms each);
    # frozen, the collector ignores them.
    import gc

    class State(WatchClusterState):
        def __init__(self) -> None:
            self.synced = asyncio.Event()

        async def wait_synced(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
            await self.synced.wait()
            return True

    runtime = Runtime(Config.load(env={}))
    state = State()
    runtime.state = state
    gc.unfreeze()
    task = asyncio.create_task(runtime._heap_keeper(interval_s=3600))
    try:
        await asyncio.sleep(0.05)
        assert gc.get_freeze_count() == 0  # not before the cache is in
        state.synced.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if gc.get_freeze_count():
                break
        assert gc.get_freeze_count() > 0
    finally:
        task.cancel()
        gc.unfreeze()


class Generation:
    """A Runtime as run_service drives it: the first generation's consume loop ends with
    KafkaClientEnded, the next one's runs to its end."""

    def __init__(self, config: Config, log: list[str], n: int = 0) -> None:
        self.config, self.log, self.n = config, log, n
        self.metrics = StreamMetrics()  # run_service counts each restart in it

    async def start(self) -> None:
        self.log.append(f"start {self.n}")

    async def run(self) -> None:
        self.log.append(f"run {self.n}")
        if self.n == 0:
            raise KafkaClientEnded("KafkaError: Unexpected error during coordination")

    def request_stop(self) -> None:
        pass

    async def stop(self, *, keep_front: bool = False) -> None:
        self.log.append(f"stop {self.n}" + (" keeping the front" if keep_front else ""))

    def handover(self, error: str, config: Config | None = None) -> Generation:
        self.log.append(f"handover {self.n}: {error}")
        self.log.append(f"restarts counted {self.metrics.client_restarts._value.get():.0f}")
        return Generation(self.config, self.log, self.n + 1)


async def test_an_ended_kafka_client_is_started_afresh_keeping_the_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    monkeypatch.setattr(runtime_module, "Runtime", lambda config: Generation(config, log))
    config = Config.load(env={"CRS_RETRY_BACKOFF_S": "0.01", "CRS_RETRY_BACKOFF_MAX_S": "0.01"})
    code = await asyncio.wait_for(runtime_module.run_service(config), 5)
    assert code == 0
    assert log == [
        "start 0",
        "run 0",
        "stop 0 keeping the front",  # the HTTP server and watchdog go on to generation 1
        "handover 0: the Kafka client ended: KafkaError: Unexpected error during coordination",
        "restarts counted 1",  # crs_kafka_client_restarts_total
        "start 1",
        "run 1",
        "stop 1",  # its loop ended: the whole runtime stops, the process exits 0
    ]


# --- what a handover carries: metrics always, the Kubernetes side when it was running


def kube_config(tmp_path: Any, content: str = "first") -> Config:
    path = tmp_path / "kubeconfig"
    path.write_text(content)
    return Config.load(env={"KUBECONFIG": str(path)})


def front_runtime(config: Config, closed: list[str]) -> Runtime:
    """A Runtime whose first attempt ran: front, metrics, client and a synced cache."""
    runtime = Runtime(config)
    fake: Any = runtime
    fake.http = Part("http", closed)
    fake.http.serve = lambda *a: None
    runtime._watchdog_task = asyncio.create_task(asyncio.sleep(3600), name="watchdog")
    fake.client = Part("client", closed)
    fake.state = FakeWatchState(Part("state", closed))
    runtime._kube_settings = runtime_module.kube_settings(config)
    fake.stream = Part("stream", closed)
    return runtime


async def test_a_restart_keeps_the_metrics_and_the_running_kubernetes_side(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restart of the Kafka clients is not a process restart: the counters go on, and
    # the watch caches are not read again (a foreign group member ending every fresh
    # client would otherwise make each replica LIST the whole cluster every few seconds).
    closed: list[str] = []
    config = kube_config(tmp_path)
    first = front_runtime(config, closed)
    await first.stop(keep_front=True)
    assert closed == ["stream"]
    second = first.handover("the Kafka client ended: X", kube_config(tmp_path))
    assert second.metrics is first.metrics
    assert second.k8s_metrics is first.k8s_metrics
    assert (second.client, second.state) == (first.client, first.state)

    async def no_new_client(*a: Any, **kw: Any) -> None:
        raise AssertionError("a new Kubernetes client was built")

    monkeypatch.setattr(runtime_module.KubeClient, "create", no_new_client)
    await second._start_kube()
    assert (second.client, second.state) == (first.client, first.state)
    await second.stop()
    assert closed == ["stream", "state", "client", "http"]
    assert second._watchdog_task is not None
    assert second._watchdog_task.cancelled()


async def test_a_changed_kubeconfig_builds_the_kubernetes_side_afresh(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []
    first = front_runtime(kube_config(tmp_path), closed)
    await first.stop(keep_front=True)
    # A rotated client certificate or token: same path, new content.
    second = first.handover("the Kafka client ended: X", kube_config(tmp_path, "rotated"))
    built: list[str] = []

    async def create(path: str, **kw: Any) -> Part:
        with open(path) as f:
            built.append(f.read())
        return Part("new client", closed)

    async def make_state() -> Any:
        return FakeWatchState(Part("new state", closed))

    monkeypatch.setattr(runtime_module.KubeClient, "create", create)
    monkeypatch.setattr(second, "_make_state", make_state)
    await second._start_kube()
    assert built == ["rotated"]
    assert closed == ["stream", "state", "client"]  # the handed-over ones
    await second.stop()
    assert closed[3:] == ["new state", "new client", "http"]
    assert second._watchdog_task is not None
    assert second._watchdog_task.cancelled()


def test_a_kubeconfig_list_is_compared_file_by_file(tmp_path: Any) -> None:
    # KUBECONFIG=a:b (the client merges the files, as kubectl does): unchanged files keep
    # the Kubernetes side across a restart (it was read as one path, never equal: a full
    # re-LIST per restart); a change in either builds it afresh.
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("clusters")
    b.write_text("users")
    config = Config.load(env={"KUBECONFIG": f"{a}:{b}"})
    first = runtime_module.kube_settings(config)
    assert runtime_module.kube_settings(config) == first
    b.write_text("users, rotated")
    assert runtime_module.kube_settings(config) != first


async def test_a_failed_start_hands_over_a_client_without_its_cache_closed(
    tmp_path: Any,
) -> None:
    # A start stopped between the client and the cache (cancelled by a stop signal):
    # the client alone is not handed over.
    closed: list[str] = []
    first = front_runtime(kube_config(tmp_path), closed)
    fake: Any = first
    fake.state = None
    await first.stop(keep_front=True)
    assert closed == ["stream", "client"]
    second = first.handover("ApiError: 503", first.config)
    assert second.client is None
    assert second.state is None
    await second.stop()
    assert closed == ["stream", "client", "http"]


async def test_a_stop_while_a_failed_attempt_backs_off_closes_the_handed_over_side(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiokafka.errors import KafkaConnectionError

    closed: list[str] = []
    first = front_runtime(kube_config(tmp_path), closed)
    first.metrics.ready.set(1)  # it ran, ready, until its Kafka client ended
    await first.stop(keep_front=True)
    runtime = first.handover("the Kafka client ended: X")
    attempts: list[float] = []
    attempted = asyncio.Event()

    async def broker_away(config: Config) -> None:
        attempts.append(runtime.metrics.ready._value.get())
        attempted.set()
        raise KafkaConnectionError("Unable to bootstrap")

    monkeypatch.setattr(runtime_module, "ensure_kafka_access", broker_away)
    stop = asyncio.Event()
    retrying = asyncio.create_task(runtime_module._start_with_retry(runtime, stop, restarting=True))
    await asyncio.wait_for(attempted.wait(), 5)
    await asyncio.sleep(0.05)  # in the back-off
    stop.set()
    assert await asyncio.wait_for(retrying, 5) is None
    assert closed == ["stream", "state", "client", "http"]
    assert attempts == [0.0]  # not ready while it waits: crs_ready follows /readyz
