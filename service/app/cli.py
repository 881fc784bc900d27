"""Command line: ``crs-consumer run | check | seed | demo``.

Every setting can come from its environment variable or from a flag of the same name
(``CRS_INPUT_TOPIC`` ↔ ``--input-topic``); the flag wins. Exit codes: 0 success, 1 a
runtime failure (``check`` could not connect, the service failed), 2 invalid
configuration or usage, with the offending variable named on one line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from service.app.config import SETTINGS, Config, ConfigError

__all__ = ["build_parser", "main"]


def _add_settings(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings (each also read from its environment variable)")
    for s in SETTINGS:
        default = "unset" if s.default is None else s.default
        if s.secret:
            group.add_argument(
                s.flag,
                dest=f"{s.field}_file",
                metavar="PATH",
                default=None,
                help=f"file holding the {s.help} [env {s.env} or {s.file_env}]",
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
        ("seed", "create the demo region in Kubernetes and publish the demo outcomes"),
        ("demo", "seed the demo region, run the consumer until drained, print a summary"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        _add_settings(p)
        if name in {"seed", "demo"}:
            p.add_argument("--events", type=int, default=300, help="outcomes to publish")
            p.add_argument("--seed", dest="random_seed", type=int, default=7, help="RNG seed")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for s in SETTINGS:
        if s.secret and getattr(args, s.field) is not None:
            print(
                f"crs-consumer: --{s.field.replace('_', '-')} is not accepted (a command line "
                f"is visible to other users): set {s.env} or {s.file_env}, or pass {s.flag}",
                file=sys.stderr,
            )
            return 2
    overrides: dict[str, str | None] = {}
    for s in SETTINGS:
        key = f"{s.field}_file" if s.secret else s.field
        overrides[key] = getattr(args, key)
    try:
        config = Config.load(overrides=overrides)
    except ConfigError as exc:
        print(f"crs-consumer: invalid configuration: {exc}", file=sys.stderr)
        return 2

    from service.app.logs import configure_logging

    if args.command == "run":
        configure_logging(config.log_level, config.log_format)
        from service.app.runtime import run_service

        return asyncio.run(run_service(config))
    if args.command == "check":
        # check speaks in one line per dependency; client libraries' own logs would
        # only repeat the failure it reports.
        configure_logging("CRITICAL", config.log_format)
        from service.app.check import run_check

        return asyncio.run(run_check(config))
    from service.app import demo

    if args.command == "seed":
        configure_logging(config.log_level, config.log_format)
        return asyncio.run(demo.seed(config, events=args.events, rng_seed=args.random_seed))
    return asyncio.run(demo.demo(config, events=args.events, rng_seed=args.random_seed))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
