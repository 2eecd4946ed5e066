"""When ``dpserve serve`` starts a child that exited again: after a backoff that doubles with
each death, unless the child keeps dying (a crash loop), in which case it is left down. Also
how an exit is put in words (``describe_exit``). Pure: no processes are started here
(``dpserve.local`` does that).
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Final

# The first restart waits a second: long enough that a child dying at once does not spin the
# machine, short enough that a one-off crash (an OOM kill, a poisoned step) costs little. Each
# further death within the window doubles it, up to half a minute, what a user waiting for a
# GPU to come back would still call prompt.
FIRST_BACKOFF_S: Final = 1.0
MAX_BACKOFF_S: Final = 30.0
# The fifth death within five minutes leaves the child down: a child that dies that often is
# not going to start working by itself (a model that cannot load, a broken GPU, a bad flag),
# and each try costs a model load. Five tries span about 15 s of backoff (1 + 2 + 4 + 8) plus
# five start-ups, so a transient failure gets several chances while a permanent one is
# reported within a minute or two. A child that dies less often than that (one crash an hour)
# is restarted for ever.
CRASH_LOOP_DEATHS: Final = 5
CRASH_LOOP_WINDOW_S: Final = 300.0


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff: float = FIRST_BACKOFF_S
    max_backoff: float = MAX_BACKOFF_S
    crash_loop_deaths: int = CRASH_LOOP_DEATHS
    crash_loop_window: float = CRASH_LOOP_WINDOW_S

    def __post_init__(self) -> None:
        if self.first_backoff <= 0 or self.max_backoff < self.first_backoff:
            raise ValueError("backoff must be positive, and its cap at least its first delay")
        if self.crash_loop_deaths < 1 or self.crash_loop_window <= 0:
            raise ValueError("a crash loop needs at least one death within a positive window")

    def backoff(self, deaths: int) -> float:
        """Seconds to wait before the restart that follows the ``deaths``-th recent death
        (1: the first): ``first_backoff`` doubled per further death, at most ``max_backoff``."""
        if deaths < 1:
            raise ValueError(f"deaths counts from 1, got {deaths}")
        doublings = min(deaths - 1, 62)  # 2**62 s is past any cap; larger would only overflow
        return min(self.max_backoff, self.first_backoff * 2.0**doublings)


@dataclass
class Deaths:
    """One child's deaths within the policy's window, and what to do about the latest."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    times: deque[float] = field(default_factory=deque)  # monotonic seconds, oldest first

    def record(self, now: float) -> float | None:
        """Note a death at ``now``: the seconds to wait before restarting, or None when this
        death completes a crash loop and the child is to be left down."""
        self.times.append(now)
        while self.times and self.times[0] <= now - self.policy.crash_loop_window:
            self.times.popleft()
        if len(self.times) >= self.policy.crash_loop_deaths:
            return None
        return self.policy.backoff(len(self.times))

    @property
    def recent(self) -> int:
        """Deaths within the window, as of the latest ``record``."""
        return len(self.times)


def describe_exit(returncode: int) -> str:
    """How a child ended, from ``Popen.returncode`` (negative: the signal that killed it):
    ``'exited with code 1'``, ``'was killed by SIGKILL'``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"
