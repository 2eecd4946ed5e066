"""The Triton greedy argmax (``triton_greedy``) picks ``sampler.greedy``'s tokens (CPU, Triton's
interpreter); ``verified`` keeps torch's path on a device where the kernel fails or disagrees.

As in ``test_triton_decode``: the kernel cases run in a child process with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dpserve.engine.kernels import triton_greedy
from dpserve.engine.sample import sampler
from tests.triton_interpreter import TRITON_MISSING, interpreter_case, interpreter_run

pytest.importorskip("triton", reason=TRITON_MISSING)
test_the_greedy_kernel_cases_pass_in_the_interpreter = interpreter_run(__file__)

INF = float("inf")
NAN = float("nan")


def torch_greedy(logits: torch.Tensor) -> torch.Tensor:
    """``sampler.greedy``'s rule in plain torch (its CPU path is numpy's, the same tokens)."""
    return torch.nan_to_num(logits.float(), nan=-INF, posinf=INF, neginf=-INF).argmax(dim=-1)


@interpreter_case
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 4096, 4097, 49152, 128256 // 8 + 3])
def test_random_logits_pick_torchs_token(dtype: torch.dtype, vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=generator) * 4).to(dtype)
    assert torch.equal(triton_greedy.greedy(logits), torch_greedy(logits))


@interpreter_case
def test_the_rules_ties_nan_and_infinities() -> None:
    block = triton_greedy._BLOCK
    vocab = 2 * block + 10
    logits = torch.zeros(7, vocab)
    logits[0, [3, block + 3]] = 9.0  # a tie across blocks: the first index
    logits[1, [block + 1, block + 2]] = 9.0  # a tie inside a later block: the first
    logits[2, :] = NAN  # nothing but NaN: token 0
    logits[2, 5] = -INF
    logits[3, :] = -INF  # nothing finite: token 0
    logits[4, 1] = NAN  # NaN is never the maximum
    logits[4, 2] = 1.0
    logits[5, [2 * block + 9, 4]] = INF  # +inf twice: the first
    logits[6, :] = -1.0  # all equal: token 0
    got = triton_greedy.greedy(logits)
    assert got.tolist() == [3, block + 1, 0, 0, 2, 4, 0]
    assert torch.equal(got, torch_greedy(logits))
    assert torch.equal(got, sampler.greedy(logits))


@interpreter_case
def test_a_view_of_some_rows_and_an_empty_batch() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    # The decode graphs hand in the first rows of their static logits; a column slice is
    # copied to contiguous rows first.
    assert torch.equal(triton_greedy.greedy(logits[:4]), torch_greedy(logits[:4]))
    assert torch.equal(triton_greedy.greedy(logits[:, 1:]), torch_greedy(logits[:, 1:]))
    assert triton_greedy.greedy(logits[:0]).shape == (0,)
    assert triton_greedy.greedy(logits).dtype == torch.long


@interpreter_case
def test_verified_on_a_working_device() -> None:
    triton_greedy.verified.cache_clear()
    assert triton_greedy.verified(torch.device("cpu"))


@interpreter_case
def test_a_kernel_that_disagrees_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    triton_greedy.verified.cache_clear()
    monkeypatch.setattr(triton_greedy, "greedy", lambda logits: torch_greedy(logits) + 1)
    with caplog.at_level(logging.WARNING, "dpserve.engine.kernels.triton_greedy"):
        assert not triton_greedy.verified(torch.device("cpu"))
    assert "disagreed with torch" in caplog.text
    triton_greedy.verified.cache_clear()


@interpreter_case
def test_a_kernel_that_fails_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("PTX: no such instruction")

    triton_greedy.verified.cache_clear()
    monkeypatch.setattr(triton_greedy, "greedy", refuse)
    with caplog.at_level(logging.WARNING, "dpserve.engine.kernels.triton_greedy"):
        assert not triton_greedy.verified(torch.device("cpu"))
    assert "PTX: no such instruction" in caplog.text
    triton_greedy.verified.cache_clear()


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton_greedy.verified.cache_clear()
    assert not triton_greedy.available(torch.device("cpu"))
    assert not triton_greedy.verified(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_greedy.greedy(torch.zeros(2, 8))
