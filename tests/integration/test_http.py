"""The OpenAI-compatible HTTP front against real processes on 127.0.0.1.

``dpserve coordinator --http-port`` (the coordinator in a spawned child, the HTTP front in the
main process) and fake engines run as subprocesses. Fake engines make results checkable: each
token is ``fake_token(prompt tokens, seed, position)``, and the byte tokenizer makes prompt
tokens the prompt's UTF-8 bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from dpserve.client import InferenceClient
from dpserve.limits import DEFAULT_REQUEST_LIMITS, HttpLimits
from dpserve.openai import create_app
from dpserve.openai.errors import InvalidRequest, failure_status
from dpserve.openai.guided import check_constraint
from dpserve.openai.health import readiness
from dpserve.openai.logprobs import token_logprob_pairs
from dpserve.openai.metrics import TokenRate
from dpserve.openai.prompts import parse_prompt
from dpserve.openai.requests import parse_chat_request, parse_completion_request
from dpserve.openai.server import FrontConfig, run_http_front
from dpserve.tokenizer import ByteTokenizer
from tests.integration.http_support import (
    Cluster,
    children_of,
    expected_text,
    http_json,
    metric,
    metric_samples,
    ready_is,
    sse_payloads,
    start_cluster,
    start_engines,
    start_front,
    wait_for_idle,
)
from tests.integration.runtime import Processes, free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)

MODEL_NAME = "dpserve"  # what the front reports without --tokenizer


# ------------------------------------------------------------------ helpers


def is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """``dpserve coordinator --http-port`` with two fake engines, shared by this module."""
    processes = Processes(tmp_path_factory.mktemp("http-cluster"))
    try:
        yield start_cluster(processes)
    finally:
        processes.cleanup()


# ---------------------------------------------------------------- completions


@pytest.mark.parametrize("seed", [None, 7])
async def test_completion_matches_the_engine_and_counts_usage(
    cluster: Cluster, session: aiohttp.ClientSession, seed: int | None
) -> None:
    prompt = "héllo wörld"  # non-ASCII: prompt tokens are UTF-8 bytes, not characters
    body = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "model": "any-name"}
    if seed is not None:
        body["seed"] = seed
    async with session.post(f"{cluster.base_url}/v1/completions", json=body) as response:
        assert response.status == 200
        result = await response.json()

    assert result["object"] == "text_completion"
    assert result["id"].startswith("cmpl-")
    assert result["model"] == MODEL_NAME  # any model name is accepted; the served one answers
    assert abs(result["created"] - time.time()) < 60
    [choice] = result["choices"]
    assert choice == {
        "index": 0,
        "text": expected_text(prompt, 9, seed),
        "finish_reason": "length",
        "logprobs": None,
    }
    prompt_tokens = len(prompt.encode())
    assert prompt_tokens == 13
    assert result["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 9,
        "total_tokens": prompt_tokens + 9,
        # The fake engines simulate a prefix cache: nothing was cached for these prompts.
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_token_id_prompt(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    prompt = [104, 105, 33, 200]
    async with session.post(
        f"{cluster.base_url}/v1/completions", json={"prompt": [prompt], "max_tokens": 4}
    ) as response:
        assert response.status == 200
        result = await response.json()
    assert result["choices"][0]["text"] == expected_text(prompt, 4)
    assert result["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_stream_concatenates_to_the_full_text(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    prompt, max_tokens = "stream me", 40
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(f"{cluster.base_url}/v1/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        payloads = await sse_payloads(response)

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *text_chunks, final, usage_chunk = chunks
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    texts = [c["choices"][0]["text"] for c in text_chunks]
    # 40 tokens at 10 ms per step and a 50 ms stream interval arrive in several pieces.
    assert len([t for t in texts if t]) >= 2, texts
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks)
    assert "".join(texts) == expected_text(prompt, max_tokens)
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": max_tokens,
        "total_tokens": len(prompt) + max_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_stop_string_ends_the_completion(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    prompt = "stop somewhere"
    full = expected_text(prompt, 30)
    stop = full[10:12]
    stops_at = full.find(stop)  # like OpenAI, the stop string itself is not returned
    async with session.post(
        f"{cluster.base_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 30, "stop": [stop, "never-generated"]},
    ) as response:
        assert response.status == 200
        result = await response.json()
    [choice] = result["choices"]
    assert choice["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == stops_at
    assert choice["text"] == full[:stops_at]


async def test_logprobs(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    prompt = "with logprobs"
    async with session.post(
        f"{cluster.base_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 5, "logprobs": 0},
    ) as response:
        assert response.status == 200
        result = await response.json()
    [choice] = result["choices"]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] == expected_text(prompt, 5)
    assert logprobs["token_logprobs"] == [-1.0] * 5  # the fake engine's constant
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------- chat


async def test_chat_completion(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    rendered = ByteTokenizer().apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    async with session.post(
        f"{cluster.base_url}/v1/chat/completions",
        json={"messages": messages, "max_completion_tokens": 6},
    ) as response:
        assert response.status == 200
        result = await response.json()

    assert result["object"] == "chat.completion"
    assert result["id"].startswith("chatcmpl-")
    [choice] = result["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected_text(rendered, 6)}
    assert choice["finish_reason"] == "length"
    assert result["usage"] == {
        "prompt_tokens": len(rendered.encode()),
        "completion_tokens": 6,
        "total_tokens": len(rendered.encode()) + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_stream(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": "tell me a long story"}]
    rendered = ByteTokenizer().apply_chat_template(messages)
    async with session.post(
        f"{cluster.base_url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 30, "stream": True},
    ) as response:
        assert response.status == 200
        payloads = await sse_payloads(response)

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    first, *content_chunks, final = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in content_chunks]
    assert all(set(d) == {"content"} for d in deltas), deltas
    assert "".join(d["content"] for d in deltas) == expected_text(rendered, 30)
    assert final["choices"][0] == {
        "index": 0,
        "delta": {},
        "finish_reason": "length",
        "logprobs": None,
    }


# ------------------------------------------------------- models, health, metrics


async def test_models(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{cluster.base_url}/v1/models") as response:
        assert response.status == 200
        result = await response.json()
    assert result["object"] == "list"
    assert [m["id"] for m in result["data"]] == [MODEL_NAME]
    assert result["data"][0]["object"] == "model"


async def test_ready_reports_the_engines(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{cluster.base_url}/ready") as response:
        assert response.status == 200
        body = await response.json()
    assert body == {"status": "ready", "engines": 2, "draining": 0, "queued": 0, "state": "running"}
    for live in ("/health", "/livez"):
        async with session.get(f"{cluster.base_url}{live}") as response:
            assert (response.status, await response.json()) == (200, {"status": "alive"})


async def test_metrics(cluster: Cluster, session: aiohttp.ClientSession) -> None:
    before = await wait_for_idle(session, cluster.base_url, 10)
    labels = {"endpoint": "/v1/completions", "outcome": "success"}
    successes_before = metric(before, "dpserve_http_requests_total", **labels) or 0
    tokens_before = metric(before, "dpserve_generated_tokens_total") or 0

    # While a stream runs, the per-engine gauges (refreshed on each scrape) show it.
    body = {"prompt": "metrics", "max_tokens": 150, "stream": True}
    async with session.post(f"{cluster.base_url}/v1/completions", json=body) as response:
        assert response.status == 200
        await response.content.readline()  # the first chunk: it is running
        async with session.get(f"{cluster.base_url}/metrics") as scrape:
            during = await scrape.text()
        await sse_payloads(response)
    per_engine = {
        sample_labels["rank"]: value
        for name, sample_labels, value in metric_samples(during)
        if name == "dpserve_engine_inflight_requests"
    }
    assert set(per_engine) == {"0", "1"}
    assert sum(per_engine.values()) == 1
    assert metric(during, "dpserve_http_inflight_requests") == 1

    async with session.get(f"{cluster.base_url}/metrics") as scrape:
        assert scrape.status == 200
        assert scrape.headers["Content-Type"].startswith("text/plain")
        after = await scrape.text()
    assert metric(after, "dpserve_http_requests_total", **labels) == successes_before + 1
    assert metric(after, "dpserve_generated_tokens_total") == tokens_before + 150
    assert metric(after, "dpserve_coordinator_up") == 1
    assert metric(after, "dpserve_registered_engines") == 2
    assert metric(after, "dpserve_queued_requests") == 0
    assert metric(after, "dpserve_http_inflight_requests") == 0
    endpoint = {"endpoint": "/v1/completions"}
    assert (metric(after, "dpserve_time_to_first_token_seconds_count", **endpoint) or 0) >= 1
    assert (metric(after, "dpserve_request_latency_seconds_count", **endpoint) or 0) >= 1
    assert (metric(after, "dpserve_generated_tokens_per_second") or 0) > 0


# --------------------------------------------------------------------- errors


async def test_invalid_json_is_an_openai_error(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    async with session.post(
        f"{cluster.base_url}/v1/completions",
        data=b'{"prompt": "unterminated',
        headers={"Content-Type": "application/json"},
    ) as response:
        assert response.status == 400
        body = await response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in body["error"]["message"]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": ["one", 5]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stream": True, "best_of": 2}, "best_of"),
        ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ],
)
async def test_invalid_parameters_are_400(
    cluster: Cluster,
    session: aiohttp.ClientSession,
    endpoint: str,
    body: dict[str, Any],
    param: str,
) -> None:
    async with session.post(f"{cluster.base_url}{endpoint}", json=body) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_rejection_maps_to_400(
    cluster: Cluster, session: aiohttp.ClientSession, stream: bool
) -> None:
    # The fake engine's context is 8192 tokens; the byte tokenizer makes this 9000.
    body = {"prompt": "a" * 9000, "max_tokens": 4, "stream": stream}
    async with session.post(f"{cluster.base_url}/v1/completions", json=body) as response:
        # Streaming waits for the first event before sending headers: still a real status.
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["code"] == "prompt_too_long"
    assert error["param"] == "prompt"
    assert "9000" in error["message"] and "8192" in error["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_request(
    cluster: Cluster, session: aiohttp.ClientSession, stream: bool
) -> None:
    before = await wait_for_idle(session, cluster.base_url, 10)
    cancelled = {"endpoint": "/v1/completions", "outcome": "cancelled"}
    cancelled_before = metric(before, "dpserve_http_requests_total", **cancelled) or 0

    # 5000 tokens take 50 s: only a cancellation ends it within the test's few seconds.
    body = {"prompt": "never mind", "max_tokens": 5000, "stream": stream}
    async with aiohttp.ClientSession() as leaving:
        if stream:
            response = await leaving.post(f"{cluster.base_url}/v1/completions", json=body)
            assert response.status == 200
            assert (await response.content.readline()).startswith(b"data: ")
            response.close()  # drop the connection mid-stream
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    leaving.post(f"{cluster.base_url}/v1/completions", json=body), 1.0
                )
    after = await wait_for_idle(session, cluster.base_url, 10)
    assert metric(after, "dpserve_http_requests_total", **cancelled) == cancelled_before + 1
    assert metric(after, "dpserve_http_inflight_requests") == 0


async def test_request_timeout(cluster: Cluster) -> None:
    """An app with a short request timeout: 504 before the first token is sent, an SSE error
    event after; either way the request is cancelled on its engine."""
    client = InferenceClient(cluster.zmq_port, handshake_timeout=20)
    await client.start()
    try:
        app = create_app(
            client, ByteTokenizer(), "short-fuse", http_limits=HttpLimits(request_timeout=0.5)
        )
        async with TestClient(TestServer(app)) as http:
            body = {"prompt": "slow", "max_tokens": 5000}
            response = await http.post("/v1/completions", json=body)
            assert response.status == 504
            error = (await response.json())["error"]
            assert error["code"] == "timeout"
            assert error["type"] == "timeout_error"

            started = time.monotonic()
            response = await http.post("/v1/completions", json={**body, "stream": True})
            assert response.status == 200
            payloads = await sse_payloads(response)
            assert time.monotonic() - started < 5
            assert payloads[-1] == "[DONE]"
            assert json.loads(payloads[-2])["error"]["code"] == "timeout"
            assert all("choices" in json.loads(p) for p in payloads[:-2])

        deadline = time.monotonic() + 10
        while (status := await asyncio.wait_for(client.get_status(), 5))["inflight"]:
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.1)
    finally:
        client.stop()


# ------------------------------------------------------------- other entry points


async def test_run_http_front_serves_until_stopped(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    port = free_port()
    stop = asyncio.Event()
    front = FrontConfig(f"tcp://127.0.0.1:{cluster.zmq_port}", None, "127.0.0.1", port, "front-2")
    task = asyncio.create_task(run_http_front(front, stop))
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert not task.done(), task
            with contextlib.suppress(aiohttp.ClientConnectionError):
                async with session.get(f"{base_url}/ready") as response:
                    if response.status == 200:
                        break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        async with session.get(f"{base_url}/v1/models") as response:
            assert [m["id"] for m in (await response.json())["data"]] == ["front-2"]
        async with session.post(
            f"{base_url}/v1/completions", json={"prompt": "second front", "max_tokens": 3}
        ) as response:
            assert (await response.json())["choices"][0]["text"] == expected_text("second front", 3)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    with pytest.raises(aiohttp.ClientConnectionError):
        async with session.get(f"{base_url}/livez"):
            pass


# ------------------------------------------------------------------- lifecycle


def test_ready_follows_engines_and_sigterm_leaves_no_process(tmp_path: Path) -> None:
    processes = Processes(tmp_path)
    try:
        coordinator, zmq_port, base_url = start_front(processes)

        code, body = http_json(f"{base_url}/ready")
        assert (code, body["status"], body["engines"]) == (503, "no_engines", 0)
        assert http_json(f"{base_url}/health") == (200, {"status": "alive"})

        start_engines(processes, zmq_port, 2)
        wait_until(ready_is(base_url, 200, engines=2), 60, "two engines")

        children = children_of(coordinator.pid)
        [child] = [pid for pid, cmd in children.items() if "spawn_main" in cmd]

        # A coordinator that does not answer makes the front unready, not hung.
        os.kill(child, signal.SIGSTOP)
        try:
            started = time.monotonic()
            code, body = http_json(f"{base_url}/ready", timeout=10)
            assert (code, body["status"]) == (503, "coordinator_unavailable")
            assert http_json(f"{base_url}/health", timeout=1) == (200, {"status": "alive"})
            assert time.monotonic() - started < 5
        finally:
            os.kill(child, signal.SIGCONT)
        wait_until(ready_is(base_url, 200, engines=2), 30, "the coordinator to answer again")

        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(30) == 0
        wait_until(lambda: not any(is_running(pid) for pid in children), 10, "the children to exit")
    finally:
        processes.cleanup()


# ------------------------------------------------- pure helpers (no processes)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("x", "x"), (["x"], "x"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2]), ([0], [0])],
)
def test_parse_prompt_accepts_one_prompt(prompt: Any, expected: str | list[int]) -> None:
    assert parse_prompt(prompt) == expected


@pytest.mark.parametrize(
    ("prompt", "message_part"),
    [
        (None, "required"),
        ("", "empty"),
        ([], "empty"),
        (["a", "b"], "one prompt, got 2"),
        ([[1], [2]], "one prompt, got 2"),
        ([1, "a"], "token ids"),
        ([-1], "token ids"),
        ([2**31], "token ids"),
        ([True], "token ids"),
        (5, "got number"),
    ],
)
def test_parse_prompt_rejects(prompt: Any, message_part: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_prompt(prompt)
    assert caught.value.param == "prompt"
    assert message_part in caught.value.message


def test_completion_parameters_map_to_sampling_params() -> None:
    request = parse_completion_request(
        {"prompt": "p", "temperature": 0, "top_k": -1, "top_p": 0.5, "seed": 3, "stop": "."}
    )
    params = request.params
    assert params.num_tokens_to_generate == 16  # OpenAI's default
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (0.0, 0, 0.5, 3)
    assert params.stop_strings == (".",)
    assert not request.stream and not params.return_log_probs


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"echo": "yes"}, "echo"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"best_of": 17}, "best_of"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 2.5}, "temperature"),  # OpenAI's and vLLM's range is [0, 2]
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": "yes"}, "stream"),
        ({"model": 3}, "model"),
    ],
)
def test_unsupported_or_invalid_parameters(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_completion_request({"prompt": "p", **extra})
    assert caught.value.param == param


async def test_an_invalid_schema_is_refused_by_its_check_naming_its_parameter() -> None:
    # The meta-schema check runs off the event loop, after parsing (guided.check_constraint).
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}
    request = parse_completion_request({"prompt": "p", "response_format": schema})
    with pytest.raises(InvalidRequest) as caught:
        await check_constraint(request.params, request.schema_param, DEFAULT_REQUEST_LIMITS)
    assert caught.value.param == "response_format.json_schema.schema"


def test_no_op_values_of_unsupported_parameters_are_accepted() -> None:
    body = {"prompt": "p", "echo": False, "presence_penalty": 0.0, "n": 1, "best_of": 1}
    assert parse_completion_request(body).prompt == "p"


def test_new_fields_reach_sampling_params() -> None:
    request = parse_completion_request(
        {
            "prompt": ["a", [5, 6]],
            "n": 2,
            "best_of": 3,
            "logprobs": 4,
            "echo": True,
            "max_tokens": 0,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "guided_choice": ["x", "y"],
        }
    )
    params = request.params
    assert request.all_prompts == ("a", [5, 6]) and (request.n, request.best_of) == (2, 3)
    assert params.return_log_probs and params.top_logprobs == 4 and params.prompt_logprobs
    assert request.echo and request.drop_generated and params.num_tokens_to_generate == 1
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1)
    assert params.repetition_penalty == 1.2 and params.guided_choice == ("x", "y")
    hidden = parse_completion_request({"prompt": "p", "n": 1, "best_of": 2})
    assert hidden.params.return_log_probs and hidden.hide_logprobs


def test_chat_request_renders_the_template_and_prefers_max_completion_tokens() -> None:
    request = parse_chat_request(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        ByteTokenizer(),
    )
    assert request.prompt == "user: hi\nassistant:"
    assert request.params.num_tokens_to_generate == 5
    assert request.stream and request.params.stream and request.include_usage


def test_chat_request_without_a_generation_prompt_or_continuing_the_final_message() -> None:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    closed = parse_chat_request(
        {"messages": turns, "add_generation_prompt": False}, ByteTokenizer()
    )
    assert closed.prompt == "user: hi\nassistant: Hel"
    body = {"messages": turns, "add_generation_prompt": False, "continue_final_message": True}
    assert parse_chat_request(body, ByteTokenizer()).prompt == "user: hi\nassistant: Hel"
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request({"messages": turns, "continue_final_message": True}, ByteTokenizer())
    assert caught.value.param == "continue_final_message"


def test_token_logprob_pairs_align_to_the_end() -> None:
    assert token_logprob_pairs(["a", "b", "c"], [-1.0, -2.0]) == [
        ("a", None),
        ("b", -1.0),
        ("c", -2.0),
    ]
    assert token_logprob_pairs(["a"], [-1.0]) == [("a", -1.0)]
    assert token_logprob_pairs([], [-1.0]) == []


def test_readiness() -> None:
    assert readiness(None)[0] == 503
    assert readiness(None)[1]["status"] == "coordinator_unavailable"
    status = {"engines": 0, "draining": 0, "queued": 4, "state": "running"}
    assert readiness(status)[1] == {
        "status": "no_engines",
        "reason": "no engine is registered",
        **status,
    }
    assert readiness({**status, "engines": 1}) == (200, {"status": "ready", **status, "engines": 1})
    assert readiness({**status, "engines": 2, "draining": 2})[1]["status"] == "draining"
    for state in ("paused", "suspended", "stopped"):
        assert readiness({**status, "engines": 1, "state": state})[:1] == (503,)
        assert readiness({**status, "engines": 1, "state": state})[1]["status"] == state


def test_failure_status_mapping() -> None:
    assert [failure_status(c) for c in ("prompt_too_long", "bad_request")] == [400, 400]
    assert [failure_status(c) for c in ("no_engine", "overloaded", "stopped")] == [503] * 3
    assert failure_status("engine_error") == 502
    assert failure_status("bad_message") == 500


def test_token_rate_forgets_old_tokens() -> None:
    rate = TokenRate(window=10.0)
    start = time.monotonic()
    rate.add(100, now=start + 20)
    assert rate.per_second(now=start + 20) == pytest.approx(10.0)
    assert rate.per_second(now=start + 31) == 0
