"""Which engines hold a LoRA adapter in a slot, for the prefix-aware router.

An engine reports its adapters with every heartbeat (``adapters.check_adapter_report``: per
adapter whether it is loaded and its requests running and waiting, and its ``max_loras``
slots). Between heartbeats the router predicts, as the prefix index predicts the blocks a
routed prompt will leave: a request sent to an engine that does not hold its adapter makes
that engine load it, and on an engine whose slots are full the load evicts the adapter least
recently routed there (the engine's own LRU, seen from here). Predictions last until the
engine's next report, which says what it really holds, or ``ttl`` seconds if none comes.

The router's adapter decisions are counted here for /metrics:

* ``resident``: sent to an engine that holds the adapter;
* ``load``: no routable engine held it: it is loaded where the request goes;
* ``moved``: an engine held it but was busier (or had less of the prompt cached) by more than
  a load costs, so another loads it too;
* ``unknown``: the engine chosen does not have it registered (it refuses the request).

What is kept is bounded by the registered adapters (``LoraLimits.max_registered_loras`` per
engine): nothing is kept for a name no engine reports.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Final

from dpserve.coordinator.registry import Engine

# Seconds a prediction counts when no report comes (heartbeats come every second by default).
PREDICTION_TTL: Final = 5.0


class AdapterResidency:
    def __init__(self, ttl: float = PREDICTION_TTL) -> None:
        self.ttl = ttl
        # (engine, adapter) -> (predicted held?, the engine's report when predicted, until).
        self._predicted: dict[tuple[bytes, str], tuple[bool, object, float]] = {}
        # Per engine, its adapters in the order requests for them were routed there (oldest
        # first): what its LRU would evict.
        self._recency: dict[bytes, OrderedDict[str, None]] = {}
        self.decisions: Counter[str] = Counter()

    def holds(self, engine: Engine, adapter: str, now: float) -> bool:
        """Whether ``engine`` holds ``adapter`` in a slot: a prediction made since its last
        report, else that report."""
        predicted = self._predicted.get((engine.identity, adapter))
        if predicted is not None:
            held, report, until = predicted
            # Each heartbeat's report is a new record (membership replaces it): a newer one
            # supersedes the prediction.
            if report is engine.adapters and until >= now:
                return held
            del self._predicted[(engine.identity, adapter)]
        reported = engine.adapters.get("adapters", {}).get(adapter)
        return reported is not None and bool(reported[0])

    def routed(self, engine: Engine, adapter: str, held: bool, any_held: bool, now: float) -> None:
        """A request for ``adapter`` went to ``engine``, which ``held`` it (``any_held``: some
        routable engine did)."""
        if adapter not in engine.adapters.get("adapters", {}):
            # Not registered there (the engine refuses the request): nothing to predict, and
            # nothing kept per unknown name (a client may send any).
            self.decisions["unknown"] += 1
            return
        recency = self._recency.setdefault(engine.identity, OrderedDict())
        recency[adapter] = None
        recency.move_to_end(adapter)
        if held:
            self.decisions["resident"] += 1
            return
        self.decisions["moved" if any_held else "load"] += 1
        report, until = engine.adapters, now + self.ttl
        victim = self._victim(engine, adapter, now)
        if victim is not None:
            self._predicted[(engine.identity, victim)] = (False, report, until)
        self._predicted[(engine.identity, adapter)] = (True, report, until)

    def _victim(self, engine: Engine, adapter: str, now: float) -> str | None:
        """The adapter a load of ``adapter`` on ``engine`` would evict: none while a slot is
        free, else the held one least recently routed there (never routed: first)."""
        slots: int = engine.adapters.get("max_loras", 0)
        if not slots:
            return None
        names: set[str] = set(engine.adapters.get("adapters", {}))
        names.update(name for (identity, name) in self._predicted if identity == engine.identity)
        held = [name for name in names if name != adapter and self.holds(engine, name, now)]
        if len(held) < slots:
            return None
        recency = self._recency.get(engine.identity, OrderedDict())
        order = {name: position for position, name in enumerate(recency)}
        return min(held, key=lambda name: order.get(name, -1))

    def engine_removed(self, identity: bytes) -> None:
        self._recency.pop(identity, None)
        for key in [key for key in self._predicted if key[0] == identity]:
            del self._predicted[key]
