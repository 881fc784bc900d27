"""Start-up: which failures are worth another attempt, and which are configuration."""

from __future__ import annotations

import socket
import ssl

import aiohttp
import pytest
from aiokafka import errors as kafka_errors
from kubernetes_asyncio.config import ConfigException
from prometheus_client import CollectorRegistry

from service.app.config import ConfigError
from service.app.http import HealthChecks, HttpServer
from service.app.runtime import _transient_startup_error
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
