"""How fast each engine gets through its requests, measured by the coordinator: what the
prefix-aware router charges for a wait for a slot there.

A request in flight that an engine runs decodes beside the others and slows each step a little
(``PrefixRouting.request_cost_tokens``). A request sent to an engine that runs all it can
already waits until one of those finishes, and on a slow engine that is seconds (vLLM's CPU
build on SmolLM2 finishes a request every ~0.7 s under load), worth hundreds of prompt tokens
of prefill: a constant price cannot be right for a fast and a slow engine both. So each
engine's is measured, by Little's law:

* ``seconds_per_request``: the time the engine had requests in flight over the requests it
  finished in that time (running means, recent ones weighing most): under load, the interval
  between two finishes, so the wait for each slot that must free first;
* ``prefill_tokens_per_second``: prompt tokens it computes a second, from dispatch to first
  token of the requests that found a slot free and no prefill queued ahead of them (one that
  waited reads as slow as the queue, not the engine: under load vLLM's CPU engines read at
  half their rate); the median of the last 16 such, the engine's first left out (it pays for
  the engine's warm-up: vLLM's first forward on CPU took seconds). Under a lasting queue there
  are none, and the rate measured before it holds (it is the engine's, not the load's). An
  engine loaded from its start has none at all: until it has one, the rate is the upper
  quartile of requests that waited, timed over the prefill queued ahead of them and their own
  (slow by the queue's waits, so a price too low rather than none).

A request ahead in the queue for a slot costs ``seconds_per_request x
prefill_tokens_per_second`` prompt tokens, the unit of the rest of the cost; until both are
measured it costs nothing beyond the constant per-request price. How many are ahead:
everything in flight beyond what the engine runs at once, which is its capacity, or fewer when
its last heartbeat said it was running fewer with others waiting (a KV pool too small for
``capacity`` of these prompts).

Pure bookkeeping: the router feeds it times it read from its clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

# A prefill shorter than this says more about the step around it than about prefill.
MIN_PREFILL_SAMPLE_TOKENS: Final = 64
# Recent prefill samples kept; the rate is their median.
PREFILL_SAMPLES: Final = 16
# The weight the past keeps at each finished request: ~the last 20 carry 90 % of the mean.
KEEP: Final = 0.9
# A price past this is a measurement gone wrong (a stalled engine), not a queue: at this
# price any engine with a free slot is preferred, which is all a larger one would say.
MAX_WAIT_PRICE_TOKENS: Final = 1_000_000.0


@dataclass(slots=True)
class EnginePace:
    """One engine's measured pace; ``floor``: a request waiting for a slot is never cheaper
    than one running (``PrefixRouting.request_cost_tokens``)."""

    floor: float
    busy_seconds: float = 0.0  # decayed sums: seconds with requests in flight, finishes
    finished: float = 0.0
    # Since when its busy time is not counted yet: its last finish, or the arrival of a
    # request to it idle (None: it never had one).
    since: float | None = None
    prefill_rates: deque[float] = field(default_factory=lambda: deque(maxlen=PREFILL_SAMPLES))
    prefill_tokens_per_second: float | None = None  # their median
    warmed_up: bool = False  # its first prefill was seen (and left out)
    queued_rates: deque[float] = field(default_factory=lambda: deque(maxlen=PREFILL_SAMPLES))
    # Prompt tokens one request ahead in the queue for a slot costs (0: not measured yet).
    wait_price_tokens: float = 0.0
    # How many requests it runs at once, as read from the heartbeat stats it was read from
    # (each heartbeat brings a new map: read once, not per request routed).
    runs_at_once: int = 0
    stats_read: Mapping[str, float] | None = None

    def runs(self, capacity: int, stats: Mapping[str, float]) -> int:
        """How many requests the engine runs at once (``running_at_once``), by the heartbeat
        ``stats`` it last reported."""
        if stats is not self.stats_read:
            self.stats_read = stats
            self.runs_at_once = running_at_once(
                capacity, stats.get("running"), stats.get("waiting")
            )
        return self.runs_at_once

    def slot_wait_tokens(
        self, outstanding: int, capacity: int, stats: Mapping[str, float]
    ) -> float:
        """What waiting for a slot costs a request sent to the engine now, with
        ``outstanding`` requests in flight there: none while one is free, else
        ``wait_price_tokens`` for each that must finish first."""
        ahead = outstanding - self.runs(capacity, stats) + 1
        return ahead * self.wait_price_tokens if ahead > 0 else 0.0

    def started(self, now: float) -> None:
        """A request was sent to the engine while it had none in flight."""
        self.since = now

    def request_finished(self, now: float) -> None:
        """A request the engine ran finished at ``now``."""
        since, self.since = self.since, now
        if since is None or now < since:
            return
        self.busy_seconds = KEEP * self.busy_seconds + (now - since)
        self.finished = KEEP * self.finished + 1.0
        if self.prefill_tokens_per_second is not None:
            self._reprice()

    def prefilled(self, seconds: float, tokens: int) -> None:
        """A request's ``tokens`` of prefill took ``seconds`` from its dispatch to its first
        token, on a free slot with no prefill queued ahead of it."""
        if tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0.0:
            if not self.warmed_up:
                self.warmed_up = True
                return
            rates = self.prefill_rates
            rates.append(tokens / seconds)
            self.prefill_tokens_per_second = sorted(rates)[len(rates) // 2]
            self._reprice()

    def prefilled_queued(self, seconds: float, tokens: int) -> None:
        """``tokens`` of prefill, a request's and those queued ahead of it, took ``seconds``
        from its dispatch to its first token: counted only while no request found the engine
        free (``prefilled``)."""
        if self.prefill_rates or tokens < MIN_PREFILL_SAMPLE_TOKENS or seconds <= 0.0:
            return
        rates = self.queued_rates
        rates.append(tokens / seconds)
        self.prefill_tokens_per_second = sorted(rates)[(3 * len(rates)) // 4]
        self._reprice()

    @property
    def seconds_per_request(self) -> float | None:
        return self.busy_seconds / self.finished if self.finished > 0.0 else None

    def _reprice(self) -> None:
        self.wait_price_tokens = wait_price_tokens(
            self.seconds_per_request, self.prefill_tokens_per_second, self.floor
        )

    def report(self) -> dict[str, float]:
        """For STATUS: the means measured so far and the price they give."""
        report = {"wait_price_tokens": round(self.wait_price_tokens, 1)}
        if (seconds := self.seconds_per_request) is not None:
            report["seconds_per_request"] = round(seconds, 4)
        if (rate := self.prefill_tokens_per_second) is not None:
            report["prefill_tokens_per_second"] = round(rate, 1)
        return report


def wait_price_tokens(
    seconds_per_request: float | None, prefill_tokens_per_second: float | None, floor: float
) -> float:
    """What one request ahead in an engine's queue for a slot costs a new request, in that
    engine's prompt tokens of prefill; 0 while either pace is unmeasured."""
    if seconds_per_request is None or prefill_tokens_per_second is None:
        return 0.0
    price = seconds_per_request * prefill_tokens_per_second
    return min(max(price, floor), MAX_WAIT_PRICE_TOKENS)


def running_at_once(capacity: int, running: float | None, waiting: float | None) -> int:
    """How many requests the engine runs at once: its capacity, or what it ran at its last
    heartbeat if others waited then (its KV pool held no more)."""
    if running is not None and waiting is not None and waiting > 0 and 1 <= running < capacity:
        return int(running)
    return capacity
