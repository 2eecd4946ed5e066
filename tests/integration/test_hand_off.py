"""An engine that is told to leave (SIGTERM) hands its requests to the other engines and exits
at once; one that waits for its coordinator registers once per connection. Real processes on
127.0.0.1: a coordinator, fake engines, a client."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import zmq
import zmq.asyncio

from dpserve import protocol
from dpserve.protocol import ControlState
from dpserve.sampling import SamplingParams
from tests.integration.runtime import free_port, wait_for_engines
from tests.integration.test_runtime import expected_tokens, start
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

TOKENS = 80
STEP = "0.05"  # seconds per fake step: a request takes 4 s, a drain would take seconds


async def _exited(process, within: float) -> int:
    deadline = time.monotonic() + within
    while process.poll() is None:
        assert time.monotonic() < deadline, f"process {process.pid} still runs after {within} s"
        await asyncio.sleep(0.02)
    return process.returncode


async def test_a_terminated_engine_hands_its_requests_over_and_streams_stay_exact(
    processes, client, port
):
    await start(processes, client, port, engines=2, engine_args=("--step-delay", STEP))
    streaming = SamplingParams(num_tokens_to_generate=TOKENS, stream=True)
    plain = SamplingParams(num_tokens_to_generate=TOKENS)
    streams = [client.stream(f"handed {i}", streaming) for i in range(24)]
    futures = [client.add_request(f"plain {i}", plain) for i in range(24)]
    texts: list[list[str]] = [[] for _ in streams]
    tokens: list[list[int]] = [[] for _ in streams]

    async def consume(index: int) -> None:
        async for chunk in streams[index]:
            texts[index].append(chunk.text)
            tokens[index].extend(chunk.tokens)

    consumers = [asyncio.create_task(consume(i)) for i in range(len(streams))]
    await eventually(lambda: all(len(t) >= 5 for t in tokens), within=30)
    leaving = processes.started[2]  # engine rank 1
    leaving.send_signal(signal.SIGTERM)
    assert await _exited(leaving, 30) == 0
    unfinished = sum(not c.done() for c in consumers) + sum(not f.done() for f in futures)
    assert unfinished > 0, "the engine left only after everything finished: it drained"

    await asyncio.wait_for(asyncio.gather(*consumers), 60)
    records = await asyncio.wait_for(asyncio.gather(*futures), 60)
    for i in range(len(streams)):
        expected = expected_tokens(f"handed {i}", TOKENS)
        assert tokens[i] == expected
        assert "".join(texts[i]) == bytes(expected).decode(), "the text neither repeats nor skips"
    for i, record in enumerate(records):
        expected = expected_tokens(f"plain {i}", TOKENS)
        assert record.generated_tokens == expected
        assert record.generated_text == bytes(expected).decode()
    status = await wait_for_engines(client, 1)
    assert status["counters"].get("handed_off", 0) > 0
    assert status["counters"].get("redispatched", 0) >= status["counters"]["handed_off"]
    assert status["counters"].get("quarantined", 0) == 0, "a hand-off is no engine death"
    assert "handed" in processes.log("engine-1")


async def test_the_last_engine_drains_instead(processes, client, port):
    await start(processes, client, port, engines=1, engine_args=("--step-delay", "0.01"))
    params = SamplingParams(num_tokens_to_generate=30)
    futures = [client.add_request(f"drain {i}", params) for i in range(100)]
    await asyncio.sleep(0.3)
    draining = processes.started[1]
    draining.send_signal(signal.SIGTERM)
    records = await asyncio.wait_for(asyncio.gather(*futures), 60)
    assert [r.generated_tokens for r in records] == [
        expected_tokens(f"drain {i}", 30) for i in range(100)
    ]
    assert await _exited(draining, 20) == 0
    status = await wait_for_engines(client, 0)
    assert status["counters"].get("handed_off", 0) == 0
    assert status["counters"].get("redispatched", 0) == 0, "a drain hands nothing back"


async def test_an_engine_waiting_for_its_coordinator_registers_once(processes):
    """The engine starts first; the 'coordinator' (a raw ROUTER) appears seconds later and
    must receive exactly one REGISTER, not one per second of waiting."""
    port = free_port()
    engine = processes.fake_engine(port, 0)
    await asyncio.sleep(3.5)  # the old engine sent a REGISTER every second meanwhile
    assert engine.poll() is None
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    registers: list[protocol.Register] = []
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            if not await router.poll(100):
                continue
            identity, payload = await router.recv_multipart()
            record = protocol.decode(payload)
            if isinstance(record, protocol.Register):
                registers.append(record)
                ack = protocol.encode(protocol.RegisterAck("coordinator-x", ControlState.RUNNING))
                await router.send_multipart([identity, ack])
            elif isinstance(record, protocol.Heartbeat):
                ack = protocol.encode(protocol.HeartbeatAck("coordinator-x"))
                await router.send_multipart([identity, ack])
    finally:
        router.close(0)
        context.term()
    assert len(registers) == 1, registers
    assert processes.log("engine-0").count("registered with coordinator") == 1
