"""Structured output's cost inside an engine step: SmolLM2 on CPU, 64 sequences decoding.

    python bench/structured_step.py [--batch 64] [--steps 8]

Runs the same batch twice through ``ModelRunner`` (SmolLM2-135M, converted to
~/.cache/dpserve/models by ``dpserve serve``): plain sampling, then every sequence under a
typical JSON schema (``guided_json``). Reports the mean decode step of each (prefill excluded)
and the time spent filling the batch's token masks (``grammar.allowed``), as a share of the
plain decode step. Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The schema grammar_mask.py compares the libraries on: the same typical schema here.
from bench.grammar_mask import SCHEMA
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.engine.sample import grammar
from dpserve.sampling import SamplingParams


def decode_steps(runner: ModelRunner, params: SamplingParams, batch: int, steps: int) -> float:
    prompt = runner.tokenizer.encode("Describe a person as JSON:")
    for i in range(batch):
        runner.add(RunnerRequest(i, prompt, params))
    runner.step()  # the prefill
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        runner.step()
        times.append(time.perf_counter() - started)
    for i in range(batch):
        runner.cancel(i)
    return sum(times) / len(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    model = Path.home() / ".cache/dpserve/models/smollm2-135m-instruct"
    runner = ModelRunner(str(model), max_num_seqs=args.batch, device="cpu")
    mask_time = [0.0]
    original = grammar.allowed

    def timed(matchers, vocab_size, device):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return original(matchers, vocab_size, device)
        finally:
            mask_time[0] += time.perf_counter() - started

    # The backend calls ``grammar.allowed`` through the module, so this sees every call.
    grammar.allowed = timed
    common = dict(temperature=1.0, seed=1, num_tokens_to_generate=args.steps + 2, ignore_eos=True)
    plain = decode_steps(runner, SamplingParams(**common), args.batch, args.steps)  # type: ignore[arg-type]
    mask_time[0] = 0.0
    guided_params = SamplingParams(**common, guided_json=json.dumps(SCHEMA))  # type: ignore[arg-type]
    guided = decode_steps(runner, guided_params, args.batch, args.steps)
    per_step_mask = mask_time[0] / (args.steps + 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}")
    print(f"plain decode step   {plain * 1e3:8.1f} ms")
    print(f"guided decode step  {guided * 1e3:8.1f} ms  ({guided / plain:.2f}x)")
    print(
        f"mask fill per step  {per_step_mask * 1e3:8.1f} ms  ({per_step_mask / plain:.1%} of plain)"
    )


if __name__ == "__main__":
    main()
