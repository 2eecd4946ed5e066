"""The CPU engine's settings from its environment, read and checked in one place, without torch
(a leaf the engine, the CLI and the operator share): ``dpserve serve`` checks them (``error``)
before it starts any engine, each engine again before it loads a model, and the operator each
value an InferenceDeployment's ``spec.engine.env`` gives them (``value_error``), so that a bad
value is one line (exit status 2, or the CR refused), not an engine that refuses at start-up and
is restarted until its restarts run out (or a pod in CrashLoopBackOff).

- ``ISA_ENV``: the instruction path of the C++ kernels (``engine.kernels.cpu_kernels``): the
  fastest this CPU runs ("auto"), or one named, so that an AVX-512 machine can run (and time)
  what an AVX2-only CPU runs (``bench/serving_cpu.py --avx2-only``).
- ``SMALL_BATCH_ROWS_ENV``: up to how many rows fp32 linears run the decode kernel instead of
  oneDNN (``engine.layers.linear``; unset: the engine's start-up probe measures it).
- ``BF16_DOTS_ENV``: whether a bf16 projection's activations are rounded to bf16 too, to be
  multiplied by AVX-512-BF16's dot product: unset, where the CPU has it; "1", the same, with a
  warning where it does not; "0", never (``engine.layers.weight_format`` says what it costs).
- ``FUSED_DECODE_ENV``: "0" runs a decode step's layers one torch operation at a time from
  Python instead of in one C++ call (``engine.layers.cpu_decode_layers``; the same result, for
  the bench and for ruling the fused call out).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Final

ISA_ENV: Final = "DPSERVE_CPU_ISA"
# The paths by name, in the order of csrc/decode_matmul.cpp's Isa
# (``engine.kernels.cpu_kernels.ISA_*``).
ISA_CHOICES: Final = ("auto", "portable", "avx2", "avx512")

SMALL_BATCH_ROWS_ENV: Final = "DPSERVE_CPU_SMALL_BATCH_ROWS"
# The most activation rows ``decode_matmul`` is meant for (the engine's probe measures it against
# oneDNN up to here, ``engine.layers.linear.small_batch_rows``): it takes any number, the weight
# read from memory once (groups of 4 rows after the first re-read it from L2, register-blocked).
# Where oneDNN's blocked kernels catch up depends on the CPU: at 24 rows they were as fast on a
# Zen 4 held to AVX2 (2 threads, SmolLM2-135M's projections: 49 ms a step against 52; 16 rows 33
# against 43), while on an AVX2-only Zen 3 the kernel's whole SmolLM2-135M step stayed 0.73x
# oneDNN's at 24 and at 32 rows (88 / 121 ms and 112 / 153; 16 rows 71 / 112; issue 33).
DECODE_MATMUL_MAX_ROWS: Final = 32

BF16_DOTS_ENV: Final = "DPSERVE_CPU_BF16_DOTS"

FUSED_DECODE_ENV: Final = "DPSERVE_CPU_FUSED_DECODE"


def isa_named(value: str) -> int:
    """The path ``value`` names, as its index in ``ISA_CHOICES``; ValueError, naming
    ``ISA_ENV``, for any other name."""
    if value not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_CHOICES)} (got {value!r})")
    return ISA_CHOICES.index(value)


@functools.cache
def isa_setting() -> int:
    """``ISA_ENV``'s path (``isa_named``; "auto" where unset), read once a process: the kernels
    are built for it and every product asks."""
    return isa_named(os.environ.get(ISA_ENV, "auto"))


def small_batch_rows_setting() -> int | None:
    """``SMALL_BATCH_ROWS_ENV`` as a row count, None where it is not set; ValueError, naming it,
    for anything but 0 to ``DECODE_MATMUL_MAX_ROWS``."""
    value = os.environ.get(SMALL_BATCH_ROWS_ENV)
    return None if value is None else small_batch_rows_named(value)


def small_batch_rows_named(value: str) -> int:
    """``value`` as ``SMALL_BATCH_ROWS_ENV``'s row count; ValueError, naming it, for anything
    but 0 to ``DECODE_MATMUL_MAX_ROWS``."""
    if not value.strip().isdigit() or int(value) > DECODE_MATMUL_MAX_ROWS:
        raise ValueError(
            f"{SMALL_BATCH_ROWS_ENV} must be a whole number from 0 to {DECODE_MATMUL_MAX_ROWS} "
            f"(got {value!r})"
        )
    return int(value)


def bf16_dots_setting() -> bool | None:
    """Whether ``BF16_DOTS_ENV`` asks for bf16 activations, None where it is unset (then: where
    the CPU can); ValueError, naming it, for anything but 0 or 1."""
    value = os.environ.get(BF16_DOTS_ENV)
    return None if value is None else bf16_dots_named(value)


def bf16_dots_named(value: str) -> bool:
    """``value`` as ``BF16_DOTS_ENV``'s setting; ValueError, naming it, for anything but 0 or
    1."""
    return switch_named(BF16_DOTS_ENV, value)


def fused_decode_setting() -> bool:
    """Whether decode steps may run their layers in one C++ call (``FUSED_DECODE_ENV``, unset:
    1); ValueError, naming it, for anything but 0 or 1."""
    return switch_named(FUSED_DECODE_ENV, os.environ.get(FUSED_DECODE_ENV, "1"))


def fused_decode_named(value: str) -> bool:
    """``value`` as ``FUSED_DECODE_ENV``'s setting."""
    return switch_named(FUSED_DECODE_ENV, value)


def switch_named(name: str, value: str) -> bool:
    """``value`` of the on/off setting ``name``; ValueError, naming it, for anything but 0 or
    1."""
    if value.strip() not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (got {value!r})")
    return value.strip() == "1"


# Each setting's reader of a value, by the variable's name.
_READERS: Final[dict[str, Callable[[str], object]]] = {
    ISA_ENV: isa_named,
    SMALL_BATCH_ROWS_ENV: small_batch_rows_named,
    BF16_DOTS_ENV: bf16_dots_named,
    FUSED_DECODE_ENV: fused_decode_named,
}


def value_error(name: str, value: str) -> str | None:
    """Why ``value`` is no setting for the variable ``name``, where ``name`` is one of these;
    None otherwise."""
    read = _READERS.get(name)
    if read is None:
        return None
    try:
        read(value)
    except ValueError as exc:
        return str(exc)
    return None


def error() -> str | None:
    """Why one of the settings in this process's environment holds no value the engine takes
    (the first found), None when all do (read now, not the cached reading)."""
    for name in _READERS:
        value = os.environ.get(name)
        why = None if value is None else value_error(name, value)
        if why is not None:
            return why
    return None
