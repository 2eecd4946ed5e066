"""``dpserve operator``: the Kubernetes operator (kopf), imported only when it runs."""

from __future__ import annotations

import argparse

from dpserve.cli.common import Subcommands


def add_parser(subparsers: Subcommands) -> None:
    operator = subparsers.add_parser("operator", help="run the Kubernetes operator (kopf)")
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument("--namespace", default=None, help="watch one namespace")
    scope.add_argument(
        "--all-namespaces", action="store_true", help="watch the whole cluster (the default)"
    )
    operator.add_argument("--liveness-port", type=int, default=8080)
    operator.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dpserve_operator.main import run as run_operator

    run_operator(
        namespace=args.namespace,
        all_namespaces=args.all_namespaces,
        liveness_port=args.liveness_port,
    )
    return 0
