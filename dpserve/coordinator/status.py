"""The coordinator's STATUS report: engines, their load, clients, queue, limits, counters."""

from __future__ import annotations

import os
from typing import Any

from dpserve.coordinator.shared import SharedState
from dpserve.protocol import ControlState


def status_report(shared: SharedState, state: ControlState) -> dict[str, Any]:
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
            }
            for e in sorted(engines, key=lambda e: e.rank)
        ],
        "clients": len(shared.clients),
        "inflight": len(requests),
        "queued": sum(1 for rid in requests.queue if rid in requests.by_id),
        "routing": shared.routing.value,
        "pid": os.getpid(),
        "security": "curve" if transport.secured else "none",
        "limits": shared.config.status_limits(),
        "counters": counters,
    }
