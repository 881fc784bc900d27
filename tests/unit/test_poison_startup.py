"""Start-up: which failures are worth another attempt, and which are configuration."""

from __future__ import annotations

import asyncio
import socket
import ssl

import aiohttp
import pytest
from aiokafka import errors as kafka_errors
from kubernetes_asyncio.config import ConfigException
from prometheus_client import CollectorRegistry

from service.app.config import Config, ConfigError
from service.app.http import HealthChecks, HttpServer
from service.app.kafka_access import Acl, KafkaAccessDenied
from service.app.runtime import _start_with_retry, _transient_startup_error
from service.crs.ports import ForbiddenError, InvalidError, UnavailableError


@pytest.mark.parametrize(
    "error",
    [
        kafka_errors.KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]"),
        kafka_errors.NoBrokersAvailable(),
        kafka_errors.KafkaTimeoutError(),
        kafka_errors.NotCoordinatorForGroupError(),
        ConnectionRefusedError(111, "Connection refused"),
        TimeoutError(),
        aiohttp.ClientConnectionError("reset"),
        UnavailableError("apiserver starting", status=503),
    ],
)
def test_transient_errors_are_retried(error: BaseException) -> None:
    assert _transient_startup_error(error)


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(2, "No such file", "/etc/kube/config"),
        PermissionError(13, "Permission denied", "/etc/kafka/ca.crt"),
        ConfigException("Invalid kube-config file"),
        ValueError("bad setting"),
        ssl.SSLCertVerificationError("certificate verify failed"),
        kafka_errors.AuthenticationFailedError(),
        kafka_errors.UnsupportedSaslMechanismError(),
        kafka_errors.TopicAuthorizationFailedError(),
        kafka_errors.GroupAuthorizationFailedError(),
        kafka_errors.TransactionalIdAuthorizationFailed(),
        kafka_errors.KafkaConfigurationError(),
        InvalidError("no such resource", status=404),
        ForbiddenError("forbidden", status=403),
    ],
)
def test_configuration_errors_exit(error: BaseException) -> None:
    assert not _transient_startup_error(error)


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])
async def test_an_http_address_that_cannot_be_listened_on_is_configuration(host: str) -> None:
    # Not this host's address / not resolvable: retrying (OSError) would loop for good.
    server = HttpServer(CollectorRegistry(), HealthChecks(alive=alive, ready=ready), host, 0)
    with pytest.raises(ConfigError, match=f"CRS_HTTP_HOST='{host}'") as err:
        await server.start()
    assert not _transient_startup_error(err.value)


async def test_a_port_in_use_stays_an_error_worth_retrying() -> None:
    # The previous process may still be exiting.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        server = HttpServer(
            CollectorRegistry(), HealthChecks(alive=alive, ready=ready), "127.0.0.1", port
        )
        with pytest.raises(OSError, match="address already in use") as err:
            await server.start()
        assert _transient_startup_error(err.value)
    finally:
        taken.close()


def alive() -> tuple[bool, str]:
    return True, "ok"


async def ready() -> tuple[bool, str]:
    return True, "ok"


class _Attempt:
    """A Runtime as _start_with_retry drives it: each attempt's start() fails with the
    next of ``errors`` until they run out."""

    def __init__(self, errors: list[BaseException], config: Config) -> None:
        self.errors, self.config = errors, config

    async def start(self) -> None:
        if self.errors:
            raise self.errors.pop(0)

    async def stop(self, *, keep_front: bool = False) -> None:
        pass

    def handover(self, error: str, config: Config | None = None) -> _Attempt:
        return _Attempt(self.errors, config or self.config)


@pytest.mark.parametrize("restarting", [False, True])
async def test_what_the_broker_refuses_is_waited_out_once_the_service_has_run(
    restarting: bool,
) -> None:
    # At the first start a missing ACL is configuration (exit, named); on a restart after
    # the Kafka client ended (service.app.runtime.run_service), the same configuration
    # ran before: the broker's side changed, and an operator restores it.
    config = Config.load(env={"CRS_RETRY_BACKOFF_S": "0.01", "CRS_RETRY_BACKOFF_MAX_S": "0.01"})
    errors: list[BaseException] = [
        KafkaAccessDenied([(Acl("Group", "g", "literal", "Read"), "GROUP_AUTHORIZATION_FAILED")]),
        kafka_errors.GroupAuthorizationFailedError(),
    ]
    started = await _start_with_retry(
        _Attempt(errors, config),  # type: ignore[arg-type]
        asyncio.Event(),
        restarting=restarting,
    )
    if restarting:
        assert started is not None
        assert not errors
    else:
        assert started is None
        assert len(errors) == 1


async def test_a_refused_authentication_still_exits_on_a_restart() -> None:
    # Credentials are not waited out on a restart: the configuration is (read again and)
    # wrong, not an ACL the broker's operator restores.
    config = Config.load(env={"CRS_RETRY_BACKOFF_S": "0.01"})
    errors: list[BaseException] = [kafka_errors.AuthenticationFailedError()]
    started = await _start_with_retry(
        _Attempt(errors, config),  # type: ignore[arg-type]
        asyncio.Event(),
        restarting=True,
    )
    assert started is None


async def test_each_further_attempt_reads_the_configuration_again() -> None:
    # A secret file rotated while the broker refuses the old one: the next attempt has
    # the new value (and a read that fails keeps the last configuration).
    env = {"CRS_RETRY_BACKOFF_S": "0.01", "CRS_RETRY_BACKOFF_MAX_S": "0.01"}
    reads = iter([ConfigError("KAFKA_SASL_PASSWORD_FILE: no such file"), "new"])
    seen: list[str] = []

    def reload() -> Config:
        found = next(reads)
        if isinstance(found, Exception):
            raise found
        return Config.load(env=env | {"CRS_GROUP_ID": found})

    class Recording(_Attempt):
        async def start(self) -> None:
            seen.append(self.config.group_id)
            await super().start()

        def handover(self, error: str, config: Config | None = None) -> _Attempt:
            return Recording(self.errors, config or self.config)

    errors: list[BaseException] = [kafka_errors.KafkaConnectionError()] * 2
    started = await _start_with_retry(
        Recording(errors, Config.load(env=env | {"CRS_GROUP_ID": "old"})),  # type: ignore[arg-type]
        asyncio.Event(),
        reload,
    )
    assert started is not None
    assert seen == ["old", "old", "new"]
