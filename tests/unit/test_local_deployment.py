"""``dpserve serve`` starts one engine per NUMA node by default, each pinned to its node's
cores; any other engine count is not pinned."""

from __future__ import annotations

import pytest

from dpserve import local
from dpserve.cli import build_parser
from dpserve.local import LocalDeployment

NODES = [frozenset({0, 1}), frozenset({2, 3})]


def deployment(engines: int) -> LocalDeployment:
    return LocalDeployment(model_path="m", data_parallel_size=engines, port=5555, http_port=None)


def test_one_engine_per_node_is_pinned_to_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "numa_core_sets", lambda: NODES)
    assert deployment(2).engine_cores() == NODES
    assert deployment(3).engine_cores() == [None, None, None]
    assert deployment(1).engine_cores() == [None]


def test_one_node_means_no_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "numa_core_sets", lambda: [frozenset({0, 1})])
    assert deployment(1).engine_cores() == [None]


def test_serve_refuses_a_data_parallel_size_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--fake", "--data-parallel-size", "0"])
    assert args.func(args) == 2
    assert "--data-parallel-size must be at least 1" in capsys.readouterr().err
