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
import time
from pathlib import Path

import pytest

from dpserve.client import InferenceClient
from dpserve.sampling import SamplingParams
from tests.integration.runtime import Processes, wait_for_engines
from tests.integration.vllm_support import (
    build_vllm_llama,
    clear_greedy_prompts,
    spawn_dpserve_engine,
    spawn_vllm_engine,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CANDIDATES = [[30 + i, 5, 90 + 7 * i, 44, 180 - i, 12, 61, 7] for i in range(64)]
STREAMS = 8
MAX_TOKENS = 120
DPSERVE_RANK, VLLM_RANK = 0, 1


async def _stream(
    client: InferenceClient, prompt: list[int], chunks: list[int], index: int
) -> tuple[list[int], str]:
    params = SamplingParams(
        temperature=0, num_tokens_to_generate=MAX_TOKENS, ignore_eos=True, stream=True
    )
    tokens: list[int] = []
    text: list[str] = []
    async for chunk in client.stream(prompt, params):
        tokens += chunk.tokens
        text.append(chunk.text)
        chunks[index] += 1
    return tokens, "".join(text)


async def _killed_mid_stream(
    client: InferenceClient, prompts: list[list[int]], victim: subprocess.Popen[bytes]
) -> list[tuple[list[int], str]]:
    """Every prompt streamed at once; the ``victim`` engine SIGKILLed once each stream has a
    few chunks (or ended)."""
    chunks = [0] * len(prompts)
    streams = [asyncio.create_task(_stream(client, p, chunks, i)) for i, p in enumerate(prompts)]
    deadline = time.monotonic() + 60
    while not all(count >= 3 or task.done() for count, task in zip(chunks, streams, strict=True)):
        assert time.monotonic() < deadline, chunks
        await asyncio.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    return await asyncio.gather(*streams)


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
        clear_greedy_prompts, model, CANDIDATES, STREAMS, MAX_TOKENS
    )
    client = InferenceClient(port, handshake_timeout=20)
    await client.start()
    try:
        await wait_for_engines(client, 2, within=240)
        chunks = [0] * len(prompts)
        whole = await asyncio.gather(
            *(_stream(client, p, chunks, i) for i, p in enumerate(prompts))
        )
        assert [tokens for tokens, _ in whole] == expected, "both backends give the greedy tokens"

        # dpserve's engine dies: its streams go on on vLLM's.
        assert await _killed_mid_stream(client, prompts, dpserve_engine) == whole
        status = await client.get_status()
        moved = status["counters"].get("redispatched", 0)
        assert moved > 0, status["counters"]

        # dpserve's engine back (a new process, same rank); then vLLM's dies: its streams go on
        # on dpserve's.
        spawn_dpserve_engine(processes, port, DPSERVE_RANK, model)
        await wait_for_engines(client, 2, within=60)
        assert await _killed_mid_stream(client, prompts, vllm_engine) == whole
        status = await client.get_status()
        assert status["counters"]["redispatched"] > moved, status["counters"]
    finally:
        client.stop()
