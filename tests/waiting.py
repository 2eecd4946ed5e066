"""Waiting in tests until something holds: ``wait_until`` blocks (for code outside an event
loop), ``eventually`` awaits. Both poll and fail with an ``AssertionError`` naming what they
waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def eventually(
    check: Callable[[], bool],
    within: float = 10.0,
    what: str = "the condition",
    interval: float = 0.05,
) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g} s waiting for {what}")
        await asyncio.sleep(interval)
