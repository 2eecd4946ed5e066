"""The one-node cluster of scripts/local-cluster.sh, for tests/e2e/test_cluster.py.

`LocalNode` brings the node up with the script (kubelet, containerd, kube-proxy, cluster DNS:
pods are real containers) and down again; `PortForward` runs ``kubectl port-forward`` and
reads the local ports it bound. The node is opt-in (``DPSERVE_E2E_CLUSTER=1``) until the
cluster e2e has proven itself in CI; it needs root, and tells exactly what the machine lacks
(the script's preflight) instead of falling back to anything.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO

import pytest

from tests.e2e.cluster import Kubectl, kill_process_group, parent_death_prefix, tail

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "local-cluster.sh"
NODE_NAME = "dpserve-node"
POD_CIDR_PREFIX = "10.244.0."
# Cold: control plane + node + images built from nothing; warm: a few seconds.
UP_TIMEOUT = 50 * 60
SESSION_LOCK = Path("/run/dpserve-node.session.lock")


cluster_opt_in = pytest.mark.skipif(
    not os.environ.get("DPSERVE_E2E_CLUSTER"),
    reason="the one-node cluster e2e is opt-in: set DPSERVE_E2E_CLUSTER=1 (needs root)",
)
# Durations the issue asks to see (conftest prints them in the terminal summary).
TIMINGS: dict[str, float] = {}
# What a step saw, line by line (the status phases and events of a scale): printed after them.
TIMELINES: dict[str, list[str]] = {}


class LocalNodeError(RuntimeError):
    """scripts/local-cluster.sh could not bring the node up (its message says why)."""


class LocalNode:
    """``scripts/local-cluster.sh up`` on enter, ``down`` on exit; one session at a time."""

    def __init__(self, state_dir: Path, python: str) -> None:
        self.state_dir = state_dir
        self.env = {**os.environ, "DPSERVE_NODE_DIR": str(state_dir), "PYTHON": python}
        self.kubeconfig = state_dir / "kubeconfig"
        self._lock: IO[str] | None = None

    def __enter__(self) -> LocalNode:
        self._lock = SESSION_LOCK.open("w")
        # Another test session on this machine owns the node's IP, bridge and iptables.
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        started = time.monotonic()
        result = subprocess.run(
            ["bash", str(SCRIPT), "up"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=UP_TIMEOUT,
            check=False,
        )
        self.up_seconds = time.monotonic() - started
        if result.returncode != 0:
            self._down()
            raise LocalNodeError(
                f"scripts/local-cluster.sh up failed ({result.returncode}):\n"
                f"{result.stderr[-4000:]}"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._down()

    def _down(self) -> None:
        if os.environ.get("DPSERVE_E2E_KEEP"):
            return
        try:
            result = subprocess.run(
                ["bash", str(SCRIPT), "down"],
                env=self.env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=180,
                check=False,
            )
            # Whatever it left (bridge, iptables chains, mounts) would break the next node.
            if result.returncode != 0:
                raise LocalNodeError(
                    f"scripts/local-cluster.sh down failed ({result.returncode}):\n"
                    f"{result.stderr[-4000:]}"
                )
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def log_tail(self, component: str, lines: int = 40) -> str:
        return tail(self.state_dir / "logs" / f"{component}.log", lines)


class PortForward:
    """``kubectl port-forward <target> :<port>...``; `local_ports` maps remote → local."""

    def __init__(self, kubectl: Kubectl, namespace: str, target: str, ports: list[int]) -> None:
        self.argv = [
            str(kubectl.binary),
            f"--kubeconfig={kubectl.kubeconfig}",
            "-n",
            namespace,
            "port-forward",
            "--address=127.0.0.1",
            target,
            *(f":{port}" for port in ports),
        ]
        self.ports = ports
        self.local_ports: dict[int, int] = {}
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> PortForward:
        self.process = subprocess.Popen(
            [*parent_death_prefix(), *self.argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        deadline = time.monotonic() + 60
        seen = []
        # "Forwarding from 127.0.0.1:43211 -> 5555", one line per port.
        while len(self.local_ports) < len(self.ports) and time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            seen.append(line)
            match = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) -> (\d+)", line)
            if match:
                self.local_ports[int(match.group(2))] = int(match.group(1))
        if len(self.local_ports) < len(self.ports):
            self.__exit__(None, None, None)
            raise AssertionError(f"kubectl port-forward did not start: {''.join(seen)}")
        # It prints a line per connection: keep reading, or a full pipe would stall it.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.process is not None:
            kill_process_group(self.process, grace_seconds=5)  # type: ignore[arg-type]
            self.process = None
