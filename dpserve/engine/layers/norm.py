"""RMSNorm: over a row's hidden state, and per attention head (Qwen3's q/k norm)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers.kernel_choice import KernelChoice

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm (fp32 statistics) as one torch operation."""
    return functional.rms_norm(hidden, weight.shape, weight, eps)


def row_norm(kernels: KernelChoice) -> Norm:
    """The RMSNorm of ``[tokens, hidden]`` rows that ``kernels`` picks: the C++ kernel or
    torch's."""
    return cpu_kernels.rms_norm if kernels.glue == "cpu" else rms_norm


def head_norm_(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm of every head of ``heads`` ``[tokens, heads, head_dim]`` in place (a view into
    the qkv projection's output, so the queries and keys stay where RoPE and the KV write read
    them). ``weight`` must be in the order the heads' dimensions are in (``rotary``'s pair
    order for queries and keys)."""
    heads.copy_(rms_norm(heads, weight, eps))
