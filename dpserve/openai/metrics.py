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
    (
        "dpserve_engine_prefix_cache_queries",
        "prefix_cache_queries",
        "Prompt tokens the engine looked up in its prefix cache (vLLM's prefix_cache_queries)",
        True,
    ),
    (
        "dpserve_engine_prefix_cache_hits",
        "prefix_cache_hits",
        "Prompt tokens the engine found in its prefix cache (vLLM's prefix_cache_hits)",
        True,
    ),
    (
        "dpserve_engine_kv_cache_usage_perc",
        "kv_cache_usage",
        "Share (0-1) of KV-cache blocks held by running sequences (vLLM's kv_cache_usage_perc)",
        False,
    ),
    (
        "dpserve_engine_kv_cache_cached_blocks",
        "kv_cached_blocks",
        "KV-cache blocks holding a reusable prefix (held or evictable)",
        False,
    ),
    (
        "dpserve_engine_prefill_tokens",
        "prefill_tokens",
        "Prompt tokens the engine actually computed (those not served from its prefix cache)",
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


def _routing_metrics(routing: Mapping[str, Any]) -> Iterable[Metric]:
    """The coordinator's routing decisions and how well its prefix index predicted caches."""
    decisions = CounterMetricFamily(
        "dpserve_routing_decisions",
        "Requests routed, by the reason the policy gave (prefix, load, balance, hot_spot)",
        labels=["reason"],
    )
    for reason, count in sorted(routing.get("decisions", {}).items()):
        decisions.add_metric([reason], count)
    yield decisions
    if "adapter_decisions" in routing:
        adapter_decisions = CounterMetricFamily(
            "dpserve_routing_adapter_decisions",
            "Requests for a LoRA adapter routed: to an engine holding it (resident), to one "
            "loading it as none held it (load), or as its holders were busier (moved)",
            labels=["outcome"],
        )
        for outcome, count in sorted(routing["adapter_decisions"].items()):
            adapter_decisions.add_metric([outcome], count)
        yield adapter_decisions
    for name, key, help_text in (
        (
            "dpserve_routing_predicted_cached_tokens",
            "predicted_cached_tokens",
            "Prompt tokens the prefix index predicted the chosen engines had cached",
        ),
        (
            "dpserve_routing_actual_cached_tokens",
            "actual_cached_tokens",
            "Prompt tokens the chosen engines reported they found cached (same requests)",
        ),
        (
            "dpserve_routing_prediction_error_tokens",
            "prediction_error_tokens",
            "Sum over requests of |predicted - actual| cached prompt tokens",
        ),
    ):
        if key in routing:
            yield CounterMetricFamily(name, help_text, value=routing[key])
    paces = routing.get("pace_by_rank", {})
    if paces:
        family = GaugeMetricFamily(
            "dpserve_routing_wait_price_tokens",
            "What the prefix-aware router charges, in prompt tokens, for each request ahead "
            "of a new one in an engine's queue for a slot (measured from its pace)",
            labels=["rank"],
        )
        for rank, pace in sorted(paces.items()):
            family.add_metric([rank], pace["wait_price_tokens"])
        yield family
    if "indexed_blocks" in routing:
        yield GaugeMetricFamily(
            "dpserve_routing_indexed_blocks",
            "Block hashes in the coordinator's prefix index",
            value=routing["indexed_blocks"],
        )


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
            (
                "dpserve_queued_requests",
                "queued",
                "Requests held because no engine could take them (at zero engines: the "
                "demand that scales from zero)",
            ),
            (
                "dpserve_oldest_queued_request_seconds",
                "oldest_queued_seconds",
                "Seconds the oldest held request has waited for an engine (0: none held)",
            ),
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
        yield from _lora_metrics(engines)
        yield from _routing_metrics(status.get("prefix_routing", {}))
        for name, value in status.get("limits", {}).items():
            # STATUS names them as dpserve.limits does (max_prompt_tokens): the metric is
            # dpserve_limit_prompt_tokens.
            what = name.removeprefix("max_")
            yield GaugeMetricFamily(
                f"dpserve_limit_{what}",
                f"The coordinator's admission limit on {what.replace('_', ' ')}",
                value=value,
            )


def _lora_metrics(engines: list[dict[str, Any]]) -> Iterable[Metric]:
    """LoRA adapters, from what engines report (STATUS ``engine_list[].adapters``): per adapter
    the engines holding it loaded and its requests running and waiting, summed over engines;
    and vLLM's ``vllm:lora_requests_info`` (the Gateway API Inference Extension picks engines
    by it): the adapters with running / waiting requests, comma-joined, and ``max_lora``, the
    value the scrape's time. Nothing while no engine serves adapters."""
    reports = [engine["adapters"] for engine in engines if engine.get("adapters")]
    if not reports:
        return
    per_adapter: dict[str, list[int]] = {}
    for report in reports:
        for name, counts in report["adapters"].items():
            total = per_adapter.setdefault(name, [0, 0, 0])
            for index, count in enumerate(counts):
                total[index] += count
    families = [
        GaugeMetricFamily(
            "dpserve_lora_adapter_loaded",
            "Engines holding the LoRA adapter loaded in a slot",
            labels=["adapter"],
        ),
        GaugeMetricFamily(
            "dpserve_lora_adapter_running_requests",
            "Requests of the LoRA adapter running on the engines",
            labels=["adapter"],
        ),
        GaugeMetricFamily(
            "dpserve_lora_adapter_waiting_requests",
            "Requests of the LoRA adapter waiting on the engines (for a step or a slot)",
            labels=["adapter"],
        ),
    ]
    for name, counts in sorted(per_adapter.items()):
        for family, count in zip(families, counts, strict=True):
            family.add_metric([name], count)
    yield from families
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running and waiting LoRA adapters (vLLM's metric); the value is the scrape's time",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    running = ",".join(name for name, counts in sorted(per_adapter.items()) if counts[1])
    waiting = ",".join(name for name, counts in sorted(per_adapter.items()) if counts[2])
    max_lora = min(int(report["max_loras"]) for report in reports)
    info.add_metric([str(max_lora), running, waiting], time.time())
    yield info


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
