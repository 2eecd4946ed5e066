"""HandshakeWatch tells a coordinator still starting from one that refuses this peer."""

from __future__ import annotations

import zmq

from dpserve.handshake import REFUSALS_BEFORE_GIVING_UP, HandshakeWatch

MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
EPIPE = 32


def watch(has_keys: bool) -> HandshakeWatch:
    return HandshakeWatch("tcp://127.0.0.1:5555", "client", has_keys, "allowed/client/")


def test_nothing_listening_is_not_a_refusal():
    plain = watch(has_keys=False)
    for event in (zmq.EVENT_DISCONNECTED,) * 50:
        assert plain.observe(event, 0) is None
    assert not plain.connected


def test_missing_keys_against_a_curve_coordinator():
    plain = watch(has_keys=False)
    assert plain.observe(zmq.EVENT_CONNECTED, 15) is None
    assert plain.connected
    refusal = plain.observe(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, MISMATCH)
    assert refusal is not None and "requires CURVE credentials" in refusal
    # A plain peer whose connection drops mid-handshake was not refused.
    assert watch(False).observe(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, EPIPE) is None


def test_a_key_the_coordinator_does_not_allow():
    refusal = watch(has_keys=True).observe(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    assert refusal is not None
    assert "key not allowed" in refusal and "allowed/client/" in refusal


def test_repeated_silent_failures_are_a_refusal_but_one_is_not():
    keyed = watch(has_keys=True)
    for _ in range(REFUSALS_BEFORE_GIVING_UP - 1):
        assert keyed.observe(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, EPIPE) is None
    assert keyed.observe(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) is None
    assert keyed.failures == 0, "a success in between starts the count again"
    results = [
        keyed.observe(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, EPIPE)
        for _ in range(REFUSALS_BEFORE_GIVING_UP)
    ]
    assert results[:-1] == [None] * (REFUSALS_BEFORE_GIVING_UP - 1)
    assert results[-1] is not None and "coordinator.key" in results[-1]
