"""What the first request of a kind does to the streams already running on its engine.

    python bench/first_request_pause.py http://127.0.0.1:8000 json_object

Against a server already started (fresh, so that nothing of the kind ran on it yet): one greedy
stream of 120 tokens starts; 1.5 s in, one request of the named kind (a JSON object, a JSON
schema, log-probs, echoed prompt log-probs) arrives. Printed: that request's time, and the gaps
between the running stream's chunks (median and largest). Work the first such request does on
the engine's step loop (building the tokenizer's structured-output tables, a compile) shows as
the largest gap; ``Runner.warm_up`` moves it to start-up. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp

KINDS: dict[str, dict[str, Any]] = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                },
            },
        }
    },
    "logprobs": {"logprobs": 5},
    "echo": {"echo": True, "logprobs": 2, "max_tokens": 1},
}


async def running_stream(session: aiohttp.ClientSession, base: str, gaps: list[float]) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    last = None
    async with session.post(f"{base}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            if line.startswith(b"data: {"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def measure(base: str, kind: str) -> None:
    async with aiohttp.ClientSession() as session:
        gaps: list[float] = []
        stream = asyncio.create_task(running_stream(session, base, gaps))
        await asyncio.sleep(1.5)
        body = {"prompt": "Give JSON", "max_tokens": 8, **KINDS[kind]}
        started = time.monotonic()
        async with session.post(f"{base}/v1/completions", json=body) as reply:
            status = reply.status
            await reply.read()
        took = time.monotonic() - started
        await stream
    print(
        f"{kind}: {status} in {took:.2f} s; the running stream's chunk gaps: median "
        f"{statistics.median(gaps) * 1000:.0f} ms, largest {max(gaps) * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("kind", choices=sorted(KINDS))
    args = parser.parse_args()
    asyncio.run(measure(args.url.rstrip("/"), args.kind))


if __name__ == "__main__":
    main()
