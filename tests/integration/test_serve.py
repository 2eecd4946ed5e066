"""``dpserve serve`` end to end: start, answer ``dpserve generate`` and HTTP, stop cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.runtime import DPSERVE, free_port, wait_for_banner

pytestmark = pytest.mark.timeout(300)


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc (children of children included)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the thread (or its process) ended after the listing
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def http_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def sse_events(url: str, body: dict) -> list[str]:
    request = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = response.read().decode().splitlines()
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("mode", ["fake", "tiny-model"])
def test_serve_answers_generate_and_http_then_stops_cleanly(
    mode: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    port, http_port = free_port(), free_port()
    model = (
        ["--fake"]
        if mode == "fake"
        else ["--model", str(request.getfixturevalue("tiny_model_path"))]
    )
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            [
                DPSERVE,
                "serve",
                "--data-parallel-size",
                "2",
                "--port",
                str(port),
                "--http-port",
                str(http_port),
                *model,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        banner = wait_for_banner(serve, log, within=180)
        assert f"tcp://127.0.0.1:{port}" in banner and "2/2 engine(s) registered" in banner
        children = descendants(serve.pid)
        assert len(children) >= 3, "a coordinator and two engines"

        def generate(*flags: str) -> str:
            result = subprocess.run(
                [DPSERVE, "generate", "Hello there", "--address", f"127.0.0.1:{port}",
                 "--max-tokens", "8", *flags],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            assert result.stdout.strip(), "generate must print the completion"
            return result.stdout

        generated = generate()
        generate("--stream", "--chat")

        base = f"http://127.0.0.1:{http_port}"
        completion = http_json(f"{base}/v1/completions", {"prompt": "Hello there", "max_tokens": 8})
        assert completion["usage"]["completion_tokens"] > 0
        assert completion["choices"][0]["text"]
        if mode == "fake":
            assert completion["choices"][0]["text"] == generated.rstrip("\n")
        events = sse_events(
            f"{base}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )
        assert events[-1] == "[DONE]"
        content = "".join(
            json.loads(e)["choices"][0]["delta"].get("content", "")
            for e in events[:-1]
            if json.loads(e).get("choices")
        )
        assert content

        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "no process may outlive dpserve serve"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_an_http_port_in_use_is_refused_before_anything_starts() -> None:
    """The HTTP port is bound first: one in use ends ``dpserve serve`` at once with a message
    naming it, before any engine or coordinator starts (the port would otherwise be bound only
    once the engines serve, and could be taken meanwhile)."""
    import socket

    http_port, port = free_port(), free_port()
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", http_port))
        taken.listen()
        result = subprocess.run(
            [DPSERVE, "serve", "--fake", "--port", str(port), "--http-port", str(http_port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"cannot serve HTTP on 127.0.0.1:{http_port}" in result.stderr
    assert "Address already in use" in result.stderr
    assert "registered" not in result.stderr  # no engine started


def test_children_never_import_from_the_directory_serve_was_started_in(tmp_path: Path) -> None:
    """``dpserve serve`` started in a directory with modules of its own (this repository's root
    has ``operator/``, which shadows the standard library's): its children import what is
    installed, and processes they start do not inherit that directory on their path (there,
    vLLM's sampler compiled kernels without their instruction set and its worker died)."""
    shadow = tmp_path / "dpserve"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise SystemExit('imported from the working directory')\n")
    port, http_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            [DPSERVE, "serve", "--fake", "--port", str(port), "--http-port", str(http_port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        banner = wait_for_banner(serve, log, within=60)
        assert "imported from the working directory" not in banner
        completion = http_json(
            f"http://127.0.0.1:{http_port}/v1/completions", {"prompt": "Hi", "max_tokens": 4}
        )
        assert completion["choices"][0]["text"]
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(60)
