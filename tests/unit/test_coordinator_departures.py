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
from dpserve.protocol import EngineRequest, EngineRequests, Register, decode

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


def test_a_turns_requests_go_to_a_batching_engine_in_one_message() -> None:
    shared, transport, dispatcher, _ = _parts()
    shared.registry.remove(GONE)  # one engine: every request goes to ALIVE
    shared.registry.engines[ALIVE].batched_requests = True
    requests = [_request(shared) for _ in range(3)]
    for request in requests:
        dispatcher.dispatch(request)
    assert transport.sent == [], "held until the turn's end"
    assert all(r.engine == ALIVE for r in requests)
    cancelled = requests[1]
    dispatcher.cancel(cancelled)  # before the send: it never goes out
    dispatcher.send_batched()
    batches = [record for _, record in transport.sent if isinstance(record, EngineRequests)]
    (batch,) = batches
    assert [e.request_id for e in batch.requests] == [
        requests[0].request_id,
        requests[2].request_id,
    ]


def test_a_batch_whose_engine_is_gone_is_dispatched_again_in_the_same_call() -> None:
    shared, transport, dispatcher, membership = _parts()
    for identity in (GONE, ALIVE):
        shared.registry.engines[identity].batched_requests = True
    requests = [_request(shared) for _ in range(4)]
    for request in requests:
        dispatcher.dispatch(request)  # round robin: GONE, ALIVE, GONE, ALIVE
    assert {r.engine for r in requests} == {GONE, ALIVE}
    dispatcher.send_batched()
    assert all(r.engine == ALIVE for r in requests)
    assert shared.registry.engines[GONE].outstanding == set()
    sent = [
        e.request_id for _, r in transport.sent if isinstance(r, EngineRequests) for e in r.requests
    ]
    assert sorted(sent) == sorted(r.request_id for r in requests), "each sent once, to ALIVE"
    membership.remove_unreachable()
    assert GONE not in shared.registry.engines
    assert shared.counters["redispatched"] == 0, "nothing was on GONE to hand over"


def test_batches_are_cut_by_size() -> None:
    from dpserve.coordinator.dispatch import BATCH_BYTES, _chunks

    assert _chunks([1, 2, 3]) == [(0, 3)]
    assert _chunks([BATCH_BYTES, 1, BATCH_BYTES - 1, 5]) == [(0, 1), (1, 3), (3, 4)]
    assert _chunks([2 * BATCH_BYTES]) == [(0, 1)], "a large request goes alone"
