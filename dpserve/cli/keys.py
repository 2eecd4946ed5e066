"""``dpserve keys generate``: CURVE key pairs for every role."""

from __future__ import annotations

import argparse
import sys

from dpserve.cli.common import Subcommands
from dpserve.security import key_files


def add_parser(subparsers: Subcommands) -> None:
    keys = subparsers.add_parser("keys", help="create CURVE keys (see docs/security.md)")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    generate_keys = key_commands.add_parser(
        "generate", help="write a coordinator key pair, role key pairs and allowed/<role>/"
    )
    generate_keys.add_argument("directory", metavar="DIR")
    generate_keys.add_argument("--force", action="store_true", help="replace existing key pairs")
    generate_keys.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        root = key_files.generate_credentials(args.directory, force=args.force)
    except (key_files.CredentialsError, OSError) as exc:
        print(f"dpserve keys generate: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {root}/: coordinator, engine, client and admin key pairs (*.key public, "
        "*.key_secret secret, mode 0600) and allowed/{engine,client,admin}/.\n"
        "Give each process only its part: the coordinator coordinator.key_secret + allowed/, "
        "an engine engine.key_secret + coordinator.key, a client client.key_secret (or "
        "admin.key_secret) + coordinator.key. See docs/security.md."
    )
    return 0
