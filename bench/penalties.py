"""What penalties cost a sampling step on the CPU, by batch rows and history length.

    python bench/penalties.py

Each case samples a batch of SmolLM2's vocabulary (49,152) greedily with a repetition and a
frequency penalty on every row, as an engine does step after step (each row's history one token
longer each time, its ``penalties.PenaltyTokens`` kept between steps), against the same rows
without penalties in the same run. A row's cost should not grow with its history: every
request in a batch waits for the whole step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dpserve.engine.sample import penalties, sampler
from dpserve.sampling import SamplingParams

VOCAB = 49_152
CASES = ((1, 0, 0), (1, 8_000, 2_000), (16, 2_000, 500), (16, 8_000, 4_000), (64, 8_192, 2_000))


def step_ms(rows: int, prompt: int, generated: int, penalized: bool, steps: int) -> float:
    logits = torch.randn(rows, VOCAB)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5)
        if penalized
        else SamplingParams(temperature=0.0, return_log_probs=True)  # not the argmax shortcut
    ] * rows
    histories = [list(range(generated)) for _ in range(rows)]
    kept = [penalties.PenaltyTokens(range(prompt), True) for _ in range(rows)]
    times = []
    for _ in range(steps):
        for tokens in histories:
            tokens.append(7)
        started = time.perf_counter()
        rows_history = (
            [k.counts(tokens) for k, tokens in zip(kept, histories, strict=True)]
            if penalized
            else None
        )
        sampler.sample(logits, params, [0] * rows, rows_history)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| rows | prompt | generated | penalized ms | without ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows, prompt, generated in CASES:
        with_penalties = step_ms(rows, prompt, generated, True, args.steps)
        without = step_ms(rows, prompt, generated, False, args.steps)
        print(
            f"| {rows} | {prompt:,} | {generated:,} | {with_penalties:.2f} | {without:.2f} | "
            f"{with_penalties / without:.1f}x |"
        )


if __name__ == "__main__":
    main()
