"""The coordinator's LoRA adapter relay (``coordinator.adapters``) with no socket: loads and
unloads reach every engine, the client gets one answer with every engine's error, engines that
register later load what was loaded, a restarted coordinator adopts what its engines loaded at
run time, and engines' heartbeat and registration reports are checked."""

from __future__ import annotations

from typing import Any, cast

import pytest

from dpserve.coordinator.adapters import (
    AdapterRelay,
    MalformedAdapterReport,
    check_adapter_report,
    check_runtime_adapters,
)
from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.registry import Client, Engine
from dpserve.coordinator.requests import RequestTable
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.coordinator.shared import SharedState
from dpserve.coordinator.transport import Transport
from dpserve.limits import DEFAULT_LORA_LIMITS
from dpserve.protocol import AdapterAck, LoadAdapter, UnloadAdapter, decode

CLIENT, FIRST, SECOND, LATE = b"client", b"engine-0", b"engine-1", b"engine-2"


class RecordingTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def send(self, identity: bytes, payload: bytes) -> bool:
        self.sent.append((identity, decode(payload)))
        return True

    def error(self, identity: bytes, ref: int | None, code: str, message: str) -> None:
        self.sent.append((identity, (ref, code, message)))

    def take(self) -> list[tuple[bytes, Any]]:
        sent, self.sent = self.sent, []
        return sent


def _late(shared: SharedState) -> Engine:
    """An engine registering now (rank 2)."""
    engine = Engine(LATE, 2, 8, "i", 0.0)
    shared.registry.add(engine)
    return engine


def _relay() -> tuple[SharedState, RecordingTransport, AdapterRelay]:
    transport = RecordingTransport()
    shared = SharedState(
        config=CoordinatorConfig(),
        routing=RoutingPolicy.ROUND_ROBIN,
        instance_id="test",
        tokenizer=cast(Any, None),
        transport=cast(Transport, transport),
        requests=RequestTable(first_id=1),
    )
    for rank, identity in enumerate((FIRST, SECOND)):
        shared.registry.add(Engine(identity, rank, 8, "i", 0.0))
    shared.clients[CLIENT] = Client(CLIENT)
    return shared, transport, AdapterRelay(shared)


def test_a_load_reaches_every_engine_and_the_client_gets_their_errors() -> None:
    shared, transport, relay = _relay()
    relay.on_signal(CLIENT, LoadAdapter(7, "sql", "/adapters/sql"))
    relayed = transport.take()
    assert {identity for identity, _ in relayed} == {FIRST, SECOND}
    own_id = relayed[0][1].control_id
    assert all(record == LoadAdapter(own_id, "sql", "/adapters/sql") for _, record in relayed)
    relay.on_ack(shared.registry.engines[FIRST], AdapterAck(own_id, None))
    assert transport.take() == []  # the second engine has not answered yet
    relay.on_ack(shared.registry.engines[SECOND], AdapterAck(own_id, "no such directory"))
    assert transport.take() == [(CLIENT, AdapterAck(7, "engine rank 1: no such directory"))]
    assert relay.loaded == {"sql": "/adapters/sql"}  # one engine has it: joiners load it too


def test_engines_that_join_later_load_it_and_an_unload_forgets_it() -> None:
    shared, transport, relay = _relay()
    relay.on_signal(CLIENT, LoadAdapter(1, "sql", "/adapters/sql"))
    own_id = transport.take()[0][1].control_id
    for identity in (FIRST, SECOND):
        relay.on_ack(shared.registry.engines[identity], AdapterAck(own_id, None))
    assert transport.take() == [(CLIENT, AdapterAck(1, None))]
    late = _late(shared)
    relay.engine_joined(late)
    assert transport.take() == [(LATE, LoadAdapter(0, "sql", "/adapters/sql"))]
    relay.on_signal(CLIENT, UnloadAdapter(2, "sql"))
    assert relay.loaded == {}
    relayed = transport.take()
    assert [record.name for _, record in relayed] == ["sql", "sql", "sql"]
    # An engine that leaves is not waited for.
    relay.engine_left(shared.registry.engines[FIRST])
    relay.engine_left(late)
    relay.on_ack(shared.registry.engines[SECOND], AdapterAck(relayed[0][1].control_id, None))
    assert transport.take() == [(CLIENT, AdapterAck(2, None))]
    relay.engine_joined(late)
    assert transport.take() == []


def test_a_load_that_failed_everywhere_is_not_sent_to_joining_engines() -> None:
    shared, transport, relay = _relay()
    relay.on_signal(CLIENT, LoadAdapter(3, "bad", "/nowhere"))
    own_id = transport.take()[0][1].control_id
    for identity in (FIRST, SECOND):
        relay.on_ack(shared.registry.engines[identity], AdapterAck(own_id, "not a directory"))
    (answer,) = transport.take()
    assert answer[1].error == "engine rank 0: not a directory; engine rank 1: not a directory"
    assert relay.loaded == {}


def test_unknown_peers_and_bad_names_are_refused() -> None:
    _, transport, relay = _relay()
    relay.on_signal(b"stranger", LoadAdapter(4, "sql", "/a"))
    relay.on_signal(CLIENT, LoadAdapter(5, "no spaces", "/a"))
    (stranger, bad_name) = transport.take()
    assert stranger == (b"stranger", (4, "unknown_peer", "connect first"))
    assert bad_name[0] == CLIENT and bad_name[1][1] == "bad_request"


def test_heartbeat_reports_are_checked() -> None:
    report = {"max_loras": 2, "adapters": {"sql": [1, 3, 0]}}
    assert check_adapter_report(report) == report
    for bad in (
        [],
        {"max_loras": 2},
        {"max_loras": "2", "adapters": {}},
        {"max_loras": 2, "adapters": {"bad name": [1, 0, 0]}},
        {"max_loras": 2, "adapters": {"sql": [1, -1, 0]}},
        {"max_loras": 2, "adapters": {"sql": [1, 0]}},
    ):
        with pytest.raises(MalformedAdapterReport):
            check_adapter_report(bad)


def test_a_restarted_coordinator_adopts_what_its_engines_loaded_at_run_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A fresh relay (the coordinator restarted): FIRST and SECOND registered again before the
    # engine that loaded adapters at run time (through the previous coordinator) does.
    shared, transport, relay = _relay()
    late = _late(shared)
    relay.engine_joined(late, {"sql": "/adapters/sql", "chat": "/adapters/chat"})
    assert relay.loaded == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    sent = transport.take()
    # The engines registered before it load them; the reporter is sent nothing it holds.
    assert sorted((identity, record.name) for identity, record in sent) == [
        (FIRST, "chat"), (FIRST, "sql"), (SECOND, "chat"), (SECOND, "sql"),
    ]  # fmt: skip
    assert all(record.control_id == 0 for _, record in sent)
    # A later report of a known name from another directory: the first report wins.
    newcomer = Engine(b"engine-3", 3, 8, "i", 0.0)
    shared.registry.add(newcomer)
    with caplog.at_level("WARNING", logger="dpserve.coordinator"):
        relay.engine_joined(newcomer, {"sql": "/elsewhere/sql"})
    assert relay.loaded["sql"] == "/adapters/sql"
    assert "/elsewhere/sql" in caplog.text and "/adapters/sql" in caplog.text
    # It holds "sql" (from elsewhere: a load would fail), and gets "chat".
    assert transport.take() == [(b"engine-3", LoadAdapter(0, "chat", "/adapters/chat"))]


def test_an_engine_is_not_sent_what_it_reports_holding() -> None:
    shared, transport, relay = _relay()
    relay.loaded["sql"] = "/adapters/sql"
    relay.engine_joined(_late(shared), {"sql": "/adapters/sql"})
    assert transport.take() == []


def test_registration_reports_are_checked() -> None:
    assert check_runtime_adapters(None) == {}
    assert check_runtime_adapters({"sql": "/a/sql"}) == {"sql": "/a/sql"}
    too_long = "/" + "x" * DEFAULT_LORA_LIMITS.max_lora_path_chars
    too_many = {f"a{i}": "/a" for i in range(DEFAULT_LORA_LIMITS.max_registered_loras + 1)}
    for bad in ([], {"bad name": "/a"}, {"sql": 3}, {"sql": ""}, {"sql": too_long}, too_many):
        with pytest.raises(MalformedAdapterReport):
            check_runtime_adapters(bad)
