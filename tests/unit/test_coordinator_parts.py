"""Pure parts of the coordinator: the transition table, routing policies, the docs' table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpserve.coordinator.control import TRANSITIONS, ControlState, InvalidTransition, next_state
from dpserve.coordinator.registry import Engine, EngineRegistry
from dpserve.coordinator.routing import RoutingPolicy, choose_engine
from dpserve.protocol import Header

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
