"""Real dpserve processes on 127.0.0.1 for integration tests: start, wait, kill, clean up."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dpserve.client import InferenceClient

DPSERVE = str(Path(sys.executable).with_name("dpserve"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Processes:
    """Starts dpserve subprocesses and guarantees none outlives the test."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen] = []

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            [DPSERVE, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        self.started.append(process)
        return process

    def coordinator(self, port: int, *extra: str) -> subprocess.Popen:
        return self.spawn(f"coordinator-{port}", "coordinator", "--port", str(port), *extra)

    def fake_engine(self, port: int, rank: int, *extra: str) -> subprocess.Popen:
        return self.spawn(
            f"engine-{rank}",
            "engine",
            "--coordinator",
            f"tcp://127.0.0.1:{port}",
            "--rank",
            str(rank),
            "--fake",
            *extra,
        )

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cleanup(self) -> None:
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.started:
            process.wait(10)


async def wait_for_engines(client: InferenceClient, count: int, within: float = 30.0) -> dict:
    """Poll the coordinator's status until ``count`` engines are registered."""
    deadline = time.monotonic() + within
    status: dict = {}
    while time.monotonic() < deadline:
        status = await asyncio.wait_for(client.get_status(), 5)
        if status["engines"] == count:
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"expected {count} engines, status: {status}")


def wait_for_banner(process: subprocess.Popen, log: Path, within: float) -> str:
    """The log of a `dpserve serve` once it printed its ready banner (it must not exit first)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "Press Ctrl-C to stop." in text:
            return text
        assert process.poll() is None, f"dpserve serve exited early:\n{text[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no banner in {within} s:\n{log.read_text()[-3000:]}")
