"""Start-up: which failures are worth another attempt, and which are configuration."""

from __future__ import annotations

import ssl

import aiohttp
import pytest
from aiokafka import errors as kafka_errors
from kubernetes_asyncio.config import ConfigException

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
