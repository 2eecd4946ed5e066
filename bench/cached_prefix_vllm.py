"""What a request whose prompt prefix is cached costs on one engine: ``dpserve serve --backend
vllm`` against ``vllm serve`` itself, and ``dpserve serve`` with its own engine beside them.

    python bench/cached_prefix_vllm.py                  # 3 rounds, 60 cached + 20 cold each

Each server, alone and in turn (rounds alternate them): a 256-token prefix is prefilled once,
then requests of that prefix + 16 fresh tokens (``max_tokens`` 1, so a request's time is its
TTFT) and, between them, requests of 272 fresh tokens (nothing cached). Prompts are token ids
(``/v1/completions``), the same for every server. The ratio cold / cached is the most a
prefix-aware router can gain on that engine (``bench/prefix.py``'s speed-ups over round-robin
are bounded by it); the first two servers' cached times tell what dpserve's coordinator, front
and runner add to vLLM's engine on such a request (issue 32). vLLM runs eager with a 2 GiB KV
cache and float32 weights on both sides; dpserve's own engine with one torch thread, as vLLM
binds one compute thread on a 2-core machine. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serving_cpu import Server, dpserve_server, start, stop, wait_ready
from serving_vllm import add_model_arguments, missing_install, vllm_backend, vllm_serve

PREFIX_TOKENS = 256
QUESTION_TOKENS = 16


def timed_request(port: int, model: str, prompt: list[int]) -> tuple[float, int | None]:
    """Seconds to the request's one token (streamed), and the cached tokens it reported."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    began = time.perf_counter()
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    first = None
    cached = None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line.endswith("[DONE]"):
            continue
        chunk = json.loads(line[5:])
        if chunk.get("choices") and first is None:
            first = time.perf_counter() - began
        details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens", cached)
    connection.close()
    if first is None:
        raise RuntimeError("no token came back")
    return first, cached


def one_round(server: Server, cached_count: int, cold_count: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)

    def fresh(count: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(count)]

    port, model = server.port, server.model_id
    for _ in range(3):  # warm-up
        timed_request(port, model, fresh(64))
    prefix = fresh(PREFIX_TOKENS)
    timed_request(port, model, prefix + fresh(QUESTION_TOKENS))  # prefills the prefix
    cached, cold, reported = [], [], []
    cold_every = max(1, cached_count // max(1, cold_count))
    for index in range(cached_count):
        seconds, tokens = timed_request(port, model, prefix + fresh(QUESTION_TOKENS))
        cached.append(seconds)
        if tokens is not None:
            reported.append(tokens)
        if index % cold_every == 0 and len(cold) < cold_count:
            cold.append(timed_request(port, model, fresh(PREFIX_TOKENS + QUESTION_TOKENS))[0])
    return {
        "cached_ms": 1000 * statistics.median(cached),
        "cold_ms": 1000 * statistics.median(cold),
        "reported_cached_tokens": statistics.median(reported) if reported else float("nan"),
    }


def servers(model: str, vllm_python: str) -> list[Server]:
    vllm = vllm_serve(model, vllm_python, ["--enforce-eager", "--max-model-len", "512"])
    backend = vllm_backend(model, vllm_python, ["--enforce-eager", "--max-model-len=512"])
    own = dpserve_server(
        "dpserve serve (own engine, 1 thread)",
        model,
        ["--data-parallel-size", "1", "--torch-threads", "1"],
    )
    return [vllm, backend, own]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cached", type=int, default=60, help="cached requests a round")
    parser.add_argument("--cold", type=int, default=20, help="uncached requests a round")
    args = parser.parse_args(argv)
    if (missing := missing_install(args)) is not None:
        print(missing, file=sys.stderr)
        return 2
    pool = servers(str(args.model), args.vllm_python)
    rounds: dict[str, list[dict[str, float]]] = {server.name: [] for server in pool}
    with tempfile.TemporaryDirectory(prefix="cached-prefix-") as scratch:
        for round_index in range(args.rounds):
            for server in pool:
                start(server, Path(scratch))
                try:
                    wait_ready(server, timeout=900)
                    result = one_round(server, args.cached, args.cold, seed=round_index)
                finally:
                    stop(server)
                rounds[server.name].append(result)
                print(json.dumps({"server": server.name, "round": round_index, **result}))
    reference = statistics.median(r["cached_ms"] for r in rounds["vllm serve"])
    print()
    print(
        "| server | cached TTFT ms (rounds) | median | uncached ms | uncached / cached "
        "| cached / `vllm serve`'s |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for name, results in rounds.items():
        cached = statistics.median(r["cached_ms"] for r in results)
        cold = statistics.median(r["cold_ms"] for r in results)
        each = " / ".join(f"{r['cached_ms']:.0f}" for r in results)
        print(
            f"| {name} | {each} | {cached:.0f} | {cold:.0f} | {cold / cached:.2f}x "
            f"| {cached / reference:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
