"""What ``/health`` answers for a coordinator status (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def health_body(status: Mapping[str, Any] | None) -> tuple[int, dict[str, Any]]:
    """``/health``'s status code and body for a coordinator status (None: no answer)."""
    if status is None:
        return 503, {"status": "coordinator_unavailable"}
    engines = int(status.get("engines", 0))
    body = {
        "status": "ok" if engines >= 1 else "no_engines",
        "engines": engines,
        "draining": status.get("draining", 0),
        "queued": status.get("queued", 0),
        "state": status.get("state"),
    }
    return (200 if engines >= 1 else 503), body
