"""The model's linear layers: every fused variant equals the plain torch computation, on the
prepacked oneDNN path (fp32 on x86 CPUs) and on the torch fallback (fp64: oneDNN refuses it)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from dpserve.engine.linear import Linear, uses_onednn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_variants_equal_torch(dtype: torch.dtype, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(int(with_bias))
    weight = torch.randn(24, 40, generator=generator, dtype=dtype)
    bias = torch.randn(24, generator=generator, dtype=dtype) if with_bias else None
    x = torch.randn(5, 40, generator=generator, dtype=dtype)
    other = torch.randn(5, 24, generator=generator, dtype=dtype)
    linear = Linear(weight.clone(), None if bias is None else bias.clone())
    if dtype == torch.float64:
        assert not linear.onednn
    plain = functional.linear(x, weight, bias)
    tolerance = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(linear(x), plain, **tolerance)
    torch.testing.assert_close(linear.silu(x), functional.silu(plain), **tolerance)
    torch.testing.assert_close(linear.times(x, other), plain * other, **tolerance)
    before = other.clone()
    torch.testing.assert_close(linear.plus(x, other), plain + other, **tolerance)
    assert torch.equal(other, before)  # the residual is not modified in place


def test_fp32_on_this_cpu_runs_prepacked() -> None:
    """The PyPI wheels this project installs have oneDNN: the fast path is the one in use."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("this torch build has no oneDNN")
    assert uses_onednn(torch.ones(4, 4))
    assert Linear(torch.ones(4, 4)).weight.is_mkldnn
