"""charts/crs-consumer: `helm lint`, `helm template` over several value sets, and a
server-side dry-run of the rendered objects against the dev stack's API server.

helm is the project's own build (devstack/helm: Go modules, cached). The dry-run is a
server-side apply with ``dryRun=All`` of every rendered object into a namespace that
enforces Pod Security ``restricted``: schema validation, defaulting and admission run,
nothing is stored. Strimzi's KafkaUser and KafkaTopic are checked against Strimzi's real
CRDs (devstack/strimzi-crds, installed into the dev stack by the test). The Prometheus
Operator's kinds are not part of the dev stack; unless their CRDs are already installed,
the test registers minimal stand-ins (any spec accepted), so those two objects are then
checked for kind, apiVersion, scope and metadata only; their content is checked by the
template tests here, and the rules as rendered pass promtool's unit tests.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from service.app.config import SETTINGS, Config
from service.app.kafka_access import required_acls
from tests.conftest import REPO, DevStack
from tests.prometheus import MONITORING, promtool
from tests.unit.test_monitoring import _anchors

CHART = REPO / "charts" / "crs-consumer"
HELM = REPO / "devstack" / "helm"
NAMESPACE = "crs-chart-test"  # fixed: without a controller-manager namespaces never go away

RUNBOOKS = "https://git.example/cortex/crs-consumer/blob/v1/docs/runbooks.md"
KAFKA_NAMESPACE = "crs-chart-test-kafka"  # where a Strimzi set-up keeps KafkaUser/Topics
BASE = ["--set", f"alerts.runbookBase={RUNBOOKS}"]

# Value sets an operator would use (each also linted).
VALUE_SETS: dict[str, list[str]] = {
    "default": BASE,
    "strimzi-sasl": [
        *BASE,
        "--set", "strimzi.kafkaUser.create=true",
        "--set", "strimzi.topics.create=true",
        "--set", "strimzi.topics.input=true",
        "--set", f"strimzi.namespace={KAFKA_NAMESPACE}",
        "--set", "strimzi.topics.config.retention\\.ms=604800000",
        "--set-string",
        "strimzi.kafkaUser.secretMetadata.annotations.replicator\\.v1\\.mittwald\\.de/replicate-to="
        + NAMESPACE,
    ],
    "mtls": [
        *BASE,
        "--set", "kafka.securityProtocol=SSL",
        "--set", "kafka.tls.caSecret.name=kafka-cluster-ca-cert",
        "--set", "kafka.tls.clientCertSecret.name=crs-consumer",
        "--set", "kafka.tls.keyPasswordSecret.name=crs-consumer-key-password",
        "--set", "image.digest=sha256:" + "ab" * 32,
        "--set", "strimzi.kafkaUser.create=true",
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
    """The rendered objects; alerts.runbookBase (required) is RUNBOOKS unless ``values``
    set it otherwise."""
    proc = helm("template", "crs", str(chart), "--namespace", NAMESPACE, *BASE, *values)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


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
    # Settings come from the ConfigMap, secrets from files; the env holds only the pod's
    # own name (for the default Kafka client.id, from the downward API) and
    # prometheus-client's own switch (test_created_series_are_switched_off_in_the_pods).
    env = {e["name"]: e for e in container["env"]}
    assert set(env) == {"CRS_POD_NAME", "PROMETHEUS_DISABLE_CREATED_SERIES"}
    assert env["CRS_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert container["args"] == ["run"]
    files = {k: v for k, v in data.items() if k.endswith(("_FILE", "FILE"))}
    expected = {
        "default": {
            "KAFKA_SASL_PASSWORD_FILE": ("crs-consumer", "password"),
            "KAFKA_SSL_CAFILE": ("kafka-cluster-ca-cert", "ca.crt"),
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
    proc = helm("template", "crs", str(CHART), *BASE, "--set", "kafka.sasl.passwordSecret.name=")
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


def test_network_policy_admits_scrapes_by_namespace_label(helm_built: None) -> None:
    policy = by_kind(render())["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = policy["ingress"]
    assert ingress["ports"] == [{"port": 8080, "protocol": "TCP"}]
    # Cortex's own NetworkPolicy admits scrapes from namespaces labelled metrics: enabled
    # (a namespace named `monitoring` may not exist there).
    assert ingress["from"] == [{"namespaceSelector": {"matchLabels": {"metrics": "enabled"}}}]
    egress_ports = [sorted(p["port"] for p in rule["ports"]) for rule in policy["egress"]]
    assert egress_ports == [[9092, 9093], [443, 6443], [53, 53]]
    assert policy["egress"][0]["to"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kafka"}}}
    ]
    # The peers are configurable ...
    custom = by_kind(
        render(
            "--set", "networkPolicy.metrics.from[0].namespaceSelector.matchLabels.team=obs",
            "--set", "networkPolicy.metrics.from[0].podSelector.matchLabels.app=prometheus",
        )
    )["NetworkPolicy"]["spec"]  # fmt: skip
    assert custom["ingress"][0]["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"team": "obs"}},
            "podSelector": {"matchLabels": {"app": "prometheus"}},
        }
    ]
    # ... and the ingress rule can be switched off: ingress is then not restricted by this
    # policy at all (not denied), the egress rules stay.
    off = by_kind(render("--set", "networkPolicy.metrics.enabled=false"))["NetworkPolicy"]
    assert off["spec"]["policyTypes"] == ["Egress"]
    assert "ingress" not in off["spec"]
    assert off["spec"]["egress"] == policy["egress"]


def test_tls_without_a_ca_is_refused_unless_system_cas_are_chosen(helm_built: None) -> None:
    for protocol in ("SASL_SSL", "SSL"):
        proc = helm(
            "template", "crs", str(CHART), *BASE,
            "--set", f"kafka.securityProtocol={protocol}",
            "--set", "kafka.tls.caSecret.name=",
        )  # fmt: skip
        assert proc.returncode != 0, protocol
        assert "kafka.tls.caSecret.name is required with securityProtocol " + protocol in (
            proc.stderr
        )
        assert "kafka.tls.useSystemCAs=true" in proc.stderr
    system = render(
        "--set", "kafka.tls.caSecret.name=", "--set", "kafka.tls.useSystemCAs=true"
    )  # fmt: skip
    assert "KAFKA_SSL_CAFILE" not in by_kind(system)["ConfigMap"]["data"]
    assert not [v for v in pod_spec(system)["volumes"] if v["name"] == "kafka-ca"]
    # The default names Strimzi's cluster CA Secret of the default cluster `kafka`.
    assert by_kind(render())["ConfigMap"]["data"]["KAFKA_SSL_CAFILE"] == (
        "/etc/crs/kafka-ca/ca.crt"
    )
    # Without TLS no CA is needed.
    plain = render(
        "--set", "kafka.securityProtocol=SASL_PLAINTEXT", "--set", "kafka.tls.caSecret.name="
    )
    assert "KAFKA_SSL_CAFILE" not in by_kind(plain)["ConfigMap"]["data"]


def test_created_series_are_switched_off_in_the_pods(helm_built: None) -> None:
    (container,) = pod_spec(render())["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env == {"PROMETHEUS_DISABLE_CREATED_SERIES": "True"}  # CRS_POD_NAME: valueFrom

    # The service's registry exposed with that environment (prometheus-client reads the
    # variable when it is imported, hence a fresh interpreter).
    script = (
        "from prometheus_client import generate_latest\n"
        "from service.app.config import Config\n"
        "from service.app.runtime import Runtime\n"
        "print(generate_latest(Runtime(Config.load(env={})).metrics.registry).decode())\n"
    )

    def exposition(extra: dict[str, str]) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_DISABLE_CREATED_SERIES"}
        proc = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
            env={**environ, **extra},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    assert re.search(r"^crs_\w+_created", exposition({}), flags=re.M), "control: they exist"
    text = exposition(env)
    assert "crs_events_total" in text
    assert "_created" not in text


def _alerts(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


def test_prometheus_rule_carries_cortex_labels_and_absolute_runbook_links(
    helm_built: None,
) -> None:
    docs = render()
    shipped = by_kind(docs)["PrometheusRule"]
    # The label Cortex's Prometheus selects rules and monitors by (its bundles:
    # alerts.prometheus: openstack, ServiceMonitor extraLabels prometheus: openstack).
    assert shipped["metadata"]["labels"]["prometheus"] == "openstack"
    assert shipped["metadata"]["labels"]["type"] == "alerting-rules"
    assert by_kind(docs)["ServiceMonitor"]["metadata"]["labels"]["prometheus"] == "openstack"
    values = yaml.safe_load((CHART / "values.yaml").read_text())["alerts"]
    source = yaml.safe_load((REPO / "deploy" / "monitoring" / "rules.yaml").read_text())
    anchors = _anchors((REPO / "docs" / "runbooks.md").read_text())
    # Every alert: Cortex's routing labels, an absolute link to an existing section;
    # otherwise exactly the tested rule of rules.yaml.
    expected = copy.deepcopy(source["groups"])
    for group in expected:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["labels"] = {
                    **rule["labels"],
                    **values["ruleLabels"],
                    **values["rules"][rule["alert"]]["labels"],
                }
                anchor = rule["annotations"]["runbook_url"].partition("#")[2]
                rule["annotations"]["runbook_url"] = f"{RUNBOOKS}#{anchor}"
    assert shipped["spec"]["groups"] == expected
    for alert in _alerts(shipped):
        assert {"service", "support_group", "context", "dashboard", "severity"} <= set(
            alert["labels"]
        ), alert["alert"]
        url, _, anchor = alert["annotations"]["runbook_url"].partition("#")
        assert url == RUNBOOKS
        assert anchor in anchors, alert["alert"]
    assert "CrsNoPartitionsOwned" in {a["alert"] for a in _alerts(shipped)}

    # The runbook base is required and absolute (relative links went nowhere).
    for bad, message in (
        ("", "alerts.runbookBase is required"),
        ("docs/runbooks.md", "must be an absolute http(s) URL"),
    ):
        proc = helm("template", "crs", str(CHART), "--set", f"alerts.runbookBase={bad}")
        assert proc.returncode != 0, bad
        assert message in proc.stderr, proc.stderr
    # ... but not asked for without alerts.
    assert render("--set", "alerts.runbookBase=", "--set", "alerts.enabled=false")

    # nameOverride / fullnameOverride are values an operator can find (and they work).
    all_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert all_values["nameOverride"] == all_values["fullnameOverride"] == ""
    named = by_kind(render("--set", "fullnameOverride=crs"))["Deployment"]
    assert named["metadata"]["name"] == "crs"


def test_per_alert_labels_thresholds_and_windows_come_from_values(
    helm_built: None, tmp_path: Path
) -> None:
    docs = render(
        "--set", "alerts.rules.CrsConsumerLagGrowing.threshold=5000",
        "--set", "alerts.rules.CrsConsumerLagGrowing.for=30m",
        "--set", "alerts.rules.CrsConsumerLagGrowing.labels.playbook=docs/support/playbook/crs/lag",
        "--set", "alerts.rules.CrsConsumerLagGrowing.labels.severity=critical",
        "--set", "alerts.rules.CrsWatchStale.threshold=600",
        "--set", "alerts.rules.CrsNotReady.for=0s",
        "--set", "alerts.rules.CrsRetrying.enabled=false",
        "--set", "alerts.ruleLabels.support_group=compute",
        "--set", "alerts.extraLabels.team=cortex",
    )  # fmt: skip
    rule = by_kind(docs)["PrometheusRule"]
    assert rule["metadata"]["labels"]["team"] == "cortex"
    alerts = {a["alert"]: a for a in _alerts(rule)}
    lag = alerts["CrsConsumerLagGrowing"]
    assert "> 5000" in lag["expr"]
    assert "> 1000" not in lag["expr"]
    assert lag["for"] == "30m"
    assert lag["labels"]["playbook"] == "docs/support/playbook/crs/lag"
    assert lag["labels"]["severity"] == "critical"
    assert "> 600" in alerts["CrsWatchStale"]["expr"]
    assert "for" not in alerts["CrsNotReady"]
    assert "CrsRetrying" not in alerts
    assert {a["labels"]["support_group"] for a in alerts.values()} == {"compute"}
    assert "${threshold}" not in json.dumps(rule)

    # What promtool makes of it: valid rules, and the raised threshold keeps quiet the
    # backlog of 3000 that fires the default (deploy/monitoring/tests.yaml's case).
    groups = tmp_path / "rules.yaml"
    groups.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = promtool("check", "rules", str(groups), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    case = {
        "interval": "1m",
        "input_series": [
            {
                "series": 'crs_consumer_lag{job="crs",namespace="ns",topic="in",partition="0"}',
                "values": "0+100x100",
            }
        ],
        "alert_rule_test": [
            {"eval_time": "45m", "alertname": "CrsConsumerLagGrowing", "exp_alerts": []},
            {"eval_time": "90m", "alertname": "CrsConsumerLagGrowing", "exp_alerts": [
                {"exp_labels": {**lag["labels"], "job": "crs", "namespace": "ns", "topic": "in"},
                 "exp_annotations": {
                     **lag["annotations"],
                     "summary": "crs-consumer falls behind on in",
                     "description": "9000 records wait in in (ns/crs) and the backlog keeps "
                                    "growing.",
                 }},
            ]},
        ],
    }  # fmt: skip
    tests = tmp_path / "tests.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [groups.name], "tests": [case]}))
    proc = promtool("test", "rules", str(tests), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # A threshold placeholder without a value is refused, not shipped as text.
    proc = helm(
        "template", "crs", str(CHART), *BASE, "--set", "alerts.rules.CrsWatchStale=null"
    )  # fmt: skip
    assert proc.returncode != 0
    assert "alerts.rules.CrsWatchStale.threshold is required" in proc.stderr


def test_the_rendered_rules_pass_every_promtool_unit_test(helm_built: None, tmp_path: Path) -> None:
    """deploy/monitoring/tests.yaml (a firing and a quiet case per alert) against the
    rules as the chart ships them: the same alerts, with the labels the chart adds."""
    rule = by_kind(render())["PrometheusRule"]
    alerts = {a["alert"]: a for a in _alerts(rule)}
    (tmp_path / "chart-rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    source = yaml.safe_load((MONITORING / "tests.yaml").read_text())
    source["rule_files"] = ["chart-rules.yaml"]
    cases = 0
    for test in source["tests"]:
        for case in test.get("alert_rule_test", []):
            shipped = alerts[case["alertname"]]
            for exp in case["exp_alerts"]:
                exp["exp_labels"] = {**shipped["labels"], **exp["exp_labels"]}
                exp["exp_labels"]["severity"] = shipped["labels"]["severity"]
                annotations = exp.get("exp_annotations", {})
                if "runbook_url" in annotations:
                    anchor = annotations["runbook_url"].partition("#")[2]
                    annotations["runbook_url"] = f"{RUNBOOKS}#{anchor}"
                cases += 1
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(source, sort_keys=False))
    proc = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert cases >= len(alerts)


def test_without_a_rule_file_a_placeholder_group_ships(helm_built: None, tmp_path: Path) -> None:
    chart = tmp_path / "crs-consumer"
    shutil.copytree(CHART, chart)
    (chart / "alerts" / "crs-consumer.alerts.yaml").unlink()
    placeholder = by_kind(render(chart=chart))["PrometheusRule"]
    (group,) = placeholder["spec"]["groups"]
    (alert,) = group["rules"]
    assert alert["alert"] == "CrsConsumerDown"
    assert alert["labels"]["service"] == "cortex"
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOKS}#crsconsumerdown"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("serviceMonitor.labels.prometheus=main", "serviceMonitor.extraLabels"),
        ("alerts.labels.team=x", "alerts.extraLabels"),
        ("networkPolicy.monitoring.podSelector.matchLabels.app=prometheus",
         "networkPolicy.metrics.from"),
    ],
)  # fmt: skip
def test_values_renamed_in_0_2_0_are_refused_not_ignored(
    helm_built: None, old: str, new: str
) -> None:
    proc = helm("template", "crs", str(CHART), *BASE, "--set", old)
    assert proc.returncode != 0
    assert f"is now {new}" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- Strimzi


def _acls(user: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out = []
    for acl in user["spec"]["authorization"]["acls"]:
        resource = acl["resource"]
        for operation in acl["operations"]:
            out.append(
                (resource["type"].lower(), resource["name"], resource["patternType"], operation)
            )
    return out


def _required(data: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """required_acls of the service with the rendered ConfigMap's settings (ACLs do not
    depend on the security settings, whose files do not exist here)."""
    env = {k: v for k, v in data.items() if not k.startswith(("KAFKA_SASL", "KAFKA_SSL"))}
    config = Config.load(env={**env, "KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"})
    return [
        (a.resource_type.lower(), a.name, a.pattern, a.operation) for a in required_acls(config)
    ]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--set", "consumer.exactlyOnce=false"],
        ["--set", "consumer.extraEnv.CRS_TRANSACTIONAL_ID_PREFIX=crs-eu", "--set",
         "consumer.groupId=crs-eu-1", "--set", "topics.output=out"],
    ],
    ids=["default", "at-least-once", "own-prefix"],
)  # fmt: skip
def test_kafka_user_has_exactly_the_acls_the_service_needs(
    helm_built: None, extra: list[str]
) -> None:
    docs = render(*VALUE_SETS["strimzi-sasl"], *extra)
    (user,) = of_kind(docs, "KafkaUser")
    data = by_kind([d for d in docs if d["kind"] != "KafkaTopic"])["ConfigMap"]["data"]
    assert sorted(_acls(user)) == sorted(_required(data))
    assert user["apiVersion"] == "kafka.strimzi.io/v1beta2"
    assert user["metadata"]["namespace"] == KAFKA_NAMESPACE
    assert user["metadata"]["labels"]["strimzi.io/cluster"] == "kafka"
    # SCRAM: the user's name is the SASL username, and its Secret (same name) is the one
    # the pods mount the password from.
    assert user["spec"]["authentication"] == {"type": "scram-sha-512"}
    assert user["metadata"]["name"] == data["KAFKA_SASL_USERNAME"] == "crs-consumer"
    spec = pod_spec(of_kind(docs, "Deployment"))
    assert _mounted_file(spec, data["KAFKA_SASL_PASSWORD_FILE"]) == ("crs-consumer", "password")
    assert user["spec"]["template"]["secret"]["metadata"]["annotations"] == {
        "replicator.v1.mittwald.de/replicate-to": NAMESPACE
    }


def test_kafka_topics_and_the_mtls_user(helm_built: None) -> None:
    docs = render(*VALUE_SETS["strimzi-sasl"])
    topics = {t["spec"]["topicName"]: t for t in of_kind(docs, "KafkaTopic")}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(topics) == set(values["topics"].values())
    for name, topic in topics.items():
        assert topic["metadata"]["name"] == name  # already a valid object name
        assert topic["metadata"]["namespace"] == KAFKA_NAMESPACE
        assert topic["spec"]["partitions"] == 6
        assert topic["spec"]["replicas"] == 3
        assert topic["spec"]["config"] == {"retention.ms": 604800000}
    # Without strimzi.topics.input only the service's own topics.
    own = render(*BASE, "--set", "strimzi.topics.create=true")
    assert {t["spec"]["topicName"] for t in of_kind(own, "KafkaTopic")} == {
        values["topics"]["output"],
        values["topics"]["deadLetter"],
    }
    assert {t["metadata"]["namespace"] for t in of_kind(own, "KafkaTopic")} == {NAMESPACE}
    odd = render(*BASE, "--set", "strimzi.topics.create=true", "--set", "topics.output=CRS_Out")
    assert "crs-out" in {t["metadata"]["name"] for t in of_kind(odd, "KafkaTopic")}

    mtls = render(*VALUE_SETS["mtls"])
    (user,) = of_kind(mtls, "KafkaUser")
    assert user["spec"]["authentication"] == {"type": "tls"}
    assert user["metadata"]["name"] == "crs-consumer"  # CN=crs-consumer, its Secret's name
    assert user["metadata"]["namespace"] == NAMESPACE
    assert "template" not in user["spec"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "kafka.sasl.mechanism=SCRAM-SHA-256"],
         "SCRAM-SHA-512 or TLS, not SCRAM-SHA-256"),
        (["--set", "kafka.sasl.passwordSecret.name=other"],
         "set kafka.sasl.passwordSecret.name to it"),
        (["--set", "kafka.securityProtocol=PLAINTEXT"], "strimzi.kafkaUser.create needs"),
    ],
    ids=["scram-256", "other-secret", "plaintext"],
)  # fmt: skip
def test_a_kafka_user_strimzi_cannot_serve_is_refused(
    helm_built: None, values: list[str], message: str
) -> None:
    proc = helm(
        "template", "crs", str(CHART), *BASE, "--set", "strimzi.kafkaUser.create=true", *values
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


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
    "KafkaUser": ("apis/kafka.strimzi.io/v1beta2", "kafkausers", True),
    "KafkaTopic": ("apis/kafka.strimzi.io/v1beta2", "kafkatopics", True),
}
STRIMZI_CRDS = REPO / "devstack" / "strimzi-crds"


def strimzi_crds() -> list[dict[str, Any]]:
    """Strimzi's own KafkaTopic and KafkaUser CRDs (devstack/strimzi-crds, cached)."""
    proc = subprocess.run(
        [str(STRIMZI_CRDS)], capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, f"devstack/strimzi-crds failed:\n{proc.stderr[-3000:]}"
    directory = Path(proc.stdout.strip().splitlines()[-1])
    crds = [yaml.safe_load(p.read_text()) for p in sorted(directory.glob("*-Crd-*.yaml"))]
    assert {c["spec"]["names"]["kind"] for c in crds} == {"KafkaTopic", "KafkaUser"}
    return crds


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
        # Strimzi's real CRDs: the KafkaUser and KafkaTopics are validated by its schema.
        for crd in strimzi_crds():
            path = f"{CRDS}/{crd['metadata']['name']}"
            if await api.get(path) == 404:
                status, body = await api.apply(path, crd, dry_run=False)
                assert status in {200, 201}, body
            await _wait_served(
                api, f"apis/kafka.strimzi.io/v1beta2/{crd['spec']['names']['plural']}"
            )
        for name in (NAMESPACE, KAFKA_NAMESPACE):
            namespace = {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {
                    "name": name,
                    "labels": {
                        "pod-security.kubernetes.io/enforce": "restricted",
                        "pod-security.kubernetes.io/warn": "restricted",
                    },
                },
            }
            status, body = await api.apply(f"api/v1/namespaces/{name}", namespace, dry_run=False)
            assert status in {200, 201}, body

        for doc in docs:
            prefix, plural, namespaced = RESOURCES[doc["kind"]]
            where = (
                f"namespaces/{doc['metadata'].get('namespace', NAMESPACE)}/" if namespaced else ""
            )
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
