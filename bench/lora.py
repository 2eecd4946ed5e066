"""LoRA adapters in one step: decode throughput of requests spread over 4 adapters against the
same requests on the base model alone (``engine.lora``; docs/lora.md).

    python bench/lora.py [--batch-sizes 1,16,64] [--rank 16] [--output-tokens 32] [--repeat 3]

A random Llama (hidden 512, 4 layers, 8 heads / 4 KV heads: ``tests.tiny_model``'s "small"
size of ``bench/engine.py``) and 4 random adapters of ``--rank`` on every projection (q, k, v,
o, gate, up, down) are built in a temporary directory. At each batch size B, B requests (8-token
prompts, ``--output-tokens`` each, greedy, EOS ignored) run to the end in one ``ModelRunner``:
once all on the base model, once spread evenly over the 4 adapters (B = 1: one adapter). The
two alternate, ``--repeat`` rounds each; the table gives each side's best round (generated
tokens per second of wall time, prefill included) and their ratio. Torch threads: as the
engine would take them (``--threads`` to set).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams
from tests.lora_adapters import make_adapter
from tests.tiny_model import build_tiny_model

ADAPTERS = 4


def run_once(runner: ModelRunner, names: list[str | None], output_tokens: int) -> float:
    """Generated tokens per second of ``len(names)`` requests, request i on ``names[i]``."""
    for index, name in enumerate(names):
        prompt = [1, *range(10 + index % 50, 17 + index % 50)]
        params = SamplingParams(
            temperature=0, num_tokens_to_generate=output_tokens, ignore_eos=True, lora_name=name
        )
        runner.add(RunnerRequest(index, prompt, params))
    generated = 0
    started = time.perf_counter()
    while runner.has_work():
        generated += sum(len(update.tokens) for update in runner.step())
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        base = build_tiny_model(
            root / "base", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4
        )
        adapters = {
            f"adapter-{i}": str(make_adapter(base, root / f"a{i}", seed=i, rank=args.rank))
            for i in range(ADAPTERS)
        }
        runner = ModelRunner(
            str(base), max_num_seqs=max(sizes), max_loras=ADAPTERS, lora_modules=adapters
        )
        names = list(adapters)
        run_once(runner, [None, *names], 4)  # warm up every path once
        print(f"torch threads {torch.get_num_threads()}, rank {args.rank}, {ADAPTERS} adapters")
        print("| batch | base tok/s | 4 adapters tok/s | adapters / base |")
        print("|---:|---:|---:|---:|")
        for size in sizes:
            mixed: list[str | None] = [names[i % ADAPTERS] for i in range(size)]
            best_base = best_mixed = 0.0
            for _ in range(args.repeat):
                best_base = max(best_base, run_once(runner, [None] * size, args.output_tokens))
                best_mixed = max(best_mixed, run_once(runner, mixed, args.output_tokens))
            print(
                f"| {size} | {best_base:,.0f} | {best_mixed:,.0f} | "
                f"{best_mixed / best_base:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
