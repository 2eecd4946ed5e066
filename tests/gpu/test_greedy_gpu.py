"""The Triton greedy argmax (``triton_greedy``) compiled, on a real vocabulary, against torch's
(skipped, with the reason, without CUDA). CI runs it in Triton's interpreter
(tests/unit/test_triton_greedy.py)."""

from __future__ import annotations

import pytest
import torch

from dpserve.engine.kernels import triton_greedy
from tests.unit.test_triton_greedy import torch_greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: the compiled Triton kernel"
)


def test_verified_on_this_gpu() -> None:
    assert triton_greedy.verified(torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_greedy_equals_torch_on_a_llama3_vocabulary(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    logits = (torch.randn(rows, 128256, device="cuda") * 5).to(dtype)
    logits[0, 1000] = float("nan")
    logits[-1, 77] = logits[-1, 128000] = 1e4  # a tie far apart: the first
    got = triton_greedy.greedy(logits)
    assert torch.equal(got, torch_greedy(logits))
    assert got[-1].item() == 77
