"""Structured-output constraints compile off the engine's step loop, within a time budget.

Compiling a grammar and computing its first token mask take from well under a millisecond to
seconds, growing with the constraint (``limits.RequestLimits.max_constraint_bytes`` bounds
that). Done inside ``Runner.add`` it stalled every request on the engine while it ran, so a
constrained request waits here instead: its compile runs on a worker thread (llguidance drops
the GIL while it builds), the step loop goes on with everybody else, and each step collects
what finished. A compile still running ``constraint_compile_timeout`` seconds after it started
refuses its request with a 400 naming the limit; its thread finishes on its own (the size limit
bounds how long) and the result is dropped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dpserve.engine.sample.grammar import GrammarError, Matcher
from dpserve.engine.sequences import Sequence

# Two workers: one hostile constraint that runs to its budget does not hold up the next
# request's compile.
COMPILE_WORKERS = 2
# The workers run at a lower CPU priority: a compile must not take cores from the forward
# passes of the requests already running (torch's threads use every core an engine has). Not
# the lowest: at 19 a compile on a core that decodes gets ~1.5% of it and a legitimate schema
# would run out its compile budget; at 10, ~10%.
WORKER_NICENESS = 10


def _lower_priority() -> None:
    """Runs once in each worker thread (Linux schedules threads by their own nice value)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)


@dataclass(slots=True, eq=False)
class _Job:
    sequence: Sequence
    future: concurrent.futures.Future[Matcher]
    started: list[float] = field(default_factory=list)  # set by the worker as it starts


@dataclass(slots=True)
class Compiled:
    """What one collection found: sequences whose matcher is ready (set on them), and the
    refused ones with why."""

    ready: list[Sequence] = field(default_factory=list)
    refused: list[tuple[Sequence, str]] = field(default_factory=list)


class ConstraintCompiler:
    """Compiles each constrained sequence's matcher on worker threads."""

    def __init__(self, compile_matcher: Callable[[Sequence], Matcher], timeout: float) -> None:
        self._compile = compile_matcher
        self.timeout = timeout
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: dict[int, _Job] = {}  # by request id
        self._finished = threading.Event()  # a job finished since the last collection

    def submit(self, sequence: Sequence) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                COMPILE_WORKERS, "dpserve-constraint", initializer=_lower_priority
            )
        started: list[float] = []

        def run() -> Matcher:
            started.append(time.monotonic())
            try:
                return self._compile(sequence)
            finally:
                self._finished.set()

        job = _Job(sequence, self._pool.submit(run), started)
        self._jobs[sequence.request_id] = job

    def cancel(self, request_id: int) -> bool:
        """Forget a request's compile (its result is dropped); False if none was queued."""
        job = self._jobs.pop(request_id, None)
        if job is None:
            return False
        job.future.cancel()
        return True

    def pending(self) -> bool:
        return bool(self._jobs)

    def wait(self, seconds: float) -> None:
        """Block until some compile finished or ``seconds`` passed (the loop has nothing else
        to do: no spinning while a constraint compiles)."""
        if self._jobs and self._finished.wait(seconds):
            self._finished.clear()

    def collect(self, now: float | None = None) -> Compiled:
        """Take the finished compiles and refuse the ones past their budget."""
        now = time.monotonic() if now is None else now
        compiled = Compiled()
        for request_id, job in list(self._jobs.items()):
            if job.future.done():
                del self._jobs[request_id]
                error = job.future.exception()
                if error is None:
                    job.sequence.matcher = job.future.result()
                    compiled.ready.append(job.sequence)
                elif isinstance(error, GrammarError):
                    compiled.refused.append((job.sequence, str(error)))
                else:
                    compiled.refused.append(
                        (
                            job.sequence,
                            "the structured-output constraint could not be compiled: "
                            f"{type(error).__name__}: {error}",
                        )
                    )
            elif job.started and now - job.started[0] > self.timeout:
                del self._jobs[request_id]
                compiled.refused.append(
                    (
                        job.sequence,
                        "the structured-output constraint did not compile within the limit "
                        f"constraint_compile_timeout={self.timeout:g} s",
                    )
                )
        return compiled

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
