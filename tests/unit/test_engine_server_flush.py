"""When the engine server sends what its runner produced: a request's first tokens at once
(they are its time to first token), later streamed tokens at most once per stream interval."""

from __future__ import annotations

from typing import Any

from dpserve import protocol
from dpserve.engine.fake import FakeRunner
from dpserve.engine.server import EngineServer
from dpserve.sampling import SamplingParams


class _Recorder:
    """Stands in for ``CoordinatorConnection``: keeps every ENGINE_REPLY it is sent."""

    rank = 0
    address = "test"
    instance = "test"

    def __init__(self) -> None:
        self.replies: list[protocol.EngineReply] = []

    def send(self, record: Any) -> None:
        if isinstance(record, protocol.EngineReply):
            self.replies.append(record)

    def close(self) -> None:
        pass

    def sent_for(self, request_id: int) -> list[protocol.EngineUpdate]:
        return [u for reply in self.replies for u in reply.updates if u.request_id == request_id]


def _server(stream_interval: float) -> tuple[EngineServer, _Recorder]:
    connection = _Recorder()
    server = EngineServer(connection, FakeRunner(), stream_interval=stream_interval)  # type: ignore[arg-type]
    server.registered = True
    return server, connection


def _submit(server: EngineServer, request_id: int, stream: bool) -> None:
    params = SamplingParams(num_tokens_to_generate=50, ignore_eos=True, stream=stream)
    server._on_request(
        protocol.EngineRequest(request_id, protocol.pack_tokens([1, 2, 3]), params.serialize(), b"")
    )


def _step(server: EngineServer, now: float) -> None:
    server._absorb(server.runner.step())
    server._flush(now)


def test_a_new_requests_first_token_goes_out_in_the_step_that_made_it() -> None:
    server, sent = _server(stream_interval=10.0)
    _submit(server, 1, stream=True)
    _step(server, now=100.0)  # the stream interval's flush: request 1's first token
    assert len(sent.sent_for(1)) == 1
    _submit(server, 2, stream=True)
    _step(server, now=100.1)  # well inside the interval
    assert [len(protocol.unpack_tokens(u.tokens)) for u in sent.sent_for(2)] == [1]
    assert sent.sent_for(2)[0].ttft is not None
    # Request 1's second token waits for the interval, as before.
    assert len(sent.sent_for(1)) == 1
    _step(server, now=100.2)
    assert len(sent.sent_for(1)) == 1 and len(sent.sent_for(2)) == 1
    _step(server, now=110.1)
    assert [len(protocol.unpack_tokens(u.tokens)) for u in sent.sent_for(1)] == [1, 3]
    assert [len(protocol.unpack_tokens(u.tokens)) for u in sent.sent_for(2)] == [1, 2]


def test_a_non_streaming_request_sends_its_first_tokens_once_then_only_its_result() -> None:
    server, sent = _server(stream_interval=10.0)
    _submit(server, 1, stream=True)
    _step(server, now=100.0)
    _submit(server, 2, stream=False)
    for tick in range(1, 60):
        _step(server, now=100.0 + tick * 0.01)
    updates = sent.sent_for(2)
    assert [u.finish_reason for u in updates] == [None, "length"]
    tokens = [t for u in updates for t in protocol.unpack_tokens(u.tokens)]
    assert len(tokens) == 50


def test_a_hand_off_sends_every_token_a_non_streaming_request_has_so_far() -> None:
    server, sent = _server(stream_interval=10.0)
    _submit(server, 1, stream=False)
    for tick in range(12):
        _step(server, now=100.0 + tick * 0.01)
    # Its first token went out at once; the eleven since wait in the runner, not in updates.
    assert [len(protocol.unpack_tokens(u.tokens)) for u in sent.sent_for(1)] == [1]
    assert server.runner.step() == []
    server._hand_off()
    handed = [t for u in sent.sent_for(1) for t in protocol.unpack_tokens(u.tokens)]
    # The same tokens as an uninterrupted run's first 13 (12 steps and the one just taken).
    alone, alone_sent = _server(stream_interval=10.0)
    _submit(alone, 1, stream=False)
    for tick in range(60):
        _step(alone, now=100.0 + tick * 0.01)
    result = [t for u in alone_sent.sent_for(1) for t in protocol.unpack_tokens(u.tokens)]
    assert len(handed) == 13 and handed == result[:13]
