"""``crs-consumer check`` against the real servers, and against unreachable ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, DevStack


def run_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )


def test_check_passes_on_the_dev_stack(devstack: DevStack) -> None:
    proc = run_check(
        {"KAFKA_BOOTSTRAP_SERVERS": devstack.kafka_bootstrap, "KUBECONFIG": devstack.kubeconfig}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("kafka: ok")
    assert "kubernetes: ok" in proc.stdout


def test_check_fails_in_one_line_when_kafka_is_unreachable(devstack: DevStack) -> None:
    proc = run_check({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "KUBECONFIG": devstack.kubeconfig})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kafka: FAILED to reach 127.0.0.1:1")


def test_check_fails_in_one_line_when_kubernetes_is_unreachable(
    devstack: DevStack, tmp_path: Path
) -> None:
    broken = tmp_path / "kubeconfig"
    broken.write_text(
        Path(devstack.kubeconfig).read_text().replace(devstack.apiserver, "https://127.0.0.1:1")
    )
    proc = run_check(
        {"KAFKA_BOOTSTRAP_SERVERS": devstack.kafka_bootstrap, "KUBECONFIG": str(broken)}
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kubernetes: FAILED")


async def test_check_reads_the_brokers_auto_create_setting(devstack: DevStack) -> None:
    from service.app import check

    # The dev stack's broker creates topics on first use (devstack/up sets it).
    assert await check._auto_create({"bootstrap_servers": devstack.kafka_bootstrap}) is True


async def test_check_fails_when_output_topics_are_missing_and_not_auto_created(
    devstack: DevStack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.app import check
    from service.app.config import Config

    async def no_auto_create(admin_args: dict[str, object]) -> bool:
        return False

    monkeypatch.setattr(check, "_auto_create", no_auto_create)
    config = Config.load(
        env={
            "KAFKA_BOOTSTRAP_SERVERS": devstack.kafka_bootstrap,
            "KUBECONFIG": devstack.kubeconfig,
            "CRS_OUTPUT_TOPIC": "no-such-output-7f3a",
            "CRS_DLQ_TOPIC": "no-such-dlq-7f3a",
        }
    )
    assert await check.run_check(config) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kafka: FAILED: output topic(s) missing: no-such-output-7f3a, no-such-dlq-7f3a"]
