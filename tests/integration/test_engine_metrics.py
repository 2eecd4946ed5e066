"""Engines' KV-pool numbers reach STATUS and /metrics: a real tiny-model engine, a fake one, and a
rogue "engine" whose heartbeat numbers the coordinator must refuse without falling over."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from dpserve import protocol
from dpserve.client import InferenceClient
from dpserve.engine.defaults import RESERVED_BLOCKS
from dpserve.limits import DEFAULT_ENGINE_STATS_LIMITS
from dpserve.protocol import Header, Heartbeat, HeartbeatAck, Register, RegisterAck
from tests.integration.http_support import metric, metric_samples, ready_is, start_front
from tests.integration.runtime import Processes, wait_for_engines
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

KV_METRICS = {
    "dpserve_engine_kv_cache_blocks": "kv_blocks",
    "dpserve_engine_kv_cache_tokens": "kv_tokens",
    "dpserve_engine_kv_cache_bytes": "kv_bytes",
    "dpserve_engine_max_concurrent_sequences": "max_num_seqs",
}


def logged_pool(log: str) -> dict[str, int]:
    """The pool facts the engine logged at start ("model ...: kv_blocks 12, kv_tokens ...")."""
    facts = {key: re.search(rf"\b{key} (\d+)\b", log) for key in KV_METRICS.values()}
    assert all(facts.values()), f"the engine did not log its pool:\n{log[-3000:]}"
    return {key: int(found[1]) for key, found in facts.items() if found}


async def test_metrics_report_the_pool_the_engine_logged(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    processes = Processes(tmp_path)
    try:
        _, zmq_port, base_url = start_front(processes)
        coordinator = f"tcp://127.0.0.1:{zmq_port}"
        processes.spawn(
            "engine-0", "engine", "--coordinator", coordinator, "--rank", "0",
            "--model", str(tiny_model_path), "--device", "cpu",
            "--kv-cache-bytes", str(256 * 1024), "--block-size", "16",
        )  # fmt: skip
        processes.fake_engine(zmq_port, 1)
        wait_until(ready_is(base_url, 200, engines=2), 120, "two engines")
        pool = logged_pool(processes.log("engine-0"))

        async with aiohttp.ClientSession() as session:

            async def scrape() -> str:
                async with session.get(f"{base_url}/metrics") as response:
                    assert response.status == 200
                    return await response.text()

            text = await scrape()
            for _ in range(100):  # the numbers come with the engines' first heartbeats
                if metric(text, "dpserve_engine_waiting_sequences", rank="1") is not None:
                    break
                await asyncio.sleep(0.1)
                text = await scrape()

        for name, key in KV_METRICS.items():
            assert metric(text, name, rank="0") == pool[key], name
        # Idle: every block but the reserved one is free, nothing was preempted.
        idle_free = pool["kv_blocks"] - RESERVED_BLOCKS
        assert metric(text, "dpserve_engine_kv_cache_free_blocks", rank="0") == idle_free
        assert metric(text, "dpserve_engine_preemptions_total", rank="0") == 0
        assert metric(text, "dpserve_engine_running_sequences", rank="0") == 0
        # The fake engine has no KV pool: its rank has no pool sample, not a made-up zero.
        kv_ranks = {
            labels["rank"]
            for name, labels, _ in metric_samples(text)
            if name == "dpserve_engine_kv_cache_blocks"
        }
        assert kv_ranks == {"0"}
        assert metric(text, "dpserve_engine_waiting_sequences", rank="1") == 0
    finally:
        processes.cleanup()


async def _register(socket: zmq.asyncio.Socket, rank: int) -> None:
    await socket.send(protocol.encode(Register(rank, 1, "rogue")))
    ack = protocol.decode(await asyncio.wait_for(socket.recv(), 10))
    assert isinstance(ack, RegisterAck)


async def _heartbeat(socket: zmq.asyncio.Socket, stats: object) -> None:
    await socket.send(protocol.encode(Heartbeat(0, stats)))
    ack = protocol.decode(await asyncio.wait_for(socket.recv(), 10))
    assert isinstance(ack, HeartbeatAck), "a heartbeat with bad numbers still counts"


async def _engine_status(client: InferenceClient, rank: int) -> tuple[dict, dict]:
    status = await asyncio.wait_for(client.get_status(), 5)
    [engine] = [e for e in status["engine_list"] if e["rank"] == rank]
    return engine, status["counters"]


MALFORMED_STATS = [
    {"kv_blocks": "many"},
    {"kv_blocks": True},
    {"kv_blocks": float("nan")},
    {"kv_blocks": float("inf")},
    {"kv_blocks": [1, 2]},
    {"kv_blocks": {"nested": 1}},
    {"kv_blocks": None},
    {"Kv-Blocks": 1},
    {"": 1},
    {"x" * (DEFAULT_ENGINE_STATS_LIMITS.max_name_chars + 1): 1},
    {f"stat_{i}": i for i in range(DEFAULT_ENGINE_STATS_LIMITS.max_entries + 1)},
]


async def test_coordinator_refuses_malformed_engine_stats(
    processes: Processes, client: InferenceClient, port: int
) -> None:
    processes.coordinator(port)
    await client.start()
    context = zmq.asyncio.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.connect(f"tcp://127.0.0.1:{port}")
    try:
        await _register(rogue, rank=7)
        await wait_for_engines(client, 1)
        await _heartbeat(rogue, {"kv_blocks": 12, "kv_free_blocks": 10.0})
        engine, counters = await _engine_status(client, 7)
        assert engine["stats"] == {"kv_blocks": 12, "kv_free_blocks": 10.0}
        assert counters.get("bad_engine_stats", 0) == 0

        for stats in MALFORMED_STATS:
            await _heartbeat(rogue, stats)
            engine, _ = await _engine_status(client, 7)
            assert engine["stats"] == {}, f"kept {stats!r:.100}"
        _, counters = await _engine_status(client, 7)
        assert counters["bad_engine_stats"] == len(MALFORMED_STATS)

        # Stats that are not a map at all are a malformed message: dropped, engine kept.
        await rogue.send(msgpack.packb([int(Header.HEARTBEAT), 0, [1, 2]]))
        await _heartbeat(rogue, {"kv_blocks": 3})
        engine, counters = await _engine_status(client, 7)
        assert engine["stats"] == {"kv_blocks": 3}
        assert counters["bad_messages"] >= 1
        assert processes.started[0].poll() is None, "the coordinator is still running"
    finally:
        rogue.close(0)
        context.term()


def test_heartbeat_without_stats_is_still_valid_on_the_wire() -> None:
    """Older engines and every client send HEARTBEAT with one field."""
    assert protocol.encode(Heartbeat(2)) == msgpack.packb([int(Header.HEARTBEAT), 2])
    assert protocol.decode(msgpack.packb([int(Header.HEARTBEAT), 2])) == Heartbeat(2, None)
    assert protocol.decode(protocol.encode(Heartbeat(1, {"kv_blocks": 4}))).stats == {
        "kv_blocks": 4
    }
