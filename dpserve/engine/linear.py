"""The model's linear layers, with the element-wise work that follows them fused in.

On x86 CPUs (torch built with oneDNN, the PyPI wheels) the weights are reordered once, at
load, into oneDNN's blocked layout and every projection runs as one oneDNN primitive with its
epilogue fused: SiLU after the gate projection, the multiplication by the gate after the up
projection, the residual add after the output and down projections. Measured on SmolLM2-135M
shapes with one thread (issue 16), a prepacked oneDNN matmul of 16 rows takes 0.6-0.7x the time
of ``F.linear`` (MKL repacks the weight on every call) and the tied 49,152-row output projection
several times less; and each fused epilogue is one operation fewer per layer, with no
intermediate tensor written and read back.

Elsewhere (CUDA, CPU builds without oneDNN, dtypes it refuses) the same calls run as plain
torch operations; the residual add still rides in the matmul (``addmm``'s beta).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.nn import functional

log = logging.getLogger(__name__)

_MKLDNN_DTYPES = frozenset({torch.float32, torch.bfloat16})

# The fewest rows a oneDNN matmul is worth running with: its kernels for 1-2 rows stream the
# weight more slowly than the one for 3-6 (SmolLM2-135M's MLP projections, one thread, weights
# from memory as in a decode step, AMD EPYC Zen 4, torch 2.13: 0.28 / 0.33 / 0.27 / 0.25 ms for
# 1 / 2 / 3 / 4 rows; a decode step of 2 sequences took 57 ms against 41 for 4). Smaller decode
# batches are padded up to it (``paged_batch.pad_decodes``).
ONEDNN_MIN_ROWS = 4


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """Whether this torch build runs prepacked oneDNN linears for ``dtype`` (probed once)."""
    if dtype not in _MKLDNN_DTYPES or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 8, dtype=dtype), packed, None, "none", [], ""
        )
    except (RuntimeError, AttributeError) as exc:  # no oneDNN kernels for this CPU or dtype
        log.info("oneDNN linear unavailable for %s (%s): using torch.nn.functional", dtype, exc)
        return False
    return bool(torch.all(out == 8).item())


def uses_onednn(weight: torch.Tensor) -> bool:
    """Whether a ``Linear`` of ``weight`` would run as a prepacked oneDNN primitive."""
    return weight.device.type == "cpu" and _onednn_works(weight.dtype)


class Linear:
    """``x @ weight.T + bias`` over ``[rows, in_features]`` activations, plus fused variants."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.onednn = uses_onednn(weight)
        # The packed copy is oneDNN's opaque tensor: the dense weight is not kept beside it.
        self.weight: torch.Tensor = (
            torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if self.onednn else weight
        )
        self.bias = bias

    def _onednn(self, x: torch.Tensor, post_op: str) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, post_op, [], ""
        )
        return out

    def _onednn_binary(self, x: torch.Tensor, other: torch.Tensor, post_op: str) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            x, other, self.weight, self.bias, post_op
        )
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return self._onednn(x, "none")
        return functional.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(self(x))``."""
        if self.onednn:
            return self._onednn(x, "swish")
        return functional.silu(self(x), inplace=True)

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) * other``."""
        if self.onednn:
            return self._onednn_binary(x, other, "mul")
        return self(x).mul_(other)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``self(x) + residual`` (a new tensor; ``residual`` is not modified)."""
        if self.onednn:
            return self._onednn_binary(x, residual, "add")
        if self.bias is None and x.dim() == 2:
            return torch.addmm(residual, x, self.weight.t())
        return self(x).add_(residual)
