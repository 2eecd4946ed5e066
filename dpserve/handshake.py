"""Why a peer is not getting through to the coordinator, from ZMQ's socket monitor.

A refused CURVE handshake is invisible on the socket itself: messages just wait. libzmq reports
it only as a monitor event, so clients and engines watch their socket's events and tell three
cases apart:

* nothing listening yet (connections refused, ``CONNECT_RETRIED``): a coordinator still
  starting. Patience, with a log line now and then;
* the coordinator requires CURVE and this peer has no keys: the handshake fails at once with a
  mechanism mismatch (``HANDSHAKE_FAILED_PROTOCOL``), and libzmq does not try again;
* this peer's key is not allowed: the coordinator's authenticator denies it
  (``HANDSHAKE_FAILED_AUTH``, status 400), and libzmq does not try again;
* a stale ``coordinator.key``, or a coordinator without CURVE: the coordinator closes the
  connection during the handshake (``HANDSHAKE_FAILED_NO_DETAIL``) and libzmq retries every
  ~0.1 s. ``REFUSALS_BEFORE_GIVING_UP`` such failures in a row, with no success between, are a
  refusal: a coordinator killed in the middle of one handshake is not.
"""

from __future__ import annotations

from typing import Final

import zmq

# Every event a HandshakeWatch looks at.
WATCHED_EVENTS: Final = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
REFUSALS_BEFORE_GIVING_UP: Final = 3


class HandshakeWatch:
    """Feed it a socket's monitor events; ``observe`` returns the reason once the coordinator
    has refused this peer for good. ``connected`` is False while nothing is listening."""

    def __init__(self, address: str, who: str, has_keys: bool, key_hint: str) -> None:
        """``who``: "client" or "engine", for messages; ``key_hint``: where this peer's key
        must be listed on the coordinator (e.g. "allowed/engine/")."""
        self.address = address
        self.who = who
        self.has_keys = has_keys
        self.key_hint = key_hint
        self.connected = False
        self.succeeded = False
        self.failures = 0  # handshake failures since the last success

    def observe(self, event: int, value: int) -> str | None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded = True
            self.failures = 0
        elif event & _FAILED:
            self.succeeded = False
            self.failures += 1
            return self._refusal(event, value)
        return None

    def _refusal(self, event: int, value: int) -> str | None:
        mismatch = (
            event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        )
        if not self.has_keys:
            if mismatch:
                return (
                    f"the coordinator at {self.address} requires CURVE credentials and this "
                    f"{self.who} has none: pass --credentials DIR (or $DPSERVE_CREDENTIALS)"
                )
            return None  # a plain peer has no key to refuse: a connection dropped mid-way
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"the coordinator at {self.address} refused this {self.who}'s CURVE handshake: "
                f"key not allowed (status {value}); its public key must be listed in the "
                f"coordinator's {self.key_hint}"
            )
        if mismatch or self.failures >= REFUSALS_BEFORE_GIVING_UP:
            return (
                f"the coordinator at {self.address} refused this {self.who}'s CURVE handshake "
                f"({_event_name(event)}): coordinator.key is not the coordinator's current "
                "public key, or the coordinator does not use CURVE"
            )
        return None


def _event_name(event: int) -> str:
    try:
        return zmq.Event(event).name or str(event)
    except ValueError:
        return str(event)
