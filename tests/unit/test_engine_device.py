"""``dpserve engine`` picks one GPU per engine: rank r uses GPU r of those it can see."""

from __future__ import annotations

import pytest
import torch

from dpserve.cli import engine_device


def test_cpu_and_machines_without_cuda_keep_the_requested_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device("cpu", 3) == "cpu"
    assert engine_device("auto", 3) == "auto"
    assert engine_device("cuda", 0) == "cuda"  # fails later, with torch's own message


@pytest.mark.parametrize(("rank", "gpus", "expected"), [(0, 4, 0), (3, 4, 3), (5, 4, 1), (7, 1, 0)])
def test_rank_r_gets_gpu_r(
    monkeypatch: pytest.MonkeyPatch, rank: int, gpus: int, expected: int
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for requested in ("auto", "cuda"):
        assert engine_device(requested, rank) == f"cuda:{expected}"
    assert engine_device("cpu", rank) == "cpu"
