"""The fake engine finishes requests by the model runner's rules (``Sequence.accept``)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dpserve.engine.fake import FakeRunner, fake_token
from dpserve.engine.runner import RequestRejected, RunnerRequest
from dpserve.sampling import SamplingParams


def run_to_end(
    runner: FakeRunner, request: RunnerRequest, every_step: bool = False
) -> tuple[list[int], str]:
    """The tokens reported, to the end; with ``every_step`` taken after each step too (as an
    engine streaming them does): what was reported is never taken back, so the tokens are the
    same either way."""
    runner.add(request)
    tokens: list[int] = []
    while runner.has_work():
        for update in runner.step() + (runner.unreported() if every_step else []):
            tokens += update.tokens
            if update.finish_reason is not None:
                return tokens, update.finish_reason
    raise AssertionError("the runner finished without a finish reason")


def reference(request: RunnerRequest, context_size: int) -> tuple[list[int], str]:
    """Token-by-token generation as the model runner does it: sample, check the termination
    token, append, check stop strings once past min_tokens (the first to complete wins; one
    that straddles the resume tokens ends the output where they end), check the length."""
    params = request.params
    prompt = request.prompt_tokens
    start = len(request.resume_tokens)
    limit = min(params.num_tokens_to_generate, context_size - len(prompt))
    tokens = list(request.resume_tokens)
    while len(tokens) < limit:
        token = fake_token(prompt, params.seed, len(tokens))
        if (
            token == params.termination_id
            and not params.ignore_eos
            and len(tokens) >= params.min_tokens
        ):
            return tokens[start:], "stop"
        tokens.append(token)
        if len(tokens) > params.min_tokens:
            text = bytes(tokens).decode("latin-1")
            ends_here = [
                len(text) - len(stop) for stop in params.stop_strings if text.endswith(stop)
            ]
            if ends_here:
                return tokens[start : max(start, min(ends_here))], "stop"
    return tokens[start:], "length"


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=6),
    seed=st.none() | st.integers(0, 2**20),
    num_tokens=st.integers(1, 80),
    resume=st.integers(0, 30),
    termination=st.none() | st.integers(ord("a"), ord("z")),
    ignore_eos=st.booleans(),
    min_fraction=st.floats(0, 1),
    stops=st.lists(st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=4), max_size=3),
    context_size=st.integers(8, 100),
    every_step=st.booleans(),
)
# A stop string that straddles the resume tokens ("wdkryfm" + "t" for "mt"): found by
# hypothesis, missed until a resumed request's stop text started with its resume tokens' text.
@example(
    prompt=[0, 229],
    seed=3,
    num_tokens=8,
    resume=7,
    termination=None,
    ignore_eos=False,
    min_fraction=0.0,
    stops=["mt"],
    context_size=10,
    every_step=False,
)
# A stop string that begins before min_tokens is reached and ends after it ("c" + "j"):
# found by hypothesis; its beginning went out before the stop string was found.
@example(
    prompt=[0],
    seed=None,
    num_tokens=18,
    resume=0,
    termination=None,
    ignore_eos=False,
    min_fraction=0.9375,
    stops=["cj"],
    context_size=18,
    every_step=True,
)
def test_fake_finishes_like_token_by_token_generation(
    prompt,
    seed,
    num_tokens,
    resume,
    termination,
    ignore_eos,
    min_fraction,
    stops,
    context_size,
    every_step,
):
    if len(prompt) + resume >= context_size:
        return  # rejected: covered below
    params = SamplingParams(
        num_tokens_to_generate=num_tokens,
        seed=seed,
        termination_id=termination,
        ignore_eos=ignore_eos,
        min_tokens=int(min_fraction * num_tokens),
        stop_strings=tuple(stops),
    )
    # Resume tokens are what an earlier engine emitted: the reference's own prefix.
    unconstrained = SamplingParams(num_tokens_to_generate=num_tokens, seed=seed)
    earlier, _ = reference(RunnerRequest(0, prompt, unconstrained), context_size)
    request = RunnerRequest(1, prompt, params, earlier[:resume])
    expected = reference(request, context_size)
    assert run_to_end(FakeRunner(max_context=context_size), request, every_step) == expected


def test_context_size_ends_a_request_with_length():
    runner = FakeRunner(max_context=32)
    params = SamplingParams(num_tokens_to_generate=10**12)
    tokens, reason = run_to_end(runner, RunnerRequest(0, [1, 2, 3], params))
    assert (len(tokens), reason) == (32 - 3, "length")


def test_huge_max_tokens_allocates_nothing_up_front():
    runner = FakeRunner(max_context=10**13)
    tracemalloc.start()
    try:
        runner.add(RunnerRequest(0, [5], SamplingParams(num_tokens_to_generate=10**12)))
        for _ in range(100):
            runner.step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes traced for 100 tokens of a 10**12-token request"
    assert runner.stats() == {"waiting": 0, "running": 1}


def test_prompt_that_fills_the_context_is_rejected():
    runner = FakeRunner(max_context=4)
    with pytest.raises(RequestRejected, match="context of 4 tokens") as rejected:
        runner.add(RunnerRequest(0, [1, 2, 3, 4], SamplingParams()))
    assert rejected.value.code == "prompt_too_long"


def test_a_fake_engine_process_starts_without_torch() -> None:
    """What `dpserve engine --fake` imports holds no torch (seconds of start on a busy
    machine): tests and benches start many fake engines, and the coordinator's queue timeout
    must not run out while one registers."""
    probe = (
        "import sys; import dpserve.cli.engine, dpserve.engine.server, dpserve.engine.fake; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0, (
        "the fake engine's process imports torch"
    )
