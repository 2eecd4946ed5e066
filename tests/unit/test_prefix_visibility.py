"""Prefix caching seen from outside: OpenAI usage's cached tokens and the /metrics lines of the
engines' cache counters and the coordinator's routing decisions."""

from __future__ import annotations

from dpserve.client import RequestRecord
from dpserve.openai.metrics import FrontMetrics
from dpserve.openai.responses import record_usage


def record(cached: int | None) -> RequestRecord:
    return RequestRecord(1, [5] * 40, [6] * 3, "abc", "length", None, 0.1, 0.2, 0, cached)


def test_usage_reports_cached_prompt_tokens_as_openai_does() -> None:
    assert record_usage(record(32)) == {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert "prompt_tokens_details" not in record_usage(record(None))  # not reported
    assert record_usage(record(60))["prompt_tokens_details"] == {"cached_tokens": 40}


def test_metrics_export_cache_counters_and_routing_decisions() -> None:
    status = {
        "engines": 1,
        "engine_list": [
            {
                "rank": 0,
                "outstanding": 0,
                "capacity": 4,
                "stats": {
                    "prefix_cache_queries": 100,
                    "prefix_cache_hits": 64,
                    "kv_cache_usage": 0.5,
                },
            }
        ],
        "prefix_routing": {
            "decisions": {"prefix": 3, "load": 1},
            "predicted_cached_tokens": 64,
            "actual_cached_tokens": 64,
            "prediction_error_tokens": 0,
            "indexed_blocks": 4,
            "pace_by_rank": {"0": {"wait_price_tokens": 312.5, "seconds_per_request": 0.7}},
        },
    }
    text = FrontMetrics().render(status).decode()
    assert 'dpserve_engine_prefix_cache_queries_total{rank="0"} 100.0' in text
    assert 'dpserve_engine_prefix_cache_hits_total{rank="0"} 64.0' in text
    assert 'dpserve_engine_kv_cache_usage_perc{rank="0"} 0.5' in text
    assert 'dpserve_routing_decisions_total{reason="prefix"} 3.0' in text
    assert "dpserve_routing_actual_cached_tokens_total 64.0" in text
    assert "dpserve_routing_indexed_blocks 4.0" in text
    assert 'dpserve_routing_wait_price_tokens{rank="0"} 312.5' in text
