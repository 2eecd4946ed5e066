"""The HTTP front's Prometheus metrics, in a registry of its own (several fronts can live in
one process, as tests do)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dpserve.client import RequestRecord
from dpserve.openai.responses import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT

STATUS_TIMEOUT: Final = 2.0  # /ready and /metrics give up on the coordinator after this long
TOKENS_PER_SECOND_WINDOW: Final = 10.0


class TokenRate:
    """Generated tokens per second over a sliding window (a gauge for dashboards that do not
    compute ``rate()`` themselves)."""

    def __init__(self, window: float = TOKENS_PER_SECOND_WINDOW) -> None:
        self.window = window
        self._started = time.monotonic()
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, count: int, now: float | None = None) -> None:
        if count:
            now = time.monotonic() if now is None else now
            self._events.append((now, count))
            self._total += count
            self._forget_before(now - self.window)  # bounded memory even if nobody scrapes

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._forget_before(now - self.window)
        # A process younger than the window has not had the whole window to generate in.
        span = max(1.0, min(self.window, now - self._started))
        return self._total / span

    def _forget_before(self, cutoff: float) -> None:
        while self._events and self._events[0][0] < cutoff:
            self._total -= self._events.popleft()[1]


# Per-engine metrics from the numbers each engine reports with its heartbeats (STATUS
# ``engine_list[].stats``): (metric name, stats key, help, is a counter). An engine that does
# not report a number (the fake engine, the transformers fallback's KV pool) has no sample.
ENGINE_STATS_METRICS: Final = (
    ("dpserve_engine_kv_cache_blocks", "kv_blocks", "Blocks in the engine's KV-cache pool", False),
    (
        "dpserve_engine_kv_cache_free_blocks",
        "kv_free_blocks",
        "KV-cache blocks free at the engine's last heartbeat",
        False,
    ),
    (
        "dpserve_engine_kv_cache_tokens",
        "kv_tokens",
        "Tokens the engine's KV-cache pool holds",
        False,
    ),
    ("dpserve_engine_kv_cache_bytes", "kv_bytes", "Bytes of the engine's KV-cache pool", False),
    (
        "dpserve_engine_max_concurrent_sequences",
        "max_num_seqs",
        "Sequences the engine runs at once at most (sized from its KV pool)",
        False,
    ),
    ("dpserve_engine_running_sequences", "running", "Sequences the engine is running", False),
    ("dpserve_engine_waiting_sequences", "waiting", "Sequences waiting in the engine", False),
    (
        "dpserve_engine_preemptions",
        "preemptions",
        "Sequences the engine preempted for KV-cache blocks (recomputed later)",
        True,
    ),
)


def _engine_stats_metrics(engines: list[Mapping[str, Any]]) -> Iterable[Metric]:
    for name, key, help_text, is_counter in ENGINE_STATS_METRICS:
        family_type = CounterMetricFamily if is_counter else GaugeMetricFamily
        family = family_type(name, help_text, labels=["rank"])
        for engine in engines:
            value = engine.get("stats", {}).get(key)
            if value is not None:
                family.add_metric([str(engine["rank"])], value)
        if family.samples:
            yield family


class _ScrapeCollector:
    """Gauges computed at scrape time: the coordinator's status (refreshed by the /metrics
    handler just before rendering) and the recent token rate."""

    def __init__(self, token_rate: TokenRate) -> None:
        self.token_rate = token_rate
        self.status: Mapping[str, Any] | None = None

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "dpserve_generated_tokens_per_second",
            f"Generated tokens per second over the last {self.token_rate.window:g} s",
            value=self.token_rate.per_second(),
        )
        status = self.status
        yield GaugeMetricFamily(
            "dpserve_coordinator_up",
            f"1 if the coordinator answered a status query within {STATUS_TIMEOUT:g} s",
            value=0 if status is None else 1,
        )
        if status is None:
            return  # absent beats stale: dashboards show a gap, not old numbers
        for name, key, help_text in (
            ("dpserve_registered_engines", "engines", "Engines registered with the coordinator"),
            ("dpserve_draining_engines", "draining", "Registered engines that are draining"),
            ("dpserve_queued_requests", "queued", "Requests waiting for an engine"),
            ("dpserve_coordinator_inflight_requests", "inflight", "Requests the coordinator holds"),
        ):
            yield GaugeMetricFamily(name, help_text, value=status.get(key, 0))
        inflight = GaugeMetricFamily(
            "dpserve_engine_inflight_requests",
            "Requests outstanding on each engine",
            labels=["rank"],
        )
        capacity = GaugeMetricFamily(
            "dpserve_engine_capacity", "Batch capacity each engine registered", labels=["rank"]
        )
        engines = status.get("engine_list", [])
        for engine in engines:
            inflight.add_metric([str(engine["rank"])], engine["outstanding"])
            capacity.add_metric([str(engine["rank"])], engine["capacity"])
        yield inflight
        yield capacity
        yield from _engine_stats_metrics(engines)
        for name, value in status.get("limits", {}).items():
            # STATUS names them as dpserve.limits does (max_prompt_tokens): the metric is
            # dpserve_limit_prompt_tokens.
            what = name.removeprefix("max_")
            yield GaugeMetricFamily(
                f"dpserve_limit_{what}",
                f"The coordinator's admission limit on {what.replace('_', ' ')}",
                value=value,
            )


class ConnectionCounts(Protocol):
    open: int
    refused: int
    timed_out: int


class _ConnectionCollector:
    def __init__(self, counts: ConnectionCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "dpserve_http_open_connections", "Open HTTP connections", value=self.counts.open
        )
        yield CounterMetricFamily(
            "dpserve_http_connections_refused",
            "Connections refused (503) because --http-max-connections were open",
            value=self.counts.refused,
        )
        yield CounterMetricFamily(
            "dpserve_http_connections_timed_out",
            "Connections closed for a request head not finished in time, or idle from the start",
            value=self.counts.timed_out,
        )


class FrontMetrics:
    """The HTTP front's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dpserve_http_requests",
            "HTTP API requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "dpserve_http_inflight_requests",
            "Generation requests this HTTP front is serving",
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "dpserve_time_to_first_token_seconds",
            "Seconds from receiving a request to its first generated token",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.latency = Histogram(
            "dpserve_request_latency_seconds",
            "Seconds from receiving a generation request to its last token",
            ["endpoint"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "dpserve_generated_tokens", "Tokens generated for this front", registry=self.registry
        )
        self.prompt_tokens = Counter(
            "dpserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.token_rate = TokenRate()
        self._scrape = _ScrapeCollector(self.token_rate)
        self.registry.register(self._scrape)
        # Export zeros from the start, so a rate() over the first requests is not lost.
        for endpoint in (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT):
            self.requests.labels(endpoint, "success")

    def add_generated(self, count: int) -> None:
        if count:
            self.generated_tokens.inc(count)
            self.token_rate.add(count)

    def finished(
        self, endpoint: str, record: RequestRecord, ttft: float | None, latency: float
    ) -> None:
        self.prompt_tokens.inc(len(record.prompt_tokens))
        if ttft is not None:
            self.time_to_first_token.labels(endpoint).observe(ttft)
        self.latency.labels(endpoint).observe(latency)

    def watch_connections(self, counts: ConnectionCounts) -> None:
        """Export the connection guard's counts (``serve_http`` has one; test apps do not)."""
        self.registry.register(_ConnectionCollector(counts))

    def render(self, coordinator_status: Mapping[str, Any] | None) -> bytes:
        self._scrape.status = coordinator_status
        return generate_latest(self.registry)
