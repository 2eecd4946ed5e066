"""Helpers for the HTTP front's integration tests: start ``dpserve coordinator --http-port``
with fake engines, read SSE streams and Prometheus metrics, and know what a fake engine
generates (each token is ``fake_token(prompt tokens, seed, position)``; the byte tokenizer
makes prompt tokens the prompt's UTF-8 bytes)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dpserve.engine.fake import fake_token
from tests.integration.runtime import Processes, free_port
from tests.waiting import wait_until

STEP_DELAY = 0.01  # seconds per fake-engine step: 100 tokens/s per request


def expected_text(prompt: str | list[int], count: int, seed: int | None = None) -> str:
    """What a fake engine generates for this prompt (byte tokenizer)."""
    tokens = list(prompt.encode()) if isinstance(prompt, str) else prompt
    return "".join(chr(fake_token(tokens, seed, position)) for position in range(count))


async def sse_payloads(response: aiohttp.ClientResponse) -> list[str]:
    """Every ``data:`` payload of a server-sent-event stream, in order."""
    payloads = []
    async for line in response.content:
        text = line.decode().rstrip("\r\n")
        if text.startswith("data: "):
            payloads.append(text[len("data: ") :])
        else:
            assert text == "", f"unexpected SSE line {text!r}"
    return payloads


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def metric(text: str, name: str, **labels: str) -> float | None:
    for sample_name, sample_labels, value in metric_samples(text):
        if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items()):
            return value
    return None


def children_of(pid: int) -> dict[int, str]:
    """Live child processes of ``pid`` (from /proc) and their command lines."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # it exited while we looked
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            children[int(entry.name)] = cmdline
    return children


def http_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def ready_is(base_url: str, status_code: int, engines: int | None = None) -> Callable[[], bool]:
    def check() -> bool:
        try:
            code, body = http_json(f"{base_url}/ready")
        except (OSError, ValueError):
            return False  # not listening yet
        return code == status_code and (engines is None or body.get("engines") == engines)

    return check


@dataclass
class Cluster:
    base_url: str
    zmq_port: int
    coordinator: subprocess.Popen
    processes: Processes


def start_front(processes: Processes, *flags: str) -> tuple[subprocess.Popen, int, str]:
    """``dpserve coordinator --http-port`` with ``flags``; returns it, its ZMQ port, its URL."""
    zmq_port, http_port = free_port(), free_port()
    coordinator = processes.coordinator(zmq_port, "--http-port", str(http_port), *flags)
    base_url = f"http://127.0.0.1:{http_port}"
    wait_until(lambda: _livez_ok(base_url, coordinator), 60, "the HTTP front to listen")
    return coordinator, zmq_port, base_url


def _livez_ok(base_url: str, coordinator: subprocess.Popen) -> bool:
    if coordinator.poll() is not None:
        raise AssertionError(f"the coordinator exited with code {coordinator.returncode}")
    try:
        return http_json(f"{base_url}/livez")[0] == 200
    except (OSError, ValueError):
        return False


def start_engines(
    processes: Processes, zmq_port: int, count: int, step_delay: float = STEP_DELAY
) -> None:
    for rank in range(count):
        processes.fake_engine(zmq_port, rank, "--step-delay", str(step_delay))


def start_cluster(
    processes: Processes, *flags: str, engines: int = 2, step_delay: float = STEP_DELAY
) -> Cluster:
    """A front started with ``flags`` and ``engines`` fake engines, ready to serve."""
    coordinator, zmq_port, base_url = start_front(processes, *flags)
    start_engines(processes, zmq_port, engines, step_delay)
    wait_until(ready_is(base_url, 200, engines=engines), 60, f"{engines} engines")
    return Cluster(base_url, zmq_port, coordinator, processes)


async def stream_text(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, Any]
) -> tuple[str, str]:
    """Run a streamed completion; return its concatenated text and finish reason."""
    async with session.post(f"{base_url}/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status == 200, await reply.text()
        payloads = await sse_payloads(reply)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert not any("error" in c for c in chunks), chunks[-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return text, chunks[-1]["choices"][0]["finish_reason"]


def error_of(body: Any) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-style error body (asserting the shape)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


async def wait_for_idle(session: aiohttp.ClientSession, base_url: str, within: float) -> str:
    """Poll /metrics until the coordinator holds no request; return the last scrape."""
    deadline = time.monotonic() + within
    while True:
        async with session.get(f"{base_url}/metrics") as response:
            text = await response.text()
        if metric(text, "dpserve_coordinator_inflight_requests") == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still in flight:\n{text}")
        await asyncio.sleep(0.1)
