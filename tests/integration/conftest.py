from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

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
