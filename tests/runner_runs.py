"""Requests run through a ``ModelRunner`` to the end, for tests that compare two ways of running
the same model (kernels on or off, weight formats)."""

from __future__ import annotations

from typing import Any

from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams


def greedy_prompt(request: int) -> list[int]:
    """The prompt of ``greedy_requests``' request ``request``."""
    return [3 + request, 17, 40 + 2 * request]


def greedy_requests(runner: Any, count: int = 6) -> dict[int, tuple[list[int], list[float]]]:
    """``count`` greedy requests of 4 to ``4 + 5 * (count - 1)`` tokens (so decode steps of 1 to
    ``count`` sequences, prompt chunks before), EOS ignored: each request's tokens and
    log-probs."""
    runner.eos_token_ids = frozenset()
    for request in range(count):
        params = SamplingParams(
            temperature=0.0, num_tokens_to_generate=4 + 5 * request, return_log_probs=True
        )
        runner.add(RunnerRequest(request, greedy_prompt(request), params))
    results: dict[int, tuple[list[int], list[float]]] = {}
    while runner.has_work():
        for update in runner.step():
            tokens, logprobs = results.setdefault(update.request_id, ([], []))
            tokens.extend(update.tokens)
            logprobs.extend(update.logprobs or [])
    return results
