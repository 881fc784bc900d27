"""Command line: ``crs-consumer run | check | audit | dlq``.

Every setting can come from its environment variable or from a flag of the same name
(``CRS_INPUT_TOPIC`` ↔ ``--input-topic``); the flag wins. Exit codes: 0 success, 1 a
runtime failure (``check`` could not connect, the service failed), 2 invalid
configuration or usage, with the offending variable named on one line. The demo and
seeding commands live in a separate tool (tools/demo, ``crs-consumer-demo``), which reuses
:func:`add_settings`, :func:`secret_value_refused` and :func:`config_from_args`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from service.app.config import SETTINGS, Config, ConfigError, secret_files

if TYPE_CHECKING:  # the dlq module (aiokafka) is imported only by the dlq command
    from service.app.dlq import DlqFilter

__all__ = [
    "add_settings",
    "build_parser",
    "config_from_args",
    "main",
    "secret_value_refused",
    "until_signalled",
]


def add_settings(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, defaulting to None so the environment applies when absent."""
    group = parser.add_argument_group("settings (each also read from its environment variable)")
    for s in SETTINGS:
        default = "unset" if s.default is None else s.default
        text = s.help.replace("%", "%%")  # argparse formats help with %
        if s.secret:
            group.add_argument(
                s.flag,
                dest=f"{s.field}_file",
                metavar="PATH",
                default=None,
                help=f"file holding the {text} [env {s.env} or {s.file_env}]",
            )
            # The old value flag put the secret into `ps` output: refused with a pointer.
            group.add_argument(
                f"--{s.field.replace('_', '-')}", dest=s.field, help=argparse.SUPPRESS
            )
            continue
        group.add_argument(
            s.flag,
            dest=s.field,
            metavar=s.env,
            default=None,
            help=f"{text} [env {s.env}, default {default}]",
        )


class _Parser(argparse.ArgumentParser):
    """argparse, with the values of ``--flag=value`` arguments left out of its errors: an
    unknown or mistyped flag is echoed whole, e.g. ``--sasl-passw=VALUE`` (a password)
    to stderr, which ends up in logs. No abbreviated flags either."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        super().error(re.sub(r"(--[\w-]+)=\S+", r"\1=...", message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="crs-consumer",
        description="Classify Nova scheduling outcomes against committed-resource "
        "reservations: Kafka in, Reservation slots and classification events out.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (
        ("run", "run the consumer service until SIGTERM/SIGINT"),
        ("check", "validate the configuration and connectivity to Kafka and Kubernetes"),
    ):
        add_settings(sub.add_parser(name, help=text, description=text))
    text = "report what violates the allocation invariants, from one listing (never writes)"
    p = sub.add_parser(
        "audit",
        help=text,
        description=text + ": a VM in more than one Reservation for longer than "
        "CRS_INVARIANT_GRACE_S (counted from its allocations' creationTimestamp: one-shot, "
        "no history), an overfilled slot, a malformed allocation, allocations without a "
        "targetHost",
        epilog="exit codes: 0 nothing found; 1 violations found; 2 the API server could not "
        "be read, or an invalid command line or configuration",
    )
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    add_settings(p)
    _add_operability(parser, sub)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The configuration from the environment, overridden by the flags given (ConfigError).

    A secret comes from its variable or a file (``--*-file``), never from a flag value.
    """
    return Config.load(overrides=_overrides(args))


def _overrides(args: argparse.Namespace) -> dict[str, str | None]:
    overrides: dict[str, str | None] = {}
    for s in SETTINGS:
        key = f"{s.field}_file" if s.secret else s.field
        overrides[key] = getattr(args, key)
    return overrides


def secret_value_refused(args: argparse.Namespace) -> str | None:
    """Why the command line is refused, when it passes a secret as a flag value (the old
    ``--sasl-password``: a command line is visible to other users), else None.

    For every command taking :func:`add_settings`' flags: :func:`config_from_args` reads
    secrets from files only, so a value left unrefused would be silently dropped.
    """
    for s in SETTINGS:
        if s.secret and getattr(args, s.field) is not None:
            return (
                f"--{s.field.replace('_', '-')} is not accepted (a command line is visible "
                f"to other users): set {s.env} or {s.file_env}, or pass {s.flag}"
            )
    return None


# --- operability: --version, dlq list | redrive


def _add_operability(parser: argparse.ArgumentParser, sub: Any) -> None:
    from service.stream.metrics import service_version

    parser.add_argument("--version", action="version", version=f"crs-consumer {service_version()}")
    text = "list the dead-letter topic, or redrive dead letters to the input topic"
    p = sub.add_parser(
        "dlq",
        help=text,
        description=text,
        epilog="exit codes: 0 done; 1 failed (redrive: nothing sent, unless the commit's outcome "
        "was unknown); 2 invalid command line or configuration; 3 stopped before the end of "
        "the dead-letter topic or more than --max-send-bytes selected (list: a partial "
        "summary; redrive: nothing sent)",
    )
    p.add_argument("action", choices=("list", "redrive"), help="list: counts by code; redrive")
    p.add_argument("--code", action="append", default=[], help="only this crs.error code (repeat)")
    p.add_argument("--since", help="only dead letters at/after this time (ISO 8601, UTC)")
    p.add_argument("--until", help="only dead letters at/before this time (ISO 8601, UTC)")
    p.add_argument("--partition", type=int, help="only this dead-letter partition")
    p.add_argument("--from-offset", type=int, help="only offsets >= this (dead-letter topic)")
    p.add_argument("--to-offset", type=int, help="only offsets <= this (dead-letter topic)")
    p.add_argument("--max-records", type=int, default=100_000, help="read at most this many")
    p.add_argument("--max-redrives", type=int, default=3, help="refuse records redriven this often")
    p.add_argument(
        "--max-send-bytes",
        type=int,
        help="redrive: send nothing when the selected records hold more bytes (they are held "
        "in memory and sent in one transaction; default 256 MiB); narrow the selection",
    )
    p.add_argument("--dry-run", action="store_true", help="redrive: only show what would be sent")
    p.add_argument("--json", action="store_true", help="list: one JSON document")
    add_settings(p)


def _dlq_args_problem(args: argparse.Namespace, flt: DlqFilter) -> str | None:
    """What makes a dlq command line mean nothing (it would silently match nothing)."""
    from service.stream.metrics import DEAD_LETTER_CODES

    known = (*DEAD_LETTER_CODES, "unknown")  # "unknown": list's name for a missing crs.error
    unknown = sorted(set(args.code) - set(known))
    if unknown:
        return f"unknown --code {', '.join(unknown)} (known: {', '.join(known)})"
    if args.max_records < 1:
        return "--max-records must be at least 1"
    if args.max_redrives < 1:
        return "--max-redrives must be at least 1"
    if args.max_send_bytes is not None and args.max_send_bytes < 1:
        return "--max-send-bytes must be at least 1"
    if flt.since_ms is not None and flt.until_ms is not None and flt.since_ms > flt.until_ms:
        return "--since is after --until"
    if (
        flt.from_offset is not None
        and flt.to_offset is not None
        and flt.from_offset > flt.to_offset
    ):
        return "--from-offset is after --to-offset"
    return None


def _dlq_filter(args: argparse.Namespace) -> DlqFilter | None:
    """The dlq command line's filter, or None after saying on stderr why it means nothing."""
    from service.app import dlq

    try:
        flt = dlq.DlqFilter(
            codes=frozenset(args.code),
            since_ms=dlq.parse_time(args.since) if args.since else None,
            until_ms=dlq.parse_time(args.until) if args.until else None,
            partition=args.partition,
            from_offset=args.from_offset,
            to_offset=args.to_offset,
        )
    except ValueError as exc:
        print(f"crs-consumer dlq: invalid time: {exc}", file=sys.stderr)
        return None
    problem = _dlq_args_problem(args, flt)
    if problem:
        print(f"crs-consumer dlq: {problem}", file=sys.stderr)
        return None
    return flt


async def until_signalled(work: Coroutine[Any, Any, int], *, note: str = "") -> int:
    """``work``'s exit code; SIGTERM, SIGHUP and SIGINT cancel it, and exit 143/129/130.

    Python's default for the first two ends the process on the spot: a redrive killed so
    (a `kubectl delete` of its pod, a closed terminal) left its transaction open on the
    input, holding every event behind it back from the service for up to the
    transaction's timeout. Cancelled, the transaction's context aborts it on the way out.
    Ctrl-C too: asyncio.run's own handling cancels on the first but raises
    KeyboardInterrupt out of the event loop on the second, past everything the tool
    would say (a second Ctrl-C while a redrive waits for its commit's outcome gave a
    traceback instead of "may or may not have been sent"), and ends even the first in
    a traceback. A signal the process ignores (``nohup``) stays ignored. ``note``: said
    after the signal's name when one stopped the work.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[signal.Signals] = []

    def cancel(sig: signal.Signals) -> None:
        received.append(sig)
        task.cancel()

    handled = [
        s
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
        if signal.getsignal(s) != signal.SIG_IGN
    ]
    previous = {s: signal.getsignal(s) for s in handled}
    for sig in handled:
        loop.add_signal_handler(sig, cancel, sig)
    try:
        return await work
    except asyncio.CancelledError:
        if not received:
            raise
        task.uncancel()
        print(f"crs-consumer dlq: stopped by {received[0].name}{note}", file=sys.stderr)
        return 128 + received[0].value
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])


def _run_dlq(args: argparse.Namespace, config: Config, flt: DlqFilter) -> int:
    from service.app.check import capturing

    with capturing() as capture:
        return _dlq_action(args, config, flt, capture.errors)


def _dlq_action(
    args: argparse.Namespace, config: Config, flt: DlqFilter, errors: list[BaseException]
) -> int:
    from service.app import dlq

    try:
        if args.action == "list":
            return asyncio.run(
                until_signalled(
                    dlq.list_dlq(config, flt=flt, max_records=args.max_records, as_json=args.json)
                )
            )
        return asyncio.run(
            until_signalled(
                dlq.redrive(
                    config,
                    flt=flt,
                    max_records=args.max_records,
                    max_redrives=args.max_redrives,
                    max_send_bytes=args.max_send_bytes or dlq.DEFAULT_MAX_SEND_BYTES,
                    dry_run=args.dry_run,
                ),
                # The summary line is printed once the transaction has committed.
                note=""
                if args.dry_run
                else (
                    "; without a 'redriven' line above nothing was sent (its transaction "
                    "was aborted)"
                ),
            )
        )
    except Exception as exc:  # one line, not a traceback: the cause in words, as check says it
        cause = dlq.failure(exc, errors, config)
        print(f"crs-consumer dlq {args.action}: FAILED: {cause}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refused = secret_value_refused(args)
    if refused:
        print(f"crs-consumer: {refused}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"crs-consumer: invalid configuration: {exc}", file=sys.stderr)
        return 2

    from service.app.logs import configure_logging

    if args.command in {"run", "dlq", "audit"}:
        from service.app.check import file_problems

        # A missing CA bundle or kubeconfig is a configuration error, named as one; dlq
        # talks to Kafka only, so its kubeconfig is none of its business.
        problems = file_problems(config, kubernetes=args.command != "dlq")
        for line in problems:
            print(f"crs-consumer: invalid configuration: {line}", file=sys.stderr)
        if problems:
            return 2
    if args.command == "dlq":
        flt = _dlq_filter(args)  # before logging is set up: nothing to log yet
        if flt is None:
            return 2
        configure_logging("ERROR", config.log_format)
        return _run_dlq(args, config, flt)
    if args.command == "audit":
        # The report is the output; the client libraries' logs would only repeat a failure.
        configure_logging("CRITICAL", config.log_format)
        from service.app.audit import run_audit

        return asyncio.run(run_audit(config, as_json=args.json))
    if args.command == "run":
        configure_logging(config.log_level, config.log_format)
        from service.app.runtime import run_service

        return asyncio.run(
            run_service(
                config,
                reload=lambda: config_from_args(args),
                secret_files=secret_files(config, overrides=_overrides(args)),
            )
        )
    # check speaks in one line per dependency; client libraries' own logs would only
    # repeat the failure it reports.
    configure_logging("CRITICAL", config.log_format)
    from service.app.check import run_check

    return asyncio.run(run_check(config))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
