"""``dpserve serve --backend vllm --data-parallel-size 2``: two vLLM engines (real vLLM, its CPU
build) behind dpserve's coordinator and HTTP front. Prefix-aware routing predicts exactly the
cached tokens vLLM reports (its KV events translated into dpserve's block hashes); an engine
SIGKILLed mid-stream is restarted while its streams move to the other engine and end
byte-identical to their uninterrupted run (resume tokens become part of vLLM's prompt); so are
an engine's streams when only its vLLM model worker dies (what the kernel's OOM killer picks:
the largest process); serve leaves no process behind, vLLM's workers included."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from dpserve.client import InferenceClient
from dpserve.sampling import SamplingParams
from tests.integration.runtime import DPSERVE, free_port, wait_for_banner
from tests.integration.test_serve import alive, descendants
from tests.integration.test_serve_supervision import Serve
from tests.integration.vllm_support import (
    STREAM_CANDIDATES,
    STREAM_TOKENS,
    VLLM_BLOCK_SIZE,
    VLLM_ENGINE_FLAGS,
    build_vllm_llama,
    clear_greedy_prompts,
    stream_greedy,
    streams_killed_mid_way,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


STREAMS = 12
# The kill pass's streams: a resumed stream's presence and frequency penalties must count the
# tokens streamed before its engine died (which vLLM gets as prompt).
PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "repetition_penalty": 1.2}


@dataclass
class Deployment:
    serve: Serve
    # Prompts whose greedy path has no near-tie, and their uninterrupted streams' tokens.
    prompts: list[list[int]]
    expected: list[list[int]]


@pytest.fixture(scope="module")
def deployment(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    directory = tmp_path_factory.mktemp("vllm-serve")
    model = build_vllm_llama(directory / "llama")
    port, http_port = free_port(), free_port()
    log = directory / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env["DPSERVE_VLLM_PYTHON"] = vllm_python
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                DPSERVE, "serve", "--backend", "vllm", "--data-parallel-size", "2", "--insecure",
                "--model", str(model), "--port", str(port), "--http-port", str(http_port),
                *VLLM_ENGINE_FLAGS,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    serving = Serve(process, log, port, http_port)
    try:
        # While vLLM starts (half a minute).
        prompts, expected = clear_greedy_prompts(model, STREAM_CANDIDATES, STREAMS, STREAM_TOKENS)
        wait_for_banner(process, log, within=300)
        yield Deployment(serving, prompts, expected)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in serving.leftovers():
            os.kill(pid, signal.SIGKILL)


async def test_prefix_aware_routing_predicts_vllm_cached_tokens(deployment: Deployment) -> None:
    """Four groups of prompts, each group sharing a 64-token prefix (two blocks): every repeat
    goes where its prefix is cached, and the tokens the coordinator predicted cached are the
    ones vLLM found."""
    client = InferenceClient(deployment.serve.port, handshake_timeout=20)
    await client.start()
    params = SamplingParams(temperature=0, num_tokens_to_generate=2, ignore_eos=True)
    prefixes = [
        [(13 * group + 7 * i) % 300 + 20 for i in range(2 * VLLM_BLOCK_SIZE)] for group in range(4)
    ]
    try:
        records = []
        for round_ in range(3):
            for group, prefix in enumerate(prefixes):
                suffix = [(group * 31 + round_ * 5 + i) % 300 + 20 for i in range(10)]
                records.append(await client.add_request(prefix + suffix, params))
            await asyncio.sleep(1.0)  # the round's KV events reach the coordinator
        status = await client.get_status()
    finally:
        client.stop()
    routing = status["prefix_routing"]
    repeats = records[len(prefixes) :]
    assert all(record.cached_tokens == 2 * VLLM_BLOCK_SIZE for record in repeats), [
        record.cached_tokens for record in records
    ]
    actual = sum(record.cached_tokens or 0 for record in records)
    assert routing["actual_cached_tokens"] == actual == routing["predicted_cached_tokens"]
    assert routing["prediction_error_tokens"] == 0
    assert sorted(routing["indexed_blocks_by_rank"]) == ["0", "1"], routing  # both engines used


async def test_a_vllm_worker_killed_mid_stream_loses_no_byte(deployment: Deployment) -> None:
    """vLLM's model worker SIGKILLed under load (not its engine's process): the engine ends,
    its streams move to the other engine byte-identical, and serve starts it again."""
    serve = deployment.serve
    client = InferenceClient(serve.port, handshake_timeout=20)
    await client.start()
    try:
        uninterrupted = await stream_all(client, deployment.prompts)
        engines: list[int] = []

        async def kill_a_worker() -> None:
            status = await asyncio.wait_for(client.get_status(), 10)
            busiest = max(status["engine_list"], key=lambda engine: engine["outstanding"])
            engine = serve.pid_of(f"engine {busiest['rank']}")
            assert engine is not None and busiest["outstanding"] > 0, status["engine_list"]
            workers = [pid for pid in descendants(engine) if "Worker" in _title(pid)]
            assert workers, [_title(pid) for pid in descendants(engine)]
            engines.append(engine)
            os.kill(workers[0], signal.SIGKILL)

        resumed = await streams_killed_mid_way(client, deployment.prompts, kill_a_worker)
        assert resumed == uninterrupted
        status = await asyncio.wait_for(client.get_status(), 10)
        assert status["counters"].get("redispatched", 0) > 0, "the victim held streams"
        # The engine whose worker died is gone, and serve started it again.
        deadline = time.monotonic() + 180
        while alive(engines[0]) or len(status["engine_list"]) < 2:
            assert time.monotonic() < deadline, (alive(engines[0]), status["engine_list"])
            await asyncio.sleep(0.5)
            status = await asyncio.wait_for(client.get_status(), 10)
        again = await stream_all(client, deployment.prompts)
        assert again == uninterrupted
    finally:
        client.stop()


async def stream_all(
    client: InferenceClient,
    prompts: list[list[int]],
    penalties: Mapping[str, float] | None = None,
) -> list[tuple[list[int], str]]:
    """Every prompt streamed greedily at once, uninterrupted."""
    chunks = [0] * len(prompts)
    return await asyncio.gather(
        *(stream_greedy(client, p, chunks, i, penalties) for i, p in enumerate(prompts))
    )


def _title(pid: int) -> str:
    """A process's name as ``ps`` shows it (vLLM names its worker processes)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # it exited while we looked
        return ""


async def test_an_engine_killed_mid_stream_loses_no_byte(deployment: Deployment) -> None:
    serve = deployment.serve
    client = InferenceClient(serve.port, handshake_timeout=20)
    await client.start()
    try:
        uninterrupted = await stream_all(client, deployment.prompts)
        assert [tokens for tokens, _ in uninterrupted] == deployment.expected
        penalized = await stream_all(client, deployment.prompts, PENALTIES)
        assert penalized != uninterrupted, "the penalties change the streams"
        workers: set[int] = set()  # the victim's vLLM model worker
        killed_at = 0.0

        async def kill() -> None:
            """SIGKILL the engine holding more of the streams (prefix-aware routing may put
            them all on one), once they are under way."""
            status = await asyncio.wait_for(client.get_status(), 10)
            busiest = max(status["engine_list"], key=lambda engine: engine["outstanding"])
            victim = serve.pid_of(f"engine {busiest['rank']}")
            assert victim is not None and busiest["outstanding"] > 0, status["engine_list"]
            nonlocal killed_at
            workers.update(descendants(victim))
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()

        resumed = await streams_killed_mid_way(
            client, deployment.prompts, kill, penalties=PENALTIES
        )
        assert resumed == penalized
        status = await asyncio.wait_for(client.get_status(), 10)
        assert status["counters"].get("redispatched", 0) > 0, "the victim held streams"
        assert workers, "vLLM runs its model in a worker process of its own"
        # vLLM's worker notices its engine is gone and exits.
        while any(alive(pid) for pid in workers):
            assert time.monotonic() - killed_at < 30, "vLLM's worker outlived its engine"
            await asyncio.sleep(0.2)
    finally:
        client.stop()
    serve_pid = serve.process.pid
    serve.process.send_signal(signal.SIGINT)
    assert serve.process.wait(120) == 0, serve.text()[-3000:]
    serve.assert_nothing_left()
    assert not [pid for pid in descendants(serve_pid) if alive(pid)]
