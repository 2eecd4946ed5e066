"""The built-in autoscaler's decision: load + spec + clock → how many engines, and why.

Pure (no I/O, no clock of its own): ``decide`` takes what the coordinator reported
(``load.LoadSignal``, None when it could not be read), ``spec.autoscaling``, the current
engine count (``spec.dataParallelSize``), its own ``Memory`` of earlier readings and the
time, and returns a ``Decision`` and the next ``Memory``. The handlers write the count through
the scale subresource and post the decision as an event.

The rules (docs/kubernetes.md, "Autoscaling"):

- **What each metric asks for.** ``QueuedRequestsPerEngine`` (target T): the fewest engines
  ``n`` whose batches hold the requests in flight with at most T waiting per engine,
  ``n = ceil(demand / (capacity + T))``. ``KVCacheUsage`` (target u): the HPA's proportional
  rule, ``n = ceil(engines * usage / u)``, left alone within 10 % of the target.
  ``TTFTP90`` (target: the objective in seconds): up to ``ceil(engines * p90 / target)``
  when the p90 exceeds it, one engine fewer when it stays under half of it (TTFT does not fall
  in proportion to engines added: the band keeps it from flapping).
- **Held requests need an engine.** Any demand at all (a request held at zero engines)
  means at least one engine, at once, whatever the windows say: that is the scale from zero.
- **Zero only after idling.** With ``minReplicas: 0``, the last engine goes only after
  ``idleBeforeZeroSeconds`` without a request in flight or held (one that came and went
  between two readings counts too: the coordinator's finished-request counter moved).
- **Up fast, down slowly.** A scale-up takes the lowest recommendation of the last
  ``scaleUpWindowSeconds`` (0: at once, to the full recommendation). A scale-down takes the
  highest recommendation of the last ``scaleDownWindowSeconds``, and removes one engine at a
  time, at most one per window since the last change (the StatefulSet removes the highest
  ordinal; its streams move to the others).
- **No reading, no change.** When the coordinator's metrics cannot be read, or the chosen
  metric is not reported (an engine without a KV-cache pool; no first token in the TTFT
  window while requests run), the count stays, except to respect min and max.
- The count is always within ``[minReplicas, maxReplicas]``.

Recommendations count the engines that serve (registered, not draining), not the pods asked
for: an engine that never becomes ready adds no capacity, and so cannot make the autoscaler
add engines without end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .load import LoadSignal
from .spec import KV_CACHE_USAGE, QUEUED_REQUESTS_PER_ENGINE, TTFT_P90, AutoscalingSpec

# KVCacheUsage within this fraction of its target recommends no change (the HPA's default).
TOLERANCE = 0.1
# TTFTP90 recommends one engine fewer only below this fraction of its target.
TTFT_SCALE_DOWN_FRACTION = 0.5

# Decision reasons (the events' reasons; Hold* decisions post no event).
SCALE_UP, SCALE_DOWN = "ScaledUp", "ScaledDown"
SCALE_FROM_ZERO, SCALE_TO_ZERO = "ScaledFromZero", "ScaledToZero"
TO_BOUNDS = "ScaledIntoBounds"
HOLD, HOLD_NO_METRICS = "Steady", "NoMetrics"


@dataclass(frozen=True)
class Memory:
    """What the autoscaler remembers between readings (kept in the handlers' memo: an
    operator restart forgets it, and then waits a full scale-down window before removing an
    engine)."""

    # (time, recommendation) of the readings within the longer window, oldest first.
    recommendations: tuple[tuple[float, int], ...] = ()
    first_reading_at: float | None = None
    last_change_at: float | None = None
    last_busy_at: float | None = None  # the last reading with demand or requests served
    last_served: int | None = None  # the coordinator's finished-request count then


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    # The signal in words, e.g. "queued per engine 3.5 (target 0), demand 15, capacity 2".
    signal: str
    # The metric's current value (None when missing): status.autoscaling.currentValue.
    value: float | None

    def changes(self, current: int) -> bool:
        return self.desired != current

    def message(self, current: int) -> str:
        return f"engines {current} → {self.desired}: {self.signal}"


def decide(
    spec: AutoscalingSpec,
    current: int,
    load: LoadSignal | None,
    memory: Memory,
    now: float,
    *,
    default_capacity: int,
) -> tuple[Decision, Memory]:
    """The engine count for this reading. ``default_capacity``: the batch size an engine
    will have (``spec.engine.maxBatchSize``), for when no engine reports its own."""
    low = spec.min_replicas
    high = spec.max_replicas if spec.max_replicas is not None else max(current, low)
    if load is None:
        bounded = min(max(current, low), high)
        reason = TO_BOUNDS if bounded != current else HOLD_NO_METRICS
        signal = "the coordinator's metrics could not be read"
        return Decision(bounded, reason, signal, None), memory

    if memory.first_reading_at is None:
        # First reading: the idle clock starts now, not at some unknown earlier time.
        memory = replace(memory, first_reading_at=now, last_busy_at=now)
    # Demand now, or requests that started and finished since the last reading (a counter
    # that went down is a restarted coordinator, not activity).
    served_since = memory.last_served is not None and load.served > memory.last_served
    busy = load.demand > 0
    memory = replace(memory, last_served=load.served)
    if busy or served_since:
        memory = replace(memory, last_busy_at=now)
    idle_for = now - (memory.last_busy_at if memory.last_busy_at is not None else now)

    raw, value, signal = _recommend(spec, current, load, default_capacity)
    floor = low
    if busy or (current > 0 and idle_for < spec.idle_before_zero_seconds):
        # Demand needs an engine; and the last one stays until the deployment idled long
        # enough (an idle deployment at zero is not woken by this, though).
        floor = max(low, 1)
    missing = raw is None
    # A missing metric holds the count, within the bounds.
    recommendation = min(max(current if raw is None else raw, floor), high)

    longest = max(spec.scale_up_window_seconds, spec.scale_down_window_seconds)
    history = (
        *((at, count) for at, count in memory.recommendations if at > now - longest),
        (now, recommendation),
    )
    memory = replace(memory, recommendations=history)

    desired = current
    if current < floor or current > high:
        desired = min(max(current, floor), high)
    elif recommendation > current:
        up_window = [r for at, r in history if at >= now - spec.scale_up_window_seconds]
        desired = max(current, min(up_window))
        if current == 0 and busy:
            desired = max(desired, 1)  # held requests do not wait out a window
    elif recommendation < current:
        window = spec.scale_down_window_seconds
        # The highest recommendation of the window; to zero, the idle time was the window.
        highest = 0 if recommendation == 0 else max(r for at, r in history if at >= now - window)
        assert memory.first_reading_at is not None
        watched_long_enough = now - memory.first_reading_at >= window
        paced = memory.last_change_at is None or now - memory.last_change_at >= window
        if highest < current and watched_long_enough and paced:
            desired = current - 1

    if desired == current:
        reason = HOLD_NO_METRICS if missing else HOLD
    elif current == 0:
        reason = SCALE_FROM_ZERO
    elif desired == 0:
        reason = SCALE_TO_ZERO
        signal = f"{signal}; idle for {idle_for:.0f} s"
    elif current < low or current > high:
        reason = TO_BOUNDS
    else:
        reason = SCALE_UP if desired > current else SCALE_DOWN
    if desired != current:
        memory = replace(memory, last_change_at=now)
    bounds = f"min {low}, max {high}"
    return Decision(desired, reason, f"{signal} ({bounds})", value), memory


def _recommend(
    spec: AutoscalingSpec, current: int, load: LoadSignal, default_capacity: int
) -> tuple[int | None, float | None, str]:
    """(engines the metric asks for or None when it is missing, the metric's value, words)."""
    engines = load.serving_engines
    demand = load.demand
    held = f"demand {demand} ({load.queued} held), {engines} engines serving"
    if spec.metric == QUEUED_REQUESTS_PER_ENGINE:
        capacity = load.mean_capacity() or float(default_capacity)
        waiting = max(0.0, demand - engines * capacity)
        per_engine = waiting / engines if engines else float(waiting)
        wanted = math.ceil(demand / (capacity + spec.target)) if demand else 0
        signal = (
            f"queued per engine {per_engine:.2f} (target {spec.target:g}), {held}, "
            f"batch capacity {capacity:g}"
        )
        return wanted, per_engine, signal
    if spec.metric == KV_CACHE_USAGE:
        usage = load.mean_kv_usage()
        if usage is None:
            if not engines:
                return (1 if demand else 0), None, f"KV-cache usage unknown, {held}"
            return None, None, f"KV-cache usage not reported by the engines, {held}"
        ratio = usage / spec.target
        wanted = engines if abs(ratio - 1) <= TOLERANCE else math.ceil(engines * ratio)
        return wanted, usage, f"KV-cache usage {usage:.2f} (target {spec.target:g}), {held}"
    assert spec.metric == TTFT_P90
    p90 = load.ttft_p90
    if p90 is None:
        if not demand:
            return 0, None, f"TTFT p90 n/a (idle), {held}"
        if not engines:
            return 1, None, f"TTFT p90 n/a, {held}"
        return None, None, f"TTFT p90 not measured yet, {held}"
    if p90 > spec.target:
        wanted = max(engines + 1, math.ceil(engines * p90 / spec.target))
    elif p90 < spec.target * TTFT_SCALE_DOWN_FRACTION:
        wanted = engines - 1
    else:
        wanted = engines
    return wanted, p90, f"TTFT p90 {p90:.3f} s (objective {spec.target:g} s), {held}"
