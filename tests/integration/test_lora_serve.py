"""LoRA adapters through ``dpserve serve`` and the OpenAI SDK: ``model=<adapter>`` runs the
adapter (greedy tokens = transformers + peft on the merged model), ``models.list()`` lists it
with its parent, adapters load and unload at run time, and an unknown one is a 404 naming it;
and, with a coordinator and engines started apart, an adapter loaded at run time survives a
coordinator restart for engines that start after it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from dpserve.client import InferenceClient
from dpserve.sampling import SamplingParams
from tests.integration.conftest import serving
from tests.integration.runtime import Processes, free_port, wait_for_engines
from tests.integration.test_runtime import FAST
from tests.lora_adapters import make_adapter, merged_model, reference_greedy

PROMPT = "The quick brown fox"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "adapter-a": make_adapter(tiny_model_path, root / "a", seed=11),
        "adapter-b": make_adapter(tiny_model_path, root / "b", seed=12, rank=4),
    }


@pytest.fixture(scope="module")
def lora_url(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    start = f"adapter-a={adapters['adapter-a']}"
    with serving(tiny_model_path, log, "--lora-modules", start, "--max-loras", "2") as url:
        yield url


@pytest.fixture
def client(lora_url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=lora_url, max_retries=0, timeout=120)


def post(url: str, body: dict[str, str]) -> tuple[int, str]:
    """POST ``body`` as JSON: the status and the body's text."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def expected_text(tiny_model_path: Path, adapter: Path | None) -> str:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = tokenizer(PROMPT)["input_ids"]
    tokens = reference_greedy(merged_model(tiny_model_path, adapter), prompt, MAX_TOKENS)
    return str(tokenizer.decode(tokens))


def complete(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_an_adapter_named_as_the_model_runs_it(
    client: openai.OpenAI, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    base_name = client.models.list().data[0].id
    with_adapter = complete(client, "adapter-a")
    assert with_adapter.model == "adapter-a"
    assert with_adapter.choices[0].text == expected_text(tiny_model_path, adapters["adapter-a"])
    base = complete(client, base_name)
    assert base.model == base_name
    assert base.choices[0].text == expected_text(tiny_model_path, None)
    assert base.choices[0].text != with_adapter.choices[0].text


def test_models_lists_the_adapters_with_their_parent(client: openai.OpenAI) -> None:
    models = client.models.list().data
    base = models[0]
    assert base.model_extra is not None and base.model_extra["parent"] is None
    by_id = {model.id: model for model in models[1:]}
    assert "adapter-a" in by_id
    extra = by_id["adapter-a"].model_extra
    assert extra is not None and extra["parent"] == base.id


def test_an_unknown_adapter_is_a_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="The model `no-such-adapter` does not exist"):
        complete(client, "no-such-adapter")


def test_adapters_load_and_unload_at_run_time(
    client: openai.OpenAI, lora_url: str, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    body = {"lora_name": "adapter-b", "lora_path": str(adapters["adapter-b"])}
    status, text = post(f"{lora_url}/load_lora_adapter", body)
    assert (status, text) == (200, "Success: LoRA adapter 'adapter-b' added successfully.")
    status, text = post(f"{lora_url}/load_lora_adapter", body)
    assert status == 400 and "already been loaded" in text
    assert "adapter-b" in {model.id for model in client.models.list().data}
    answer = complete(client, "adapter-b")
    assert answer.choices[0].text == expected_text(tiny_model_path, adapters["adapter-b"])

    status, text = post(f"{lora_url}/unload_lora_adapter", {"lora_name": "adapter-b"})
    assert status == 200, text
    assert "adapter-b" not in {model.id for model in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match="adapter-b"):
        complete(client, "adapter-b")
    status, text = post(f"{lora_url}/unload_lora_adapter", {"lora_name": "adapter-b"})
    assert status == 404 and "adapter-b" in text


def test_a_bad_adapter_directory_is_refused_with_the_engines_reason(
    lora_url: str, tmp_path: Path
) -> None:
    body = {"lora_name": "broken", "lora_path": str(tmp_path)}
    status, text = post(f"{lora_url}/load_lora_adapter", body)
    assert status == 400
    assert "engine rank 0" in text and "adapter_config.json not found" in text


def test_metrics_count_requests_per_adapter(lora_url: str, client: openai.OpenAI) -> None:
    complete(client, "adapter-a")
    with urllib.request.urlopen(lora_url.removesuffix("/v1") + "/metrics", timeout=30) as reply:
        metrics = reply.read().decode()
    info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert info and 'max_lora="2"' in info[0] and 'running_lora_adapters="' in info[0]
    assert 'dpserve_lora_adapter_loaded{adapter="adapter-a"} 1.0' in metrics


def test_the_front_names_the_engines_holding_each_adapter(lora_url: str) -> None:
    with urllib.request.urlopen(f"{lora_url}/lora_adapters", timeout=30) as reply:
        listed = json.loads(reply.read())["data"]
    by_name = {entry["id"]: entry for entry in listed}
    assert by_name["adapter-a"]["ranks"] == [0]  # loaded at start: registered on engine 0


# ------------------------------------------------- a coordinator restart keeps what was loaded


async def _engine_with_adapter(client: Any, rank: int, name: str, within: float = 120.0) -> None:
    """Wait until engine ``rank`` reports adapter ``name`` registered (its heartbeats)."""
    deadline = time.monotonic() + within
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = await asyncio.wait_for(client.get_status(), 5)
        for engine in status.get("engine_list", []):
            held = (engine.get("adapters") or {}).get("adapters", {})
            if engine["rank"] == rank and name in held:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"engine {rank} never reported {name}: {status.get('engine_list')}")


async def test_a_restarted_coordinator_gives_new_engines_what_was_loaded_before(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter loaded at run time, then the coordinator killed and restarted: the engine
    re-registers naming it, and an engine that starts after the restart loads it and serves it
    (greedy output = what the adapter gave before the restart, not the base model's)."""
    processes = Processes(tmp_path)
    port = free_port()
    engine = (
        "--model", str(tiny_model_path), "--device", "cpu", "--enable-lora",
        "--max-loras", "2", "--coordinator-timeout", "1",
    )  # fmt: skip
    prompt = AutoTokenizer.from_pretrained(tiny_model_path)(PROMPT)["input_ids"]
    greedy = SamplingParams(num_tokens_to_generate=MAX_TOKENS, temperature=0, ignore_eos=True)
    adapter = dataclasses.replace(greedy, lora_name="adapter-b")
    try:
        coordinator = processes.coordinator(port, *FAST)
        processes.spawn("engine-0", "engine", "--coordinator", f"tcp://127.0.0.1:{port}",
                        "--rank", "0", *engine)  # fmt: skip
        async with InferenceClient(port, handshake_timeout=20) as client:
            await wait_for_engines(client, 1, within=120)
            error = await client.load_lora_adapter("adapter-b", str(adapters["adapter-b"]))
            assert error is None
            before = await asyncio.wait_for(client.add_request(prompt, adapter), 60)
            base = await asyncio.wait_for(client.add_request(prompt, greedy), 60)
            assert before.generated_tokens != base.generated_tokens
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
        processes.coordinator(port, *FAST)
        async with InferenceClient(port, handshake_timeout=20) as client:
            await wait_for_engines(client, 1, within=60)  # engine 0, registered again
            processes.spawn("engine-1", "engine", "--coordinator", f"tcp://127.0.0.1:{port}",
                            "--rank", "1", *engine)  # fmt: skip
            await wait_for_engines(client, 2, within=120)
            await _engine_with_adapter(client, 1, "adapter-b")
            # Engine 0 gone, the new engine answers the adapter's requests.
            processes.started[1].send_signal(signal.SIGKILL)
            await wait_for_engines(client, 1, within=30)
            after = await asyncio.wait_for(client.add_request(prompt, adapter), 60)
            assert after.engine_rank == 1
            assert after.generated_tokens == before.generated_tokens
        assert "adopted from engine rank 0" in processes.log(f"coordinator-{port}")
    finally:
        processes.cleanup()
