"""Each engine's measured pace and the price the prefix-aware router puts on a wait for a slot."""

from __future__ import annotations

import pytest

from dpserve import protocol
from dpserve.block_hash import block_hashes
from dpserve.coordinator.engine_pace import (
    MAX_WAIT_PRICE_TOKENS,
    MIN_PREFILL_SAMPLE_TOKENS,
    EnginePace,
    running_at_once,
    wait_price_tokens,
)
from dpserve.coordinator.registry import Engine, EngineRegistry
from dpserve.coordinator.requests import InflightRequest
from dpserve.coordinator.router import Router
from dpserve.coordinator.routing import (
    DEFAULT_PREFIX_ROUTING,
    Candidate,
    Reason,
    RoutingPolicy,
    choose_by_prefix,
)
from tests.unit.test_prefix_routing import CLEARED, batch, stored

A, B = b"engine-a", b"engine-b"
FLOOR = DEFAULT_PREFIX_ROUTING.request_cost_tokens


def test_the_price_is_a_finish_interval_in_the_engines_prefill_tokens() -> None:
    # A request finishes every 0.75 s; 400 prompt tokens prefilled a second: 300 tokens.
    assert wait_price_tokens(0.75, 400.0, floor=FLOOR) == pytest.approx(300.0)
    # Unmeasured: no price beyond the constant one.
    assert wait_price_tokens(None, 400.0, floor=FLOOR) == 0.0
    assert wait_price_tokens(0.75, None, floor=FLOOR) == 0.0
    # A fast engine's wait is never cheaper than a running request; a stalled one is bounded.
    assert wait_price_tokens(0.001, 400.0, floor=FLOOR) == FLOOR
    assert wait_price_tokens(1e9, 400.0, floor=FLOOR) == MAX_WAIT_PRICE_TOKENS


def test_a_request_waits_only_past_what_the_engine_runs_at_once() -> None:
    pace = EnginePace(FLOOR, wait_price_tokens=300.0)
    assert pace.slot_wait_tokens(outstanding=3, capacity=4, stats={}) == 0.0
    assert pace.slot_wait_tokens(outstanding=4, capacity=4, stats={}) == 300.0
    assert pace.slot_wait_tokens(outstanding=6, capacity=4, stats={}) == 900.0
    # A heartbeat that ran 2 with others waiting: 2 at once, until the next heartbeat.
    assert pace.slot_wait_tokens(2, 4, {"running": 2, "waiting": 3}) == 300.0
    assert pace.slot_wait_tokens(2, 4, {"running": 2, "waiting": 0}) == 0.0
    # Its capacity, unless its last heartbeat had fewer running while others waited.
    assert running_at_once(4, running=2, waiting=3) == 2
    assert running_at_once(4, running=2, waiting=0) == 4  # only two to run
    assert running_at_once(4, running=None, waiting=None) == 4  # not reported
    assert running_at_once(4, running=0, waiting=5) == 4  # a heartbeat between batches
    assert running_at_once(4, running=6, waiting=1) == 4


def test_the_engines_pace_is_its_busy_time_per_finish_and_fast_prefills() -> None:
    pace = EnginePace(FLOOR)
    pace.started(10.0)
    pace.request_finished(11.0)  # one second busy, one finished
    pace.request_finished(11.5)  # half a second since the last finish
    assert pace.seconds_per_request == pytest.approx((0.9 * 1.0 + 0.5) / (0.9 + 1.0))
    pace.started(20.0)  # idle from 11.5 to 20: not busy time
    pace.request_finished(20.5)
    assert pace.busy_seconds == pytest.approx(0.9 * (0.9 * 1.0 + 0.5) + 0.5)
    # Prefill: a short one says nothing, nor the first (the engine's warm-up); of the rest
    # the median of the last 16.
    pace.prefilled(5.0, MIN_PREFILL_SAMPLE_TOKENS - 1)
    pace.prefilled(30.0, 400)
    assert pace.prefill_tokens_per_second is None
    for seconds in (1.0, 4.0, 0.5):  # 400, 100 and 800 tokens a second
        pace.prefilled(seconds, 400)
    assert pace.prefill_tokens_per_second == 400.0
    for _ in range(16):
        pace.prefilled(0.5, 400)
    assert pace.prefill_tokens_per_second == 800.0
    assert pace.wait_price_tokens == pytest.approx(800.0 * pace.busy_seconds / pace.finished)
    assert pace.runs(4, {"running": 2, "waiting": 1}) == 2


def test_a_measured_wait_moves_a_cached_prefix_to_an_idle_engine() -> None:
    # Two engines of 2 slots; A holds a 256-token prefix, B nothing. A's pace is measured from
    # one request: 300 tokens prefilled in 1 s, finished 0.5 s later (1.5 s busy for one
    # request). With A's two slots taken one more request there waits for a finish: 1.5 s at
    # 300 tokens/s = 450 tokens, more than B's whole 272-token prefill.
    now = [0.0]
    registry = EngineRegistry()
    router = Router(RoutingPolicy.PREFIX_AWARE, registry, clock=lambda: now[0])
    for identity, instance in ((A, "a1"), (B, "b1")):
        engine = Engine(identity, len(registry), capacity=2, instance=instance, last_seen=0)
        registry.add(engine)
        router.engine_added(engine)
    engine_a = registry.engines[A]
    prompt = list(range(272))
    router.on_kv_events(
        engine_a, batch("a1", 0, 16, [CLEARED, stored(block_hashes(prompt[:256], 16))])
    )
    router.on_kv_events(registry.engines[B], batch("b1", 0, 16, [CLEARED]))

    def request(request_id: int, tokens: list[int]) -> InflightRequest:
        return InflightRequest(
            request_id, b"client", request_id, protocol.pack_tokens(tokens), {}, False, 0.0
        )

    def choose(request_id: int) -> tuple[bytes, Reason]:
        decision = router.choose(request(request_id, prompt))
        assert decision is not None
        return decision.identity, decision.reason

    engine_a.outstanding = {101, 102}  # both slots taken
    # Unmeasured: the constant price, and A's cached prefix outweighs two requests in flight.
    assert choose(1) == (A, Reason.PREFIX)

    # One request, with a prompt A holds none of, measured on A (idle when it was sent; A's
    # warm-up request came before).
    router.paces[A].warmed_up = True
    measured = request(7, [9_999] * 300)
    decision = choose_by_prefix([Candidate(A, 0, 0)], 300)
    assert decision is not None
    engine_a.outstanding = {7}
    router.routed(measured, decision)
    measured.engine = A
    now[0] = 1.0
    router.first_token(7)
    now[0] = 1.5
    router.finished(measured, 0)
    router.forget(7)
    assert router.paces[A].wait_price_tokens == pytest.approx(450.0)
    assert router.status()["pace_by_rank"] == {
        "0": {
            "wait_price_tokens": 450.0,
            "seconds_per_request": 1.5,
            "prefill_tokens_per_second": 300.0,
        },
        "1": {"wait_price_tokens": 0.0},
    }

    engine_a.outstanding = {101, 102}
    assert choose(2) == (B, Reason.BALANCE)
    # With a slot free on A the wait costs nothing: A again (once B's predicted copy of the
    # prefix, from the choice just made, has expired).
    now[0] += 2 * router.index.prediction_ttl
    engine_a.outstanding = {101}
    assert choose(3) == (A, Reason.PREFIX)
    # Unless A's last heartbeat said its KV pool ran one request with others waiting.
    engine_a.stats = {"running": 1, "waiting": 1}
    assert choose(4) == (B, Reason.BALANCE)
    # An engine that leaves takes its pace with it.
    router.engine_removed(engine_a)
    assert A not in router.paces


def test_only_the_prefix_aware_policy_measures_and_reports_a_pace() -> None:
    registry = EngineRegistry()
    router = Router(RoutingPolicy.LEAST_OUTSTANDING, registry)
    engine = Engine(A, 0, capacity=2, instance="a1", last_seen=0)
    registry.add(engine)
    router.engine_added(engine)
    request = InflightRequest(1, b"client", 1, protocol.pack_tokens([5] * 300), {}, False, 0.0)
    request.engine = A
    router.finished(request, None)
    assert router.paces == {} and router.status()["pace_by_rank"] == {}


def test_only_a_request_that_found_the_engine_free_times_its_prefill() -> None:
    # Its dispatch-to-first-token time is its own prefill only with a slot free and no
    # prefill queued ahead; otherwise it measures the queue, not the engine.
    now = [0.0]
    registry = EngineRegistry()
    router = Router(RoutingPolicy.PREFIX_AWARE, registry, clock=lambda: now[0])
    engine = Engine(A, 0, capacity=1, instance="a1", last_seen=0)
    registry.add(engine)
    router.engine_added(engine)

    def send(request_id: int, outstanding: set[int]) -> None:
        request = InflightRequest(
            request_id, b"client", request_id, protocol.pack_tokens([5] * 300), {}, False, 0.0
        )
        engine.outstanding = outstanding
        router.routed(request, choose_by_prefix([Candidate(A, 0, 0)], 300) or pytest.fail())

    router.paces[A].warmed_up = True
    send(1, {1})  # alone
    send(2, {1, 2})  # behind request 1's prefill, and no slot free
    now[0] = 1.0
    router.first_token(1)
    now[0] = 5.0
    router.first_token(2)
    assert list(router.paces[A].prefill_rates) == [300.0]


def test_an_engine_loaded_from_its_start_is_priced_by_its_queued_prefills() -> None:
    pace = EnginePace(FLOOR)
    pace.prefilled(20.0, 300)  # its warm-up: left out
    pace.request_finished(1.0)
    pace.started(1.0)
    pace.request_finished(2.0)  # a second a request
    # No request found it free since: the upper quartile of those that waited, timed over
    # the prefill ahead of them.
    for seconds in (4.0, 2.0, 8.0, 1.0):  # 250, 500, 125 and 1,000 tokens a second
        pace.prefilled_queued(seconds, 1_000)
    assert pace.prefill_tokens_per_second == 1_000.0
    assert pace.wait_price_tokens == pytest.approx(1_000.0)
    # The first one timed alone takes over, and the waiting ones count no more.
    pace.prefilled(0.5, 200)
    pace.prefilled_queued(0.1, 1_000)
    assert pace.prefill_tokens_per_second == 400.0
    assert pace.wait_price_tokens == pytest.approx(400.0)
