"""The registry: the engines and clients the coordinator knows, as records (``Engine``,
``Client``), and which engines get new work (``EngineRegistry.routable``). Who joins and who
leaves is decided in ``membership``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class Engine:
    identity: bytes
    rank: int
    capacity: int
    instance: str  # changes when the engine process restarts
    last_seen: float
    last_probe: float = 0.0  # when the coordinator last checked that a quiet engine is alive
    draining: bool = False
    outstanding: set[int] = field(default_factory=set)  # request ids dispatched here
    # The runner's numbers from the engine's last heartbeat (engine_stats checked them).
    stats: dict[str, int | float] = field(default_factory=dict)
    # Its LoRA adapters from its last heartbeat (adapters.check_adapter_report); empty: none.
    adapters: dict[str, Any] = field(default_factory=dict)
    # It reads ENGINE_REQUESTS (it said so in its REGISTER): a turn's requests go in one send.
    batched_requests: bool = False

    @property
    def load(self) -> float:
        return len(self.outstanding) / self.capacity


class EngineRegistry:
    """Registered engines; ``routable`` is the deque the router rotates (seed's
    ``identities_of_data_parallel_ranks``): registered engines that are not draining."""

    def __init__(self) -> None:
        self.engines: dict[bytes, Engine] = {}
        self.routable: deque[bytes] = deque()

    def __len__(self) -> int:
        return len(self.engines)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self.engines

    def get(self, identity: bytes) -> Engine | None:
        return self.engines.get(identity)

    def add(self, engine: Engine) -> None:
        self.engines[engine.identity] = engine
        self.routable.append(engine.identity)

    def remove(self, identity: bytes) -> Engine | None:
        engine = self.engines.pop(identity, None)
        if engine is not None:
            self.stop_routing(identity)
        return engine

    def start_draining(self, engine: Engine) -> None:
        if not engine.draining:
            engine.draining = True
            self.stop_routing(engine.identity)

    def stop_routing(self, identity: bytes) -> None:
        """No new work for this engine (draining, or unreachable until it is removed)."""
        if identity in self.routable:
            self.routable.remove(identity)

    def silent_since(self, deadline: float) -> list[Engine]:
        return [e for e in self.engines.values() if e.last_seen < deadline]


@dataclass(slots=True, eq=False)
class Client:
    identity: bytes
    inflight: int = 0
