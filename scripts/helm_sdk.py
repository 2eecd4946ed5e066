"""``scripts/helm``: Helm's own install and uninstall actions, through its Go SDK
(``helm-python-sdk``, installed by ``make setup``), for machines without a ``helm`` binary.

It takes the arguments of the ``helm`` commands the docs show, so the same line works with
either (``alias helm=scripts/helm``)::

    scripts/helm install dpserve-operator charts/dpserve-operator \\
        --namespace dpserve-system --create-namespace [--set KEY=VALUE ...] [-f values.yaml]
    scripts/helm uninstall dpserve-operator --namespace dpserve-system

The cluster comes from ``--kubeconfig``, else ``$KUBECONFIG``, else ``~/.kube/config``, as for
helm. Anything else is refused with helm's own advice: install helm.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

_HELM_TIMEOUT_SECONDS = 300  # helm's default --timeout (5m0s)


class UsageError(ValueError):
    """An argument this command cannot honour (the message says which)."""


def parse_duration(text: str) -> int:
    """Helm's --timeout (a Go duration like ``5m0s``, ``90s``, ``2m``) in whole seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    total, number = 0.0, ""
    for char in text.strip():
        if char.isdigit() or char == ".":
            number += char
        elif char in units and number:
            total += float(number) * units[char]
            number = ""
        else:
            raise UsageError(f"--timeout {text!r} is not a duration like 5m0s or 90s")
    if number:  # a bare number: seconds
        total += float(number)
    return max(1, round(total))


def _typed(value: str) -> Any:
    """What ``--set`` makes of a value: booleans, null and integers are typed, the rest text
    (helm's strvals rules; ``--set-string`` is for text that looks like a number)."""
    if value in ("true", "false"):
        return value == "true"
    if value == "null":
        return None
    if value.lstrip("-").isdigit():
        return int(value)
    return value


def set_value(values: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set a.b=c[,d=e]`` to ``values`` (nested keys by dots)."""
    for item in assignment.split(","):
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = values
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"--set {key}: {part} is not a map")
            node = child
        node[leaf] = _typed(value)


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` deep-merged over ``base`` (what several -f files do in helm)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/helm",
        description="helm install/uninstall through Helm's Go SDK (no helm binary needed)",
    )
    parser.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG, ~/.kube/config")
    commands = parser.add_subparsers(dest="command", required=True)
    install = commands.add_parser("install", help="install a chart (helm install)")
    install.add_argument("release")
    install.add_argument("chart", type=Path)
    uninstall = commands.add_parser("uninstall", help="uninstall a release (helm uninstall)")
    uninstall.add_argument("release")
    for command in (install, uninstall):
        command.add_argument("-n", "--namespace", default="default")
        command.add_argument("--timeout", default="5m0s", type=parse_duration)
        command.add_argument("--wait", action="store_true", help="wait until ready/deleted")
        command.add_argument("--kubeconfig", dest="command_kubeconfig", default=None)
    install.add_argument("--create-namespace", action="store_true")
    install.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    install.add_argument("-f", "--values", action="append", default=[], type=Path)
    return parser


def install_values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path in args.values:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise UsageError(f"{path}: a values file holds a map")
        values = merge(values, loaded)
    for assignment in args.set:
        set_value(values, assignment)
    return values


def kubeconfig(args: argparse.Namespace) -> str:
    chosen = args.command_kubeconfig or args.kubeconfig or os.environ.get("KUBECONFIG")
    path = Path(chosen.split(os.pathsep)[0]) if chosen else Path.home() / ".kube" / "config"
    if not path.is_file():
        raise UsageError(f"no kubeconfig at {path}: pass --kubeconfig or set KUBECONFIG")
    return str(path)


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config_path = kubeconfig(args)
        values = install_values(args) if args.command == "install" else {}
    except (UsageError, OSError, yaml.YAMLError) as error:
        print(f"scripts/helm: {error}", file=sys.stderr)
        return 2
    import helm_python  # the Go SDK's shared library loads here, not for --help

    wait = "watcher" if args.wait else None
    try:
        with helm_python.Config(kubeconfig_path=config_path, namespace=args.namespace) as config:
            if args.command == "install":
                release = config.install(
                    str(args.chart),
                    args.release,
                    values or None,
                    namespace=args.namespace,
                    create_namespace=args.create_namespace,
                    timeout=args.timeout,
                    wait=wait,
                )
                print(f"NAME: {args.release}\nNAMESPACE: {args.namespace}\nSTATUS: deployed")
                info = release.get("info") if isinstance(release, dict) else None
                notes = info.get("notes") if isinstance(info, dict) else None
                if notes:
                    print(f"\nNOTES:\n{notes}")
            else:
                config.uninstall(args.release, timeout=args.timeout, wait=wait)
                print(f'release "{args.release}" uninstalled')
    except helm_python.HelmError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
