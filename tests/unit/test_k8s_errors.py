"""Transport failures become the ports' error types (service.k8s.errors)."""

from __future__ import annotations

import aiohttp
from kubernetes_asyncio.config.config_exception import ConfigException

from service.crs.ports import UnavailableError
from service.k8s.errors import map_exception


def test_a_failed_credential_refresh_is_an_outage_not_a_bad_event() -> None:
    # kubernetes_asyncio refreshes the token inside the request; an empty token file (read
    # while the kubelet replaces it) raised ConfigException, which dead-lettered the event.
    err = map_exception(ConfigException("Token file exists but empty."), what="patch r-1")
    assert isinstance(err, UnavailableError)
    assert str(err).startswith("patch r-1: credentials: Token file exists but empty.")


def test_timeouts_and_connection_errors_are_outages_and_other_exceptions_are_not_mapped() -> None:
    assert isinstance(map_exception(TimeoutError()), UnavailableError)
    assert isinstance(map_exception(aiohttp.ClientConnectionError("reset")), UnavailableError)
    assert map_exception(ValueError("a bug")) is None
