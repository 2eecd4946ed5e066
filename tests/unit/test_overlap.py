"""The overlapped paged backend (step N+1 prepared while step N runs) returns exactly what the
sequential one returns: tokens, logprobs and finish reasons, through preemption, stop strings,
termination ids, seeded sampling, cancellation and suspend/resume. (That the step then takes
about max(host, device) rather than their sum is a figure of ``bench/engine_host.py
--device-ms``, not asserted here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams
from tests.unit.test_model_runner import Outcome, random_prompts, run, tiny_pool_runner


def mixed_requests() -> list[RunnerRequest]:
    prompts = random_prompts(9, seed=5, low=10, high=40)
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.0, "num_tokens_to_generate": 30},
        {"temperature": 0.0, "num_tokens_to_generate": 1},
        {"temperature": 0.9, "seed": 3, "num_tokens_to_generate": 25, "return_log_probs": True},
        {"temperature": 0.0, "num_tokens_to_generate": 40, "stop_strings": ("e", "th")},
        {"temperature": 0.0, "num_tokens_to_generate": 40, "termination_id": 7, "min_tokens": 2},
        {"temperature": 0.7, "top_k": 20, "seed": 11, "num_tokens_to_generate": 35},
        {"temperature": 0.0, "num_tokens_to_generate": 20, "return_log_probs": True},
        {"temperature": 0.0, "num_tokens_to_generate": 33, "stop_strings": ("a",)},
        {"temperature": 1.0, "seed": 5, "num_tokens_to_generate": 12},
    ]
    return [
        RunnerRequest(i, prompt, SamplingParams(**kind))
        for i, (prompt, kind) in enumerate(zip(prompts, kinds, strict=True))
    ]


def outcomes(runner: ModelRunner, **kwargs: Any) -> dict[int, tuple[Any, ...]]:
    runner.eos_token_ids = frozenset()
    requests = mixed_requests()
    result = run(runner, {0: requests[:5], 3: requests[5:]}, **kwargs)
    return {i: _summary(outcome) for i, outcome in result.items()}


def _summary(outcome: Outcome) -> tuple[Any, ...]:
    return outcome.tokens, _LogProbs(outcome.logprobs), outcome.finish


class _LogProbs(tuple[float, ...]):
    """Log-probs that compare equal within ``LOGPROB_TOLERANCE``: an overlapped step can hold a
    row the sequential one does not (a sequence whose stop is only known once the step before
    it is read), and a step's row count picks its linears' kernel (``linear.small_batch_rows``:
    the decode kernel up to 8 rows, oneDNN beyond), whose sums round apart by ~1e-5."""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, tuple)
            and len(self) == len(other)
            and all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(self, other, strict=True))
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


LOGPROB_TOLERANCE = 1e-4


def test_overlap_is_on_only_where_asked(tiny_model_path: Path) -> None:
    assert ModelRunner(str(tiny_model_path), device="cpu").stats()["overlap"] is False
    assert ModelRunner(str(tiny_model_path), device="cpu", overlap=True).stats()["overlap"]


def test_overlapped_steps_give_the_sequential_outputs(tiny_model_path: Path) -> None:
    sequential = ModelRunner(str(tiny_model_path), max_num_seqs=4, overlap=False)
    overlapped = ModelRunner(str(tiny_model_path), max_num_seqs=4, overlap=True)
    expected = outcomes(sequential)
    assert {finish for _, _, finish in expected.values()} == {"length", "stop"}
    assert outcomes(overlapped) == expected
    assert not overlapped.has_work() and overlapped.stats()["running"] == 0


def test_overlap_through_preemption(tiny_model_path: Path) -> None:
    sequential = tiny_pool_runner(tiny_model_path, blocks=40, max_num_seqs=5, overlap=False)
    overlapped = tiny_pool_runner(tiny_model_path, blocks=40, max_num_seqs=5, overlap=True)
    expected = outcomes(sequential)
    assert sequential.stats()["preemptions"] > 0
    assert outcomes(overlapped) == expected
    assert overlapped.stats()["preemptions"] > 0
    assert overlapped.stats()["kv_free_blocks"] == 39  # every block came back


def test_overlap_through_suspend_and_cancel(tiny_model_path: Path) -> None:
    def disturb(runner: ModelRunner) -> Any:
        def on_step(step: int) -> None:
            if step == 6:
                runner.release()
                runner.reload()
            if step == 9:
                runner.cancel(0)  # in flight with overlap: its last token is dropped

        return on_step

    results = []
    for overlap in (False, True):
        runner = ModelRunner(str(tiny_model_path), max_num_seqs=4, overlap=overlap)
        runner.eos_token_ids = frozenset()
        requests = mixed_requests()[1:]
        requests.insert(
            0,
            RunnerRequest(
                0, [9, 8, 7], SamplingParams(temperature=0.0, num_tokens_to_generate=100)
            ),
        )
        outcome = run(runner, {0: requests}, on_step=disturb(runner), max_steps=4000)
        cancelled = outcome.pop(0)
        assert cancelled.finish is None
        results.append(({i: _summary(o) for i, o in outcome.items()}, cancelled.tokens))
    (sequential, sequential_cancelled), (overlapped, overlapped_cancelled) = results
    assert overlapped == sequential
    # Cancelled while its step was in flight: it got at most the sequential engine's tokens.
    assert sequential_cancelled[: len(overlapped_cancelled)] == overlapped_cancelled


def test_the_next_step_is_submitted_before_the_last_one_is_read(tiny_model_path: Path) -> None:
    """With overlap a step returns the tokens of the step before it: the first returns none."""
    for overlap, first_tokens in ((False, 1), (True, 0)):
        runner = ModelRunner(str(tiny_model_path), overlap=overlap)
        runner.add(RunnerRequest(0, [5, 6, 7], SamplingParams(temperature=0.0)))
        first = runner.step()
        assert sum(len(update.tokens) for update in first) == first_tokens


def test_blocks_filled_by_decoding_are_cached_with_overlap(tiny_model_path: Path) -> None:
    """A block whose last token was sampled by the step still in flight is hashed once that
    token is known: a follow-up prompt that repeats the answer finds it, with or without
    overlap (multi-turn chat)."""
    cached = {}
    for overlap in (False, True):
        runner = ModelRunner(str(tiny_model_path), block_size=4, overlap=overlap)
        runner.eos_token_ids = frozenset()
        prompt = random_prompts(1, seed=2, low=9, high=10)[0]
        runner.add(
            RunnerRequest(0, prompt, SamplingParams(temperature=0.0, num_tokens_to_generate=23))
        )
        generated: list[int] = []
        while runner.has_work():
            for update in runner.step():
                generated += update.tokens
        assert len(generated) == 23
        # The last generated token was never fed: its block is the one left out.
        cached[overlap] = runner.stats()["kv_cached_blocks"]
        assert cached[overlap] == (len(prompt) + len(generated) - 1) // 4, overlap
    assert cached[False] == cached[True]
