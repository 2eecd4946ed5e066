"""ModelRunner on the tiny random Llama: continuous batching must not change any request's
tokens, and every finishing rule, rejection and suspend/resume path must hold."""

from __future__ import annotations

import platform
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from dpserve.cpu_settings import SMALL_BATCH_ROWS_ENV
from dpserve.engine.layers.linear import ONEDNN_MIN_ROWS
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.paged import backend as paged_backend
from dpserve.engine.runner import RequestRejected, RunnerRequest, TokenUpdate
from dpserve.protocol import ErrorCode
from dpserve.sampling import SamplingParams
from tests.tiny_model import VARIANT_KINDS, build_variant_model

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    finished_at_step: int | None = None
    updates: list[TokenUpdate] = field(default_factory=list)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture
def runner(tiny_model_path: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model_path), max_num_seqs=4, device="cpu")


def greedy_reference(model: Any, prompt: list[int], max_new: int) -> tuple[list[int], str]:
    """``model.generate`` alone, greedy: (tokens without the EOS, finish reason)."""
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new,
        )
    tokens = output[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    if eos in tokens:
        return tokens[: tokens.index(eos)], "stop"
    return tokens, "length"


def run(
    runner: ModelRunner,
    schedule: dict[int, list[RunnerRequest]],
    *,
    on_step: Callable[[int], None] | None = None,
    max_steps: int = 2000,
    every_step: bool = False,
) -> dict[int, Outcome]:
    """Add each request at its step, step until everything finished; collect per request
    (with ``every_step`` also what each step produced that it did not report)."""
    outcomes: dict[int, Outcome] = {}
    step = 0
    while step <= max(schedule, default=0) or runner.has_work():
        for request in schedule.get(step, []):
            outcomes[request.request_id] = Outcome()
            runner.add(request)
        if on_step is not None:
            on_step(step)
        for update in runner.step() + (runner.unreported() if every_step else []):
            outcome = outcomes[update.request_id]
            assert outcome.finish is None, "update after the request finished"
            outcome.updates.append(update)
            outcome.tokens += update.tokens
            if update.logprobs is not None:
                assert len(update.logprobs) == len(update.tokens)
                outcome.logprobs += update.logprobs
            if update.finish_reason is not None:
                outcome.finish = update.finish_reason
                outcome.finished_at_step = step
        step += 1
        assert step < max_steps, "runner did not finish"
    return outcomes


def random_prompts(count: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 380) for _ in range(rng.randint(low, high))] for _ in range(count)]


def request(request_id: int, prompt: list[int], **params: Any) -> RunnerRequest:
    return RunnerRequest(request_id, prompt, SamplingParams(**{"temperature": 0.0, **params}))


def test_continuous_batching_matches_generate_token_for_token(
    runner: ModelRunner, reference: Any
) -> None:
    prompts = random_prompts(10, seed=1)
    lengths = [40, 6, 25, 3, 33, 12, 18, 5, 29, 9]
    # Batch of 4, ten requests arriving over several steps: requests join a running batch,
    # wait for a free row, and leave while longer ones continue.
    arrival = [0, 0, 0, 2, 3, 3, 7, 9, 9, 15]
    schedule: dict[int, list[RunnerRequest]] = {}
    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        schedule.setdefault(arrival[i], []).append(
            request(i, prompt, num_tokens_to_generate=length)
        )
    batch_sizes: list[int] = []
    outcomes = run(
        runner, schedule, on_step=lambda _: batch_sizes.append(runner.stats()["running"])
    )

    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        expected, finish = greedy_reference(reference, prompt, length)
        assert outcomes[i].tokens == expected, f"request {i}"
        assert outcomes[i].finish == finish
    assert max(batch_sizes) == 4  # the batch really filled up
    # Short requests added later finished before the long first one: nobody waited for it.
    assert outcomes[1].finished_at_step < outcomes[0].finished_at_step
    assert outcomes[7].finished_at_step < outcomes[0].finished_at_step
    assert runner.stats()["running"] == 0 and not runner.has_work()


def test_eight_concurrent_requests_share_one_batch(tiny_model_path: Path, reference: Any) -> None:
    runner = ModelRunner(str(tiny_model_path), max_num_seqs=8, device="cpu")
    prompts = random_prompts(12, seed=2, low=1, high=90)
    lengths = [random.Random(i).randint(1, 45) for i in range(12)]
    schedule = {
        step: [request(i, prompts[i], num_tokens_to_generate=lengths[i]) for i in ids]
        for step, ids in {0: [0, 1, 2, 3, 4, 5], 1: [6, 7], 4: [8, 9, 10], 11: [11]}.items()
    }
    outcomes = run(runner, schedule)
    for i in range(12):
        expected, finish = greedy_reference(reference, prompts[i], lengths[i])
        assert (outcomes[i].tokens, outcomes[i].finish) == (expected, finish), f"request {i}"


def test_seeded_sampling_reproduces_in_any_batch_mix(runner: ModelRunner) -> None:
    runner.eos_token_ids = frozenset()  # hot sampling reaches EOS early otherwise
    prompt = random_prompts(1, seed=3)[0]
    params = {"temperature": 1.5, "top_p": 0.95, "num_tokens_to_generate": 30}
    alone = run(runner, {0: [request(1, prompt, seed=42, **params)]})[1].tokens

    others = random_prompts(3, seed=4)
    mixed = run(
        runner,
        {
            0: [request(10, others[0], temperature=0.8, num_tokens_to_generate=12)],
            2: [
                request(11, prompt, seed=42, **params),
                request(12, others[1], temperature=1.0, seed=5, num_tokens_to_generate=40),
            ],
            5: [request(13, others[2], num_tokens_to_generate=7)],
        },
    )
    assert mixed[11].tokens == alone
    other_seed = run(runner, {0: [request(2, prompt, seed=43, **params)]})[2].tokens
    assert other_seed != alone
    assert len(alone) == 30


def test_top_k_1_equals_greedy(runner: ModelRunner, reference: Any) -> None:
    prompt = random_prompts(1, seed=5)[0]
    outcome = run(
        runner,
        {0: [request(1, prompt, temperature=2.0, top_k=1, seed=1, num_tokens_to_generate=20)]},
    )[1]
    assert outcome.tokens == greedy_reference(reference, prompt, 20)[0]


def test_sampling_parameters_change_the_output(runner: ModelRunner) -> None:
    prompt = random_prompts(1, seed=6)[0]
    greedy = run(runner, {0: [request(1, prompt, num_tokens_to_generate=25)]})[1].tokens
    hot = run(
        runner, {0: [request(2, prompt, temperature=2.0, seed=3, num_tokens_to_generate=25)]}
    )[2].tokens
    assert hot != greedy
    # A greedy request ignores its seed entirely.
    seeded_greedy = run(runner, {0: [request(3, prompt, seed=9, num_tokens_to_generate=25)]})
    assert seeded_greedy[3].tokens == greedy


def test_termination_id_stops_without_returning_it(runner: ModelRunner, reference: Any) -> None:
    prompt = random_prompts(1, seed=7)[0]
    expected, _ = greedy_reference(reference, prompt, 30)
    stop_at = next(i for i in range(3, 30) if expected[i] not in expected[:i])
    outcome = run(
        runner,
        {0: [request(1, prompt, num_tokens_to_generate=30, termination_id=expected[stop_at])]},
    )[1]
    assert outcome.finish == "stop"
    assert outcome.tokens == expected[:stop_at]


def test_tokens_generated_counts_the_tokens_kept(runner: ModelRunner, reference: Any) -> None:
    # A stop token is not counted (not returned), a length finish's last token is.
    prompts = random_prompts(3, seed=9)
    expected = [greedy_reference(reference, prompt, 12)[0] for prompt in prompts]
    stop_at = [next(i for i in range(3, 12) if e[i] not in e[:i]) for e in expected]
    outcomes = run(
        runner,
        {
            0: [
                request(
                    0, prompts[0], num_tokens_to_generate=12, termination_id=expected[0][stop_at[0]]
                ),
                request(1, prompts[1], num_tokens_to_generate=12),
                request(
                    2, prompts[2], num_tokens_to_generate=12, termination_id=expected[2][stop_at[2]]
                ),
            ]
        },
    )
    assert [outcomes[i].finish for i in range(3)] == ["stop", "length", "stop"]
    assert runner.stats()["tokens_generated"] == sum(len(o.tokens) for o in outcomes.values())
    assert runner.stats()["tokens_generated"] == stop_at[0] + 12 + stop_at[2]


def test_model_eos_stops_generation(runner: ModelRunner, reference: Any) -> None:
    prompt = random_prompts(1, seed=8)[0]
    expected, _ = greedy_reference(reference, prompt, 30)
    stop_at = next(i for i in range(2, 30) if expected[i] not in expected[:i])
    # Pretend the model's EOS is a token it produces: the EOS path, not termination_id.
    runner.eos_token_ids = frozenset({expected[stop_at]})
    outcome = run(runner, {0: [request(1, prompt, num_tokens_to_generate=30)]})[1]
    assert (outcome.tokens, outcome.finish) == (expected[:stop_at], "stop")


def test_max_tokens_finishes_with_length(runner: ModelRunner) -> None:
    prompt = random_prompts(1, seed=9)[0]
    runner.eos_token_ids = frozenset()  # nothing can stop it early
    for wanted in (1, 17):
        outcome = run(runner, {0: [request(wanted, prompt, num_tokens_to_generate=wanted)]})
        assert len(outcome[wanted].tokens) == wanted
        assert outcome[wanted].finish == "length"


def _first_ascii_stop(text: str, start: int) -> tuple[int, str]:
    """A 2-character printable stop string whose first occurrence is at or after ``start``."""
    for i in range(start, len(text) - 2):
        candidate = text[i : i + 2]
        if candidate.isascii() and candidate.isprintable() and text.find(candidate) == i:
            return i, candidate
    raise AssertionError("no usable stop string in the reference text")


def _run_with_a_stop_string(runner: ModelRunner, **params: Any) -> tuple[list[int], str, Any]:
    """A greedy 60-token run without a stop string, then the same prompt stopped by two ASCII
    characters a third of the way into its text: the full tokens, the stop string and the
    stopped run's outcome (``params``: more of the stopped request's sampling parameters)."""
    runner.eos_token_ids = frozenset()
    prompt = random_prompts(1, seed=10)[0]
    full = run(runner, {0: [request(1, prompt, num_tokens_to_generate=60)]})[1].tokens
    text = runner.tokenizer.decode(full, skip_special_tokens=True)
    _, stop = _first_ascii_stop(text, start=len(text) // 3)
    stopped = request(2, prompt, num_tokens_to_generate=60, stop_strings=[stop], **params)
    return full, stop, run(runner, {0: [stopped]})[2]


def test_stop_string_truncates_before_it(runner: ModelRunner) -> None:
    tokenizer = runner.tokenizer
    full, stop, outcome = _run_with_a_stop_string(runner, return_log_probs=True)
    assert outcome.finish == "stop"
    assert outcome.tokens == full[: len(outcome.tokens)]
    assert len(outcome.tokens) < len(full)
    assert stop not in tokenizer.decode(outcome.tokens, skip_special_tokens=True)
    # Cut at the token where the stop string begins: it lies within the next few tokens.
    following = full[: len(outcome.tokens) + len(stop) + 1]
    assert stop in tokenizer.decode(following, skip_special_tokens=True)
    assert len(outcome.logprobs) == len(outcome.tokens)
    # The text the stop string was looked for in is the text sent (decoded once, here).
    sent = "".join(update.text or "" for update in outcome.updates)
    assert sent == tokenizer.decode(outcome.tokens, skip_special_tokens=True)
    assert all(update.text is not None for update in outcome.updates)


def test_include_stop_str_in_output_keeps_the_stop_string(runner: ModelRunner) -> None:
    """The same stop string with ``include_stop_str_in_output``: the tokens run through the one
    it ends in, so the text holds it and ends with it or within that token."""
    tokenizer = runner.tokenizer
    full, stop, outcome = _run_with_a_stop_string(runner, include_stop_str_in_output=True)
    assert outcome.finish == "stop"
    assert outcome.tokens == full[: len(outcome.tokens)]
    kept = tokenizer.decode(outcome.tokens, skip_special_tokens=True)
    assert stop in kept and stop not in tokenizer.decode(outcome.tokens[:-1])
    assert "".join(update.text or "" for update in outcome.updates) == kept


def test_held_back_tokens_are_released_when_no_stop_string_follows(
    runner: ModelRunner,
) -> None:
    runner.eos_token_ids = frozenset()
    prompt = random_prompts(1, seed=11)[0]
    full = run(runner, {0: [request(1, prompt, num_tokens_to_generate=40)]})[1].tokens
    text = runner.tokenizer.decode(full, skip_special_tokens=True)
    _, start = _first_ascii_stop(text, start=len(text) // 2)
    # Begins like text that occurs, so tokens are held back, but never completes.
    never = start + "\x07\x07never"
    outcome = run(
        runner, {0: [request(2, prompt, num_tokens_to_generate=40, stop_strings=[never])]}
    )[2]
    assert (outcome.tokens, outcome.finish) == (full, "length")
    # Some tokens really were held back (then returned together), not streamed one by one.
    assert any(len(update.tokens) > 1 for update in outcome.updates)


@pytest.mark.parametrize("backend", ["paged", "transformers"])
def test_release_and_reload_continue_requests(
    tiny_model_path: Path, reference: Any, backend: str
) -> None:
    runner = ModelRunner(str(tiny_model_path), max_num_seqs=2, device="cpu", backend=backend)
    prompts = random_prompts(3, seed=12)
    lengths = [30, 12, 20]
    schedule = {0: [request(i, prompts[i], num_tokens_to_generate=lengths[i]) for i in range(3)]}

    def suspend_mid_run(step: int) -> None:
        if step == 5:
            assert runner.stats()["running"] == 2 and runner.stats()["waiting"] == 1
            runner.release()
            assert runner.model is None
            assert runner.has_work()
            assert runner.step() == []  # released: nothing runs
            assert runner.stats()["waiting"] == 3
            runner.reload()

    outcomes = run(runner, schedule, on_step=suspend_mid_run)
    for i in range(3):
        expected, finish = greedy_reference(reference, prompts[i], lengths[i])
        assert (outcomes[i].tokens, outcomes[i].finish) == (expected, finish), f"request {i}"


def test_prompt_too_long_is_rejected(runner: ModelRunner) -> None:
    context = runner.context_size
    with pytest.raises(RequestRejected) as rejected:
        runner.add(request(1, [5] * context))
    assert rejected.value.code == ErrorCode.PROMPT_TOO_LONG
    assert str(context) in rejected.value.message
    with pytest.raises(RequestRejected) as with_resume:
        runner.add(RunnerRequest(2, [5] * (context - 3), GREEDY, resume_tokens=[6, 6, 6]))
    assert with_resume.value.code == ErrorCode.PROMPT_TOO_LONG
    assert not runner.has_work()


def test_output_is_clamped_to_the_context(runner: ModelRunner) -> None:
    runner.eos_token_ids = frozenset()
    prompt = random_prompts(1, seed=13, low=1, high=1)[0] * (runner.context_size - 3)
    outcome = run(runner, {0: [request(1, prompt, num_tokens_to_generate=50)]})[1]
    assert len(outcome.tokens) == 3
    assert outcome.finish == "length"


def test_max_num_batched_tokens_bounds_every_step(tiny_model_path: Path, reference: Any) -> None:
    runner = ModelRunner(str(tiny_model_path), max_num_seqs=8, max_num_batched_tokens=64)
    prompts = random_prompts(4, seed=17, low=100, high=150)
    schedule = {0: [request(i, prompts[i], num_tokens_to_generate=6) for i in range(4)]}
    prefill_per_step: list[int] = []
    last = [0]

    def record(_: int) -> None:
        total = runner.stats()["prefill_tokens"]
        prefill_per_step.append(total - last[0])
        last[0] = total

    outcomes = run(runner, schedule, on_step=record)
    # Prompts longer than the budget are accepted and prefilled in chunks of at most 64 tokens.
    record(0)
    assert max(prefill_per_step) <= 64
    assert sum(prefill_per_step) == sum(len(p) for p in prompts)
    for i in range(4):
        assert outcomes[i].tokens == greedy_reference(reference, prompts[i], 6)[0], f"request {i}"


def test_bad_token_ids_and_empty_prompts_are_rejected(runner: ModelRunner) -> None:
    for prompt in ([], [1, runner.vocab_size], [-1]):
        with pytest.raises(RequestRejected) as rejected:
            runner.add(request(1, prompt))
        assert rejected.value.code == ErrorCode.BAD_REQUEST


def test_resume_tokens_continue_the_output(runner: ModelRunner, reference: Any) -> None:
    prompt = random_prompts(1, seed=14)[0]
    expected, _ = greedy_reference(reference, prompt, 24)
    assert len(expected) == 24
    resumed = RunnerRequest(
        1,
        prompt,
        SamplingParams(temperature=0.0, num_tokens_to_generate=24),
        resume_tokens=expected[:9],
    )
    outcome = run(runner, {0: [resumed]})[1]
    assert (outcome.tokens, outcome.finish) == (expected[9:], "length")

    done = RunnerRequest(
        2,
        prompt,
        SamplingParams(temperature=0.0, num_tokens_to_generate=5),
        resume_tokens=expected[:5],
    )
    finished = run(runner, {0: [done]})[2]
    assert (finished.tokens, finished.finish) == ([], "length")


def test_logprobs_one_per_token_and_match_the_model(runner: ModelRunner, reference: Any) -> None:
    prompt = random_prompts(1, seed=15)[0]
    outcome = run(
        runner,
        {
            0: [
                request(1, prompt, num_tokens_to_generate=10, return_log_probs=True),
                request(2, prompt, num_tokens_to_generate=10),
            ]
        },
    )
    assert len(outcome[1].logprobs) == len(outcome[1].tokens) == 10
    assert all(lp <= 0 for lp in outcome[1].logprobs)
    assert all(update.logprobs is None for update in outcome[2].updates)
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt])).logits[0, -1]
    expected_first = torch.log_softmax(logits, -1)[outcome[1].tokens[0]].item()
    assert outcome[1].logprobs[0] == pytest.approx(expected_first, abs=1e-4)


def test_cancel_drops_running_and_waiting_requests(runner: ModelRunner, reference: Any) -> None:
    prompts = random_prompts(6, seed=16)
    for i in range(6):
        runner.add(request(i, prompts[i], num_tokens_to_generate=20))
    first = runner.step()  # rows 0-3 run, 4 and 5 wait (capacity 4)
    assert {u.request_id for u in first} == {0, 1, 2, 3}
    runner.cancel(1)  # running
    runner.cancel(5)  # waiting
    runner.cancel(999)  # unknown: ignored
    tokens: dict[int, list[int]] = {u.request_id: list(u.tokens) for u in first}
    while runner.has_work():
        for update in runner.step():
            assert update.request_id not in (1, 5)
            tokens.setdefault(update.request_id, []).extend(update.tokens)
    assert set(tokens) == {0, 1, 2, 3, 4}
    for i in (0, 2, 3, 4):
        assert tokens[i] == greedy_reference(reference, prompts[i], 20)[0]
    assert runner.stats()["tokens_generated"] >= 4 * 20


def test_runner_attributes(runner: ModelRunner) -> None:
    assert runner.max_num_seqs == 4
    assert runner.eos_token_id == runner.tokenizer.eos_token_id
    assert runner.tokenizer.decode(runner.tokenizer.encode("Hello world")) == "Hello world"
    stats = runner.stats()
    assert {"waiting", "running", "tokens_generated"} <= set(stats)


# ------------------------------------------------------------- paged cache and scheduling


# With either setting of the small-batch rows (the probe's choice differs between CPUs, and a
# pod under a memory limit takes 0): a step of prompt chunks that need no logits yet sends no
# rows to the vocabulary projection, which once failed where no dense weight was kept.
@pytest.mark.parametrize("small_batch_rows", ["0", "3"])
def test_chunked_prefill_across_chunk_and_block_boundaries_matches_generate(
    tiny_model_path: Path, reference: Any, small_batch_rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, small_batch_rows)
    # 4-token blocks and 7-token steps: chunks start and end inside blocks, prompts span many
    # steps, and decodes share steps with other requests' chunks.
    runner = ModelRunner(
        str(tiny_model_path), max_num_seqs=6, max_num_batched_tokens=7, block_size=4
    )
    prompts = random_prompts(6, seed=20, low=1, high=70)
    lengths = [9, 14, 3, 20, 11, 6]
    schedule = {
        0: [request(i, prompts[i], num_tokens_to_generate=lengths[i]) for i in (0, 1, 2)],
        3: [request(i, prompts[i], num_tokens_to_generate=lengths[i]) for i in (3, 4, 5)],
    }
    outcomes = run(runner, schedule)
    for i in range(6):
        expected, finish = greedy_reference(reference, prompts[i], lengths[i])
        assert (outcomes[i].tokens, outcomes[i].finish) == (expected, finish), f"request {i}"
    assert runner.stats()["kv_free_blocks"] == runner.stats()["kv_blocks"] - 1


def test_decoding_goes_on_every_step_during_a_burst_of_long_prompts(
    tiny_model_path: Path,
) -> None:
    runner = ModelRunner(str(tiny_model_path), max_num_batched_tokens=24)
    runner.eos_token_ids = frozenset()
    long_prompts = random_prompts(5, seed=27, low=180, high=200)
    schedule = {
        0: [request(0, [7, 8, 9], num_tokens_to_generate=30)],
        2: [request(i, long_prompts[i - 1], num_tokens_to_generate=3) for i in range(1, 6)],
    }
    outcomes = run(runner, schedule, every_step=True)
    # ~950 prompt tokens arrive at step 2 and are prefilled 23 at a time beside request 0,
    # which still gets a token in every step: one per step, finishing at step 29.
    assert [len(update.tokens) for update in outcomes[0].updates] == [1] * 30
    assert outcomes[0].finished_at_step == 29
    assert max(outcomes[i].finished_at_step for i in range(1, 6)) > 29  # still prefilling
    assert runner.stats()["prefill_tokens"] == 3 + sum(map(len, long_prompts))


def test_a_request_reports_its_first_tokens_and_its_end_and_the_rest_when_taken(
    runner: ModelRunner, reference: Any
) -> None:
    prompt = random_prompts(1, seed=31)[0]
    taken: list[list[int]] = []

    def take_unreported(step: int) -> None:
        if step == 6:  # as an engine that hands its requests over
            taken.extend(update.tokens for update in runner.unreported())

    outcomes = run(
        runner, {0: [request(0, prompt, num_tokens_to_generate=12)]}, on_step=take_unreported
    )
    expected, finish = greedy_reference(reference, prompt, 12)
    assert (outcomes[0].tokens[:1], outcomes[0].finish) == (expected[:1], finish)
    # The first token (the prefill's), the five since it taken at step 6, then the rest.
    assert [len(update.tokens) for update in outcomes[0].updates] == [1, 6]
    assert [len(tokens) for tokens in taken] == [5]
    assert outcomes[0].tokens[:1] + taken[0] + outcomes[0].tokens[1:] == expected
    assert runner.unreported() == []


def logprob_requests(count: int, seed: int) -> dict[int, list[RunnerRequest]]:
    """``count`` random prompts at step 0, 20 greedy tokens each with their log-probs."""
    prompts = random_prompts(count, seed=seed)
    return {
        0: [request(i, prompt, num_tokens_to_generate=20, return_log_probs=True)
            for i, prompt in enumerate(prompts)]
    }  # fmt: skip


def assert_same_tokens_and_logprobs(ours: Any, theirs: Any, count: int) -> None:
    for i in range(count):
        assert ours[i].tokens == theirs[i].tokens
        torch.testing.assert_close(ours[i].logprobs, theirs[i].logprobs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_decode_steps_padded_to_onednns_rows_give_the_same_tokens_and_logprobs(
    tiny_model_path: Path, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, "0")  # oneDNN at every row count: padding's case
    schedule = logprob_requests(count, seed=40 + count)
    outcomes = {}
    for padded in (False, True):
        runner = ModelRunner(str(tiny_model_path), max_num_seqs=4, device="cpu")
        backend: Any = runner.backend
        if padded and backend._min_decode_rows <= count:
            pytest.skip("this torch build has no oneDNN linears: no padding")
        backend._min_decode_rows = ONEDNN_MIN_ROWS if padded else 0
        outcomes[padded] = run(runner, schedule)
    assert_same_tokens_and_logprobs(outcomes[True], outcomes[False], count)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_small_decode_steps_through_the_dense_weights_give_the_same_tokens_and_logprobs(
    tiny_model_path: Path, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``linear.small_batch_rows``: decode steps of at most that many sequences run unpadded
    through torch's dense matmul instead of oneDNN padded to 4 rows; same tokens either way."""
    schedule = logprob_requests(count, seed=50 + count)
    outcomes = {}
    for rows in ("3", "0"):
        monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, rows)
        runner = ModelRunner(str(tiny_model_path), max_num_seqs=4, device="cpu")
        backend: Any = runner.backend
        if not backend.model.lm_head.onednn:
            pytest.skip("this torch build has no oneDNN linears: one path only")
        assert runner.stats()["small_batch_rows"] == int(rows)
        assert (backend.model.lm_head.dense is not None) == (rows == "3")
        padded: list[int] = []
        monkeypatch.setattr(
            paged_backend, "pad_decodes", _recording(paged_backend.pad_decodes, padded)
        )
        outcomes[rows] = run(runner, schedule)
        assert bool(padded) == (rows == "0")  # the dense path takes 1-3 rows as they are
    assert_same_tokens_and_logprobs(outcomes["3"], outcomes["0"], count)


def _recording(function: Any, calls: list[int]) -> Any:
    def recorded(*args: Any) -> Any:
        calls.append(1)
        return function(*args)

    return recorded


def tiny_pool_runner(tiny_model_path: Path, blocks: int, **kwargs: Any) -> ModelRunner:
    """A runner whose KV pool has ``blocks`` 4-token blocks (block 0 included)."""
    probe = ModelRunner(str(tiny_model_path), max_num_seqs=1, block_size=4, kv_cache_bytes=1 << 20)
    block_bytes = probe.stats()["kv_bytes"] // probe.stats()["kv_blocks"]
    return ModelRunner(
        str(tiny_model_path), block_size=4, kv_cache_bytes=blocks * block_bytes, **kwargs
    )


def test_preemption_and_recompute_give_the_same_tokens(
    tiny_model_path: Path, reference: Any
) -> None:
    def five_requests() -> list[RunnerRequest]:
        sampled = {"temperature": 1.2, "top_p": 0.9, "seed": 77, "num_tokens_to_generate": 40}
        greedy = [request(i, prompts[i], num_tokens_to_generate=40) for i in range(4)]
        return [*greedy, request(4, prompts[4], return_log_probs=True, **sampled)]

    prompts = random_prompts(5, seed=21, low=15, high=30)
    tight = tiny_pool_runner(tiny_model_path, blocks=31, max_num_seqs=4)  # 120 tokens
    assert tight.context_size == 120  # a sequence is capped at what the pool holds
    roomy = ModelRunner(str(tiny_model_path), max_num_seqs=4)
    for runner in (tight, roomy):
        runner.eos_token_ids = frozenset()  # every request runs its 40 tokens
    interrupted = run(tight, {0: five_requests()})
    uninterrupted = run(roomy, {0: five_requests()})
    assert tight.stats()["preemptions"] > 0  # four 55-70 token sequences in 120 tokens
    assert roomy.stats()["preemptions"] == 0
    assert tight.stats()["kv_free_blocks"] == 30  # every block came back
    for i in range(5):
        assert interrupted[i].tokens == uninterrupted[i].tokens, f"request {i}"
        assert len(interrupted[i].tokens) == 40
    # Seeded sampling draws the same tokens after a recompute; greedy ones equal generate's.
    assert interrupted[4].logprobs == pytest.approx(uninterrupted[4].logprobs, abs=1e-4)
    for i in range(4):
        expected, _ = greedy_reference(reference, prompts[i], 40)
        assert interrupted[i].tokens[: len(expected)] == expected, f"request {i}"


def test_capacity_and_pool_are_reported(tiny_model_path: Path) -> None:
    runner = tiny_pool_runner(tiny_model_path, blocks=65)  # 256 tokens, the model's context
    stats = runner.stats()
    assert stats["backend"] == "paged"
    assert (stats["kv_blocks"], stats["kv_block_size"], stats["kv_tokens"]) == (65, 4, 256)
    assert stats["kv_bytes"] > 0
    # No --max-num-seqs: as many sequences as the pool holds at a typical length.
    assert runner.max_num_seqs == stats["max_num_seqs"] == 1
    default = ModelRunner(str(tiny_model_path)).stats()
    assert default["max_num_seqs"] >= 32  # the fixed 8 rows are gone


# ------------------------------------------------------------------- sampling parameters


@pytest.mark.parametrize("temperature", [5e-324, 1e-50, 9.9e-6])
def test_tiny_temperatures_decode_greedily(
    runner: ModelRunner, reference: Any, temperature: float
) -> None:
    prompt = random_prompts(1, seed=22)[0]
    outcome = run(
        runner,
        {0: [request(1, prompt, temperature=temperature, seed=3, num_tokens_to_generate=15)]},
    )[1]
    assert outcome.tokens == greedy_reference(reference, prompt, 15)[0]


def test_ignore_eos_and_min_tokens(runner: ModelRunner, reference: Any) -> None:
    prompt = random_prompts(1, seed=23)[0]
    expected, _ = greedy_reference(reference, prompt, 30)
    stop_at = next(i for i in range(2, 20) if expected[i] not in expected[:i])
    runner.eos_token_ids = frozenset({expected[stop_at]})
    outcomes = run(
        runner,
        {
            0: [
                request(1, prompt, num_tokens_to_generate=30),
                request(2, prompt, num_tokens_to_generate=30, ignore_eos=True),
                request(3, prompt, num_tokens_to_generate=30, min_tokens=stop_at + 2),
            ]
        },
    )
    assert (outcomes[1].tokens, outcomes[1].finish) == (expected[:stop_at], "stop")
    # ignore_eos: the EOS token is an ordinary token, returned, and generation goes on.
    assert (outcomes[2].tokens, outcomes[2].finish) == (expected, "length")
    # min_tokens: the early EOS is returned; a later one (if any) stops the request.
    tokens = outcomes[3].tokens
    assert tokens == expected[: len(tokens)] and len(tokens) > stop_at
    later = [i for i in range(stop_at + 2, 30) if expected[i] == expected[stop_at]]
    assert len(tokens) == (later[0] if later else 30)


# ---------------------------------------------------------------- the transformers fallback


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    directory = tmp_path_factory.mktemp("tiny-gpt2")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(5)
    GPT2LMHeadModel(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_other_architectures_fall_back_to_transformers(gpt2_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(str(gpt2_path), device="cpu")
    assert runner.stats()["backend"] == "transformers"
    assert runner.max_num_seqs == 8
    model = AutoModelForCausalLM.from_pretrained(gpt2_path, dtype=torch.float32).eval()
    prompts = random_prompts(3, seed=24)
    outcomes = run(
        runner, {0: [request(i, prompts[i], num_tokens_to_generate=12) for i in range(3)]}
    )
    for i in range(3):
        assert outcomes[i].tokens == greedy_reference(model, prompts[i], 12)[0], f"request {i}"
    with pytest.raises(ValueError, match="gpt2"):
        ModelRunner(str(gpt2_path), backend="paged")


def test_transformers_path_still_serves_llama_exactly(
    tiny_model_path: Path, reference: Any
) -> None:
    runner = ModelRunner(str(tiny_model_path), backend="transformers", max_num_seqs=3)
    assert runner.stats()["backend"] == "transformers"
    prompts = random_prompts(4, seed=25)
    outcomes = run(
        runner, {0: [request(i, prompts[i], num_tokens_to_generate=10) for i in range(4)]}
    )
    for i in range(4):
        assert outcomes[i].tokens == greedy_reference(reference, prompts[i], 10)[0], f"request {i}"
    # Only the paged backend computes logits at prompt positions: the fallback refuses such a
    # request up front rather than answering without them.
    assert not runner.backend.computes_prompt_logprobs
    with pytest.raises(RequestRejected) as rejected:
        runner.add(request(9, prompts[0], num_tokens_to_generate=2, prompt_logprobs=True))
    assert rejected.value.code == ErrorCode.BAD_REQUEST
    assert "paged Llama backend" in rejected.value.message
    assert not runner.has_work()


# ---------------------------------------------------------------- Llama-family variants


VARIANTS = list(VARIANT_KINDS)
# The class of models/ that each variant's model_type is registered to (models.registry).
MODEL_CLASS = {"qwen3": "PagedQwen3", "qwen3-moe": "PagedQwen3Moe", "mixtral": "PagedMixtral"}


@pytest.mark.parametrize("kind", VARIANTS)
def test_llama_family_variants_match_generate(
    kind: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    build_variant_model(kind, tiny_model_path, tmp_path)
    runner = ModelRunner(str(tmp_path), max_num_batched_tokens=40, block_size=8)
    assert runner.stats()["backend"] == "paged"
    assert runner.stats()["model_class"] == MODEL_CLASS.get(kind, "PagedLlama")
    prompts = random_prompts(4, seed=26, low=20, high=120)
    requests = [request(i, prompts[i], num_tokens_to_generate=25) for i in range(4)]
    outcomes = run(runner, {0: requests})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for i in range(4):
        expected, finish = greedy_reference(reference, prompts[i], 25)
        assert (outcomes[i].tokens, outcomes[i].finish) == (expected, finish), f"request {i}"


@pytest.mark.parametrize("kind", VARIANTS)
def test_llama_family_variants_match_generate_through_preemption_and_prefix_hits(
    kind: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Chunked prefill (40-token steps), a pool too small for the four first requests at once
    (preemption and recompute), and later requests that share their prompts' first blocks
    (prefix-cache hits): greedy tokens equal generate's, log-probs the model's within 1e-4."""
    from transformers import AutoModelForCausalLM

    build_variant_model(kind, tiny_model_path, tmp_path)
    probe = ModelRunner(str(tmp_path), max_num_seqs=1, block_size=8, kv_cache_bytes=1 << 20)
    block_bytes = probe.stats()["kv_bytes"] // probe.stats()["kv_blocks"]
    runner = ModelRunner(
        str(tmp_path),
        max_num_seqs=4,
        max_num_batched_tokens=40,
        block_size=8,
        kv_cache_bytes=13 * block_bytes,  # 96 tokens for four 58-77 token sequences
    )
    runner.eos_token_ids = frozenset()  # every request runs its tokens
    shared = random_prompts(1, seed=27, low=32, high=32)[0]
    tails = random_prompts(6, seed=28, low=1, high=20)
    prompts = [shared + tail for tail in tails]
    requests = [
        request(i, prompts[i], num_tokens_to_generate=25, return_log_probs=True) for i in range(6)
    ]
    outcomes = run(runner, {0: requests[:4], 60: requests[4:]})
    stats = runner.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for i in range(6):
        tokens = outcomes[i].tokens
        with torch.inference_mode():
            output = reference.generate(
                torch.tensor([prompts[i]]),
                attention_mask=torch.ones(1, len(prompts[i]), dtype=torch.long),
                do_sample=False,
                max_new_tokens=25,
                eos_token_id=None,
            )
            assert tokens == output[0, len(prompts[i]) :].tolist(), f"request {i}"
            logits = reference(torch.tensor([prompts[i] + tokens[:-1]])).logits[0]
        expected = torch.log_softmax(logits[len(prompts[i]) - 1 :].float(), -1)
        expected_logprobs = expected.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        assert outcomes[i].logprobs == pytest.approx(expected_logprobs.tolist(), abs=1e-4)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_the_paged_model_keeps_no_view_of_the_weights_file(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Once converted, nothing holds the safetensors file's memory map (a view of it kept the
    whole file resident: ``layers.linear.resident``). A copy of the model, so that no other
    test's loaded model maps the same path."""
    import gc
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path, model_dir)
    weights = sorted(str(path) for path in model_dir.glob("*.safetensors"))
    assert weights
    runner = ModelRunner(str(model_dir), device="cpu", backend="paged")
    gc.collect()
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if any(line.endswith(path) for path in weights)]  # fmt: skip
    assert not mapped, mapped
    runner.add(RunnerRequest(0, [5, 6, 7], SamplingParams(temperature=0.0)))
    assert runner.step() is not None  # still computes from its own copies


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_heap_a_load_freed_goes_back_to_the_system() -> None:
    """What a load converts or packs is freed in the middle of the C heap, where glibc keeps it
    (RSS) until asked: ``_return_freed_heap`` asks. Many small tensors (heap, not mmap), all
    freed but the last, which keeps the heap's top from being trimmed on its own."""
    from dpserve.engine.model_runner import _return_freed_heap

    def resident_mb() -> float:
        status = Path("/proc/self/status").read_text()
        return (
            int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
            / 1024
        )

    held = [torch.ones(16 << 10) for _ in range(2048)]  # 64 KB each: 128 MB
    last = held[-1]
    del held
    before = resident_mb()
    _return_freed_heap()
    assert before - resident_mb() > 64, "at least half of the 128 MB freed went back"
    assert last.sum().item() == 16 << 10
