"""Coordinator + client + fake engines as real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import collections
import random
import signal

import msgpack
import pytest
import zmq
import zmq.asyncio

from dpserve import protocol
from dpserve.client import InferenceClient, RequestFailed
from dpserve.engine.fake import fake_token
from dpserve.protocol import Connect, ConnectAck, Error, Header, SubmitRequest
from dpserve.sampling import SamplingParams
from tests.integration.runtime import Processes, wait_for_engines
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

FAST = ("--heartbeat-timeout", "1.5")


def expected_tokens(prompt: str, count: int, seed: int | None = None) -> list[int]:
    prompt_tokens = list(prompt.encode())
    return [fake_token(prompt_tokens, seed, i) for i in range(count)]


async def start(
    processes: Processes,
    client: InferenceClient,
    port: int,
    engines: int,
    coordinator_args: tuple[str, ...] = FAST,
    engine_args: tuple[str, ...] = (),
) -> None:
    processes.coordinator(port, *coordinator_args)
    for rank in range(engines):
        processes.fake_engine(port, rank, *engine_args)
    await client.start()
    await wait_for_engines(client, engines)


async def test_results_are_correct_and_reach_the_right_client(processes, client, port):
    await start(processes, client, port, engines=2)
    others = [InferenceClient(port) for _ in range(2)]
    for other in others:
        await other.start()
    try:
        everyone = [client, *others]
        futures = []
        for i in range(300):
            owner = everyone[i % 3]
            prompt = f"client {i % 3} prompt {i}"
            params = SamplingParams(num_tokens_to_generate=1 + i % 7)
            futures.append((owner, prompt, params, owner.add_request(prompt, params)))
        for _owner, prompt, params, future in futures:
            record = await asyncio.wait_for(future, 30)
            assert record.prompt_tokens == list(prompt.encode())
            assert record.generated_tokens == expected_tokens(prompt, params.num_tokens_to_generate)
            assert record.generated_text == bytes(record.generated_tokens).decode()
            assert record.finish_reason == "length"
            assert record.latency > 0
        assert all(not c.completion_futures for c in everyone)
    finally:
        for other in others:
            other.stop()


async def test_token_prompts_log_probs_stop_strings_and_seeds(processes, client, port):
    await start(processes, client, port, engines=1)
    tokens = [104, 105, 33]
    record = await client.add_request(
        tokens, SamplingParams(num_tokens_to_generate=5, return_log_probs=True)
    )
    assert record.prompt_tokens == tokens
    assert record.log_probs == [-1.0] * 5
    # A stop string that the fake engine's output contains ends generation there.
    full = await client.add_request("stop me", SamplingParams(num_tokens_to_generate=20))
    stop = full.generated_text[3:5]
    stopped = await client.add_request(
        "stop me", SamplingParams(num_tokens_to_generate=20, stop_strings=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.generated_text == full.generated_text[:3], "output ends before the stop string"
    seeded = SamplingParams(num_tokens_to_generate=6, seed=7)
    a = await client.add_request("seeded", seeded)
    b = await client.add_request("seeded", seeded)
    assert a.generated_tokens == b.generated_tokens == expected_tokens("seeded", 6, seed=7)


async def test_streaming_yields_tokens_as_they_come(processes, client, port):
    await start(processes, client, port, engines=1, engine_args=("--step-delay", "0.02"))
    chunks = [
        c async for c in client.stream("stream it", SamplingParams(num_tokens_to_generate=30))
    ]
    assert len(chunks) > 3, "a 30-token request at 20 ms a step must arrive in several chunks"
    tokens = [t for c in chunks for t in c.tokens]
    assert tokens == expected_tokens("stream it", 30)
    assert "".join(c.text for c in chunks) == bytes(tokens).decode()


async def test_round_robin_routing_is_reproducible(processes, client, port):
    await start(processes, client, port, engines=3, coordinator_args=(*FAST, "--deterministic"))
    ranks = []
    for i in range(12):
        record = await client.add_request(f"r{i}", SamplingParams(num_tokens_to_generate=1))
        ranks.append(record.engine_rank)
    assert sorted(set(ranks)) == [0, 1, 2]
    assert ranks == ranks[:3] * 4, f"round robin must cycle the engines in order: {ranks}"


async def test_least_outstanding_routing_favours_the_faster_engine(processes, client, port):
    processes.coordinator(port, *FAST)
    processes.fake_engine(port, 0, "--step-delay", "0.2")
    processes.fake_engine(port, 1, "--step-delay", "0.002")
    await client.start()
    await wait_for_engines(client, 2)
    futures = []
    for i in range(120):  # a steady stream: the slow engine's backlog grows, the fast one's not
        futures.append(client.add_request(f"lor {i}", SamplingParams(num_tokens_to_generate=3)))
        await asyncio.sleep(0.005)
    per_rank = collections.Counter(r.engine_rank for r in await asyncio.gather(*futures))
    assert per_rank[1] > 2 * per_rank[0], f"fast engine should get most requests: {per_rank}"


async def test_control_signals_are_acknowledged_and_transitions_checked(processes, client, port):
    await start(processes, client, port, engines=2)
    await asyncio.wait_for(client.pause_engines(), 10)
    held = client.add_request("while paused", SamplingParams(num_tokens_to_generate=2))
    await asyncio.sleep(0.5)
    assert not held.done(), "a paused engine must not step"
    with pytest.raises(RequestFailed) as second_pause:
        await client.pause_engines()
    assert second_pause.value.code == "invalid_transition"
    await asyncio.wait_for(client.suspend_engines(), 10)
    with pytest.raises(RequestFailed, match="UNPAUSE"):
        await client.unpause_engines()  # must resume before unpausing
    await asyncio.wait_for(client.resume_engines(), 10)
    await asyncio.wait_for(client.unpause_engines(), 10)
    record = await asyncio.wait_for(held, 10)
    assert record.generated_tokens == expected_tokens("while paused", 2)
    status = await client.get_status()
    assert status["state"] == "running"
    assert processes.started[0].poll() is None, "the coordinator must survive all of it"


async def test_stop_leaves_no_pending_future(processes, client, port):
    await start(processes, client, port, engines=2, engine_args=("--step-delay", "0.05"))
    futures = [
        client.add_request(f"long {i}", SamplingParams(num_tokens_to_generate=500))
        for i in range(20)
    ]
    await asyncio.sleep(0.3)
    await asyncio.wait_for(client.stop_engines(), 10)
    results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
    assert all(isinstance(r, RequestFailed) and r.code == "stopped" for r in results)
    with pytest.raises(RequestFailed, match="stopped"):
        await asyncio.wait_for(client.add_request("after stop"), 10)
    assert not client.completion_futures
    for engine in processes.started[1:]:
        assert engine.wait(10) == 0


async def test_requests_wait_for_an_engine_then_fail_clearly(processes, client, port):
    processes.coordinator(port, "--queue-timeout", "1")
    await client.start()
    waiting = client.add_request("nobody home")
    with pytest.raises(RequestFailed) as failure:
        await asyncio.wait_for(waiting, 10)
    assert failure.value.code == "no_engine"
    # A request that is queued when an engine arrives is served by it.
    queued = client.add_request("served later", SamplingParams(num_tokens_to_generate=3))
    processes.fake_engine(port, 0)
    record = await asyncio.wait_for(queued, 20)
    assert record.generated_tokens == expected_tokens("served later", 3)


async def test_an_early_client_is_not_mistaken_for_an_engine(processes, client, port):
    processes.coordinator(port, "--data-parallel-size", "1")
    await client.start()  # before any engine: the coordinator is still waiting for one
    early = client.add_request("early bird", SamplingParams(num_tokens_to_generate=2))
    await asyncio.sleep(0.3)
    processes.fake_engine(port, 0)
    record = await asyncio.wait_for(early, 20)
    assert record.engine_rank == 0
    status = await client.get_status()
    assert status["engines"] == 1 and status["clients"] == 1


async def test_invalid_requests_get_clear_errors(processes, client, port):
    await start(processes, client, port, engines=1)
    # A raw peer, to send what the client's own validation would refuse to build.
    context = zmq.asyncio.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(f"tcp://127.0.0.1:{port}")
    try:
        await raw.send(protocol.encode(SubmitRequest(1, "x", {})))
        error = protocol.decode(await asyncio.wait_for(raw.recv(), 10))
        assert (type(error), error.ref, error.code) == (Error, 1, "unknown_peer")
        await raw.send(protocol.encode(Connect(protocol.PROTOCOL_VERSION)))
        assert isinstance(protocol.decode(await asyncio.wait_for(raw.recv(), 10)), ConnectAck)
        for ref, params in enumerate([{"temperature": -1}, {"bogus": 1}, {"top_p": "x"}], 2):
            await raw.send(protocol.encode(SubmitRequest(ref, "x", params)))
            error = protocol.decode(await asyncio.wait_for(raw.recv(), 10))
            assert (type(error), error.ref, error.code) == (Error, ref, "bad_request")
            assert next(iter(params)) in error.message
    finally:
        raw.close(0)
        context.term()
    with pytest.raises(RequestFailed) as too_long:
        await client.add_request(list(range(1, 9000)))
    assert too_long.value.code == "prompt_too_long"
    assert "8192" in too_long.value.message


async def test_engine_killed_mid_load_loses_no_request(processes, client, port):
    await start(processes, client, port, engines=3, engine_args=("--step-delay", "0.01"))
    params = SamplingParams(num_tokens_to_generate=20)
    futures = [client.add_request(f"kill test {i}", params) for i in range(1000)]
    await eventually(lambda: sum(f.done() for f in futures) >= 100, within=30)
    processes.started[2].send_signal(signal.SIGKILL)  # engine rank 1
    records = await asyncio.wait_for(asyncio.gather(*futures), 60)
    assert len(records) == 1000
    for i, record in enumerate(records):
        assert record.generated_tokens == expected_tokens(f"kill test {i}", 20)
    status = await client.get_status()
    assert status["engines"] == 2
    assert status["counters"].get("redispatched", 0) > 0


async def test_engine_joining_mid_load_gets_traffic(processes, client, port):
    await start(processes, client, port, engines=1, engine_args=("--step-delay", "0.02"))
    params = SamplingParams(num_tokens_to_generate=10)
    first = [client.add_request(f"a{i}", params) for i in range(50)]
    processes.fake_engine(port, 1, "--step-delay", "0.02")
    await wait_for_engines(client, 2)
    later = [client.add_request(f"b{i}", params) for i in range(50)]
    records = await asyncio.wait_for(asyncio.gather(*first, *later), 60)
    assert sum(r.engine_rank == 1 for r in records) >= 20


async def test_coordinator_killed_and_restarted_loses_no_request(processes, client, port):
    await start(processes, client, port, engines=2, engine_args=("--step-delay", "0.01"))
    params = SamplingParams(num_tokens_to_generate=10)
    futures = [client.add_request(f"restart {i}", params) for i in range(1000)]
    await eventually(lambda: sum(f.done() for f in futures) >= 100, within=30)
    processes.started[0].send_signal(signal.SIGKILL)
    processes.started[0].wait(5)
    await asyncio.sleep(0.5)
    processes.coordinator(port, *FAST)
    records = await asyncio.wait_for(asyncio.gather(*futures), 90)
    for i, record in enumerate(records):
        assert record.generated_tokens == expected_tokens(f"restart {i}", 10)
    await wait_for_engines(client, 2)


async def test_rogue_peer_flood_does_not_stop_serving(processes, client, port):
    await start(processes, client, port, engines=2)
    rng = random.Random(1234)
    context = zmq.asyncio.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.connect(f"tcp://127.0.0.1:{port}")
    frames = [
        lambda: rng.randbytes(rng.randint(0, 64)),
        lambda: msgpack.packb(
            [rng.randint(-5, 200), *rng.choices([1, "x", None, b"y", [], {}], k=rng.randint(0, 5))]
        ),
        lambda: msgpack.packb(
            [int(Header.ENGINE_REPLY), [[rng.randint(0, 10**9), b"abcd", None, "stop", None, 0.1]]]
        ),
        lambda: msgpack.packb([int(Header.SUBMIT_REQUEST), rng.randint(0, 9), "hi", {}]),
        lambda: msgpack.packb([int(Header.CONTROL_ACK), 40, 1]),
        lambda: msgpack.packb({"not": "a list"}),
        lambda: msgpack.packb([int(Header.REGISTER), -1, 0, "x"]),
        lambda: msgpack.packb([int(Header.HEARTBEAT), 1]),
    ]
    served = []

    async def keep_serving() -> None:
        for i in range(200):
            record = await client.add_request(
                f"during flood {i}", SamplingParams(num_tokens_to_generate=2)
            )
            served.append(record)

    serving = asyncio.create_task(keep_serving())
    try:
        for i in range(12_000):
            kind = frames[i % len(frames)]
            await rogue.send_multipart([kind()] if i % 50 else [b"a", b"b", b"c"])
            if i % 500 == 0:
                await asyncio.sleep(0)
        await asyncio.wait_for(serving, 60)
    finally:
        rogue.close(0)
        context.term()
    assert len(served) == 200
    assert served[-1].generated_tokens == expected_tokens("during flood 199", 2)
    status = await client.get_status()
    assert status["engines"] == 2
    assert status["counters"]["bad_messages"] >= 1000
    assert processes.started[0].poll() is None


async def test_client_vanishing_with_replies_pending(processes, client, port):
    await start(processes, client, port, engines=2, engine_args=("--step-delay", "0.02"))
    leaver = InferenceClient(port)
    await leaver.start()
    abandoned = [
        leaver.add_request(f"gone {i}", SamplingParams(num_tokens_to_generate=20))
        for i in range(100)
    ]
    await asyncio.sleep(0.2)
    leaver.stop()
    assert all(f.done() for f in abandoned), "stop() must settle every future"
    record = await asyncio.wait_for(
        client.add_request("still here", SamplingParams(num_tokens_to_generate=3)), 20
    )
    assert record.generated_tokens == expected_tokens("still here", 3)

    async def drained() -> bool:
        status = await client.get_status()
        return status["inflight"] == 0

    for _ in range(100):
        if await drained():
            break
        await asyncio.sleep(0.1)
    status = await client.get_status()
    assert status["inflight"] == 0
    assert status["counters"].get("clients_vanished", 0) == 1
    assert processes.started[0].poll() is None


async def test_coordinator_exits_cleanly_on_sigterm(processes, client, port):
    await start(processes, client, port, engines=1)
    coordinator = processes.started[0]
    coordinator.send_signal(signal.SIGTERM)
    assert coordinator.wait(10) == 0
    assert "stopped" in processes.log(f"coordinator-{port}")
    assert processes.started[1].poll() is None, "engines outlive a coordinator restart"


async def test_frozen_engine_is_dropped_and_its_requests_served_elsewhere(processes, client, port):
    # Small batches keep most requests queued on the engines when one of them freezes.
    engine_args = ("--step-delay", "0.01", "--max-num-seqs", "8")
    await start(processes, client, port, engines=2, engine_args=engine_args)
    params = SamplingParams(num_tokens_to_generate=20)
    futures = [client.add_request(f"freeze {i}", params) for i in range(300)]
    await eventually(lambda: sum(f.done() for f in futures) >= 30, within=30)
    frozen = processes.started[1]
    frozen.send_signal(signal.SIGSTOP)  # connected, but neither its loop nor libzmq answers
    try:
        records = await asyncio.wait_for(asyncio.gather(*futures), 60)
        assert [r.generated_tokens for r in records] == [
            expected_tokens(f"freeze {i}", 20) for i in range(300)
        ]
        status = await wait_for_engines(client, 1)
        assert status["counters"].get("redispatched", 0) > 0
    finally:
        frozen.send_signal(signal.SIGCONT)


async def test_busy_engine_is_not_mistaken_for_a_dead_one(processes, client, port):
    # Each step takes twice the heartbeat timeout, as a long prefill under load can.
    await start(processes, client, port, engines=1, engine_args=("--step-delay", "3"))
    record = await asyncio.wait_for(
        client.add_request("slow", SamplingParams(num_tokens_to_generate=2)), 30
    )
    assert record.generated_tokens == expected_tokens("slow", 2)
    status = await client.get_status()
    assert status["engines"] == 1
    assert status["counters"].get("redispatched", 0) == 0


async def test_streams_continue_exactly_on_another_engine_when_theirs_dies(processes, client, port):
    await start(processes, client, port, engines=2, engine_args=("--step-delay", "0.02"))
    params = SamplingParams(num_tokens_to_generate=60, stream=True)
    streams = [client.stream(f"moved {i}", params) for i in range(40)]
    texts: list[list[str]] = [[] for _ in streams]
    tokens: list[list[int]] = [[] for _ in streams]

    async def consume(index: int) -> None:
        async for chunk in streams[index]:
            texts[index].append(chunk.text)
            tokens[index].extend(chunk.tokens)

    consumers = [asyncio.create_task(consume(i)) for i in range(len(streams))]
    await eventually(lambda: all(len(t) >= 10 for t in tokens), within=30)
    processes.started[2].send_signal(signal.SIGKILL)  # engine rank 1, mid-stream
    await asyncio.wait_for(asyncio.gather(*consumers), 60)
    for i in range(len(streams)):
        expected = expected_tokens(f"moved {i}", 60)
        assert tokens[i] == expected
        assert "".join(texts[i]) == bytes(expected).decode(), "the text neither repeats nor skips"
    status = await client.get_status()
    assert status["counters"].get("redispatched", 0) > 0
