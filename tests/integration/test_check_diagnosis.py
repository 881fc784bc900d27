"""``crs-consumer check`` names the cause in one line, against the real servers.

Each case is a real failure, not a simulated one: a TLS client at the broker's plaintext
listener, a plaintext client at a TLS listener (the API server's port), a TLS client that
does not trust the listener's CA, SASL at a listener without it, missing files, an
identity the API server does not know (401), and one it knows but grants nothing
(SelfSubjectAccessReview per verb and kind).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from service.app.check import K8S_PERMISSIONS
from tests.conftest import REPO, DevStack

pytestmark = pytest.mark.integration


def check(devstack: DevStack, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        "KAFKA_BOOTSTRAP_SERVERS": devstack.kafka_bootstrap,
        "KUBECONFIG": devstack.kubeconfig,
    }
    return subprocess.run(
        [sys.executable, "-m", "service", "check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **base, **env},
        timeout=120,
        check=False,
    )


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def tls_port(devstack: DevStack) -> str:
    """A TLS listener that is not Kafka: the API server's port (the handshake comes first)."""
    return devstack.apiserver.removeprefix("https://")


def test_tls_client_at_a_plaintext_listener_is_a_protocol_mismatch(devstack: DevStack) -> None:
    proc = check(devstack, KAFKA_SECURITY_PROTOCOL="SSL")
    assert proc.returncode == 1
    assert one_line(proc).startswith(
        f"kafka: FAILED to reach {devstack.kafka_bootstrap}: protocol mismatch"
    )
    assert "KAFKA_SECURITY_PROTOCOL=SSL" in proc.stderr


def test_plaintext_client_at_a_tls_listener_is_a_protocol_mismatch(devstack: DevStack) -> None:
    proc = check(devstack, KAFKA_BOOTSTRAP_SERVERS=tls_port(devstack))
    assert proc.returncode == 1
    line = one_line(proc)
    assert "protocol mismatch" in line
    assert "expects TLS" in line


def test_untrusted_certificate_is_a_tls_verification_failure(
    devstack: DevStack, tmp_path: Path
) -> None:
    proc = check(
        devstack, KAFKA_BOOTSTRAP_SERVERS=tls_port(devstack), KAFKA_SECURITY_PROTOCOL="SSL"
    )
    assert proc.returncode == 1
    assert "TLS verification failed" in one_line(proc)
    assert "set KAFKA_SSL_CAFILE" in proc.stderr
    # another CA than the one that signed the listener's certificate
    other = tmp_path / "other-ca.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=other-ca", "-keyout", str(tmp_path / "k"), "-out", str(other)],
        check=True, capture_output=True,
    )  # fmt: skip
    proc = check(
        devstack,
        KAFKA_BOOTSTRAP_SERVERS=tls_port(devstack),
        KAFKA_SECURITY_PROTOCOL="SSL",
        KAFKA_SSL_CAFILE=str(other),
    )
    assert "TLS verification failed" in one_line(proc)
    assert f"KAFKA_SSL_CAFILE={other}" in proc.stderr


def test_sasl_at_a_listener_without_sasl_is_a_protocol_mismatch(devstack: DevStack) -> None:
    proc = check(
        devstack,
        KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
        KAFKA_SASL_MECHANISM="PLAIN",
        KAFKA_SASL_USERNAME="crs",
        KAFKA_SASL_PASSWORD="secret-pw",
    )
    assert proc.returncode == 1
    assert "starts SASL but the listener does not expect it" in one_line(proc)
    assert "secret-pw" not in proc.stderr + proc.stdout


def test_missing_files_name_the_variable_and_path(devstack: DevStack, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ca.crt"
    proc = check(devstack, KAFKA_SECURITY_PROTOCOL="SSL", KAFKA_SSL_CAFILE=str(missing))
    assert proc.returncode == 2
    assert one_line(proc) == (
        f"crs-consumer: invalid configuration: KAFKA_SSL_CAFILE={missing}: no such file"
    )
    proc = check(devstack, KUBECONFIG=str(tmp_path))
    assert proc.returncode == 2
    assert one_line(proc) == f"kubernetes: KUBECONFIG={tmp_path}: not a regular file"
    run = subprocess.run(
        [sys.executable, "-m", "service", "run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": str(missing)},
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    assert f"KAFKA_SSL_CAFILE={missing}: no such file" in one_line(run)


def token_kubeconfig(devstack: DevStack, tmp_path: Path, token: str) -> str:
    config = yaml.safe_load(Path(devstack.kubeconfig).read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    path = tmp_path / f"kubeconfig-{uuid.uuid4().hex[:6]}"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_an_unknown_identity_is_an_authentication_failure(
    devstack: DevStack, tmp_path: Path
) -> None:
    proc = check(devstack, KUBECONFIG=token_kubeconfig(devstack, tmp_path, "not-a-token"))
    assert proc.returncode == 1
    assert "authentication failed" in one_line(proc)
    assert "(401)" in proc.stderr


def test_missing_rbac_is_reported_per_verb_and_kind(
    devstack: DevStack, tmp_path: Path, service_account: tuple[str, str]
) -> None:
    _, token = service_account  # a ServiceAccount bound to nothing
    proc = check(devstack, KUBECONFIG=token_kubeconfig(devstack, tmp_path, token))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(K8S_PERMISSIONS) == 13
    assert "kubernetes: FAILED: forbidden: may not patch reservations.cortex.cloud" in proc.stderr
    assert "may not watch hypervisors.kvm.cloud.sap" in proc.stderr
    assert proc.stdout.startswith("kafka: ok")


def test_ok_line_says_whether_the_brokers_enforce_acls(devstack: DevStack) -> None:
    proc = check(devstack)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"kafka: ok, {devstack.kafka_bootstrap} (no authorizer on the brokers")


def test_no_kubeconfig_outside_a_pod_is_a_configuration_error(devstack: DevStack) -> None:
    proc = check(devstack, KUBECONFIG="", KUBERNETES_SERVICE_HOST="")
    assert proc.returncode == 2
    assert one_line(proc) == (
        "kubernetes: FAILED: KUBECONFIG is unset and this is not a pod: set KUBECONFIG"
    )


def test_every_dependency_is_reported_in_one_run(devstack: DevStack, tmp_path: Path) -> None:
    # Kafka unreachable and Kubernetes refusing the identity: both causes, one run.
    proc = check(
        devstack,
        KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1",
        KUBECONFIG=token_kubeconfig(devstack, tmp_path, "not-a-token"),
    )
    assert proc.returncode == 1
    kafka, kubernetes = proc.stderr.strip().splitlines()
    assert kafka == (
        "kafka: FAILED to reach 127.0.0.1:1: connection refused: nothing listens there "
        "(check KAFKA_BOOTSTRAP_SERVERS)"
    )
    assert kubernetes.startswith("kubernetes: FAILED: authentication failed")
    # A configuration error of one (its file) and a failure of the other: both, exit 2.
    proc = check(devstack, KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1", KUBECONFIG=str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kubernetes: KUBECONFIG={tmp_path}: not a regular file",
        "kafka: FAILED to reach 127.0.0.1:1: connection refused: nothing listens there "
        "(check KAFKA_BOOTSTRAP_SERVERS)",
    ]
