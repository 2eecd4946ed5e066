"""The load an InferenceDeployment carries, read from its coordinator's Prometheus page.

The operator's autoscaler reads the very numbers an external KEDA ``ScaledObject`` would
(docs/kubernetes.md): ``dpserve_registered_engines``, ``dpserve_draining_engines``,
``dpserve_queued_requests`` (held while no engine can take them), the per-engine in-flight
requests, batch capacity and KV-cache blocks, and the time-to-first-token histogram. Pure: the
handlers fetch the text (``Cluster.coordinator_metrics``), this module reads it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# TTFT p90 is taken over the requests whose first token came within this window.
TTFT_WINDOW_SECONDS = 60.0


@dataclass(frozen=True)
class EngineLoad:
    rank: int
    outstanding: int
    capacity: int
    # 0..1, None when the engine does not report its KV-cache pool.
    kv_usage: float | None


@dataclass(frozen=True)
class LoadSignal:
    """One reading of the coordinator's metrics."""

    engines: int  # registered
    draining: int
    queued: int  # held: no engine could take them (yet)
    inflight: int  # every request the coordinator holds, queued ones included
    engine_loads: tuple[EngineLoad, ...]
    # Over the last TTFT_WINDOW_SECONDS; None when no request got its first token then.
    ttft_p90: float | None = None
    # Generation requests finished since the coordinator's front started (a counter): one
    # that came and went between two readings still counts as activity.
    served: int = 0

    @property
    def serving_engines(self) -> int:
        return max(0, self.engines - self.draining)

    @property
    def demand(self) -> int:
        """Requests the deployment has to serve now (in flight on engines or held)."""
        return max(self.inflight, self.queued)

    def mean_capacity(self) -> float | None:
        capacities = [e.capacity for e in self.engine_loads if e.capacity > 0]
        return sum(capacities) / len(capacities) if capacities else None

    def mean_kv_usage(self) -> float | None:
        usages = [e.kv_usage for e in self.engine_loads if e.kv_usage is not None]
        return sum(usages) / len(usages) if usages else None


class MalformedMetrics(ValueError):
    """The page is not the coordinator's metrics (or not Prometheus text at all)."""


Histogram = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), sorted


class TtftWindow:
    """Cumulative TTFT histograms as scraped, kept for TTFT_WINDOW_SECONDS: the p90 of what
    happened in the window is the quantile of the difference between now and its start."""

    def __init__(self, window: float = TTFT_WINDOW_SECONDS) -> None:
        self.window = window
        self._samples: deque[tuple[float, Histogram]] = deque()

    def p90(self, now: float, histogram: Histogram) -> float | None:
        samples = self._samples
        # A counter that went down: the coordinator restarted, older samples mean nothing.
        if samples and _total(histogram) < _total(samples[-1][1]):
            samples.clear()
        samples.append((now, histogram))
        while len(samples) > 1 and samples[1][0] <= now - self.window:
            samples.popleft()
        oldest = samples[0][1] if len(samples) > 1 else ()
        return histogram_quantile(0.9, _difference(histogram, oldest))


def read_metrics(text: str, now: float, ttft: TtftWindow | None = None) -> LoadSignal:
    """The load in a ``/metrics`` page. Raises ``MalformedMetrics`` when the page lacks the
    coordinator's gauges (the coordinator did not answer the front: ``dpserve_coordinator_up``
    is 0 and they are left out)."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as error:
        raise MalformedMetrics(f"not Prometheus text: {error}") from error
    values: dict[str, float] = {}
    per_rank: dict[str, dict[int, float]] = {}
    buckets: dict[float, float] = {}
    served = 0.0
    for family in families:
        for sample in family.samples:
            if sample.name == "dpserve_request_latency_seconds_count":
                served += sample.value  # summed over endpoints
            elif sample.name == "dpserve_time_to_first_token_seconds_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value  # summed over endpoints
            elif "rank" in sample.labels:
                per_rank.setdefault(sample.name, {})[int(sample.labels["rank"])] = sample.value
            elif not sample.labels:
                values[sample.name] = sample.value
    if not values.get("dpserve_coordinator_up"):
        raise MalformedMetrics("the coordinator did not answer the HTTP front's status query")
    try:
        engines = int(values["dpserve_registered_engines"])
        queued = int(values["dpserve_queued_requests"])
        inflight = int(values["dpserve_coordinator_inflight_requests"])
    except KeyError as error:
        raise MalformedMetrics(f"the page has no {error.args[0]}") from error
    histogram = tuple(sorted(buckets.items()))
    return LoadSignal(
        engines=engines,
        draining=int(values.get("dpserve_draining_engines", 0)),
        queued=queued,
        inflight=inflight,
        engine_loads=tuple(_engine_loads(per_rank)),
        ttft_p90=None if ttft is None or not histogram else ttft.p90(now, histogram),
        served=int(served),
    )


def histogram_quantile(quantile: float, histogram: Histogram) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket that holds the rank; None
    for an empty histogram. A rank in the ``+Inf`` bucket answers the largest finite bound."""
    total = _total(histogram)
    if total <= 0:
        return None
    rank = quantile * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in histogram:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _total(histogram: Histogram) -> float:
    return histogram[-1][1] if histogram else 0.0


def _difference(new: Histogram, old: Histogram) -> Histogram:
    before = dict(old)
    return tuple((bound, count - before.get(bound, 0.0)) for bound, count in new)


def _engine_loads(per_rank: Mapping[str, Mapping[int, float]]) -> Iterable[EngineLoad]:
    outstanding = per_rank.get("dpserve_engine_inflight_requests", {})
    capacity = per_rank.get("dpserve_engine_capacity", {})
    blocks = per_rank.get("dpserve_engine_kv_cache_blocks", {})
    free = per_rank.get("dpserve_engine_kv_cache_free_blocks", {})
    for rank in sorted(set(outstanding) | set(capacity)):
        kv_usage = None
        if blocks.get(rank) and rank in free:
            kv_usage = min(1.0, max(0.0, 1.0 - free[rank] / blocks[rank]))
        yield EngineLoad(
            rank=rank,
            outstanding=int(outstanding.get(rank, 0)),
            capacity=int(capacity.get(rank, 0)),
            kv_usage=kv_usage,
        )
