"""``Refusals``: how the coordinator answers input it will not handle — malformed, oversized,
or not permitted to the sender's role. Each kind is counted (STATUS ``counters``) and logged,
the first few and then one in ``LOG_EVERY``, so that a flood cannot fill the log."""

from __future__ import annotations

import logging
from typing import Any

from dpserve.coordinator.shared import SharedState
from dpserve.protocol import HEADER_OF, ErrorCode, Header, MessageTooLarge
from dpserve.security import roles

log = logging.getLogger("dpserve.coordinator")

LOG_FIRST = 10
LOG_EVERY = 1000


class Refusals:
    def __init__(self, shared: SharedState) -> None:
        self.shared = shared

    def _count_and_log(self, counter: str, what: str, identity: bytes, reason: str) -> None:
        count = self.shared.counters[counter] = self.shared.counters[counter] + 1
        if count <= LOG_FIRST or count % LOG_EVERY == 0:
            log.warning("%s #%d from %r: %s", what, count, identity, reason)

    def forbidden(self, identity: bytes, role: str, record: Any) -> None:
        ref, reason = roles.forbidden(role, HEADER_OF[type(record)], record)
        self._count_and_log("forbidden", "refused message", identity, reason)
        self.shared.transport.error(identity, ref, ErrorCode.FORBIDDEN, reason)

    def bad_input(self, identity: bytes, reason: str) -> None:
        self._count_and_log("bad_messages", "bad message", identity, reason)
        if identity in self.shared.clients:
            self.shared.transport.error(identity, None, ErrorCode.BAD_MESSAGE, reason)

    def too_large(self, identity: bytes, exc: MessageTooLarge) -> None:
        """Refuse an oversized request by its id, so that its sender fails it at once."""
        if exc.header != Header.SUBMIT_REQUEST or identity not in self.shared.clients:
            self.bad_input(identity, str(exc))
            return
        self.shared.counters["too_large"] += 1
        self.shared.transport.error(
            identity,
            exc.reference,
            ErrorCode.MESSAGE_TOO_LARGE,
            f"the request's message has {exc.size} bytes; this coordinator accepts at most "
            f"{exc.limit} (--max-message-bytes)",
        )
