"""Issue 9, runtime items: the client and engines against real processes on 127.0.0.1.

Fake engines make every result checkable: each token is ``fake_token(prompt tokens, seed,
position)`` and the byte tokenizer makes prompt tokens the prompt's UTF-8 bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import time

import pytest

from dpserve.client import (
    CoordinatorRefused,
    InferenceClient,
    RequestFailed,
    RequestRecord,
    UnsendableRequest,
)
from dpserve.engine.cpus import usable_cores
from dpserve.engine.fake import fake_token
from dpserve.limits import DEFAULT_REQUEST_LIMITS
from dpserve.sampling import SamplingParams
from dpserve.security import key_files
from tests.integration.runtime import DPSERVE, Processes, free_port, wait_for_engines
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(180)

FAST = ("--heartbeat-timeout", "1.5")
# The coordinator accepts every message the client's default limit lets through.
MESSAGE_LIMIT = ("--max-message-bytes", str(DEFAULT_REQUEST_LIMITS.max_message_bytes))


def expected_text(prompt: str, count: int, seed: int | None = None) -> str:
    prompt_tokens = list(prompt.encode())
    return "".join(chr(fake_token(prompt_tokens, seed, i)) for i in range(count))


async def start(
    processes: Processes,
    client: InferenceClient,
    port: int,
    engines: int,
    engine_args: tuple[str, ...] = (),
) -> None:
    processes.coordinator(port, *FAST, *MESSAGE_LIMIT)
    for rank in range(engines):
        processes.fake_engine(port, rank, *engine_args)
    await client.start()
    await wait_for_engines(client, engines)


async def collect(stream_chunks, received: list[str]) -> RequestRecord:
    """Consume a stream, appending each chunk's text to ``received``; returns the record."""
    record = None
    async for event in stream_chunks.events():
        if isinstance(event, RequestRecord):
            record = event
        else:
            received.append(event.text)
    assert record is not None
    return record


# ------------------------------------------------------------------ item 4


async def test_streams_continue_after_a_coordinator_restart_without_duplication(
    processes, client, port
):
    await start(processes, client, port, engines=2, engine_args=("--step-delay", "0.03"))
    length = 120
    params = SamplingParams(num_tokens_to_generate=length, temperature=0)
    prompts = [f"restart stream {i}" for i in range(50)]
    texts: list[list[str]] = [[] for _ in prompts]
    streams = [
        asyncio.create_task(collect(client.stream(prompt, params), texts[i]))
        for i, prompt in enumerate(prompts)
    ]
    plain_prompts = [f"restart plain {i}" for i in range(50)]
    plain = [client.add_request(prompt, params) for prompt in plain_prompts]
    # Every stream has text, none has finished: kill the coordinator mid-way.
    await eventually(lambda: all(len("".join(t)) >= 5 for t in texts), within=60)
    assert not any(task.done() for task in streams)
    processes.started[0].send_signal(signal.SIGKILL)
    processes.started[0].wait(5)
    await asyncio.sleep(0.5)
    processes.coordinator(port, *FAST, *MESSAGE_LIMIT)
    records = await asyncio.wait_for(asyncio.gather(*streams), 120)
    for prompt, received, record in zip(prompts, texts, records, strict=True):
        assert "".join(received) == expected_text(prompt, length), prompt
        assert record.generated_text == expected_text(prompt, length)
        assert record.generated_tokens == [ord(c) for c in expected_text(prompt, length)]
        assert record.finish_reason == "length"
    for prompt, record in zip(plain_prompts, await asyncio.gather(*plain), strict=True):
        assert record.generated_text == expected_text(prompt, length)
    assert not client.completion_futures


# ------------------------------------------------------------------ item 5


async def test_text_that_cannot_be_encoded_is_refused_before_sending(processes, client, port):
    await start(processes, client, port, engines=1)
    lone_surrogate = "\ud800"
    attempts = [
        lambda: client.add_request(f"bad {lone_surrogate}"),
        lambda: client.stream([{"role": "user", "content": lone_surrogate}]),
        lambda: client.add_request("ok", SamplingParams(stop_strings=(lone_surrogate,))),
        lambda: client.add_request([1, 2**40]),
    ]
    for attempt in attempts:
        with pytest.raises(UnsendableRequest) as refused:
            attempt()
        assert "encode" in str(refused.value)
    with pytest.raises(UnsendableRequest, match="not valid Unicode"):
        client.add_request(lone_surrogate)
    assert not client.completion_futures, "a refused request never reaches the pending table"
    # The client keeps serving, and a restart's resubmission has nothing that cannot encode.
    pending = client.add_request("fine", SamplingParams(num_tokens_to_generate=4))
    assert (await asyncio.wait_for(pending, 30)).generated_text == expected_text("fine", 4)


# ------------------------------------------------------------------ item 3


async def test_oversize_request_fails_fast_while_other_streams_finish_exactly(
    processes, client, port
):
    await start(processes, client, port, engines=2, engine_args=("--step-delay", "0.01"))
    length = 100
    params = SamplingParams(num_tokens_to_generate=length)
    prompts = [f"neighbour {i}" for i in range(20)]
    texts: list[list[str]] = [[] for _ in prompts]
    streams = [
        asyncio.create_task(collect(client.stream(prompt, params), texts[i]))
        for i, prompt in enumerate(prompts)
    ]
    await eventually(lambda: all(texts), within=30)
    limit = DEFAULT_REQUEST_LIMITS.max_message_bytes
    token_ids = [7] * (limit // 4)  # a few bytes over the limit once framed
    started = time.monotonic()
    for oversize in (token_ids, "x" * limit, [{"role": "user", "content": "y" * limit}]):
        with pytest.raises(UnsendableRequest, match=f"message limit of {limit} bytes"):
            client.add_request(oversize, params)
    assert time.monotonic() - started < 1.0
    # The biggest request the limit allows still goes through, on the same connection.
    just_under = [7] * ((limit - 1024) // 4)
    accepted = client.add_request(just_under, SamplingParams(num_tokens_to_generate=1))
    records = await asyncio.wait_for(asyncio.gather(*streams), 60)
    for prompt, received, record in zip(prompts, texts, records, strict=True):
        assert "".join(received) == expected_text(prompt, length)
        assert record.generated_text == expected_text(prompt, length)
    # The coordinator's own prompt limit answers the just-under request: it was delivered.
    with pytest.raises(RequestFailed) as refused:
        await asyncio.wait_for(accepted, 30)
    assert refused.value.code == "prompt_too_long"


# ------------------------------------------------------------------ item 6


async def test_fake_engine_honours_its_context_and_finishing_rules(processes, client, port):
    await start(processes, client, port, engines=1, engine_args=("--context-size", "64"))
    prompt = "context"
    most = SamplingParams(num_tokens_to_generate=DEFAULT_REQUEST_LIMITS.max_new_tokens)
    record = await asyncio.wait_for(client.add_request(prompt, most), 30)
    assert record.finish_reason == "length"
    assert record.generated_text == expected_text(prompt, 64 - len(prompt))
    # The termination token ends a request only from min_tokens on, and never with ignore_eos.
    text = expected_text(prompt, 40)
    termination = ord(text[3])
    first, later = text.index(text[3]), text.index(text[3], 10)
    cases = {
        SamplingParams(num_tokens_to_generate=40, termination_id=termination): (first, "stop"),
        SamplingParams(num_tokens_to_generate=40, termination_id=termination, min_tokens=10): (
            later,
            "stop",
        ),
        SamplingParams(num_tokens_to_generate=40, termination_id=termination, ignore_eos=True): (
            40,
            "length",
        ),
    }
    for params, (count, reason) in cases.items():
        record = await asyncio.wait_for(client.add_request(prompt, params), 30)
        assert (record.generated_text, record.finish_reason) == (text[:count], reason), params


# ------------------------------------------------------------------ item 9


def run_dpserve(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run a dpserve command without inherited credentials; returns it and its duration."""
    env = {k: v for k, v in os.environ.items() if k != key_files.ENV_CREDENTIALS}
    started = time.monotonic()
    done = subprocess.run(
        [DPSERVE, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    return done, time.monotonic() - started


async def test_wrong_or_missing_credentials_fail_fast_and_say_why(processes, port, tmp_path):
    keys = key_files.generate_credentials(tmp_path / "keys")
    stranger = key_files.generate_credentials(tmp_path / "stranger")
    shutil.copy(keys / "coordinator.key", stranger / "coordinator.key")
    processes.coordinator(port, *FAST, "--credentials", str(keys))
    async with InferenceClient(port, credentials=keys) as admin:  # the coordinator is up
        address = f"127.0.0.1:{port}"
        # `generate` waits up to --timeout (120 s) for an answer; a refusal must not.
        no_keys, took = await asyncio.to_thread(run_dpserve, "generate", "hi", "--address", address)
        assert no_keys.returncode == 1 and took < 10
        assert "requires CURVE credentials" in no_keys.stderr
        not_allowed, took = await asyncio.to_thread(
            run_dpserve, "generate", "hi", "--address", address, "--credentials", str(stranger)
        )
        assert not_allowed.returncode == 1 and took < 10
        assert "key not allowed" in not_allowed.stderr
        for credentials, cause in ((None, "requires CURVE credentials"), (stranger, "not allowed")):
            outsider = InferenceClient(port, credentials=credentials)
            started = time.monotonic()
            with pytest.raises(CoordinatorRefused, match=cause):
                await outsider.start()
            assert time.monotonic() - started < 3
        # Engines alike: an engine without keys exits with the cause instead of waiting.
        engine = processes.fake_engine(port, 0)
        assert await asyncio.to_thread(engine.wait, 30) == 1
        assert "requires CURVE credentials" in processes.log("engine-0")
        assert (await admin.get_status())["engines"] == 0


async def test_a_coordinator_still_starting_is_waited_for(processes, port, caplog):
    caplog.set_level(logging.WARNING, logger="dpserve.client")
    engine = processes.fake_engine(port, 0)
    client = InferenceClient(port, handshake_timeout=1.0)
    try:
        starting = asyncio.create_task(client.start())
        # Nothing listens for longer than the handshake timeout, as on a cold node.
        await asyncio.sleep(3.0)
        assert not starting.done()
        processes.coordinator(port, *FAST)
        await asyncio.wait_for(starting, 30)
        await wait_for_engines(client, 1)
        record = await client.add_request("late", SamplingParams(num_tokens_to_generate=3))
        assert record.generated_text == expected_text("late", 3)
    finally:
        client.stop()
    assert "nothing listening yet" in caplog.text
    assert engine.poll() is None


# ------------------------------------------------------------------ item 11


async def test_a_long_engine_step_is_not_coordinator_silence(processes, client, port):
    # Each step takes 2.5 times the engine's coordinator timeout, as a step on an
    # oversubscribed CPU did (7-11 s against 5 s).
    await start(
        processes,
        client,
        port,
        engines=1,
        engine_args=("--step-delay", "2.5", "--coordinator-timeout", "1"),
    )
    params = SamplingParams(num_tokens_to_generate=3)
    records = await asyncio.wait_for(
        asyncio.gather(*(client.add_request(f"slow {i}", params) for i in range(4))), 60
    )
    for i, record in enumerate(records):
        assert record.generated_text == expected_text(f"slow {i}", 3)
    assert "registering again" not in processes.log("engine-0")
    # A coordinator that is really gone is still noticed within the timeout.
    processes.started[0].send_signal(signal.SIGKILL)
    await eventually(lambda: "registering again" in processes.log("engine-0"), within=10)


def test_serve_splits_the_cores_among_its_engines_and_streams_hold_up(tmp_path, tiny_model_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        serve = subprocess.Popen(
            [DPSERVE, "serve", "--model", str(tiny_model_path), "--insecure",
             "--data-parallel-size", "2", "--port", str(port), "--http-port", "0"],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        records = asyncio.run(_eight_streams(port, serve))
        assert len(records) == 8
        # ignore_eos: 32 tokens each once the model runner honours it (item 12).
        assert all(1 <= len(r.generated_tokens) <= 32 and r.finish_reason for r in records)
        text = log_path.read_text(errors="replace")
        threads = max(1, usable_cores() // 2)
        assert text.count(f"{threads} torch thread(s), from --torch-threads") == 2, text[-3000:]
        assert "registering again" not in text
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


async def _eight_streams(port: int, serve: subprocess.Popen) -> list[RequestRecord]:
    client = InferenceClient(port, handshake_timeout=30)
    try:
        await client.start()
        await wait_for_engines(client, 2, within=120)
        assert serve.poll() is None
        # ~150-token prompts and 32 new tokens, as the standard benchmark clients send.
        params = SamplingParams(num_tokens_to_generate=32, temperature=0, ignore_eos=True)
        prompts = [("The coordinator routes requests to engines. " * 15) + str(i) for i in range(8)]
        received: list[list[str]] = [[] for _ in prompts]
        return await asyncio.wait_for(
            asyncio.gather(
                *(collect(client.stream(p, params), received[i]) for i, p in enumerate(prompts))
            ),
            120,
        )
    finally:
        client.stop()
