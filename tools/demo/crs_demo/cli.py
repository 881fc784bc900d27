"""Command line: ``crs-consumer-demo seed | demo``.

Takes the service's settings the same way ``crs-consumer`` does (environment variables,
flags of the same name winning), so ``devstack/run/env`` and compose's environment work
unchanged. Exit codes: 0 success, 1 a failure (including refusing to replace objects the
demo does not own), 2 invalid configuration or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from service.app.cli import add_settings, config_from_args, secret_value_refused
from service.app.config import ConfigError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crs-consumer-demo",
        description="Seed a demo region for crs-consumer and run the demo tour. For "
        "development clusters only: it creates and deletes objects labelled as its own.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (
        ("seed", "create the demo region in Kubernetes and publish the demo outcomes"),
        ("demo", "seed the demo region, run the consumer until drained, print a summary"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        add_settings(p)
        p.add_argument("--events", type=int, default=300, help="outcomes to publish")
        p.add_argument("--seed", dest="random_seed", type=int, default=7, help="RNG seed")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refused = secret_value_refused(args)
    if refused:
        print(f"crs-consumer-demo: {refused}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"crs-consumer-demo: invalid configuration: {exc}", file=sys.stderr)
        return 2

    from crs_demo import demo
    from service.app.logs import configure_logging

    if args.command == "seed":
        configure_logging(config.log_level, config.log_format)
        return asyncio.run(demo.seed(config, events=args.events, rng_seed=args.random_seed))
    return asyncio.run(demo.demo(config, events=args.events, rng_seed=args.random_seed))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
