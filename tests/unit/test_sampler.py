"""Next-token selection: greedy, temperature, top-k, top-p, hashed seeds, log-probs.

Distribution checks put thousands of copies of one row in a single batch: ``sample`` does the
whole batch at once, so this is also what a full engine step looks like.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dpserve.engine.sample import sampler
from dpserve.engine.sample.sampler import (
    SampleOutput,
    greedy,
    sample,
)
from dpserve.sampling import SamplingParams

# Four tokens with probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()
DRAWS = 4000


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS) -> dict[int, float]:
    """Token frequencies over DRAWS rows of one batch (seeded rows at DRAWS positions)."""
    torch.manual_seed(0)
    batch = logits.unsqueeze(0).expand(DRAWS, -1)
    tokens = sample(batch, [params] * DRAWS, range(DRAWS)).tokens
    counts = Counter(tokens.tolist())
    return {token: count / DRAWS for token, count in counts.items()}


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9], [0.0, 0.0, 0.5], [2.0, 1.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-6),  # below the greedy threshold
        SamplingParams(temperature=2.0, top_k=1),  # one candidate: greedy at any temperature
        SamplingParams(temperature=0.0, seed=3),
    ]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sample(logits.to(dtype), params, [0, 1, 2, 3])
        assert out.tokens.tolist() == [1, 0, 2, 0]
        assert out.tokens.dtype == torch.long and out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_all_greedy_batch_picks_what_the_fp32_path_picks(dtype: torch.dtype) -> None:
    # An all-greedy batch without log-probs takes the argmax in the logits' own dtype; asking
    # for log-probs takes the fp32 path. Both must choose the same tokens, NaN, infinities and
    # ties included.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=generator).to(dtype)
    logits[:, 7] = logits[:, 11]  # ties: the lowest id wins on both paths
    logits[3] = float("nan")  # all NaN: token 0
    logits[4, 5] = float("nan")
    logits[5, 9] = float("inf")
    logits[6] = float("-inf")
    logits[7, :] = float("nan")
    logits[7, 200] = -5.0  # the one finite value wins over NaN
    logits[8, 10] = float("inf")
    logits[8, 20] = float("inf")  # two +inf: the first
    fast = sample(logits, [SamplingParams(temperature=0.0)] * 64, range(64))
    full = sample(logits, [SamplingParams(temperature=0.0, return_log_probs=True)] * 64, range(64))
    assert fast.logprobs is None and full.logprobs is not None
    assert fast.tokens.tolist() == full.tokens.tolist()
    assert fast.tokens[[3, 5, 6, 7, 8]].tolist() == [0, 9, 0, 200, 10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_greedy_on_cpu_is_torchs_argmax(dtype: torch.dtype) -> None:
    # On CPU greedy() takes numpy's argmax (vectorized): it must pick torch's tokens, for
    # strided views, tensors that require grad and inference tensors alike.
    generator = torch.Generator().manual_seed(1)
    base = torch.randint(-3, 4, (300, 40), generator=generator).to(dtype)  # many ties
    base[5] = float("nan")
    base[6, 3] = float("inf")
    for logits in (base, base.t(), base[:, ::3], base.clone().requires_grad_()):
        expected = torch.nan_to_num(logits.detach(), nan=float("-inf")).argmax(dim=-1)
        assert torch.equal(greedy(logits), expected)
        with torch.inference_mode():
            assert torch.equal(greedy(logits.detach().clone()), expected)
    assert greedy(base[:0]).shape == (0,)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_follows_the_distribution(seeded: bool) -> None:
    seen = frequencies(SamplingParams(temperature=1.0, seed=11 if seeded else None))
    for token, probability in enumerate(PROBS.tolist()):
        assert seen.get(token, 0.0) == pytest.approx(probability, abs=0.03)


def test_top_k_keeps_only_the_k_most_likely() -> None:
    seen = frequencies(SamplingParams(temperature=1.0, top_k=2, seed=5))
    assert set(seen) == {0, 1}
    assert seen[0] == pytest.approx(0.625, abs=0.03)  # renormalised: 0.5 / 0.8


@pytest.mark.parametrize(
    ("top_p", "survivors"),
    # Away from the exact cumulative sums (0.5, 0.8, 0.95), where rounding decides.
    [(1e-9, {0}), (0.45, {0}), (0.6, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, survivors: set[int]) -> None:
    assert set(frequencies(SamplingParams(temperature=1.0, top_p=top_p))) == survivors


def test_top_k_and_top_p_combine() -> None:
    # top_k=3 leaves 0.5/0.3/0.15 (renormalised 0.526/0.316/0.158); top_p=0.8 then drops token 2.
    assert set(frequencies(SamplingParams(temperature=1.0, top_k=3, top_p=0.8))) == {0, 1}


@pytest.mark.parametrize(
    ("min_p", "survivors"),
    # Tokens at 0.5 x (0.6, 0.3, 0.1) of the most likely one; away from those ratios.
    [
        (1.0, {0}),
        (0.7, {0}),
        (0.5, {0, 1}),
        (0.2, {0, 1, 2}),
        (0.05, {0, 1, 2, 3}),
        (0.0, {0, 1, 2, 3}),
    ],
)
def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely(
    min_p: float, survivors: set[int]
) -> None:
    seen = frequencies(SamplingParams(temperature=1.0, min_p=min_p, seed=3))
    assert set(seen) == survivors
    if survivors == {0, 1}:
        assert seen[0] == pytest.approx(0.625, abs=0.03)  # renormalised: 0.5 / 0.8


def test_min_p_applies_after_the_temperature_and_before_top_p() -> None:
    # At T=2 the probabilities flatten (token 3 at ~0.32 of token 0), so min_p 0.28 keeps all
    # four where at T=1 it keeps three (token 2 at 0.3 of token 0).
    assert set(frequencies(SamplingParams(temperature=2.0, min_p=0.28))) == {0, 1, 2, 3}
    assert set(frequencies(SamplingParams(temperature=1.0, min_p=0.28))) == {0, 1, 2}
    # min_p 0.2 keeps 0.5 / 0.3 / 0.15, renormalised 0.526 / 0.316 / 0.158: top_p 0.83 then
    # drops token 2 (0.842 before it). Top-p first would keep it (0.8 before it), as min_p would.
    assert set(frequencies(SamplingParams(temperature=1.0, min_p=0.2, top_p=0.83))) == {0, 1}


def test_min_p_is_per_row_and_leaves_greedy_rows_alone() -> None:
    batch = torch.stack([LOGITS, LOGITS, LOGITS.flip(0)])
    params = [
        SamplingParams(temperature=1.0, min_p=1.0, seed=1),
        SamplingParams(temperature=0.0, min_p=0.5),
        SamplingParams(temperature=1.0, min_p=1.0, seed=2),
    ]
    for position in range(20):
        assert sample(batch, params, [position] * 3).tokens.tolist() == [0, 0, 3]


def test_logit_bias_moves_greedy_and_sampled_rows_but_not_the_reported_logprobs() -> None:
    batch = torch.stack([LOGITS, LOGITS, LOGITS])
    params = [
        SamplingParams(temperature=0.0, logit_bias=((2, 5.0),), return_log_probs=True),
        SamplingParams(temperature=0.0, return_log_probs=True),  # a batch mate without one
        SamplingParams(temperature=1.0, seed=4, logit_bias=((0, -100.0), (1, -100.0))),
    ]
    for position in range(30):
        out = sample(batch, params, [position] * 3)
        tokens = out.tokens.tolist()
        assert tokens[:2] == [2, 0]
        assert tokens[2] in (2, 3)
        assert out.logprobs is not None
        # The model's own log-probs: the bias chose token 2, it did not make it likelier.
        assert out.logprobs[0].item() == pytest.approx(math.log(0.15), abs=1e-5)
    # The bias is applied before the penalties and top-k: top_k 1 keeps the biased token.
    assert sample(
        LOGITS.unsqueeze(0), [SamplingParams(top_k=1, logit_bias=((3, 3.0),))], [0]
    ).tokens.tolist() == [3]


def test_top_k_ties_at_the_boundary_keep_the_lowest_ids() -> None:
    seen = frequencies(SamplingParams(temperature=1.0, top_k=3, seed=2), torch.zeros(10))
    assert set(seen) == {0, 1, 2}


def test_temperature_sharpens_and_flattens() -> None:
    cold = frequencies(SamplingParams(temperature=0.2))
    hot = frequencies(SamplingParams(temperature=2.0))
    assert cold[0] > 0.9  # 0.5 vs 0.3 at T=0.2: ~93% on token 0
    assert hot[3] > 0.09  # flatter at T=2: the 5% token reaches ~12%


def test_a_seeded_row_does_not_depend_on_its_batch_mates() -> None:
    vocab = 50
    target = torch.randn(vocab, generator=torch.Generator().manual_seed(1))
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    mates = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=5, seed=8),
        SamplingParams(temperature=2.0, seed=7),  # same seed, other logits and position
    ]

    def tokens_in(batch_mates: list[SamplingParams], row: int) -> list[int]:
        out = []
        for position in range(30):
            logits = torch.randn(len(batch_mates) + 1, vocab)
            logits[row] = target
            params = [*batch_mates[:row], mine, *batch_mates[row:]]
            positions = [position if i == row else 99 for i in range(len(params))]
            out.append(int(sample(logits, params, positions).tokens[row]))
        return out

    alone = tokens_in([], 0)
    assert tokens_in(mates, 2) == alone
    assert tokens_in(mates[:2], 0) == alone
    assert tokens_in(mates[1:], 3) == alone
    assert len(set(alone)) > 5  # it really sampled


def test_seeds_and_positions_change_the_draw() -> None:
    logits = torch.zeros(20, 1000)  # uniform: 20 agreeing draws would be a broken hash

    def draws(seed: int, first_position: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, seed=seed)] * 20
        return sample(logits, params, range(first_position, first_position + 20)).tokens.tolist()

    assert draws(1, 0) == draws(1, 0)
    assert draws(1, 0) != draws(2, 0)
    assert draws(2**63 - 1, 0) != draws(0, 0)
    # The draw belongs to (seed, position), not to the row that carries it.
    assert draws(1, 0)[1:] == draws(1, 1)[:-1]


def test_hashed_noise_is_exact_integer_arithmetic() -> None:
    # A plain-Python lowbias32 gives the same bits: no int64 overflow anywhere, so every device
    # computes the same noise.
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    key = sampler._row_key(2**63 - 1, 123_456)
    low, high = key & 0xFFFFFFFF, key >> 32
    vocab = 3000
    noise = sampler._hashed_gumbel(torch.tensor([[low, high]]), vocab)[0]
    for column in (0, 1, 2**11, vocab - 1):
        state = mix(mix((column + low) & 0xFFFFFFFF) ^ high)
        uniform = (state + 0.5) * 2.0**-32
        assert float(noise[column]) == pytest.approx(-math.log(-math.log(uniform)), rel=1e-6)
    assert torch.isfinite(noise).all()


def test_logprobs_are_the_raw_log_softmax_of_the_chosen_tokens() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, return_log_probs=True), SamplingParams()]
    out = sample(logits, params, [0, 0])
    assert out.logprobs is not None
    tokens, logprobs = out.tolist()
    assert tokens[0] == 2 and isinstance(tokens[1], int)
    assert logprobs is not None
    assert logprobs[0] == pytest.approx(3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3)))
    assert logprobs[1] == pytest.approx(-math.log(3))  # temperature does not change it


def test_tolist_keeps_large_token_ids_exact() -> None:
    out = SampleOutput(torch.tensor([128_255, 0]), torch.tensor([-0.5, -1e30]))
    assert out.tolist() == ([128_255, 0], [-0.5, pytest.approx(-1e30)])


def test_mismatched_lengths_are_errors() -> None:
    with pytest.raises(ValueError, match="positions"):
        sample(torch.zeros(2, 5), [SamplingParams()] * 2, [0])
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(2, 5), [SamplingParams()], [0])


# -------------------------------------------------- the earlier interface, still used by callers
