"""``crs-consumer check``: can this configuration work, here and now?

Prints one line per dependency, every dependency in one run; a failure is one line naming
the cause, the setting and the fix. Exit codes (the worst of the dependencies'): 0
everything works; 1 a dependency failed (unreachable, authentication, TLS, protocol,
authorization, missing topics, RBAC); 2 the configuration is invalid (including a file
setting naming a missing or unreadable file).

The causes come from the brokers' and the API server's own answers: the Kafka client's
connection errors are captured while it bootstraps (it only logs them and raises a
generic "Unable to bootstrap"), authorization is probed per resource with requests that
change nothing (topic metadata without auto-creation, a one-record fetch of the input,
coordinator look-ups of the group and the transactional id; DescribeAcls only informs
the ok line, as it is often not allowed), and the Kubernetes
permissions are asked with SelfSubjectAccessReview per verb and kind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from service.app.config import Config
from service.app.kafka_access import missing_acls
from service.stream import aiokafka_internals

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_OK",
    "capturing",
    "diagnose_kafka",
    "file_problems",
    "run_check",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2

# (verb, group, plural): what deploy/clusterrole.yaml grants and the service needs.
K8S_PERMISSIONS: tuple[tuple[str, str, str], ...] = (
    *(
        (verb, group, plural)
        for group, plural in (
            ("kvm.cloud.sap", "hypervisors"),
            ("cortex.cloud", "reservations"),
            ("cortex.cloud", "committedresources"),
            ("cortex.cloud", "knowledges"),
        )
        for verb in ("get", "list", "watch")
    ),
    ("patch", "cortex.cloud", "reservations"),
)


def _fail(line: str) -> None:
    print(line, file=sys.stderr)


async def run_check(config: Config) -> int:
    """Every dependency in one run, each with its own cause: a failing one does not hide
    the next. The exit code is the worst (an invalid configuration over a failure)."""
    problems = file_problems(config)
    for line in problems:
        _fail(line)
    codes = [EXIT_CONFIG if problems else EXIT_OK]
    # A dependency whose own file is unusable is not tried; the line above says why.
    if not any(line.startswith("kafka:") for line in problems):
        codes.append(await _check_kafka(config))
    if not any(line.startswith("kubernetes:") for line in problems):
        codes.append(await _check_kubernetes(config))
    return max(codes)


# ---------------------------------------------------------------- files


def file_problems(config: Config, *, kubernetes: bool = True) -> list[str]:
    """One line per file setting that names a missing or unreadable file (``kubernetes``:
    KUBECONFIG too; a command that never talks to Kubernetes must not trip over it)."""
    files = [("KAFKA_SSL_CAFILE", config.ssl_cafile, "kafka")]
    if kubernetes:
        files.append(("KUBECONFIG", config.kubeconfig, "kubernetes"))
    problems = []
    for env, value, who in files:
        if not value:
            continue
        # KUBECONFIG may list several files, as for kubectl: the client merges them.
        paths = value.split(os.pathsep) if env == "KUBECONFIG" else [value]
        for path in filter(None, paths):
            name = f"{env}={value}" if path == value else f"{env}={value}: {path}"
            if not os.path.exists(path):
                problems.append(f"{who}: {name}: no such file")
            elif not os.path.isfile(path):
                problems.append(f"{who}: {name}: not a regular file")
            elif not os.access(path, os.R_OK):
                problems.append(f"{who}: {name}: not readable by uid {os.getuid()}")
    return problems


# ---------------------------------------------------------------- kafka


def diagnose_kafka(errors: list[BaseException], config: Config) -> str:
    """The most specific cause among the client's connection errors, with the fix."""
    from aiokafka import errors as ke

    proto = config.security_protocol
    tls = proto in {"SSL", "SASL_SSL"}
    for exc in errors:
        if isinstance(exc, ssl.SSLCertVerificationError):
            trusted = (
                f"KAFKA_SSL_CAFILE={config.ssl_cafile}"
                if config.ssl_cafile
                else "the system CAs (set KAFKA_SSL_CAFILE)"
            )
            return (
                f"TLS verification failed ({exc.verify_message}): the brokers' certificate "
                f"is not trusted by {trusted}"
            )
    for exc in errors:
        if isinstance(exc, ssl.SSLError):
            reason = str(exc.reason or exc)
            if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason:
                return (
                    f"TLS handshake refused ({reason}): the listener wants a client "
                    "certificate (mutual TLS); use a listener with SASL or without client auth"
                )
            if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
                return (
                    f"protocol mismatch: KAFKA_SECURITY_PROTOCOL={proto} speaks TLS but the "
                    "listener does not (use PLAINTEXT or SASL_PLAINTEXT, or the TLS listener)"
                )
            return f"TLS handshake failed: {reason}"
    for exc in errors:
        if isinstance(exc, (ke.SaslAuthenticationFailed, ke.AuthenticationFailedError)):
            return (
                f"authentication failed for KAFKA_SASL_USERNAME={config.sasl_username} "
                f"(KAFKA_SASL_MECHANISM={config.sasl_mechanism}): check KAFKA_SASL_PASSWORD"
            )
        if isinstance(exc, ke.UnsupportedSaslMechanismError):
            return (
                f"KAFKA_SASL_MECHANISM={config.sasl_mechanism} is not enabled on this "
                f"listener: {exc}"
            )
        if isinstance(exc, ke.IllegalSaslStateError):
            return (
                f"protocol mismatch: KAFKA_SECURITY_PROTOCOL={proto} starts SASL but the "
                "listener does not expect it (use PLAINTEXT/SSL, or the SASL listener)"
            )
    for exc in errors:
        text = str(exc)
        if isinstance(exc, ConnectionResetError) and tls:
            return (
                f"protocol mismatch: the listener reset the TLS handshake; it probably does "
                f"not speak TLS (KAFKA_SECURITY_PROTOCOL={proto})"
            )
        if isinstance(exc, ke.KafkaConnectionError) and "closed" in text and not tls:
            return (
                f"protocol mismatch: the listener closed the connection at the first "
                f"request; it probably expects TLS (KAFKA_SECURITY_PROTOCOL={proto})"
            )
        if isinstance(exc, ConnectionRefusedError):
            return "connection refused: nothing listens there (check KAFKA_BOOTSTRAP_SERVERS)"
        if isinstance(exc, OSError) and "Name or service not known" in text:
            return "host name not resolvable (check KAFKA_BOOTSTRAP_SERVERS)"
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            return "timed out connecting (network, firewall, or a frozen broker)"
    if errors:
        last, name = errors[-1], type(errors[-1]).__name__
        text = str(last)
        return text if text.startswith(name) else f"{name}: {text}"  # aiokafka adds it
    return "no broker answered"


class _Capture(logging.Handler):
    """Collects the exceptions aiokafka logs (and swallows) while connecting."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        for arg in record.args if isinstance(record.args, tuple) else ():
            if isinstance(arg, BaseException):
                self.errors.append(arg)


@contextmanager
def capturing() -> Iterator[_Capture]:
    """The errors aiokafka logs meanwhile, collected for :func:`diagnose_kafka` instead of
    printed: the command says the cause once, in its own words."""
    logger = logging.getLogger("aiokafka")
    capture = _Capture()
    saved = (logger.level, logger.propagate)
    logger.setLevel(logging.ERROR)
    logger.propagate = False  # check speaks for itself, in one line
    logger.addHandler(capture)
    try:
        yield capture
    finally:
        logger.removeHandler(capture)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


async def _check_kafka(config: Config) -> int:
    from aiokafka.admin import AIOKafkaAdminClient

    servers = config.bootstrap_servers
    try:
        args = config.kafka_client_args()
    except (OSError, ssl.SSLError) as exc:  # an unusable CA bundle
        _fail(f"kafka: KAFKA_SSL_CAFILE={config.ssl_cafile}: not a usable CA bundle: {exc}")
        return EXIT_CONFIG
    admin = AIOKafkaAdminClient(**args, request_timeout_ms=10000)
    with capturing() as capture:
        try:
            await asyncio.wait_for(admin.start(), 15)
            present = await _topics_present(admin, config)
            acls = await _describe_acls(admin)
        except Exception as exc:  # the captured client errors say why
            cause = diagnose_kafka([*capture.errors, exc], config)
            _fail(f"kafka: FAILED to reach {servers}: {cause}")
            return EXIT_FAILED
        finally:
            await admin.close()
    # Authorization per resource (topics, group, the prefixed TransactionalId), asked of
    # the broker without side effects; the same table `run` checks before it starts.
    try:
        denied = await missing_acls(config)
    except Exception as exc:
        _fail(f"kafka: FAILED to check ACLs: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    if denied:
        who = f"User:{config.sasl_username}" if config.sasl_username else "this client's principal"
        for acl, why in denied:
            _fail(f"kafka: FAILED: missing ACL for {who}: {acl}: {why}")
        return EXIT_FAILED
    # Outputs to a missing topic would stall every commit (unless the brokers create
    # topics on first use); a missing input topic only means nothing was published yet.
    missing = [t for t in (config.output_topic, config.dlq_topic) if t not in present]
    if missing and not await _auto_create(admin_args=args):
        _fail(f"kafka: FAILED: output topic(s) missing: {', '.join(missing)}")
        return EXIT_FAILED
    notes = [acls]
    if config.input_topic not in present:
        notes.append(f"input topic {config.input_topic} not created yet")
    print(f"kafka: ok, {servers} ({'; '.join(notes)})")
    return EXIT_OK


async def _topics_present(admin: Any, config: Config) -> set[str]:
    """The service's topics that exist (an unauthorized one is not reported missing)."""
    from aiokafka.protocol.metadata import MetadataRequest

    topics = [config.input_topic, config.output_topic, config.dlq_topic]
    # Named topics, no auto-creation: an unauthorized topic answers 29, not "missing".
    request = MetadataRequest(topics, allow_auto_topic_creation=False)
    response = await aiokafka_internals.send_admin_request(admin, request)
    return {entry[1] for entry in response.topics if entry[0] in (0, 29)}


async def _describe_acls(admin: Any) -> str:
    """What the brokers say about ACLs (informative: access is probed per resource)."""
    from aiokafka.protocol.admin import DescribeAclsRequest

    # resource type, pattern, operation, permission: 1 = ANY; no name/principal/host filter
    try:
        request = DescribeAclsRequest(1, None, 1, None, None, 1, 1)
        response = await aiokafka_internals.send_admin_request(admin, request)
    except Exception as exc:  # an old broker or a closed connection: the probes still ran
        return f"ACLs not described: {type(exc).__name__}"
    if response.error_code == 54:
        return "no authorizer on the brokers: ACLs are not enforced"
    if response.error_code == 31:
        return "authorizer on, DescribeAcls not allowed; access probed per resource"
    if response.error_code:
        return f"ACLs not described: error {response.error_code}"
    bindings = sum(len(resource[-1]) for resource in response.resources)
    return f"authorizer on, {bindings} ACL bindings; access probed per resource"


async def _auto_create(admin_args: dict[str, object]) -> bool:
    """Whether the brokers create topics on first use (auto.create.topics.enable)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(**admin_args, request_timeout_ms=10000)
    try:
        await admin.start()
        brokers = aiokafka_internals.broker_ids(admin)
        described = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.BROKER, str(brokers[0]))]
        )
        for response in described:
            for resource in response.resources:
                for entry in resource[4]:
                    if entry[0] == "auto.create.topics.enable":
                        return str(entry[1]).lower() == "true"
        return False
    except Exception:  # unknown: be strict and report the missing topics
        return False
    finally:
        await admin.close()


# ---------------------------------------------------------------- kubernetes


async def _check_kubernetes(config: Config) -> int:
    from service.k8s import KubeClient
    from service.k8s.client import COMMITTED_RESOURCES, HYPERVISORS, RESERVATIONS

    source = f"KUBECONFIG={config.kubeconfig}" if config.kubeconfig else "in-cluster"
    if not config.kubeconfig and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        _fail("kubernetes: FAILED: KUBECONFIG is unset and this is not a pod: set KUBECONFIG")
        return EXIT_CONFIG
    try:
        client = await KubeClient.create(config.kubeconfig, request_timeout_s=config.k8s_timeout_s)
    except Exception as exc:  # a bad kubeconfig or no service account
        _fail(f"kubernetes: FAILED: {source} is not usable: {type(exc).__name__}: {exc}")
        return EXIT_CONFIG if config.kubeconfig else EXIT_FAILED
    try:
        denied = await _denied_permissions(client)
        if denied:
            for line in denied:
                _fail(f"kubernetes: FAILED: {line}")
            return EXIT_FAILED
        knowledge = await client.get_knowledge()
        for kind in (HYPERVISORS, RESERVATIONS, COMMITTED_RESOURCES):
            await client.probe_list(kind)
    except Exception as exc:  # unreachable, unauthenticated, CRDs missing
        _fail(f"kubernetes: FAILED: {_describe_k8s(exc, client)}")
        return EXIT_FAILED
    finally:
        await client.close()
    kn = "present" if knowledge is not None else "MISSING (placements will count cr_slot=error)"
    print(f"kubernetes: ok, Knowledge flavor-groups {kn}")
    return EXIT_OK


async def _denied_permissions(client: Any) -> list[str]:
    """SelfSubjectAccessReview for each permission the service needs; the denied ones."""
    from kubernetes_asyncio import client as k8s

    api = k8s.AuthorizationV1Api(client.api_client)
    denied = []
    for verb, group, plural in K8S_PERMISSIONS:
        review = k8s.V1SelfSubjectAccessReview(
            spec=k8s.V1SelfSubjectAccessReviewSpec(
                resource_attributes=k8s.V1ResourceAttributes(
                    verb=verb, group=group, resource=plural
                )
            )
        )
        result = await asyncio.wait_for(
            api.create_self_subject_access_review(review), client.request_timeout_s
        )
        if not result.status.allowed:
            denied.append(
                f"forbidden: may not {verb} {plural}.{group} "
                "(apply deploy/clusterrole.yaml and bind it to this identity)"
            )
    return denied


def _describe_k8s(exc: BaseException, client: Any) -> str:
    host = getattr(client.api_client.configuration, "host", "?")
    status = getattr(exc, "status", None)
    if status == 401:
        return (
            f"authentication failed at {host} (401): the token or client certificate "
            "is invalid or expired"
        )
    if status == 404:
        return f"{exc} (are the CRDs installed? see schemas/crds/)"
    text = f"{type(exc).__name__}: {exc}"
    if (
        isinstance(exc, (OSError, TimeoutError))
        or "Cannot connect" in text
        or "timed out" in text.lower()
    ):
        return f"cannot reach the API server at {host}: {text}"
    return text
