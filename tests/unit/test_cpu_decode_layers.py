"""A decode step's layers in one C++ call (``layers.cpu_decode_layers``): the same tokens and
the same log-probs, to the bit, as the Python layers, on every model shape and weight format it
takes; the steps it must not take go to the Python layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dpserve import cpu_settings
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers.cpu_decode_layers import DecodeLayers

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="the CPU kernels did not build here (no C++ compiler, or DPSERVE_CPU_KERNELS=0)",
)


def _runner(path: Path, cpu_weights: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    from dpserve.engine.model_runner import ModelRunner

    monkeypatch.setenv(cpu_settings.FUSED_DECODE_ENV, "1" if fused else "0")
    monkeypatch.setenv(cpu_settings.SMALL_BATCH_ROWS_ENV, str(cpu_settings.DECODE_MATMUL_MAX_ROWS))
    return ModelRunner(str(path), device="cpu", max_num_seqs=8, cpu_weights=cpu_weights)


def _counting_fused_steps(runner: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every step the fused call ran (it still runs: this only counts)."""
    fused = runner.backend.model.decode_layers
    assert fused is not None
    seen: list[int] = []
    call = DecodeLayers.__call__

    def counted(self: DecodeLayers, hidden: torch.Tensor, *rest: Any) -> torch.Tensor:
        seen.append(int(hidden.shape[0]))
        return call(self, hidden, *rest)

    monkeypatch.setattr(DecodeLayers, "__call__", counted)
    return seen


@pytest.mark.parametrize(
    ("kind", "cpu_weights"),
    [
        ("llama", "fp32"),
        ("llama", "bf16"),
        ("llama", "int8"),
        ("qwen3", "fp32"),  # the head norms
        ("qwen2", "fp32"),  # biases on q/k/v
        ("llama3-rope-tied-biases", "int8"),  # biases in the MLP, the gate and up stacked
    ],
)
def test_decode_steps_in_one_call_give_what_the_python_layers_give(
    kind: str,
    cpu_weights: str,
    tiny_model_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six greedy requests of 4 to 29 tokens: steps of 6 down to 1 decoding sequence, all in
    the fused call, every token and log-prob equal to those of the Python layers."""
    from tests.runner_runs import greedy_requests
    from tests.tiny_model import build_variant_model

    path = tiny_model_path
    if kind != "llama":
        path = tmp_path / kind
        build_variant_model(kind, tiny_model_path, path)
    python_layers = _runner(path, cpu_weights, False, monkeypatch)
    assert python_layers.backend.model.decode_layers is None
    expected = greedy_requests(python_layers)

    runner = _runner(path, cpu_weights, True, monkeypatch)
    steps = _counting_fused_steps(runner, monkeypatch)
    got = greedy_requests(runner)
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6]
    assert got.keys() == expected.keys()
    for request, (tokens, logprobs) in got.items():
        assert tokens == expected[request][0]
        assert logprobs == expected[request][1]  # to the bit


def test_prompt_chunks_and_larger_steps_run_the_python_layers(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a prompt chunk, and a decode step of more rows than the decode kernel
    takes (oneDNN's then), do not enter the fused call."""
    from tests.runner_runs import greedy_requests

    monkeypatch.setenv(cpu_settings.FUSED_DECODE_ENV, "1")
    monkeypatch.setenv(cpu_settings.SMALL_BATCH_ROWS_ENV, "2")
    from dpserve.engine.model_runner import ModelRunner

    runner = ModelRunner(str(tiny_model_path), device="cpu", max_num_seqs=8)
    fused = runner.backend.model.decode_layers
    assert fused is not None and fused.max_rows == 2
    steps = _counting_fused_steps(runner, monkeypatch)
    greedy_requests(runner, 4)
    assert steps and set(steps) <= {1, 2}
    assert fused.runs(2, 2, False)
    assert not fused.runs(3, 3, False)
    assert not fused.runs(2, 1, False)  # a prompt chunk beside a decode row
    assert not fused.runs(1, 1, True)  # a LoRA row


def test_a_mixture_of_experts_keeps_the_python_layers(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpserve.engine.model_runner import ModelRunner
    from tests.tiny_model import build_variant_model

    build_variant_model("qwen3-moe", tiny_model_path, tmp_path / "moe")
    monkeypatch.setenv(cpu_settings.FUSED_DECODE_ENV, "1")
    runner = ModelRunner(str(tmp_path / "moe"), device="cpu", max_num_seqs=4)
    assert runner.backend.model.decode_layers is None


def test_the_switch_is_a_checked_setting() -> None:
    assert cpu_settings.value_error(cpu_settings.FUSED_DECODE_ENV, "0") is None
    why = cpu_settings.value_error(cpu_settings.FUSED_DECODE_ENV, "yes")
    assert why is not None and cpu_settings.FUSED_DECODE_ENV in why
