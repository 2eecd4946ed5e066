from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from dpserve.client import InferenceClient
from tests.integration.runtime import Processes, free_port


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
