"""Engine control states and the one table of allowed transitions.

``docs/protocol.md`` shows the same table; ``tests/unit/test_control.py`` checks they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

from dpserve.protocol import Header


class ControlState(IntEnum):
    RUNNING = 0
    PAUSED = 1  # engines keep their requests and accept new ones, but do not step
    SUSPENDED = 2  # paused, and the model's and KV cache's memory released
    STOPPED = 3  # engines exited; the coordinator answers every request with an error


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
