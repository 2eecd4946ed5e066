"""The CPU engine's settings from its environment, read and checked in one place, without torch:
``dpserve serve`` checks them (``error``) before it starts any engine and each engine again
before it loads a model, so that a bad value is one line and exit status 2, not an engine that
refuses at start-up and is restarted until its restarts run out.

- ``ISA_ENV``: the instruction path of the C++ kernels (``cpu_kernels``): the fastest this CPU
  runs ("auto"), or one named, so that an AVX-512 machine can run (and time) what an AVX2-only
  CPU runs (``bench/serving_cpu.py --avx2-only``).
- ``SMALL_BATCH_ROWS_ENV``: up to how many rows fp32 linears run the decode kernel instead of
  oneDNN (``layers.linear``; unset: the engine's start-up probe measures it).
- ``BF16_DOTS_ENV``: "1" rounds a bf16 projection's activations to bf16 too, where the CPU can
  multiply them so (``layers.weight_format`` says what it costs).
"""

from __future__ import annotations

import functools
import os
from typing import Final

ISA_ENV: Final = "DPSERVE_CPU_ISA"
# The paths by name, in the order of csrc/decode_matmul.cpp's Isa (``cpu_kernels.ISA_*``).
ISA_CHOICES: Final = ("auto", "portable", "avx2", "avx512")

SMALL_BATCH_ROWS_ENV: Final = "DPSERVE_CPU_SMALL_BATCH_ROWS"
# The most activation rows ``decode_matmul`` is meant for (the engine's probe measures it against
# oneDNN up to here, ``layers.linear.small_batch_rows``): it takes any number, the weight read
# from memory once (groups of 4 rows after the first re-read it from L2, register-blocked),
# but at 24 rows oneDNN's blocked kernels were as fast (Zen 4 held to AVX2, 2 threads,
# SmolLM2-135M's projections: 49 ms a step against oneDNN's 52; 16 rows 33 against 43; issue 33).
DECODE_MATMUL_MAX_ROWS: Final = 16

BF16_DOTS_ENV: Final = "DPSERVE_CPU_BF16_DOTS"


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
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) > DECODE_MATMUL_MAX_ROWS:
        raise ValueError(
            f"{SMALL_BATCH_ROWS_ENV} must be a whole number from 0 to {DECODE_MATMUL_MAX_ROWS} "
            f"(got {value!r})"
        )
    return int(value)


def bf16_dots_setting() -> bool:
    """Whether ``BF16_DOTS_ENV`` asks for bf16 activations; ValueError, naming it, for anything
    but 0 or 1 (unset: 0)."""
    value = os.environ.get(BF16_DOTS_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{BF16_DOTS_ENV} must be 0 or 1 (got {value!r})")
    return value == "1"


def error() -> str | None:
    """Why one of the settings holds no value the engine takes (the first found), None when all
    do."""
    try:
        isa_named(os.environ.get(ISA_ENV, "auto"))  # not the cached reading: now's
        small_batch_rows_setting()
        bf16_dots_setting()
    except ValueError as exc:
        return str(exc)
    return None
