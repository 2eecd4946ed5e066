"""The built-in autoscaler's decision (dpserve_operator.autoscaling.decide) over the edge cases,
spec.autoscaling's validation, and the load it reads from the HTTP front's real /metrics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pytest

from dpserve.cli import build_parser
from dpserve.client import RequestRecord
from dpserve.openai.metrics import FrontMetrics
from dpserve.openai.responses import COMPLETIONS_ENDPOINT
from dpserve_operator.autoscaling import (
    HOLD,
    HOLD_NO_METRICS,
    SCALE_DOWN,
    SCALE_FROM_ZERO,
    SCALE_TO_ZERO,
    SCALE_UP,
    TO_BOUNDS,
    Decision,
    Memory,
    decide,
)
from dpserve_operator.load import (
    EngineLoad,
    LoadSignal,
    MalformedMetrics,
    TtftWindow,
    histogram_quantile,
    read_metrics,
)
from dpserve_operator.manifests import coordinator_command
from dpserve_operator.spec import AutoscalingSpec, InvalidSpec, parse_spec

CAPACITY = 4
BASE = {"model": "m", "image": "ghcr.io/dpserve/runtime-cpu:0.1.0"}


def scaling(**changes: Any) -> AutoscalingSpec:
    spec = AutoscalingSpec(
        mode="Builtin",
        min_replicas=0,
        max_replicas=4,
        metric="QueuedRequestsPerEngine",
        target=0.0,
        scale_up_window_seconds=0,
        scale_down_window_seconds=30,
        idle_before_zero_seconds=60,
    )
    return replace(spec, **changes)


def load(
    engines: int,
    demand: int,
    *,
    queued: int = 0,
    kv: float | None = None,
    ttft: float | None = None,
    ready: int | None = None,
) -> LoadSignal:
    """``engines`` registered, the first ``ready`` of them (all by default) serving."""
    ready = engines if ready is None else ready
    return LoadSignal(
        engines=ready,
        draining=0,
        queued=queued,
        inflight=demand,
        engine_loads=tuple(
            EngineLoad(rank, demand // max(ready, 1), CAPACITY, kv) for rank in range(ready)
        ),
        ttft_p90=ttft,
    )


class Run:
    """Feeds readings to ``decide`` as the handlers do: the count follows each decision."""

    def __init__(self, spec: AutoscalingSpec, current: int, start: float = 1000.0) -> None:
        self.spec, self.current, self.now, self.memory = spec, current, start, Memory()
        self.decisions: list[tuple[float, Decision]] = []

    def step(self, reading: LoadSignal | None, seconds: float = 1.0) -> Decision:
        decision, self.memory = decide(
            self.spec, self.current, reading, self.memory, self.now, default_capacity=CAPACITY
        )
        if decision.desired != self.current:
            self.decisions.append((self.now, decision))
        self.current = decision.desired
        self.now += seconds
        return decision

    def steps(self, readings: Iterable[LoadSignal | None]) -> list[int]:
        return [self.step(reading).desired for reading in readings]


# --------------------------------------------------------------------------- decisions


def test_demand_asks_for_enough_batches() -> None:
    run = Run(scaling(), current=1)
    decision = run.step(load(1, 13))
    # ceil(13 / (4 + 0)) = 4, at once (scale-up window 0).
    assert (decision.desired, decision.reason) == (4, SCALE_UP)
    assert "queued per engine 9.00" in decision.signal and "demand 13" in decision.signal
    assert decision.value == 9.0


def test_the_target_leaves_room_to_queue() -> None:
    run = Run(scaling(target=2.0), current=1)
    assert run.step(load(1, 13)).desired == 3  # ceil(13 / (4 + 2))


def test_max_caps_the_count() -> None:
    run = Run(scaling(max_replicas=2), current=1)
    assert run.step(load(1, 100)).desired == 2


def test_a_request_held_at_zero_starts_an_engine_at_once() -> None:
    run = Run(scaling(scale_up_window_seconds=600), current=0)
    decision = run.step(load(0, 1, queued=1))
    assert (decision.desired, decision.reason) == (1, SCALE_FROM_ZERO)
    assert "1 held" in decision.signal


def test_idle_at_zero_stays_at_zero_after_an_operator_restart() -> None:
    run = Run(scaling(), current=0)
    assert run.steps([load(0, 0)] * 100) == [0] * 100


def test_scale_down_one_engine_per_window_then_zero_after_the_idle_time() -> None:
    spec = scaling(scale_down_window_seconds=30, idle_before_zero_seconds=100)
    run = Run(spec, current=1)
    run.step(load(1, 16))  # up to 4 at once
    assert run.current == 4
    for _ in range(400):
        run.step(load(run.current, 0))
    steps = [(round(at - 1000), d.desired, d.reason) for at, d in run.decisions]
    assert steps == [
        (0, 4, SCALE_UP),
        (30, 3, SCALE_DOWN),
        (60, 2, SCALE_DOWN),
        (90, 1, SCALE_DOWN),
        # The idle time (100 s since the last demand at t=0) and a window since the last step.
        (120, 0, SCALE_TO_ZERO),
    ]
    assert "idle for 120 s" in run.decisions[-1][1].signal


def test_requests_that_come_and_go_between_readings_keep_the_last_engine() -> None:
    spec = scaling(idle_before_zero_seconds=20, scale_down_window_seconds=5)
    run = Run(spec, current=1)
    # A short request every 15 s, finished before the next reading sees it in flight: the
    # finished-request counter moves, and the idle clock starts again each time.
    for served in range(1, 8):
        run.steps([replace(load(1, 0), served=served)] * 15)
    assert run.current == 1 and not run.decisions
    # Then nothing: zero after the idle time, counted from the last reading that saw one.
    run.steps([replace(load(1, 0), served=7)] * 25)
    [(_, decision)] = run.decisions
    assert decision.reason == SCALE_TO_ZERO and "idle for 20 s" in decision.signal


def test_a_coordinator_restart_is_not_activity() -> None:
    run = Run(scaling(idle_before_zero_seconds=20, scale_down_window_seconds=5), current=1)
    run.steps([replace(load(1, 0), served=50)] * 10)
    # The counter starts again from zero: no request was served, the clock goes on.
    run.steps([replace(load(1, 0), served=0)] * 19)  # up to t = 28 s: idle since t = 0
    assert [d.reason for _, d in run.decisions] == [SCALE_TO_ZERO]


def test_min_replicas_one_never_goes_to_zero() -> None:
    run = Run(scaling(min_replicas=1, scale_down_window_seconds=5), current=3)
    assert run.steps([load(3, 0)] * 100)[-1] == 1


def test_flapping_load_does_not_flap_the_count() -> None:
    run = Run(scaling(scale_down_window_seconds=30), current=1)
    counts = run.steps([load(run.current, 16 if i % 2 else 0) for i in range(200)])
    # Up at the first burst, and no scale-down while bursts keep coming within the window.
    assert counts[1:] == [4] * 199
    assert [d.reason for _, d in run.decisions] == [SCALE_UP]


def test_an_up_window_needs_sustained_load() -> None:
    run = Run(scaling(scale_up_window_seconds=10), current=1)
    counts = run.steps([load(1, 16 if i % 3 else 1) for i in range(60)])
    assert set(counts) == {1}  # every 10 s window holds a quiet reading
    counts = run.steps([load(1, 16)] * 12)
    assert counts[-1] == 4 and counts[0] == 1


def test_min_equals_max_pins_the_count() -> None:
    run = Run(scaling(min_replicas=2, max_replicas=2), current=2)
    readings = [load(2, 0), load(2, 100), None, load(2, 0, kv=0.99)] * 50
    assert set(run.steps(readings)) == {2}


def test_a_count_outside_the_bounds_is_brought_in_even_without_metrics() -> None:
    run = Run(scaling(min_replicas=2, max_replicas=3), current=7)
    decision = run.step(None)
    assert (decision.desired, decision.reason) == (3, TO_BOUNDS)
    run = Run(scaling(min_replicas=2, max_replicas=3), current=0)
    assert run.step(load(0, 0)).desired == 2


def test_missing_metrics_hold_the_count() -> None:
    run = Run(scaling(), current=3)
    decisions = [run.step(None) for _ in range(500)]
    assert {d.desired for d in decisions} == {3}
    assert {d.reason for d in decisions} == {HOLD_NO_METRICS}


def test_kv_usage_missing_holds_but_a_held_request_still_scales_from_zero() -> None:
    run = Run(scaling(metric="KVCacheUsage", target=0.5), current=2)
    decision = run.step(load(2, 8, kv=None))
    assert (decision.desired, decision.reason) == (2, HOLD_NO_METRICS)
    assert "not reported" in decision.signal
    run = Run(scaling(metric="KVCacheUsage", target=0.5), current=0)
    assert run.step(load(0, 1, queued=1)).reason == SCALE_FROM_ZERO


def test_kv_usage_is_proportional_with_a_tolerance() -> None:
    run = Run(scaling(metric="KVCacheUsage", target=0.5), current=2)
    assert run.step(load(2, 8, kv=0.54)).desired == 2  # within 10 %
    assert run.step(load(2, 8, kv=0.9)).desired == 4  # ceil(2 * 1.8)


def test_an_engine_that_never_becomes_ready_adds_no_engines_without_end() -> None:
    # Asked for 3, only 1 ever registers: each metric asks from what serves, so the count
    # settles instead of climbing to max.
    for spec, reading in [
        (scaling(max_replicas=10), lambda: load(3, 10, ready=1)),
        (
            scaling(max_replicas=10, metric="KVCacheUsage", target=0.5),
            lambda: load(3, 9, kv=0.9, ready=1),
        ),
        (
            scaling(max_replicas=10, metric="TTFTP90", target=1.0),
            lambda: load(3, 9, ttft=1.5, ready=1),
        ),
    ]:
        run = Run(spec, current=3)
        counts = run.steps([reading() for _ in range(300)])
        assert max(counts) <= 3, (spec.metric, counts[-1])


def test_ttft_band() -> None:
    spec = scaling(metric="TTFTP90", target=1.0, min_replicas=1, scale_down_window_seconds=0)
    run = Run(spec, current=2)
    assert run.step(load(2, 8, ttft=3.0)).desired == 6 - 2  # ceil(2 * 3) capped at max 4
    run = Run(spec, current=2)
    assert run.step(load(2, 8, ttft=0.7)).reason == HOLD  # within the band
    assert run.step(load(2, 8, ttft=0.3)).desired == 1  # under half the objective
    run = Run(spec, current=2)
    assert run.step(load(2, 8, ttft=None)).reason == HOLD_NO_METRICS


def test_no_scale_down_before_a_whole_window_was_watched() -> None:
    run = Run(scaling(scale_down_window_seconds=30, min_replicas=1), current=3)
    counts = run.steps([load(3, 0)] * 29)
    assert set(counts) == {3}
    assert run.steps([load(3, 0)] * 2)[-1] == 2


# --------------------------------------------------------------------------- spec


def test_the_spec_parses_with_defaults() -> None:
    spec = parse_spec({**BASE, "autoscaling": {"minReplicas": 0, "maxReplicas": 3}}, name="d")
    assert spec.autoscaling == AutoscalingSpec(
        mode="Builtin",
        min_replicas=0,
        max_replicas=3,
        metric="QueuedRequestsPerEngine",
        target=0.0,
        scale_up_window_seconds=0,
        scale_down_window_seconds=120,
        idle_before_zero_seconds=300,
    )
    assert spec.autoscaling.builtin and spec.autoscaling.from_zero
    assert parse_spec(BASE, name="d").autoscaling is None
    external = parse_spec({**BASE, "autoscaling": {"mode": "External"}}, name="d").autoscaling
    assert external is not None and not external.builtin and external.from_zero


@pytest.mark.parametrize(
    ("autoscaling", "problem"),
    [
        ({}, "spec.autoscaling.maxReplicas: is required with mode Builtin"),
        ({"minReplicas": 3, "maxReplicas": 2}, "maxReplicas: must be >= minReplicas (2 < 3)"),
        ({"maxReplicas": 2, "minReplicas": -1}, "spec.autoscaling.minReplicas: must be >= 0"),
        ({"maxReplicas": 2, "metric": "GPU"}, "spec.autoscaling.metric: must be one of"),
        ({"maxReplicas": 2, "metric": "TTFTP90"}, "target: is required with metric TTFTP90"),
        ({"maxReplicas": 2, "metric": "KVCacheUsage", "target": 80}, "fraction in (0, 1]"),
        ({"maxReplicas": 2, "target": "high"}, "spec.autoscaling.target: must be a number"),
        ({"maxReplicas": 2, "scaleDownWindowSeconds": -5}, "scaleDownWindowSeconds: must be >="),
    ],
)
def test_invalid_autoscaling_is_named(autoscaling: dict[str, Any], problem: str) -> None:
    with pytest.raises(InvalidSpec) as raised:
        parse_spec({**BASE, "autoscaling": autoscaling}, name="demo")
    assert any(problem in item for item in raised.value.problems), raised.value.problems


# --------------------------------------------------------------------------- the load


def front_page(status: dict[str, Any] | None, ttfts: Iterable[float] = ()) -> str:
    metrics = FrontMetrics()
    record = RequestRecord(1, [1, 2], [3], "x", "stop", None, None, 0.1, 0)
    for ttft in ttfts:
        metrics.finished(COMPLETIONS_ENDPOINT, record, ttft, ttft)
    return metrics.render(status).decode()


STATUS = {
    "engines": 2,
    "draining": 1,
    "queued": 3,
    "inflight": 9,
    "engine_list": [
        {
            "rank": 0,
            "outstanding": 4,
            "capacity": 4,
            "stats": {"kv_blocks": 100, "kv_free_blocks": 25},
        },
        {"rank": 1, "outstanding": 2, "capacity": 8, "stats": {}},
    ],
    "limits": {"queued_requests": 100},
}


def test_the_load_is_read_from_the_fronts_own_metrics_page() -> None:
    signal = read_metrics(front_page(STATUS), now=0.0)
    assert (signal.engines, signal.draining, signal.queued, signal.inflight) == (2, 1, 3, 9)
    assert signal.serving_engines == 1 and signal.demand == 9
    assert signal.engine_loads == (EngineLoad(0, 4, 4, 0.75), EngineLoad(1, 2, 8, None))
    assert signal.mean_capacity() == 6 and signal.mean_kv_usage() == 0.75
    assert signal.served == 0
    assert read_metrics(front_page(STATUS, [0.1, 0.2, 0.3]), now=0.0).served == 3


def test_a_page_without_the_coordinator_is_no_reading() -> None:
    with pytest.raises(MalformedMetrics, match="did not answer"):
        read_metrics(front_page(None), now=0.0)
    with pytest.raises(MalformedMetrics):
        read_metrics("<html>502 Bad Gateway</html>", now=0.0)


def test_ttft_p90_over_the_window_only() -> None:
    window = TtftWindow(window=60.0)
    old = front_page(STATUS, [8.0] * 10)
    assert read_metrics(old, now=0.0, ttft=window).ttft_p90 is not None  # no history: all
    # 10 slow requests before, then 20 fast ones: the window's p90 sees only the fast ones.
    new = front_page(STATUS, [8.0] * 10 + [0.02] * 20)
    p90 = read_metrics(new, now=30.0, ttft=window).ttft_p90
    assert p90 is not None and 0.01 < p90 <= 0.025
    # Nothing new for longer than the window: no measurement.
    assert read_metrics(new, now=200.0, ttft=window).ttft_p90 is None


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    histogram = ((0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (float("inf"), 20.0))
    assert histogram_quantile(0.5, histogram) == pytest.approx(0.5)
    assert histogram_quantile(0.9, histogram) == pytest.approx(0.9)
    assert histogram_quantile(0.9, ((1.0, 0.0), (float("inf"), 5.0))) == 1.0
    assert histogram_quantile(0.9, ((1.0, 0.0),)) is None


@pytest.mark.parametrize(
    ("autoscaling", "holds"),
    [
        (None, False),
        ({"minReplicas": 1, "maxReplicas": 3}, False),
        ({"minReplicas": 0, "maxReplicas": 3}, True),
        ({"mode": "External"}, True),
    ],
)
def test_the_coordinator_is_ready_without_engines_only_when_they_may_reach_zero(
    autoscaling: dict[str, Any] | None, holds: bool
) -> None:
    raw = {**BASE, **({"autoscaling": autoscaling} if autoscaling else {})}
    command = coordinator_command(parse_spec(raw, name="demo"))
    assert ("--ready-without-engines" in command) == holds
    assert build_parser().parse_args(command[1:]).ready_without_engines == holds
