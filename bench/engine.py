"""Engine throughput: ``ModelRunner`` against transformers' own ways to generate.

    python bench/engine.py [--model PATH|smollm2-135m-instruct] [--requests 32] [--batch-size 32]
    python bench/engine.py --model-type qwen3_moe [--concurrency 1,16,64] [--repeat 2]

Without ``--model`` it builds the tiny random Llama of the tests (``--size small``: a ~10M
parameter one) in a temporary directory. All
methods get the same prompts (8-96 tokens) and per-request output lengths (16-128 tokens),
greedy, with EOS disabled so every method produces exactly the requested tokens:

* sequential ``model.generate`` — one request at a time;
* one static ``generate`` batch — left padded, run to the longest requested length; only the
  tokens each request asked for are counted;
* transformers' continuous batching (``generate_batch``'s manager, per-request lengths);
* ``ModelRunner`` driven in-process by its ``step()`` loop;
* the whole stack (``run_through_coordinator``): a coordinator and one engine process, the
  requests sent concurrently by an ``InferenceClient``.

``--model-type qwen3_moe`` measures something else: our fast path (``ModelRunner`` on the paged
backend) against the transformers fallback (``ModelRunner(backend="transformers")``) on a
random-weight Qwen3-MoE built here from transformers' ``Qwen3MoeConfig`` (``--moe-shape``), at
each concurrency of ``--concurrency``: ``max_num_seqs`` = C and 2 x C requests (at least 8)
submitted at once, so C run together; prompts of 8-96 tokens, ``--output-tokens`` each. Both
sides get the same requests; they alternate, ``--repeat`` rounds each, every round reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.model_loading import load_model_and_tokenizer, resolve_model
from dpserve.sampling import SamplingParams

Workload = list[tuple[list[int], int]]  # (prompt tokens, tokens to generate)

GENERATED_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},  # build_tiny_model's defaults, as in the tests
    "small": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4},
}

# Random-weight Qwen3-MoE shapes for --model-type qwen3_moe (Qwen3MoeConfig fields). "small":
# 16 experts, 2 per token, every layer sparse: at 64 concurrent requests each expert sees ~8
# tokens per decode step, so the per-expert loop and its small matmuls are what is measured,
# as in the real 30B-A3B (128 experts, 8 per token) at a few hundred tokens per step.
MOE_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
    },
}


def make_workload(requests: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    # Skip the lowest ids: tokenizers put their special tokens there.
    return [
        (
            [rng.randrange(16, vocab_size) for _ in range(rng.randint(8, 96))],
            rng.randint(16, 128),
        )
        for _ in range(requests)
    ]


def build_qwen3_moe(directory: Path, shape: dict[str, int]) -> Path:
    """A random-weight Qwen3-MoE of ``shape`` with the tests' tiny BPE tokenizer, saved in
    ``directory`` (deterministic: fixed seed)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3MoeConfig

    from tests.tiny_model import MAX_POSITIONS, SEED, _train_tokenizer

    tokenizer = _train_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        intermediate_size=2 * shape["hidden_size"],  # dense layers only; none in these shapes
        max_position_embeddings=MAX_POSITIONS,
        norm_topk_prob=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **shape,
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def concurrency_workload(
    concurrency: int, vocab_size: int, output_tokens: int, seed: int = 0
) -> Workload:
    """2 x ``concurrency`` requests (at least 8): prompts of 8-96 tokens, ``output_tokens``
    each, so ``concurrency`` of them are in flight at once until the last ones finish."""
    rng = random.Random(seed + concurrency)
    return [
        ([rng.randrange(16, vocab_size) for _ in range(rng.randint(8, 96))], output_tokens)
        for _ in range(max(8, 2 * concurrency))
    ]


def compare_backends(
    model_path: str, levels: Sequence[int], repeat: int, output_tokens: int
) -> dict[int, dict[str, list[float]]]:
    """Output tok/s of the paged backend and the transformers fallback at each concurrency,
    every round of each (the two alternate, so load from other processes hits both)."""
    rates: dict[int, dict[str, list[float]]] = {}
    for concurrency in levels:
        runners = {
            backend: ModelRunner(model_path, max_num_seqs=concurrency, backend=backend)
            for backend in ("paged", "transformers")
        }
        vocab_size = int(runners["paged"].model.config.vocab_size)
        workload = concurrency_workload(concurrency, vocab_size, output_tokens)
        for runner in runners.values():  # warm-up: one short request
            run_model_runner(runner, [(workload[0][0], 4)])
        rates[concurrency] = {backend: [] for backend in runners}
        for round_index in range(max(1, repeat)):
            for backend, runner in runners.items():
                seconds, tokens = timed(partial(run_model_runner, runner, workload))
                if tokens != output_tokens * len(workload):
                    raise RuntimeError(f"{backend}: {tokens} tokens, not {output_tokens} each")
                rates[concurrency][backend].append(tokens / seconds)
                print(
                    f"concurrency {concurrency:3d} round {round_index + 1} {backend:<12} "
                    f"{tokens:6d} tokens {seconds:7.2f} s {tokens / seconds:8.1f} tok/s",
                    flush=True,
                )
        del runners
    return rates


def print_backend_table(rates: dict[int, dict[str, list[float]]]) -> None:
    def cell(values: list[float]) -> str:
        return f"{max(values):8.1f} ({min(values):.1f}-{max(values):.1f})"

    print(
        f"\n{'concurrency':>11} {'paged tok/s (range)':>26} {'transformers tok/s (range)':>28} "
        f"{'ratio best':>10} {'ratio range':>13}"
    )
    for concurrency, by_backend in rates.items():
        fast, fallback = by_backend["paged"], by_backend["transformers"]
        print(
            f"{concurrency:>11} {cell(fast):>26} {cell(fallback):>28} "
            f"{max(fast) / max(fallback):9.2f}x "
            f"{min(fast) / max(fallback):5.2f}-{max(fast) / min(fallback):.2f}x"
        )


def main_moe(args: argparse.Namespace) -> int:
    levels = [int(level) for level in args.concurrency.split(",")]
    shape = MOE_SHAPES[args.moe_shape]
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            model_path = resolve_model(args.model)
        else:
            model_path = str(build_qwen3_moe(Path(scratch) / args.moe_shape, shape))
        model, _ = load_model_and_tokenizer(model_path)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        config = model.config
        del model
        print(
            f"model {model_path}: {config.model_type}, {params:.1f}M params, hidden "
            f"{config.hidden_size}, {config.num_hidden_layers} layers, {config.num_experts} "
            f"experts, {config.num_experts_per_tok} per token, expert inner "
            f"{config.moe_intermediate_size}; concurrency {levels}, {args.output_tokens} output "
            f"tokens per request, {args.repeat} rounds per side, torch threads "
            f"{torch.get_num_threads()}",
            flush=True,
        )
        rates = compare_backends(model_path, levels, args.repeat, args.output_tokens)
    print_backend_table(rates)
    return 0


def timed(function: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = function()
    return time.perf_counter() - start, tokens


def run_sequential(model: Any, workload: Workload) -> int:
    produced = 0
    for prompt, wanted in workload:
        input_ids = torch.tensor([prompt], device=model.device)
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=wanted,
        )
        produced += output.shape[1] - len(prompt)
    return produced


def run_static_batch(model: Any, workload: Workload, pad_id: int) -> int:
    width = max(len(prompt) for prompt, _ in workload)
    input_ids = torch.full((len(workload), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(workload):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    output = model.generate(
        input_ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=False,
        max_new_tokens=max(wanted for _, wanted in workload),
    )
    generated = output.shape[1] - width
    # Tokens past a request's own length are wasted work: not counted.
    return sum(min(wanted, generated) for _, wanted in workload)


def run_transformers_continuous(model: Any, workload: Workload) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(wanted for _, wanted in workload),
        eos_token_id=None,
        pad_token_id=model.generation_config.pad_token_id,
    )
    produced = 0
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=30
    ) as manager:
        request_ids = [
            manager.add_request(prompt, max_new_tokens=wanted) for prompt, wanted in workload
        ]
        pending = set(request_ids)
        while pending:
            result = manager.get_result(timeout=5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
    return produced


def run_model_runner(runner: ModelRunner, workload: Workload) -> int:
    # An id past the logits' width is never sampled: EOS disabled, like the baselines.
    never = int(runner.model.config.vocab_size)
    for request_id, (prompt, wanted) in enumerate(workload):
        params = SamplingParams(
            temperature=0.0, num_tokens_to_generate=wanted, termination_id=never
        )
        runner.add(RunnerRequest(request_id, prompt, params))
    produced = 0
    while runner.has_work():
        for update in runner.step():
            produced += len(update.tokens)
    return produced


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_through_coordinator(
    model_path: str,
    workload: Workload,
    batch_size: int,
    repeat: int = 1,
    startup_timeout: float = 180.0,
    engines: int = 1,
    engine_args: Sequence[str] = ("--device", "cpu"),
) -> tuple[float, int]:
    """The whole stack: ``dpserve coordinator`` and ``engines`` ``dpserve engine`` processes
    (ModelRunner, started with ``engine_args``), the requests sent concurrently by an
    ``InferenceClient``. Timed from the first submission to the last result (best of ``repeat``
    rounds); start-up and one warm-up request are not counted."""
    from dpserve.client import InferenceClient

    port = _free_port()
    root = Path(__file__).resolve().parent.parent
    # No PYTHONPATH: the repo's operator/ would shadow the standard library's operator.
    # ``-m`` run from the repo root finds dpserve anyway.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "dpserve.cli"]
    processes = [
        subprocess.Popen(
            [*cli, "coordinator", "--port", str(port), "--tokenizer", model_path],
            cwd=root,
            env=env,
            stderr=subprocess.DEVNULL,
        ),
        *(
            subprocess.Popen(
                [
                    *cli,
                    "engine",
                    "--coordinator",
                    str(port),
                    "--rank",
                    str(rank),
                    "--model",
                    model_path,
                    "--max-batch-size",
                    str(batch_size),
                    *engine_args,
                ],
                cwd=root,
                env=env,
                stderr=subprocess.DEVNULL,
            )
            for rank in range(engines)
        ),
    ]

    async def drive() -> tuple[float, int]:
        deadline = time.monotonic() + startup_timeout
        client = InferenceClient(port, handshake_timeout=startup_timeout)
        await client.start()
        try:
            while (await client.get_status())["engines"] < engines:
                if time.monotonic() > deadline:
                    raise TimeoutError("the engine did not register with the coordinator")
                await asyncio.sleep(0.2)
            await client.add_request(workload[0][0], SamplingParams(num_tokens_to_generate=4))
            never = 1 << 30  # an id no model produces: EOS disabled, like the other methods
            rounds = []
            for _ in range(max(1, repeat)):
                start = time.perf_counter()
                records = await asyncio.gather(
                    *(
                        client.add_request(
                            prompt,
                            SamplingParams(
                                temperature=0.0,
                                num_tokens_to_generate=wanted,
                                termination_id=never,
                            ),
                        )
                        for prompt, wanted in workload
                    )
                )
                seconds = time.perf_counter() - start
                rounds.append((seconds, sum(len(record.generated_tokens) for record in records)))
            return min(rounds)
        finally:
            client.stop()

    try:
        return asyncio.run(drive())
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model dir or smollm2-135m-instruct (default: tiny)")
    parser.add_argument(
        "--size",
        choices=sorted(GENERATED_SIZES),
        default="tiny",
        help="without --model: the generated Llama's size (tiny: the tests' 0.1M-parameter "
        "model; small: ~10M parameters, where compute rather than Python overhead dominates)",
    )
    parser.add_argument(
        "--model-type",
        choices=("llama", "qwen3_moe"),
        default="llama",
        help="llama: the methods above on a Llama; qwen3_moe: the paged backend against the "
        "transformers fallback on a random Qwen3-MoE, at each --concurrency",
    )
    parser.add_argument("--moe-shape", choices=sorted(MOE_SHAPES), default="small")
    parser.add_argument(
        "--concurrency", default="1,16,64", help="qwen3_moe: concurrent requests, comma-separated"
    )
    parser.add_argument(
        "--output-tokens", type=int, default=64, help="qwen3_moe: output tokens per request"
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="ModelRunner max_num_seqs")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of the fast methods; the best one counts (qwen3_moe: rounds per side)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        help="methods to skip: sequential, static, hf-cb, coordinator (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_type == "qwen3_moe":
        return main_moe(args)

    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            model_path = resolve_model(args.model)
        else:
            from tests.tiny_model import build_tiny_model

            model_path = str(
                build_tiny_model(Path(scratch) / args.size, **GENERATED_SIZES[args.size])
            )
        model, tokenizer = load_model_and_tokenizer(model_path)
        # EOS off for the baselines: every method generates exactly the requested tokens.
        model.generation_config.eos_token_id = None
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        model.generation_config.pad_token_id = pad_id
        workload = make_workload(args.requests, len(tokenizer))
        wanted = sum(n for _, n in workload)
        print(
            f"model {model_path}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
            f"{args.requests} requests, prompts {min(len(p) for p, _ in workload)}-"
            f"{max(len(p) for p, _ in workload)} tokens, outputs {min(n for _, n in workload)}-"
            f"{max(n for _, n in workload)} ({wanted} in total), torch threads "
            f"{torch.get_num_threads()}, ModelRunner batch {args.batch_size}",
            flush=True,
        )
        warm = [(workload[0][0], 4)]
        results: dict[str, tuple[float, int] | str] = {}
        runner = ModelRunner(model_path, max_num_seqs=args.batch_size)
        with torch.inference_mode():
            if "sequential" not in args.skip:
                run_sequential(model, warm)
                results["sequential generate"] = timed(partial(run_sequential, model, workload))
            run_static_batch(model, warm, pad_id)
        run_model_runner(runner, warm)
        # The fast methods alternate, round after round, and each keeps its best round: load
        # from other processes on a shared machine then hits both alike.
        rounds: dict[str, list[tuple[float, int]]] = {}
        for _ in range(max(1, args.repeat)):
            if "static" not in args.skip:
                with torch.inference_mode():
                    rounds.setdefault("static generate batch", []).append(
                        timed(partial(run_static_batch, model, workload, pad_id))
                    )
            rounds.setdefault("ModelRunner (step loop)", []).append(
                timed(partial(run_model_runner, runner, workload))
            )
        del runner
        if "hf-cb" not in args.skip:
            try:
                results["transformers generate_batch"] = timed(
                    partial(run_transformers_continuous, model, workload)
                )
            except Exception as exc:  # report, do not abort the other measurements
                results["transformers generate_batch"] = f"failed: {type(exc).__name__}: {exc}"
        del model
        results.update({name: min(timings) for name, timings in rounds.items()})

        if "coordinator" not in args.skip:
            for engines in (1, 2):
                name = f"coordinator + {engines} engine{'s' * (engines > 1)}"
                try:
                    results[name] = run_through_coordinator(
                        model_path, workload, args.batch_size, args.repeat, engines=engines
                    )
                except Exception as exc:
                    results[name] = f"failed: {type(exc).__name__}: {exc}"

    print_table(results)
    return 0


def print_table(results: dict[str, tuple[float, int] | str]) -> None:
    def rate_of(name: str) -> float | None:
        outcome = results.get(name)
        return outcome[1] / outcome[0] if isinstance(outcome, tuple) else None

    def ratio(rate: float, base: float | None) -> str:
        return f"{rate / base:7.2f}x" if base else "     n/a"

    sequential, static = rate_of("sequential generate"), rate_of("static generate batch")
    print(
        f"\n{'method':<30} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'vs seq':>8} "
        f"{'vs static':>9}"
    )
    for name, outcome in results.items():
        if isinstance(outcome, str):
            print(f"{name:<30} {outcome}")
            continue
        seconds, tokens = outcome
        rate = tokens / seconds
        print(
            f"{name:<30} {seconds:8.2f} {tokens:7d} {rate:9.1f} {ratio(rate, sequential)} "
            f"{ratio(rate, static):>9}"
        )


if __name__ == "__main__":
    sys.exit(main())
