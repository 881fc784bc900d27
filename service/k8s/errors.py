"""Translate Kubernetes client failures into the error types of :mod:`service.crs.ports`.

The Recorder and the stream layer decide on the error *type* (retry a conflict, give up
on a forbidden, back off on an outage); they must never see aiohttp or kubernetes_asyncio
exceptions. Everything the transport can raise is funnelled through here.
"""

from __future__ import annotations

import asyncio

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from service.crs.ports import (
    ApiError,
    ConflictError,
    ForbiddenError,
    InvalidError,
    NotFoundError,
    UnavailableError,
)

__all__ = ["ResourceExpiredError", "error_for_status", "map_exception"]


class ResourceExpiredError(UnavailableError):
    """HTTP 410 on a watch: the resourceVersion is too old, only a new LIST helps."""


def error_for_status(status: int, message: str, *, kind: str = "") -> ApiError:
    """The error type for an HTTP status the API server answered with.

    410 Gone (an expired list ``continue`` token or watch resourceVersion) counts as
    unavailable: a fresh list answers it, which is what a retry does.
    """
    text = f"{message} (HTTP {status})"
    if status == 409:
        return ConflictError(text, status=status, kind=kind)
    if status == 404:
        return NotFoundError(text, status=status, kind=kind)
    if status in (401, 403):
        return ForbiddenError(text, status=status, kind=kind)
    if status in (400, 422):
        return InvalidError(text, status=status, kind=kind)
    if status in (410, 429) or status >= 500 or status == 0:
        return UnavailableError(text, status=status, kind=kind)
    # Anything else (405, 406, 415, ...) is a request this client should not have sent:
    # retrying the same request cannot help.
    return InvalidError(text, status=status, kind=kind)


def map_exception(exc: BaseException, *, kind: str = "", what: str = "") -> ApiError | None:
    """The :class:`ApiError` for a transport exception, or None if it is not one.

    ``what`` names the call for the message (e.g. ``"get reservations/r-1"``); it never
    contains request or response bodies.
    """
    prefix = f"{what}: " if what else ""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        return error_for_status(status, f"{prefix}{exc.reason or 'API error'}", kind=kind)
    if isinstance(exc, aiohttp.ClientResponseError):
        return error_for_status(exc.status, f"{prefix}{exc.message}", kind=kind)
    # TimeoutError is asyncio.TimeoutError on 3.11+; aiohttp's timeouts subclass both.
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return UnavailableError(f"{prefix}timed out", kind=kind)
    if isinstance(exc, aiohttp.ClientError | OSError):
        return UnavailableError(f"{prefix}{type(exc).__name__}: {exc}", kind=kind)
    # Raised inside a request by the credential refresh (an in-cluster token file read
    # while it is replaced, a kubeconfig exec plugin failing): the event is not at fault,
    # a retry reads the credentials again.
    if isinstance(exc, ConfigException):
        return UnavailableError(f"{prefix}credentials: {str(exc)[:200]}", kind=kind)
    return None
