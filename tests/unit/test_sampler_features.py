"""The batched sampler's penalties, top log-probs and masks against plain per-row references,
the new SamplingParams fields' rules, and the log-prob wire format."""

from __future__ import annotations

import pytest
import torch

from dpserve import protocol
from dpserve.engine.sample.penalties import PenaltyTokens, TokenHistory, apply_penalties
from dpserve.engine.sample.sampler import log_probs_of, sample
from dpserve.protocol import ProtocolError
from dpserve.sampling import InvalidSamplingParams, SamplingParams

VOCAB = 50


def reference_penalties(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory
) -> torch.Tensor:
    """vLLM's rules, one token at a time."""
    out = logits.clone()
    seen = set(history.prompt) | set(history.generated)
    for token in range(out.shape[0]):
        if token in seen and params.repetition_penalty != 1.0:
            value = out[token]
            out[token] = (
                value / params.repetition_penalty
                if value > 0
                else value * params.repetition_penalty
            )
        count = history.generated.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def test_penalties_match_the_per_row_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=generator) * 3
    params = [
        SamplingParams(temperature=0.0, presence_penalty=1.5, return_log_probs=True),
        SamplingParams(temperature=0.0),  # no penalty: untouched
        SamplingParams(temperature=0.0, frequency_penalty=-0.7, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=2.0),
    ]
    histories = [
        TokenHistory([1, 2, 3], [4, 4, 5]),
        TokenHistory([7], [8, 9]),
        TokenHistory([10, 11], [11, 12, 12, 12]),
        TokenHistory([], [0, 49, 49]),
    ]
    out = sample(logits, params, [0] * 4, histories)
    for row in range(4):
        expected = reference_penalties(logits[row], params[row], histories[row])
        assert out.tokens[row].item() == int(expected.argmax())
    # Reported log-probs stay the model's own (vLLM's raw log-probs).
    assert out.logprobs is not None
    raw = torch.log_softmax(logits[0], dim=-1)[out.tokens[0]]
    assert out.logprobs[0].item() == pytest.approx(raw.item(), abs=1e-6)


def test_kept_penalty_tokens_give_the_list_histories_scores_step_after_step() -> None:
    """``PenaltyTokens`` (a sequence's distinct tokens and counts kept between steps, grown by
    the tokens appended since, counted afresh if some were taken back) penalizes exactly as the
    plain lists do, with and without a repetition penalty; rows without penalties are left
    alone."""
    generator = torch.Generator().manual_seed(1)
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.9, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=-0.4, frequency_penalty=0.2),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2, 2, 3, 30], [40, 41], [7]]
    repeats = [q.repetition_penalty != 1.0 for q in params]
    kept = [PenaltyTokens(p, r) for p, r in zip(prompts, repeats, strict=True)]
    generated: list[list[int]] = [[], [5], [6]]
    for step in range(120):
        if step == 80:
            del generated[0][-3:]  # taken back
        logits = torch.randn(3, VOCAB, generator=generator) * 3
        plain = [TokenHistory(p, g) for p, g in zip(prompts, generated, strict=True)]
        cached = [k.counts(g) for k, g in zip(kept, generated, strict=True)]
        expected = apply_penalties(logits, [0, 1], params, plain)
        torch.testing.assert_close(apply_penalties(logits, [0, 1], params, cached), expected)
        torch.testing.assert_close(expected[2], logits[2])
        tokens = sample(logits, params, [0, 0, 0], cached).tokens.tolist()
        for history, token in zip(generated, tokens, strict=True):
            history.append(token % 35 if step % 3 else 30)  # repeats, and the prompt's 30


def test_penalties_need_histories() -> None:
    with pytest.raises(ValueError, match="history"):
        sample(torch.zeros(1, VOCAB), [SamplingParams(presence_penalty=1.0)], [0])


def test_top_logprobs_per_row_from_one_batch_topk() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0, return_log_probs=True, top_logprobs=5),
        SamplingParams(temperature=0.0, return_log_probs=True),  # the token only
        SamplingParams(temperature=0.0, return_log_probs=True, top_logprobs=2),
    ]
    host = sample(logits, params, [0, 0, 0]).to_host()
    assert host.top is not None and [len(t) for t in host.top] == [5, 0, 2]
    for row, top in enumerate(host.top):
        reference = torch.log_softmax(logits[row], dim=-1).topk(len(top)) if top else None
        if reference is not None:
            assert [t for t, _ in top] == reference.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(reference.values.tolist(), abs=1e-6)
            assert top[0][0] == host.tokens[row]  # greedy: the top-1 is the token


def test_allowed_mask_restricts_greedy_and_sampled_rows() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[:, [3, 17]] = True
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=4)]
    for _ in range(5):
        tokens = sample(logits, params, [0, 0], allowed=allowed).tokens.tolist()
        assert set(tokens) <= {3, 17}


def test_log_probs_of_given_tokens() -> None:
    logits = torch.randn(3, VOCAB)
    tokens = torch.tensor([4, 9, 0])
    host = log_probs_of(logits, tokens, 3).to_host()
    expected = torch.log_softmax(logits, dim=-1)
    assert host.logprobs == pytest.approx(
        [expected[i, t].item() for i, t in enumerate(tokens.tolist())], abs=1e-6
    )
    assert host.top is not None and all(len(t) == 3 for t in host.top)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"top_logprobs": 3}, "needs return_log_probs"),
        ({"top_logprobs": 21, "return_log_probs": True}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"guided_json": "{}", "guided_regex": "x"}, "at most one"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_new_fields_are_validated(fields: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=named):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_new_fields_round_trip_the_wire_form() -> None:
    params = SamplingParams(
        return_log_probs=True, top_logprobs=4, prompt_logprobs=True, presence_penalty=0.5,
        frequency_penalty=-1.0, repetition_penalty=1.1, guided_choice=("a", "b"),
    )  # fmt: skip
    assert SamplingParams.deserialize(params.serialize()) == params


def test_logprob_entries_pack_and_concatenate() -> None:
    first = protocol.pack_logprobs([-0.5, -1.5], [[(3, -0.5), (4, -2.0)], [(9, -1.0), (1, -1.5)]])
    second = protocol.pack_logprobs([-0.25], [[(7, -0.25), (2, -3.0)]])
    logprobs, top = protocol.unpack_logprobs(first + second, 2)
    assert logprobs == [-0.5, -1.5, -0.25]
    assert top == [[(3, -0.5), (4, -2.0)], [(9, -1.0), (1, -1.5)], [(7, -0.25), (2, -3.0)]]
    assert protocol.pack_logprobs([-0.5], None) == protocol.pack_floats([-0.5])
    with pytest.raises(ProtocolError):
        protocol.unpack_logprobs(first[:-4], 2)
