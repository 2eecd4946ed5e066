"""The client sends the requests of one event-loop turn as one SUBMIT_REQUESTS where the
coordinator's CONNECT_ACK offers it (issue 36), and as SUBMIT_REQUESTs otherwise: watched on
the wire from a ROUTER socket standing where the coordinator would. (Through a real coordinator,
tests/integration/test_runtime.py's hundreds of requests submitted in one turn are batches.)"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from dpserve import protocol
from dpserve.client import InferenceClient
from dpserve.sampling import SamplingParams
from tests.integration.runtime import free_port


async def _sent_by_a_client(batch_bytes: int, submit: Any) -> list[Any]:
    """The records a client sends after its handshake, to a ROUTER that answers CONNECT with
    ``batch_bytes`` as its SUBMIT_REQUESTS size; ``submit(client)`` runs in one loop turn."""
    port = free_port()
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    client = InferenceClient(port)
    received: list[Any] = []

    async def coordinator() -> None:
        while True:
            identity, payload = await router.recv_multipart()
            record = protocol.decode(payload)
            if isinstance(record, protocol.Connect):
                ack = protocol.ConnectAck("coordinator-x", protocol.PROTOCOL_VERSION, batch_bytes)
                await router.send_multipart([identity, protocol.encode(ack)])
            elif not isinstance(record, protocol.Heartbeat):
                received.append(record)

    serving = asyncio.create_task(coordinator())
    try:
        await client.start()
        submit(client)
        await asyncio.sleep(0.5)
    finally:
        client.stop()
        serving.cancel()
        router.close(0)
        context.term()
    return received


async def test_one_turns_requests_go_in_one_message_and_a_cancel_after_them() -> None:
    def submit(client: InferenceClient) -> None:
        futures = [
            client.add_request(f"prompt {index}", SamplingParams(num_tokens_to_generate=2))
            for index in range(3)
        ]
        futures[-1].cancel()  # in the same turn: its CANCEL must not overtake it
        client.get_status()  # a message sent at once, in this turn: after the batch too

    received = await _sent_by_a_client(1 << 20, submit)
    kinds = [type(record) for record in received]
    assert kinds == [protocol.SubmitRequests, protocol.Status, protocol.Cancel], kinds
    batch, _status, cancel = received
    assert [entry.prompt for entry in batch.requests] == ["prompt 0", "prompt 1", "prompt 2"]
    assert cancel.ref == batch.requests[-1].client_request_id


async def test_without_the_offer_or_past_its_size_requests_go_alone() -> None:
    def submit(client: InferenceClient) -> None:
        client.add_request("short", SamplingParams(num_tokens_to_generate=2))
        client.add_request("x" * 600, SamplingParams(num_tokens_to_generate=2))
        client.add_request("short again", SamplingParams(num_tokens_to_generate=2))

    older = await _sent_by_a_client(0, submit)  # a coordinator that reads no batch
    assert [type(record) for record in older] == [protocol.SubmitRequest] * 3
    # The long prompt does not fit a batch of 300 bytes: it goes alone, and in its place (what
    # was batched before it goes first).
    small = await _sent_by_a_client(300, submit)
    kinds = [type(record) for record in small]
    assert kinds == [protocol.SubmitRequests, protocol.SubmitRequest, protocol.SubmitRequests]
    assert [entry.prompt for entry in small[0].requests] == ["short"]
    assert small[1].prompt == "x" * 600
    assert [entry.prompt for entry in small[2].requests] == ["short again"]
