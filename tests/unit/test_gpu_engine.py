"""The engine on a CUDA device: what CI (CPU only) cannot check.

Every test here skips, saying why, when no CUDA device is present. On a GPU machine:
``.venv/bin/python -m pytest tests/unit/test_gpu_engine.py -v``.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from dpserve.engine.layers.attention import (
    decode_attention_backend,
    paged_decode_attention,
    paged_decode_attention_reference,
    prefill_attention,
)
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI is CPU only)"
)
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or importlib.util.find_spec("dpserve.engine.kernels.triton_decode") is None,
    reason="needs Triton and dpserve.engine.kernels.triton_decode",
)


def drive(
    runner: ModelRunner, requests: list[RunnerRequest], *, staggered: bool = False
) -> dict[int, tuple[list[int], list[float]]]:
    """Every request added at once, or (``staggered``) eight at once and then one a step, so
    that prompts arrive while others decode."""
    waiting = list(requests)
    for request in waiting[: 8 if staggered else len(waiting)]:
        runner.add(request)
    del waiting[: 8 if staggered else len(waiting)]
    out: dict[int, tuple[list[int], list[float]]] = {r.request_id: ([], []) for r in requests}
    while runner.has_work() or waiting:
        if waiting:
            runner.add(waiting.pop(0))
        for update in runner.step():
            out[update.request_id][0].extend(update.tokens)
            out[update.request_id][1].extend(update.logprobs or [])
    return out


def workload(count: int, rng_seed: int, **params: Any) -> list[RunnerRequest]:
    rng = random.Random(rng_seed)
    return [
        RunnerRequest(
            i,
            [rng.randrange(5, 380) for _ in range(rng.randint(1, 90))],
            SamplingParams(
                **{"temperature": 0.0, "num_tokens_to_generate": rng.randint(1, 60), **params}
            ),
        )
        for i in range(count)
    ]


def test_greedy_equals_generate_on_cuda_fp32(tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = model.to("cuda").eval()
    runner = ModelRunner(str(tiny_model_path), device="cuda", dtype="float32", block_size=4)
    runner.eos_token_ids = frozenset()
    requests = workload(24, rng_seed=1)
    outcomes = drive(runner, requests)
    for request in requests:
        prompt = torch.tensor([request.prompt_tokens], device="cuda")
        with torch.inference_mode():
            expected = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                eos_token_id=None,
                max_new_tokens=request.params.num_tokens_to_generate,
            )[0, prompt.shape[1] :].tolist()
        assert outcomes[request.request_id][0] == expected, f"request {request.request_id}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_on_cuda_equals_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, block_size, num_blocks = 37, 32, 8, 64, 16, 400
    lengths = [1, 15, 16, 17, 255, 256, 257, 1000] + [random.randint(1, 1200) for _ in range(29)]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.randint(1, num_blocks, (batch, width), dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
    out = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, dim**-0.5)
    expected = paged_decode_attention_reference(
        query, k_cache, v_cache, tables, seq_lens, dim**-0.5
    )
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


def test_prefill_attention_on_cuda_uses_flash_or_efficient_and_is_right() -> None:
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        query = torch.randn(40, 8, 64, device="cuda", dtype=dtype)
        keys = torch.randn(100, 2, 64, device="cuda", dtype=dtype)
        values = torch.randn_like(keys)
        out = prefill_attention(query, keys, values, 0.125)  # fails if only cuDNN/math could
        expected = prefill_attention(
            query.cpu().float(), keys.cpu().float(), values.cpu().float(), 0.125
        )
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.cpu().float(), expected, rtol=tolerance, atol=tolerance)


@needs_triton
def test_cuda_graph_replay_equals_eager(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps through their graphs and steps with prompt chunks through the piecewise
    graphs (prompts of 1-90 tokens arrive while others decode) give eager decoding's tokens."""
    assert decode_attention_backend(torch.device("cuda")) == "triton"
    results = []
    for graphs in (True, False):
        runner = ModelRunner(
            str(tiny_model_path), device="cuda", dtype="float32", cuda_graphs=graphs
        )
        assert bool(runner.stats()["cuda_graphs"]) == graphs
        assert bool(runner.stats()["piecewise_graphs"]) == graphs
        piecewise_steps: list[int] = []
        if graphs:
            pieces = runner.backend.piecewise  # type: ignore[attr-defined]
            monkeypatch.setattr(pieces, "run", _counting(pieces.run, piecewise_steps))
        runner.eos_token_ids = frozenset()
        requests = workload(40, rng_seed=2, return_log_probs=True)
        requests += workload(5, rng_seed=3, temperature=0.9, seed=11)  # ids 0-4 again: renumber
        for offset, request in enumerate(requests[40:]):
            request.request_id = 100 + offset
        results.append(drive(runner, requests, staggered=True))
        assert bool(piecewise_steps) == graphs
    graphed, eager = results
    assert graphed.keys() == eager.keys()
    for request_id in graphed:
        assert graphed[request_id][0] == eager[request_id][0], f"request {request_id}"
        assert graphed[request_id][1] == pytest.approx(eager[request_id][1], abs=1e-5)


@needs_triton
def test_piecewise_graphs_pass_their_check_in_bfloat16(tiny_model_path: Path) -> None:
    """They are dropped (steps with prompts run eagerly) when their check step disagrees with
    the eager forward: in bfloat16 it must still agree."""
    runner = ModelRunner(str(tiny_model_path), device="cuda", dtype="bfloat16")
    assert runner.stats()["piecewise_graphs"]
    outcomes = drive(runner, workload(8, rng_seed=6))
    assert all(tokens for tokens, _ in outcomes.values())


def test_pool_is_sized_from_free_gpu_memory(tiny_model_path: Path) -> None:
    small = ModelRunner(str(tiny_model_path), device="cuda", gpu_memory_utilization=0.2)
    stats = small.stats()
    total = torch.cuda.mem_get_info()[1]
    assert 0 < stats["kv_bytes"] <= 0.2 * total
    # Plenty of memory for a tiny model: the pool stops at what 256 full contexts can use.
    assert stats["kv_tokens"] == 256 * small.context_size
    assert stats["max_num_seqs"] == 256
    outcomes = drive(small, workload(8, rng_seed=4))  # bf16 by default on CUDA
    assert all(tokens for tokens, _ in outcomes.values())


def _counting(method: Any, calls: list[int]) -> Any:
    def counted(*args: Any) -> Any:
        calls.append(1)
        return method(*args)

    return counted


@needs_triton
def test_bare_greedy_steps_take_their_tokens_from_the_graph(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = []
    for graphs in (True, False):
        runner = ModelRunner(
            str(tiny_model_path), device="cuda", dtype="float32", cuda_graphs=graphs
        )
        assert runner.stats()["greedy_argmax"] == "triton"
        runner.eos_token_ids = frozenset()
        replays: list[int] = []
        if graphs:
            decode_graphs = runner.backend.graphs  # type: ignore[attr-defined]
            monkeypatch.setattr(
                decode_graphs, "run_greedy", _counting(decode_graphs.run_greedy, replays)
            )
        results.append(drive(runner, workload(40, rng_seed=4)))  # greedy, nothing else read
        assert bool(replays) == graphs
    graphed, eager = results
    assert graphed == eager
