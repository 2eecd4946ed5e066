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

Decode steps of a few sequences are a matrix-vector product in all but name: their time is the time
to stream the weights from memory once. oneDNN's and MKL's kernels for 1-2 rows read the weights at
well below the memory's bandwidth (AMD EPYC Zen 4, one thread, SmolLM2's shapes: 10-18 GB/s for
oneDNN padded to 4 rows, 5-12 for ``F.linear``, 24-32 for the kernel below; BENCHMARKS.md, issue
33), so where the C++ kernels are built (fp32 on CPU) such steps run ``cpu_kernels.decode_matmul``:
each weight row read once for every row of the step, threads splitting the output rows, its epilogue
(SiLU, the product by the gate, the residual add) fused as oneDNN's is. Without the C++ kernels the
same steps can run torch's dense ``F.linear`` instead (on an Intel Xeon with AVX-512 it read a row's
weights at ~24 GB/s on two threads against oneDNN's ~17; issue 16). ``small_batch_rows`` measures
that small-batch path against oneDNN once per model, on its own projection shapes, for 1 to
``SMALL_BATCH_MAX_ROWS`` rows (oneDNN padded to ``ONEDNN_MIN_ROWS`` below it, as the engine pads),
and each linear keeps the dense weight beside the packed one and runs steps of that many rows or
fewer through it. That is a second copy of the weights: for the kernel one in 2 MB pages
(``cpu_kernels.huge_page_copy``: a SmolLM2-135M step of one sequence took 25 CPU ms against 33 with
the 4 KB pages of its memory-mapped file), column-blocked where rows have 2,048 columns or more
(``cpu_kernels.decode_weight_copy``), so the fp32 weights are held twice; for ``F.linear`` SmolLM2's
stay memory-mapped from its file (RSS +48 MB, for the fused QKV matrices), while weights converted
at load are kept twice. So not under a memory limit (a container's cgroup), which was sized for one
copy: there each weight is held once. With the decode kernel that one copy is the kernel's, in 2 MB
pages and row-major (oneDNN reads it too): steps of up to ``SMALL_BATCH_MAX_ROWS`` rows run the
kernel and larger ones run oneDNN from the same unpacked weight, its epilogues still fused
(``keeps_one_copy``; SmolLM2-135M's shapes, one thread, Zen 4, BENCHMARKS.md: oneDNN unpacked took
1.04-1.41x the packed primitive's time at 4-512 rows, and the kernel less than unpacked oneDNN at
4-8 rows; at 16 rows, 2 threads, a whole step's projections took 36-44 ms against 48-57; at 1-3
the engine pads oneDNN to 4). Without the kernel the one copy is oneDNN's packed
one, nothing measured. ``DPSERVE_CPU_SMALL_BATCH_ROWS=N`` sets the count instead, anywhere (0:
never), and keeps both.

With a lower-precision weight format (``weight_format``: ``dpserve engine --cpu-weights bf16`` or
``int8``, never the default) only the bf16 or int8 copy is kept, as the decode kernel reads it where
the kernel serves it (``cpu_kernels.decode_weight_copy``), and every product runs the kernel on it,
prompt chunks too: decode steps stream a half or a quarter of fp32's bytes, and from 5 rows its
register-blocked passes compute a prompt chunk faster than any library path from the same copy
(``_low_precision_kernel_rows``). Without the kernel (or past ``SMALL_BATCH_ROWS_ENV``'s count where
it is set) a library path runs from the same copy, its epilogues as separate torch operations.
Which library path was measured (SmolLM2-135M's shapes, 16-512 rows, one thread, AMD
EPYC with AVX-512-BF16, torch 2.13, a shared machine): ``aten._weight_int8pack_mm`` takes fp32
activations but ran 30-130x oneDNN fp32's time (36 ms against 0.28 for 16 rows of the 1536x576
projection), so int8 is widened to fp32 a tile of ``_DEQUANT_TILE_ROWS`` weight rows at a time (a
few MB: it stays in the last-level cache) and multiplied by ``F.linear``: 1.0-1.4x oneDNN fp32's
time. bf16 is widened the same way (1.0-1.1x fp32's time). ``F.linear`` in bf16 took 0.5x fp32's
time on this CPU (AVX-512-BF16) but 3-5x with oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``), and
even where it is fast it rounds the activations and its output to bf16 (torch 2.13 has no bf16
product with an fp32 result on CPU: ``aten::mm.dtype`` has no CPU kernel): every projection's output
and the logits to 8 significant bits, a logit of 15 off by up to 0.03, and prefill's numbers unlike
decode's. So both formats keep fp32 activations and outputs; the weight's rounding is the only
approximation there. On the kernel of a CPU with AVX-512-BF16 a bf16 weight's activations are
rounded to bf16 too (``bf16_dots``, unless ``BF16_DOTS_ENV`` is "0"; fp32 sums and outputs; why,
and what it costs, in ``weight_format``'s docstring), for every product of the engine, prompt
chunks and decode steps alike."""

from __future__ import annotations

import functools
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from dpserve import cpu_settings
from dpserve.cpu_settings import (
    BF16_DOTS_ENV,
    SMALL_BATCH_ROWS_ENV,
    bf16_dots_setting,
    small_batch_rows_setting,
)
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers.weight_format import (
    DEFAULT_WEIGHT_FORMAT,
    WeightFormat,
    dequantize,
    quantize_int8_per_channel,
    to_bf16,
    weight_bytes,
)

log = logging.getLogger(__name__)

_MKLDNN_DTYPES = frozenset({torch.float32, torch.bfloat16})

# The fewest rows a oneDNN matmul is worth running with: its kernels for 1-2 rows stream the
# weight more slowly than the one for 3-6 (SmolLM2-135M's MLP projections, one thread, weights
# from memory as in a decode step, AMD EPYC Zen 4, torch 2.13: 0.28 / 0.33 / 0.27 / 0.25 ms for
# 1 / 2 / 3 / 4 rows; a decode step of 2 sequences took 57 ms against 41 for 4). Smaller decode
# batches are padded up to it (``paged.batch.pad_decodes``).
ONEDNN_MIN_ROWS = 4

# The most rows the small-batch path is measured for and may take: the decode kernel's one
# pass over the weight (beyond it oneDNN's kernels stream the weight as fast; issue 33).
SMALL_BATCH_MAX_ROWS = cpu_settings.DECODE_MATMUL_MAX_ROWS
# The probe: copies of the model's own projection shapes (one decoder layer's, in turn; a weight
# of another shape where none are given), together far larger than a server's last-level cache,
# so that they come from memory as a decode step's weights do. The shapes decide the result: on
# 2 threads, Zen 4, the kernel's lead over oneDNN for one row was 1.5-1.8x on each of SmolLM2's
# four shapes and 1.3-1.6x on a 2048x1024 stand-in, whose run-to-run noise once left it at
# 1.16x, under the margin, and a server ran oneDNN at 1.6x the kernel's c=1 step time (issue
# 33). The small-batch path is used for a row count only where it takes at most _DENSE_MARGIN of
# oneDNN's time for one row (noise is not a reason to hold the weights twice), and for each
# further row count while it is not slower than oneDNN (the copy is held by then; at 8 rows on 2
# threads, Zen 4, the kernel read 17.4 GB/s against oneDNN's 15.1, and the margin alone had sent
# 8-sequence steps to oneDNN).
# The row counts measured, in stages: each only where every count of the one before went to the
# small-batch path (on Zen 4 with AVX-512, 2 threads, oneDNN's 5-6-row kernels won and the
# first stage ended at 4-5; held to AVX2 every count to 16 went to the kernel, as on an AVX2-only
# Zen 3, where 24 and 32 rows did too). The third stage measures 24 and 32 rows only, a step of
# 17-23 rows going with 24's result: every count there would cost seconds at start-up, where
# each stage now costs about one.
_PROBE_STAGES: tuple[Sequence[int], ...] = (range(1, 9), range(9, 17), (24, SMALL_BATCH_MAX_ROWS))
_PROBE_SHAPE = (2048, 1024)
_PROBE_BYTES = 192 << 20
# The most bytes one probe weight takes: a larger projection (an 8B model's 14336x4096 MLP
# matrices, 235 MB in fp32) is probed on its first rows, its row width kept.
_PROBE_MAX_WEIGHT_BYTES = _PROBE_BYTES // 4
# Fewer bytes than this in a layer's projections (tests' tiny random models: a few KB) and the
# stand-in is probed instead: such weights sit in the cache, and passes over thousands of tiny
# copies would time Python's calls rather than memory (and take seconds).
_PROBE_MIN_LAYER_BYTES = 1 << 20
_DENSE_MARGIN = 0.85
_PROBE_ROUNDS = 5
# A pass's time is taken from its calls one by one (``pass_seconds``): per shape, the (lower)
# median of its calls' times, times their count. An engine that starts beside a busy process
# (another engine starting, a compile) has its threads preempted in some calls, each then waiting a
# scheduler slice at the parallel region's barrier, whichever path it runs; timed as whole
# passes, both paths read as slow as that wait (0.4 GB/s each, 2026-11-28, an engine that
# started while llama.cpp compiled on both cores) and the margin sent every step to oneDNN, for
# the engine's life. The calls no thread was preempted in still time the path: with two
# busy loops beside the probe (2 threads, Zen 4, SmolLM2's shapes) whole passes read 11-24 GB/s
# and the median 21-46, as quiet. A lower quantile was as robust but favoured oneDNN, whose
# calls' times spread wider: quiet, its 25th percentile read 7-18 % above its whole passes, the
# kernel's 4-9 % (the median: 4-11 % and 3-7 %; BENCHMARKS.md, issue 33).

# Weight rows widened to fp32 at a time on a low-precision weight's large-step path: 512 x
# SmolLM2's 576 or 1536 columns is 1.2-3 MB of fp32, read back from the last-level cache by
# F.linear (measured as fast as widening the whole weight at once: module docstring).
_DEQUANT_TILE_ROWS = 512


@functools.cache
def _bf16_dots_here() -> bool:
    """Whether this process's bf16 linears can take the bf16 activations ``BF16_DOTS_ENV=1``
    asks for (the kernels loaded, AVX-512-BF16, the AVX-512 path); a warning, once, where they
    cannot: the weights are then widened to fp32 (the engine's facts say which)."""
    if cpu_kernels.supports_bf16_dots():
        return True
    log.warning(
        "%s=1, but this engine cannot round activations to bf16 (no AVX-512-BF16, the CPU "
        "kernels not loaded, or %s held to another path): bf16 weights are widened to fp32",
        BF16_DOTS_ENV,
        cpu_settings.ISA_ENV,
    )
    return False


def rounds_bf16_activations(weight_format: WeightFormat, *, by_default: bool = True) -> bool:
    """Whether projections held in ``weight_format`` round their activations to bf16 here: bf16
    on a CPU whose kernels take them (``cpu_kernels.supports_bf16_dots``) where ``by_default``,
    unless ``BF16_DOTS_ENV`` says otherwise ("1": wherever the kernels take them, "0": never).
    A model passes ``by_default`` False where its step cannot be batch-invariant
    (``step_attention``): a mixture of experts' fp32 expert products."""
    if weight_format != "bf16":
        return False
    wanted = bf16_dots_setting()
    if wanted is None:
        return by_default and cpu_kernels.supports_bf16_dots()
    return wanted and _bf16_dots_here()


def _low_precision_kernel_rows() -> int:
    """Up to how many rows a bf16 or int8 weight's product runs on the decode kernel:
    ``SMALL_BATCH_ROWS_ENV``'s count where it is set, else every row count. The kernel beats the
    tiles (fp32 widened and packed on every call) at every size measured, decode steps and
    prompt chunks alike: from 5 rows its later groups of activation rows run register-blocked
    over a weight tile held in L2. AMD EPYC Zen 4, 2 threads, ms for a whole step's projections
    (kernel / tiles): SmolLM2-135M's shapes, bf16, 8 rows 15 / 49, 128 rows 134 / 180, 512 rows
    523 / 591, 2,048 rows 2,254 / 2,414 (int8 alike); a 1B model's (8192x2048, 2048x8192,
    3072x2048; column-blocked), 128 rows 102 / 147 (bf16) and 97 / 143 (int8), 512 rows 423 /
    491 and 404 / 502. Before the register-blocked passes the kernel grew ~1.4x steeper than the
    tiles past 64 rows, which was then its bound (issue 33)."""
    setting = small_batch_rows_setting()
    return sys.maxsize if setting is None else setting


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


Shape = tuple[int, int]


def small_batch_rows(dtype: torch.dtype, shapes: Sequence[Shape] = ()) -> int:
    """Up to how many rows a prepacked fp32 ``Linear`` runs through its small-batch path (the
    decode kernel, else the dense ``F.linear``) rather than oneDNN (0: never):
    ``SMALL_BATCH_ROWS_ENV``, else measured on weights of ``shapes`` ([out, in] each: a model's
    projections; a stand-in shape where empty), once per process, thread count and shapes."""
    override = small_batch_rows_setting()
    if override is not None:
        return override
    if dtype != torch.float32 or not _onednn_works(dtype) or _under_memory_limit():
        return 0
    return _measured_small_batch_rows(torch.get_num_threads(), probe_shapes(shapes))


def probe_shapes(shapes: Sequence[Shape]) -> tuple[Shape, ...]:
    """The weights the probe measures, in turn: ``shapes``, each cut to its first rows where it
    exceeds ``_PROBE_MAX_WEIGHT_BYTES`` (at least one row); the stand-in where they hold fewer
    than ``_PROBE_MIN_LAYER_BYTES`` in all."""
    if sum(rows_out * rows_in * 4 for rows_out, rows_in in shapes) < _PROBE_MIN_LAYER_BYTES:
        return (_PROBE_SHAPE,)
    return tuple(
        (max(1, min(rows_out, _PROBE_MAX_WEIGHT_BYTES // (rows_in * 4))), rows_in)
        for rows_out, rows_in in shapes
    )


def keeps_one_copy(weight: torch.Tensor) -> bool:
    """Whether a ``Linear`` of ``weight`` holds it once, as the decode kernel's copy in 2 MB
    pages that oneDNN also runs from, unpacked, for larger batches: under a memory limit where
    the kernel serves ``weight`` and ``SMALL_BATCH_ROWS_ENV`` is not set."""
    return (
        uses_onednn(weight)
        and small_batch_rows_setting() is None
        and _under_memory_limit()
        and cpu_kernels.usable(weight)
    )


def small_batch_kernel() -> str:
    """What runs the small batches of fp32 CPU linears: ``"decode_matmul"`` (the C++ kernel,
    where it is built) or ``"dense"`` (torch's ``F.linear``)."""
    return "decode_matmul" if cpu_kernels.available() else "dense"


# cgroup v2, then v1: a container's memory limit as it sees it.
_CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


@functools.cache
def _under_memory_limit() -> bool:
    """Whether this process's cgroup caps its memory below the machine's."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < machine:
            log.info(
                "a memory limit of %d MiB is set (%s): the CPU weights are held once, in the "
                "decode kernel's pages where it is built (oneDNN runs larger steps from them "
                "unpacked), else packed for oneDNN (%s=N keeps both copies)",
                int(text) >> 20,
                path,
                SMALL_BATCH_ROWS_ENV,
            )
            return True
        return False  # "max", or v1's unlimited figure
    return False


def _small_batch_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if small_batch_kernel() == "decode_matmul":
        return cpu_kernels.decode_matmul(x, weight, isa=cpu_kernels.engine_isa())
    return functional.linear(x, weight)


def pass_seconds(calls: Sequence[tuple[Shape, float]]) -> float:
    """A probe pass's seconds from its calls' ``(weight shape, seconds)``: per shape, the
    lower median of its calls' times, times their count, summed. Calls slowed by a preempted
    thread count as the pass's ordinary ones (the comment on the probe's constants)."""
    by_shape: dict[Shape, list[float]] = {}
    for shape, seconds in calls:
        by_shape.setdefault(shape, []).append(seconds)
    return sum(len(times) * statistics.median_low(times) for times in by_shape.values())


@functools.cache
def _measured_small_batch_rows(threads: int, shapes: tuple[Shape, ...]) -> int:
    plain: list[torch.Tensor] = []
    held = 0
    while held < _PROBE_BYTES:  # the shapes in turn, each copy's values its own
        shape = shapes[len(plain) % len(shapes)]
        plain.append(torch.full(shape, 1.0 + len(plain) / 64))
        held += shape[0] * shape[1] * 4
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight) for weight in plain]
    # The small-batch path's weights as a Linear keeps them (for the kernel: in huge pages,
    # column-blocked where rows are wide).
    # Regions of the probe's own, gone with it (cpu_kernels.huge_page_copy).
    regions = cpu_kernels.SharedRegions()
    dense = (
        [cpu_kernels.decode_weight_copy(weight, regions) for weight in plain]
        if small_batch_kernel() == "decode_matmul"
        else plain
    )
    widths = sorted({rows_in for _, rows_in in shapes})
    # Activations for the row counts the stages measure, and oneDNN's padded count below its
    # least.
    measured_rows = {
        count
        for stage in _PROBE_STAGES
        for rows in stage
        for count in (rows, max(rows, ONEDNN_MIN_ROWS))
    }
    inputs = {
        (rows, width): torch.full((rows, width), 0.5)
        for rows in sorted(measured_rows)
        for width in widths
    }

    def one_pass(rows: int, small: bool) -> float:
        """Seconds for every copy (``pass_seconds`` of each call's): the small-batch path, or
        oneDNN at the rows the engine would run it with (padded to ``ONEDNN_MIN_ROWS``)."""
        calls: list[tuple[Shape, float]] = []
        padded = max(rows, ONEDNN_MIN_ROWS)
        for weight, kernel_weight, packed_weight in zip(plain, dense, packed, strict=True):
            shape = (int(weight.shape[0]), int(weight.shape[1]))
            start = time.perf_counter()
            if small:
                _small_batch_product(inputs[rows, shape[1]], kernel_weight)
            else:
                x = inputs[padded, shape[1]]
                torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")
            calls.append((shape, time.perf_counter() - start))
        return pass_seconds(calls)

    # Round after round, every candidate of a stage once, the fastest pass of each kept: engines
    # start beside other processes, and a load that comes or goes mid-probe then weighs on all
    # alike. oneDNN below ONEDNN_MIN_ROWS rows is the padded pass, measured once. The second
    # stage's row counts are measured only where the first's all went to the small-batch path.
    small: dict[int, float] = {}
    onednn: dict[int, float] = {}
    chosen = 0
    for stage in _PROBE_STAGES:
        small |= dict.fromkeys(stage, float("inf"))
        onednn_rows = [rows for rows in stage if rows >= ONEDNN_MIN_ROWS]
        onednn |= dict.fromkeys(onednn_rows, float("inf"))
        for _ in range(_PROBE_ROUNDS):
            for rows in stage:
                small[rows] = min(small[rows], one_pass(rows, small=True))
            for rows in onednn_rows:
                onednn[rows] = min(onednn[rows], one_pass(rows, small=False))
        for rows in stage:
            margin = _DENSE_MARGIN if chosen == 0 else 1.0
            if small[rows] > margin * onednn[max(rows, ONEDNN_MIN_ROWS)]:
                break
            chosen = rows
        if chosen != stage[-1]:
            break
    kernel = small_batch_kernel()
    choice = (
        f"CPU decode steps of at most {chosen} sequence(s) run through {kernel}, with a copy of "
        f"the weights kept for it ({SMALL_BATCH_ROWS_ENV}=0: never)"
        if chosen
        else f"CPU decode steps of every size run through oneDNN, one copy of the weights "
        f"({SMALL_BATCH_ROWS_ENV}=N: {kernel} up to N sequences)"
    )
    gigabytes = held / 1e9
    log.info(
        "%s; GB/s of weights read by rows %s: %s %s, oneDNN %s (padded to %d below it; %d "
        "threads; weights of %s)",
        choice,
        " / ".join(map(str, small)),
        kernel,
        " / ".join(f"{gigabytes / seconds:.1f}" for seconds in small.values()),
        " / ".join(f"{gigabytes / onednn[max(rows, ONEDNN_MIN_ROWS)]:.1f}" for rows in small),
        ONEDNN_MIN_ROWS,
        threads,
        ", ".join(f"{rows_out}x{rows_in}" for rows_out, rows_in in shapes),
    )
    return chosen


class Linear:
    """``x @ weight.T + bias`` over ``[rows, in_features]`` activations, plus fused variants.

    ``weight_format`` other than fp32 (a float32 CPU weight only): the weight is held as bf16,
    or as int8 with per-row ``scales``, and nothing else (module docstring). ``small_rows``:
    the model's ``small_batch_rows`` (measured on its shapes: ``KernelChoice``); None measures
    on the stand-in shape. ``rounds_activations``: whether a bf16 weight meets activations
    rounded to bf16 (the model's ``rounds_bf16_activations``; None: that rule's default)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_format: WeightFormat = DEFAULT_WEIGHT_FORMAT,
        small_rows: int | None = None,
        *,
        rounds_activations: bool | None = None,
    ) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.weight_format: WeightFormat = weight_format
        # int8's per-row scales (``weight_format``); None for the other formats.
        self.scales: torch.Tensor | None = None
        # Whether the decode kernel multiplies a bf16 weight by activations rounded to bf16
        # (``_hold_low_precision``).
        self.bf16_dots = False
        self.bias = bias
        if weight_format != DEFAULT_WEIGHT_FORMAT:
            self._hold_low_precision(weight, weight_format, rounds_activations)
            return
        self.onednn = uses_onednn(weight)
        # Whether ``dense`` is the only copy, which oneDNN also runs from (``keeps_one_copy``).
        self.one_copy = keeps_one_copy(weight)
        # Activations of at most this many rows go through ``dense`` (see the module docstring).
        self.small_rows = (
            SMALL_BATCH_MAX_ROWS
            if self.one_copy
            else (small_batch_rows(weight.dtype) if small_rows is None else small_rows)
            if self.onednn
            else 0
        )
        # Whether those run the C++ decode kernel (else torch's F.linear on ``dense``).
        self.decode_kernel = bool(self.small_rows) and cpu_kernels.usable(weight)
        # The weight for the small batches: the weight itself without oneDNN; the decode
        # kernel's copy (``cpu_kernels.decode_weight_copy``: huge pages, column-blocked where
        # rows are wide), row-major where oneDNN runs from it too (``one_copy``); F.linear's
        # dense copy; else None.
        self.dense: torch.Tensor | None = (
            weight
            if not self.onednn
            else cpu_kernels.huge_page_copy(weight)
            if self.decode_kernel and self.one_copy
            else cpu_kernels.decode_weight_copy(weight)
            if self.decode_kernel
            else weight.contiguous()
            if self.small_rows
            else None
        )
        # What oneDNN runs from: its opaque packed copy, or ``dense`` itself where that is the
        # only copy; the weight itself without oneDNN.
        self.weight: torch.Tensor = (
            weight
            if not self.onednn
            else self.dense
            if self.one_copy and self.dense is not None
            else torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        )

    def _hold_low_precision(
        self, weight: torch.Tensor, weight_format: WeightFormat, rounds_activations: bool | None
    ) -> None:
        """Only the bf16 or int8 copy (and int8's scales), for the decode kernel where it is
        built (huge pages), the library path for the rest (``_low_precision``)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(
                f"weight format {weight_format} converts float32 CPU weights, not "
                f"{weight.dtype} on {weight.device.type}"
            )
        if weight_format == "bf16":
            stored = to_bf16(weight)
        else:
            stored, self.scales = quantize_int8_per_channel(weight)
        self.onednn = False
        self.one_copy = True
        self.decode_kernel = cpu_kernels.available()
        self.small_rows = _low_precision_kernel_rows() if self.decode_kernel else 0
        self.bf16_dots = weight_format == "bf16" and (
            rounds_bf16_activations(weight_format)
            if rounds_activations is None
            else rounds_activations
        )
        self.dense = cpu_kernels.decode_weight_copy(stored) if self.decode_kernel else stored
        self.weight = self.dense

    @property
    def arithmetic(self) -> str:
        """How this linear's products are computed, for an engine's start-up facts."""
        if self.weight_format == DEFAULT_WEIGHT_FORMAT:
            return "fp32"
        if self.bf16_dots:
            return "bf16 weights x activations rounded to bf16, fp32 sums (AVX-512-BF16)"
        return f"{self.weight_format} weights widened to fp32, fp32 activations and sums"

    @property
    def nbytes(self) -> int:
        """The bytes of the weight as held for the small batches (fp32: the dense copy, else
        the packed one), with int8's scales; the bias not counted."""
        held = self.dense if self.dense is not None else self.weight
        if held.is_mkldnn:  # opaque: its element count is the weight's
            return self.out_features * self.in_features * held.element_size()
        return weight_bytes(held, self.scales)

    def _packed(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the prepacked oneDNN primitive: every row count but 1 to
        ``small_rows``, an empty ``x`` (a step whose prompt chunks need no logits yet)
        included, since no dense copy may be kept."""
        return self.onednn and not 0 < x.shape[0] <= self.small_rows

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the C++ decode kernel (a small batch of 2-D rows)."""
        return self.decode_kernel and x.dim() == 2 and 0 < x.shape[0] <= self.small_rows

    def _decode(
        self, x: torch.Tensor, epilogue: int, other: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert self.dense is not None
        return cpu_kernels.decode_matmul(
            _unit_stride_rows(x),
            self.dense,
            self.bias,
            None if other is None else _unit_stride_rows(other),
            epilogue,
            cpu_kernels.engine_isa(),
            self.scales,
            self.bf16_dots,
        )

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

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        assert self.dense is not None
        if self.weight_format != DEFAULT_WEIGHT_FORMAT:
            return self._low_precision(x)
        return functional.linear(x, self.dense, self.bias)

    def _low_precision(self, x: torch.Tensor) -> torch.Tensor:
        """A low-precision weight's product off the decode kernel, in fp32, widened in tiles
        (module docstring)."""
        assert self.dense is not None
        return tiled_dequantized_linear(x, self.dense, self.scales, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed(x):
            return self._onednn(x, "none")
        if self._kernel(x):
            return self._decode(x, cpu_kernels.EPILOGUE_NONE)
        return self._dense(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(self(x))``."""
        if self._packed(x):
            return self._onednn(x, "swish")
        if self._kernel(x):
            return self._decode(x, cpu_kernels.EPILOGUE_SILU)
        return functional.silu(self._dense(x), inplace=True)

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) * other``."""
        if self._packed(x):
            return self._onednn_binary(x, other, "mul")
        if self._kernel(x):
            return self._decode(x, cpu_kernels.EPILOGUE_MUL, other)
        return self._dense(x).mul_(other)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``self(x) + residual`` (a new tensor; ``residual`` is not modified)."""
        if self._packed(x):
            return self._onednn_binary(x, residual, "add")
        if self._kernel(x):
            return self._decode(x, cpu_kernels.EPILOGUE_ADD, residual)
        if self.bias is None and x.dim() == 2 and self.weight_format == DEFAULT_WEIGHT_FORMAT:
            assert self.dense is not None
            return torch.addmm(residual, x, self.dense.t())
        return self._dense(x).add_(residual)


def tiled_dequantized_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ dequantize(weight, scales).T (+ bias)`` in fp32, ``_DEQUANT_TILE_ROWS`` weight rows
    widened at a time, so that no fp32 copy of the whole weight is ever made; ``weight`` in
    either of ``cpu_kernels.decode_weight_copy``'s layouts."""
    rows = x.reshape(-1, x.shape[-1])
    out_features = int(weight.shape[-2])
    out = rows.new_empty(rows.shape[0], out_features)
    if rows.shape[0] > 0:
        for start in range(0, out_features, _DEQUANT_TILE_ROWS):
            stop = min(out_features, start + _DEQUANT_TILE_ROWS)
            tile = dequantize(
                cpu_kernels.weight_rows(weight, start, stop, int(rows.shape[1])),
                None if scales is None else scales[start:stop],
            )
            out[:, start:stop] = functional.linear(
                rows, tile, None if bias is None else bias[start:stop]
            )
    return out.reshape(*x.shape[:-1], out_features)


def _unit_stride_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the decode kernel reads them: 2-D, each row contiguous (a copy only where a
    row is not)."""
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def resident(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` detached, in memory of its own where it is on the CPU. A weight read from a
    safetensors file is a view of the file's memory map, and one such view kept after the model
    is converted keeps the whole mapping resident: SmolLM2-135M's embedding and norms held
    513 MiB of its file in RSS (file-backed) for 113 MiB of their own (issue 33)."""
    weight = weight.detach()
    return weight.clone() if weight.device.type == "cpu" else weight


def detached_weights(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformers ``nn.Linear``'s weight and bias, detached (the arguments of ``Linear``)."""
    bias = linear.bias
    return linear.weight.detach(), None if bias is None else bias.detach()


def fused_weights(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``Linear``'s weight and bias for several projections of the same input (their
    outputs concatenated): a missing bias is zeros where another projection has one."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return weight, None
    bias = torch.cat(
        [
            linear.bias.detach()
            if linear.bias is not None
            else weight.new_zeros(linear.out_features)
            for linear in linears
        ]
    )
    return weight, bias
