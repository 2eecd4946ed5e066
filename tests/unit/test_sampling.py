from __future__ import annotations

import pytest

from dpserve.sampling import InvalidSamplingParams, SamplingParams


def test_defaults_serialize_to_nothing_and_round_trip() -> None:
    assert SamplingParams().serialize() == {}
    params = SamplingParams(
        temperature=0.0,
        top_k=5,
        top_p=0.9,
        num_tokens_to_generate=3,
        termination_id=2,
        stop_strings=["\n", "END"],
        return_log_probs=True,
        seed=11,
        stream=True,
        stop_token_ids=[7, 9],
        min_p=0.05,
        logit_bias=[[5, 2.5], [9, -100]],
    )
    wire = params.serialize()
    assert wire["stop_strings"] == ["\n", "END"]
    assert (wire["stop_token_ids"], wire["min_p"]) == ([7, 9], 0.05)
    assert params.logit_bias == ((5, 2.5), (9, -100))
    assert SamplingParams.deserialize(wire) == params
    assert params.greedy


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 2.0000000000000004}, r"temperature must be in \[0, 2\]"),
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"num_tokens_to_generate": 0}, "num_tokens_to_generate"),
        ({"num_tokens_to_generate": True}, "num_tokens_to_generate must be an integer"),
        ({"termination_id": -3}, "termination_id"),
        ({"stop_strings": [""]}, "stop_strings"),
        ({"stop_strings": "abc"}, "stop_strings"),
        ({"return_log_probs": 1}, "return_log_probs"),
        ({"seed": -1}, "seed"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "low"}, "min_p must be a number"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [3, True]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "at most 1024 stop_token_ids"),
        ({"logit_bias": [[5, 100.5]]}, "logit_bias must map"),
        ({"logit_bias": [[-1, 1]]}, "logit_bias must map"),
        ({"logit_bias": [[5, float("nan")]]}, "logit_bias must map"),
        ({"logit_bias": [[5, True]]}, "logit_bias must map"),
        ({"logit_bias": [[5, 1, 2]]}, "logit_bias must map"),
        ({"logit_bias": {"5": 1}}, "logit_bias must map"),
        ({"logit_bias": [[5, 1], [5, 2]]}, "more than once"),
        ({"logit_bias": [[t, 1] for t in range(1025)]}, "at most 1024 tokens"),
        ({"max_tokens": 5}, "unknown sampling parameter"),
    ],
)
def test_invalid_values_and_unknown_keys_are_rejected(data: dict, message: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=message):
        SamplingParams.deserialize(data)


def test_non_mapping_is_rejected() -> None:
    with pytest.raises(InvalidSamplingParams, match="mapping"):
        SamplingParams.deserialize([1, 2])
    assert SamplingParams.deserialize(None) == SamplingParams()


def test_the_params_memo_checks_each_distinct_set_once_and_keeps_types_apart() -> None:
    """``ParamsMemo`` (the coordinator's admission and the engine's requests): an equal set
    gets the same checked object back; ``True`` and ``1`` (equal in Python) are told apart,
    so a value validation refuses is refused after its accepted twin was memoized; sets with a
    list are checked every time; what is not a map gets its error."""
    from dpserve.sampling import InvalidSamplingParams, ParamsMemo, SamplingParams

    built: list[object] = []

    def build(raw: object) -> SamplingParams:
        built.append(raw)
        return SamplingParams.deserialize(raw)

    memo = ParamsMemo(build)
    first = memo({"temperature": 0, "ignore_eos": True})
    assert memo({"temperature": 0, "ignore_eos": True}) is first and len(built) == 1
    with pytest.raises(InvalidSamplingParams):
        memo({"temperature": 0, "ignore_eos": 1})
    assert memo({"stop_strings": ["x"]}) == memo({"stop_strings": ["x"]}) and len(built) == 4
    with pytest.raises(InvalidSamplingParams, match="must be a mapping"):
        memo([1])
