"""Cache-aware routing through real processes with fake engines (their simulated prefix caches
hash and report blocks as the model engine does): same-prefix requests land together, a hot
prefix still spreads, and the coordinator's index stays true when an engine dies or restarts,
when events are lost, and when the coordinator itself restarts."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dpserve.client import InferenceClient
from dpserve.sampling import SamplingParams
from tests.integration import gappy_engine
from tests.integration.runtime import Processes, wait_for_engines
from tests.integration.test_runtime import FAST

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).parents[2]
BLOCK = 16
ENGINE = ("--step-delay", "0.01", "--block-size", str(BLOCK))
PREFIX = [random.Random(1).randrange(1, 250) for _ in range(200)]  # 12 full blocks + 8
CACHED = 192  # of PREFIX + a question: the 12 blocks before the question


def prompt(question: int, prefix: list[int] = PREFIX) -> list[int]:
    return prefix + [question % 250 + 1] * 8


async def routing_status(client: InferenceClient) -> dict[str, Any]:
    status = await asyncio.wait_for(client.get_status(), 5)
    routing: dict[str, Any] = status["prefix_routing"]
    return routing


async def indexed(client: InferenceClient, rank: int) -> int:
    return int((await routing_status(client))["indexed_blocks_by_rank"].get(str(rank), 0))


async def wait_indexed(client: InferenceClient, rank: int, check, within: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    latest = {"n": -1}

    async def poll() -> None:
        latest["n"] = await indexed(client, rank)

    deadline = asyncio.get_running_loop().time() + within
    while True:
        await poll()
        if check(latest["n"]):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine {rank} indexed {latest['n']} blocks")
        await asyncio.sleep(0.1)


async def run(client: InferenceClient, prompts: list[list[int]], tokens: int = 4) -> list:  # type: ignore[type-arg]
    params = SamplingParams(num_tokens_to_generate=tokens)
    return await asyncio.wait_for(
        asyncio.gather(*(client.add_request(p, params) for p in prompts)), 60
    )


async def test_same_prefix_lands_together_and_a_hot_prefix_spreads(processes, client, port):
    processes.coordinator(port, *FAST)
    for rank in range(4):
        processes.fake_engine(port, rank, *ENGINE)
    await client.start()
    await wait_for_engines(client, 4)
    [first] = await run(client, [prompt(0)])
    home = first.engine_rank
    assert first.cached_tokens == 0
    await wait_indexed(client, home, lambda n: n >= 13)
    # A burst of the same prefix: all where it is cached, all served from that cache.
    burst = await run(client, [prompt(i) for i in range(1, 4)])
    assert {r.engine_rank for r in burst} == {home}
    assert [r.cached_tokens for r in burst] == [CACHED] * 3
    # A very popular prefix, many requests in flight at once: every engine gets some.
    hot = await run(client, [prompt(i) for i in range(10, 50)], tokens=100)
    assert {r.engine_rank for r in hot} == {0, 1, 2, 3}
    routing = await routing_status(client)
    # Moved off the prefix's engine by cost (its queue) or by the hot-spot guard.
    decisions = routing["decisions"]
    assert decisions["prefix"] >= 3
    assert decisions.get("balance", 0) + decisions.get("hot_spot", 0) > 0, decisions
    # The index predicted what the engines found, request for request, on the burst.
    assert routing["actual_cached_tokens"] >= 3 * CACHED


async def test_a_slow_engines_queue_is_priced_at_its_measured_pace(processes, client, port):
    # Engines that run 2 requests at once, with slow steps and a prefill cost per uncached
    # token. With the constant price of a request in flight alone (16 tokens) a burst of 8
    # requests for one cached prefix kept 7 on its engine (a miss elsewhere costs ~200 tokens;
    # the queued prefills moved the 8th). Measured, each request queued there for a slot
    # costs what the engine prefills in the time it takes to finish one (~250 tokens here), so
    # the burst is split as soon as requests wait there (4 of 8 stayed, in 3 of 3 runs).
    slow = (
        *ENGINE,
        "--step-delay",
        "0.02",
        "--fake-prefill-cost",
        "0.002",
        "--max-batch-size",
        "2",
    )
    processes.coordinator(port, *FAST)
    for rank in range(2):
        processes.fake_engine(port, rank, *slow)
    await client.start()
    await wait_for_engines(client, 2)
    # The engines' pace: requests with prompts nobody holds, finished on both; a few one at a
    # time (a prefill is timed only on an engine with nothing queued, and not its first).
    rng = random.Random(7)

    def unheld(count: int) -> list[list[int]]:
        return [[rng.randrange(1, 250) for _ in range(200)] for _ in range(count)]

    for _ in range(3):
        await run(client, unheld(2), tokens=10)  # one on each engine
    await run(client, unheld(6), tokens=10)
    paces = (await routing_status(client))["pace_by_rank"]
    assert set(paces) == {"0", "1"}
    assert all(pace["wait_price_tokens"] > 16 for pace in paces.values()), paces
    [first] = await run(client, [prompt(0)])
    home = first.engine_rank
    await wait_indexed(client, home, lambda n: n >= 13)
    before = (await routing_status(client))["decisions"]
    burst = await run(client, [prompt(i) for i in range(1, 9)], tokens=30)
    after = (await routing_status(client))["decisions"]
    on_home = sum(r.engine_rank == home for r in burst)
    assert 2 <= on_home <= 5, [r.engine_rank for r in burst]
    assert after.get("balance", 0) > before.get("balance", 0), after
    assert after.get("hot_spot", 0) == before.get("hot_spot", 0)
    # The ones kept home were served from its cache.
    assert all(r.cached_tokens == CACHED for r in burst if r.engine_rank == home)


async def test_index_follows_engine_death_and_restart(processes, client, port):
    processes.coordinator(port, *FAST)
    engines = {rank: processes.fake_engine(port, rank, *ENGINE) for rank in range(2)}
    await client.start()
    await wait_for_engines(client, 2)
    [first] = await run(client, [prompt(0)])
    home, other = first.engine_rank, 1 - first.engine_rank
    await wait_indexed(client, home, lambda n: n >= 13)
    # The engine holding the prefix dies: its entries go with it, and the next request is
    # routed by the survivor's cache (nothing there yet: predicted 0, found 0).
    engines[home].send_signal(signal.SIGKILL)
    await wait_for_engines(client, 1)
    assert await indexed(client, home) == 0
    before = await routing_status(client)
    [moved] = await run(client, [prompt(1)])
    assert moved.engine_rank == other and moved.cached_tokens == 0
    after = await routing_status(client)
    assert after["prediction_error_tokens"] == before["prediction_error_tokens"]
    # A new process takes the dead one's rank: it starts empty in the index, and learns.
    processes.fake_engine(port, home, *ENGINE)
    await wait_for_engines(client, 2)
    assert await indexed(client, home) == 0
    await wait_indexed(client, other, lambda n: n >= 13)
    [again] = await run(client, [prompt(2)])
    assert again.engine_rank == other and again.cached_tokens == CACHED


def spawn_gappy_engine(processes: Processes, port: int, lose_batch: int) -> None:
    log = open(processes.log_dir / "engine-gappy.log", "ab")  # noqa: SIM115
    engine = subprocess.Popen(
        [sys.executable, gappy_engine.__file__, f"tcp://127.0.0.1:{port}", "0", str(lose_batch)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
    )
    log.close()
    processes.started.append(engine)


async def test_lost_events_are_noticed_and_a_snapshot_repairs_the_index(processes, client, port):
    processes.coordinator(port, *FAST)
    spawn_gappy_engine(processes, port, lose_batch=2)
    await client.start()
    await wait_for_engines(client, 1)
    prefixes = [[random.Random(s).randrange(1, 250) for _ in range(64)] for s in range(4)]
    for prefix in prefixes:  # one batch of events each: batch 2 is lost
        await run(client, [prompt(0, prefix)])
        await asyncio.sleep(0.2)
    routing = await routing_status(client)
    assert routing["event_gaps"] == 1
    # The snapshot that followed restored everything the engine holds: 4 prefixes x 4 blocks.
    await wait_indexed(client, 0, lambda n: n == 4 * 4)


async def test_a_restarted_coordinator_rebuilds_the_index_from_snapshots(processes, port):
    coordinator = processes.coordinator(port, *FAST)
    for rank in range(2):
        processes.fake_engine(port, rank, *ENGINE, "--coordinator-timeout", "1")
    client = InferenceClient(port, handshake_timeout=20)
    try:
        await client.start()
        await wait_for_engines(client, 2)
        [first] = await run(client, [prompt(0)])
        home = first.engine_rank
        await wait_indexed(client, home, lambda n: n >= 13)
    finally:
        client.stop()
    coordinator.send_signal(signal.SIGKILL)
    coordinator.wait(10)
    processes.coordinator(port, *FAST)
    client = InferenceClient(port, handshake_timeout=20)
    try:
        await client.start()
        await wait_for_engines(client, 2)
        # Nothing was routed by this coordinator: it learned it from the engines' snapshots.
        await wait_indexed(client, home, lambda n: n >= 13)
        [again] = await run(client, [prompt(1)])
        assert again.engine_rank == home and again.cached_tokens == CACHED
    finally:
        client.stop()
