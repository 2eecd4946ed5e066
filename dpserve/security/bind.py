"""Where a coordinator may listen: without credentials, only on loopback (or with --insecure)."""

from __future__ import annotations

import ipaddress


class InsecureBind(ValueError):
    """Binding the coordinator beyond loopback without credentials, and without --insecure."""


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and ``localhost`` count: a name could resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, secured: bool, insecure: bool) -> None:
    """Raise ``InsecureBind`` for a plain coordinator reachable from other machines."""
    if secured or insecure or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to bind the coordinator to {host} without credentials: anyone who can "
        "reach the port could submit work, register as an engine or stop every engine. "
        "Pass --credentials DIR (create one with `dpserve keys generate DIR`), or --insecure "
        "to accept that risk."
    )
