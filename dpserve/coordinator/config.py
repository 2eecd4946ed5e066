"""``CoordinatorConfig``: every setting of the coordinator, and the one place of their defaults.

The limits come from ``dpserve.limits`` (``RequestLimits``, ``AdmissionLimits``); the timing
rules are defined here. ``dpserve coordinator`` builds its flags from these fields (those with
a ``help`` in their metadata; the request limits come from ``dpserve.flags``, shared with the
HTTP edge), so the CLI, the constructor's keyword arguments and the status
report can never disagree about a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from dpserve.coordinator.routing import RoutingPolicy
from dpserve.limits import DEFAULT_ADMISSION_LIMITS, DEFAULT_REQUEST_LIMITS
from dpserve.security import key_files

_REQUEST = DEFAULT_REQUEST_LIMITS
_ADMISSION = DEFAULT_ADMISSION_LIMITS


def _flag(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


# The limits STATUS reports (``CoordinatorConfig.status_limits``): fields of the config and of
# ``dpserve.limits.RequestLimits`` / ``AdmissionLimits``, by the same names.
STATUS_LIMITS = (
    "max_inflight_per_client",
    "max_inflight_requests",
    "max_queued_requests",
    "max_message_bytes",
    "max_prompt_tokens",
    "max_prompt_chars",
    "max_dispatch_attempts",
)


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    host: str = _flag("127.0.0.1", "address to bind (default: %(default)s)")
    # None: prefix-aware, or round-robin in deterministic mode.
    routing: RoutingPolicy | str | None = None
    # Seconds an engine counts as holding a prefix it was just sent, before its KV events
    # confirm it (same-prefix bursts land together).
    prefix_prediction_ttl: float = 2.0
    heartbeat_timeout: float = _flag(
        5.0, "seconds of engine silence before the coordinator probes it (default: %(default)s)"
    )
    # A connected engine that says nothing for this long is removed as hung.
    engine_hung_timeout: float = 120.0
    # How long the constructor waits for data_parallel_size engines (None: for ever).
    engine_wait_timeout: float | None = None
    queue_timeout: float = _flag(
        _ADMISSION.queue_timeout, "seconds a request may wait for an engine (default: %(default)s)"
    )
    max_inflight_per_client: int = _flag(
        _ADMISSION.max_inflight_per_client, "requests one client may hold (default: %(default)s)"
    )
    max_inflight_requests: int = _flag(
        _ADMISSION.max_inflight_requests, "requests in flight at once (default: %(default)s)"
    )
    max_queued_requests: int = _flag(
        _ADMISSION.max_queued_requests, "requests waiting for an engine (default: %(default)s)"
    )
    max_message_bytes: int = _REQUEST.max_message_bytes
    max_prompt_tokens: int = _REQUEST.max_prompt_tokens
    max_prompt_chars: int = _REQUEST.max_prompt_chars
    max_dispatch_attempts: int = _flag(
        _ADMISSION.max_dispatch_attempts,
        "a request in flight on this many engines that died is failed, not sent again "
        "(default: %(default)s)",
    )
    # CURVE keys, or the credentials directory holding them; None: plain ZMQ.
    credentials: key_files.ServerKeys | str | os.PathLike[str] | None = None
    # --chat-template's text: chat prompts rendered with it, not the model's own template.
    chat_template: str | None = None

    def routing_policy(self, deterministic_mode: bool) -> RoutingPolicy:
        if self.routing:
            return RoutingPolicy(self.routing)
        return RoutingPolicy.ROUND_ROBIN if deterministic_mode else RoutingPolicy.PREFIX_AWARE

    def status_limits(self) -> dict[str, int]:
        """The limits as STATUS reports them, under their names in ``dpserve.limits`` (the
        HTTP front checks requests against some and exports each as a metric)."""
        return {name: getattr(self, name) for name in STATUS_LIMITS}

    def options(self) -> dict[str, Any]:
        """The settings as keyword arguments of ``DataParallelInferenceCoordinator``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def flag_fields() -> list[Any]:
    """The settings that ``dpserve coordinator`` exposes as ``--flags`` (their ``help``)."""
    return [f for f in fields(CoordinatorConfig) if "help" in f.metadata]
