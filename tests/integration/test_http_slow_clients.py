"""Issue 9, item 8: slow or idle HTTP clients cannot hold the front's resources. Clients that
trickle their headers or body are answered 408 and closed, idle connections are closed, and
connections over the cap are refused with 503, while normal requests keep their latency."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.integration.http_support import Cluster, expected_text, metric, start_cluster
from tests.integration.runtime import Processes

pytestmark = pytest.mark.timeout(120)

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
KEEPALIVE_TIMEOUT = 2.0
MAX_CONNECTIONS = 40
SLACK = 1.5  # seconds a timed-out connection may take beyond its timeout on a busy machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    processes = Processes(tmp_path_factory.mktemp("http-slow"))
    try:
        yield start_cluster(
            processes,
            f"--http-header-timeout={HEADER_TIMEOUT}",
            f"--http-body-timeout={BODY_TIMEOUT}",
            f"--http-keepalive-timeout={KEEPALIVE_TIMEOUT}",
            f"--http-max-connections={MAX_CONNECTIONS}",
            step_delay=0.001,
        )
    finally:
        processes.cleanup()


def address(cluster: Cluster) -> tuple[str, int]:
    host, port = cluster.base_url.removeprefix("http://").split(":")
    return host, int(port)


async def trickle(
    cluster: Cluster, head: bytes, rest: bytes, interval: float
) -> tuple[bytes, float]:
    """Send ``head`` at once, then ``rest`` one byte per ``interval`` until the server closes
    the connection; return what it answered and after how many seconds it closed."""
    reader, writer = await asyncio.open_connection(*address(cluster))
    started = time.monotonic()
    answer = b""
    try:
        writer.write(head)
        for byte in rest:
            if reader.at_eof():
                break
            with contextlib.suppress(TimeoutError):
                answer += await asyncio.wait_for(reader.read(4096), interval)
            if answer or reader.at_eof():
                break
            writer.write(bytes([byte]))
            await writer.drain()
        answer += await asyncio.wait_for(reader.read(), 10)  # until the server closes
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()
    return answer, time.monotonic() - started


async def completion_latencies(
    session: aiohttp.ClientSession, base: str, count: int
) -> list[float]:
    latencies = []
    for index in range(count):
        prompt = f"normal {index}"
        started = time.monotonic()
        async with session.post(
            f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 4}
        ) as reply:
            assert (await reply.json())["choices"][0]["text"] == expected_text(prompt, 4)
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.05)
    return latencies


REQUEST_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: dpserve\r\nContent-Type: application/json\r\n"
)
BODY = json.dumps({"prompt": "slow body", "max_tokens": 2}).encode()


async def test_tricklers_are_closed_while_normal_requests_keep_their_latency(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    baseline = statistics.median(await completion_latencies(session, cluster.base_url, 10))
    slow_heads = [
        trickle(cluster, b"POST /v1/compl", b"etions HTTP/1.1\r\nHost: x\r\n" * 20, 0.2)
        for _ in range(10)
    ]
    slow_bodies = [
        trickle(cluster, REQUEST_HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode(), BODY, 0.2)
        for _ in range(10)
    ]
    slow = asyncio.gather(*slow_heads, *slow_bodies)
    during = await completion_latencies(session, cluster.base_url, 20)
    results = await slow

    for answer, seconds in results[:10]:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"header_timeout" in answer
        assert seconds < HEADER_TIMEOUT + SLACK, seconds
    for answer, seconds in results[10:]:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body_timeout" in answer
        # The rest of the body is read and dropped for --http-linger-timeout (1 s) first.
        assert seconds < BODY_TIMEOUT + 1.0 + SLACK, seconds
    # Normal requests were served throughout, about as fast as before.
    assert statistics.median(during) < baseline + 0.25, (baseline, during)
    async with session.get(f"{cluster.base_url}/metrics") as reply:
        scrape = await reply.text()
    assert (metric(scrape, "dpserve_http_connections_timed_out_total") or 0) >= 10
    assert (metric(scrape, "dpserve_http_open_connections") or 0) <= 2  # the session's own


async def test_idle_connections_are_closed(cluster: Cluster) -> None:
    fresh_reader, fresh_writer = await asyncio.open_connection(*address(cluster))
    used_reader, used_writer = await asyncio.open_connection(*address(cluster))
    try:
        used_writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await used_reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        for reader in (fresh_reader, used_reader):  # nothing sent / idle after a request
            await asyncio.wait_for(reader.read(), KEEPALIVE_TIMEOUT + SLACK + 1)
        assert time.monotonic() - started < KEEPALIVE_TIMEOUT + SLACK
    finally:
        fresh_writer.close()
        used_writer.close()


async def test_connections_over_the_cap_are_refused_with_503(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    held = [await asyncio.open_connection(*address(cluster)) for _ in range(MAX_CONNECTIONS)]
    try:
        reader, writer = await asyncio.open_connection(*address(cluster))
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "max_connections"
        async with session.get(f"{cluster.base_url}/metrics") as reply:
            assert reply.status == 503  # the cap holds for everybody, scrapers included
    finally:
        for _, held_writer in held:
            held_writer.close()
    await asyncio.sleep(0.2)  # the server sees them close
    async with session.post(
        f"{cluster.base_url}/v1/completions", json={"prompt": "room again", "max_tokens": 3}
    ) as reply:
        assert reply.status == 200
    async with session.get(f"{cluster.base_url}/metrics") as reply:
        assert (metric(await reply.text(), "dpserve_http_connections_refused_total") or 0) >= 2
