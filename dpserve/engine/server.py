"""The engine process: protocol, control states and draining around any ``Runner``.

One loop: handle everything the coordinator sent, heartbeat, run one runner step when there is
work and the engine is not paused, send one ENGINE_REPLY with every finished request and every
request's first tokens (and, at the stream interval, the new tokens of streaming requests, taken
from the runner in one pass). The same loop serves the fake and the model runner.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from dpserve import protocol
from dpserve.engine.connection import EngineConnection
from dpserve.engine.detokenize import RequestText
from dpserve.engine.kv_events import KVEventPublisher, ReportsKVEvents
from dpserve.engine.lora.serving import AdapterError, ServesAdapters
from dpserve.engine.runner import RequestRejected, Runner, RunnerRequest, TokenUpdate
from dpserve.limits import DEFAULT_ENGINE_STATS_LIMITS
from dpserve.protocol import (
    ADAPTER_SIGNALS,
    CONTROL_SIGNALS,
    AdapterAck,
    Cancel,
    ControlAck,
    ControlState,
    Deregister,
    Drain,
    DrainAck,
    EngineReply,
    EngineUpdate,
    Error,
    ErrorCode,
    HandOff,
    HandOffAck,
    Header,
    Heartbeat,
    HeartbeatAck,
    KvSnapshotRequest,
    LoadAdapter,
    RegisterAck,
    UnloadAdapter,
)
from dpserve.sampling import InvalidSamplingParams, ParamsMemo, SamplingParams
from dpserve.tokenizer import IncrementalDetokenizer, prepare_detokenizing, push_batch

log = logging.getLogger("dpserve.engine")

_PAUSED, _SUSPENDED, _STOPPED = ControlState.PAUSED, ControlState.SUSPENDED, ControlState.STOPPED
_WAITING_NOTE_EVERY = 10.0  # seconds between log lines while unregistered


def _is_finite_number(value: object) -> TypeGuard[int | float]:
    # The exact types: a bool is an int subclass but no statistic, and numpy's scalars are left out.
    return (type(value) is int or type(value) is float) and math.isfinite(value)


def _failed(request_id: int, code: str, message: str) -> EngineUpdate:
    """The update of a request the runner refused: ``code`` (an ErrorCode) and why."""
    return EngineUpdate(request_id, b"", None, code, message, None)


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
    stop_token: int | None = None  # the stop token that ended it, sent with the last entry
    stop_logprob: bytes | None = None  # packed: its log-prob, sent with it
    # The tokens' text as the runner decoded it (stop strings: ``TokenUpdate.text``); then
    # ``text`` is not used.
    decoded: list[str] | None = None
    cached_tokens: int | None = None  # prompt tokens its engine found in the prefix cache


class EngineServer:
    def __init__(
        self,
        connection: EngineConnection,
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
        # HAND_OFF sent, answer awaited: no steps (the coordinator has every token so far).
        self.handing_off = False
        self.handed_off = False
        self._held: dict[int, _Held] = {}
        # Requests' sampling parameters, checked once per distinct set (frozen: shared).
        self._params = ParamsMemo(SamplingParams.deserialize)
        # The LoRA adapters loaded at run time (LOAD_ADAPTER), name -> directory, reported in
        # every REGISTER: a restarted coordinator learns them back from its engines.
        self.runtime_adapters: dict[str, str] = {}
        self._text = RequestText(runner)
        prepare_detokenizing(self._text.tokenizer)
        self._stream_dirty: set[int] = set()
        # Requests whose first tokens came in the last step: they go out at the next flush
        # without waiting for the stream interval (a first token's delay is the client's TTFT).
        self._first_due: set[int] = set()
        self._outbox: list[EngineUpdate] = []
        self._last_stream_flush = 0.0
        self._last_heartbeat = 0.0
        # When the oldest heartbeat the coordinator has not answered yet was sent; None: none.
        self._unanswered_since: float | None = None
        self._last_waiting_note = time.monotonic()
        # One handler per message header, called with the message's record.
        self._handlers: dict[Header, Callable[[Any], None]] = {
            Header.ENGINE_REQUEST: self._on_request,
            Header.ENGINE_REQUESTS: self._on_requests,
            Header.CANCEL: self._on_cancel,
            Header.HEARTBEAT_ACK: self._on_heartbeat_ack,
            Header.REGISTER_ACK: self._on_register_ack,
            Header.DRAIN_ACK: self._on_drain_ack,
            Header.HAND_OFF_ACK: self._on_hand_off_ack,
            Header.ERROR: self._on_error,
            Header.KV_SNAPSHOT_REQUEST: self._on_kv_snapshot_request,
            **{signal: self._on_control for signal in CONTROL_SIGNALS},
            **{signal: self._on_adapter_signal for signal in ADAPTER_SIGNALS},
        }
        # The runner's prefix-cache events for the coordinator's index (None: no cache).
        self._kv_source: ReportsKVEvents | None = None
        self._kv_publisher: KVEventPublisher | None = None
        if isinstance(runner, ReportsKVEvents) and runner.kv_block_size is not None:
            self._kv_source = runner
            self._kv_publisher = KVEventPublisher(connection.instance, runner.kv_block_size)

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
        """SIGTERM and SIGINT leave: hand what is held to the other engines and exit 0, or,
        with no other engine, drain (no new work, finish what is held, deregister, exit 0)."""
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
                    for record in self.connection.receive_all():
                        self._handle(record)
                if self.stopped:
                    break
                self._keep_registered(looked_at)
                stepping = self.registered and not self.paused and not self.handing_off
                if stepping and self.runner.has_work():
                    self._absorb(self.runner.step())
                self._publish_kv_events()
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
        if self.handed_off:
            return
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
            self.connection.register_again()
        now = time.monotonic()
        if not self.registered:
            # Sends only when one is due (one per connection).
            self.connection.register(self.runtime_adapters)
            self._note_waiting(now)
        elif now - self._last_heartbeat >= self.heartbeat_interval:
            self.connection.send(
                Heartbeat(len(self._held), self._numeric_stats(), self._adapter_report())
            )
            self._last_heartbeat = now
            if self._unanswered_since is None:
                self._unanswered_since = now

    def _numeric_stats(self) -> dict[str, int | float]:
        """The runner's numbers for the coordinator (STATUS, /metrics): what its ``stats()``
        reports that is a finite number, at most as many as the coordinator keeps."""
        try:
            reported = self.runner.stats()
        except Exception:  # the numbers are for dashboards: never let them stop a heartbeat
            log.exception("engine rank %d: the runner's stats failed", self.connection.rank)
            return {}
        numbers = {name: value for name, value in reported.items() if _is_finite_number(value)}
        return dict(sorted(numbers.items())[: DEFAULT_ENGINE_STATS_LIMITS.max_entries])

    def _adapter_report(self) -> dict[str, Any] | None:
        """The runner's LoRA adapters for the coordinator (None: it serves none)."""
        if not isinstance(self.runner, ServesAdapters):
            return None
        report = self.runner.adapter_report()
        return None if report is None else report.to_wire()

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

    def _on_register_ack(self, ack: RegisterAck) -> None:
        instance, state = ack.instance, ack.state
        if self.coordinator_instance not in (None, instance):
            self._forget_all("the coordinator restarted")
        newly = not self.registered or self.coordinator_instance != instance
        self.coordinator_instance = instance
        self.registered = True
        self._unanswered_since = None
        if newly:  # a repeated REGISTER is acknowledged again: nothing new to say
            log.info(
                "engine rank %d registered with coordinator %s", self.connection.rank, instance
            )
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
            self.connection.send(Drain())  # a new coordinator must not route to us
        self._send_kv_snapshot()  # a (new) coordinator's index learns what we hold

    # ------------------------------------------------------------ prefix cache

    def _publish_kv_events(self) -> None:
        """Send what the cache gained and lost since the last turn (kept while unregistered:
        the snapshot sent on registration supersedes them)."""
        if self._kv_source is None or self._kv_publisher is None or not self.registered:
            return
        events = self._kv_source.kv_events()
        if events:
            for message in self._kv_publisher.messages(events):
                self.connection.send(message)

    def _send_kv_snapshot(self) -> None:
        if self._kv_source is None or self._kv_publisher is None:
            return
        self._kv_source.kv_events()  # superseded by the snapshot
        for message in self._kv_publisher.snapshot(self._kv_source.kv_snapshot()):
            self.connection.send(message)

    def _on_kv_snapshot_request(self, _request: KvSnapshotRequest) -> None:
        if self.registered:
            self._send_kv_snapshot()

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

    def _handle(self, record: Any) -> None:
        """Run the handler of a message's header with its record."""
        header = protocol.header_of(record)
        handler = self._handlers.get(header)
        if handler is None:
            log.warning("ignoring unexpected %s from the coordinator", header.name)
            return
        handler(record)

    def _on_cancel(self, cancel: Cancel) -> None:
        if self._held.pop(cancel.ref, None) is not None:
            self.runner.cancel(cancel.ref)
            self._stream_dirty.discard(cancel.ref)

    def _on_heartbeat_ack(self, ack: HeartbeatAck) -> None:
        if self.coordinator_instance not in (None, ack.instance):
            self.registered = False  # restarted: register with the new one
            self.connection.register_again()

    def _on_drain_ack(self, _ack: DrainAck) -> None:
        self.drain_acked = True
        self.handing_off = False  # nobody else takes our requests: finish them here

    def _on_error(self, error: Error) -> None:
        if error.code == ErrorCode.UNKNOWN_PEER:
            self._forget_all("the coordinator does not know this engine")
            self.registered = False
            self.connection.register_again()
        else:
            log.warning("coordinator error: %s: %s", error.code, error.message)

    def _on_requests(self, batch: protocol.EngineRequests) -> None:
        for message in batch.requests:
            self._on_request(message)

    def _on_request(self, message: protocol.EngineRequest) -> None:
        request_id = message.request_id
        try:
            request = RunnerRequest(
                request_id,
                protocol.unpack_tokens(message.prompt_tokens),
                self._params(message.sampling_params),
                protocol.unpack_tokens(message.resume_tokens),
            )
            self.runner.add(request)
        except RequestRejected as exc:
            self._outbox.append(_failed(request_id, exc.code, exc.message))
            return
        except (InvalidSamplingParams, protocol.ProtocolError) as exc:
            self._outbox.append(_failed(request_id, ErrorCode.BAD_REQUEST, str(exc)))
            return
        except Exception as exc:
            # A request that passed validation must never end the engine: whatever admitting
            # it raised fails that request alone (the runner checks what it can first, and
            # ``add`` keeps a request only as its last step).
            log.exception(
                "engine rank %d: admitting request %d failed", self.connection.rank, request_id
            )
            why = f"the engine could not admit the request: {type(exc).__name__}: {exc}"
            self._outbox.append(_failed(request_id, ErrorCode.ENGINE_ERROR, why))
            return
        self._held[request_id] = _Held(
            request.params.stream, time.monotonic(), self._text.start(request.resume_tokens)
        )

    def _on_control(self, control: Any) -> None:
        """PAUSE, UNPAUSE, SUSPEND, RESUME or STOP (each a record with a ``control_id``)."""
        signal_header = protocol.header_of(control)
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
        self.connection.send(ControlAck(int(signal_header), control.control_id))

    def _on_adapter_signal(self, signal: LoadAdapter | UnloadAdapter) -> None:
        """Load or unload a LoRA adapter; ADAPTER_ACK says how it went (read on this loop:
        an adapter's weights are a few MB, read in milliseconds)."""
        error: str | None = None
        runner = self.runner
        if not isinstance(runner, ServesAdapters):
            error = "this engine's runner serves no LoRA adapters"
        else:
            try:
                if isinstance(signal, LoadAdapter):
                    runner.load_adapter(signal.name, signal.path)
                    self.runtime_adapters[signal.name] = signal.path
                else:
                    runner.unload_adapter(signal.name)
                    self.runtime_adapters.pop(signal.name, None)
            except KeyError:
                error = f"no LoRA adapter {signal.name!r} is loaded"
            except AdapterError as exc:
                error = str(exc)
        outcome = "done" if error is None else error
        log.info(
            "engine rank %d: %s %s: %s",
            self.connection.rank,
            type(signal).__name__,
            signal.name,
            outcome,
        )
        self.connection.send(AdapterAck(signal.control_id, error))

    # ----------------------------------------------------------------- results

    def _absorb(self, updates: list[TokenUpdate]) -> None:
        now = time.monotonic()
        finished: list[tuple[int, _Held, str | None]] = []
        for update in updates:
            held = self._held.get(update.request_id)
            if held is None:
                continue
            if update.error is not None:  # failed after it was accepted: nothing else counts
                del self._held[update.request_id]
                self._stream_dirty.discard(update.request_id)
                self._first_due.discard(update.request_id)
                code = update.finish_reason or ErrorCode.ENGINE_ERROR
                self._outbox.append(_failed(update.request_id, code, update.error))
                continue
            first = held.ttft is None and bool(update.tokens)
            if first:
                held.ttft = now - held.received_at
                if update.finish_reason is None:
                    self._first_due.add(update.request_id)
            if update.cached_tokens is not None:
                held.cached_tokens = update.cached_tokens
            held.tokens.extend(update.tokens)
            if update.text is not None:
                if held.decoded is None:
                    held.decoded = []
                held.decoded.append(update.text)
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
                held.stop_token = update.stop_token
                if update.stop_logprob is not None:
                    top = update.stop_top_logprobs
                    held.stop_logprob = protocol.pack_logprobs(
                        [update.stop_logprob], None if top is None else [top]
                    )
                finished.append((update.request_id, held, update.finish_reason))
            elif held.stream or first:
                # A request's first tokens go out at once even when it does not stream: the
                # coordinator learns that its prefill is done (cache-aware routing counts the
                # prefill still queued on each engine).
                self._stream_dirty.add(update.request_id)
        if finished:
            self._outbox += self._entries(finished)

    def _entries(self, items: list[tuple[int, _Held, str | None]]) -> list[EngineUpdate]:
        """The ENGINE_REPLY entries of these requests (what they produced since their last
        entry); the text the runner did not decode comes from one ``decode_batch`` for all."""
        undecoded = [
            (held.text, held.tokens, finish is not None)
            for _, held, finish in items
            if held.decoded is None
        ]
        pushed = iter(push_batch(self._text.tokenizer, undecoded) if undecoded else [])
        entries: list[EngineUpdate] = []
        for request_id, held, finish_reason in items:
            text = next(pushed) if held.decoded is None else "".join(held.decoded)
            entries.append(
                EngineUpdate(
                    request_id,
                    protocol.pack_tokens(held.tokens),
                    None
                    if held.logprobs is None
                    else protocol.pack_logprobs(held.logprobs, held.top_logprobs),
                    finish_reason,
                    None,
                    held.ttft,
                    text,
                    held.cached_tokens if finish_reason is not None else None,
                    held.prompt_logprobs,
                    held.stop_token if finish_reason is not None else None,
                    held.stop_logprob if finish_reason is not None else None,
                )
            )
            held.prompt_logprobs = None
            held.tokens = []
            held.logprobs = None if held.logprobs is None else []
            held.top_logprobs = None if held.top_logprobs is None else []
            if held.decoded is not None:
                held.decoded = []
        return entries

    def _flush(self, now: float) -> None:
        held = self._held
        interval_over = now - self._last_stream_flush >= self.stream_interval
        if interval_over and any(request.stream for request in held.values()):
            # What the running requests produced since the last interval, taken in one pass:
            # the streaming ones' tokens go out now (the others' wait in ``_held``).
            self._absorb(self.runner.unreported())
        if self._stream_dirty and interval_over:
            self._outbox += self._entries([(i, held[i], None) for i in self._stream_dirty])
            self._stream_dirty.clear()
            self._last_stream_flush = now
        elif self._first_due:
            due = [i for i in self._first_due if i in self._stream_dirty]
            self._outbox += self._entries([(i, held[i], None) for i in due])
            self._stream_dirty.difference_update(due)
        self._first_due.clear()
        if self._outbox and self.registered:
            self.connection.send(EngineReply(self._outbox))
            self._outbox = []

    # ----------------------------------------------------------------- draining

    def _drain_step(self, now: float) -> bool:
        """Advance a requested leave (hand-off, else drain); True when the engine may exit."""
        if not self.drain_requested:
            return False
        if self.drain_started is None:
            self.drain_started = now
            log.info(
                "engine rank %d leaving with %d request(s)", self.connection.rank, len(self._held)
            )
            if not self.registered:
                return True  # nobody routes to us: nothing to finish
            if not self._held and not self._outbox:
                # Nothing to hand over: say so and go, without waiting for an answer. A
                # request already on its way here is the coordinator's to re-dispatch when it
                # reads DEREGISTER (as after HAND_OFF). Waiting would cost a Pod deleted with
                # its coordinator (a namespace, an uninstall) the whole coordinator timeout.
                self.connection.send(Deregister())
                log.info("engine rank %d idle; leaving", self.connection.rank)
                return True
            self._hand_off()
            return False
        if self.handed_off:
            return True
        if self.handing_off and now - self.drain_started > self.coordinator_timeout:
            # No answer (a coordinator that predates HAND_OFF ignores it): drain instead.
            log.warning("no answer to HAND_OFF within %.1f s: draining", self.coordinator_timeout)
            self.handing_off = False
            self.connection.send(Drain())
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
            self.connection.send(Deregister())
            log.info("engine rank %d drained; leaving", self.connection.rank)
            return True
        return False

    def _hand_off(self) -> None:
        """Send every token produced so far (streaming or not), then HAND_OFF: the coordinator
        re-dispatches the requests after exactly those tokens, so no step may run until it
        answers (HAND_OFF_ACK: leave; DRAIN_ACK: finish them here)."""
        self._absorb(self.runner.unreported())
        self._outbox += self._entries(
            [(request_id, held, None) for request_id, held in self._held.items() if held.tokens]
        )
        self._stream_dirty.clear()
        if self._outbox:
            self.connection.send(EngineReply(self._outbox))
            self._outbox = []
        self.connection.send(HandOff())
        self.handing_off = True

    def _on_hand_off_ack(self, ack: HandOffAck) -> None:
        log.info(
            "engine rank %d handed %d request(s) to other engines; leaving",
            self.connection.rank,
            ack.requests,
        )
        for request_id in self._held:
            self.runner.cancel(request_id)
        self._held.clear()
        self._outbox.clear()
        self.handed_off = True
        self.registered = False  # and never again: _keep_registered stands down
