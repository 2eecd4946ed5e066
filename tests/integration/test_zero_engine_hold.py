"""Issue 17, scale from zero at the coordinator: with no engine, requests are held (bounded by
--max-queued-requests and --queue-timeout) instead of failing; beyond the bound a fast 503
with Retry-After; the held demand shows in /ready, STATUS and /metrics; /ready is 200
("holding") with --ready-without-engines; an engine that registers serves the held requests.
A real coordinator and HTTP front on loopback, fake engines."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.integration.http_support import (
    error_of,
    expected_text,
    http_json,
    metric,
    start_engines,
    start_front,
    stream_text,
    wait_until,
)
from tests.integration.runtime import Processes

pytestmark = pytest.mark.timeout(120)

HOLD_BOUND = 2


async def scrape(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/metrics") as response:
        return await response.text()


async def test_held_at_zero_engines_then_served_and_beyond_the_bound_refused_fast(
    processes: Processes,
) -> None:
    flags = ("--ready-without-engines", "--max-queued-requests", str(HOLD_BOUND))
    _, zmq_port, base = start_front(processes, *flags)
    code, body = http_json(f"{base}/ready")
    assert (code, body["status"], body["engines"]) == (200, "holding", 0), body

    prompts = [f"held {i}" for i in range(HOLD_BOUND)]
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        held = [
            asyncio.create_task(
                stream_text(session, base, {"prompt": p, "max_tokens": 12, "temperature": 0})
            )
            for p in prompts
        ]
        deadline = time.monotonic() + 20
        while metric(page := await scrape(session, base), "dpserve_queued_requests") != HOLD_BOUND:
            assert time.monotonic() < deadline, page
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        page = await scrape(session, base)
        oldest = metric(page, "dpserve_oldest_queued_request_seconds")
        assert oldest is not None and oldest >= 0.3, page
        assert metric(page, "dpserve_registered_engines") == 0
        code, body = http_json(f"{base}/ready")
        assert (code, body["status"], body["queued"]) == (200, "holding", HOLD_BOUND), body
        assert not any(task.done() for task in held)

        # One more than the bound: refused at once, with Retry-After.
        refused_at = time.monotonic()
        async with session.post(
            f"{base}/v1/completions", json={"prompt": "one too many", "max_tokens": 4}
        ) as reply:
            refusal_seconds = time.monotonic() - refused_at
            assert reply.status == 503
            assert int(reply.headers["Retry-After"]) >= 1
            error = error_of(await reply.json())
        assert error["code"] == "overloaded" and "--max-queued-requests" in error["message"]
        print(f"\nbeyond the hold bound: 503 in {refusal_seconds * 1000:.0f} ms")
        assert refusal_seconds < 1.0

        # An engine registers: the held requests complete, exactly as an engine makes them.
        engine_at = time.monotonic()
        start_engines(processes, zmq_port, 1)
        results = await asyncio.wait_for(asyncio.gather(*held), 60)
        print(
            f"held requests completed {time.monotonic() - engine_at:.2f} s after the engine "
            f"started ({time.monotonic() - started:.2f} s after they arrived)"
        )
        for prompt, (text, finish_reason) in zip(prompts, results, strict=True):
            assert (text, finish_reason) == (expected_text(prompt, 12), "length")
        page = await scrape(session, base)
        assert metric(page, "dpserve_queued_requests") == 0
        assert metric(page, "dpserve_oldest_queued_request_seconds") == 0
    code, body = http_json(f"{base}/ready")
    assert (code, body["status"], body["engines"]) == (200, "ready", 1), body


async def test_a_request_held_past_the_queue_timeout_fails_with_retry_after(
    processes: Processes,
) -> None:
    _, _, base = start_front(processes, "--queue-timeout", "0.5")
    # Without --ready-without-engines, no engine means not ready (nobody will start one).
    wait_until(lambda: http_json(f"{base}/ready")[0] == 503, 10, "/ready")
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(
            f"{base}/v1/completions", json={"prompt": "nobody comes", "max_tokens": 4}
        ) as reply:
            waited = time.monotonic() - started
            assert reply.status == 503 and reply.headers["Retry-After"]
            error = error_of(await reply.json())
    assert error["code"] == "no_engine" and "0.5 s" in error["message"]
    assert 0.5 <= waited < 5, waited
