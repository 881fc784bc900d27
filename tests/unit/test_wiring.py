"""Every tuning setting reaches the part it tunes (runtime's config -> parts functions)."""

from __future__ import annotations

import dataclasses
import inspect
import socket
import time
import typing
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from service.app.config import SETTINGS, Config, ConfigError
from service.app.runtime import Runtime, client_options, recorder_options, watch_options
from service.crs import Recorder
from service.k8s import KubeClient
from service.k8s.cache import WatchClusterState
from service.stream.engine import StreamService, StreamSettings
from service.stream.kafka_probe import KafkaProbe
from service.stream.metrics import StreamMetrics

# Non-default values of the knobs, each distinct so a swapped wire shows.
TUNED = {
    "CRS_POLL_TIMEOUT_MS": "123",
    "CRS_COMMIT_TIMEOUT_S": "7.5",
    "CRS_FENCE_RECHECK_S": "3.25",
    "CRS_CONFLICT_TIMEOUT_S": "11",
    "CRS_CONFLICT_RETRIES": "4",
    "CRS_CONFLICT_BACKOFF_S": "0.02",
    "CRS_CONFLICT_BACKOFF_MAX_S": "0.75",
    "CRS_K8S_PAGE_SIZE": "77",
    "CRS_K8S_TIMEOUT_S": "13",
    "CRS_K8S_MAX_WRITES": "6",
    "CRS_READINESS_BOUND_S": "40",
    "CRS_WATCH_TIMEOUT_S": "9",
    "CRS_WATCH_STALE_AFTER_S": "45",
    "CRS_WATCH_BACKOFF_S": "0.25",
    "CRS_WATCH_BACKOFF_MAX_S": "12",
    "CRS_INVARIANT_GRACE_S": "60",
    "CRS_SHUTDOWN_TIMEOUT_S": "21",
}


def test_stream_settings_carry_the_engine_knobs() -> None:
    s = StreamSettings.from_config(Config.load(env=TUNED))
    assert (s.poll_timeout_ms, s.commit_timeout_s, s.fence_recheck_s) == (123, 7.5, 3.25)
    assert s.stop_wait_s == 7.0  # a third of the shutdown budget
    assert s.consumer_args["session_timeout_ms"] == 10000


# How the engine's settings that are not a Config field of the same name come from the
# configuration: for each, variables that change it (one set each).
DERIVED: dict[str, list[dict[str, str]]] = {
    "transactional_id_prefix": [
        {"CRS_TRANSACTIONAL_ID_PREFIX": "tuned-prefix"},
        {"CRS_GROUP_ID": "tuned-group"},  # the prefix defaults to the group id
    ],
    "revoke_commit_s": [{"CRS_SESSION_TIMEOUT_MS": "20000"}, {"CRS_REVOKE_WAIT_S": "1"}],
    "assign_wait_s": [{"CRS_SESSION_TIMEOUT_MS": "20000"}],
    "stop_wait_s": [{"CRS_SHUTDOWN_TIMEOUT_S": "15"}],
    "client_args": [
        {"KAFKA_BOOTSTRAP_SERVERS": "tuned:9092"},
        {
            "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "KAFKA_SASL_MECHANISM": "PLAIN",
            "KAFKA_SASL_USERNAME": "u",
            "KAFKA_SASL_PASSWORD": "p",
        },
    ],
    "consumer_args": [{"CRS_SESSION_TIMEOUT_MS": "20000"}, {"CRS_METADATA_MAX_AGE_S": "5"}],
}
# The engine's own knobs, not settings of the service (their defaults are the engine's).
ENGINE_ONLY = {"poll_keepalive_s", "lag_refresh_s", "txn_open_ahead_max_s"}


def _tuned(field: str) -> str:
    """A valid value of Config ``field`` other than its default, as a variable's text."""
    default = getattr(Config(), field)
    hint = next(s.hint for s in SETTINGS if s.field == field)
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) is typing.Literal:
        return next(str(choice) for choice in typing.get_args(hint) if choice != default)
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int):
        return str(default + 1)
    if isinstance(default, float):
        return str(default / 2)  # within every bound a larger base or smaller cap keeps
    return f"tuned-{field.replace('_', '-')}"


def test_every_engine_setting_is_declared_once_in_the_config() -> None:
    # Each field of StreamSettings is a Config setting of the same name, derived from
    # settings (DERIVED), or the engine's own; a new one must be placed here.
    fields = {f.name for f in dataclasses.fields(StreamSettings)}
    same = fields & set(Config.__struct_fields__) - DERIVED.keys()
    assert fields == same | DERIVED.keys() | ENGINE_ONLY
    # The defaults of an engine built directly are the service's.
    shipped = StreamSettings.from_config(Config())
    direct = StreamSettings(input_topic=shipped.input_topic, group_id=shipped.group_id)
    for name in fields - {"transactional_id_prefix", "client_args", "consumer_args"}:
        assert getattr(direct, name) == getattr(shipped, name), name


def test_every_setting_reaches_the_engine() -> None:
    env = {s.field: s.env for s in SETTINGS}
    fields = {f.name for f in dataclasses.fields(StreamSettings)}
    shipped = StreamSettings.from_config(Config())
    for name in sorted(fields & set(Config.__struct_fields__) - DERIVED.keys()):
        tuned = Config.load(env={env[name]: _tuned(name)})
        value = getattr(StreamSettings.from_config(tuned), name)
        assert value == getattr(tuned, name) != getattr(shipped, name), name
    for name, changes in DERIVED.items():
        for change in changes:
            value = getattr(StreamSettings.from_config(Config.load(env=change)), name)
            assert value != getattr(shipped, name), (name, change)


def test_recorder_options_carry_the_conflict_knobs() -> None:
    opts = recorder_options(Config.load(env=TUNED))
    assert opts == {
        "conflict_timeout_s": 11.0,
        "max_conflict_retries": 4,
        "backoff_s": 0.02,
        "backoff_max_s": 0.75,
    }
    # Unset, the retry count is unbounded (only the timeout bounds the conflicts).
    assert recorder_options(Config())["max_conflict_retries"] is None
    inspect.signature(Recorder).bind(None, **opts)


def test_client_options_carry_the_request_knobs() -> None:
    opts = client_options(Config.load(env=TUNED))
    assert opts == {"request_timeout_s": 13.0, "max_writes": 6}
    inspect.signature(KubeClient.create).bind(None, **opts)


def test_watch_options_carry_the_watch_knobs() -> None:
    opts = watch_options(Config.load(env=TUNED))
    assert opts == {
        "page_size": 77,
        "watch_timeout_s": 9.0,
        "idle_timeout_s": 40.0,
        "silence_bound_s": 40.0,
        "stale_after_s": 45.0,
        "backoff_base_s": 0.25,
        "backoff_max_s": 12.0,
        "invariant_grace_s": 60.0,
    }
    inspect.signature(WatchClusterState).bind(None, **opts)


def test_the_watch_renewal_defaults_to_within_the_readiness_bound() -> None:
    assert watch_options(Config())["watch_timeout_s"] == 15.0
    short = Config.load(env={"CRS_READINESS_BOUND_S": "6"})
    assert watch_options(short)["watch_timeout_s"] == 3.0
    assert watch_options(Config.load(env={"CRS_READINESS_BOUND_S": "1"}))["watch_timeout_s"] == 1


class _Loop:
    started = True

    def __init__(self, idle_s: float, fetching_s: float = 0.0) -> None:
        self.last_loop = time.monotonic() - idle_s
        self.fetching_s = fetching_s

    def fetching_for(self) -> float:
        return self.fetching_s


class _Probe:
    def __init__(self, failed_ago_s: float | None) -> None:
        self.failed_ago_s = failed_ago_s

    def failed_within(self, seconds: float) -> bool:
        return self.failed_ago_s is not None and self.failed_ago_s <= seconds


def test_liveness_spares_a_loop_waiting_in_a_rebalance_while_kafka_is_away() -> None:
    # aiokafka's getmany() waits for a rebalance's assignment without limit, through a
    # whole broker outage: a wait, not a wedge. The real-stack counterpart is
    # test_broker_frozen.py::test_a_broker_outage_during_a_rebalance_is_no_reason_to_restart.
    runtime = Runtime(
        Config.load(env={"CRS_LIVENESS_BOUND_S": "5", "CRS_RETRY_BACKOFF_MAX_S": "2"})
    )
    fake: Any = runtime
    fake.kafka_probe = _Probe(failed_ago_s=3)
    fake.stream = _Loop(idle_s=30, fetching_s=29)
    ok, detail = runtime._alive()
    assert ok
    assert "waiting for the Kafka group" in detail
    # Kafka answering for longer than a session timeout plus a request timeout: wedged.
    fake.kafka_probe = _Probe(failed_ago_s=60)
    assert not runtime._alive()[0]
    fake.kafka_probe = _Probe(failed_ago_s=None)
    assert not runtime._alive()[0]
    # Idle outside getmany() (the loop's own code): wedged, whatever Kafka does.
    fake.kafka_probe = _Probe(failed_ago_s=3)
    fake.stream = _Loop(idle_s=30, fetching_s=0)
    assert not runtime._alive()[0]
    fake.stream = _Loop(idle_s=30, fetching_s=10)
    assert not runtime._alive()[0]


def test_liveness_fails_after_the_configured_bound() -> None:
    runtime = Runtime(
        Config.load(env={"CRS_LIVENESS_BOUND_S": "5", "CRS_RETRY_BACKOFF_MAX_S": "2"})
    )
    fake: Any = runtime
    fake.stream = _Loop(idle_s=10)
    ok, detail = runtime._alive()
    assert not ok
    assert "has not turned for 10s" in detail
    fake.stream = _Loop(idle_s=2)
    assert runtime._alive() == (True, "ok")
    default = Runtime(Config())
    fake = default
    fake.stream = _Loop(idle_s=10)  # well inside the default 180 s
    assert default._alive() == (True, "ok")


# --- Kafka identity and replay control reach the clients ----------------------------------


class _Built(Exception):
    """Raised by a factory once it has seen its arguments: nothing is started."""


async def _consumer_kwargs(config: Config) -> dict[str, Any]:
    """The keyword arguments the engine builds its Kafka consumer with."""
    seen: dict[str, Any] = {}

    def consumer(**kw: Any) -> Any:
        seen.update(kw)
        raise _Built

    service = StreamService(
        StreamSettings.from_config(config),
        None,  # type: ignore[arg-type]  # never reached
        StreamMetrics(),
        consumer_factory=consumer,
        producer_factory=lambda **kw: None,
    )
    with pytest.raises(_Built):
        await service.start()
    return seen


async def test_client_id_and_offset_reset_reach_the_consumer() -> None:
    env = {"KAFKA_CLIENT_ID": "crs-eu-1", "CRS_AUTO_OFFSET_RESET": "latest"}
    kw = await _consumer_kwargs(Config.load(env=env))
    assert (kw["client_id"], kw["auto_offset_reset"]) == ("crs-eu-1", "latest")
    # aiokafka takes them as such (a misspelt keyword would raise here).
    consumer = AIOKafkaConsumer(**kw)
    assert consumer._client._client_id == "crs-eu-1"
    await consumer.stop()
    # The default replays: a new group starts at the earliest retained record.
    assert (await _consumer_kwargs(Config.load(env={})))["auto_offset_reset"] == "earliest"


def test_client_id_defaults_to_the_group_and_the_pod_name() -> None:
    env = {"CRS_GROUP_ID": "crs", "CRS_POD_NAME": "crs-consumer-5d9c7-x2k4p"}
    config = Config.load(env=env)
    assert config.kafka_client_args()["client_id"] == "crs-crs-consumer-5d9c7-x2k4p"
    unnamed = Config.load(env={"CRS_GROUP_ID": "crs"})
    assert unnamed.kafka_client_args()["client_id"] == f"crs-{socket.gethostname()}"
    named = Config.load(env=env | {"KAFKA_CLIENT_ID": "mine"})
    assert named.kafka_client_args()["client_id"] == "mine"


async def test_every_kafka_client_of_the_replica_carries_the_client_id() -> None:
    # The engine's per-partition producers, the admin clients of check and kafka_access and
    # the dlq tool's clients all take kafka_client_args; the probe marks its own.
    config = Config.load(env={"KAFKA_CLIENT_ID": "crs-eu-1"})
    assert StreamSettings.from_config(config).client_args["client_id"] == "crs-eu-1"
    client = KafkaProbe(config.kafka_client_args())._new_client()
    assert client._client_id == "crs-eu-1-probe"
    await client.close()


def test_offset_reset_accepts_only_earliest_or_latest() -> None:
    with pytest.raises(ConfigError, match="CRS_AUTO_OFFSET_RESET='none': must be one of"):
        Config.load(env={"CRS_AUTO_OFFSET_RESET": "none"})
