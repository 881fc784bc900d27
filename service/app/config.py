"""Configuration from environment variables, with command-line overrides.

Every setting has one environment variable and one ``--flag``; the flag wins. Defaults
work against the local dev stack (``devstack/up``). A bad value is reported naming the
variable, so an operator can fix a Deployment without reading code.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["SETTINGS", "Config", "ConfigError", "Setting"]

_CLIENT_TLS = frozenset({"ssl_certfile", "ssl_keyfile", "ssl_key_password"})
# Trailing line breaks of a secret file are an editor's, not part of the secret.
_FILE_TRAILER = "\r\n"


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names the variable."""


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected true or false")


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port (0-65535)")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if value <= 0:
        raise ValueError("must be a positive number")
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip()
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return value

    return parse


def _text(raw: str) -> str:
    return raw


def _nonempty(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw.strip()


def _log_level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
    return value


@dataclass(frozen=True)
class Setting:
    """One configurable value: its field, variable, default, parser and meaning.

    A secret is masked in logs and errors, and has no value flag: a command line shows in
    ``ps`` and in the pod spec. It comes from ``ENV``, or from the file named by
    ``ENV_FILE`` / ``--<name>-file`` (a mounted Secret), never both.
    """

    field: str
    env: str
    default: str | None
    parse: Callable[[str], Any]
    help: str
    secret: bool = False

    @property
    def flag(self) -> str:
        """The command-line flag; a secret's flag takes the path of a file holding it."""
        return f"--{self.field.replace('_', '-')}" + ("-file" if self.secret else "")

    @property
    def file_env(self) -> str:
        return f"{self.env}_FILE"


SETTINGS: tuple[Setting, ...] = (
    Setting("bootstrap_servers", "KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092", _nonempty,
            "Kafka bootstrap servers, comma-separated host:port"),
    Setting("security_protocol", "KAFKA_SECURITY_PROTOCOL", "PLAINTEXT",
            _choice("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"), "Kafka security protocol"),
    Setting("sasl_mechanism", "KAFKA_SASL_MECHANISM", None,
            _choice("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"), "SASL mechanism (with SASL_*)"),
    Setting("sasl_username", "KAFKA_SASL_USERNAME", None, _text, "SASL user name"),
    Setting("sasl_password", "KAFKA_SASL_PASSWORD", None, _text, "SASL password", secret=True),
    Setting("ssl_cafile", "KAFKA_SSL_CAFILE", None, _nonempty,
            "CA bundle for the brokers' TLS certificates"),
    Setting("ssl_certfile", "KAFKA_SSL_CERTFILE", None, _nonempty,
            "Client certificate (PEM) for mutual TLS, e.g. a Strimzi KafkaUser's user.crt"),
    Setting("ssl_keyfile", "KAFKA_SSL_KEYFILE", None, _nonempty,
            "Private key (PEM) of the client certificate"),
    Setting("ssl_key_password", "KAFKA_SSL_KEY_PASSWORD", None, _text,
            "Password of an encrypted KAFKA_SSL_KEYFILE", secret=True),
    Setting("input_topic", "CRS_INPUT_TOPIC", "nova.scheduling-outcomes", _nonempty,
            "Topic of Nova scheduling outcomes (input)"),
    Setting("output_topic", "CRS_OUTPUT_TOPIC", "cortex.crs.classifications", _nonempty,
            "Topic of classification events (output)"),
    Setting("dlq_topic", "CRS_DLQ_TOPIC", "nova.scheduling-outcomes.dlq", _nonempty,
            "Dead-letter topic for events that cannot be processed"),
    Setting("group_id", "CRS_GROUP_ID", "cortex-crs-consumer", _nonempty, "Kafka consumer group"),
    Setting("exactly_once", "CRS_EXACTLY_ONCE", "true", _bool,
            "Commit outputs and input offsets in one Kafka transaction"),
    # --- stream engine (issue 11)
    Setting("transactional_id_prefix", "CRS_TRANSACTIONAL_ID_PREFIX", None, _nonempty,
            "Prefix of the per-partition transactional.id <prefix>-<topic>-<partition> "
            "(default: the group id); the prefix of the TransactionalId ACL"),
    Setting("max_in_flight", "CRS_MAX_IN_FLIGHT", "500", _positive_int,
            "Records of one partition received but not committed before it is paused"),
    Setting("key_concurrency", "CRS_KEY_CONCURRENCY", "256", _positive_int,
            "Records with different keys processed at once per partition"),
    Setting("commit_interval_ms", "CRS_COMMIT_INTERVAL_MS", "50", _positive_int,
            "Least time between two commits (transactions) of a partition; the first "
            "output after a quiet spell is committed at once"),
    Setting("commit_max_records", "CRS_COMMIT_MAX_RECORDS", "500", _positive_int,
            "A partition commits at once when this many decided records wait"),
    Setting("revoke_wait_s", "CRS_REVOKE_WAIT_S", "2", _positive_float,
            "On revoke, how long records in progress may finish before handover "
            "(inside the rebalance: keep it well below the session timeout)"),
    Setting("session_timeout_ms", "CRS_SESSION_TIMEOUT_MS", "10000", _positive_int,
            "Kafka consumer group session timeout"),
    Setting("conflict_timeout_s", "CRS_CONFLICT_TIMEOUT_S", "30", _positive_float,
            "How long a placement keeps re-deciding after 409 conflicts before 'failed'"),
    Setting("max_event_bytes", "CRS_MAX_EVENT_BYTES", "1048576", _positive_int,
            "Larger input events are dead-lettered unread"),
    Setting("max_attempts", "CRS_MAX_ATTEMPTS", "20", _positive_int,
            "Attempts for an event failing on a retryable error before it is dead-lettered "
            "(20 with the default back-off: about 8 minutes)"),
    Setting("retry_backoff_s", "CRS_RETRY_BACKOFF_S", "0.5", _positive_float,
            "First retry delay; doubles per attempt"),
    Setting("retry_backoff_max_s", "CRS_RETRY_BACKOFF_MAX_S", "30", _positive_float,
            "Cap of the retry delay"),
    Setting("max_batch", "CRS_MAX_BATCH", "500", _positive_int,
            "Most records fetched per poll"),
    Setting("k8s_read_mode", "CRS_K8S_READ_MODE", "watch", _choice("watch", "list"),
            "watch: informer cache, no API reads per event; list: read per event"),
    Setting("k8s_timeout_s", "CRS_K8S_TIMEOUT_S", "10", _positive_float,
            "Timeout of one Kubernetes API request"),
    Setting("kubeconfig", "KUBECONFIG", None, _nonempty,
            "kubeconfig file; unset: in-cluster service account"),
    Setting("http_host", "CRS_HTTP_HOST", "127.0.0.1", _nonempty,
            "Address of the HTTP server (/metrics, /healthz, /readyz)"),
    Setting("http_port", "CRS_HTTP_PORT", "8080", _port, "Port of the HTTP server (0: any free)"),
    Setting("log_level", "CRS_LOG_LEVEL", "INFO", _log_level, "DEBUG, INFO, WARNING or ERROR"),
    Setting("log_format", "CRS_LOG_FORMAT", "json", _choice("json", "console"),
            "json (one object per line) or console"),
    Setting("shutdown_timeout_s", "CRS_SHUTDOWN_TIMEOUT_S", "30", _positive_float,
            "Longest graceful shutdown before in-flight work is abandoned"),
    # --- operability (health bounds, metadata refresh)
    Setting("readiness_bound_s", "CRS_READINESS_BOUND_S", "30", _positive_float,
            "/readyz fails when Kafka has been unreachable, or a watch has delivered "
            "nothing, for longer than this"),
    Setting("metadata_max_age_s", "CRS_METADATA_MAX_AGE_S", "15", _positive_float,
            "Kafka metadata refresh period: a topic created after start is consumed "
            "within about this"),
)  # fmt: skip


def _raw_value(
    s: Setting, env: Mapping[str, str], overrides: Mapping[str, str | None]
) -> tuple[str | None, str]:
    """The raw text of one setting and where it came from (for error messages)."""
    raw = overrides.get(s.field)  # programmatic callers may pass a secret's value
    if raw is not None:
        return raw, s.flag
    if s.secret:
        path = overrides.get(f"{s.field}_file")
        if path is not None:
            return _read_secret(path, s.flag), s.flag
        value, path = env.get(s.env) or None, env.get(s.file_env) or None
        if value is not None and path is not None:
            raise ConfigError(f"{s.env} and {s.file_env} are both set; set one")
        if path is not None:
            return _read_secret(path, s.file_env), s.file_env
        return value, s.env
    return env.get(s.env) or None, s.env


def _read_secret(path: str, source: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().rstrip(_FILE_TRAILER) or None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(f"{source}={path!r}: cannot read the secret file: {reason}") from None


@dataclass(frozen=True)
class Config:
    bootstrap_servers: str
    security_protocol: str
    sasl_mechanism: str | None
    sasl_username: str | None
    sasl_password: str | None
    ssl_cafile: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    ssl_key_password: str | None
    input_topic: str
    output_topic: str
    dlq_topic: str
    group_id: str
    exactly_once: bool
    transactional_id_prefix: str | None
    max_in_flight: int
    key_concurrency: int
    commit_interval_ms: int
    commit_max_records: int
    revoke_wait_s: float
    session_timeout_ms: int
    conflict_timeout_s: float
    max_event_bytes: int
    max_attempts: int
    retry_backoff_s: float
    retry_backoff_max_s: float
    max_batch: int
    k8s_read_mode: str
    k8s_timeout_s: float
    kubeconfig: str | None
    http_host: str
    http_port: int
    log_level: str
    log_format: str
    shutdown_timeout_s: float
    # --- operability
    readiness_bound_s: float
    metadata_max_age_s: float

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, str | None] | None = None,
    ) -> Config:
        """Build from ``env`` (default ``os.environ``), then ``overrides`` (by field)."""
        env = os.environ if env is None else env
        overrides = overrides or {}
        values: dict[str, Any] = {}
        for s in SETTINGS:
            raw, source = _raw_value(s, env, overrides)
            if raw is None:
                raw = s.default
                source = f"{s.env} (default)"
            if raw is None:
                values[s.field] = None
                continue
            try:
                values[s.field] = s.parse(raw)
            except ValueError as exc:
                shown = "***" if s.secret else repr(raw)
                raise ConfigError(f"{source}={shown}: {exc}") from None
        config = cls(**values)
        config._check_consistency()
        return config

    def _check_consistency(self) -> None:
        if self.security_protocol.startswith("SASL_"):
            for s in SETTINGS:
                if s.field in {"sasl_mechanism", "sasl_username", "sasl_password"} and not getattr(
                    self, s.field
                ):
                    raise ConfigError(f"{s.env} is required when KAFKA_SECURITY_PROTOCOL is SASL_*")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("KAFKA_SSL_CERTFILE and KAFKA_SSL_KEYFILE go together (mutual TLS)")
        if self.ssl_key_password and not self.ssl_keyfile:
            raise ConfigError("KAFKA_SSL_KEY_PASSWORD needs KAFKA_SSL_KEYFILE")
        tls = self.security_protocol in {"SSL", "SASL_SSL"}
        for s in SETTINGS:
            if s.field in _CLIENT_TLS and getattr(self, s.field) and not tls:
                raise ConfigError(f"{s.env} needs KAFKA_SECURITY_PROTOCOL SSL or SASL_SSL")
        if tls:
            self.kafka_client_args()  # unreadable or mismatched TLS files fail here, by name
        if len({self.input_topic, self.output_topic, self.dlq_topic}) != 3:
            raise ConfigError("CRS_INPUT_TOPIC, CRS_OUTPUT_TOPIC and CRS_DLQ_TOPIC must differ")
        if self.revoke_wait_s * 1000 > self.session_timeout_ms / 2:
            raise ConfigError("CRS_REVOKE_WAIT_S must be at most half of CRS_SESSION_TIMEOUT_MS")
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ConfigError("CRS_RETRY_BACKOFF_MAX_S must be >= CRS_RETRY_BACKOFF_S")

    @property
    def effective_transactional_id_prefix(self) -> str:
        return self.transactional_id_prefix or self.group_id

    def kafka_client_args(self) -> dict[str, Any]:
        """Connection settings shared by the consumer, producers and admin client."""
        args: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol.startswith("SASL_"):
            args |= {
                "sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.sasl_username,
                "sasl_plain_password": self.sasl_password,
            }
        if self.security_protocol in {"SSL", "SASL_SSL"}:
            args["ssl_context"] = self._ssl_context()
        return args

    def kafka_consumer_args(self) -> dict[str, Any]:
        """Consumer-only settings (StreamSettings.consumer_args)."""
        return {
            "metadata_max_age_ms": int(self.metadata_max_age_s * 1000),
            "session_timeout_ms": self.session_timeout_ms,
        }

    def _ssl_context(self) -> ssl.SSLContext:
        for env, path in (
            ("KAFKA_SSL_CAFILE", self.ssl_cafile),
            ("KAFKA_SSL_CERTFILE", self.ssl_certfile),
            ("KAFKA_SSL_KEYFILE", self.ssl_keyfile),
        ):
            if path and not os.path.exists(path):
                raise ConfigError(f"{env}={path}: no such file")
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ssl_cafile)
            if self.ssl_certfile:
                # A callable, even for an unencrypted key: with no password OpenSSL would
                # prompt on the terminal for an encrypted one instead of failing.
                password = self.ssl_key_password or ""
                ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, lambda: password)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            names = "KAFKA_SSL_CAFILE" + (
                ", KAFKA_SSL_CERTFILE, KAFKA_SSL_KEYFILE, KAFKA_SSL_KEY_PASSWORD"
                if self.ssl_certfile
                else ""
            )
            raise ConfigError(f"cannot load the TLS files ({names}): {exc}") from None
        return ctx

    def redacted(self) -> dict[str, Any]:
        """The settings for logs and ``check`` output, with secrets masked."""
        secret = {s.field for s in SETTINGS if s.secret}
        return {
            f.name: ("***" if f.name in secret and getattr(self, f.name) else getattr(self, f.name))
            for f in fields(self)
        }
