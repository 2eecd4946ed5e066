"""``Dispatcher``: where each accepted request is, and what happens when that changes.

It sends requests to engines (under the routing policy, or into the wait queue), forgets them
when they finish, fail or are cancelled, and hands the requests of an engine that left to the
others (``reassign``, called by ``membership``) — except a request that keeps killing the
engines it reaches (quarantine).

A send to an engine that vanished only takes that engine out of the rotation: it is removed,
and its requests reassigned, once the send returned (``Membership.remove_unreachable``), so
dispatching never re-enters itself.
"""

from __future__ import annotations

import logging
import time

from dpserve import protocol
from dpserve.coordinator.registry import Engine
from dpserve.coordinator.requests import InflightRequest
from dpserve.coordinator.router import Router
from dpserve.coordinator.shared import SharedState
from dpserve.protocol import Cancel, EngineRequest, EngineRequests, ErrorCode, KvSnapshotRequest

log = logging.getLogger("dpserve.coordinator")


# An ENGINE_REQUESTS message is cut after this many bytes of prompt and resume tokens, far
# below any message size limit (a single request larger than this goes alone, as before).
BATCH_BYTES = 1 << 20


def _chunks(sizes: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` runs of consecutive items whose sizes add up to at most BATCH_BYTES
    (an item larger than that alone)."""
    runs, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > BATCH_BYTES:
            runs.append((start, index))
            start, total = index, 0
        total += size
    runs.append((start, len(sizes)))
    return runs


class Dispatcher:
    def __init__(self, shared: SharedState) -> None:
        self.shared = shared
        # Requests dispatched this turn to engines that read ENGINE_REQUESTS, not sent yet.
        self._batched: dict[bytes, list[tuple[InflightRequest, EngineRequest]]] = {}
        transport = shared.transport
        self.router = Router(
            shared.routing,
            shared.registry,
            prediction_ttl=shared.config.prefix_prediction_ttl,
            request_snapshot=lambda identity: transport.send(
                identity, protocol.encode(KvSnapshotRequest())
            ),
        )

    # ------------------------------------------------------------------- sending

    def dispatch(self, request: InflightRequest) -> None:
        """Send the request to the engine the policy picks, or queue it when none can. To an
        engine that reads ENGINE_REQUESTS it goes out with the rest of this turn's requests
        for that engine (``send_batched``), as if sent now."""
        shared = self.shared
        registry = shared.registry
        while (decision := self.router.choose(request)) is not None:
            identity = decision.identity
            entry = EngineRequest(
                request.request_id, request.prompt_tokens, request.params, bytes(request.generated)
            )
            engine = registry.engines[identity]
            if engine.batched_requests:
                self._batched.setdefault(identity, []).append((request, entry))
            elif not shared.transport.send(identity, protocol.encode(entry)):
                # That engine vanished: the request never got there. No more work for it; it
                # is removed once this turn's sends are done.
                registry.stop_routing(identity)
                continue
            engine.outstanding.add(request.request_id)
            self.router.routed(request, decision)
            request.engine = identity
            request.progressed = False
            if request.dispatched_at is None:
                request.dispatched_at = time.monotonic()
            return
        queue, limit = shared.requests.queue, shared.config.max_queued_requests
        if len(queue) >= limit:
            self.fail(
                request,
                ErrorCode.OVERLOADED,
                f"no engine available and the wait queue is full (--max-queued-requests {limit})",
            )
        else:
            queue.append(request.request_id)

    def send_batched(self) -> None:
        """Send what ``dispatch`` held for engines that read ENGINE_REQUESTS: one message per
        engine, split so none passes ``BATCH_BYTES``. When a send finds its engine gone, the
        requests in it and after it never got there: they are taken back from that engine
        and dispatched again (to the others, or the wait queue), and sent in the same call."""
        by_id = self.shared.requests.by_id
        while self._batched:
            identity, held = self._batched.popitem()
            # Since dispatched: cancelled or failed (gone from the table), or moved to another
            # engine when this one was removed (``reassign``): not sent here.
            entries = [
                (request, entry)
                for request, entry in held
                if request.engine == identity and by_id.get(request.request_id) is request
            ]
            sizes = [len(entry.prompt_tokens) + len(entry.resume_tokens) for _, entry in entries]
            for start, end in _chunks(sizes) if entries else ():
                message = EngineRequests([entry for _, entry in entries[start:end]])
                if self.shared.transport.send(identity, protocol.encode(message)):
                    continue
                self.shared.registry.stop_routing(identity)
                for request, _ in entries[start:]:
                    self._take_back(identity, request)
                    self.dispatch(request)
                break

    def _take_back(self, identity: bytes, request: InflightRequest) -> None:
        """Undo ``dispatch``'s bookkeeping of a request whose send failed."""
        engine = self.shared.registry.engines.get(identity)
        if engine is not None:
            engine.outstanding.discard(request.request_id)
        self.router.forget(request.request_id)
        request.engine = None

    def dispatch_queued(self) -> None:
        requests, routable = self.shared.requests, self.shared.registry.routable
        queue = requests.queue
        while queue and routable:
            request = requests.by_id.get(queue.popleft())
            if request is not None and request.engine is None:
                self.dispatch(request)

    def expire_queued(self, now: float) -> None:
        """Send what waits when an engine is free; fail what waited past the queue timeout."""
        requests = self.shared.requests
        queue = requests.queue
        if queue and self.shared.registry.routable:
            self.dispatch_queued()
        timeout = self.shared.config.queue_timeout
        while queue:
            request = requests.by_id.get(queue[0])
            if request is not None and request.engine is None:
                if now - request.received_at < timeout:
                    break
                self.fail(
                    request, ErrorCode.NO_ENGINE, f"no engine became available within {timeout:g} s"
                )
            queue.popleft()

    # ---------------------------------------------------------------- forgetting

    def fail(self, request: InflightRequest, code: str, message: str) -> None:
        self.forget(request)
        self.shared.counters["failed"] += 1
        if request.client in self.shared.clients:
            self.shared.transport.error(request.client, request.client_request_id, code, message)

    def cancel(self, request: InflightRequest) -> None:
        """Forget a request nobody wants any more, and tell its engine to drop it."""
        registry = self.shared.registry
        engine = None if request.engine is None else registry.get(request.engine)
        if engine is not None:
            engine.outstanding.discard(request.request_id)
            self.shared.transport.send(engine.identity, protocol.encode(Cancel(request.request_id)))
        self.forget(request)

    def forget(self, request: InflightRequest) -> None:
        shared = self.shared
        if shared.requests.pop(request.request_id) is None:
            return
        self.router.forget(request.request_id)
        if request.engine is not None and (engine := shared.registry.get(request.engine)):
            engine.outstanding.discard(request.request_id)
        client = shared.clients.get(request.client)
        if client is not None:
            client.inflight -= 1

    def fail_all(self, code: str, message: str) -> None:
        for request in list(self.shared.requests.by_id.values()):
            self.fail(request, code, message)

    # ------------------------------------------------------------- engines leaving

    def reassign(self, engine: Engine, died: bool) -> None:
        """Hand every request a removed engine held to the others, continuing after the tokens
        already streamed. When it ``died``, the death counts against each request it held that
        had not produced a token on it yet (one that had, survived its steps there), and a
        request with ``max_dispatch_attempts`` such deaths is failed instead: it is likely what
        kills them, and sending it on would take every engine down in turn."""
        by_id = self.shared.requests.by_id
        orphans = [by_id[rid] for rid in engine.outstanding if rid in by_id]
        engine.outstanding.clear()
        if orphans:
            self.shared.counters["redispatched"] += len(orphans)
        for request in orphans:
            request.engine = None
            request.engines_died += died and not request.progressed
            if request.engines_died >= self.shared.config.max_dispatch_attempts:
                self._quarantine(request)
            else:
                self.dispatch(request)

    def _quarantine(self, request: InflightRequest) -> None:
        self.shared.counters["quarantined"] += 1
        log.warning(
            "request %d was in flight on %d engines that died: failing it",
            request.request_id,
            request.engines_died,
        )
        self.fail(
            request,
            ErrorCode.QUARANTINED,
            f"request was in flight on {request.engines_died} engines that died; not retried",
        )
