"""charts/crs-consumer: `helm lint`, `helm template` over several value sets, and a
server-side dry-run of the rendered objects against the dev stack's API server.

helm is the project's own build (devstack/helm: Go modules, cached). The dry-run is a
server-side apply with ``dryRun=All`` of every rendered object into a namespace that
enforces Pod Security ``restricted``: schema validation, defaulting and admission run,
nothing is stored. The Prometheus Operator's kinds are not part of the dev stack; unless
their CRDs are already installed, the test registers minimal stand-ins (any spec
accepted), so those two objects are then checked for kind, apiVersion, scope and
metadata only; their content is checked by the template tests here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from service.app.config import SETTINGS
from tests.conftest import REPO, DevStack

CHART = REPO / "charts" / "crs-consumer"
HELM = REPO / "devstack" / "helm"
NAMESPACE = "crs-chart-test"  # fixed: without a controller-manager namespaces never go away

# Value sets an operator would use (each also linted).
VALUE_SETS: dict[str, list[str]] = {
    "default": [],
    "mtls": [
        "--set", "kafka.securityProtocol=SSL",
        "--set", "kafka.tls.caSecret.name=kafka-cluster-ca-cert",
        "--set", "kafka.tls.clientCertSecret.name=crs-consumer",
        "--set", "kafka.tls.keyPasswordSecret.name=crs-consumer-key-password",
        "--set", "image.digest=sha256:" + "ab" * 32,
    ],
    "plain-single": [
        "--set", "kafka.securityProtocol=PLAINTEXT",
        "--set", "replicaCount=1",
        "--set", "serviceMonitor.enabled=false",
        "--set", "alerts.enabled=false",
        "--set", "networkPolicy.enabled=false",
        "--set", "consumer.extraEnv.CRS_MAX_BATCH=200",
    ],
}  # fmt: skip


def helm(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, timeout=900, check=False, cwd=cwd
    )


def render(*values: str, chart: Path = CHART) -> list[dict[str, Any]]:
    proc = helm("template", "crs", str(chart), "--namespace", NAMESPACE, *values)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for d in docs:
        assert d["kind"] not in out, f"two {d['kind']} objects"
        out[d["kind"]] = d
    return out


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def helm_built() -> None:
    proc = subprocess.run(
        [str(HELM), "--path"], capture_output=True, text=True, timeout=1800, check=False
    )
    assert proc.returncode == 0, f"building helm failed:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_is_clean(helm_built: None, name: str) -> None:
    proc = helm("lint", "--strict", str(CHART), *VALUE_SETS[name])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_default_release_two_replicas_pdb_and_least_privilege(helm_built: None) -> None:
    docs = render()
    kinds = by_kind(docs)
    assert set(kinds) == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment",
        "Service", "ServiceMonitor", "PrometheusRule", "PodDisruptionBudget", "NetworkPolicy",
    }  # fmt: skip
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        key = "selector" if kind == "PodDisruptionBudget" else "podSelector"
        assert kinds[kind]["spec"][key]["matchLabels"].items() <= pod_labels.items(), kind
    # AlwaysAllow: /readyz is unready while Kafka or the API server is unreachable, and the
    # default policy would then refuse every eviction, hanging node drains during an outage.
    assert kinds["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
        "selector": kinds["PodDisruptionBudget"]["spec"]["selector"],
    }
    (container,) = pod_spec(docs)["containers"]
    for part in ("requests", "limits"):
        assert set(container["resources"][part]) == {"cpu", "memory", "ephemeral-storage"}
    deploy_role = yaml.safe_load((REPO / "deploy" / "clusterrole.yaml").read_text())
    assert kinds["ClusterRole"]["rules"] == deploy_role["rules"]
    assert kinds["ClusterRoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": kinds["ServiceAccount"]["metadata"]["name"],
         "namespace": NAMESPACE}
    ]  # fmt: skip
    assert pod_spec(docs)["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]


def _known_env() -> set[str]:
    return {s.env for s in SETTINGS} | {f"{s.env}_FILE" for s in SETTINGS if s.secret}


def _mounted_file(spec: dict[str, Any], path: str) -> tuple[str, str]:
    """(secret name, key) of the Secret item mounted at ``path``."""
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            secret = volumes[mount["name"]]["secret"]
            for item in secret["items"]:
                if item["path"] == path[len(prefix) :]:
                    return secret["secretName"], item["key"]
    raise AssertionError(f"nothing mounted at {path}")


@pytest.mark.parametrize("name", ["default", "mtls"])
def test_secrets_come_from_existing_secrets_as_files(helm_built: None, name: str) -> None:
    docs = render(*VALUE_SETS[name])
    data = by_kind(docs)["ConfigMap"]["data"]
    assert set(data) <= _known_env(), set(data) - _known_env()
    secrets = {s.env for s in SETTINGS if s.secret}
    assert not set(data) & secrets, "a secret value in the ConfigMap"
    spec = pod_spec(docs)
    (container,) = spec["containers"]
    # Settings come from the ConfigMap, secrets from files; only the pod's own name (for
    # the default Kafka client.id) comes from the downward API.
    assert container["env"] == [
        {"name": "CRS_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    assert container["args"] == ["run"]
    files = {k: v for k, v in data.items() if k.endswith(("_FILE", "FILE"))}
    expected = {
        "default": {
            "KAFKA_SASL_PASSWORD_FILE": ("crs-consumer", "password"),
        },
        "mtls": {
            "KAFKA_SSL_CAFILE": ("kafka-cluster-ca-cert", "ca.crt"),
            "KAFKA_SSL_CERTFILE": ("crs-consumer", "user.crt"),
            "KAFKA_SSL_KEYFILE": ("crs-consumer", "user.key"),
            "KAFKA_SSL_KEY_PASSWORD_FILE": ("crs-consumer-key-password", "password"),
        },
    }[name]
    assert {k: _mounted_file(spec, v) for k, v in files.items()} == expected
    if name == "mtls":
        assert container["image"] == "crs-consumer@sha256:" + "ab" * 32


def test_sasl_without_a_password_secret_fails_to_render(helm_built: None) -> None:
    proc = helm("template", "crs", str(CHART), "--set", "kafka.sasl.passwordSecret.name=")
    assert proc.returncode != 0
    assert "kafka.sasl.passwordSecret.name is required" in proc.stderr


def test_single_replica_has_no_pdb_and_optional_objects_can_be_left_out(
    helm_built: None,
) -> None:
    docs = render(*VALUE_SETS["plain-single"])
    kinds = by_kind(docs)
    assert set(kinds) == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment",
        "Service",
    }  # fmt: skip
    data = kinds["ConfigMap"]["data"]
    assert data["KAFKA_SECURITY_PROTOCOL"] == "PLAINTEXT"
    assert data["CRS_MAX_BATCH"] == "200"
    assert not [k for k in data if k.startswith(("KAFKA_SASL", "KAFKA_SSL"))]


def test_a_config_change_rolls_the_pods_and_nothing_else_does(helm_built: None) -> None:
    def checksum(*values: str) -> str:
        docs = render(*values)
        annotations = by_kind(docs)["Deployment"]["spec"]["template"]["metadata"]["annotations"]
        value: str = annotations["checksum/config"]
        return value

    base = checksum()
    assert len(base) == 64
    assert checksum("--set", "topics.input=other-input") != base
    assert checksum("--set", "consumer.extraEnv.CRS_MAX_BATCH=100") != base
    assert checksum("--set", "replicaCount=3") == base  # scaling is not a config change


def test_network_policy_admits_only_monitoring_to_the_metrics_port(helm_built: None) -> None:
    policy = by_kind(render())["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = policy["ingress"]
    assert ingress["ports"] == [{"port": 8080, "protocol": "TCP"}]
    (peer,) = ingress["from"]
    assert peer == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    egress_ports = [sorted(p["port"] for p in rule["ports"]) for rule in policy["egress"]]
    assert egress_ports == [[9092, 9093], [443, 6443], [53, 53]]
    assert policy["egress"][0]["to"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kafka"}}}
    ]


def test_prometheus_rule_takes_the_charts_rule_files_verbatim(
    helm_built: None, tmp_path: Path
) -> None:
    # The chart ships the service's alert rules (copied from deploy/monitoring/rules.yaml).
    shipped = by_kind(render())["PrometheusRule"]
    assert shipped["metadata"]["labels"]["prometheus"] == "kubernetes"
    assert shipped["metadata"]["labels"]["type"] == "alerting-rules"
    source = yaml.safe_load((REPO / "deploy" / "monitoring" / "rules.yaml").read_text())
    assert shipped["spec"]["groups"] == source["groups"]
    # The runbook links are relative to the repository unless alerts.runbookBase says
    # where it is served: then every one is absolute (they went nowhere in Alertmanager).
    base = "https://git.example/cortex/crs-consumer/blob/v1/"
    linked = by_kind(render("--set", f"alerts.runbookBase={base}"))["PrometheusRule"]
    urls = [
        rule["annotations"]["runbook_url"]
        for group in linked["spec"]["groups"]
        for rule in group["rules"]
        if "runbook_url" in rule.get("annotations", {})
    ]
    assert len(urls) >= 14
    assert all(u.startswith(base + "docs/runbooks.md#") for u in urls), urls[:3]
    # nameOverride / fullnameOverride are values an operator can find (and they work).
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["nameOverride"] == values["fullnameOverride"] == ""
    named = by_kind(render("--set", "fullnameOverride=crs"))["Deployment"]
    assert named["metadata"]["name"] == "crs"

    # Without a rule file: one placeholder group.
    chart = tmp_path / "crs-consumer"
    shutil.copytree(CHART, chart)
    (chart / "alerts" / "crs-consumer.alerts.yaml").unlink()
    placeholder = by_kind(render(chart=chart))["PrometheusRule"]
    (group,) = placeholder["spec"]["groups"]
    assert [r["alert"] for r in group["rules"]] == ["CrsConsumerDown"]

    rules = {
        "groups": [
            {
                "name": "crs-consumer",
                "rules": [
                    {
                        "alert": "CrsConsumerLagging",
                        "expr": "sum(crs_consumer_lag) > 1000",
                        "annotations": {"summary": "lag on {{ $labels.topic }}"},
                    }
                ],
            }
        ]
    }
    (chart / "alerts" / "crs-consumer.alerts.yaml").write_text(yaml.safe_dump(rules))
    rendered = by_kind(render(chart=chart))["PrometheusRule"]
    assert rendered["spec"]["groups"] == rules["groups"]


# ---------------------------------------------------------------- server-side dry-run

CRDS = "apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# kind -> (API path prefix, plural, namespaced)
RESOURCES = {
    "ServiceAccount": ("api/v1", "serviceaccounts", True),
    "ConfigMap": ("api/v1", "configmaps", True),
    "Service": ("api/v1", "services", True),
    "Deployment": ("apis/apps/v1", "deployments", True),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets", True),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies", True),
    "ClusterRole": ("apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "ServiceMonitor": ("apis/monitoring.coreos.com/v1", "servicemonitors", True),
    "PrometheusRule": ("apis/monitoring.coreos.com/v1", "prometheusrules", True),
}


def _stand_in_crd(kind: str, plural: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


class Api:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session, self.base = session, base

    async def apply(self, path: str, doc: dict[str, Any], *, dry_run: bool) -> tuple[int, str]:
        params = {"fieldManager": "crs-chart-test", "force": "true"}
        if dry_run:
            params["dryRun"] = "All"
        async with self.session.patch(
            f"{self.base}/{path}",
            params=params,
            data=json.dumps(doc),
            headers={"Content-Type": "application/apply-patch+yaml"},
        ) as resp:
            body = await resp.text()
            warnings = resp.headers.getall("Warning", [])
            return resp.status, body + "".join(f"\nWarning: {w}" for w in warnings)

    async def get(self, path: str) -> int:
        async with self.session.get(f"{self.base}/{path}") as resp:
            return resp.status


async def _wait_served(api: Api, path: str) -> None:
    for _ in range(100):
        if await api.get(path) == 200:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} is not served")


@pytest.mark.parametrize("name", list(VALUE_SETS))
async def test_rendered_chart_passes_a_server_side_dry_run(
    helm_built: None, devstack: DevStack, name: str
) -> None:
    docs = render(*VALUE_SETS[name])
    pki = devstack.run_dir / "pki"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        api = Api(session, devstack.apiserver)
        for kind in ("ServiceMonitor", "PrometheusRule"):
            crd = _stand_in_crd(kind, RESOURCES[kind][1])
            path = (
                f"apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
            )
            # Never replace a definition someone installed (e.g. the real operator's CRDs).
            if await api.get(path) == 404:
                status, body = await api.apply(path, crd, dry_run=False)
                assert status in {200, 201}, body
            await _wait_served(api, f"apis/monitoring.coreos.com/v1/{RESOURCES[kind][1]}")
        namespace = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": NAMESPACE,
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/warn": "restricted",
                },
            },
        }
        status, body = await api.apply(f"api/v1/namespaces/{NAMESPACE}", namespace, dry_run=False)
        assert status in {200, 201}, body

        for doc in docs:
            prefix, plural, namespaced = RESOURCES[doc["kind"]]
            where = f"namespaces/{NAMESPACE}/" if namespaced else ""
            path = f"{prefix}/{where}{plural}/{doc['metadata']['name']}"
            status, body = await api.apply(path, doc, dry_run=True)
            assert status in {200, 201}, f"{doc['kind']}: {status} {body[-2000:]}"
            # Pod Security `restricted` answers a violating Deployment with a warning.
            assert "Warning:" not in body, f"{doc['kind']}: {body[-2000:]}"
            applied = json.loads(body)
            assert applied["kind"] == doc["kind"]


def test_the_grace_period_grows_with_the_shutdown_budget(helm_built: None) -> None:
    # Set independently, a shutdown budget raised above ~35 s got the pod killed in the
    # middle of its last commit, before it left the consumer group (found by review).
    assert pod_spec(render())["terminationGracePeriodSeconds"] == 60
    raised = render("--set", "consumer.shutdownTimeoutSeconds=90")
    assert pod_spec(raised)["terminationGracePeriodSeconds"] == 115
    longer = render("--set", "terminationGracePeriodSeconds=300")
    assert pod_spec(longer)["terminationGracePeriodSeconds"] == 300
