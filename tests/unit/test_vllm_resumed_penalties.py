"""A resumed request's penalties on vLLM (``dpserve.engine.vllm.resumed_penalties``): the
processor's part plus what vLLM's own sampler subtracts over its output give the scores of the
uninterrupted request, as dpserve's sampler computes them with the resumed tokens generated.
(The processor inside real vLLM: ``tests/integration/test_vllm_serve.py``'s kill pass.)"""

from __future__ import annotations

import pytest
import torch

from dpserve.engine.sample.penalties import TokenHistory, apply_penalties
from dpserve.engine.vllm.resumed_penalties import PenalizedRow, penalized, penalized_row
from dpserve.engine.vllm.sampling import vllm_sampling_kwargs
from dpserve.sampling import SamplingParams

VOCAB = 50


def _vllm_output_penalties(scores: torch.Tensor, output: list[int], p: float, f: float):
    """What vLLM's sampler subtracts after the logits processors (its repetition penalty is
    1 for these requests)."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
    return scores - f * counts - p * (counts > 0).float()


@pytest.mark.parametrize("repetition", [1.0, 1.3])
def test_processor_and_vllm_give_the_uninterrupted_scores(repetition: float) -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(VOCAB, generator=generator) * 3
    prompt, resumed, output = [1, 2, 3, 4, 2], [5, 6, 5, 7, 3], [6, 8, 8, -1]
    params = SamplingParams(
        temperature=0, presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=repetition
    )
    kwargs = vllm_sampling_kwargs(params, 10, resumed=len(resumed))
    assert kwargs["repetition_penalty"] == 1.0

    class VllmParams:  # the fields of vLLM's SamplingParams the processor reads
        extra_args = kwargs["extra_args"]
        presence_penalty = kwargs["presence_penalty"]
        frequency_penalty = kwargs["frequency_penalty"]

    row = penalized_row(VllmParams, prompt + resumed, output)
    assert row == PenalizedRow(prompt + resumed, len(resumed), output, 0.7, 0.3, repetition)
    done = [t for t in output if t >= 0]  # -1: vLLM's placeholder for a token still in flight
    ours = _vllm_output_penalties(penalized(scores.clone(), row), done, 0.7, 0.3)
    expected = apply_penalties(
        scores[None].clone(), [0], [params], [TokenHistory(prompt, resumed + done)]
    )[0]
    torch.testing.assert_close(ours, expected)

    # Without the processor (vLLM alone, the resumed tokens only prompt): not the same scores.
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[prompt + resumed + done] = True
    alone = torch.where(
        seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores
    )
    assert not torch.allclose(_vllm_output_penalties(alone, done, 0.7, 0.3), expected)


def test_only_resumed_requests_with_presence_or_frequency_get_the_processor() -> None:
    with_penalties = SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=1.1)
    assert "extra_args" not in vllm_sampling_kwargs(with_penalties, 10)  # not resumed
    assert vllm_sampling_kwargs(with_penalties, 10)["repetition_penalty"] == 1.1
    repetition_only = SamplingParams(temperature=0, repetition_penalty=1.1)
    # vLLM's repetition penalty already covers the resumed tokens (its prompt).
    assert "extra_args" not in vllm_sampling_kwargs(repetition_only, 10, resumed=4)
    assert "extra_args" in vllm_sampling_kwargs(with_penalties, 10, resumed=4)
