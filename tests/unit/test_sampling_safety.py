"""Every ``SamplingParams`` that passes validation is numerically safe (issue 9, item 1).

Property tests sweep temperature, top_p, top_k, seed and logprobs over their whole valid range
(tiny, subnormal, boundary and huge values) against logits in fp32 / bf16 / fp16 that include
-inf, +inf, NaN and overflowing values: ``sample`` never raises, every token is in the
vocabulary, a row that has a possible token never gets an impossible one, greedy rows are the
argmax, and logprobs are finite. The same parameters then go through a real ``ModelRunner`` on
the tiny model, including one whose output layer overflows to inf/NaN.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest, TokenUpdate
from dpserve.engine.sample.sampler import sample
from dpserve.sampling import GREEDY_TEMPERATURE, MAX_TEMPERATURE, SamplingParams

VOCAB = 37
SEED_LIMIT = 2**63

temperatures = st.one_of(
    st.sampled_from(
        [
            *(0.0, 5e-324, 1e-300, 1e-50, GREEDY_TEMPERATURE * 0.999, GREEDY_TEMPERATURE, 1e-4),
            *(0.7, 1.0, 1.9999999999999998, MAX_TEMPERATURE),
        ]
    ),
    st.floats(min_value=0.0, max_value=MAX_TEMPERATURE),
)
top_ps = st.one_of(
    st.sampled_from([5e-324, 1e-300, 1e-9, 0.5, 0.999999, 1.0]),
    st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
)
top_ks = st.one_of(
    st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**62]),
    st.integers(min_value=0, max_value=2**70),
)
seeds = st.one_of(st.none(), st.sampled_from([0, SEED_LIMIT - 1]), st.integers(0, SEED_LIMIT - 1))
sampling_params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    seed=seeds,
    return_log_probs=st.booleans(),
    num_tokens_to_generate=st.integers(1, 4),
)

# Row shapes the logits of a real model can take, healthy and pathological.
ROW_KINDS = ["normal", "huge", "one_pos_inf", "some_neg_inf", "all_neg_inf", "nan", "all_nan"]
ROW_KINDS += ["flat", "tiny"]


def make_row(kind: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    row = torch.randn(VOCAB, generator=generator) * 4
    pick = torch.randperm(VOCAB, generator=generator)[: VOCAB // 3]
    if kind == "huge":
        row = row * 1e38  # overflows the formats narrower than fp32's range
    elif kind == "one_pos_inf":
        row[pick[0]] = float("inf")
    elif kind == "some_neg_inf":
        row[pick] = float("-inf")
    elif kind == "all_neg_inf":
        row.fill_(float("-inf"))
    elif kind == "nan":
        row[pick] = float("nan")
    elif kind == "all_nan":
        row.fill_(float("nan"))
    elif kind == "flat":
        row.fill_(3.0)
    elif kind == "tiny":
        row = row * 1e-40  # subnormal in fp32
    return row


def check_output(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> None:
    out = sample(logits, params, positions)
    assert out.tokens.shape == (len(params),) and out.tokens.dtype == torch.int64
    tokens, logprobs = out.tolist()
    assert all(0 <= token < VOCAB for token in tokens)
    as_float = logits.float()
    for row, (token, p) in enumerate(zip(tokens, params, strict=True)):
        possible = ~(as_float[row].isnan() | (as_float[row] == float("-inf")))
        if possible.any():
            assert possible[token], f"row {row} ({p}) chose an impossible token {token}"
        if p.greedy:
            assert token == int(torch.nan_to_num(as_float[row], nan=float("-inf")).argmax())
    if any(p.return_log_probs for p in params):
        assert logprobs is not None and all(
            lp <= 0 and lp == lp and abs(lp) != float("inf") for lp in logprobs
        )
    else:
        assert logprobs is None


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(sampling_params, st.sampled_from(ROW_KINDS), st.integers(0, 2**31)),
        min_size=1,
        max_size=6,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_sample_is_safe_for_every_valid_params_and_logits(
    rows: list[tuple[SamplingParams, str, int]], dtype: torch.dtype
) -> None:
    logits = torch.stack([make_row(kind, seed) for _, kind, seed in rows]).to(dtype)
    params = [p for p, _, _ in rows]
    check_output(logits, params, [seed for _, _, seed in rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax_over_a_large_batch(dtype: torch.dtype) -> None:
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-300, 5e-324, 9e-6)] * 16
    assert torch.equal(sample(logits, params, range(64)).tokens, logits.float().argmax(-1))


# ---------------------------------------------------------------- through a real ModelRunner


def run_to_completion(runner: ModelRunner, requests: list[RunnerRequest]) -> list[TokenUpdate]:
    for request in requests:
        runner.add(request)
    updates: list[TokenUpdate] = []
    for _ in range(200):
        if not runner.has_work():
            return updates
        updates.extend(runner.step())
    raise AssertionError("the runner did not finish its requests")


def check_updates(updates: list[TokenUpdate], requests: list[RunnerRequest], vocab: int) -> None:
    by_id = {request.request_id: request for request in requests}
    finished = set()
    for update in updates:
        assert all(0 <= token < vocab for token in update.tokens)
        if by_id[update.request_id].params.return_log_probs:
            assert update.logprobs is not None and len(update.logprobs) == len(update.tokens)
            assert all(lp <= 0 and abs(lp) != float("inf") for lp in update.logprobs)
        if update.finish_reason is not None:
            finished.add(update.request_id)
    assert finished == set(by_id)


@pytest.fixture(scope="module")
def runner(tiny_model_path: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model_path), device="cpu")


_request_ids = iter(range(10**9))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(params=st.lists(sampling_params, min_size=1, max_size=4))
def test_model_runner_survives_every_valid_params(
    runner: ModelRunner, params: list[SamplingParams]
) -> None:
    requests = [RunnerRequest(next(_request_ids), [5, 6, 7, 8], p) for p in params]
    check_updates(run_to_completion(runner, requests), requests, runner.vocab_size)


@pytest.fixture(scope="module")
def overflowing_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an output layer whose logits overflow to +-inf and NaN."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    weight = model.lm_head.weight.data
    weight[: weight.shape[0] // 2] *= 1e38  # +-inf after the matmul
    weight[-5:] = float("nan")
    directory = tmp_path_factory.mktemp("overflowing-model")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(directory)
    return directory


EXTREME_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1e-50, return_log_probs=True),
    SamplingParams(temperature=5e-324, seed=0),
    SamplingParams(temperature=GREEDY_TEMPERATURE, top_p=1e-300, seed=SEED_LIMIT - 1),
    SamplingParams(temperature=MAX_TEMPERATURE, top_k=2**62, return_log_probs=True),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=10, seed=42, return_log_probs=True),
]


def test_model_runner_survives_non_finite_logits(overflowing_model_path: Path) -> None:
    poisoned = ModelRunner(str(overflowing_model_path), device="cpu")
    requests = [
        RunnerRequest(row, [5, 6, 7, 8 + row], replace(p, num_tokens_to_generate=6))
        for row, p in enumerate(EXTREME_PARAMS)
    ]
    check_updates(run_to_completion(poisoned, requests), requests, poisoned.vocab_size)


def test_seeded_runner_tokens_do_not_depend_on_the_batch(runner: ModelRunner) -> None:
    seeded = SamplingParams(
        temperature=1.5, top_p=0.95, seed=1234, num_tokens_to_generate=12, ignore_eos=True
    )
    others = [
        SamplingParams(temperature=0.9, num_tokens_to_generate=9),
        SamplingParams(temperature=0.0, num_tokens_to_generate=15),
        SamplingParams(temperature=1.2, top_k=20, seed=99, num_tokens_to_generate=5),
    ]

    def tokens_of_seeded(mates: list[SamplingParams]) -> list[int]:
        target = RunnerRequest(next(_request_ids), [10, 11, 12], seeded)
        requests = [RunnerRequest(next(_request_ids), [20, 21, 22, 23], p) for p in mates]
        updates = run_to_completion(runner, [*requests[:1], target, *requests[1:]])
        return [t for u in updates if u.request_id == target.request_id for t in u.tokens]

    alone = tokens_of_seeded([])
    assert len(alone) == 12
    assert tokens_of_seeded(others) == alone
    assert tokens_of_seeded(others[1:]) == alone
