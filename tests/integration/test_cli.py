"""``crs-consumer check`` against the real servers, and against unreachable ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
