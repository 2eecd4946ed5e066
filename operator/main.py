"""Entry point: ``dpserve operator`` calls ``run``."""

from __future__ import annotations

import importlib
import logging

import kopf

LIVENESS_PATH = "/healthz"


class QuietStatusRefresh(logging.Filter):
    """Drops kopf's INFO line for each successful 2-second status refresh of each resource
    (and each 1-second autoscaler tick).

    kopf logs every timer run; at one line per resource every 2 s the operator's log would
    hold little else. Failures and every other handler's lines still get through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno == logging.INFO
            and record.getMessage()
            in ("Timer 'refresh-status' succeeded.", "Timer 'autoscale' succeeded.")
        )


def run(namespace: str | None, all_namespaces: bool, liveness_port: int = 8080) -> None:
    """Run the operator until SIGTERM/SIGINT (blocking).

    Exactly one of ``namespace`` (watch that namespace) and ``all_namespaces`` must be given.
    The operator runs standalone: one replica, no kopf peering objects. Its liveness endpoint
    is ``http://0.0.0.0:<liveness_port>/healthz``.
    """
    if all_namespaces == bool(namespace):
        raise ValueError("pass either a namespace or all_namespaces=True, not both or neither")
    # Importing registers the handlers with kopf's default registry.
    importlib.import_module("dpserve_operator.handlers")
    logging.getLogger("kopf.objects").addFilter(QuietStatusRefresh())
    kopf.run(
        standalone=True,
        clusterwide=all_namespaces,
        namespaces=[namespace] if namespace else [],
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}{LIVENESS_PATH}",
    )
