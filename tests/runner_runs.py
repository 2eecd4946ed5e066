"""Requests run through a ``ModelRunner`` to the end, for tests that compare two ways of running
the same model (kernels on or off, weight formats)."""

from __future__ import annotations

from typing import Any

from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams


def six_greedy_requests(runner: Any) -> dict[int, tuple[list[int], list[float]]]:
    """Six greedy requests of 4 to 29 tokens (so decode steps of 1 to 6 sequences, prompt
    chunks before), EOS ignored: each request's tokens and log-probs."""
    runner.eos_token_ids = frozenset()
    for request in range(6):
        params = SamplingParams(
            temperature=0.0, num_tokens_to_generate=4 + 5 * request, return_log_probs=True
        )
        runner.add(RunnerRequest(request, [3 + request, 17, 40 + 2 * request], params))
    results: dict[int, tuple[list[int], list[float]]] = {}
    while runner.has_work():
        for update in runner.step():
            tokens, logprobs = results.setdefault(update.request_id, ([], []))
            tokens.extend(update.tokens)
            logprobs.extend(update.logprobs or [])
    return results
