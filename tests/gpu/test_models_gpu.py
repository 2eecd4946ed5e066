"""Every model family of the paged engine on a CUDA device, and the fused MoE kernel compiled
on real MoE shapes (skipped, with the reason, without CUDA).

CI checks the same code on CPU, with the CUDA path's Triton kernels in Triton's interpreter
(tests/unit/test_triton_layer_kernels.py, tests/unit/test_triton_moe.py); here the kernels
are compiled, and decode steps and prompt steps replay their CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from dpserve.engine.layers.kernel_choice import KernelChoice
from dpserve.engine.layers.moe import SparseMoE
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams
from tests.tiny_model import VARIANT_KINDS, build_variant_model
from tests.unit.test_triton_moe import moe_block

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device: the compiled Triton kernels and CUDA graphs",
    ),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]

# The class of models/ that each family's model_type is registered to (models.registry).
MODEL_CLASS = {"qwen3": "PagedQwen3", "qwen3-moe": "PagedQwen3Moe", "mixtral": "PagedMixtral"}
KINDS = ["llama", *VARIANT_KINDS]


def _model_path(kind: str, tiny_model_path: Path, directory: Path) -> Path:
    if kind == "llama":
        return tiny_model_path
    build_variant_model(kind, tiny_model_path, directory)
    return directory


def _small_runner(path: Path, dtype: str) -> ModelRunner:
    # Few rows and 64-token steps: few graphs to capture, and prompts that take several steps.
    runner = ModelRunner(
        str(path),
        device="cuda",
        dtype=dtype,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    runner.eos_token_ids = frozenset()  # every request runs all its tokens
    return runner


def _drive(
    runner: ModelRunner, schedule: dict[int, list[RunnerRequest]]
) -> dict[int, tuple[list[int], list[float]]]:
    """Add each request at its step; step until all finished. Per request: tokens, log-probs."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    step = 0
    while step <= max(schedule) or runner.has_work():
        for request in schedule.get(step, []):
            out[request.request_id] = ([], [])
            runner.add(request)
        for update in runner.step():
            out[update.request_id][0].extend(update.tokens)
            out[update.request_id][1].extend(update.logprobs or [])
        step += 1
    return out


def _schedule(output_tokens: int) -> tuple[list[list[int]], dict[int, list[RunnerRequest]]]:
    """Six greedy requests sharing a 24-token prefix: four at once, two more while those
    decode (prompt chunks beside decoding rows: the piecewise graphs), hitting the prefix
    cache."""
    rng = random.Random(11)
    shared = [rng.randrange(5, 380) for _ in range(24)]
    tails = [[rng.randrange(5, 380) for _ in range(rng.randint(3, 70))] for _ in range(6)]
    prompts = [shared + tail for tail in tails]
    params = SamplingParams(
        temperature=0.0, num_tokens_to_generate=output_tokens, return_log_probs=True
    )
    requests = [RunnerRequest(i, prompt, params) for i, prompt in enumerate(prompts)]
    return prompts, {0: requests[:4], 5: requests[4:]}


@pytest.mark.parametrize("kind", KINDS)
def test_each_family_runs_the_cuda_path_and_equals_generate_in_fp32(
    kind: str, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    path = _model_path(kind, tiny_model_path, tmp_path)
    runner = _small_runner(path, "float32")
    stats = runner.stats()
    assert stats["backend"] == "paged"
    assert stats["model_class"] == MODEL_CLASS.get(kind, "PagedLlama")
    paged: Any = runner.backend
    assert paged.model.glue == "triton"  # Triton layer kernels, and the fused MoE for experts
    assert stats["cuda_graphs"] and stats["piecewise_graphs"]  # both passed their start check
    piecewise_steps: list[object] = []
    monkeypatch.setattr(
        paged.piecewise,
        "run",
        lambda batch, run=paged.piecewise.run: piecewise_steps.append(batch) or run(batch),
    )
    prompts, schedule = _schedule(output_tokens=24)
    outcomes = _drive(runner, schedule)
    assert runner.stats()["prefix_cache_hits"] > 0
    assert piecewise_steps  # prompt chunks beside decoding rows went through the graphs
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    for request_id, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            logits = reference(
                torch.tensor([prompt + outcomes[request_id][0]], device="cuda")
            ).logits[0, len(prompt) - 1 : -1]
            expected = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                eos_token_id=None,
                max_new_tokens=24,
            )[0, len(prompt) :].tolist()
        assert outcomes[request_id][0] == expected, f"request {request_id}"
        chosen = torch.log_softmax(logits.float(), -1).gather(
            1, torch.tensor(expected, device="cuda")[:, None]
        )
        assert outcomes[request_id][1] == pytest.approx(chosen[:, 0].tolist(), abs=1e-4)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe", "mixtral"])
def test_each_new_family_passes_its_graph_checks_in_bfloat16(
    kind: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """The graphs are dropped at start when their check step disagrees with the eager forward
    (then prompt steps run eagerly): in bfloat16 they must still agree, and serve."""
    runner = _small_runner(_model_path(kind, tiny_model_path, tmp_path), "bfloat16")
    assert runner.stats()["cuda_graphs"] and runner.stats()["piecewise_graphs"]
    _, schedule = _schedule(output_tokens=8)
    outcomes = _drive(runner, schedule)
    assert all(len(tokens) == 8 for tokens, _ in outcomes.values())


# -------------------------------------------------------------- the fused MoE kernel, compiled

# (hidden, expert inner width, experts, experts per token): Qwen3-30B-A3B's, Mixtral-8x7B's.
MOE_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}


def _moe_block(shape: str, dtype: torch.dtype) -> Any:
    hidden, inner, experts, top_k = MOE_SHAPES[shape]
    kind = "mixtral" if shape.startswith("mixtral") else "qwen3-moe-renormalised"
    # Outputs of order 1 at every width: each weight's std 1/sqrt(its input width).
    block = moe_block(kind, hidden, inner, experts, top_k, device="cuda", std=None)
    return block.to(dtype)


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("tokens", [1, 7, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_fused_moe_equals_the_expert_loop_on_real_shapes(
    shape: str, tokens: int, dtype: torch.dtype
) -> None:
    block = _moe_block(shape, dtype)
    _, _, _, top_k = MOE_SHAPES[shape]
    loop = SparseMoE(block, top_k, True, KernelChoice(glue="torch", decode_attention="torch"))
    fused = SparseMoE(block, top_k, True, KernelChoice(glue="triton", decode_attention="torch"))
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    normed = torch.randn(tokens, block.gate.weight.shape[1], device="cuda", generator=generator)
    residual = torch.randn(normed.shape, device="cuda", generator=generator)
    normed, residual = normed.to(dtype), residual.to(dtype)
    expected_float = fused_float = None
    with torch.inference_mode():
        expected = loop.plus(normed, residual)
        got = fused.plus(normed, residual)
        if dtype == torch.float32:
            expected_float, fused_float = expected, got
        else:  # against the loop in fp32 over the same (bf16) weights and inputs
            reference = SparseMoE(
                block.float(), top_k, True, KernelChoice(glue="torch", decode_attention="torch")
            )
            expected_float = reference.plus(normed.float(), residual.float())
            fused_float = got.float()
    assert torch.isfinite(got).all()
    error = float((fused_float - expected_float).norm() / expected_float.norm())
    if dtype == torch.float32:  # IEEE dots: sums in another order only
        assert error < 1e-5, error
    else:  # bf16 rounding, as torch's own loop in bf16 has it (~1.4 % here: the output's)
        loop_error = float((expected.float() - expected_float).norm() / expected_float.norm())
        assert error < 5e-2 and error < 1.5 * loop_error + 1e-3, (error, loop_error)
