"""Next-token selection: greedy, temperature, top-k, top-p, seeded generators, log-probs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dpserve.engine.sampler import make_generator, sample_next_tokens, token_logprobs
from dpserve.sampling import SamplingParams

# Four tokens with probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draw(
    params: SamplingParams, times: int, seed: int = 0, logits: torch.Tensor = LOGITS
) -> Counter:
    generator = make_generator(seed, "cpu")
    counts: Counter = Counter()
    for _ in range(times):
        token = sample_next_tokens(logits.unsqueeze(0), [params], [generator])
        counts[int(token[0])] += 1
    return counts


def test_greedy_takes_the_argmax_per_row() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9], [0.0, 0.0, 0.5]])
    params = [SamplingParams(temperature=0.0)] * 3
    tokens = sample_next_tokens(logits, params, [None, None, None])
    assert tokens.tolist() == [1, 0, 2]
    assert tokens.dtype == torch.long


def test_top_k_1_is_greedy_even_at_high_temperature() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=5.0, top_k=1, seed=i) for i in range(6)]
    generators = [make_generator(i, "cpu") for i in range(6)]
    assert sample_next_tokens(logits, params, generators).tolist() == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution() -> None:
    counts = draw(SamplingParams(temperature=1.0), 4000)
    for token, probability in enumerate(PROBS.tolist()):
        assert counts[token] / 4000 == pytest.approx(probability, abs=0.03)


def test_top_k_keeps_only_the_k_most_likely() -> None:
    counts = draw(SamplingParams(temperature=1.0, top_k=2), 2000)
    assert set(counts) == {0, 1}
    # Renormalised over the two survivors: 0.5 / 0.8 and 0.3 / 0.8.
    assert counts[0] / 2000 == pytest.approx(0.625, abs=0.04)


@pytest.mark.parametrize(
    ("top_p", "survivors"),
    # Away from the exact cumulative sums (0.5, 0.8, 0.95), where rounding decides.
    [(0.45, {0}), (0.6, {0, 1}), (0.79, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, survivors: set[int]) -> None:
    counts = draw(SamplingParams(temperature=1.0, top_p=top_p), 1500)
    assert set(counts) == survivors


def test_top_k_and_top_p_combine() -> None:
    # top_k=3 leaves 0.5/0.3/0.15 (renormalised 0.526/0.316/0.158); top_p=0.8 then drops token 2.
    counts = draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.8), 1500)
    assert set(counts) == {0, 1}


def test_temperature_sharpens_and_flattens() -> None:
    cold = draw(SamplingParams(temperature=0.2), 1000)
    hot = draw(SamplingParams(temperature=5.0), 1000)
    assert cold[0] > 900  # 0.5 vs 0.3 at T=0.2: ~93% on token 0
    assert hot[3] > 120  # nearly uniform at T=5: the 5% token reaches ~18%


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    vocab = 40
    target = torch.randn(vocab, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)

    def tokens_for(batch_mates: int, position: int) -> list[int]:
        generator = make_generator(7, "cpu")
        others = [SamplingParams(temperature=1.3, top_p=0.9)] * batch_mates
        out = []
        for step in range(25):
            noise = torch.randn(
                batch_mates + 1, vocab, generator=torch.Generator().manual_seed(step)
            )
            logits = noise.clone()
            logits[position] = target
            row_params = [*others[:position], params, *others[position:]]
            generators: list[torch.Generator | None] = [None] * (batch_mates + 1)
            generators[position] = generator
            out.append(int(sample_next_tokens(logits, row_params, generators)[position]))
        return out

    alone = tokens_for(0, 0)
    assert tokens_for(3, 2) == alone
    assert tokens_for(5, 0) == alone
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)  # uniform: two seeds agreeing on 20 draws is ~impossible
    params = [SamplingParams(temperature=1.0)]

    def tokens(seed: int) -> list[int]:
        generator = make_generator(seed, "cpu")
        return [int(sample_next_tokens(logits, params, [generator])[0]) for _ in range(20)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=2),
    ]
    generators = [None, make_generator(1, "cpu"), None, make_generator(2, "cpu")]
    tokens = sample_next_tokens(logits, params, generators)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    top5 = set(logits[3].topk(5).indices.tolist())
    assert int(tokens[3]) in top5


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    tokens = torch.tensor([2, 1])
    logprobs = token_logprobs(logits, tokens).tolist()
    expected_first = 3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert logprobs[0] == pytest.approx(expected_first)
    assert logprobs[1] == pytest.approx(-math.log(3))
    assert all(lp <= 0 for lp in logprobs)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="do not match"):
        sample_next_tokens(torch.zeros(2, 5), [SamplingParams()], [None])


def test_unseeded_requests_get_no_generator() -> None:
    assert make_generator(None, "cpu") is None
    generator = make_generator(5, "cpu")
    assert generator is not None and generator.initial_seed() == 5
