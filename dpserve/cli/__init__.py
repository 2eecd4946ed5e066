"""``dpserve`` command line: one subcommand per process kind, one module per subcommand,
named after it (``http_cmd`` and ``operator_cmd``: ``http`` and ``operator`` are standard-library
modules).

Each subcommand module has ``add_parser(subparsers)`` (its flags, with the defaults of their
owners) and ``run(args)``; heavy imports (torch, transformers, kopf) happen inside ``run`` so
that ``dpserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dpserve.cli import coordinator, engine, generate, http_cmd, keys, operator_cmd, serve
from dpserve.cli.common import DEFAULT_HTTP_PORT, DEFAULT_ZMQ_PORT, setup_logging
from dpserve.cli.coordinator import coordinator_config as _coordinator_config
from dpserve.cli.engine import engine_device, resolve_rank

__all__ = [
    "DEFAULT_HTTP_PORT",
    "DEFAULT_ZMQ_PORT",
    "_coordinator_config",
    "build_parser",
    "engine_device",
    "main",
    "resolve_rank",
]

# In the order `dpserve --help` lists them.
SUBCOMMANDS = (coordinator, engine, serve, http_cmd, generate, keys, operator_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpserve", description="Data-parallel LLM inference: coordinator, engines, HTTP."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    return args.func(args) or 0
