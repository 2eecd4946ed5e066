"""A send that finds an engine gone does not remove it in the middle of the send: dispatching
goes on to another engine, and the loop removes the gone one afterwards (its requests then go
to the others). No socket: the transport is a stand-in that fails sends to chosen peers."""

from __future__ import annotations

from collections import deque
from typing import Any, cast

from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.control import ControlRelay
from dpserve.coordinator.dispatch import Dispatcher
from dpserve.coordinator.membership import Membership
from dpserve.coordinator.registry import Client, Engine
from dpserve.coordinator.requests import InflightRequest, RequestTable
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.coordinator.shared import SharedState
from dpserve.coordinator.transport import Transport
from dpserve.protocol import EngineRequest, Register, decode

GONE, ALIVE, CLIENT = b"gone", b"alive", b"client"


class StandInTransport:
    """What the parts use of ``Transport``: sends to ``gone`` peers fail and are noted."""

    def __init__(self, gone: set[bytes]) -> None:
        self.gone = gone
        self.unreachable: deque[bytes] = deque()
        self.sent: list[tuple[bytes, Any]] = []

    def send(self, identity: bytes, payload: bytes) -> bool:
        if identity in self.gone:
            self.unreachable.append(identity)
            return False
        self.sent.append((identity, decode(payload)))
        return True

    def error(self, identity: bytes, ref: int | None, code: str, message: str) -> None:
        if identity in self.gone:
            self.unreachable.append(identity)
        else:
            self.sent.append((identity, (ref, code, message)))


def _parts() -> tuple[SharedState, StandInTransport, Dispatcher, Membership]:
    transport = StandInTransport({GONE})
    shared = SharedState(
        config=CoordinatorConfig(),
        routing=RoutingPolicy.ROUND_ROBIN,
        instance_id="test",
        tokenizer=cast(Any, None),
        transport=cast(Transport, transport),
        requests=RequestTable(first_id=1),
    )
    for rank, identity in enumerate((GONE, ALIVE)):
        shared.registry.add(Engine(identity, rank, 8, "i", 0.0))
    shared.clients[CLIENT] = Client(CLIENT)
    dispatcher = Dispatcher(shared)
    membership = Membership(shared, dispatcher, ControlRelay(shared, dispatcher))
    return shared, transport, dispatcher, membership


def _request(shared: SharedState) -> InflightRequest:
    request_id = shared.requests.new_id()
    request = InflightRequest(request_id, CLIENT, request_id, b"", {}, False, 0.0)
    shared.requests.add(request)
    shared.clients[CLIENT].inflight += 1
    return request


def test_a_failed_send_only_stops_routing_to_the_engine_until_the_loop_removes_it() -> None:
    shared, transport, dispatcher, membership = _parts()
    held = _request(shared)  # already on the engine that is gone
    held.engine = GONE
    shared.registry.engines[GONE].outstanding.add(held.request_id)

    fresh = _request(shared)
    dispatcher.dispatch(fresh)  # round robin picks GONE first: the send fails
    assert fresh.engine == ALIVE
    assert GONE in shared.registry.engines, "not removed in the middle of the send"
    assert list(shared.registry.routable) == [ALIVE]
    assert list(transport.unreachable) == [GONE]

    membership.remove_unreachable()
    assert GONE not in shared.registry.engines and not transport.unreachable
    assert held.engine == ALIVE, "its request went to the engine left"
    assert shared.counters["redispatched"] == 1
    sent_to_alive = [r.request_id for who, r in transport.sent if isinstance(r, EngineRequest)]
    assert sent_to_alive == [fresh.request_id, held.request_id]


def test_a_vanished_client_is_forgotten_with_its_requests_after_the_send() -> None:
    shared, transport, dispatcher, membership = _parts()
    transport.gone = {CLIENT}
    failed, also_failed, other = _request(shared), _request(shared), _request(shared)
    for request in (failed, also_failed, other):
        dispatcher.dispatch(request)
    dispatcher.fail(failed, "engine_error", "x")  # the error cannot reach the client
    dispatcher.fail(also_failed, "engine_error", "x")
    assert CLIENT in shared.clients, "not removed in the middle of the send"
    assert list(transport.unreachable) == [CLIENT, CLIENT]  # noted twice, removed once
    membership.remove_unreachable()
    assert CLIENT not in shared.clients and shared.counters["clients_vanished"] == 1
    assert len(shared.requests) == 0, "its other request was cancelled"
    cancels = [r for who, r in transport.sent if type(r).__name__ == "Cancel"]
    assert [c.ref for c in cancels] == [other.request_id]


def test_an_engine_restarted_under_its_rank_replaces_its_dead_predecessor_at_once() -> None:
    """dpserve serve restarts a dead engine with its rank (a StatefulSet pod keeps its
    ordinal): the newcomer's registration probes the others of that rank, and a dead one is
    removed then, not when its heartbeats time out; its requests go on elsewhere."""
    shared, transport, _, membership = _parts()
    held = _request(shared)
    held.engine = GONE
    shared.registry.engines[GONE].outstanding.add(held.request_id)
    membership.on_register(b"restarted", Register(0, 8, "new"))  # GONE had rank 0
    assert list(transport.unreachable) == [GONE]
    membership.remove_unreachable()
    assert set(shared.registry.engines) == {ALIVE, b"restarted"}
    assert held.engine in (ALIVE, b"restarted")
    # A live engine that shares a rank is only probed (a heartbeat ack), never removed.
    membership.on_register(b"twin", Register(1, 8, "other"))  # ALIVE has rank 1
    membership.remove_unreachable()
    assert set(shared.registry.engines) == {ALIVE, b"restarted", b"twin"}
