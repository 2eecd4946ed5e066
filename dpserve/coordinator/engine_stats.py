"""The numbers an engine reports with its heartbeats (KV pool, capacity, preemptions), checked
before the coordinator keeps them for STATUS and the HTTP front's /metrics.

An engine is trusted to route requests, not to fill the coordinator's memory or break a
Prometheus scrape: a report is kept only if it is a map of at most ``max_entries`` snake_case
names to finite numbers; anything else is refused whole (``MalformedEngineStats``).
"""

from __future__ import annotations

import math
import re
from typing import Final

from dpserve.limits import DEFAULT_ENGINE_STATS_LIMITS, EngineStatsLimits
from dpserve.protocol import ProtocolError

EngineStats = dict[str, int | float]

# Names become parts of metric names and JSON keys: lower-case snake_case only.
_NAME: Final = re.compile(r"[a-z][a-z0-9_]*")


class MalformedEngineStats(ProtocolError):
    """An engine's heartbeat numbers that the coordinator will not keep."""


def check_engine_stats(
    raw: object, limits: EngineStatsLimits = DEFAULT_ENGINE_STATS_LIMITS
) -> EngineStats:
    """``raw`` as a name -> number map, or ``MalformedEngineStats`` saying what is wrong."""
    if not isinstance(raw, dict):
        raise MalformedEngineStats(f"engine stats must be a map, got {type(raw).__name__}")
    if len(raw) > limits.max_entries:
        raise MalformedEngineStats(
            f"engine stats hold {len(raw)} entries, more than the {limits.max_entries} allowed"
        )
    for name, value in raw.items():
        if (
            not isinstance(name, str)
            or len(name) > limits.max_name_chars
            or not _NAME.fullmatch(name)
        ):
            raise MalformedEngineStats(
                f"engine stat name {name!r:.80} is not snake_case of at most "
                f"{limits.max_name_chars} characters"
            )
        if type(value) not in (int, float) or not math.isfinite(value):
            raise MalformedEngineStats(
                f"engine stat {name} must be a finite number, got {value!r:.80}"
            )
    return dict(raw)
