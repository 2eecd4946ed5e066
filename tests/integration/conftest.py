from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from dpserve.client import InferenceClient
from tests.integration.runtime import DPSERVE, Processes, free_port, wait_for_banner


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.cleanup()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
async def client(port: int) -> AsyncIterator[InferenceClient]:
    """A client for the coordinator on ``port`` (the test starts the coordinator first)."""
    instance = InferenceClient(port, handshake_timeout=20)
    yield instance
    instance.stop()


@pytest.fixture
def session_timeout() -> float:
    """Seconds for each HTTP call of ``session``; a module may override it."""
    return 30.0


@pytest.fixture
async def session(session_timeout: float) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client session for tests against a front."""
    timeout = aiohttp.ClientTimeout(total=session_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as instance:
        yield instance


@contextlib.contextmanager
def serving(model: Path, log: Path, *flags: str) -> Iterator[str]:
    """``dpserve serve`` (one engine) on ``model`` while the block runs: its OpenAI-compatible
    base URL, ``http://127.0.0.1:PORT/v1``; its output goes to ``log``."""
    port, http_port = free_port(), free_port()
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            [
                DPSERVE, "serve", "--data-parallel-size", "1", "--port", str(port),
                "--http-port", str(http_port), "--model", str(model), *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    try:
        wait_for_banner(serve, log, within=180)
        yield f"http://127.0.0.1:{http_port}/v1"
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


@pytest.fixture(scope="module")
def tiny_serve_url(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``dpserve serve`` (one engine) on the tiny model for a module's tests."""
    with serving(tiny_model_path, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url
