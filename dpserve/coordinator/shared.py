"""``SharedState``: what the coordinator's parts share, in one object.

The coordinator builds it once and hands it to each part (dispatch, control, membership,
intake, results, refusals); a part keeps its own state to itself (the control relay its
control state, intake and results their batch) and reaches every shared table through this.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.registry import Client, EngineRegistry
from dpserve.coordinator.requests import RequestTable
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.coordinator.transport import Transport
from dpserve.tokenizer import BatchTokenizer


@dataclass(slots=True, eq=False)
class SharedState:
    config: CoordinatorConfig
    routing: RoutingPolicy
    # Engines and clients tell a restarted coordinator from the old one by this id.
    instance_id: str
    tokenizer: BatchTokenizer
    transport: Transport
    requests: RequestTable
    registry: EngineRegistry = field(default_factory=EngineRegistry)
    clients: dict[bytes, Client] = field(default_factory=dict)
    # STATUS ``counters``: what happened so far (completed, failed, refused, ...), by name.
    counters: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
