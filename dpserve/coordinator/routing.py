"""Which engine gets the next request."""

from __future__ import annotations

from enum import StrEnum

from dpserve.coordinator.registry import EngineRegistry


class RoutingPolicy(StrEnum):
    # Reproducible assignment: request k goes to the k-th routable engine in turn.
    ROUND_ROBIN = "round-robin"
    # Fewest outstanding requests relative to the engine's capacity; adapts to slow engines.
    LEAST_OUTSTANDING = "least-outstanding"


def choose_engine(registry: EngineRegistry, policy: RoutingPolicy) -> bytes | None:
    """The identity of the engine for the next request, or None when none can take work."""
    routable = registry.routable
    if not routable:
        return None
    if policy is RoutingPolicy.ROUND_ROBIN:
        identity = routable[0]
        routable.rotate(-1)
        return identity
    engines = registry.engines
    return min(routable, key=lambda identity: engines[identity].load)
