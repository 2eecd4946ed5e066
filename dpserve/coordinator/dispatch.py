"""``Dispatcher``: where each accepted request is, and what happens when that changes.

It sends requests to engines (under the routing policy, or into the wait queue), forgets them
when they finish, fail or are cancelled, and hands the requests of an engine that left to the
others — except a request that keeps killing the engines it reaches (quarantine).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable

from dpserve import protocol
from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.registry import Client, Engine, EngineRegistry
from dpserve.coordinator.requests import InflightRequest, RequestTable
from dpserve.coordinator.router import Router
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.coordinator.transport import Transport
from dpserve.protocol import Cancel, EngineRequest, ErrorCode, KvSnapshotRequest

log = logging.getLogger("dpserve.coordinator")


class Dispatcher:
    def __init__(
        self,
        config: CoordinatorConfig,
        routing: RoutingPolicy,
        transport: Transport,
        registry: EngineRegistry,
        requests: RequestTable,
        clients: dict[bytes, Client],
        counters: defaultdict[str, int],
    ) -> None:
        self.config = config
        self.routing = routing
        self.transport = transport
        self.registry = registry
        self.requests = requests
        self.clients = clients
        self.counters = counters
        self.router = Router(
            routing,
            registry,
            prediction_ttl=config.prefix_prediction_ttl,
            request_snapshot=lambda identity: transport.send(
                identity, protocol.encode(KvSnapshotRequest())
            ),
        )
        # Called with each engine that is removed (a control operation stops waiting for it).
        self.on_engine_removed: Callable[[Engine], None] = lambda engine: None

    # ------------------------------------------------------------------- sending

    def dispatch(self, request: InflightRequest) -> None:
        """Send the request to the engine the policy picks, or queue it when none can."""
        while (decision := self.router.choose(request)) is not None:
            identity = decision.identity
            payload = protocol.encode(
                EngineRequest(
                    request.request_id,
                    request.prompt_tokens,
                    request.params,
                    bytes(request.generated),
                )
            )
            if not self.transport.send(identity, payload):
                continue  # that engine vanished (and was removed): the request never got there
            self.registry.engines[identity].outstanding.add(request.request_id)
            self.router.routed(request, decision)
            request.engine = identity
            request.progressed = False
            if request.dispatched_at is None:
                request.dispatched_at = time.monotonic()
            return
        if len(self.requests.queue) >= self.config.max_queued_requests:
            self.fail(
                request,
                ErrorCode.OVERLOADED,
                "no engine available and the wait queue is full "
                f"(--max-queued-requests {self.config.max_queued_requests})",
            )
        else:
            self.requests.queue.append(request.request_id)

    def dispatch_queued(self) -> None:
        queue = self.requests.queue
        while queue and self.registry.routable:
            request = self.requests.by_id.get(queue.popleft())
            if request is not None and request.engine is None:
                self.dispatch(request)

    def expire_queued(self, now: float) -> None:
        """Send what waits when an engine is free; fail what waited past the queue timeout."""
        queue = self.requests.queue
        if queue and self.registry.routable:
            self.dispatch_queued()
        timeout = self.config.queue_timeout
        while queue:
            request = self.requests.by_id.get(queue[0])
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
        self.counters["failed"] += 1
        if request.client in self.clients:
            self.transport.error(request.client, request.client_request_id, code, message)

    def cancel(self, request: InflightRequest) -> None:
        """Forget a request nobody wants any more, and tell its engine to drop it."""
        engine = None if request.engine is None else self.registry.get(request.engine)
        if engine is not None:
            engine.outstanding.discard(request.request_id)
            self.transport.send(engine.identity, protocol.encode(Cancel(request.request_id)))
        self.forget(request)

    def forget(self, request: InflightRequest) -> None:
        if self.requests.pop(request.request_id) is None:
            return
        self.router.forget(request.request_id)
        if request.engine is not None and (engine := self.registry.get(request.engine)):
            engine.outstanding.discard(request.request_id)
        client = self.clients.get(request.client)
        if client is not None:
            client.inflight -= 1

    def fail_all(self, code: str, message: str) -> None:
        for request in list(self.requests.by_id.values()):
            self.fail(request, code, message)

    # ------------------------------------------------------------- peers leaving

    def peer_gone(self, identity: bytes) -> None:
        """A send to this peer failed: its connection is gone."""
        engine = self.registry.get(identity)
        if engine is not None:
            log.warning("engine rank %d unreachable: removing it", engine.rank)
            self.remove_engine(engine, died=True)
        elif self.clients.pop(identity, None) is not None:
            self.counters["clients_vanished"] += 1
            dropped = self.requests.of_client(identity)
            log.info("client %r vanished; cancelling its %d request(s)", identity, len(dropped))
            for request in dropped:
                self.cancel(request)

    def remove_engine(self, engine: Engine, died: bool) -> None:
        """Forget an engine; every request it held goes to the others, continuing after the
        tokens already streamed. When it ``died``, the death counts against each request it
        held that had not produced a token on it yet (one that had, survived its steps there),
        and a request with ``max_dispatch_attempts`` such deaths is failed instead: it is
        likely what kills them, and sending it on would take every engine down in turn."""
        self.registry.remove(engine.identity)
        self.router.engine_removed(engine)  # re-dispatch below routes by the survivors' caches
        self.on_engine_removed(engine)
        by_id = self.requests.by_id
        orphans = [by_id[rid] for rid in engine.outstanding if rid in by_id]
        engine.outstanding.clear()
        if orphans:
            self.counters["redispatched"] += len(orphans)
        for request in orphans:
            request.engine = None
            request.engines_died += died and not request.progressed
            if request.engines_died >= self.config.max_dispatch_attempts:
                self._quarantine(request)
            else:
                self.dispatch(request)

    def _quarantine(self, request: InflightRequest) -> None:
        self.counters["quarantined"] += 1
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
