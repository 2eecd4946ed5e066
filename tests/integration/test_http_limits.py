"""Issue 9, item 3: every request limit is checked at the HTTP edge, before anything is sent
to the coordinator, and answered fast with a 400/413 naming the limit, while other users'
streams finish byte-for-byte as they would alone.

The front runs with small limits given as flags (so the flags are tested too), and with a
coordinator whose ``--max-message-bytes`` is tighter than the front's own: the front learns it
from the coordinator's status and refuses what the coordinator would drop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from dpserve.tokenizer import as_batch_tokenizer
from tests.integration.http_support import (
    Cluster,
    error_of,
    expected_text,
    start_cluster,
    stream_text,
    wait_for_idle,
)
from tests.integration.runtime import Processes

pytestmark = pytest.mark.timeout(120)

BODY_BYTES = 65_536
PROMPT_CHARS = 2_000
PROMPT_TOKENS = 3_000
NEW_TOKENS = 400
STOP_STRINGS = 3
STOP_CHARS = 20
STOP_TOKEN_IDS = 4
LOGIT_BIAS_TOKENS = 3
JSON_DEPTH = 5  # a chat body with content parts nests exactly this deep
MESSAGE_BYTES = 8_192  # the coordinator's: tighter than the front's own
FLAGS = (
    f"--max-body-bytes={BODY_BYTES}",
    f"--max-prompt-chars={PROMPT_CHARS}",
    f"--max-prompt-tokens={PROMPT_TOKENS}",
    f"--max-new-tokens={NEW_TOKENS}",
    f"--max-stop-strings={STOP_STRINGS}",
    f"--max-stop-string-chars={STOP_CHARS}",
    f"--max-stop-token-ids={STOP_TOKEN_IDS}",
    f"--max-logit-bias-tokens={LOGIT_BIAS_TOKENS}",
    f"--max-json-depth={JSON_DEPTH}",
)
STEP_DELAY = 0.01  # the other users' streams of NEW_TOKENS tokens take > 4 s
EARLY_STOP = expected_text("n", NEW_TOKENS)[5:7]  # ends the just-under max_tokens request soon


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    processes = Processes(tmp_path_factory.mktemp("http-limits"))
    try:
        yield start_cluster(processes, *FLAGS, step_delay=STEP_DELAY)
    finally:
        processes.cleanup()


@pytest.fixture
def session_timeout() -> float:
    """Seconds for each HTTP call of the shared ``session`` fixture (conftest)."""
    return 60.0


def padded_body(size: int) -> bytes:
    """A valid completion body of exactly ``size`` bytes (padding in ``user``)."""
    body = {"prompt": "pad", "max_tokens": 2, "user": ""}
    empty = len(json.dumps(body).encode())
    return json.dumps({**body, "user": "u" * (size - empty)}).encode()


# What the byte tokenizer's chat template adds around one user message.
CHAT_TEMPLATE_CHARS = len(
    as_batch_tokenizer(None).apply_chat_template([{"role": "user", "content": ""}])
)


def chat(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2}


# (name, endpoint, body just under the limit, body just over it, the error code, its status)
CASES: list[tuple[str, str, Any, Any, str, int]] = [
    ("body", "/v1/completions", padded_body(BODY_BYTES), padded_body(BODY_BYTES + 1),
     "max_body_bytes", 413),
    ("prompt chars", "/v1/completions", {"prompt": "c" * PROMPT_CHARS, "max_tokens": 2},
     {"prompt": "c" * (PROMPT_CHARS + 1), "max_tokens": 2}, "max_prompt_chars", 400),
    # The limit counts the rendered conversation (the template's characters too).
    ("chat chars", "/v1/chat/completions", chat("c" * (PROMPT_CHARS - CHAT_TEMPLATE_CHARS)),
     chat("c" * (PROMPT_CHARS - CHAT_TEMPLATE_CHARS + 1)), "max_prompt_chars", 400),
    ("prompt tokens", "/v1/completions", {"prompt": [7] * PROMPT_TOKENS, "max_tokens": 2},
     {"prompt": [7] * (PROMPT_TOKENS + 1), "max_tokens": 2}, "max_prompt_tokens", 400),
    ("max_tokens", "/v1/completions", {"prompt": "n", "max_tokens": NEW_TOKENS, "stop": EARLY_STOP},
     {"prompt": "n", "max_tokens": NEW_TOKENS + 1}, "max_new_tokens", 400),
    ("stop strings", "/v1/completions", {"prompt": "s", "max_tokens": 2, "stop": ["1", "2", "3"]},
     {"prompt": "s", "max_tokens": 2, "stop": ["1", "2", "3", "4"]}, "max_stop_strings", 400),
    ("stop chars", "/v1/completions", {"prompt": "s", "max_tokens": 2, "stop": "1" * STOP_CHARS},
     {"prompt": "s", "max_tokens": 2, "stop": "1" * (STOP_CHARS + 1)},
     "max_stop_string_chars", 400),
    ("stop token ids", "/v1/completions",
     {"prompt": "s", "max_tokens": 2, "stop_token_ids": list(range(STOP_TOKEN_IDS))},
     {"prompt": "s", "max_tokens": 2, "stop_token_ids": list(range(STOP_TOKEN_IDS + 1))},
     "max_stop_token_ids", 400),
    ("logit bias", "/v1/completions",
     {"prompt": "s", "max_tokens": 2, "logit_bias": {str(t): 1 for t in range(LOGIT_BIAS_TOKENS)}},
     {"prompt": "s", "max_tokens": 2,
      "logit_bias": {str(t): 1 for t in range(LOGIT_BIAS_TOKENS + 1)}},
     "max_logit_bias_tokens", 400),
    ("json depth", "/v1/chat/completions", chat([{"type": "text", "text": "deep"}]),
     chat([{"type": "text", "text": ["deeper"]}]), "max_json_depth", 400),
]  # fmt: skip


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any, float]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    started = time.monotonic()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as reply:
        payload = await reply.json()
        return reply.status, payload, time.monotonic() - started


async def test_each_limit_just_under_and_just_over_while_streams_run(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    # Other users: streams long enough to outlast every check below.
    others = [{"prompt": f"other user {i}", "max_tokens": NEW_TOKENS, "seed": i} for i in range(4)]
    streams = [asyncio.create_task(stream_text(session, cluster.base_url, b)) for b in others]
    await asyncio.sleep(0.3)  # they are streaming

    for case in CASES:
        await check_limit(session, cluster.base_url, *case)
    await check_streams(streams, others)
    await wait_for_idle(session, cluster.base_url, 10)


async def test_the_coordinators_tighter_message_limit_is_checked_at_the_edge(
    processes: Processes, session: aiohttp.ClientSession
) -> None:
    """A coordinator started with a smaller ``--max-message-bytes`` than the front's would drop
    a larger message (and with it the front's connection): the front learns the limit from
    the coordinator's status and refuses such a request itself."""
    cluster = start_cluster(processes, f"--max-message-bytes={MESSAGE_BYTES}", engines=1)
    others = [{"prompt": "a stream beside", "max_tokens": NEW_TOKENS, "seed": 3}]
    streams = [asyncio.create_task(stream_text(session, cluster.base_url, others[0]))]
    await asyncio.sleep(0.3)
    # 4 bytes per token id on the wire: 1,900 fit 8 KiB with the envelope, 2,100 do not.
    await check_limit(
        session,
        cluster.base_url,
        "message bytes",
        "/v1/completions",
        {"prompt": [7] * 1_900, "max_tokens": 2},
        {"prompt": [7] * 2_100, "max_tokens": 2},
        "max_message_bytes",
        400,
    )
    await check_streams(streams, others)


async def check_limit(
    session: aiohttp.ClientSession,
    base_url: str,
    name: str,
    endpoint: str,
    under: Any,
    over: Any,
    code: str,
    status: int,
) -> None:
    url = f"{base_url}{endpoint}"
    got, payload, _ = await post(session, url, under)
    assert got == 200, (name, payload)
    got, payload, seconds = await post(session, url, over)
    error = error_of(payload)
    assert (got, error["code"]) == (status, code), (name, payload)
    assert code in error["message"], error  # the message names the limit (and its flag)
    assert seconds < 1.0, (name, seconds)


async def check_streams(streams: list[asyncio.Task], bodies: list[dict[str, Any]]) -> None:
    """Still running after the checks, then byte-for-byte what they get alone."""
    assert not any(s.done() for s in streams), "the streams must still run during the checks"
    for body, (text, reason) in zip(bodies, await asyncio.gather(*streams), strict=True):
        assert reason == "length"
        assert text == expected_text(body["prompt"], body["max_tokens"], body["seed"])


async def test_a_body_larger_than_the_limit_is_refused_before_it_is_read(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    """A declared Content-Length over the limit is answered at once, without the body."""
    reader, writer = await asyncio.open_connection(*cluster.base_url[7:].split(":"))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {100 * BODY_BYTES}\r\n\r\n".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert head.startswith(b"HTTP/1.1 413"), head
    finally:
        writer.close()
