"""The router's own cost per request, in one process: no sockets, no other processes.

    python bench/coordinator_router.py [--repeat 3]

For each case (engines, prompt length) a ``Router`` with that many registered engines routes
requests the way the dispatcher does (``choose``, ``routed``, the first token, the finish,
``forget``), under prefix-aware and round-robin routing. Every engine reported block size 16
and its room; with long prompts (32 shared prefixes + 16 tokens of their own, as
``bench/coordinator_scale.py`` sends) engine k holds prefix k mod 32 by its KV events. The
figure is the thread's CPU time per request (the best of ``--repeat`` rounds): on a shared
machine it moves far less than wall time, and it is the part of the coordinator's CPU per
request that the routing policy decides.

Run it with ``PYTHONPATH=<a copy of another commit's dpserve package's parent>`` to measure
that commit's router (never the repository root: its ``operator/`` shadows the stdlib).
"""

from __future__ import annotations

import argparse
import random
import time

from dpserve import protocol
from dpserve.block_hash import block_hashes, pack_hashes
from dpserve.coordinator.registry import Engine, EngineRegistry
from dpserve.coordinator.requests import InflightRequest
from dpserve.coordinator.router import Router
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.protocol import KvEvent, KvEvents, decode, encode

BLOCK = 16
PREFIXES = 32
OWN_TOKENS = 16


def routed_fleet(
    policy: RoutingPolicy, engines: int, held: list[list[int]]
) -> tuple[EngineRegistry, Router]:
    registry = EngineRegistry()
    router = Router(policy, registry)
    for rank in range(engines):
        engine = Engine(b"engine-%d" % rank, rank, capacity=8, instance=f"i{rank}", last_seen=0)
        engine.stats = {"kv_empty_blocks": 100_000}
        registry.add(engine)
        router.engine_added(engine)
        events = [KvEvent(2, b"", None)]  # cleared: the start of a snapshot
        if held:
            hashes = block_hashes(held[rank % len(held)], BLOCK)
            events.append(KvEvent(0, pack_hashes(hashes), 0))
        router.on_kv_events(engine, decode(encode(KvEvents(f"i{rank}", 0, BLOCK, events))))
    return registry, router


def cpu_us_per_request(
    policy: RoutingPolicy, engines: int, prompts: list[list[int]], count: int
) -> float:
    long_prompts = len(prompts[0]) > BLOCK
    registry, router = routed_fleet(policy, engines, prompts[:PREFIXES] if long_prompts else [])
    packed = [protocol.pack_tokens(prompt) for prompt in prompts]
    requests = [
        InflightRequest(i, b"client", i, packed[i % len(packed)], {}, False, 0.0)
        for i in range(count)
    ]
    by_identity = registry.engines
    started = time.thread_time()
    for request in requests:
        decision = router.choose(request)
        assert decision is not None
        outstanding = by_identity[decision.identity].outstanding
        outstanding.add(request.request_id)
        router.routed(request, decision)
        router.prefilled(request.request_id)  # its first token
        router.finished(request, 0)
        outstanding.discard(request.request_id)
        router.forget(request.request_id)
    return (time.thread_time() - started) / count * 1e6


def shared_prefix_prompts(length: int, count: int, rng: random.Random) -> list[list[int]]:
    shared = length - OWN_TOKENS
    prefixes = [[rng.randrange(32, 127) for _ in range(shared)] for _ in range(PREFIXES)]
    return [
        prefixes[i % PREFIXES] + [rng.randrange(32, 127) for _ in range(OWN_TOKENS)]
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(1)
    short = [list(b"prompt %d" % i) for i in range(1000)]  # as bench/coordinator.py's, bytes
    cases = [
        ("2 engines, 9-13 tokens", 2, short, 40_000),
        ("64 engines, 9-13 tokens", 64, short, 5_000),
        ("8 engines, 1,024 tokens", 8, shared_prefix_prompts(1024, 256, rng), 2_000),
        ("64 engines, 8,192 tokens", 64, shared_prefix_prompts(8192, 256, rng), 400),
    ]
    print(f"{'':26}{'prefix-aware us':>16}{'round-robin us':>16}")
    for label, engines, prompts, count in cases:
        figures = [
            min(cpu_us_per_request(policy, engines, prompts, count) for _ in range(args.repeat))
            for policy in (RoutingPolicy.PREFIX_AWARE, RoutingPolicy.ROUND_ROBIN)
        ]
        print(f"{label:26}{figures[0]:>16.2f}{figures[1]:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
