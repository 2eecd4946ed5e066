"""Requests over the coordinator's limits (``dpserve.limits``) are refused at once, by request
id, while the requests of others are served (issue 9, item 3, for clients of the ZMQ port)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dpserve.client import RequestFailed
from dpserve.limits import DEFAULT_REQUEST_LIMITS
from dpserve.sampling import SamplingParams
from tests.integration.test_runtime import FAST, expected_tokens, start

pytestmark = pytest.mark.timeout(120)

# Room for a 7,000-token prompt (packed: 4 bytes a token) that the fake engine's 8k context
# takes, and not much more.
MESSAGE_LIMIT = 28_300


async def refused(future: asyncio.Future) -> tuple[RequestFailed, float]:
    started = time.monotonic()
    with pytest.raises(RequestFailed) as failure:
        await asyncio.wait_for(future, 10)
    return failure.value, time.monotonic() - started


async def test_over_limit_requests_are_refused_at_once_beside_live_streams(processes, client, port):
    coordinator_args = (*FAST, "--max-message-bytes", str(MESSAGE_LIMIT))
    await start(processes, client, port, 1, coordinator_args, ("--step-delay", "0.01"))
    live = client.stream("live stream", SamplingParams(num_tokens_to_generate=200, stream=True))
    # Just under the message limit: served.
    near = [110] * 7_000
    record = await asyncio.wait_for(
        client.add_request(near, SamplingParams(num_tokens_to_generate=2)), 20
    )
    assert record.prompt_tokens == near
    # Just over it: refused by its id, well under a second, and the client stays connected.
    error, took = await refused(client.add_request("o" * MESSAGE_LIMIT))
    assert error.code == "message_too_large"
    assert f"at most {MESSAGE_LIMIT}" in error.message and "--max-message-bytes" in error.message
    assert took < 1.0
    record = await asyncio.wait_for(live.future, 30)
    assert record.generated_tokens == expected_tokens("live stream", 200)
    status = await client.get_status()
    assert status["counters"]["too_large"] == 1
    assert status["limits"]["max_message_bytes"] == MESSAGE_LIMIT


async def test_prompts_over_the_character_and_token_limits_are_refused(processes, client, port):
    await start(processes, client, port, 1)
    # Token ids over --max-prompt-tokens (given as ids: nothing to tokenize).
    too_many = DEFAULT_REQUEST_LIMITS.max_prompt_tokens + 1
    error, took = await refused(client.add_request([1] * too_many))
    assert error.code == "prompt_too_long" and str(too_many) in error.message
    assert took < 1.0
    chars = DEFAULT_REQUEST_LIMITS.max_prompt_chars
    error, took = await refused(client.add_request("c" * (chars + 1)))
    assert error.code == "prompt_too_long"
    assert f"at most {chars}" in error.message
    assert took < 1.0
