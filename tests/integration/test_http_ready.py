"""Issue 9, item 7: ``/health`` (and ``/livez``) is liveness, ``/ready`` readiness with the
reason it is not ready: paused, suspended, stopped, no engine registered, coordinator
unreachable."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from dpserve.client import InferenceClient
from tests.integration.http_support import children_of, http_json, ready_is, start_cluster
from tests.integration.runtime import Processes
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def ready(base_url: str) -> tuple[int, str]:
    code, body = http_json(f"{base_url}/ready")
    if body["status"] != "coordinator_unavailable":
        assert {"status", "engines", "draining", "queued", "state"} <= set(body), body
    assert code == 200 or body["reason"], body
    return code, body["status"]


def assert_live(base_url: str) -> None:
    started = time.monotonic()
    for path in ("/health", "/livez"):
        assert http_json(f"{base_url}{path}", timeout=2) == (200, {"status": "alive"})
    assert time.monotonic() - started < 1.0


async def test_ready_reflects_pause_suspend_stop_and_health_stays_live(
    processes: Processes,
) -> None:
    cluster = start_cluster(processes, engines=1)
    base = cluster.base_url
    assert ready(base) == (200, "ready")
    async with InferenceClient(cluster.zmq_port, handshake_timeout=20) as admin:
        steps = [
            (admin.pause_engines, 503, "paused"),
            (admin.suspend_engines, 503, "suspended"),
            (admin.resume_engines, 503, "paused"),  # RESUME returns to PAUSED
            (admin.unpause_engines, 200, "ready"),
            (admin.stop_engines, 503, "stopped"),
        ]
        for signal_engines, code, status in steps:
            await asyncio.wait_for(signal_engines(), 20)
            assert ready(base) == (code, status), status  # at once: no stale answer
            assert_live(base)


def test_ready_without_engines_and_without_a_coordinator(processes: Processes) -> None:
    cluster = start_cluster(processes, engines=1)
    base = cluster.base_url
    [engine] = [p for p in processes.started if p is not cluster.coordinator]
    engine.send_signal(signal.SIGKILL)
    wait_until(lambda: ready(base) == (503, "no_engines"), 30, "the engine to be dropped")
    assert_live(base)

    # A coordinator that does not answer: the front stays live, readiness says why.
    children = children_of(cluster.coordinator.pid)
    [child] = [pid for pid, command in children.items() if "spawn_main" in command]
    os.kill(child, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert ready(base) == (503, "coordinator_unavailable")
        assert time.monotonic() - started < 5
        assert_live(base)
    finally:
        os.kill(child, signal.SIGCONT)
    wait_until(ready_is(base, 503), 10, "the coordinator to answer again")
