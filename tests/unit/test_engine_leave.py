"""How an engine asked to leave (SIGTERM: a Pod deleted, a scale-down) says so: with requests
held it hands them over and waits for the coordinator's answer; with none it deregisters and
goes at once, so a Pod deleted together with its coordinator (a namespace, an uninstall) does
not wait out the coordinator timeout for an answer that cannot come."""

from __future__ import annotations

from typing import Any

from dpserve import protocol
from dpserve.engine.fake import FakeRunner
from dpserve.engine.server import EngineServer
from dpserve.sampling import SamplingParams


class _Recorder:
    """Stands in for ``CoordinatorConnection``: keeps every record it is sent."""

    rank = 0
    address = "test"
    instance = "test"

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, record: Any) -> None:
        self.sent.append(record)

    def close(self) -> None:
        pass

    def kinds(self) -> list[type]:
        return [type(record) for record in self.sent]


def _registered_server() -> tuple[EngineServer, _Recorder]:
    connection = _Recorder()
    server = EngineServer(connection, FakeRunner(), coordinator_timeout=5.0)  # type: ignore[arg-type]
    server.registered = True
    return server, connection


def test_an_idle_engine_deregisters_and_may_exit_in_the_same_step() -> None:
    server, connection = _registered_server()
    server.request_drain()
    assert server._drain_step(now=100.0) is True
    assert connection.kinds() == [protocol.Deregister]


def test_an_engine_holding_a_request_hands_it_over_and_waits_for_the_answer() -> None:
    server, connection = _registered_server()
    params = SamplingParams(num_tokens_to_generate=50, ignore_eos=True, stream=True)
    server._on_request(
        protocol.EngineRequest(7, protocol.pack_tokens([1, 2, 3]), params.serialize(), b"")
    )
    server._absorb(server.runner.step())
    server.request_drain()
    assert server._drain_step(now=100.0) is False
    assert protocol.HandOff in connection.kinds()
    assert protocol.Deregister not in connection.kinds()
    assert server._drain_step(now=101.0) is False  # no answer yet, well inside the timeout
    server._on_hand_off_ack(protocol.HandOffAck(1))
    assert server._drain_step(now=101.5) is True
