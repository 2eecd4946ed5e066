"""``dpserve serve --backend vllm`` against ``vllm serve`` under a load generator that costs the
machine almost nothing: what the servers do when the client is not a third party on their cores.

    python bench/plain_load_vllm.py                    # c = 8, 5 rounds, 4 requests per stream

guidellm (``serving_vllm.py``) takes about half a core for itself at c = 8 (~50 s of CPU over a
~100 s run, measured with ``getrusage`` on its process tree), and on a 2-core machine whose one
core runs vLLM's model worker and whose other runs vLLM's engine core loop, that half a core is
taken from the servers: its rounds moved by 15 % (``vllm serve``: 32.0 then 27.8 tok/s in two
rounds ten minutes apart). Here the load is an asyncio client in this process (under 1 s of CPU a
run): ``--concurrency`` streams, each sending ``--requests`` completions one after another,
each a fresh 128-token token-id prompt (the same prompts for both servers in a round) and 64
output tokens (greedy, ``ignore_eos``, streamed); one request per stream first, not counted.
Each round starts each server fresh, the order alternating from round to round. Reported per
round and as medians: output tokens/s (every output token / the time from the first counted
request to the last end), the ITL p50 (each request's (last token - first token) / 63, so
servers that pack several tokens in one chunk are timed alike), and the CPU seconds of each
server's process tree and of the client over the counted run. vLLM runs eager with a 2 GiB KV
cache and float32 weights on both sides, as in ``serving_vllm.py``. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from serving_cpu import Server, start, stop, tree_pids, wait_ready
from serving_vllm import add_model_arguments, missing_install, vllm_backend, vllm_serve

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid``, its threads and all its descendants."""
    ticks = 0
    for current in tree_pids(pid):
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return ticks / 100  # USER_HZ


def client_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def one_request(
    session: aiohttp.ClientSession, port: int, model: str, prompt: list[int]
) -> float:
    """Stream one completion; its inter-token latency in seconds."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    first = last = None
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                continue
            if json.loads(line[5:]).get("choices"):
                last = time.perf_counter()
                first = first or last
    if first is None or last is None:
        raise RuntimeError("no token came back")
    return (last - first) / (OUTPUT_TOKENS - 1)


async def run_load(
    server: Server, concurrency: int, requests: int, rng: random.Random
) -> dict[str, float]:
    assert server.process is not None

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(count)]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def stream(own: list[list[int]], itls: list[float]) -> None:
            for prompt in own:
                itls.append(await one_request(session, server.port, server.model_id, prompt))

        warm = prompts(concurrency)
        await asyncio.gather(*(stream([p], []) for p in warm))
        counted = [prompts(requests) for _ in range(concurrency)]
        itls: list[float] = []
        server_cpu, client_cpu = tree_cpu_seconds(server.process.pid), client_cpu_seconds()
        began = time.perf_counter()
        await asyncio.gather(*(stream(own, itls) for own in counted))
        elapsed = time.perf_counter() - began
        return {
            "tok_s": concurrency * requests * OUTPUT_TOKENS / elapsed,
            "itl_ms": 1000 * statistics.median(itls),
            "server_cpu_s": tree_cpu_seconds(server.process.pid) - server_cpu,
            "client_cpu_s": client_cpu_seconds() - client_cpu,
            "seconds": elapsed,
        }


def servers(model: str, vllm_python: str) -> list[Server]:
    backend = vllm_backend(model, vllm_python, ["--enforce-eager"])
    return [backend, vllm_serve(model, vllm_python, ["--enforce-eager"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="counted requests per stream")
    args = parser.parse_args(argv)
    if (missing := missing_install(args)) is not None:
        print(missing, file=sys.stderr)
        return 2
    names = [server.name for server in servers(str(args.model), args.vllm_python)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="plain-load-") as scratch:
        for round_index in range(args.rounds):
            pool = servers(str(args.model), args.vllm_python)  # fresh ports each round
            for server in pool if round_index % 2 == 0 else pool[::-1]:
                start(server, Path(scratch))
                try:
                    wait_ready(server, 900)
                    rng = random.Random(round_index)  # the same prompts for both servers
                    result = asyncio.run(run_load(server, args.concurrency, args.requests, rng))
                finally:
                    stop(server)
                results[server.name].append(result)
                print(
                    f"round {round_index + 1}: {server.name}: "
                    + ", ".join(f"{key} {value:.1f}" for key, value in result.items()),
                    flush=True,
                )
    print(f"\nc={args.concurrency}, medians of {args.rounds} rounds")
    print("| server | output tok/s | ITL p50 (ms) | server CPU s | client CPU s |")
    print("|---|---:|---:|---:|---:|")
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    for name, median in medians.items():
        print(
            f"| {name} | {median['tok_s']:.1f} | {median['itl_ms']:.0f} | "
            f"{median['server_cpu_s']:.0f} | {median['client_cpu_s']:.1f} |"
        )
    first, second = (medians[name] for name in names)
    print(
        f"\n{names[0]} / {names[1]}: tok/s {first['tok_s'] / second['tok_s']:.2f}x, "
        f"ITL {first['itl_ms'] / second['itl_ms']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
