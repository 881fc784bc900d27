"""Command line: ``crs-consumer run | check``.

Every setting can come from its environment variable or from a flag of the same name
(``CRS_INPUT_TOPIC`` ↔ ``--input-topic``); the flag wins. Exit codes: 0 success, 1 a
runtime failure (``check`` could not connect, the service failed), 2 invalid
configuration or usage, with the offending variable named on one line. The demo and
seeding commands live in a separate tool (tools/demo, ``crs-consumer-demo``), which reuses
:func:`add_settings` and :func:`config_from_args`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from service.app.config import SETTINGS, Config, ConfigError

__all__ = ["add_settings", "build_parser", "config_from_args", "main"]


def add_settings(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, defaulting to None so the environment applies when absent."""
    group = parser.add_argument_group("settings (each also read from its environment variable)")
    for s in SETTINGS:
        default = "unset" if s.default is None else s.default
        group.add_argument(
            f"--{s.field.replace('_', '-')}",
            dest=s.field,
            metavar=s.env,
            default=None,
            help=f"{s.help} [env {s.env}, default {default}]",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The configuration from the environment, overridden by the flags given (ConfigError)."""
    return Config.load(overrides={s.field: getattr(args, s.field) for s in SETTINGS})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"crs-consumer: invalid configuration: {exc}", file=sys.stderr)
        return 2

    from service.app.logs import configure_logging

    if args.command == "run":
        configure_logging(config.log_level, config.log_format)
        from service.app.runtime import run_service

        return asyncio.run(run_service(config))
    # check speaks in one line per dependency; client libraries' own logs would only
    # repeat the failure it reports.
    configure_logging("CRITICAL", config.log_format)
    from service.app.check import run_check

    return asyncio.run(run_check(config))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
