"""The text a client receives is the text its engine sent with the tokens: the coordinator
forwards it without decoding; for an engine that sends no text it decodes the tokens itself."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from dpserve import protocol
from dpserve.protocol import EngineReply, EngineRequest, EngineUpdate, Register
from dpserve.sampling import SamplingParams
from tests.integration.runtime import wait_for_engines

pytestmark = pytest.mark.timeout(60)


class RawEngine:
    """An engine speaking the protocol by hand, to choose exactly what it sends."""

    def __init__(self, port: int) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    async def register(self) -> None:
        await self.socket.send(protocol.encode(Register(0, 8, "raw")))

    async def next_request(self) -> EngineRequest:
        while True:
            record = protocol.decode(await asyncio.wait_for(self.socket.recv(), 20))
            if isinstance(record, EngineRequest):
                return record

    async def reply(self, *updates: list) -> None:
        # As lists, the way an engine that predates the text field writes them.
        await self.socket.send(protocol.encode(EngineReply(list(updates))))

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


@pytest.fixture
def raw_engine(port: int):
    engine = RawEngine(port)
    yield engine
    engine.close()


async def test_text_from_the_engine_is_forwarded_as_sent(processes, client, port, raw_engine):
    processes.coordinator(port)
    await client.start()
    await raw_engine.register()
    await wait_for_engines(client, 1)
    stream = client.stream("hi", SamplingParams(num_tokens_to_generate=4, stream=True))
    request = await raw_engine.next_request()
    tokens = protocol.pack_tokens([1, 2])
    # Text that is not the byte tokenizer's reading of the tokens: only the engine knows it.
    await raw_engine.socket.send(
        protocol.encode(
            EngineReply([EngineUpdate(request.request_id, tokens, None, None, None, 0.1, "one ")])
        )
    )
    events = stream.events()  # kept: leaving the iteration would cancel the request
    first = await asyncio.wait_for(anext(events), 20)
    assert first.text == "one "
    await raw_engine.socket.send(
        protocol.encode(
            EngineReply(
                [EngineUpdate(request.request_id, tokens, None, "length", None, None, "two")]
            )
        )
    )
    rest = [event async for event in events]
    record = rest[-1]
    assert [chunk.text for chunk in rest[:-1]] == ["two"]
    assert record.generated_text == "one two"
    assert record.generated_tokens == [1, 2, 1, 2]


async def test_an_engine_that_sends_no_text_is_decoded_here(processes, client, port, raw_engine):
    processes.coordinator(port)
    await client.start()
    await raw_engine.register()
    await wait_for_engines(client, 1)
    stream = client.stream("hi", SamplingParams(num_tokens_to_generate=8, stream=True))
    request = await raw_engine.next_request()
    euro, rid = list("€".encode()), request.request_id
    events = stream.events()  # kept: leaving the iteration would cancel the request
    # Half a character first: its text waits for the rest.
    await raw_engine.reply([rid, protocol.pack_tokens([97, *euro[:2]]), None, None, None, 0.1])
    assert (await asyncio.wait_for(anext(events), 20)).text == "a"
    await raw_engine.reply([rid, protocol.pack_tokens([*euro[2:], 98]), None, None, None, None])
    assert (await asyncio.wait_for(anext(events), 20)).text == "€b"
    await raw_engine.reply([rid, protocol.pack_tokens([99]), None, "stop", None, None])
    rest = [event async for event in events]
    assert [chunk.text for chunk in rest[:-1]] == ["c"]
    assert rest[-1].generated_text == "a€bc"
