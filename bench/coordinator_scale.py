"""The coordinator at scale: many fake engines, long prompts with shared prefixes, each routing
policy. What one request costs the coordinator, and how that grows with engines and prompts.

    python bench/coordinator_scale.py [--engines 8 32 64] [--prompt-tokens 16 1024 8192]
        [--routing prefix-aware round-robin] [--requests 2000] [--inflight 256]

For each engine count, that many fake engines (``dpserve engine --fake``: instant steps, a
simulated prefix cache that reports KV events as a real engine's does) run for the whole
count; for each routing policy a coordinator is started on their port (they register with it)
and, for each prompt length, ``--requests`` single-token requests go through it from one client
with at most ``--inflight`` in flight. Prompts are token ids (the coordinator does not
tokenize: tokenizing is excluded, as the goal says), each one of 32 shared prefixes followed
by 16 tokens of its own, so prefix-aware routing has something to find.

Reported per run: requests/s, the coordinator process's CPU time per request (user + system,
all threads), p50 / p99 latency from submit to result, the coordinator's resident memory and
its prefix index's size (blocks indexed). Not a test; results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.runtime import free_port  # noqa: E402

if TYPE_CHECKING:
    from dpserve.client import InferenceClient

# DPSERVE_BIN: another dpserve command (a profiling wrapper, another checkout's).
DPSERVE = os.environ.get("DPSERVE_BIN") or str(Path(sys.executable).with_name("dpserve"))
PREFIXES = 32
OWN_TOKENS = 16  # each prompt's tokens after its shared prefix


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prompts(length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = max(0, length - OWN_TOKENS)
    prefixes = [[rng.randrange(32, 127) for _ in range(shared)] for _ in range(PREFIXES)]
    return [
        prefixes[i % PREFIXES] + [rng.randrange(32, 127) for _ in range(length - shared)]
        for i in range(count)
    ]


async def registered(client: InferenceClient, engines: int, within: float) -> None:
    """Wait until ``engines`` engines registered. A STATUS may take seconds to be answered
    while dozens of engines register on a loaded 2-core machine (tests' helper allows 5 s)."""
    deadline = time.monotonic() + within
    count = 0
    while time.monotonic() < deadline:
        status = await asyncio.wait_for(client.get_status(), 60)
        count = status["engines"]
        if count == engines:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"only {count} of {engines} engines registered within {within:g} s")


async def run_load(
    port: int,
    coordinator_pid: int,
    engines: int,
    length: int,
    count: int,
    inflight: int,
    register_within: float,
) -> dict:
    from dpserve.client import InferenceClient
    from dpserve.sampling import SamplingParams

    client = InferenceClient(port, handshake_timeout=60)
    await client.start()
    try:
        await registered(client, engines, register_within)
        params = SamplingParams(num_tokens_to_generate=1)
        gate = asyncio.Semaphore(inflight)
        latencies: list[float] = []

        async def one(prompt: list[int]) -> None:
            async with gate:
                started = time.perf_counter()
                await client.add_request(prompt, params)
                latencies.append(time.perf_counter() - started)

        work = prompts(length, count, seed=length)
        await asyncio.gather(*(one(p) for p in work[: min(200, count)]))  # warm the index
        latencies.clear()
        cpu_before, started = cpu_seconds(coordinator_pid), time.perf_counter()
        await asyncio.gather(*(one(p) for p in work))
        elapsed = time.perf_counter() - started
        cpu_spent = cpu_seconds(coordinator_pid) - cpu_before
        status = await client.get_status()
        routing = status.get("prefix_routing") or {}
        return {
            "rps": count / elapsed,
            "cpu_us": cpu_spent / count * 1e6,
            "p50": percentile(latencies, 0.5),
            "p99": percentile(latencies, 0.99),
            "indexed_blocks": routing.get("indexed_blocks", 0),
        }
    finally:
        client.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[16, 1024, 8192])
    parser.add_argument(
        "--routing", nargs="+", default=["prefix-aware", "round-robin"],
        choices=["prefix-aware", "least-outstanding", "round-robin"],
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--inflight", type=int, default=256)
    parser.add_argument(
        "--register-within",
        type=float,
        default=600.0,
        help="seconds for the fake engines to register (64 engines each import torch first)",
    )
    args = parser.parse_args()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    print(
        f"{'engines':>7} {'routing':>17} {'prompt':>7} {'req/s':>8} {'CPU us/req':>11} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'RSS MiB':>8} {'indexed':>9}",
        flush=True,
    )
    for engines in args.engines:
        port = free_port()
        fake = ["--fake", "--max-batch-size", "100000", "--fake-cache-blocks", "65536"]
        fake += ["--context-size", str(max(args.prompt_tokens) + 64)]
        fleet = [
            subprocess.Popen(
                [DPSERVE, "engine", "--coordinator", str(port), "--rank", str(rank), *fake],
                **quiet,
            )
            for rank in range(engines)
        ]
        try:
            for routing in args.routing:
                coordinator = subprocess.Popen(
                    [DPSERVE, "coordinator", "--port", str(port), "--routing", routing], **quiet
                )
                try:
                    for length in args.prompt_tokens:
                        result = asyncio.run(
                            run_load(
                                port,
                                coordinator.pid,
                                engines,
                                length,
                                args.requests,
                                args.inflight,
                                args.register_within,
                            )
                        )
                        print(
                            f"{engines:>7} {routing:>17} {length:>7} {result['rps']:>8.0f} "
                            f"{result['cpu_us']:>11.0f} {result['p50'] * 1e3:>8.1f} "
                            f"{result['p99'] * 1e3:>8.1f} {rss_mib(coordinator.pid):>8.0f} "
                            f"{result['indexed_blocks']:>9}",
                            flush=True,
                        )
                finally:
                    coordinator.terminate()
                    coordinator.wait(30)
        finally:
            for process in fleet:
                process.terminate()
            for process in fleet:
                process.wait(30)


if __name__ == "__main__":
    main()
