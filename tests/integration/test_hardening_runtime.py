"""Issue 9, runtime items: the client and engines against real processes on 127.0.0.1.

Fake engines make every result checkable: each token is ``fake_token(prompt tokens, seed,
position)`` and the byte tokenizer makes prompt tokens the prompt's UTF-8 bytes.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from dpserve.client import InferenceClient, InvalidRequest, RequestFailed, RequestRecord
from dpserve.engine.fake import fake_token
from dpserve.limits import DEFAULT_REQUEST_LIMITS
from dpserve.sampling import SamplingParams
from tests.integration.runtime import Processes, eventually, wait_for_engines

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
        with pytest.raises(InvalidRequest) as refused:
            attempt()
        assert "encode" in str(refused.value)
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
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
        with pytest.raises(InvalidRequest, match=f"message limit of {limit} bytes"):
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
