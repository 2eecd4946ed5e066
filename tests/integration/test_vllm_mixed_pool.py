"""One deployment, two engine backends: a dpserve engine and a vLLM engine (real vLLM, its CPU
build) behind one coordinator compute the same greedy tokens, so a stream whose engine is
SIGKILLed moves to the other backend and ends byte-identical to its uninterrupted run, from
dpserve's engine to vLLM's and back. (The prompts are ones whose greedy path has no near-tie
on the random tiny model: ``vllm_support.clear_greedy_prompts``.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from dpserve.client import InferenceClient
from tests.integration.runtime import Processes, wait_for_engines
from tests.integration.vllm_support import (
    STREAM_CANDIDATES,
    STREAM_TOKENS,
    build_vllm_llama,
    clear_greedy_prompts,
    spawn_dpserve_engine,
    spawn_vllm_engine,
    stream_greedy,
    streams_killed_mid_way,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STREAMS = 8
DPSERVE_RANK, VLLM_RANK = 0, 1


def _sigkill(engine: subprocess.Popen[bytes]) -> Callable[[], Awaitable[None]]:
    async def kill() -> None:
        os.kill(engine.pid, signal.SIGKILL)
        await asyncio.to_thread(engine.wait, 10)

    return kill


async def test_streams_move_between_a_dpserve_and_a_vllm_engine(
    tmp_path: Path, processes: Processes, port: int, vllm_python: str
) -> None:
    model = await asyncio.to_thread(build_vllm_llama, tmp_path / "llama")
    processes.coordinator(
        port, "--insecure", "--tokenizer", str(model), "--routing", "round-robin",
        "--heartbeat-timeout", "2",
    )  # fmt: skip
    dpserve_engine = spawn_dpserve_engine(processes, port, DPSERVE_RANK, model)
    vllm_engine = spawn_vllm_engine(processes, vllm_python, port, VLLM_RANK, model)
    # While vLLM starts (half a minute).
    prompts, expected = await asyncio.to_thread(
        clear_greedy_prompts, model, STREAM_CANDIDATES, STREAMS, STREAM_TOKENS
    )
    client = InferenceClient(port, handshake_timeout=20)
    await client.start()
    try:
        await wait_for_engines(client, 2, within=240)
        chunks = [0] * len(prompts)
        whole = await asyncio.gather(
            *(stream_greedy(client, p, chunks, i) for i, p in enumerate(prompts))
        )
        assert [tokens for tokens, _ in whole] == expected, "both backends give the greedy tokens"

        # dpserve's engine dies: its streams go on on vLLM's.
        assert (
            await streams_killed_mid_way(
                client,
                prompts,
                _sigkill(dpserve_engine),
                victim=DPSERVE_RANK,
                frozen=dpserve_engine,
            )
            == whole
        )
        status = await client.get_status()
        moved = status["counters"].get("redispatched", 0)
        assert moved > 0, status["counters"]

        # dpserve's engine back (a new process, same rank); then vLLM's dies: its streams go on
        # on dpserve's.
        spawn_dpserve_engine(processes, port, DPSERVE_RANK, model)
        await wait_for_engines(client, 2, within=60)
        assert (
            await streams_killed_mid_way(
                client, prompts, _sigkill(vllm_engine), victim=VLLM_RANK, frozen=vllm_engine
            )
            == whole
        )
        status = await client.get_status()
        assert status["counters"]["redispatched"] > moved, status["counters"]
    finally:
        client.stop()
