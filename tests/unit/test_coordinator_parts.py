"""Pure parts of the coordinator: the transition table, routing policies, the docs' table,
the config and its CLI flags, admission, the check of engines' heartbeat numbers."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from dpserve.cli import _coordinator_config, build_parser
from dpserve.coordinator.admission import Admission
from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.control import TRANSITIONS, ControlState, InvalidTransition, next_state
from dpserve.coordinator.engine_stats import MalformedEngineStats, check_engine_stats
from dpserve.coordinator.registry import Client, Engine, EngineRegistry
from dpserve.coordinator.routing import RoutingPolicy, choose_engine
from dpserve.limits import (
    DEFAULT_ADMISSION_LIMITS,
    DEFAULT_ENGINE_STATS_LIMITS,
    DEFAULT_REQUEST_LIMITS,
)
from dpserve.protocol import ErrorCode, Header, pack_tokens

DOCS = Path(__file__).parents[2] / "docs" / "protocol.md"


def test_transitions() -> None:
    assert next_state(ControlState.RUNNING, Header.PAUSE) is ControlState.PAUSED
    assert next_state(ControlState.SUSPENDED, Header.RESUME) is ControlState.PAUSED
    with pytest.raises(InvalidTransition, match="cannot PAUSE while engines are PAUSED"):
        next_state(ControlState.PAUSED, Header.PAUSE)
    with pytest.raises(InvalidTransition, match="allowed now: nothing"):
        next_state(ControlState.STOPPED, Header.UNPAUSE)


def test_docs_show_the_same_transition_table() -> None:
    rows = re.findall(r"^\| (\w+) \| (\w+) \| (\w+) \|$", DOCS.read_text(), flags=re.MULTILINE)
    documented = {
        (ControlState[state], Header[signal]): ControlState[target]
        for state, signal, target in rows
        if state in ControlState.__members__
    }
    assert documented == TRANSITIONS


def _registry(*loads: tuple[int, int]) -> EngineRegistry:
    registry = EngineRegistry()
    for rank, (outstanding, capacity) in enumerate(loads):
        engine = Engine(bytes([rank]), rank, capacity, "i", 0.0)
        engine.outstanding.update(range(outstanding))
        registry.add(engine)
    return registry


def test_round_robin_cycles_in_registration_order() -> None:
    registry = _registry((5, 1), (0, 1), (9, 1))
    picks = [choose_engine(registry, RoutingPolicy.ROUND_ROBIN) for _ in range(6)]
    assert picks == [b"\x00", b"\x01", b"\x02"] * 2


def test_least_outstanding_weighs_capacity_and_skips_draining() -> None:
    registry = _registry((4, 8), (1, 1), (3, 4))
    assert choose_engine(registry, RoutingPolicy.LEAST_OUTSTANDING) == b"\x00"  # 0.5 < 0.75 < 1
    registry.start_draining(registry.engines[b"\x00"])
    assert choose_engine(registry, RoutingPolicy.LEAST_OUTSTANDING) == b"\x02"
    assert choose_engine(EngineRegistry(), RoutingPolicy.LEAST_OUTSTANDING) is None


def test_config_defaults_are_the_limits_and_the_cli_flags_are_the_config() -> None:
    config = CoordinatorConfig()
    assert config.max_message_bytes == DEFAULT_REQUEST_LIMITS.max_message_bytes
    assert config.max_prompt_tokens == DEFAULT_REQUEST_LIMITS.max_prompt_tokens
    assert config.max_prompt_chars == DEFAULT_REQUEST_LIMITS.max_prompt_chars
    for name in (
        "max_inflight_per_client",
        "max_inflight_requests",
        "max_queued_requests",
        "queue_timeout",
        "max_dispatch_attempts",
    ):
        assert getattr(config, name) == getattr(DEFAULT_ADMISSION_LIMITS, name), name
    args = build_parser().parse_args(["coordinator"])
    assert _coordinator_config(args) == config, "the CLI's defaults are the config's"
    args = build_parser().parse_args(["coordinator", "--max-dispatch-attempts", "2"])
    assert _coordinator_config(args).max_dispatch_attempts == 2


def test_admission_names_the_limit_it_refuses_with() -> None:
    admission = Admission(replace(CoordinatorConfig(), max_inflight_per_client=2))
    busy, idle = Client(b"a", inflight=2), Client(b"b")
    assert admission.refusal(idle, 0, ControlState.RUNNING, "hi") is None
    code, message = admission.refusal(busy, 2, ControlState.RUNNING, "hi")
    assert code == ErrorCode.OVERLOADED and "--max-inflight-per-client 2" in message
    code, _ = admission.refusal(idle, 0, ControlState.STOPPED, "hi")
    assert code == ErrorCode.STOPPED
    too_long = "x" * (DEFAULT_REQUEST_LIMITS.max_prompt_chars + 1)
    code, message = admission.refusal(idle, 0, ControlState.RUNNING, too_long)
    assert code == ErrorCode.PROMPT_TOO_LONG and "--max-prompt-chars" in message
    tokens = pack_tokens([1] * (DEFAULT_REQUEST_LIMITS.max_prompt_tokens + 1))
    code, message = admission.prompt_tokens_refusal(tokens)
    assert code == ErrorCode.PROMPT_TOO_LONG and "--max-prompt-tokens" in message
    assert admission.prompt_tokens_refusal(pack_tokens([1])) is None
    assert admission.prompt_tokens_refusal(b"")[0] == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    ("stats", "complaint"),
    [
        ([("kv_blocks", 1)], "must be a map"),
        ({"kv_blocks": "12"}, "finite number"),
        ({"kv_blocks": False}, "finite number"),
        ({"kv_blocks": float("-inf")}, "finite number"),
        ({"kv_blocks": None}, "finite number"),
        ({"kv blocks": 1}, "snake_case"),
        ({b"kv_blocks": 1}, "snake_case"),
        ({"k" * (DEFAULT_ENGINE_STATS_LIMITS.max_name_chars + 1): 1}, "snake_case"),
        ({f"s{i}": 0 for i in range(DEFAULT_ENGINE_STATS_LIMITS.max_entries + 1)}, "entries"),
    ],
)
def test_engine_stats_are_refused_unless_a_small_map_of_finite_numbers(
    stats: object, complaint: str
) -> None:
    with pytest.raises(MalformedEngineStats, match=complaint):
        check_engine_stats(stats)


def test_engine_stats_within_the_limits_are_kept_as_sent() -> None:
    most = {f"s{i}": i * 0.5 for i in range(DEFAULT_ENGINE_STATS_LIMITS.max_entries)}
    assert check_engine_stats(most) == most
    assert check_engine_stats({"kv_blocks": 2**63, "preemptions": 0}) == {
        "kv_blocks": 2**63,
        "preemptions": 0,
    }


def test_status_reports_each_limit_under_its_name_in_dpserve_limits() -> None:
    reported = CoordinatorConfig().status_limits()
    assert "max_message_bytes" in reported and "max_prompt_tokens" in reported
    for name, value in reported.items():
        owner = next(
            (o for o in (DEFAULT_REQUEST_LIMITS, DEFAULT_ADMISSION_LIMITS) if hasattr(o, name)),
            None,
        )
        assert owner is not None, f"{name} is not a name of dpserve.limits"
        assert value == getattr(owner, name), name
