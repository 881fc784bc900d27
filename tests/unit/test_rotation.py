"""Rotated secret files (service.app.rotation): noticed on a poll, acted on only once they
load, and handed to run_service, which rebuilds the Kafka clients in order.

The files are laid out as the kubelet mounts a Secret (tests.secret_volume): new content
appears by a swap of the ``..data`` symlink.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from service.app import runtime as runtime_module
from service.app.config import Config, secret_files
from service.app.rotation import SecretFiles, SecretMetrics, new_secret_metrics
from service.stream.metrics import StreamMetrics
from tests.secret_volume import SecretVolume

FILES = ("user.crt", "user.key", "user.password")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """Two generations of a client certificate, each with its encrypted key and password."""
    out = {}
    for gen, password in (("v1", "first-s3cret"), ("v2", "second-s3cret")):
        d = tmp_path_factory.mktemp(gen)
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-passout", f"pass:{password}", "-keyout", str(d / "user.key"),
                 "-out", str(d / "user.crt"), "-subj", f"/CN=crs-{gen}", "-days", "1")  # fmt: skip
        (d / "user.password").write_text(password + "\n")
        out[gen] = {name: (d / name).read_bytes() for name in FILES}
    return out


class Mount(SecretVolume):
    def env(self) -> dict[str, str]:
        return {
            "KAFKA_SECURITY_PROTOCOL": "SSL",
            "KAFKA_SSL_CERTFILE": self.path("user.crt"),
            "KAFKA_SSL_KEYFILE": self.path("user.key"),
            "KAFKA_SSL_KEY_PASSWORD_FILE": self.path("user.password"),
        }


@pytest.fixture
def mount(tmp_path: Path, material: dict[str, dict[str, bytes]]) -> Mount:
    m = Mount(tmp_path / "secret")
    m.publish(material["v1"])
    return m


def watcher(mount: Mount, **kw: Any) -> tuple[SecretFiles, list[str], SecretMetrics]:
    """A watcher of ``mount`` whose attempts to load are recorded."""
    loads: list[str] = []
    env = mount.env()

    def load() -> Config:
        loads.append("load")
        return Config.load(env=env)

    metrics = new_secret_metrics(CollectorRegistry())
    files = secret_files(Config.load(env=env), env=env)
    w = SecretFiles(files, load, interval_s=30, metrics=metrics, **kw)
    w.load()
    return w, loads, metrics


def count(metrics: SecretMetrics, result: str) -> float:
    return float(metrics.reloads.labels(result)._value.get())


def refused(metrics: SecretMetrics) -> float:
    return float(metrics.refused._value.get())


def test_the_watched_files_are_the_tls_files_and_the_secret_files(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("x")
    env = {
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "KAFKA_SASL_USERNAME": "crs",
        "KAFKA_SASL_PASSWORD_FILE": str(pw),
        "KAFKA_SSL_CAFILE": "/etc/ssl/certs/ca-certificates.crt",
    }
    config = Config(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="crs",
        sasl_password="x",
        ssl_cafile="/ca.crt",
    )
    assert secret_files(config, env=env) == {
        "KAFKA_SSL_CAFILE": "/ca.crt",
        "KAFKA_SASL_PASSWORD_FILE": str(pw),
    }
    # A --*-file flag is watched under its name; a value passed programmatically is no file.
    assert secret_files(config, env={}, overrides={"sasl_password_file": "/p"}) == {
        "KAFKA_SSL_CAFILE": "/ca.crt",
        "--sasl-password-file": "/p",
    }
    assert secret_files(config, env=env, overrides={"sasl_password": "x"}) == {
        "KAFKA_SSL_CAFILE": "/ca.crt"
    }
    assert secret_files(Config(), env={}) == {}  # PLAINTEXT, no secret files: nothing


def test_unchanged_files_are_no_rotation(mount: Mount) -> None:
    w, loads, metrics = watcher(mount)
    os.utime(mount.root / "user.crt")  # touched, same content
    assert w.poll() is None
    assert len(loads) == 1
    assert count(metrics, "applied") == count(metrics, "invalid") == 0


def test_a_symlink_swap_is_detected_and_loads_the_new_material(
    mount: Mount, material: dict[str, dict[str, bytes]]
) -> None:
    w, loads, metrics = watcher(mount)
    mount.publish(material["v2"])
    reloaded = w.poll()
    assert reloaded is not None
    assert reloaded.config.ssl_key_password == "second-s3cret"
    assert reloaded.files == [
        f"{k}={v}" for k, v in mount.env().items() if k != "KAFKA_SECURITY_PROTOCOL"
    ]
    assert count(metrics, "applied") == 1
    assert w.poll() is None  # said once: the new content is the baseline now
    assert len(loads) == 2


def test_a_file_rewritten_in_place_is_detected(
    mount: Mount, material: dict[str, dict[str, bytes]]
) -> None:
    w, _, _ = watcher(mount)
    # Not a swap: the file the link points to is rewritten (a plain hostPath, a CSI driver).
    target = mount.root / "..data" / "user.password"
    target.write_bytes(b"first-s3cret")  # the same password without the newline
    assert w.poll() is not None


def test_invalid_material_is_refused_once_and_retried_until_it_loads(
    mount: Mount, material: dict[str, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    w, loads, metrics = watcher(mount)
    v1, v2 = material["v1"], material["v2"]
    # Half-written certificate; then the new key without its new password; then a file
    # missing for a moment: none of them loads, so the running clients are kept.
    broken = [
        {**v1, "user.crt": v2["user.crt"][: len(v2["user.crt"]) // 2]},
        {**v2, "user.password": v1["user.password"]},
        {"user.crt": v2["user.crt"], "user.key": v2["user.key"]},
    ]
    with structlog.testing.capture_logs() as logs:
        assert refused(metrics) == 0
        for files in broken:
            mount.publish(files)
            assert w.poll() is None
            assert refused(metrics) == 1  # the state an alert sees, while it lasts
            assert w.poll() is None  # the same content again: not counted, not logged
            assert refused(metrics) == 1
        mount.publish(v2)
        reloaded = w.poll()
    assert reloaded is not None
    assert refused(metrics) == 0
    assert reloaded.config.ssl_key_password == "second-s3cret"
    assert count(metrics, "invalid") == 3
    assert count(metrics, "applied") == 1
    events = [(e["event"], e["log_level"]) for e in logs]
    assert events == [("secret_reload_invalid", "warning")] * 3 + [("secret_files_changed", "info")]
    # Paths only: never a password or key.
    for e in logs:
        text = repr(e)
        assert "s3cret" not in text, text
        assert "PRIVATE KEY" not in text, text
    assert "KAFKA_SSL_CERTFILE" in repr(logs[0]["files"])
    assert len(loads) == 1 + 6 + 1  # every poll of a broken state tried to load it


def test_files_back_to_the_material_in_use_are_no_longer_refused(
    mount: Mount, material: dict[str, dict[str, bytes]]
) -> None:
    w, loads, metrics = watcher(mount)
    v1, v2 = material["v1"], material["v2"]
    mount.publish({**v2, "user.password": v1["user.password"]})
    assert w.poll() is None
    assert refused(metrics) == 1
    mount.publish(v1)  # the rotation rolled back: the clients run on what is on disk
    assert w.poll() is None
    assert refused(metrics) == 0
    assert (count(metrics, "invalid"), count(metrics, "applied")) == (1, 0)
    assert len(loads) == 2  # the rollback is no change: nothing was loaded for it


def test_a_changed_sasl_password_file_is_a_rotation_and_an_empty_one_is_refused(
    tmp_path: Path,
) -> None:
    volume = SecretVolume(tmp_path / "kafka-user")
    volume.publish({"password": b"first\n"})
    env = {
        "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "KAFKA_SASL_USERNAME": "crs",
        "KAFKA_SASL_PASSWORD_FILE": volume.path("password"),
    }
    files = secret_files(Config.load(env=env), env=env)
    metrics = new_secret_metrics(CollectorRegistry())
    w = SecretFiles(files, lambda: Config.load(env=env), interval_s=30, metrics=metrics)
    assert w.load().sasl_password == "first"
    volume.publish({"password": b""})  # truncated while being written: no password at all
    assert w.poll() is None
    volume.publish({"password": b"second\n"})
    reloaded = w.poll()
    assert reloaded is not None
    assert reloaded.config.sasl_password == "second"
    assert reloaded.files == [f"KAFKA_SASL_PASSWORD_FILE={volume.path('password')}"]
    assert (count(metrics, "invalid"), count(metrics, "applied")) == (1, 1)


async def test_polls_every_interval_on_fake_time(
    mount: Mount, material: dict[str, dict[str, bytes]]
) -> None:
    now = [0.0]
    changed_at = 95.0

    async def sleep(seconds: float) -> None:
        assert seconds == 30
        now[0] += seconds
        if now[0] >= changed_at and mount.versions == 1:
            mount.publish(material["v2"])

    w, _, _ = watcher(mount, sleep=sleep)
    reloaded = await asyncio.wait_for(w.next_change(), 5)
    assert reloaded.config.ssl_key_password == "second-s3cret"
    assert now[0] == 120  # the first poll after the change


async def test_a_failing_poll_does_not_end_the_watch(mount: Mount) -> None:
    polls = [0]

    async def sleep(seconds: float) -> None:
        pass

    w, _, _ = watcher(mount, sleep=sleep)
    real_poll = w.poll

    def poll() -> Any:
        polls[0] += 1
        if polls[0] < 3:
            raise RuntimeError("bug")
        w._baseline = {}
        return real_poll()

    w.poll = poll  # type: ignore[method-assign]
    assert await asyncio.wait_for(w.next_change(), 5) is not None
    assert polls[0] == 3


# --- run_service: the rebuild goes the orderly way (commit, leave, start afresh)


class Generation:
    """A Runtime as run_service drives it; its consume loop runs until asked to stop."""

    def __init__(self, config: Config, log: list[str], n: int = 0) -> None:
        self.config, self.log, self.n = config, log, n
        self.metrics = StreamMetrics()
        self.secrets = new_secret_metrics(self.metrics.registry)
        self.stopping = asyncio.Event()

    async def start(self) -> None:
        self.log.append(f"start {self.n} with {self.config.ssl_key_password}")

    async def run(self) -> None:
        await self.stopping.wait()
        self.log.append(f"run {self.n} finished its work and committed")

    def request_stop(self) -> None:
        self.stopping.set()

    async def stop(self, *, keep_front: bool = False) -> None:
        self.log.append(f"stop {self.n}" + (" keeping the front" if keep_front else ""))

    def handover(self, error: str, config: Config | None = None) -> Generation:
        self.log.append(f"handover {self.n}: {error}")
        successor = Generation(config or self.config, self.log, self.n + 1)
        successor.metrics, successor.secrets = self.metrics, self.secrets
        generations.append(successor)
        return successor


generations: list[Generation] = []


async def wait_for(predicate: Any, timeout_s: float = 5) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_rotation_rebuilds_the_kafka_clients_in_order_and_invalid_material_does_not(
    mount: Mount, material: dict[str, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    generations.clear()

    def first(config: Config) -> Generation:
        generations.append(Generation(config, log))
        return generations[-1]

    monkeypatch.setattr(runtime_module, "Runtime", first)
    env = {**mount.env(), "CRS_SECRET_RELOAD_INTERVAL_S": "0.02"}
    config = Config.load(env=env)
    service = asyncio.create_task(
        runtime_module.run_service(
            config, reload=lambda: Config.load(env=env), secret_files=secret_files(config, env=env)
        )
    )
    try:
        await wait_for(lambda: len(log) == 1)
        # Half-written: several polls go by, the running generation is left alone.
        mount.publish({**material["v2"], "user.key": material["v2"]["user.key"][:100]})
        await asyncio.sleep(0.2)
        assert log == ["start 0 with first-s3cret"]
        mount.publish(material["v2"])
        await wait_for(lambda: len(log) == 5)
        assert log == [
            "start 0 with first-s3cret",
            "run 0 finished its work and committed",  # asked to stop: commits what is done
            "stop 0 keeping the front",  # clients closed, group left; HTTP and metrics kept
            "handover 0: rebuilding the Kafka clients with rotated secret files",
            "start 1 with second-s3cret",  # at once, with the new material
        ]
        reloads = generations[0].secrets
        assert count(reloads, "invalid") == 1
        assert count(reloads, "applied") == 1
        assert generations[0].metrics.client_restarts._value.get() == 0  # not a failure
        # The next rotation is watched too (the watch goes on with the new generation).
        mount.publish(material["v1"])
        await wait_for(lambda: len(log) == 9)
        assert log[-1] == "start 2 with first-s3cret"
    finally:
        os.kill(os.getpid(), 15)  # SIGTERM: run_service's own stop
        code = await asyncio.wait_for(service, 5)
    assert code == 0
    assert log[-2:] == ["run 2 finished its work and committed", "stop 2"]
