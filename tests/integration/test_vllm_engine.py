"""``dpserve engine --backend vllm`` behind dpserve's coordinator, against real vLLM (its CPU
build, in its own install: ``make vllm``): greedy output and log-probs equal transformers'
``generate``; stop strings, ``min_tokens`` and stop tokens give dpserve's own engine's text and
finish reasons; seeds repeat; structured output follows its constraint, checked first within
dpserve's limits; a repeated prompt is
found in vLLM's prefix cache as the coordinator's index predicted (KV events translated into
dpserve's block hashes). The module's engine finds no C++ compiler, as in dpserve's images."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpserve.client import InferenceClient, RequestFailed
from dpserve.sampling import SamplingParams
from tests.integration.runtime import Processes, free_port, wait_for_engines
from tests.integration.vllm_support import (
    build_vllm_llama,
    greedy_reference,
    spawn_vllm_engine,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_LOGPROBS_FLAG = "--vllm-arg=--max-logprobs=3"
NO_COMPILER = {"CXX": "/nonexistent/g++"}
PROMPTS = [[5 + i, 40 + 3 * i, 77, 120 + i, 9, 200 - i, 31] for i in range(4)]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_llama(tmp_path_factory.mktemp("vllm-llama"))


@pytest.fixture(scope="module")
def coordinator_port(
    llama: Path, vllm_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[int]:
    """A coordinator and one vLLM engine on the tiny Llama, for the module's tests."""
    processes = Processes(tmp_path_factory.mktemp("vllm-engine"))
    port = free_port()
    try:
        processes.coordinator(port, "--insecure", "--tokenizer", str(llama))
        # vLLM refuses more alternatives than this, and dpserve's edge allows up to 20: a
        # request only vLLM refuses (``test_a_request_vllm_refuses_...``).
        # And no C++ compiler, as in dpserve's runtime images, and nothing compiled cached:
        # vLLM's sampler cannot compile its log-prob ranking (the engine died on the first
        # log-probs request, or at its warm-up), so it runs eagerly
        # (``test_greedy_tokens_and_logprobs_equal_transformers`` checks the log-probs).
        cold = {**NO_COMPILER, "DPSERVE_CACHE": str(tmp_path_factory.mktemp("cold-cache"))}
        spawn_vllm_engine(
            processes, vllm_python, port, 0, llama, MAX_LOGPROBS_FLAG, environment=cold
        )
        yield port
    finally:
        processes.cleanup()


@pytest.fixture
async def vllm_client(coordinator_port: int, processes: Processes) -> InferenceClient:
    client = InferenceClient(coordinator_port, handshake_timeout=20)
    await client.start()
    try:
        await wait_for_engines(client, 1, within=240)
    except AssertionError:
        log = Path(processes.log_dir.parent)  # the module's logs are beside this test's
        raise AssertionError(f"the vLLM engine did not register; logs under {log}") from None
    return client


async def test_greedy_tokens_and_logprobs_equal_transformers(
    vllm_client: InferenceClient, llama: Path
) -> None:
    expected, expected_logprobs = await asyncio.to_thread(
        greedy_reference, llama, PROMPTS, NEW_TOKENS
    )
    params = SamplingParams(
        temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True, return_log_probs=True
    )
    records = await asyncio.gather(*(vllm_client.add_request(p, params) for p in PROMPTS))
    vllm_client.stop()
    for record, tokens, logprobs in zip(records, expected, expected_logprobs, strict=True):
        assert record.generated_tokens == tokens
        assert record.finish_reason == "length"
        assert record.log_probs == pytest.approx(logprobs, abs=1e-4)


def _own_engine(model: Path, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
    """What dpserve's own engine (in this process) returns for each request: tokens, text,
    finish reason, stop token."""
    from dpserve.engine.model_runner import ModelRunner
    from dpserve.engine.runner import RunnerRequest
    from dpserve.tokenizer import as_batch_tokenizer

    runner = ModelRunner(str(model), device="cpu", dtype="float32")
    tokenizer = as_batch_tokenizer(runner.tokenizer)
    results = []
    for index, (prompt, params) in enumerate(requests):
        runner.add(RunnerRequest(index, prompt, params))
        tokens: list[int] = []
        texts: list[str] = []
        finish, stop_token = None, None
        while finish is None:
            for update in runner.step() + runner.unreported():
                tokens += update.tokens
                if update.text is not None:
                    texts.append(update.text)
                if update.finish_reason is not None:
                    finish, stop_token = update.finish_reason, update.stop_token
        text = "".join(texts) if texts else tokenizer.decode_batch([tokens])[0]
        results.append((tokens, text, finish, stop_token))
    return results


async def test_finishing_rules_give_dpserve_engine_text(
    vllm_client: InferenceClient, llama: Path
) -> None:
    """Stop strings (cut where they begin), min_tokens, a termination id, EOS and stop token
    ids: vLLM samples, dpserve's rules finish, so the tokens, text and finish reason are our
    engine's; min_p reaches vLLM's sampler (at 1 it samples greedily, as ours)."""
    greedy, _ = await asyncio.to_thread(greedy_reference, llama, PROMPTS[:1], 40)
    probe = greedy[0]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(llama).decode(probe)
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle
    cases = [
        SamplingParams(temperature=0, num_tokens_to_generate=40, stop_strings=(stop,)),
        SamplingParams(
            temperature=0, num_tokens_to_generate=40, stop_strings=(stop,), min_tokens=30
        ),
        SamplingParams(temperature=0, num_tokens_to_generate=40, termination_id=probe[10]),
        SamplingParams(temperature=0, num_tokens_to_generate=40),  # the model's EOS, if sampled
        SamplingParams(
            temperature=0, num_tokens_to_generate=40, ignore_eos=True, stop_token_ids=(probe[12],)
        ),
        # min_p 1 leaves each step's most likely token only: both engines sample greedily.
        SamplingParams(temperature=1.0, min_p=1.0, seed=7, num_tokens_to_generate=40),
        SamplingParams(
            temperature=0,
            num_tokens_to_generate=40,
            stop_strings=(stop,),
            include_stop_str_in_output=True,
        ),
        # A bias that outweighs the model's preference, then takes it back: greedy follows it.
        SamplingParams(
            temperature=0,
            num_tokens_to_generate=12,
            ignore_eos=True,
            logit_bias=((probe[5], 100.0), (probe[0], -100.0)),
        ),
    ]
    requests = [(PROMPTS[0], params) for params in cases]
    expected = await asyncio.to_thread(_own_engine, llama, requests)
    records = [await vllm_client.add_request(prompt, params) for prompt, params in requests]
    vllm_client.stop()
    for record, (tokens, own_text, finish, stop_token) in zip(records, expected, strict=True):
        assert (record.generated_tokens, record.finish_reason) == (tokens, finish)
        assert record.generated_text == own_text
        assert record.stop_token == stop_token
    assert records[0].finish_reason == "stop" and stop not in records[0].generated_text
    assert records[2].stop_token == probe[10]
    assert records[4].stop_token == probe[12] and records[4].finish_reason == "stop"
    assert records[5].generated_tokens == records[3].generated_tokens  # min_p 1: greedy
    assert records[6].finish_reason == "stop" and stop in records[6].generated_text
    assert records[7].generated_tokens == [probe[5]] * 12 or probe[5] == probe[0]


async def test_seeds_repeat_and_differ(vllm_client: InferenceClient) -> None:
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, num_tokens_to_generate=16, ignore_eos=True, seed=seed
        )

    first, again, other = await asyncio.gather(
        vllm_client.add_request(PROMPTS[1], seeded(7)),
        vllm_client.add_request(PROMPTS[1], seeded(7)),
        vllm_client.add_request(PROMPTS[1], seeded(8)),
    )
    vllm_client.stop()
    assert first.generated_tokens == again.generated_tokens
    assert first.generated_tokens != other.generated_tokens


async def test_structured_output_follows_its_constraint(vllm_client: InferenceClient) -> None:
    choice = SamplingParams(
        temperature=0, num_tokens_to_generate=16, guided_choice=("yes please", "no thanks")
    )
    regex = SamplingParams(temperature=0, num_tokens_to_generate=16, guided_regex="[0-9]{3}-[a-c]+")
    chose, matched = await asyncio.gather(
        vllm_client.add_request(PROMPTS[2], choice), vllm_client.add_request(PROMPTS[2], regex)
    )
    vllm_client.stop()
    assert chose.generated_text in ("yes please", "no thanks"), chose
    assert chose.finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}-[a-c]+", matched.generated_text), matched


async def test_a_constraint_is_checked_as_dpserve_engine_checks_it(
    vllm_client: InferenceClient,
) -> None:
    """Before vLLM compiles a constraint, the engine compiles it and times its first masks as
    dpserve's engine does, off the step loop, within the same limits: a schema that admits no
    document (a $ref cycle) is refused with dpserve's reason, and the engine serves on."""
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    cyclic = SamplingParams(temperature=0, num_tokens_to_generate=8, guided_json=json.dumps(cycle))
    plain = SamplingParams(temperature=0, num_tokens_to_generate=8, ignore_eos=True)
    with pytest.raises(RequestFailed) as refused:
        await vllm_client.add_request(PROMPTS[0], cyclic)
    answered = await vllm_client.add_request(PROMPTS[0], plain)
    vllm_client.stop()
    assert refused.value.code == "bad_request", refused.value
    assert "admits no" in refused.value.message, refused.value
    assert len(answered.generated_tokens) == 8


async def test_a_request_vllm_refuses_fails_alone_as_a_bad_request(
    vllm_client: InferenceClient,
) -> None:
    """A request that passes dpserve's checks but not vLLM's (here: more top log-probs than
    the engine's ``--max-logprobs``) is the client's error, 400, not the engine's (vLLM's
    validation errors are not ValueErrors): it fails alone, and the engine serves on."""
    alternatives = SamplingParams(
        temperature=0, num_tokens_to_generate=4, return_log_probs=True, top_logprobs=5
    )
    plain = SamplingParams(temperature=0, num_tokens_to_generate=4, ignore_eos=True)
    with pytest.raises(RequestFailed) as refused:
        await vllm_client.add_request(PROMPTS[1], alternatives)
    answered = await vllm_client.add_request(PROMPTS[1], plain)
    vllm_client.stop()
    assert refused.value.code == "bad_request", refused.value
    assert refused.value.message.startswith("vLLM refused the request: "), refused.value
    assert "greater than max allowed: 3" in refused.value.message, refused.value
    assert len(answered.generated_tokens) == 4


async def test_a_repeated_prompt_is_found_in_the_prefix_cache_as_predicted(
    vllm_client: InferenceClient,
) -> None:
    prompt = [(7 * i) % 300 + 20 for i in range(100)]  # three full 32-token blocks
    params = SamplingParams(temperature=0, num_tokens_to_generate=4, ignore_eos=True)
    first = await vllm_client.add_request(prompt, params)
    await asyncio.sleep(1.5)  # the KV events reach the coordinator with the next turn
    second = await vllm_client.add_request(prompt, params)
    await asyncio.sleep(1.5)  # a heartbeat with the engine's figures once it runs nothing
    status = await vllm_client.get_status()
    vllm_client.stop()
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96
    assert second.generated_tokens == first.generated_tokens
    routing = status["prefix_routing"]
    assert routing["predicted_cached_tokens"] == routing["actual_cached_tokens"] >= 96
    stats = status["engine_list"][0]["stats"]
    assert stats["backend_vllm"] == 1 and stats["block_size"] == 32
    # The prompt's 3 cached blocks sit in vLLM's free queue, evictable but not empty: the
    # router's room on this engine is the free blocks less those (and less any other test's).
    assert stats["kv_cached_blocks"] >= 3
    assert 0 < stats["kv_empty_blocks"] <= stats["kv_free_blocks"] - 3, stats


async def test_cancel_pause_and_suspend(vllm_client: InferenceClient) -> None:
    """A stream left early is aborted in vLLM (the engine runs nothing after it); a paused or
    suspended engine holds its requests (vLLM's CPU build has no sleep mode: the engine only
    stops stepping) and finishes them, unchanged, once running again."""
    long = SamplingParams(temperature=0, num_tokens_to_generate=200, ignore_eos=True, stream=True)
    short = SamplingParams(temperature=0, num_tokens_to_generate=6, ignore_eos=True)
    streamed = 0
    async for chunk in vllm_client.stream(PROMPTS[3], long):
        streamed += len(chunk.tokens)
        if streamed >= 3:
            break  # leaving the iteration cancels the request
    expected = await vllm_client.add_request(PROMPTS[3], short)
    await asyncio.sleep(1.5)  # a heartbeat with the engine's figures after the cancel
    status = await vllm_client.get_status()
    assert status["inflight"] == 0
    stats = status["engine_list"][0]["stats"]
    assert stats["running"] == stats["waiting"] == 0, stats

    await asyncio.wait_for(vllm_client.pause_engines(), 10)
    held = vllm_client.add_request(PROMPTS[3], short)
    await asyncio.sleep(0.5)
    assert not held.done(), "a paused engine must not step"
    await asyncio.wait_for(vllm_client.suspend_engines(), 10)
    await asyncio.wait_for(vllm_client.resume_engines(), 10)
    await asyncio.wait_for(vllm_client.unpause_engines(), 10)
    record = await asyncio.wait_for(held, 30)
    vllm_client.stop()
    assert record.generated_tokens == expected.generated_tokens


async def test_cache_salt_separates_prefixes_as_predicted(vllm_client: InferenceClient) -> None:
    """A request's cache_salt reaches vLLM (its blocks' extra keys) and dpserve's hashes mix it
    in the same way: a prompt cached under one salt is not found under another, and found
    again under its own, as the coordinator predicted."""
    prompt = [(11 * i) % 300 + 40 for i in range(100)]

    def salted(salt: str) -> SamplingParams:
        return SamplingParams(
            temperature=0, num_tokens_to_generate=2, ignore_eos=True, cache_salt=salt
        )

    cached = []
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        record = await vllm_client.add_request(prompt, salted(salt))
        cached.append(record.cached_tokens)
        await asyncio.sleep(1.5)  # the KV events reach the coordinator with the next turn
    status = await vllm_client.get_status()
    vllm_client.stop()
    assert cached == [0, 0, 96]
    routing = status["prefix_routing"]
    assert routing["predicted_cached_tokens"] == routing["actual_cached_tokens"]
