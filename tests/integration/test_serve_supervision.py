"""``dpserve serve`` survives its children (issue 35): an engine that dies is started again with
its rank while the other serves and the dead one's streams move on unchanged; a rank that keeps
dying is left down; one that cannot start (it dies before it ever registered) is left down at
once; with no engine left, serve exits with an error; Ctrl-C during a restart's backoff still
stops everything."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from dpserve.client import InferenceClient
from tests.integration.runtime import DPSERVE, free_port, wait_for_banner
from tests.integration.test_serve import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEP_DELAY = 0.02  # seconds per fake step: 250 tokens take ~5 s, long enough to kill mid-way
MAX_TOKENS = 250
PROMPTS = [f"supervised stream {i}" for i in range(16)]
CRASH_EXIT_CODE = 3
READY = {"status": "ready", "draining": 0, "queued": 0, "state": "running"}

# Loaded by every Python process the test's serve starts (PYTHONPATH): an engine whose rank the
# file lists when it starts exits at once, as one whose model cannot load would. Nothing in
# dpserve knows of it.
CRASHING_SITE = """\
import os
import sys

_args = sys.argv
if "engine" in _args and "--rank" in _args and os.path.exists({ranks_file!r}):
    if _args[_args.index("--rank") + 1] in open({ranks_file!r}).read().split():
        os._exit({code})
"""


class Serve:
    def __init__(
        self,
        process: subprocess.Popen[bytes],
        log: Path,
        port: int,
        http: int,
        ranks_file: Path | None = None,  # read by CRASHING_SITE, where ``serve`` installed it
    ):
        self.process, self.log, self.port, self.ranks_file = process, log, port, ranks_file
        self.base = f"http://127.0.0.1:{http}"

    def crash_from_now(self, *ranks: str) -> None:
        """Each later start of these engines exits at once (``CRASHING_SITE``)."""
        assert self.ranks_file is not None, "a deployment started by this module's serve()"
        self.ranks_file.write_text(" ".join(ranks))

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pid_of(self, name: str) -> int | None:
        """The pid of serve's live child ``name``: "coordinator", or "engine R" for rank R."""
        for pid in descendants(self.process.pid):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:  # it exited while we looked
                continue
            if "dpserve.cli" not in args or not alive(pid):
                continue
            command = args[args.index("dpserve.cli") + 1]
            if command == "engine":
                command += " " + args[args.index("--rank") + 1]
            if command == name:
                return pid
        return None

    def leftovers(self) -> list[int]:
        """Live processes of this deployment other than serve: any process whose command line
        names its ZMQ port (the coordinator binds it, engines connect to it)."""
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            pid = int(cmdline.parent.name)
            try:
                args = cmdline.read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            mine = str(self.port) in args or f"tcp://127.0.0.1:{self.port}" in args
            if mine and pid != self.process.pid and alive(pid):
                found.append(pid)
        return found

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not self.leftovers(), "no process may outlive serve"

    def stop_and_check_nothing_is_left(self, running: int) -> None:
        assert len(self.leftovers()) == running, "the coordinator and the engines not down"
        self.process.send_signal(signal.SIGINT)
        assert self.process.wait(60) == 0, self.text()[-3000:]
        self.assert_nothing_left()


@contextmanager
def serve(
    tmp_path: Path,
    crashing_ranks: tuple[str, ...] = (),
    model: Path | None = None,
    model_args: tuple[str, ...] = (),
) -> Iterator[Serve]:
    """``dpserve serve --data-parallel-size 2`` with fake engines (or ``model``, with
    ``model_args``), plain ZMQ (the test's client needs no keys); with ``crashing_ranks``, those
    engines exit at once every time they start (``Serve.crash_from_now`` names others
    later)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    site, ranks_file = tmp_path / "site", tmp_path / "crashing-ranks"
    site.mkdir()
    code = CRASHING_SITE.format(ranks_file=str(ranks_file), code=CRASH_EXIT_CODE)
    (site / "sitecustomize.py").write_text(code)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    ranks_file.write_text(" ".join(crashing_ranks))
    port, http_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                DPSERVE, "serve", "--data-parallel-size", "2", "--insecure",
                *(["--fake", "--step-delay", str(STEP_DELAY)] if model is None
                  else ["--model", str(model), *model_args]),
                "--port", str(port), "--http-port", str(http_port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    deployment = Serve(process, log, port, http_port, ranks_file)
    try:
        yield deployment
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in deployment.leftovers():  # only after a failure: the tests check for none
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


Streamed = tuple[str, str | None, list[float]]


async def stream(
    session: aiohttp.ClientSession, base: str, prompt: str, events: list[int], index: int
) -> Streamed:
    """One streamed completion: its whole text, finish reason and tokens' log-probs."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body["stream"] = True
    body["logprobs"] = 0
    pieces: list[str] = []
    logprobs: list[float] = []
    finish = None
    async with session.post(f"{base}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            for choice in json.loads(data)["choices"]:
                pieces.append(choice["text"])
                if choice.get("logprobs"):
                    logprobs += choice["logprobs"]["token_logprobs"]
                finish = choice["finish_reason"] or finish
            events[index] += 1
    return "".join(pieces), finish, logprobs


async def completion(session: aiohttp.ClientSession, base: str, prompt: str) -> int:
    """The tokens a completion of 4 generated (answered 200 and ended). Not its text: a random
    tiny model's 4 tokens can be special tokens or bytes of an unfinished UTF-8 character."""
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    async with session.post(f"{base}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    assert answer["choices"][0]["finish_reason"] == "length", answer
    tokens: int = answer["usage"]["completion_tokens"]
    return tokens


async def ready(session: aiohttp.ClientSession, base: str) -> tuple[int, dict]:
    async with session.get(f"{base}/ready") as response:
        return response.status, await response.json()


async def streams_under_way(
    session: aiohttp.ClientSession, base: str
) -> list[asyncio.Task[Streamed]]:
    """The 16 streams, once every one of them has received a few events or ended (on the tiny
    model a stream of ~245 tokens can end within 4 stream intervals on a quiet machine)."""
    events = [0] * len(PROMPTS)
    streams = [
        asyncio.create_task(stream(session, base, p, events, i)) for i, p in enumerate(PROMPTS)
    ]
    deadline = time.monotonic() + 30
    while not all(count >= 5 or task.done() for count, task in zip(events, streams, strict=True)):
        assert time.monotonic() < deadline, events
        await asyncio.sleep(0.02)
    return streams


async def uninterrupted_run(session: aiohttp.ClientSession, base: str) -> list[Streamed]:
    events = [0] * len(PROMPTS)
    run = await asyncio.gather(
        *(stream(session, base, p, events, i) for i, p in enumerate(PROMPTS))
    )
    assert all(finish == "length" for _, finish, _ in run)
    return run


def _rounds_bf16_activations_here() -> bool:
    """Whether this machine's engines round bf16's activations (``--cpu-weights bf16``)."""
    from dpserve.engine.kernels import cpu_kernels

    return cpu_kernels.available() and cpu_kernels.supports_bf16_dots()


@pytest.mark.parametrize("mode", ["fake", "tiny-model", "tiny-model-bf16"])
async def test_an_engine_killed_mid_stream_is_restarted_while_the_other_serves(
    mode: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """With the tiny model too: a model engine takes a moment to die (the kernel frees its
    memory before it closes its socket), and requests sent to it meanwhile must still move.
    With bf16 weights the moved streams stay exact as well: where the CPU has AVX-512-BF16 the
    activations are rounded to bf16 and every step is batch-invariant (``step_attention``),
    elsewhere the weights are widened to fp32."""
    model = None if mode == "fake" else request.getfixturevalue("tiny_model_path")
    model_args = ("--cpu-weights", "bf16") if mode == "tiny-model-bf16" else ()
    bitwise = mode == "tiny-model-bf16" and _rounds_bf16_activations_here()
    with serve(tmp_path, model=model, model_args=model_args) as deployment:
        banner = await asyncio.to_thread(wait_for_banner, deployment.process, deployment.log, 120)
        assert "2/2 engine(s) registered" in banner
        client = InferenceClient(deployment.port, handshake_timeout=20)
        await client.start()
        timeout = aiohttp.ClientTimeout(total=120)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                base = deployment.base
                uninterrupted = await uninterrupted_run(session, base)
                victim = deployment.pid_of("engine 1")
                assert victim is not None
                streams = await streams_under_way(session, base)
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()

                # The survivor answers new requests at once.
                answers = await asyncio.gather(
                    *(completion(session, base, f"after the kill {i}") for i in range(4))
                )
                assert answers == [4] * 4
                answered_in = time.monotonic() - killed_at
                print(f"\nnew requests answered {answered_in:.2f} s after the kill")
                assert answered_in < 5.0

                # The streams in flight finish as if nothing had happened: the same text, and
                # log-probs to the bit where the step is batch-invariant, else within fp32's
                # summation differences (a moved stream's tokens are prefilled anew).
                interrupted = await asyncio.gather(*streams)
                assert [run[:2] for run in interrupted] == [run[:2] for run in uninterrupted]
                for (_, _, moved), (_, _, whole) in zip(interrupted, uninterrupted, strict=True):
                    assert len(moved) == len(whole) and (whole or not model)
                    if bitwise:
                        assert moved == whole
                    else:
                        assert moved == pytest.approx(whole, abs=1e-4)

                # Rank 1 runs again (another process) and registered within 60 s.
                while True:
                    status = await asyncio.wait_for(client.get_status(), 10)
                    ranks = sorted(e["rank"] for e in status["engine_list"])
                    code, body = await ready(session, base)
                    restarted = deployment.pid_of("engine 1")
                    if ranks == [0, 1] and body["engines"] == 2 and restarted not in (None, victim):
                        break
                    assert time.monotonic() - killed_at < 60, (status, body, restarted)
                    await asyncio.sleep(0.2)
                back_in = time.monotonic() - killed_at
                print(f"rank 1 registered again {back_in:.2f} s after the kill")
                assert code == 200
                assert status["counters"].get("redispatched", 0) > 0, "rank 1 held streams"
                assert await completion(session, base, "once both are back") == 4
        finally:
            client.stop()
        assert deployment.process.poll() is None, "serve keeps running"
        log = deployment.text()
        assert re.search(
            rf"engine 1 \(pid {victim}\) was killed by SIGKILL after [\d.]+ s; restarting it in "
            r"1 s \(death 1 within 300 s; the 5th leaves it down\)",
            log,
        ), log[-3000:]
        assert f"engine 1 started again (pid {restarted})" in log
        deployment.stop_and_check_nothing_is_left(running=3)


async def test_a_killed_coordinator_is_restarted_and_the_streams_resume(tmp_path: Path) -> None:
    """The coordinator holds no state a client cannot give back: the front's client resubmits
    its streams (with the tokens it has) to the restarted one, and the engines register again."""
    with serve(tmp_path) as deployment:
        await asyncio.to_thread(wait_for_banner, deployment.process, deployment.log, 120)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            base = deployment.base
            uninterrupted = await uninterrupted_run(session, base)
            victim = deployment.pid_of("coordinator")
            assert victim is not None
            streams = await streams_under_way(session, base)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            assert await asyncio.gather(*streams) == uninterrupted
            while (await ready(session, base)) != (200, {**READY, "engines": 2}):
                assert time.monotonic() - killed_at < 60
                await asyncio.sleep(0.2)
            assert await completion(session, base, "after the coordinator came back") == 4
        log = deployment.text()
        assert re.search(
            rf"coordinator \(pid {victim}\) was killed by SIGKILL after [\d.]+ s; restarting it "
            r"in 1 s",
            log,
        ), log[-3000:]
        assert f"coordinator started again (pid {deployment.pid_of('coordinator')})" in log
        deployment.stop_and_check_nothing_is_left(running=3)


async def test_an_engine_that_cannot_start_is_left_down_at_once_and_the_other_serves(
    tmp_path: Path,
) -> None:
    with serve(tmp_path, crashing_ranks=("1",)) as deployment:
        banner = await asyncio.to_thread(wait_for_banner, deployment.process, deployment.log, 120)
        assert "serving fake with 1 of 2 engine(s) (engine 1 left down" in banner
        deaths = re.findall(rf"engine 1 \(pid \d+\) exited with code {CRASH_EXIT_CODE}", banner)
        assert len(deaths) == 1, banner
        assert (
            "before it ever came up: it is not restarted, as it would fail the same way"
        ) in banner
        assert "(engines left: 1 of 2)" in banner
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            code, body = await ready(session, deployment.base)
            assert (code, body["status"], body["engines"]) == (200, "ready", 1)
            for i in range(8):
                assert await completion(session, deployment.base, f"one engine {i}") == 4
        assert "engine 1 started again" not in deployment.text(), "left down means left down"
        assert deployment.process.poll() is None
        deployment.stop_and_check_nothing_is_left(running=2)


async def test_a_crash_looping_engine_is_left_down_and_the_other_serves(tmp_path: Path) -> None:
    """An engine that served, then dies and fails each start after, is tried five times."""
    with serve(tmp_path) as deployment:
        await asyncio.to_thread(wait_for_banner, deployment.process, deployment.log, 120)
        deployment.crash_from_now("1")
        victim = deployment.pid_of("engine 1")
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "a crash loop" not in deployment.text():
            assert time.monotonic() < deadline, deployment.text()[-3000:]
            await asyncio.sleep(0.2)
        log = deployment.text()
        assert f"engine 1 (pid {victim}) was killed by SIGKILL" in log
        deaths = re.findall(rf"engine 1 \(pid \d+\) exited with code {CRASH_EXIT_CODE}", log)
        assert len(deaths) == 4, log[-3000:]
        assert (
            "it died 5 times within 300 s, a crash loop: it is left down until dpserve serve "
            "is restarted (engines left: 1 of 2)"
        ) in log
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            for i in range(8):
                assert await completion(session, deployment.base, f"one engine {i}") == 4
            await asyncio.sleep(3)
            code, body = await ready(session, deployment.base)
            assert (code, body["status"], body["engines"]) == (200, "ready", 1)
        after = deployment.text().split("a crash loop", 1)[1]
        assert "engine 1 started again" not in after, "left down means left down"
        assert deployment.process.poll() is None
        deployment.stop_and_check_nothing_is_left(running=2)


def test_serve_exits_with_an_error_when_no_engine_can_start(tmp_path: Path) -> None:
    with serve(tmp_path, crashing_ranks=("0", "1")) as deployment:
        assert deployment.process.wait(120) == 1
        log = deployment.text()
        assert "no engine is left to serve" in log, log[-3000:]
        assert len(re.findall(r"before it ever came up: it is not restarted", log)) == 2
        assert "started again" not in log
        assert "Press Ctrl-C to stop." not in log, "it never claimed to be serving"
        deployment.assert_nothing_left()


def test_ctrl_c_during_a_restart_backoff_stops_everything(tmp_path: Path) -> None:
    with serve(tmp_path) as deployment:
        wait_for_banner(deployment.process, deployment.log, 120)
        deployment.crash_from_now("0", "1")
        for rank in ("0", "1"):
            pid = deployment.pid_of(f"engine {rank}")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "restarting it in 4 s" not in deployment.text():  # a 4 s wait has begun
            assert time.monotonic() < deadline, deployment.text()[-3000:]
            assert deployment.process.poll() is None
            time.sleep(0.1)
        signalled = len(deployment.text())
        deployment.process.send_signal(signal.SIGINT)
        assert deployment.process.wait(30) == 0
        time.sleep(5)  # past the backoff: nothing may have been started meanwhile
        assert "started again" not in deployment.text()[signalled:]
        deployment.assert_nothing_left()
