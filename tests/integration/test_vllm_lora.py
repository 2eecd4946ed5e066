"""LoRA adapters on ``dpserve engine --backend vllm`` (real vLLM, its CPU build): the same flags,
client calls and routing as dpserve's own engine drive vLLM's LoRA support. Each adapter's
greedy output equals transformers + peft with the adapter merged; a batch mixing adapters and
the base model gives each row its alone output; the engine reports its adapters to the
coordinator; a repeated prompt through an adapter is found in vLLM's prefix cache as the
coordinator predicted (the adapter's name in dpserve's block hashes too); adapters load and
unload at run time, and an unknown one is refused naming it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpserve.client import InferenceClient, RequestFailed
from dpserve.sampling import SamplingParams
from tests.integration.runtime import Processes, free_port, wait_for_engines
from tests.integration.vllm_support import build_vllm_llama, spawn_vllm_engine
from tests.lora_adapters import make_adapter, merged_model, reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROMPT = [5, 40, 77, 120, 9, 200, 31, 64]
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_llama(tmp_path_factory.mktemp("vllm-lora-llama"))


@pytest.fixture(scope="module")
def adapters(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-lora-adapters")
    return {
        name: make_adapter(llama, root / name, seed=seed, rank=8)
        for seed, name in enumerate(("sql", "poems", "late"))
    }


@pytest.fixture(scope="module")
def expected(llama: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """Each adapter's (and the base model's) greedy tokens: transformers + peft, merged."""
    return {
        name: reference_greedy(merged_model(llama, path), PROMPT, NEW_TOKENS)
        for name, path in [(None, None), *adapters.items()]
    }


@pytest.fixture(scope="module")
def coordinator_port(
    llama: Path,
    adapters: dict[str, Path],
    vllm_python: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[int]:
    """A coordinator and one vLLM engine serving two adapters from the start (dpserve's
    flags: --lora-modules, --max-loras)."""
    processes = Processes(tmp_path_factory.mktemp("vllm-lora"))
    port = free_port()
    modules = [f"{name}={adapters[name]}" for name in ("sql", "poems")]
    try:
        processes.coordinator(port, "--insecure", "--tokenizer", str(llama))
        spawn_vllm_engine(
            processes, vllm_python, port, 0, llama, "--max-loras", "2", "--lora-modules", *modules
        )
        yield port
    finally:
        processes.cleanup()


@pytest.fixture
async def client(coordinator_port: int) -> InferenceClient:
    client = InferenceClient(coordinator_port, handshake_timeout=20)
    await client.start()
    await wait_for_engines(client, 1, within=240)
    return client


def adapter(name: str | None) -> SamplingParams:
    return SamplingParams(
        temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True, lora_name=name
    )


async def test_each_adapter_alone_and_mixed_in_one_batch_equals_peft(
    client: InferenceClient, expected: dict[str | None, list[int]]
) -> None:
    try:
        alone = {
            name: (await client.add_request(PROMPT, adapter(name))).generated_tokens
            for name in (None, "sql", "poems")
        }
        assert alone == {name: expected[name] for name in alone}
        assert alone["sql"] != alone[None] != alone["poems"], "the adapters change the output"
        mixed = await asyncio.gather(
            *(client.add_request(PROMPT, adapter(name)) for name in (None, "sql", "poems") * 2)
        )
        assert [r.generated_tokens for r in mixed] == [alone[n] for n in (None, "sql", "poems")] * 2
        await asyncio.sleep(1.5)  # a heartbeat with the engine's adapters
        status = await client.get_status()
    finally:
        client.stop()
    report = status["engine_list"][0]["adapters"]
    assert report["max_loras"] == 2
    assert sorted(report["adapters"]) == ["poems", "sql"]
    assert all(loaded == 1 for loaded, _, _ in report["adapters"].values()), report


async def test_an_adapters_prompt_is_found_in_the_prefix_cache_as_predicted(
    client: InferenceClient,
) -> None:
    prompt = [(13 * i) % 300 + 20 for i in range(100)]  # three full 32-token blocks
    try:
        records = []
        for name in ("sql", "sql", None):
            records.append(await client.add_request(prompt, adapter(name)))
            await asyncio.sleep(1.5)  # the KV events reach the coordinator with the next turn
        status = await client.get_status()
    finally:
        client.stop()
    # The second run of the adapter finds its blocks; the base model does not find them.
    assert [r.cached_tokens for r in records] == [0, 96, 0]
    routing = status["prefix_routing"]
    assert routing["predicted_cached_tokens"] == routing["actual_cached_tokens"], routing


async def test_adapters_load_and_unload_at_run_time(
    client: InferenceClient, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    try:
        with pytest.raises(RequestFailed, match="unknown LoRA adapter 'late'"):
            await client.add_request(PROMPT, adapter("late"))
        assert await client.load_lora_adapter("late", str(adapters["late"])) is None
        late = await client.add_request(PROMPT, adapter("late"))
        assert late.generated_tokens == expected["late"]
        bad = await client.load_lora_adapter("broken", str(adapters["late"].parent))
        assert bad is not None and "no adapter_config.json" in bad, bad
        assert await client.unload_lora_adapter("late") is None
        with pytest.raises(RequestFailed, match="unknown LoRA adapter 'late'"):
            await client.add_request(PROMPT, adapter("late"))
    finally:
        client.stop()
