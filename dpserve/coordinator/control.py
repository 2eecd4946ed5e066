"""The one table of allowed control-state transitions (the states are
``dpserve.protocol.ControlState``), and ``ControlRelay``: a
client's control signal relayed to every engine and acknowledged once all of them did.

``docs/protocol.md`` shows the same table; ``tests/unit/test_coordinator_parts.py`` checks
that they agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Final

from dpserve import protocol
from dpserve.coordinator.dispatch import Dispatcher
from dpserve.coordinator.registry import Engine
from dpserve.coordinator.shared import SharedState
from dpserve.protocol import ControlAck, ControlState, ErrorCode, Header

log = logging.getLogger("dpserve.coordinator")


# (state, signal) -> next state. Anything not listed is answered with INVALID_TRANSITION.
TRANSITIONS: Final[dict[tuple[ControlState, Header], ControlState]] = {
    (ControlState.RUNNING, Header.PAUSE): ControlState.PAUSED,
    (ControlState.PAUSED, Header.UNPAUSE): ControlState.RUNNING,
    (ControlState.PAUSED, Header.SUSPEND): ControlState.SUSPENDED,
    (ControlState.SUSPENDED, Header.RESUME): ControlState.PAUSED,
    (ControlState.RUNNING, Header.STOP): ControlState.STOPPED,
    (ControlState.PAUSED, Header.STOP): ControlState.STOPPED,
    (ControlState.SUSPENDED, Header.STOP): ControlState.STOPPED,
}


class InvalidTransition(Exception):
    pass


def next_state(state: ControlState, signal: Header) -> ControlState:
    try:
        return TRANSITIONS[(state, signal)]
    except KeyError:
        allowed = sorted(s.name for (current, s) in TRANSITIONS if current is state)
        raise InvalidTransition(
            f"cannot {signal.name} while engines are {state.name}; "
            f"allowed now: {', '.join(allowed) or 'nothing'}"
        ) from None


@dataclass(slots=True)
class ControlOperation:
    """A signal relayed to every engine; done when each one acknowledged it or left."""

    signal: Header
    control_id: int
    requester: bytes  # the client to answer
    target: ControlState
    waiting_for: set[bytes] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return not self.waiting_for


class ControlRelay:
    """The engines' control state, and the one control operation in progress."""

    def __init__(self, shared: SharedState, dispatcher: Dispatcher) -> None:
        self.shared = shared
        self.dispatcher = dispatcher
        self.state = ControlState.RUNNING
        self.operation: ControlOperation | None = None

    def on_signal(self, identity: bytes, record: Any) -> None:
        """A client's PAUSE, UNPAUSE, SUSPEND, RESUME or STOP record."""
        header, control_id = protocol.HEADER_OF[type(record)], record.control_id
        error = self._refusal(header, identity)
        if error is not None:
            self.shared.transport.error(identity, control_id, *error)
            return
        self.operation = ControlOperation(
            header,
            control_id,
            identity,
            next_state(self.state, header),
            set(self.shared.registry.engines),
        )
        payload = protocol.encode(record)
        for engine_identity in list(self.operation.waiting_for):
            self.shared.transport.send(engine_identity, payload)
        self._maybe_finish()

    def _refusal(self, header: Header, identity: bytes) -> tuple[str, str] | None:
        if identity not in self.shared.clients:
            return ErrorCode.UNKNOWN_PEER, "connect before sending control signals"
        if self.operation is not None:
            return (
                ErrorCode.CONTROL_BUSY,
                f"{self.operation.signal.name} is still waiting for engine acknowledgements",
            )
        try:
            next_state(self.state, header)
        except InvalidTransition as exc:
            return ErrorCode.INVALID_TRANSITION, str(exc)
        return None

    def on_ack(self, engine: Engine, ack: ControlAck) -> None:
        control_id = ack.control_id
        if self.operation is None or control_id != self.operation.control_id:
            return  # an acknowledgement that arrived after its engine was given up on
        self.operation.waiting_for.discard(engine.identity)
        self._maybe_finish()

    def engine_joined(self, identity: bytes) -> None:
        """An engine that registers mid-operation must reach the same state before we answer."""
        if self.operation is not None:
            self.operation.waiting_for.add(identity)
            self.shared.transport.send(
                identity,
                protocol.encode(protocol.RECORDS[self.operation.signal](self.operation.control_id)),
            )

    def engine_left(self, engine: Engine) -> None:
        if self.operation is not None and engine.identity in self.operation.waiting_for:
            self.operation.waiting_for.discard(engine.identity)
            self._maybe_finish()

    def _maybe_finish(self) -> None:
        operation = self.operation
        if operation is None or not operation.done:
            return
        self.operation = None
        self.state = operation.target
        log.info("engines %s", operation.target.name)
        if operation.target is ControlState.STOPPED:
            self.dispatcher.fail_all(
                ErrorCode.STOPPED, "engines were stopped before this request finished"
            )
        if operation.requester in self.shared.clients:
            self.shared.transport.send(
                operation.requester,
                protocol.encode(ControlAck(operation.signal, operation.control_id)),
            )
