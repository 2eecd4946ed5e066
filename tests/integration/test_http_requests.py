"""Issue 9, items 5, 10 and 12 through HTTP against real processes: text that cannot be
encoded, deep JSON, wrong types and unknown fields are 400s in OpenAI's error shape (never a
500 or a stuck request); what benchmark clients send is honoured or refused by name; log-prob
token strings concatenate to the returned text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dpserve.openai.logprobs import token_pieces
from dpserve.openai.requests import parse_completion_request
from dpserve.tokenizer import ByteTokenizer
from tests.integration.http_support import (
    Cluster,
    error_of,
    expected_text,
    ready_is,
    sse_payloads,
    start_cluster,
    start_front,
    wait_for_idle,
)
from tests.integration.runtime import Processes
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    processes = Processes(tmp_path_factory.mktemp("http-requests"))
    try:
        yield start_cluster(processes, step_delay=0.001)
    finally:
        processes.cleanup()


async def post_raw(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, Any]:
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as reply:
        return reply.status, await reply.json()


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


# ------------------------------------------------------------ item 5: refused at the edge

# json.dumps writes a lone surrogate as the escape "\ud800", which json.loads accepts.
LONE_SURROGATE_BODIES = [
    (COMPLETIONS, {"prompt": "ok \ud800", "max_tokens": 3}, "prompt"),
    (COMPLETIONS, {"prompt": "ok", "max_tokens": 3, "stop": ["\udfff"]}, "stop"),
    (CHAT, chat("hi \ud83d"), "messages"),
    (COMPLETIONS, {"prompt": "ok", "max_tokens": 3, "user": "\ud800"}, "user"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), LONE_SURROGATE_BODIES)
async def test_text_that_cannot_be_encoded_is_a_400_and_leaves_nothing_pending(
    cluster: Cluster, session: aiohttp.ClientSession, endpoint: str, body: dict, param: str
) -> None:
    for stream in (False, True):
        data = json.dumps({**body, "stream": stream}).encode()
        status, payload = await post_raw(session, f"{cluster.base_url}{endpoint}", data)
        error = error_of(payload)
        assert (status, error["code"], error["param"]) == (400, "invalid_unicode", param)
    scrape = await wait_for_idle(session, cluster.base_url, 5)
    assert "dpserve_http_inflight_requests 0.0" in scrape
    async with session.post(
        f"{cluster.base_url}{COMPLETIONS}", json={"prompt": "after", "max_tokens": 4}
    ) as reply:
        assert (await reply.json())["choices"][0]["text"] == expected_text("after", 4)


@pytest.mark.parametrize("opening", ["[", '{"a":'])
async def test_deeply_nested_json_is_a_400(
    cluster: Cluster, session: aiohttp.ClientSession, opening: str
) -> None:
    closing = "]" if opening == "[" else "}"
    for depth in (65, 50_000):  # just over the default limit, and past Python's recursion limit
        inner = opening * depth + "1" + closing * depth
        data = ('{"prompt": "x", "metadata": ' + inner + "}").encode()
        status, payload = await post_raw(session, f"{cluster.base_url}{COMPLETIONS}", data)
        assert (status, error_of(payload)["code"]) == (400, "max_json_depth")


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "code"),
    [
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature", None),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream", None),
        (COMPLETIONS, {"prompt": {"text": "x"}}, "prompt", None),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, "max_tokens", None),
        (COMPLETIONS, {"prompt": "x", "ignore_eos": 1}, "ignore_eos", None),
        (COMPLETIONS, {"prompt": "x", "min_tokens": "3"}, "min_tokens", None),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", None),
        (COMPLETIONS, {"prompt": "x", "user": 7}, "user", None),
        (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p", None),
        (COMPLETIONS, {"prompt": "x", "min_p": "low"}, "min_p", None),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": 5}, "stop_token_ids", None),
        (CHAT, chat("x", stop_token_ids=[1, -2]), "stop_token_ids", None),
        (CHAT, chat("x", stop_token_ids=[2**40]), "stop_token_ids", None),
        (
            COMPLETIONS,
            {"prompt": "x", "stop_token_ids": list(range(65))},
            "stop_token_ids",
            "max_stop_token_ids",
        ),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", None),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias", None),
        (CHAT, chat("x", logit_bias={"5": 101}), "logit_bias", None),
        (CHAT, chat("x", logit_bias={"5": "1"}), "logit_bias", None),
        (CHAT, chat("x", logit_bias={"5": 1, "05": 2}), "logit_bias", None),
        (CHAT, chat("x", logit_bias=[5]), "logit_bias", None),
        (
            COMPLETIONS,
            {"prompt": "x", "logit_bias": {str(t): 1 for t in range(301)}},
            "logit_bias",
            "max_logit_bias_tokens",
        ),
        (CHAT, {"messages": "hi"}, "messages", None),
        (CHAT, chat("x", top_logprobs=21, logprobs=True), "top_logprobs", "max_top_logprobs"),
        (CHAT, chat("x", top_logprobs=2), "top_logprobs", None),
        (COMPLETIONS, {"prompt": "x", "frobnicate": True}, "frobnicate", "unknown_field"),
        (COMPLETIONS, {"prompt": "x", "guided_json": {"type": 5}}, "guided_json", None),
        (COMPLETIONS, {"prompt": "x", "guided_regex": "(x"}, "guided_regex", None),
        (COMPLETIONS, {"prompt": "x", "guided_choice": []}, "guided_choice", None),
        (
            CHAT,
            chat("x", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema",
            None,
        ),
        (
            COMPLETIONS,
            {"prompt": "x", "response_format": {"type": "xml"}},
            "response_format.type",
            None,
        ),
        (CHAT, chat("x", prompt="not here"), "prompt", "unknown_field"),
        (COMPLETIONS, {"prompt": "x", "messages": []}, "messages", "unknown_field"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", None),
        (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", None),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs", "max_top_logprobs"),
        (COMPLETIONS, {"prompt": "x", "n": 3, "best_of": 2}, "best_of", None),
        (COMPLETIONS, {"prompt": ["x"] * 257}, "prompt", "max_prompts"),
        (COMPLETIONS, {"prompt": ["x"] * 40, "n": 16}, "n", "max_request_sequences"),
        (
            COMPLETIONS,
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
            "stream_options.x",
            "unknown_field",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]},
            "messages[0].audio",
            "unsupported_field",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x", "name": 7}]},
            "messages[0].name",
            None,
        ),
        (
            CHAT,
            chat("x", tools=[{"type": "function", "function": {"name": "f"}}]),
            "tool_choice",
            "unsupported_field",  # auto, OpenAI's default, needs --tool-call-parser
        ),
        (CHAT, chat("x", tools=[{"type": "function"}]), "tools[0].function", None),
    ],
)
async def test_wrong_types_and_unknown_fields_are_400_naming_the_field(
    cluster: Cluster,
    session: aiohttp.ClientSession,
    endpoint: str,
    body: dict,
    param: str,
    code: str | None,
) -> None:
    async with session.post(f"{cluster.base_url}{endpoint}", json=body) as reply:
        status, error = reply.status, error_of(await reply.json())
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param)
    if code is not None:
        assert error["code"] == code


# ---------------------------------------------------- item 12: what benchmark clients send


async def test_a_benchmark_clients_body_is_honoured(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    """What vLLM's and similar benchmark clients send, every field known."""
    prompt, max_tokens = "benchmark me", 12
    body = {
        "model": "whatever",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "ignore_eos": True,
        "min_tokens": max_tokens,
        "best_of": 1,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with session.post(f"{cluster.base_url}{COMPLETIONS}", json=body) as reply:
        assert reply.status == 200, await reply.text()
        payloads = await sse_payloads(reply)
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == expected_text(prompt, max_tokens)
    # continuous_usage_stats: every chunk carries the usage so far.
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == len(prompt) for u in usages), usages
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == max_tokens
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == []  # include_usage's final chunk is still there


async def test_stop_token_ids_min_p_and_included_stop_strings_are_honoured(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    """Through the front, coordinator and a (fake) engine: a stop token id ends the choice with
    "stop" and counts as generated, not as text; min_p reaches the engine (the fake engine
    does not sample: tests/unit/test_sampler.py checks what it does); a stop string asked to
    stay in the text does."""
    prompt = "stop me"
    expected = expected_text(prompt, 12)
    stop_at = 5
    body = {"prompt": prompt, "max_tokens": 12, "stop_token_ids": [ord(expected[stop_at])]}
    async with session.post(f"{cluster.base_url}{COMPLETIONS}", json=body) as reply:
        assert reply.status == 200, await reply.text()
        result = await reply.json()
    first = expected.index(expected[stop_at])
    assert result["choices"][0]["text"] == expected[:first]
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == first + 1
    body = {"prompt": prompt, "max_tokens": 12, "min_p": 1.0, "temperature": 1.0}
    async with session.post(f"{cluster.base_url}{COMPLETIONS}", json=body) as reply:
        assert reply.status == 200, await reply.text()
        assert (await reply.json())["choices"][0]["finish_reason"] == "length"
    # include_stop_str_in_output: the stop string stays, streamed or not.
    stop = expected[4:6]
    end = expected.index(stop) + len(stop)
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 12, "stop": stop, "stream": stream}
        body["include_stop_str_in_output"] = True
        async with session.post(f"{cluster.base_url}{COMPLETIONS}", json=body) as reply:
            assert reply.status == 200, await reply.text()
            if stream:
                chunks = [json.loads(p) for p in (await sse_payloads(reply))[:-1]]
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            else:
                text = (await reply.json())["choices"][0]["text"]
        assert text == expected[:end]


def test_ignore_eos_and_min_tokens_reach_sampling_params() -> None:
    body = {"prompt": "p", "max_tokens": 8, "ignore_eos": True, "min_tokens": 5}
    params = parse_completion_request(body).params
    assert (params.ignore_eos, params.min_tokens, params.num_tokens_to_generate) == (True, 5, 8)
    assert not parse_completion_request({"prompt": "p"}).params.ignore_eos
    body = {"prompt": "p", "min_p": 0.1, "stop_token_ids": [3, 4], "logit_bias": {"7": -100}}
    params = parse_completion_request(body).params
    assert (params.min_p, params.stop_token_ids) == (0.1, (3, 4))
    assert params.logit_bias == ((7, -100.0),)


# -------------------------------------------------------------- item 10: logprob strings


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
async def test_logprob_tokens_concatenate_to_the_text(
    cluster: Cluster, session: aiohttp.ClientSession, endpoint: str
) -> None:
    body = (
        {"prompt": "log me", "max_tokens": 20, "logprobs": 0}
        if endpoint == COMPLETIONS
        else chat("log me", max_tokens=20, logprobs=True)
    )
    async with session.post(f"{cluster.base_url}{endpoint}", json=body) as reply:
        assert reply.status == 200
        result = await reply.json()
    text, tokens = completion_text_and_tokens(result)
    assert len(tokens) == 20 and "".join(tokens) == text


def completion_text_and_tokens(result: dict[str, Any]) -> tuple[str, list[str]]:
    [choice] = result["choices"]
    if "text" in choice:
        return choice["text"], choice["logprobs"]["tokens"]
    entries = choice["logprobs"]["content"]
    assert all(bytes(e["bytes"]) == e["token"].encode() for e in entries)
    return choice["message"]["content"], [e["token"] for e in entries]


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 😀 and 🎉!", "a€b"])
def test_token_pieces_of_multibyte_text_concatenate_to_it(text: str) -> None:
    tokenizer = ByteTokenizer()  # one token per byte: every multi-byte character is split
    tokens = list(text.encode())
    pieces = token_pieces(tokenizer, tokens, text)
    assert len(pieces) == len(tokens) and "".join(pieces) == text
    assert "" in pieces or text.isascii()  # a token inside a character adds nothing yet
    # A stop string cut the text inside the last token: the pieces follow the text.
    assert "".join(token_pieces(tokenizer, tokens, text[:-1])) == text[:-1]


@pytest.mark.slow
async def test_logprob_tokens_of_a_real_tokenizer_concatenate_to_the_text(
    processes: Processes, tiny_model_path: Path, session: aiohttp.ClientSession
) -> None:
    """A real engine with a byte-level BPE tokenizer (random weights: it samples byte tokens
    that split multi-byte characters) through ``coordinator --http-port``."""
    model = str(tiny_model_path)
    _, zmq_port, base_url = start_front(processes, "--tokenizer", model)
    processes.spawn(
        "engine-0", "engine", "--coordinator", str(zmq_port), "--rank", "0", "--model", model
    )
    wait_until(ready_is(base_url, 200, engines=1), 120, "the tiny model's engine")
    non_ascii = 0
    for seed in range(6):
        for endpoint in (COMPLETIONS, CHAT):
            body: dict[str, Any] = {"max_tokens": 48, "temperature": 1.0, "seed": seed}
            if endpoint == COMPLETIONS:
                body.update(prompt="The quick brown fox", logprobs=0)
            else:
                body.update(chat("The quick brown fox", logprobs=True))
                body["max_tokens"] = 48
            async with session.post(f"{base_url}{endpoint}", json=body) as reply:
                assert reply.status == 200, await reply.text()
                text, tokens = completion_text_and_tokens(await reply.json())
            assert "".join(tokens) == text
            non_ascii += not text.isascii()
    assert non_ascii, "no sample held a non-ASCII character: the check proved nothing"
