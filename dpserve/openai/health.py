"""Liveness and readiness, as the probes ask them.

* ``/health`` and ``/livez``: liveness. 200 whenever this process serves HTTP; they never ask
  the coordinator, so a slow coordinator cannot get the front restarted.
* ``/ready``: readiness. 200 only when the coordinator answered a status query within
  ``STATUS_TIMEOUT``, its engines are running (not paused, suspended or stopped) and at least
  one registered engine is not draining; otherwise 503 with ``status`` naming the reason:
  ``coordinator_unavailable``, ``paused``, ``suspended``, ``stopped``, ``no_engines`` or
  ``draining``. With ``hold_without_engines`` (``--ready-without-engines``: engines are
  autoscaled and may be at zero), no engine, or only draining ones, is 200 with status
  ``holding``: the coordinator takes requests and holds them until an engine registers, and
  those held requests are what brings an engine back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

LIVE_BODY: Final = {"status": "alive"}

_REASONS: Final = {
    "coordinator_unavailable": "the coordinator did not answer a status query",
    "paused": "engines are paused",
    "suspended": "engines are suspended",
    "stopped": "engines were stopped",
    "no_engines": "no engine is registered",
    "draining": "every registered engine is draining",
    "holding": "no engine can take requests now: they are held until one registers",
}


def readiness(
    status: Mapping[str, Any] | None, *, hold_without_engines: bool = False
) -> tuple[int, dict[str, Any]]:
    """``/ready``'s status code and body for a coordinator status (None: no answer)."""
    if status is None:
        return 503, _body("coordinator_unavailable", {})
    engines = int(status.get("engines", 0))
    draining = int(status.get("draining", 0))
    state = status.get("state")
    details = {
        "engines": engines,
        "draining": draining,
        "queued": status.get("queued", 0),
        "state": state,
    }
    if state in ("paused", "suspended", "stopped"):
        return 503, _body(state, details)
    if hold_without_engines and engines <= draining:
        return 200, _body("holding", details)
    if engines < 1:
        return 503, _body("no_engines", details)
    if engines <= draining:
        return 503, _body("draining", details)
    return 200, {"status": "ready", **details}


def _body(reason: str, details: dict[str, Any]) -> dict[str, Any]:
    return {"status": reason, "reason": _REASONS[reason], **details}
