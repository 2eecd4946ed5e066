"""A request that kills every engine it reaches is failed after a few engines, not sent on
until none is left (issue 9, item 2); the requests beside it are served as before."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from dpserve.client import RequestFailed
from dpserve.limits import DEFAULT_ADMISSION_LIMITS
from dpserve.sampling import SamplingParams
from tests.integration import poison_engine
from tests.integration.runtime import Processes, wait_for_engines
from tests.integration.test_runtime import FAST, expected_tokens
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).parents[2]


def spawn_poisonable_engine(processes: Processes, port: int, rank: int) -> subprocess.Popen:
    log = open(processes.log_dir / f"engine-{rank}.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, poison_engine.__file__, f"tcp://127.0.0.1:{port}", str(rank), "0.02"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
    )
    log.close()
    processes.started.append(process)
    return process


async def test_a_request_that_kills_engines_is_failed_and_the_rest_served(processes, client, port):
    attempts = 2  # below the default, so that one of the three engines is left to serve
    assert attempts < DEFAULT_ADMISSION_LIMITS.max_dispatch_attempts
    processes.coordinator(port, *FAST, "--max-dispatch-attempts", str(attempts))
    engines = [spawn_poisonable_engine(processes, port, rank) for rank in range(3)]
    await client.start()
    await wait_for_engines(client, 3)
    # Innocent streams in flight on every engine, each already past its first tokens, so
    # that the engines the poison kills hold some of them.
    innocent = SamplingParams(num_tokens_to_generate=150, stream=True)
    streams = [client.stream(f"innocent {i}", innocent) for i in range(60)]
    await eventually(lambda: all(not s._chunks.empty() for s in streams), within=30)
    poison = client.add_request("POISON pill", SamplingParams(num_tokens_to_generate=5))
    with pytest.raises(RequestFailed) as failure:
        await asyncio.wait_for(poison, 60)
    assert failure.value.code == "quarantined"
    assert failure.value.message == (
        f"request was in flight on {attempts} engines that died; not retried"
    )
    records = await asyncio.wait_for(asyncio.gather(*(s.future for s in streams)), 60)
    for i, record in enumerate(records):
        assert record.generated_tokens == expected_tokens(f"innocent {i}", 150)
    died = [e for e in engines if e.poll() is not None]
    assert [e.returncode for e in died] == [poison_engine.EXIT_CODE] * attempts
    status = await wait_for_engines(client, 3 - attempts)
    assert status["counters"]["quarantined"] == 1
    assert status["counters"]["redispatched"] > 0, "the dead engines' streams went elsewhere"
    after = await asyncio.wait_for(
        client.add_request("after the poison", SamplingParams(num_tokens_to_generate=3)), 20
    )
    assert after.generated_tokens == expected_tokens("after the poison", 3)
