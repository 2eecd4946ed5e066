"""Resolve oneMKL's vector-math dispatch once, in one thread, before torch's threads race on it.

torch's CPU build sends contiguous float unary operations (``cos``, ``sin``, ``exp``, ``log``,
``sqrt``, ``tanh``, ...) to oneMKL's VML, each intra-op thread on its chunk, asking for the
high-accuracy kernel. oneMKL 2024.2 (the one in torch's wheels, 2.10 to 2.13) picks each
function's kernel on its first call; when that first call runs on several threads at once, one
thread may run a low-accuracy kernel for its whole chunk (pytorch/pytorch#188792, fixed in torch
by the same warm-up, and gone with oneMKL 2025).

In dpserve that first call is the engine's RoPE table (``layers.rotary.rope_rotation``): in about
one engine start in twenty on this project's 2-core machine, part of the table came out with
errors of 1.5e-4 instead of 4e-6, silently, and every log-prob that engine served moved by up to
2e-3 (found as a flaky test comparing two runs of the engine in one process). A call on one
element runs in the calling thread alone, and afterwards every call gets the kernel it asks for.
"""

from __future__ import annotations

import functools

# The float operations torch routes to VML (ATen/cpu/vml.h, IMPLEMENT_VML_MKL).
VML_OPERATIONS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)


@functools.cache
def resolve_vml_dispatch() -> None:
    """Call every VML-backed operation once on one element, in float32 and float64 (each
    precision is a kernel of its own); does nothing where torch has no MKL."""
    import torch

    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return
    with torch.inference_mode():
        for dtype in (torch.float32, torch.float64):
            one = torch.full((1,), 0.5, dtype=dtype)
            for name in VML_OPERATIONS:
                getattr(torch, name)(one)
