"""Greedy decoding's argmax as one Triton kernel (CUDA; the interpreter on CPU).

torch's greedy pick on a GPU is two kernels over the whole ``[rows, vocab]`` logits:
``nan_to_num`` (which reads them and writes a copy) and ``argmax`` (which reads the copy), ~92
us per batch-256 step of a 128k vocabulary on an H100 (issue 16). ``greedy`` reads the logits
once: one program per row walks the vocabulary in blocks, NaN counted as -inf, each lane
keeping the largest value it saw and its first index, reduced across lanes at the end. It is
the same token as ``sampler.greedy``'s torch path: the first maximal index, where a row of
nothing but -inf or NaN gives 0.

``cuda_graphs.DecodeGraphs`` captures it after the forward, so a bare greedy decode step
(``paged.backend``) replays one graph and copies out only the ids.

Code that has only run in the interpreter may still fail to compile on a GPU: ``verified``
runs the kernel once on a device against torch (ties, NaN, infinities, a vocabulary that is
not a whole number of blocks) before anything relies on it, and a device where it fails keeps
torch's two kernels, with a warning.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from dpserve.engine.kernels.triton_layer_ops import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without Triton (then torch's argmax runs)
    triton = None
    tl = None

log = logging.getLogger(__name__)

_BLOCK = 4096  # vocabulary entries a program compares at once


# Unannotated pointers and strides: Triton reads annotations as compile-time meaning.
def _greedy_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    out_ptr,
    row_stride,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    columns = tl.arange(0, BLOCK)
    # Each lane keeps the largest value it has seen and where: element-wise work in the loop,
    # and the two reductions across lanes once, at the end.
    best_values = tl.full([BLOCK], float("-inf"), tl.float32)
    best_indices = tl.zeros([BLOCK], tl.int32)
    for start in range(0, VOCAB, BLOCK):
        offsets = start + columns
        values = tl.load(base + offsets, mask=offsets < VOCAB, other=float("-inf"))
        values = values.to(tl.float32)
        values = tl.where(values != values, float("-inf"), values)  # NaN counts as -inf
        # Strictly larger: on a tie a lane keeps its earlier index.
        better = values > best_values
        best_indices = tl.where(better, offsets, best_indices)
        best_values = tl.where(better, values, best_values)
    best = tl.max(best_values, axis=0)
    # The first index holding the maximum; with nothing above -inf every lane holds it at its
    # initial index 0, so token 0, as torch's argmax.
    best_index = tl.min(tl.where(best_values == best, best_indices, VOCAB), axis=0)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def available(device: torch.device) -> bool:
    """Whether the kernel runs on tensors of ``device`` (CUDA, or the CPU interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


@functools.cache
def _kernel(interpret: bool) -> Any:
    # Decorated on first use: triton.jit picks the interpreter or the compiler at decoration.
    del interpret
    return triton.jit(_greedy_kernel)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The first maximal index of each row of ``logits`` ``[rows, vocab]`` (int64), NaN counted
    as -inf."""
    if not available(logits.device):
        raise RuntimeError(
            f"the Triton greedy kernel does not run on {logits.device} here (no triton, or CPU "
            "tensors without TRITON_INTERPRET=1): use sampler.greedy"
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if not rows:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(_BLOCK, max(128, triton.next_power_of_2(vocab)))  # masked past the vocabulary
    _kernel(logits.device.type == "cpu")[(rows,)](
        logits,
        out,
        logits.stride(0),
        VOCAB=vocab,
        BLOCK=block,
        **({} if logits.device.type == "cpu" else {"num_warps": 8}),
    )
    return out


def _probe(device: torch.device) -> torch.Tensor:
    """Rows that each exercise one rule, as wide as a large vocabulary's first blocks."""
    vocab = 3 * _BLOCK + 77  # the last block only partly inside the vocabulary
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, [5, _BLOCK + 9]] = 50.0  # a tie across blocks: the first wins
    logits[2, 7] = float("nan")  # NaN is not a maximum
    logits[3] = float("-inf")  # nothing finite: token 0
    logits[4] = float("nan")
    logits[5, [11, 2 * _BLOCK]] = float("inf")  # +inf, twice: the first
    logits[6, vocab - 1] = 60.0  # the maximum in the partial block
    logits[7, :_BLOCK] = float("-inf")  # a first block of nothing
    return logits.to(device)


@functools.cache
def verified(device: torch.device) -> bool:
    """Whether ``greedy`` runs on ``device`` and picks torch's tokens (checked once a device;
    call it outside CUDA graph capture, as it synchronizes)."""
    if not available(device):
        return False
    logits = _probe(device)
    inf = float("inf")
    expected = torch.nan_to_num(logits, nan=-inf, posinf=inf, neginf=-inf).argmax(dim=-1)
    try:
        got = {dtype: greedy(logits.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    except Exception as exc:  # a compiler or driver refusal: keep torch's path
        log.warning("Triton greedy argmax unavailable on %s (%s): using torch's", device, exc)
        return False
    # bf16 rounds some random logits into ties, so it is held to its own rounding's argmax.
    rounded = logits.to(torch.bfloat16).float()
    expected_bf16 = torch.nan_to_num(rounded, nan=-inf, posinf=inf, neginf=-inf).argmax(dim=-1)
    if torch.equal(got[torch.float32], expected) and torch.equal(
        got[torch.bfloat16], expected_bf16
    ):
        return True
    log.warning(
        "Triton greedy argmax disagreed with torch on %s (%s vs %s): using torch's",
        device,
        got[torch.float32].tolist(),
        expected.tolist(),
    )
    return False
