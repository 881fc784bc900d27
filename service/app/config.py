"""Configuration from environment variables, with command-line overrides.

Each setting is declared once, as a field of :class:`Config`: its type and constraint
(msgspec ``Annotated`` metadata), its default, and its variable and meaning (``_env``).
Everything else derives from that one declaration: :data:`SETTINGS` (the flags, the
README table, redaction), the parsing of a variable's text (msgspec's lax conversion of
strings) and the error message. Every setting has one environment variable and one
``--flag``; the flag wins. Defaults work against the local dev stack (``devstack/up``).
A bad value is reported naming the variable (or flag, or ``_FILE`` variable) it came
from, so an operator can fix a Deployment without reading code.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_type_hints

import msgspec
from msgspec import Meta
from msgspec import inspect as mi

__all__ = ["SETTINGS", "Config", "ConfigError", "Setting", "secret_files"]

_CLIENT_TLS = ("ssl_certfile", "ssl_keyfile", "ssl_key_password")
# Trailing line breaks of a secret file are an editor's, not part of the secret.
_FILE_TRAILER = "\r\n"
_BOOL_WORDS = {"yes": "true", "on": "true", "no": "false", "off": "false"}

# The constraints, named once; msgspec checks them when a variable's text is converted.
NonEmpty = Annotated[str, Meta(min_length=1)]
PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]


def _env(env: str, text: str, *, secret: bool = False) -> Meta:
    """A setting's variable and meaning, attached to its field.

    A secret is masked in logs and errors, and has no value flag: a command line shows in
    ``ps`` and in the pod spec. It comes from ``ENV``, or from the file named by
    ``ENV_FILE`` / ``--<name>-file`` (a mounted Secret), never both.
    """
    return Meta(description=text, extra={"env": env, "secret": secret})


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names the variable."""


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """The service's settings; ``Config()`` is the dev-stack configuration."""

    # --- Kafka connection
    bootstrap_servers: Annotated[
        NonEmpty,
        _env("KAFKA_BOOTSTRAP_SERVERS", "Kafka bootstrap servers, comma-separated host:port"),
    ] = "127.0.0.1:19092"
    security_protocol: Annotated[
        Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"],
        _env("KAFKA_SECURITY_PROTOCOL", "Kafka security protocol"),
    ] = "PLAINTEXT"
    sasl_mechanism: Annotated[
        Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None,
        _env("KAFKA_SASL_MECHANISM", "SASL mechanism (with SASL_*)"),
    ] = None
    sasl_username: Annotated[str | None, _env("KAFKA_SASL_USERNAME", "SASL user name")] = None
    sasl_password: Annotated[
        str | None, _env("KAFKA_SASL_PASSWORD", "SASL password", secret=True)
    ] = None
    ssl_cafile: Annotated[
        NonEmpty | None, _env("KAFKA_SSL_CAFILE", "CA bundle for the brokers' TLS certificates")
    ] = None
    ssl_certfile: Annotated[
        NonEmpty | None,
        _env(
            "KAFKA_SSL_CERTFILE",
            "Client certificate (PEM) for mutual TLS, e.g. a Strimzi KafkaUser's user.crt",
        ),
    ] = None
    ssl_keyfile: Annotated[
        NonEmpty | None, _env("KAFKA_SSL_KEYFILE", "Private key (PEM) of the client certificate")
    ] = None
    ssl_key_password: Annotated[
        str | None,
        _env("KAFKA_SSL_KEY_PASSWORD", "Password of an encrypted KAFKA_SSL_KEYFILE", secret=True),
    ] = None
    client_id: Annotated[
        NonEmpty | None,
        _env(
            "KAFKA_CLIENT_ID",
            "Kafka client.id of this replica's consumer, producers and admin client: how "
            "brokers name it in logs, quotas and consumer-group listings "
            "(default: <CRS_GROUP_ID>-<CRS_POD_NAME>)",
        ),
    ] = None
    pod_name: Annotated[
        NonEmpty | None,
        _env(
            "CRS_POD_NAME",
            "This replica's name, for the default KAFKA_CLIENT_ID (the chart sets the pod's "
            "name from the downward API; default: the host name)",
        ),
    ] = None
    secret_reload_interval_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_SECRET_RELOAD_INTERVAL_S",
            "How often the TLS files and secret files (*_FILE) are checked for new content; "
            "a change that loads rebuilds the Kafka clients with it (a certificate rotation)",
        ),
    ] = 30.0
    # --- topics and group
    input_topic: Annotated[
        NonEmpty, _env("CRS_INPUT_TOPIC", "Topic of Nova scheduling outcomes (input)")
    ] = "nova.scheduling-outcomes"
    output_topic: Annotated[
        NonEmpty, _env("CRS_OUTPUT_TOPIC", "Topic of classification events (output)")
    ] = "cortex.crs.classifications"
    dlq_topic: Annotated[
        NonEmpty, _env("CRS_DLQ_TOPIC", "Dead-letter topic for events that cannot be processed")
    ] = "nova.scheduling-outcomes.dlq"
    group_id: Annotated[NonEmpty, _env("CRS_GROUP_ID", "Kafka consumer group")] = (
        "cortex-crs-consumer"
    )
    auto_offset_reset: Annotated[
        Literal["earliest", "latest"],
        _env(
            "CRS_AUTO_OFFSET_RESET",
            "Where a partition the group has no committed offset for (a new or renamed group), "
            "or whose committed offset is out of range (retention deleted it), starts: "
            "earliest replays the retained records (each is counted and classified again, "
            "its classification published again); latest starts at the end and skips every "
            "record published before",
        ),
    ] = "earliest"
    exactly_once: Annotated[
        bool, _env("CRS_EXACTLY_ONCE", "Commit outputs and input offsets in one Kafka transaction")
    ] = True
    # --- stream engine
    transactional_id_prefix: Annotated[
        NonEmpty | None,
        _env(
            "CRS_TRANSACTIONAL_ID_PREFIX",
            "Prefix of the per-partition transactional.id <prefix>-<topic>-<partition> "
            "(default: the group id); the prefix of the TransactionalId ACL",
        ),
    ] = None
    max_in_flight: Annotated[
        PositiveInt,
        _env(
            "CRS_MAX_IN_FLIGHT",
            "Records of one partition received but not committed before it is fetched no more",
        ),
    ] = 2000
    key_concurrency: Annotated[
        PositiveInt,
        _env("CRS_KEY_CONCURRENCY", "Records with different keys processed at once per partition"),
    ] = 256
    commit_interval_ms: Annotated[
        PositiveInt,
        _env(
            "CRS_COMMIT_INTERVAL_MS",
            "A partition's sustained commit pace: one commit (transaction) per interval "
            "under load (records still in progress when others are decided), carrying "
            "whatever was decided meanwhile; with nothing else in progress a decided "
            "record is committed at once",
        ),
    ] = 30
    commit_burst: Annotated[
        PositiveInt,
        _env(
            "CRS_COMMIT_BURST",
            "Commits a quiet partition may make back to back, each output at once, before "
            "the interval paces it",
        ),
    ] = 3
    commit_rate_max: Annotated[
        NonNegativeInt,
        _env(
            "CRS_COMMIT_RATE_MAX",
            "Transactions per second a replica begins at most across all its partitions "
            "(a few may follow each other at once); above it each carries more records. "
            "0: no limit beyond each partition's own pace",
        ),
    ] = 0
    commit_max_records: Annotated[
        PositiveInt,
        _env(
            "CRS_COMMIT_MAX_RECORDS",
            "A partition commits at once when this many decided records wait",
        ),
    ] = 500
    revoke_wait_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_REVOKE_WAIT_S",
            "On revoke, how long records in progress may finish before "
            "handover (inside the rebalance: keep it well below the session timeout)",
        ),
    ] = 2.0
    session_timeout_ms: Annotated[
        PositiveInt, _env("CRS_SESSION_TIMEOUT_MS", "Kafka consumer group session timeout")
    ] = 10000
    conflict_timeout_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_CONFLICT_TIMEOUT_S",
            "How long a placement keeps re-deciding after 409 conflicts before 'failed'",
        ),
    ] = 30.0
    max_event_bytes: Annotated[
        PositiveInt, _env("CRS_MAX_EVENT_BYTES", "Larger input events are dead-lettered unread")
    ] = 1048576
    max_attempts: Annotated[
        PositiveInt,
        _env(
            "CRS_MAX_ATTEMPTS",
            "Attempts for an event failing on a retryable error before it is "
            "dead-lettered (20 with the default back-off: about 8 minutes)",
        ),
    ] = 20
    retry_backoff_s: Annotated[
        PositiveFloat, _env("CRS_RETRY_BACKOFF_S", "First retry delay; doubles per attempt")
    ] = 0.5
    retry_backoff_max_s: Annotated[
        PositiveFloat, _env("CRS_RETRY_BACKOFF_MAX_S", "Cap of the retry delay")
    ] = 30.0
    max_batch: Annotated[PositiveInt, _env("CRS_MAX_BATCH", "Most records fetched per poll")] = 500
    poll_timeout_ms: Annotated[
        PositiveInt,
        _env(
            "CRS_POLL_TIMEOUT_MS",
            "Longest one fetch waits for records (an idle consume loop turns this often)",
        ),
    ] = 500
    txn_retry_backoff_ms: Annotated[
        PositiveInt,
        _env(
            "CRS_TXN_RETRY_BACKOFF_MS",
            "Retry back-off of the transactional producers; also how long a transaction "
            "begun right after another waits for the broker to finish that one",
        ),
    ] = 2
    txn_open_ahead_ms: Annotated[
        NonNegativeInt,
        _env(
            "CRS_TXN_OPEN_AHEAD_MS",
            "A quiet partition whose records are still undecided this long after they "
            "arrived (at once when a decision has sent a request to the Kubernetes API) "
            "begins its next transaction, sends its offset and adds the output partitions "
            "of the waiting records' keys meanwhile, so only the outputs and the end "
            "follow the decision; 0: never",
        ),
    ] = 2
    txn_produce_ahead_ms: Annotated[
        NonNegativeInt,
        _env(
            "CRS_TXN_PRODUCE_AHEAD_MS",
            "A placement's classification is produced into its partition's transaction "
            "opened ahead while its allocation write is in flight, so only the "
            "transaction's end follows the answer; it is discarded (the transaction "
            "aborted) when the write ends otherwise or is not answered within this, so "
            "read_committed readers of that output partition wait at most this long behind "
            "it; 0: never (needs CRS_TXN_OPEN_AHEAD_MS)",
        ),
    ] = 100
    fetch_linger_ms: Annotated[
        NonNegativeInt,
        _env(
            "CRS_FETCH_LINGER_MS",
            "Least time between two fetches that returned records: under load records are "
            "taken in batches (fewer requests and transactions), an idle loop takes the next "
            "record at once",
        ),
    ] = 5
    commit_timeout_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_COMMIT_TIMEOUT_S",
            "Longest one commit (outputs and input offsets) may take before it counts as "
            "failed and is retried",
        ),
    ] = 30.0
    fence_recheck_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_FENCE_RECHECK_S",
            "After a partition's producer was fenced (another member took its "
            "transactional.id), how long before this member checks whether it still owns it",
        ),
    ] = 15.0
    # --- 409 conflicts (the Recorder)
    conflict_retries: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _env(
            "CRS_CONFLICT_RETRIES",
            "Most re-decisions of one placement after 409 conflicts before 'failed' "
            "(unset: only CRS_CONFLICT_TIMEOUT_S bounds them)",
        ),
    ] = None
    conflict_backoff_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_CONFLICT_BACKOFF_S",
            "First wait after a 409 conflict; doubles per conflict, plus up to half of it "
            "at random so racing replicas spread out",
        ),
    ] = 0.01
    conflict_backoff_max_s: Annotated[
        PositiveFloat, _env("CRS_CONFLICT_BACKOFF_MAX_S", "Cap of the conflict wait")
    ] = 0.5
    # --- Kubernetes
    k8s_read_mode: Annotated[
        Literal["watch", "list"],
        _env(
            "CRS_K8S_READ_MODE",
            "watch: informer cache, no API reads per event (a slot_used placement below its "
            "partition's end offset at the take-over, perhaps written by the previous owner, "
            "re-reads its candidate slots first); list: read per event",
        ),
    ] = "watch"
    k8s_timeout_s: Annotated[
        PositiveFloat, _env("CRS_K8S_TIMEOUT_S", "Timeout of one Kubernetes API request")
    ] = 10.0
    k8s_max_writes: Annotated[
        NonNegativeInt,
        _env(
            "CRS_K8S_MAX_WRITES",
            "Allocation writes (PATCHes) in flight at once per replica; the others wait "
            "their turn, outside CRS_K8S_TIMEOUT_S; 0: no limit",
        ),
    ] = 0
    kubeconfig: Annotated[
        NonEmpty | None, _env("KUBECONFIG", "kubeconfig file; unset: in-cluster service account")
    ] = None
    k8s_page_size: Annotated[
        PositiveInt,
        _env(
            "CRS_K8S_PAGE_SIZE",
            "Objects per page of a Kubernetes list (the watches' (re)lists, list mode's reads)",
        ),
    ] = 500
    watch_timeout_s: Annotated[
        Annotated[float, Meta(ge=1)] | None,
        _env(
            "CRS_WATCH_TIMEOUT_S",
            "Renewal period of a watch (its server-side timeoutSeconds, spread by up to "
            "+20 %); unset: min(15, CRS_READINESS_BOUND_S / 2)",
        ),
    ] = None
    watch_stale_after_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_WATCH_STALE_AFTER_S",
            "How long requests are still answered from the cache while a watch is down "
            "(reconnecting); then they fail and /readyz says so",
        ),
    ] = 30.0
    watch_backoff_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_WATCH_BACKOFF_S",
            "First wait before a failed watch or list is retried; doubles per failure",
        ),
    ] = 0.5
    watch_backoff_max_s: Annotated[
        PositiveFloat, _env("CRS_WATCH_BACKOFF_MAX_S", "Cap of the watch retry wait")
    ] = 30.0
    invariant_grace_s: Annotated[
        Annotated[float, Meta(ge=0)],
        _env(
            "CRS_INVARIANT_GRACE_S",
            "How long one VM may be listed in more than one Reservation before the "
            "allocation invariant monitor (watch mode) and `audit` report it "
            "(Cortex's allocationGracePeriod)",
        ),
    ] = 900.0
    # --- HTTP, logs, lifecycle
    http_host: Annotated[
        NonEmpty, _env("CRS_HTTP_HOST", "Address of the HTTP server (/metrics, /healthz, /readyz)")
    ] = "127.0.0.1"
    http_port: Annotated[Port, _env("CRS_HTTP_PORT", "Port of the HTTP server (0: any free)")] = (
        8080
    )
    log_level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR"],
        _env("CRS_LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR"),
    ] = "INFO"
    log_format: Annotated[
        Literal["json", "console"], _env("CRS_LOG_FORMAT", "json (one object per line) or console")
    ] = "json"
    shutdown_timeout_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_SHUTDOWN_TIMEOUT_S", "Longest graceful shutdown before in-flight work is abandoned"
        ),
    ] = 30.0
    # --- operability (health bounds, metadata refresh)
    readiness_bound_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_READINESS_BOUND_S",
            "/readyz fails when Kafka has been unreachable, or a watch "
            "has delivered nothing, for longer than this",
        ),
    ] = 30.0
    metadata_max_age_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_METADATA_MAX_AGE_S",
            "Kafka metadata refresh period: a topic created after start "
            "is consumed within about this",
        ),
    ] = 15.0
    liveness_bound_s: Annotated[
        PositiveFloat,
        _env(
            "CRS_LIVENESS_BOUND_S",
            "/healthz fails when the consume loop has not turned for longer than this",
        ),
    ] = 180.0

    # ------------------------------------------------------------------ loading

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
            if raw is not None:
                values[s.field] = s.parse(raw, source)
        config = cls(**values)
        config._check_consistency()
        return config

    def _check_consistency(self) -> None:
        env = _ENV
        if self.security_protocol.startswith("SASL_"):
            for field in ("sasl_mechanism", "sasl_username", "sasl_password"):
                if not getattr(self, field):
                    raise ConfigError(
                        f"{env[field]} is required when KAFKA_SECURITY_PROTOCOL is SASL_*"
                    )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("KAFKA_SSL_CERTFILE and KAFKA_SSL_KEYFILE go together (mutual TLS)")
        if self.ssl_key_password and not self.ssl_keyfile:
            raise ConfigError("KAFKA_SSL_KEY_PASSWORD needs KAFKA_SSL_KEYFILE")
        tls = self.security_protocol in {"SSL", "SASL_SSL"}
        for field in _CLIENT_TLS:
            if getattr(self, field) and not tls:
                raise ConfigError(f"{env[field]} needs KAFKA_SECURITY_PROTOCOL SSL or SASL_SSL")
        if tls:
            self.kafka_client_args()  # unreadable or mismatched TLS files fail here, by name
        if len({self.input_topic, self.output_topic, self.dlq_topic}) != 3:
            raise ConfigError("CRS_INPUT_TOPIC, CRS_OUTPUT_TOPIC and CRS_DLQ_TOPIC must differ")
        if self.session_timeout_ms < 6000:
            # Kafka's default group.min.session.timeout.ms: the broker refuses to let a
            # member join with less (and aiokafka heartbeats every 3 s).
            raise ConfigError("CRS_SESSION_TIMEOUT_MS must be at least 6000")
        if self.liveness_bound_s <= self.retry_backoff_max_s + self.poll_timeout_ms / 1000:
            # While fetches fail the consume loop waits the back-off between turns; a
            # bound below it would restart a healthy pod that is waiting out an outage.
            raise ConfigError(
                "CRS_LIVENESS_BOUND_S must exceed CRS_RETRY_BACKOFF_MAX_S plus CRS_POLL_TIMEOUT_MS"
            )
        if self.revoke_wait_s * 1000 > self.session_timeout_ms / 2:
            raise ConfigError("CRS_REVOKE_WAIT_S must be at most half of CRS_SESSION_TIMEOUT_MS")
        if self.watch_timeout_s is not None and self.watch_timeout_s > self.readiness_bound_s / 2:
            # A renewal is the watch's sign of life: a rarer one makes a healthy quiet
            # watch look silent to /readyz.
            raise ConfigError("CRS_WATCH_TIMEOUT_S must be at most half of CRS_READINESS_BOUND_S")
        for base, cap in _BACKOFFS:
            if getattr(self, cap) < getattr(self, base):
                raise ConfigError(f"{env[cap]} must be >= {env[base]}")

    # ------------------------------------------------------------------ derived values

    @property
    def effective_transactional_id_prefix(self) -> str:
        return self.transactional_id_prefix or self.group_id

    @property
    def effective_client_id(self) -> str:
        """KAFKA_CLIENT_ID, else the group and this replica's (pod's) name: each replica
        tells itself apart in the broker's logs and group listings, all share the prefix."""
        return self.client_id or f"{self.group_id}-{self.pod_name or socket.gethostname()}"

    @property
    def effective_watch_timeout_s(self) -> float:
        """Watch renewals well inside the readiness bound, unless set."""
        if self.watch_timeout_s is not None:
            return self.watch_timeout_s
        return max(1.0, min(15.0, self.readiness_bound_s / 2))

    def kafka_client_args(self) -> dict[str, Any]:
        """Connection settings shared by the consumer, producers and admin client."""
        args: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.security_protocol,
            "client_id": self.effective_client_id,
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
        for field in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, field)
            if path and not os.path.exists(path):
                raise ConfigError(f"{_ENV[field]}={path}: no such file")
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
        return {
            s.field: "***" if s.secret and getattr(self, s.field) else getattr(self, s.field)
            for s in SETTINGS
        }

    def to_env(self) -> dict[str, str]:
        """The variables that configure a child process exactly so (secrets included)."""
        return {
            s.env: _text(value) for s in SETTINGS if (value := getattr(self, s.field)) is not None
        }


# (base, cap) pairs of back-offs: a cap below its base is a typo, not a tuning.
_BACKOFFS = (
    ("retry_backoff_s", "retry_backoff_max_s"),
    ("conflict_backoff_s", "conflict_backoff_max_s"),
    ("watch_backoff_s", "watch_backoff_max_s"),
)


# ---------------------------------------------------------------------- the derived view


@dataclass(frozen=True)
class Setting:
    """One field of :class:`Config` as the outside sees it: variable, flag, default, help.

    Derived from the field's declaration; ``kind`` is its msgspec type (constraints
    included) and ``hint`` the annotation that ``parse`` converts a variable's text to.
    """

    field: str
    env: str
    default: str | None  # as written in a variable; None: unset
    help: str
    secret: bool
    hint: Any
    kind: mi.Type

    @property
    def flag(self) -> str:
        """The command-line flag; a secret's flag takes the path of a file holding it."""
        return f"--{self.field.replace('_', '-')}" + ("-file" if self.secret else "")

    @property
    def file_env(self) -> str:
        return f"{self.env}_FILE"

    @property
    def expects(self) -> str:
        """What a valid value is, in words, from the type's constraints."""
        return _describe(self.kind)

    def parse(self, raw: str, source: str) -> Any:
        """The value of ``raw`` (the text of ``source``), or a ConfigError naming it."""
        text = raw if self.secret else raw.strip()
        choices = _choices(self.kind)
        if choices:  # case does not matter for a choice: `info` is INFO
            text = next((c for c in choices if c.lower() == text.lower()), text)
        elif isinstance(_base(self.kind), mi.BoolType):
            text = _BOOL_WORDS.get(text.lower(), text)
        try:
            return msgspec.convert(text, self.hint, strict=False)
        except msgspec.ValidationError:
            shown = "***" if self.secret else repr(raw)
            raise ConfigError(f"{source}={shown}: must be {self.expects}") from None


def _base(t: mi.Type) -> mi.Type:
    """The type without its metadata and without the ``| None`` of an optional setting."""
    if isinstance(t, mi.Metadata):
        return _base(t.type)
    if isinstance(t, mi.UnionType):
        (inner,) = [u for u in t.types if not isinstance(u, mi.NoneType)]
        return _base(inner)
    return t


def _choices(t: mi.Type) -> tuple[str, ...]:
    base = _base(t)
    return tuple(map(str, base.values)) if isinstance(base, mi.LiteralType) else ()


def _describe(t: mi.Type) -> str:
    base = _base(t)
    if isinstance(base, mi.LiteralType):
        return "one of " + ", ".join(map(str, base.values))
    if isinstance(base, mi.BoolType):
        return "true or false"
    if isinstance(base, mi.IntType | mi.FloatType):
        noun = "integer" if isinstance(base, mi.IntType) else "number"
        if base.gt == 0:
            return f"a positive {noun}"
        article = "an" if noun == "integer" else "a"
        if base.ge is not None and base.le is not None:
            return f"{article} {noun} from {base.ge} to {base.le}"
        if base.ge is not None:
            return f"{article} {noun} >= {base.ge}"
        return f"{article} {noun}"
    if isinstance(base, mi.StrType) and base.min_length:
        return "a non-empty text"
    return f"a {type(base).__name__.removesuffix('Type').lower()}"


def _text(value: object) -> str:
    """``value`` as written in a variable: ``true``, ``2``, ``0.5``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _settings(cls: type[msgspec.Struct]) -> tuple[Setting, ...]:
    """The settings declared by the fields of ``cls``; each must have _env(...) and a default."""
    hints = get_type_hints(cls, include_extras=True)
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    out = []
    for f in info.fields:
        meta = f.type
        if not isinstance(meta, mi.Metadata) or not meta.extra or not meta.extra_json_schema:
            raise TypeError(f"{cls.__name__}.{f.name} is declared without _env(...)")
        if f.required:
            raise TypeError(f"{cls.__name__}.{f.name} has no default")
        out.append(
            Setting(
                field=f.name,
                env=meta.extra["env"],
                default=None if f.default is None else _text(f.default),
                help=meta.extra_json_schema["description"],
                secret=meta.extra["secret"],
                hint=hints[f.name],
                kind=meta,
            )
        )
    return tuple(out)


SETTINGS: tuple[Setting, ...] = _settings(Config)
_ENV = {s.field: s.env for s in SETTINGS}


def secret_files(
    config: Config,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """The files ``config`` was read from that a rotation changes in place: the TLS files
    it names and the secret files (``KAFKA_SASL_PASSWORD_FILE``, ``--*-file``) of the
    ``env`` and ``overrides`` it was loaded with, as variable (or flag) -> path."""
    env = os.environ if env is None else env
    overrides = overrides or {}
    files: dict[str, str] = {}
    if config.security_protocol in {"SSL", "SASL_SSL"}:
        for field in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if path := getattr(config, field):
                files[_ENV[field]] = path
    for s in SETTINGS:
        if not s.secret or overrides.get(s.field) is not None:
            continue
        if path := overrides.get(f"{s.field}_file"):
            files[s.flag] = path
        elif path := env.get(s.file_env):
            files[s.file_env] = path
    return files


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
