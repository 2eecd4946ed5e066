"""The engine process: protocol, control states and draining around any ``Runner``.

One loop: handle everything the coordinator sent, heartbeat, run one runner step when there is
work and the engine is not paused, send one ENGINE_REPLY with every finished request (and, at
the stream interval, the new tokens of streaming requests). The same loop serves the fake and
the model runner.

Liveness: the coordinator answers every HEARTBEAT. It counts as silent only when a heartbeat
went unanswered for ``coordinator_timeout`` *as of a moment the engine looked at its socket*:
an answer that arrived during a long step is read right after it, so the engine's own slow
steps are never mistaken for a silent coordinator.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeGuard, runtime_checkable

from dpserve import protocol
from dpserve.engine.connection import CoordinatorConnection
from dpserve.engine.detokenize import RequestText
from dpserve.engine.runner import EngineRequest, RequestRejected, Runner, TokenUpdate
from dpserve.limits import DEFAULT_ENGINE_STATS_LIMITS
from dpserve.protocol import CONTROL_SIGNALS, ControlState, ErrorCode, Header
from dpserve.sampling import InvalidSamplingParams, SamplingParams
from dpserve.tokenizer import IncrementalDetokenizer

log = logging.getLogger("dpserve.engine")

_PAUSED, _SUSPENDED, _STOPPED = ControlState.PAUSED, ControlState.SUSPENDED, ControlState.STOPPED
_WAITING_NOTE_EVERY = 10.0  # seconds between log lines while unregistered


@runtime_checkable
class _ReportsStats(Protocol):
    """A runner with numbers to report (``ModelRunner``: KV pool, capacity, preemptions)."""

    def stats(self) -> Mapping[str, object]: ...


def _is_finite_number(value: object) -> TypeGuard[int | float]:
    # The exact types: a bool is an int subclass but no statistic, and numpy's scalars are left out.
    return (type(value) is int or type(value) is float) and math.isfinite(value)


@dataclass(slots=True, eq=False)
class _Held:
    """A request this engine holds, and what it produced that the coordinator has not seen."""

    stream: bool
    received_at: float
    text: IncrementalDetokenizer  # the tokens' text, sent with them
    ttft: float | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: bytes | None = None  # packed, sent with the next entry


class EngineServer:
    def __init__(
        self,
        connection: CoordinatorConnection,
        runner: Runner,
        *,
        stream_interval: float = 0.05,
        heartbeat_interval: float = 1.0,
        coordinator_timeout: float = 5.0,
        drain_timeout: float = 600.0,
        ready_file: Path | None = None,
    ) -> None:
        self.ready_file = ready_file
        self._registered: bool | None = None
        self.connection = connection
        self.runner = runner
        self.stream_interval = stream_interval
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.drain_timeout = drain_timeout
        self.coordinator_instance: str | None = None
        self.registered = False
        self.paused = False
        self.suspended = False
        self.stopped = False
        self.drain_requested = False
        self.drain_started: float | None = None
        self.drain_acked = False
        self._held: dict[int, _Held] = {}
        self._text = RequestText(runner)
        self._stream_dirty: set[int] = set()
        self._outbox: list[list[object]] = []
        self._last_stream_flush = 0.0
        self._last_heartbeat = 0.0
        self._last_register = 0.0
        # When the oldest heartbeat the coordinator has not answered yet was sent; None: none.
        self._unanswered_since: float | None = None
        self._last_waiting_note = time.monotonic()

    @property
    def registered(self) -> bool:
        return bool(self._registered)

    @registered.setter
    def registered(self, value: bool) -> None:
        # The ready file exists exactly while registered: a pod's exec readiness probe tests it
        # (an emptyDir outlives a container restart, hence the removal on the first set).
        if self.ready_file is not None and value != self._registered:
            self.ready_file.touch() if value else self.ready_file.unlink(missing_ok=True)
        self._registered = value

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT drain: no new work, finish what is held, deregister, exit 0."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.request_drain())

    def request_drain(self) -> None:
        self.drain_requested = True

    def run(self) -> int:
        """Serve until drained or stopped; returns the process exit code."""
        try:
            while not self.stopped:
                busy = self.registered and not self.paused and self.runner.has_work()
                looked_at = time.monotonic()
                if self.connection.poll(0 if busy else 50):
                    self._unanswered_since = None
                    for header, fields in self.connection.receive_all():
                        self._handle(header, fields)
                if self.stopped:
                    break
                self._keep_registered(looked_at)
                if self.registered and not self.paused and self.runner.has_work():
                    self._absorb(self.runner.step())
                self._flush(time.monotonic())
                if self._drain_step(time.monotonic()):
                    break
            return 0
        finally:
            self.connection.close()

    # ------------------------------------------------------------- registration

    def _keep_registered(self, looked_at: float) -> None:
        """Register until acknowledged, then heartbeat. ``looked_at``: when the socket was last
        found with nothing more to read."""
        unanswered = self._unanswered_since
        if (
            self.registered
            and unanswered is not None
            and looked_at - unanswered > self.coordinator_timeout
        ):
            log.warning(
                "no word from the coordinator for %.1f s: registering again",
                looked_at - unanswered,
            )
            self.registered = False
        now = time.monotonic()
        if not self.registered:
            if now - self._last_register >= self.heartbeat_interval:
                self.connection.register()
                self._last_register = now
            self._note_waiting(now)
        elif now - self._last_heartbeat >= self.heartbeat_interval:
            self.connection.send(Header.HEARTBEAT, len(self._held), self._numeric_stats())
            self._last_heartbeat = now
            if self._unanswered_since is None:
                self._unanswered_since = now

    def _numeric_stats(self) -> dict[str, int | float]:
        """The runner's numbers for the coordinator (STATUS, /metrics): what its ``stats()``
        reports that is a finite number, at most as many as the coordinator keeps."""
        if not isinstance(self.runner, _ReportsStats):
            return {}
        try:
            reported = self.runner.stats()
        except Exception:  # the numbers are for dashboards: never let them stop a heartbeat
            log.exception("engine rank %d: the runner's stats failed", self.connection.rank)
            return {}
        numbers = {name: value for name, value in reported.items() if _is_finite_number(value)}
        return dict(sorted(numbers.items())[: DEFAULT_ENGINE_STATS_LIMITS.max_entries])

    def _note_waiting(self, now: float) -> None:
        if now - self._last_waiting_note < _WAITING_NOTE_EVERY:
            return
        self._last_waiting_note = now
        log.info(
            "engine rank %d waiting for the coordinator at %s: %s",
            self.connection.rank,
            self.connection.address,
            "no answer to REGISTER yet"
            if self.connection.handshake.connected
            else "nothing listening yet (still starting?)",
        )

    def _on_register_ack(self, instance: str, state: int) -> None:
        if self.coordinator_instance not in (None, instance):
            self._forget_all("the coordinator restarted")
        self.coordinator_instance = instance
        self.registered = True
        self._unanswered_since = None
        log.info("engine rank %d registered with coordinator %s", self.connection.rank, instance)
        if state == _STOPPED:
            self.stopped = True
            return
        self.paused = state in (_PAUSED, _SUSPENDED)
        if state == _SUSPENDED and not self.suspended:
            self.runner.release()
            self.suspended = True
        elif state != _SUSPENDED and self.suspended:
            self.runner.reload()
            self.suspended = False
        if self.drain_requested and self.drain_started is not None:
            self.connection.send(Header.DRAIN)  # a new coordinator must not route to us

    def _forget_all(self, why: str) -> None:
        """Drop every held request: the coordinator that sent them no longer tracks them (its
        clients resubmit to the new one, or it re-dispatched them elsewhere)."""
        if self._held:
            log.warning("%s: dropping %d request(s) it no longer tracks", why, len(self._held))
        for request_id in self._held:
            self.runner.cancel(request_id)
        self._held.clear()
        self._stream_dirty.clear()
        self._outbox.clear()

    # ---------------------------------------------------------------- messages

    def _handle(self, header: Header, fields: list[Any]) -> None:
        if header is Header.ENGINE_REQUEST:
            self._on_request(*fields)
        elif header is Header.CANCEL:
            (request_id,) = fields
            if self._held.pop(request_id, None) is not None:
                self.runner.cancel(request_id)
                self._stream_dirty.discard(request_id)
        elif header in CONTROL_SIGNALS:
            self._on_control(header, fields[0])
        elif header is Header.HEARTBEAT_ACK:
            if self.coordinator_instance not in (None, fields[0]):
                self.registered = False  # restarted: register with the new one
        elif header is Header.REGISTER_ACK:
            self._on_register_ack(*fields)
        elif header is Header.DRAIN_ACK:
            self.drain_acked = True
        elif header is Header.ERROR:
            _ref, code, message = fields
            if code == ErrorCode.UNKNOWN_PEER:
                self._forget_all("the coordinator does not know this engine")
                self.registered = False
            else:
                log.warning("coordinator error: %s: %s", code, message)
        else:
            log.warning("ignoring unexpected %s from the coordinator", header.name)

    def _on_request(
        self, request_id: int, prompt: bytes, params: dict[str, Any], resume: bytes
    ) -> None:
        try:
            request = EngineRequest(
                request_id,
                protocol.unpack_tokens(prompt),
                SamplingParams.deserialize(params),
                protocol.unpack_tokens(resume),
            )
            self.runner.add(request)
        except RequestRejected as exc:
            self._outbox.append([request_id, b"", None, exc.code, exc.message, None])
            return
        except (InvalidSamplingParams, protocol.ProtocolError) as exc:
            self._outbox.append([request_id, b"", None, ErrorCode.BAD_REQUEST, str(exc), None])
            return
        self._held[request_id] = _Held(
            request.params.stream, time.monotonic(), self._text.start(request.resume_tokens)
        )

    def _on_control(self, signal_header: Header, control_id: int) -> None:
        if signal_header is Header.PAUSE:
            self.paused = True
        elif signal_header is Header.UNPAUSE:
            self.paused = False
        elif signal_header is Header.SUSPEND:
            self.paused = True
            if not self.suspended:
                self.runner.release()
                self.suspended = True
        elif signal_header is Header.RESUME:
            if self.suspended:
                self.runner.reload()
                self.suspended = False
        elif signal_header is Header.STOP:
            self._forget_all("stop")
            self.stopped = True
        log.info("engine rank %d: %s", self.connection.rank, signal_header.name)
        self.connection.send(Header.CONTROL_ACK, int(signal_header), control_id)

    # ----------------------------------------------------------------- results

    def _absorb(self, updates: list[TokenUpdate]) -> None:
        now = time.monotonic()
        for update in updates:
            held = self._held.get(update.request_id)
            if held is None:
                continue
            if held.ttft is None and update.tokens:
                held.ttft = now - held.received_at
            held.tokens.extend(update.tokens)
            if update.logprobs is not None:
                if held.logprobs is None:
                    held.logprobs = []
                held.logprobs.extend(update.logprobs)
                if update.top_logprobs is not None:
                    if held.top_logprobs is None:
                        held.top_logprobs = []
                    held.top_logprobs.extend(update.top_logprobs)
            if update.prompt_logprobs is not None:
                held.prompt_logprobs = protocol.pack_logprobs(
                    update.prompt_logprobs, update.prompt_top_logprobs
                )
            if update.finish_reason is not None:
                del self._held[update.request_id]
                self._stream_dirty.discard(update.request_id)
                entry = self._entry(update.request_id, held, update.finish_reason)
                if update.stop_token is not None:
                    entry += [None] * (8 - len(entry)) + [update.stop_token]
                self._outbox.append(entry)
            elif held.stream:
                self._stream_dirty.add(update.request_id)

    @staticmethod
    def _entry(request_id: int, held: _Held, finish_reason: str | None) -> list[object]:
        entry = [
            request_id,
            protocol.pack_tokens(held.tokens),
            None
            if held.logprobs is None
            else protocol.pack_logprobs(held.logprobs, held.top_logprobs),
            finish_reason,
            None,
            held.ttft,
            held.text.push(held.tokens, final=finish_reason is not None),
        ]
        if held.prompt_logprobs is not None:
            entry.append(held.prompt_logprobs)
            held.prompt_logprobs = None
        held.tokens = []
        held.logprobs = None if held.logprobs is None else []
        held.top_logprobs = None if held.top_logprobs is None else []
        return entry

    def _flush(self, now: float) -> None:
        if self._stream_dirty and now - self._last_stream_flush >= self.stream_interval:
            for request_id in self._stream_dirty:
                self._outbox.append(self._entry(request_id, self._held[request_id], None))
            self._stream_dirty.clear()
            self._last_stream_flush = now
        if self._outbox and self.registered:
            self.connection.send(Header.ENGINE_REPLY, self._outbox)
            self._outbox = []

    # ----------------------------------------------------------------- draining

    def _drain_step(self, now: float) -> bool:
        """Advance a requested drain; True when the engine may exit."""
        if not self.drain_requested:
            return False
        if self.drain_started is None:
            self.drain_started = now
            log.info("engine rank %d draining %d request(s)", self.connection.rank, len(self._held))
            if not self.registered:
                return True  # nobody routes to us: nothing to finish
            self.connection.send(Header.DRAIN)
            return False
        if now - self.drain_started > self.drain_timeout:
            log.warning("drain timed out with %d request(s) unfinished", len(self._held))
            return True
        if not self.registered:
            # The coordinator is gone: whatever we hold is re-dispatched or resubmitted by
            # its clients, so waiting would only delay the shutdown.
            log.warning(
                "draining without a coordinator: leaving with %d request(s)", len(self._held)
            )
            return True
        if self.drain_acked and not self._held and not self._outbox:
            self.connection.send(Header.DEREGISTER)
            log.info("engine rank %d drained; leaving", self.connection.rank)
            return True
        return False
