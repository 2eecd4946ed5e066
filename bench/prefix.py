"""Prefix caching and cache-aware routing: round-robin vs least-outstanding vs prefix-aware.

    python bench/prefix.py [--skip-real] [--skip-fake] [--quick]
    python bench/prefix.py --skip-fake --backend vllm     # the real engines are vLLM's

One run, three parts (results in BENCHMARKS.md):

1. **Real engines** (SmolLM2-135M, the model ``dpserve serve`` converts, CPU): ``dpserve serve``
   with 2 engines per policy, each engine's KV pool sized with ``--kv-cache-bytes`` so that
   the workload's shared prefixes together exceed one engine's pool but fit two. Workloads as
   inference-perf's ``shared_prefix`` (groups x prompts per group, system prompt length,
   question length, output length; requests in random order, Poisson arrivals) at several
   request rates, and multi-turn conversations (each turn resends the whole history).
2. **One engine, cache on vs off**: a 1,000-token shared prefix, requests one at a time:
   TTFT with ``--no-prefix-caching`` against with it.
3. **Fake engines at 8 and 32** (their simulated caches hash and report blocks as the model
   engine does, with a prefill cost per uncached token): prefix-aware's hit rate against an
   oracle that knows every engine's cache (it sends each request, in the same order, to the
   engine holding the longest prefix of it), and the coordinator's CPU per routed request.

With ``--backend vllm`` parts 1 and 2 run ``dpserve serve --backend vllm`` (vLLM's CPU build from
its own install, ``make vllm``; ``--vllm-python``): the same workloads and pools, blocks of 32
tokens (vLLM's CPU attention takes multiples of 32), float32 as dpserve's engine, eager, and a
context of twice the system prompt (vLLM refuses a pool smaller than one request of the
model's whole context).

Reported per run: TTFT p50/p90, output tok/s, prompt tokens actually prefilled (the engines'
own counters), cache hit rate (cached / prompt tokens, as the engines reported them per
request), index accuracy (predicted vs actual cached tokens), the requests each engine got, and
each engine's pace as the router measured it (``coordinator/engine_pace``). Prompts are token
ids (no tokenizer in the way). Not a test: numbers depend on the machine and on what else runs
on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpserve.block_hash import block_hashes  # noqa: E402
from dpserve.client import InferenceClient, RequestRecord  # noqa: E402
from dpserve.engine.fake_cache import SimulatedPrefixCache  # noqa: E402
from dpserve.sampling import SamplingParams  # noqa: E402
from tests.integration.runtime import free_port  # noqa: E402

DPSERVE = str(Path(sys.executable).with_name("dpserve"))
POLICIES = ("round-robin", "least-outstanding", "prefix-aware")
BLOCK = 16  # the fake engines' blocks


@dataclass(frozen=True)
class Backend:
    """The real engines: dpserve's own, or vLLM's (``flags`` added to ``dpserve serve``)."""

    name: str
    block: int
    flags: tuple[str, ...] = ()


DPSERVE_BACKEND = Backend("dpserve", BLOCK)


def vllm_backend(python: str, max_model_len: int | None) -> Backend:
    flags = ["--backend", "vllm", "--engine-python", python, "--vllm-arg=--enforce-eager"]
    if max_model_len is not None:
        flags.append(f"--vllm-arg=--max-model-len={max_model_len}")
    return Backend("vllm", 32, tuple(flags))


def default_vllm_python() -> str:
    found = sorted(Path.home().glob(".cache/dpserve/vllm/*/venv/bin/python"))
    return str(found[-1]) if found else ""


VOCAB = (100, 40_000)  # token ids valid for SmolLM2 (49,152) and the fake engine


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(count)]


# -------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class SharedPrefix:
    """inference-perf's shared_prefix: ``groups`` system prompts, ``per_group`` questions each."""

    groups: int
    per_group: int
    system_len: int
    question_len: int
    output_len: int

    def prompts(self, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        systems = [tokens(rng, self.system_len) for _ in range(self.groups)]
        prompts = [
            system + tokens(rng, self.question_len)
            for system in systems
            for _ in range(self.per_group)
        ]
        rng.shuffle(prompts)
        return prompts


@dataclass(frozen=True)
class MultiTurn:
    """``conversations`` chats of ``turns`` turns; each turn resends the whole history."""

    conversations: int
    turns: int
    system_len: int
    user_len: int
    output_len: int


@dataclass
class Run:
    policy: str
    workload: str
    rate: float
    records: list[RequestRecord] = field(default_factory=list)
    wall: float = 0.0
    prefilled: int = 0
    coordinator_cpu: float = 0.0
    routing: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ttfts = [r.ttft for r in self.records if r.ttft is not None]
        prompt = sum(len(r.prompt_tokens) for r in self.records)
        cached = sum(r.cached_tokens or 0 for r in self.records)
        generated = sum(len(r.generated_tokens) for r in self.records)
        predicted = self.routing.get("predicted_cached_tokens", 0)
        actual = self.routing.get("actual_cached_tokens", 0)
        error = self.routing.get("prediction_error_tokens", 0)
        return {
            "policy": self.policy,
            "workload": self.workload,
            "rate": self.rate,
            "requests": len(self.records),
            "ttft_p50": percentile(ttfts, 0.5),
            "ttft_p90": percentile(ttfts, 0.9),
            "output_tok_s": generated / self.wall if self.wall else float("nan"),
            "prompt_tokens": prompt,
            "prefilled_tokens": self.prefilled,
            "hit_rate": cached / prompt if prompt else 0.0,
            # 1 - (sum |predicted - actual|) / actual: how well the index knew the caches.
            "index_accuracy": (1 - error / actual) if actual else None,
            "predicted_cached": predicted,
            "actual_cached": actual,
            "coordinator_cpu_ms_per_request": 1000 * self.coordinator_cpu / len(self.records)
            if self.records
            else float("nan"),
            "decisions": self.routing.get("decisions", {}),
            "requests_by_rank": dict(sorted(Counter(r.engine_rank for r in self.records).items())),
            # Each engine's measured pace and price of a request queued for a slot, after the run.
            "pace_by_rank": self.routing.get("pace_by_rank", {}),
        }


async def engine_totals(client: InferenceClient) -> tuple[int, dict[str, Any], int]:
    status = await asyncio.wait_for(client.get_status(), 10)
    prefilled = sum(int(e["stats"].get("prefill_tokens", 0)) for e in status["engine_list"])
    return prefilled, status.get("prefix_routing", {}), int(status["pid"])


async def drive_shared(
    client: InferenceClient, prompts: list[list[int]], rate: float, output_len: int, seed: int
) -> list[RequestRecord]:
    """Poisson arrivals at ``rate`` requests/s."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=output_len, ignore_eos=True)
    futures = []
    for prompt in prompts:
        futures.append(client.add_request(prompt, params))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.wait_for(asyncio.gather(*futures), 1800))


async def drive_multi_turn(
    client: InferenceClient, workload: MultiTurn, rate: float, seed: int
) -> list[RequestRecord]:
    """Conversations start at ``rate`` per second; each runs its turns back to back, every
    turn's prompt the history so far (the answers as the engine generated them)."""
    rng = random.Random(seed)
    params = SamplingParams(
        temperature=0.0, num_tokens_to_generate=workload.output_len, ignore_eos=True
    )
    records: list[RequestRecord] = []

    async def conversation(index: int) -> None:
        own = random.Random(seed * 1000 + index)
        history = tokens(own, workload.system_len)
        for _ in range(workload.turns):
            history = history + tokens(own, workload.user_len)
            record = await asyncio.wait_for(client.add_request(history, params), 1800)
            records.append(record)
            history = history + record.generated_tokens

    tasks = []
    for index in range(workload.conversations):
        tasks.append(asyncio.create_task(conversation(index)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return records


async def measure(client: InferenceClient, policy: str, name: str, rate: float, body: Any) -> Run:
    prefilled, routing_before, pid = await engine_totals(client)
    cpu = cpu_seconds(pid)
    started = time.perf_counter()
    records = await body
    run = Run(policy, name, rate, records, time.perf_counter() - started)
    prefilled_after, routing, _ = await engine_totals(client)
    run.coordinator_cpu = cpu_seconds(pid) - cpu
    run.prefilled = prefilled_after - prefilled
    run.routing = {
        key: (value - routing_before.get(key, 0) if isinstance(value, int) else value)
        for key, value in routing.items()
    }
    decisions = dict(routing.get("decisions", {}))
    for reason, count in routing_before.get("decisions", {}).items():
        decisions[reason] = decisions.get(reason, 0) - count
    run.routing["decisions"] = {k: v for k, v in decisions.items() if v}
    return run


# --------------------------------------------------------------------------- processes


class Stack:
    """``dpserve serve`` (real engines) or a coordinator and fake engines, insecure loopback."""

    def __init__(self, backend: Backend = DPSERVE_BACKEND) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.port = free_port()
        self.backend = backend

    def serve(self, engines: int, policy: str, extra: list[str]) -> None:
        self.processes.append(
            subprocess.Popen(
                [
                    DPSERVE,
                    "serve",
                    "--insecure",
                    "--http-port",
                    "0",
                    "--port",
                    str(self.port),
                    "--data-parallel-size",
                    str(engines),
                    "--routing",
                    policy,
                    "--block-size",
                    str(self.backend.block),
                    *self.backend.flags,
                    *extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    def fake(self, engines: int, policy: str, extra: list[str]) -> None:
        self.processes.append(
            subprocess.Popen(
                [DPSERVE, "coordinator", "--port", str(self.port), "--routing", policy],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for rank in range(engines):
            self.processes.append(
                subprocess.Popen(
                    [
                        DPSERVE,
                        "engine",
                        "--coordinator",
                        str(self.port),
                        "--rank",
                        str(rank),
                        "--fake",
                        "--block-size",
                        str(BLOCK),
                        *extra,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )

    async def client(self, engines: int, within: float = 300.0) -> InferenceClient:
        client = InferenceClient(self.port, handshake_timeout=within)
        await client.start()
        deadline = time.monotonic() + within
        while True:
            status = await asyncio.wait_for(client.get_status(), 10)
            if status["engines"] == engines:
                return client
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {status['engines']} of {engines} engines registered")
            await asyncio.sleep(0.5)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


# ----------------------------------------------------------------------- the 3 parts


def kv_bytes_per_token() -> int:
    """SmolLM2-135M in fp32: 30 layers x 3 KV heads x 64 dims x (K + V) x 4 bytes."""
    return 30 * 3 * 64 * 2 * 4


async def warm_up(client: InferenceClient) -> None:
    """One small request first: the first forward of a fresh engine is slow (allocations)."""
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=2, ignore_eos=True)
    await asyncio.wait_for(client.add_request(list(range(100, 140)), params), 600)


async def real_engines(
    quick: bool,
    per_group: int,
    system_len: int,
    rates: list[float],
    policies: tuple[str, ...] = POLICIES,
    vllm_python: str | None = None,
) -> list[dict[str, Any]]:
    backend = DPSERVE_BACKEND if vllm_python is None else vllm_backend(vllm_python, 2 * system_len)
    shared = SharedPrefix(
        groups=4, per_group=per_group, system_len=system_len, question_len=16, output_len=8
    )
    chats = MultiTurn(conversations=3, turns=3, system_len=128, user_len=16, output_len=8)
    # Each engine's pool: 2 of the 4 system prompts plus room for the running requests, so
    # the 4 together exceed one pool but fit two.
    pool_tokens = 3 * system_len
    extra = ["--kv-cache-bytes", str(pool_tokens * kv_bytes_per_token()), "--max-batch-size", "4"]
    rates = rates[:1] if quick else rates
    results = []
    for policy in policies:
        stack = Stack(backend)
        stack.serve(2, policy, extra)
        try:
            client = await stack.client(2)
            await warm_up(client)
            for index, rate in enumerate(rates):
                prompts = shared.prompts(seed=10 + index)
                body = drive_shared(client, prompts, rate, shared.output_len, seed=index)
                run = await measure(client, policy, "shared_prefix", rate, body)
                results.append(run.summary() | {"backend": backend.name})
                print(json.dumps(results[-1]), flush=True)
            body = drive_multi_turn(client, chats, 0.2, seed=99)
            run = await measure(client, policy, "multi_turn", 0.2, body)
            results.append(run.summary() | {"backend": backend.name})
            print(json.dumps(results[-1]), flush=True)
            client.stop()
        finally:
            stack.stop()
    return results


async def one_engine_on_off(vllm_python: str | None = None) -> list[dict[str, Any]]:
    backend = DPSERVE_BACKEND if vllm_python is None else vllm_backend(vllm_python, 2048)
    rng = random.Random(5)
    system = tokens(rng, 1000)
    prompts = [system + tokens(rng, 24) for _ in range(4)]
    results = []
    for label, extra in (("cache off", ["--no-prefix-caching"]), ("cache on", [])):
        stack = Stack(backend)
        stack.serve(1, "prefix-aware", extra)
        try:
            client = await stack.client(1)
            await warm_up(client)
            params = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
            ttfts = []
            for prompt in prompts:
                record = await asyncio.wait_for(client.add_request(prompt, params), 600)
                ttfts.append(record.ttft or float("nan"))
            client.stop()
        finally:
            stack.stop()
        # The first request computes the prefix either way: the rest show the cache.
        results.append(
            {
                "backend": backend.name,
                "run": label,
                "ttft_first": ttfts[0],
                "ttft_p50_rest": percentile(ttfts[1:], 0.5),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def oracle_hit_rate(prompts: list[list[int]], engines: int, cache_blocks: int) -> float:
    """Each request, in order, to the engine whose cache holds the longest prefix of it (ties:
    the one that got fewest so far); every cache simulated as the fake engines do."""
    caches = [SimulatedPrefixCache(cache_blocks, BLOCK) for _ in range(engines)]
    assigned = [0] * engines
    hit = total = 0
    for prompt in prompts:
        hashes = block_hashes(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]

        def held(cache: SimulatedPrefixCache, hashes: list[int] = hashes) -> int:
            count = 0
            for block_hash in hashes:
                if not cache.held(block_hash):
                    break
                count += 1
            return count

        best = max(range(engines), key=lambda e: (held(caches[e]), -assigned[e]))
        assigned[best] += 1
        hit += caches[best].admit(prompt, b"")
        total += len(prompt)
    return hit / total


async def fake_engines(quick: bool) -> list[dict[str, Any]]:
    results = []
    for engines in (8, 32):
        groups = engines * 4
        shared = SharedPrefix(
            groups=groups, per_group=8, system_len=512, question_len=64, output_len=16
        )
        # Each cache holds ~6 of the system prompts: all fit the engines together, not one.
        cache_blocks = 6 * (512 // BLOCK + 8)
        extra = [
            "--fake-cache-blocks",
            str(cache_blocks),
            "--fake-prefill-cost",
            "0.00002",
            "--step-delay",
            "0.005",
        ]
        prompts = shared.prompts(seed=engines)
        if quick:
            prompts = prompts[: len(prompts) // 2]
        oracle = oracle_hit_rate(prompts, engines, cache_blocks)
        rate = 50.0 if engines == 8 else 100.0
        for policy in POLICIES:
            stack = Stack()
            stack.fake(engines, policy, extra)
            try:
                client = await stack.client(engines, within=120)
                body = drive_shared(client, prompts, rate, shared.output_len, seed=1)
                run = await measure(client, policy, f"shared_prefix x{engines} fake", rate, body)
                client.stop()
            finally:
                stack.stop()
            summary = run.summary() | {"engines": engines, "oracle_hit_rate": oracle}
            results.append(summary)
            print(json.dumps(summary), flush=True)
    return results


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-fake", action="store_true")
    parser.add_argument("--skip-one-engine", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer rates and requests")
    # The real engines' shared_prefix workload (4 groups): on a machine shared with other
    # work, --per-group 3 --system-len 192 --rates 0.2,0.4 finish in ~25 min.
    parser.add_argument("--per-group", type=int, default=8, help="prompts per system prompt")
    parser.add_argument("--system-len", type=int, default=256, help="system prompt tokens")
    parser.add_argument("--rates", default="0.5,1.0", help="requests/s, comma-separated")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="the real engines' policies, comma-separated (default: all three)",
    )
    parser.add_argument(
        "--backend",
        choices=("dpserve", "vllm"),
        default="dpserve",
        help="the real engines' backend (the fake engines are dpserve's either way)",
    )
    parser.add_argument("--vllm-python", default=default_vllm_python(), help="vLLM's install")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    vllm_python = None
    if args.backend == "vllm":
        if not args.vllm_python or not Path(args.vllm_python).exists():
            parser.error("--backend vllm: no vLLM install (run `make vllm`, or --vllm-python)")
        vllm_python = args.vllm_python
    results: dict[str, Any] = {}
    if not args.skip_fake:
        results["fake"] = await fake_engines(args.quick)
    if not args.skip_real:
        if not args.skip_one_engine:
            results["one_engine"] = await one_engine_on_off(vllm_python)
        rates = [float(rate) for rate in args.rates.split(",")]
        policies = tuple(args.policies.split(","))
        if not set(policies) <= set(POLICIES):
            parser.error(f"--policies: each one of {', '.join(POLICIES)}")
        results["real"] = await real_engines(
            args.quick, args.per_group, args.system_len, rates, policies, vllm_python
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
