"""The coordinator's STATUS report: engines, their load, clients, queue, limits, counters."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from dpserve.coordinator.requests import RequestTable
from dpserve.coordinator.shared import SharedState
from dpserve.protocol import ControlState


def status_report(
    shared: SharedState, state: ControlState, prefix_routing: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The STATUS reply's report, from the shared state and the engines' control state."""
    registry, requests, transport = shared.registry, shared.requests, shared.transport
    engines = registry.engines.values()
    counters = dict(shared.counters)
    if transport.authenticator is not None:
        counters["auth_denied"] = transport.authenticator.denied
    return {
        "instance": shared.instance_id,
        "state": state.name.lower(),
        "engines": len(registry),
        "draining": sum(1 for e in engines if e.draining),
        "engine_list": [
            {
                "rank": e.rank,
                "capacity": e.capacity,
                "outstanding": len(e.outstanding),
                "draining": e.draining,
                "stats": e.stats,
                "adapters": e.adapters,
            }
            for e in sorted(engines, key=lambda e: e.rank)
        ],
        "clients": len(shared.clients),
        "inflight": len(requests),
        "queued": sum(1 for rid in requests.queue if rid in requests.by_id),
        "oldest_queued_seconds": _oldest_wait(requests),
        "routing": shared.routing.value,
        "pid": os.getpid(),
        "security": "curve" if transport.secured else "none",
        "limits": shared.config.status_limits(),
        "counters": counters,
        # Routing decisions by reason, and the prefix index's predicted vs actual cached tokens.
        "prefix_routing": dict(prefix_routing or {}),
    }


def _oldest_wait(requests: RequestTable) -> float:
    """Seconds the oldest request still in the wait queue has waited (0.0: none waits)."""
    for request_id in requests.queue:
        request = requests.by_id.get(request_id)
        if request is not None and request.engine is None:
            return round(time.monotonic() - request.received_at, 3)
    return 0.0
