"""Rotated TLS and SASL secret files: noticed, checked, and handed to a restart.

Strimzi renews user and cluster-CA certificates; a KafkaUser's password can change too.
In a pod the Secret is a mounted volume whose files change in place: the kubelet writes
the new content into a fresh directory and swaps the ``..data`` symlink to it in one
rename. No inotify event reaches a file opened through the old link, and the swap keeps
every visible path, so the files are polled: their content hashed every
``CRS_SECRET_RELOAD_INTERVAL_S`` (a few kilobytes; a content change, however written, is
noticed, and a touched but unchanged file is not a rotation).

A change is acted on only once the new material loads: the whole configuration is read
again (:meth:`SecretFiles.load`), which builds the TLS context with the key and its
password, so a certificate that does not match its key, a key whose password file is not
yet updated, or a half-written file is refused there. A refused change keeps the clients
that work, says once why (paths only, never contents) and is tried again at the next
poll: the kubelet finishes writing. An accepted one is returned to the runtime, which
rebuilds the Kafka clients along its orderly restart path (see
``service.app.runtime._run``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from service.app.config import Config
from service.stream.codec import clip

__all__ = ["Reloaded", "SecretFiles", "SecretMetrics", "new_secret_metrics"]

log = structlog.get_logger(__name__)

# Content hash per path; None: missing or unreadable (a swap under way, a removed mount).
Fingerprint = dict[str, str | None]
RESULTS = ("applied", "invalid")


@dataclass(frozen=True)
class SecretMetrics:
    """The rotation's series: the changes acted on, and whether the files are refused now."""

    reloads: Counter
    # A counter says a change was refused once; an alert needs the state, which lasts
    # until the files load (or are back to what the clients were built from).
    refused: Gauge


def new_secret_metrics(registry: CollectorRegistry) -> SecretMetrics:
    reloads = Counter(
        "crs_secret_reloads",
        "Changes of the TLS/SASL secret files acted on: applied (the Kafka clients were "
        "rebuilt with them) or invalid (they did not load; the running clients were kept)",
        ["result"],
        registry=registry,
    )
    for result in RESULTS:  # both series from the start: increase() sees the first one
        reloads.labels(result)
    refused = Gauge(
        "crs_secret_files_refused",
        "1 while the TLS/SASL secret files have changed and do not load: the Kafka clients "
        "keep the material they were built with, until it expires; 0 once the files load "
        "or are back to that material",
        registry=registry,
    )
    return SecretMetrics(reloads, refused)


def fingerprint(paths: Mapping[str, str]) -> Fingerprint:
    out: Fingerprint = {}
    for path in paths.values():
        try:
            with open(path, "rb") as f:  # through the symlinks: what a client would load
                out[path] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            out[path] = None
    return out


@dataclass(frozen=True)
class Reloaded:
    """A change that loaded: the configuration read from it, and what changed."""

    config: Config
    files: list[str]  # the variables whose files changed, with their paths


class SecretFiles:
    """The secret files one configuration was read from, polled for a rotation.

    ``files``: variable (``KAFKA_SSL_CERTFILE``, ``KAFKA_SASL_PASSWORD_FILE``...) -> path.
    ``load`` reads the whole configuration again (raising when it does not load);
    ``metrics``: the series it keeps (:func:`new_secret_metrics`); ``sleep``: the poll's
    wait (a fake clock's in unit tests).
    """

    def __init__(
        self,
        files: Mapping[str, str],
        load: Callable[[], Config],
        *,
        interval_s: float,
        metrics: SecretMetrics | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.files = dict(files)
        self._load = load
        self.interval_s = interval_s
        self.metrics = metrics
        self._sleep = sleep
        # The content the current configuration was read from: empty until the first
        # load, so a poll before it reads the files once.
        self._baseline: Fingerprint = {}
        self._refused: Fingerprint | None = None  # the last change that did not load

    def load(self) -> Config:
        """The configuration read again, remembering the content it was read from.

        The files are hashed *before* they are read: a change landing in between makes
        the next poll see a difference (one more rebuild, never a missed rotation).
        """
        before = fingerprint(self.files)
        config = self._load()
        self._baseline = before
        self._note_refused(None)
        return config

    def _note_refused(self, content: Fingerprint | None) -> None:
        """The last change that did not load (None: the files load, or are the baseline),
        and the gauge an alert reads, derived from it."""
        self._refused = content
        if self.metrics is not None:
            self.metrics.refused.set(0 if content is None else 1)

    def poll(self) -> Reloaded | None:
        """One check: the reloaded configuration when the files changed and load, else
        None (unchanged, or a change that does not load, which is logged and counted once
        and retried at each poll until it does)."""
        now = fingerprint(self.files)
        if all(now[p] == self._baseline.get(p, "") for p in self.files.values()):
            # Unchanged, or back to the content the clients were built from.
            self._note_refused(None)
            return None
        files = [
            f"{name}={path}"
            for name, path in self.files.items()
            if now[path] != self._baseline.get(path, "")
        ]
        quiet = now == self._refused  # the same broken content: said already
        try:
            config = self._load()
        except Exception as exc:  # ConfigError above all: a file that does not load
            if not quiet:
                log.warning(
                    "secret_reload_invalid",
                    files=files,
                    error=clip(f"{type(exc).__name__}: {exc}"),
                    hint="keeping the running Kafka clients; retried at the next poll",
                )
                if self.metrics is not None:
                    self.metrics.reloads.labels("invalid").inc()
            self._note_refused(now)
            return None
        # Hashed before the load: content changed since is seen at the next poll.
        self._baseline = now
        self._note_refused(None)
        log.info("secret_files_changed", files=files, action="rebuilding the Kafka clients")
        if self.metrics is not None:
            self.metrics.reloads.labels("applied").inc()
        return Reloaded(config, files)

    async def next_change(self) -> Reloaded:
        """Poll every ``interval_s`` until a change loads; returns it."""
        while True:
            await self._sleep(self.interval_s)
            try:
                reloaded = self.poll()
            except Exception as exc:  # a watcher's fault must not end the service
                log.error("secret_files_poll_failed", error=clip(f"{type(exc).__name__}: {exc}"))
                continue
            if reloaded is not None:
                return reloaded
