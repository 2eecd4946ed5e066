"""How the CPU engine holds its projection weights (``dpserve engine --cpu-weights``, issue 33):
fp32 as loaded (the default), bf16, or int8 weight-only with one fp32 scale per output row.

A CPU decode step of a few sequences is bound by how fast the weights stream from memory, so
halving (bf16) or quartering (int8) their bytes shortens it; accumulators, norms, attention and
the embedding stay fp32. int8's activations stay fp32, so its only approximation is the
weight's rounding; bf16's too on CPUs without AVX-512-BF16 (the weight widened to fp32 in
registers). The pure functions here make the low-precision copies; ``linear.Linear`` runs them
(the C++ decode kernel, or a library path without it) and keeps no fp32 copy beside them.

On a CPU with AVX-512-BF16 (Zen 4 and 5, Intel from Cooper Lake and Sapphire Rapids) bf16
rounds the activations entering each projection to bf16 as well, as llama.cpp's bf16 does, and
multiplies them by that instruction set's dot product: twice an FMA's products per instruction
and no widening (SmolLM2-135M, 2 Zen 4 threads, whole decode steps of 1-16 sequences 1.22-1.42x
faster than with fp32 activations, a 128-token prompt 1.7x; bench/cpu_weights.py). Its NLL on
a fixed text did not move (-0.0004 nats against fp32's, widened -0.0009). A difference of one
unit in the last place before a rounding can become a whole bf16 step after it, so such a step
is batch-invariant (``step_attention``): every row's arithmetic the same whatever rode the step
with it, prompt chunks' rows attending as decode rows do, and a stream resumed after a failover
continues the uninterrupted run's log-probs to the bit. ``DPSERVE_CPU_BF16_DOTS=0``
(``cpu_settings``) keeps fp32 activations.

- bf16: the fp32 weight rounded to nearest even (8 significant bits, 7 stored): a relative error
  of at most 2**-8 per element.
- int8: symmetric, per output row: ``scale[n] = max_k |w[n, k]| / 127``, ``q = round(w / scale)``
  in [-127, 127], so ``|q * scale - w| <= scale / 2`` per element. A row of zeros keeps scale 0
  (its products are 0, as the row's are).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Final, Literal

from dpserve import cpu_settings

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: the CLI builds its parsers from the names
# and flag helpers below, and ``dpserve serve`` never loads torch itself.

WeightFormat = Literal["fp32", "bf16", "int8"]
# The formats, the CLI's choices in this order; the default is the weights as loaded.
WEIGHT_FORMATS: Final[tuple[WeightFormat, ...]] = ("fp32", "bf16", "int8")
DEFAULT_WEIGHT_FORMAT: Final[WeightFormat] = "fp32"
# int8's largest magnitude: symmetric, so -128 is never used and q and -q both exist.
INT8_MAX: Final = 127
# Bytes per weight element in each format (int8's scales, 4 bytes a row, come on top).
ELEMENT_BYTES: Final[dict[WeightFormat, int]] = {"fp32": 4, "bf16": 2, "int8": 1}


class WeightFormatRefused(ValueError):
    """A lower-precision weight format asked for where it cannot be honoured (one line)."""


def parse(name: str) -> WeightFormat | None:
    """``name`` as a weight format, None where it names none."""
    return next((known for known in WEIGHT_FORMATS if known == name), None)


def to_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded to bf16 (nearest even), contiguous."""
    import torch

    return weight.detach().to(torch.bfloat16).contiguous()


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: int8 ``[n, k]`` and fp32 ``[n]`` with ``q[n] * scales[n] ~= weight[n]``
    (module docstring), computed in fp32 whatever ``weight``'s dtype."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"a weight to quantize must be [n, k], got {tuple(weight.shape)}")
    values = weight.detach().float()
    scales = values.abs().amax(dim=1) / INT8_MAX
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(values / divisors[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight ``q`` and ``scales`` stand for (``quantize_int8_per_channel``'s inverse
    up to rounding)."""
    return q.float().mul_(scales[:, None])


def dequantize(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """A low-precision weight (bf16, or int8 with its ``scales``) as fp32; fp32 as it is."""
    import torch

    if weight.dtype == torch.int8:
        if scales is None:
            raise ValueError("an int8 weight needs its scales")
        return dequantize_int8(weight, scales)
    return weight.float()


def weight_bytes(weight: torch.Tensor, scales: torch.Tensor | None = None) -> int:
    """The bytes a stored weight (and its scales) take."""
    stored = weight.numel() * weight.element_size()
    return stored + (0 if scales is None else scales.numel() * scales.element_size())


def refusal(
    weight_format: str,
    *,
    backend: str = "dpserve",
    device_type: str | None = None,
    dtype: torch.dtype | None = None,
) -> str | None:
    """Why ``weight_format`` cannot be honoured by an engine of ``backend``
    (``flags.ENGINE_BACKENDS``) on ``device_type`` whose model loads as ``dtype`` (either None:
    not known yet, not checked); None where it can. One line, for the CLI."""
    if parse(weight_format) is None:
        return f"--cpu-weights must be one of {', '.join(WEIGHT_FORMATS)} (got {weight_format!r})"
    if weight_format == DEFAULT_WEIGHT_FORMAT:
        return None
    if backend != "dpserve":
        return f"--cpu-weights {weight_format} needs dpserve's own engine, not --backend {backend}"
    if device_type is not None and device_type != "cpu":
        return (
            f"--cpu-weights {weight_format} is for CPU engines (this one runs on {device_type}, "
            "with its own --dtype)"
        )
    if dtype is not None:
        import torch

        if dtype != torch.float32:
            return (
                f"--cpu-weights {weight_format} converts float32 weights (this model loads as "
                f"{dtype})"
            )
    return None


def checked(
    weight_format: str, *, device_type: str, dtype: torch.dtype, backend: str = "dpserve"
) -> WeightFormat:
    """``weight_format`` where ``refusal`` finds no reason against it; else
    ``WeightFormatRefused`` with the reason."""
    why = refusal(weight_format, device_type=device_type, dtype=dtype, backend=backend)
    known = parse(weight_format)
    if why is not None or known is None:
        raise WeightFormatRefused(why)
    return known


# ------------------------------------------------------------------------ the CLI's flag
# (here rather than in dpserve.flags, which the operator imports and which so may not import
# the engine)

FLAG = "--cpu-weights"


def add_flag(parser: argparse.ArgumentParser) -> None:
    """``--cpu-weights`` (``dpserve engine`` and ``dpserve serve``, which passes it on)."""
    parser.add_argument(
        FLAG,
        dest="cpu_weights",
        choices=WEIGHT_FORMATS,
        default=DEFAULT_WEIGHT_FORMAT,
        help="how a CPU engine holds its projection weights: fp32 as loaded, bf16, or int8 with "
        "a scale per output row; decode steps stream a half or a quarter of the bytes, at a "
        "small quality cost (bench/cpu_weights.py; on CPUs with AVX-512-BF16 bf16 rounds the "
        f"activations to bf16 too, {cpu_settings.BF16_DOTS_ENV}=0 keeps them fp32). dpserve's "
        "own engine, on CPU, with a float32 model only (default: %(default)s)",
    )


def flag_error(args: argparse.Namespace) -> str | None:
    """Why ``--cpu-weights`` cannot hold with the other flags (``dpserve serve`` asks before it
    starts any engine, each engine again; an engine checks its device and dtype itself, once it
    knows them); None when it can."""
    if args.cpu_weights != DEFAULT_WEIGHT_FORMAT and args.fake:
        return f"{FLAG} needs a model (not --fake)"
    return refusal(args.cpu_weights, backend=args.backend)


def flag_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``--cpu-weights`` as passed on to each engine: nothing for the default."""
    if args.cpu_weights == DEFAULT_WEIGHT_FORMAT:
        return ()
    return (FLAG, args.cpu_weights)
