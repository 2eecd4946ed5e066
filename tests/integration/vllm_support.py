"""What the vLLM backend's tests share: tiny models vLLM's CPU build runs, transformers'
greedy reference, and dpserve processes whose engines run in vLLM's own install."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from dpserve.client import InferenceClient
from dpserve.sampling import SamplingParams
from tests.integration.runtime import Processes

# vLLM's CPU attention takes head sizes of 32 and up (the project's tiny Llama has 16: "Unsupported
# CPU attention configuration: head_dim=16"), so its tests use a tiny Llama of head size 64.
VLLM_LLAMA = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1}
# vLLM's CPU block default is 128 tokens; the tiny model's context is 256, so blocks of 32 let
# prompts of a few blocks share prefixes. vLLM's CPU attention takes multiples of 32.
VLLM_BLOCK_SIZE = 32
# Every vLLM engine in the tests: no torch.compile (minutes on CPU), a small KV cache.
VLLM_ENGINE_FLAGS = (
    "--vllm-arg=--enforce-eager",
    "--block-size",
    str(VLLM_BLOCK_SIZE),
    "--kv-cache-bytes",
    str(64 * 1024**2),
)


def build_vllm_llama(directory: Path) -> Path:
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(directory, **VLLM_LLAMA)


def _never_stopping(hf: Any) -> Any:
    """The model without its EOS: ``generate`` merges the model's own generation config into
    the one it is given, so an EOS unset there still stops it (as ``ignore_eos`` must not)."""
    hf.generation_config.eos_token_id = None
    return hf


def _greedy_generator(model: Path, max_new_tokens: int) -> tuple[Any, Any]:
    """The model (fp32, never stopping early) and a greedy generation config that returns
    each step's logits."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = _never_stopping(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval())
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return hf, config


def greedy_reference(
    model: Path, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' ``generate`` (greedy, fp32, never stopping early) for each prompt: the
    tokens and each one's log-prob."""
    import torch

    hf, config = _greedy_generator(model, max_new_tokens)
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), generation_config=config)
            new = out.sequences[0, len(prompt) :].tolist()
            steps = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
            tokens.append(new)
            logprobs.append([float(step[token]) for step, token in zip(steps, new, strict=True)])
    return tokens, logprobs


# A greedy step whose two most likely tokens are closer than this (in log-prob) is a near-tie:
# fp32 rounding that differs between two implementations (dpserve's engine and vLLM's CPU
# kernels), or between two batch compositions of vLLM's, may pick either token there.
NEAR_TIE = 0.01


def clear_greedy_prompts(
    model: Path, candidates: list[list[int]], count: int, max_new_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` of ``candidates`` whose greedy continuation (transformers, fp32) has no
    near-tie in its first ``max_new_tokens`` steps, and those continuations. A random tiny
    model has near-ties on some paths; a test that compares two engines' greedy streams token
    for token needs paths on which every correct implementation agrees."""
    import torch

    hf, config = _greedy_generator(model, max_new_tokens)
    chosen: list[list[int]] = []
    continuations: list[list[int]] = []
    with torch.no_grad():
        for prompt in candidates:
            out = hf.generate(torch.tensor([prompt]), generation_config=config)
            gaps = [
                float(top[0] - top[1])
                for top in (
                    torch.log_softmax(step[0].float(), -1).topk(2).values for step in out.logits
                )
            ]
            if min(gaps) >= NEAR_TIE:
                chosen.append(prompt)
                continuations.append(out.sequences[0, len(prompt) :].tolist())
            if len(chosen) == count:
                return chosen, continuations
    raise AssertionError(f"only {len(chosen)} of {len(candidates)} prompts have no near-tie")


# Token prompts to pick streamed prompts from (``clear_greedy_prompts``), and how many tokens a
# stream generates: with the 8-token prompts, about half the tiny model's context (256).
STREAM_CANDIDATES = [[30 + i, 5, 90 + 7 * i, 44, 180 - i, 12, 61, 7] for i in range(64)]
STREAM_TOKENS = 120


async def stream_greedy(
    client: InferenceClient,
    prompt: list[int],
    chunks: list[int],
    index: int,
    penalties: Mapping[str, float] | None = None,
) -> tuple[list[int], str]:
    """One greedy stream of ``STREAM_TOKENS`` tokens: its tokens and text (``chunks[index]``
    counts its chunks as they come). ``penalties``: ``SamplingParams`` penalty fields."""
    params = SamplingParams(
        temperature=0,
        num_tokens_to_generate=STREAM_TOKENS,
        ignore_eos=True,
        stream=True,
        **(penalties or {}),
    )
    tokens: list[int] = []
    text: list[str] = []
    async for chunk in client.stream(prompt, params):
        tokens += chunk.tokens
        text.append(chunk.text)
        chunks[index] += 1
    return tokens, "".join(text)


# Rounds of streams tried for the moment to kill: with a fast and a slow backend in one pool
# the fast one's streams can all end before the slow one's have a few chunks (a CI run saw
# chunk counts [58, 7, 58, 7, ...], every stream done, and waited out the deadline).
_KILL_ROUNDS = 3


async def streams_killed_mid_way(
    client: InferenceClient,
    prompts: list[list[int]],
    kill: Callable[[], Awaitable[None]],
    victim: int | None = None,
    penalties: Mapping[str, float] | None = None,
    frozen: subprocess.Popen[bytes] | None = None,
) -> list[tuple[list[int], str]]:
    """Every prompt streamed at once, and ``kill`` (an engine) once each stream has a few
    chunks (or ended). With ``victim`` (the rank ``kill`` ends), once that engine holds streams
    and as many streams are under way (a few chunks, not ended): two backends differ in speed,
    and the faster one's streams can end before the slower one's have a few chunks. With
    ``frozen`` (the victim's process), the victim is stopped (SIGSTOP) at that moment and
    killed only if it still holds streams once what it had sent has arrived: a fast engine
    can otherwise finish its streams between the status read and the kill (a CI run, 4573c68:
    nothing was left to move)."""
    deadline = time.monotonic() + 60
    for _ in range(_KILL_ROUNDS):
        chunks = [0] * len(prompts)
        streams = [
            asyncio.create_task(stream_greedy(client, p, chunks, i, penalties))
            for i, p in enumerate(prompts)
        ]
        while True:
            if await _time_to_kill(client, chunks, streams, victim) and await _holds_frozen(
                client, victim, frozen
            ):
                await kill()
                return await asyncio.gather(*streams)
            assert time.monotonic() < deadline, (chunks, [task.done() for task in streams])
            if all(task.done() for task in streams):
                break  # every stream ended before the moment came: stream them all again
            await asyncio.sleep(0.002)
        await asyncio.gather(*streams)
    raise AssertionError(f"in {_KILL_ROUNDS} rounds the streams always ended before the kill")


async def _holds_frozen(
    client: InferenceClient, victim: int | None, frozen: subprocess.Popen[bytes] | None
) -> bool:
    """Without ``frozen``: True. With it: the victim stopped, and whether it still holds
    streams once its last messages have arrived (then it stays stopped until killed; else it
    goes on)."""
    if frozen is None:
        return True
    os.kill(frozen.pid, signal.SIGSTOP)
    await asyncio.sleep(0.25)  # what it sent before it stopped reaches the coordinator
    status = await asyncio.wait_for(client.get_status(), 10)
    held = [e["outstanding"] for e in status["engine_list"] if e["rank"] == victim]
    if held and held[0] > 0:
        return True
    os.kill(frozen.pid, signal.SIGCONT)
    return False


async def _time_to_kill(
    client: InferenceClient,
    chunks: list[int],
    streams: list[asyncio.Task[tuple[list[int], str]]],
    victim: int | None,
) -> bool:
    if victim is None:
        return all(count >= 3 or task.done() for count, task in zip(chunks, streams, strict=True))
    under_way = sum(
        1 for count, task in zip(chunks, streams, strict=True) if count >= 3 and not task.done()
    )
    if under_way == 0:
        return False
    status = await asyncio.wait_for(client.get_status(), 10)
    held = [e["outstanding"] for e in status["engine_list"] if e["rank"] == victim]
    return bool(held) and 0 < held[0] <= under_way


def spawn_vllm_engine(
    processes: Processes,
    vllm_python: str,
    port: int,
    rank: int,
    model: Path,
    *extra: str,
    environment: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``dpserve engine --backend vllm`` in vLLM's install, logged like ``Processes.spawn``;
    ``environment`` is set for it over this process's."""
    log = open(processes.log_dir / f"engine-{rank}.log", "ab")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            vllm_python, "-m", "dpserve.cli", "engine", "--coordinator",
            f"tcp://127.0.0.1:{port}", "--rank", str(rank), "--model", str(model),
            "--backend", "vllm", *VLLM_ENGINE_FLAGS, *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(environment or {})},
        cwd=processes.log_dir,  # never the repository root: its operator/ shadows the stdlib's
    )  # fmt: skip
    log.close()
    processes.started.append(process)
    return process


def spawn_dpserve_engine(
    processes: Processes, port: int, rank: int, model: Path
) -> subprocess.Popen[bytes]:
    # Streams flushed every 2 ms, not 50: the tiny model's streams on this engine ended
    # within their first 3 chunks at 50 ms (CI, cc67691), and again at 10 ms (CI, 641cbad:
    # every stream one chunk), so none stood "under way" for the kill while the engine held it.
    return processes.spawn(
        f"engine-{rank}", "engine", "--coordinator", f"tcp://127.0.0.1:{port}",
        "--rank", str(rank), "--model", str(model), "--torch-threads", "1",
        "--stream-interval", "0.002",
    )  # fmt: skip
