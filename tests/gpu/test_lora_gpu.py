"""GPU checks of the LoRA shrink/expand kernels (``triton_lora``) compiled, on Llama-8B shapes,
against ``lora.delta``'s torch path on the same device, and of the engine's LoRA output with
and without them (skipped, with the reason, without CUDA). CI runs the kernels in Triton's
interpreter (tests/unit/test_triton_lora.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from dpserve.engine.kernels import triton_lora
from dpserve.engine.lora import delta
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams
from tests.lora_adapters import make_adapter
from tests.unit.test_triton_lora import adapter, by_rows, stacked_step

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device: the compiled Triton kernels"
    ),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]

# Llama-3-8B: q/k/v fused 4096 -> 4096 + 2 * 1024, gate/up fused 4096 -> 2 * 14336, down back.
SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down_proj": (4096, 14336)}
RANKS = (8, 16, 32, 64)  # 120 together: the stacked form (STACK_MAX_RANK 128)
# Relative to values of about one: fp32 to rounding (IEEE dots), bf16 one or two units.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("module", list(SHAPES))
def test_the_kernels_equal_the_torch_path_on_cuda(
    dtype: torch.dtype, rows: int, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_features, in_features = SHAPES[module]
    shapes = {module: SHAPES[module]}
    adapters = [adapter(seed, rank, shapes, dtype, "cuda") for seed, rank in enumerate(RANKS)]
    generator = torch.Generator().manual_seed(rows)
    row_slots = [int(s) for s in torch.randint(-1, len(RANKS), (rows,), generator=generator)]
    x = torch.randn(rows + 2, in_features, generator=generator).to(dtype).cuda()
    base = torch.randn(rows + 2, out_features, generator=generator).to(dtype).cuda()

    step = stacked_step(adapters, row_slots, "cuda")
    assert delta._kernels_on(x.device)
    by_kernels = base.clone()
    step.add(0, module, x, by_kernels)
    monkeypatch.setattr(delta, "_kernels_on", lambda device: False)
    by_torch = base.clone()
    step.add(0, module, x, by_torch)

    untouched = [row for row, slot in enumerate(row_slots) if slot < 0] + [rows, rows + 1]
    assert torch.equal(by_kernels[untouched], base[untouched])
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(by_kernels, by_torch, rtol=tolerance, atol=tolerance)
    if dtype == torch.float32:
        expected = base.double().cpu()
        # The same weights (the same seeds) on CPU.
        cpu_adapters = [adapter(seed, rank, shapes, dtype) for seed, rank in enumerate(RANKS)]
        expected[:rows] += by_rows(cpu_adapters, row_slots, module, x[:rows].cpu())
        torch.testing.assert_close(by_kernels.double().cpu(), expected, rtol=1e-4, atol=1e-4)


def _run(runner: ModelRunner, jobs: list[tuple[list[int], str | None]]) -> list[Any]:
    for index, (prompt, name) in enumerate(jobs):
        params = SamplingParams(
            temperature=0,
            num_tokens_to_generate=12,
            ignore_eos=True,
            lora_name=name,
            return_log_probs=True,
        )
        runner.add(RunnerRequest(index, prompt, params))
    out: dict[int, tuple[list[int], list[float]]] = {i: ([], []) for i in range(len(jobs))}
    while runner.has_work():
        for update in runner.step():
            assert update.error is None, update.error
            out[update.request_id][0].extend(update.tokens)
            out[update.request_id][1].extend(update.logprobs or [])
    return [out[i] for i in range(len(jobs))]


def test_the_engine_gives_the_same_lora_output_with_and_without_the_kernels(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapters = {
        "a": make_adapter(tiny_model_path, tmp_path / "a", seed=1),
        "b": make_adapter(tiny_model_path, tmp_path / "b", seed=2, rank=4, alpha=8),
        "c": make_adapter(
            tiny_model_path, tmp_path / "c", seed=3, rank=16, modules=("q_proj", "down_proj")
        ),
    }
    runner = ModelRunner(
        str(tiny_model_path),
        device="cuda",
        dtype="float32",
        lora_modules={name: str(path) for name, path in adapters.items()},
    )
    prompts = [[1, 40, 41, 42, 43], [1, 50, 60, 70], [1, 99, 98, 97, 96, 95, 94]]
    jobs = [(p, name) for p in prompts for name in (None, "a", "b", "c")]

    calls: list[int] = []
    add_delta = triton_lora.add_delta

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        add_delta(*args, **kwargs)

    monkeypatch.setattr(triton_lora, "add_delta", counted)
    with_kernels = _run(runner, jobs)
    assert calls  # the mixed steps ran the kernels
    monkeypatch.setattr(delta, "_kernels_on", lambda device: False)
    calls.clear()
    with_torch = _run(runner, jobs)
    assert not calls
    for job, (tokens, logprobs), (torch_tokens, torch_logprobs) in zip(
        jobs, with_kernels, with_torch, strict=True
    ):
        assert tokens == torch_tokens, job
        assert max(abs(x - y) for x, y in zip(logprobs, torch_logprobs, strict=True)) < 1e-4
