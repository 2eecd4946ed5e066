"""C++ kernels for the CPU forward's glue in fp32: RMSNorm, RoPE with the KV write, and decode
attention read in place from the paged pool (``csrc/cpu_kernels.cpp``).

torch runs each of these as several operations with a tensor written and read back between
them. Measured on SmolLM2-135M shapes, one thread (AMD EPYC Zen 4, torch 2.13, issue 16):
decode attention for 4 sequences of ~220 tokens took ~180 us a layer as an ``index_select``
of the sequences' blocks plus a masked SDPA, ~55 us here, where each sequence's keys and values
are read once, in place, through its block table; RMSNorm ~20 us for 4 rows (five operations),
~3 us here; RoPE plus the KV write (a complex product and an ``index_put_``) ~35 us, a loop
here. vLLM's CPU build has C++ kernels of its own for the same reason.

Built on first use with the C++ compiler (``$CXX``, else ``g++``) against the installed torch's
headers, for this CPU (``-march=native``), into ``$DPSERVE_CACHE/cpu-kernels/<key>``; the key
hashes the source, the flags, torch's version and the CPU's model and feature flags, so a cache
shared by two machines never loads code built for the other. Engines that start together wait
on one file lock, and one builds.

Where no compiler is (the container images have none), a prebuilt library named by
``$DPSERVE_CPU_KERNELS_PREBUILT`` is loaded instead if it was built for this torch version and
the CPU has what it was compiled for:
``python -m dpserve.engine.kernels.cpu_kernels --portable OUT`` builds one for x86-64-v3 (AVX2
and FMA: every x86 server since ~2015), and ``scripts/build-images.sh`` puts one in the
runtime image. Without either, on a failed build, or with ``DPSERVE_CPU_KERNELS=0``,
``available()`` is False and the model runs torch's operations instead (the same results to
~1e-6). ``python -m dpserve.engine.kernels.cpu_kernels`` builds ahead of time (``make setup``
does) and prints where the library is, or why there is none.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from dpserve import cpu_settings
from dpserve.model_loading import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# The glue kernels, compiled for this CPU (``-march=native``), and the decode matmul, compiled
# for a baseline target, its AVX2 and AVX-512 paths by function attributes and chosen at run
# time (a baseline below them, so that the AVX2 path holds no AVX-512 instruction and is the
# code an AVX2-only CPU runs, whichever CPU built it): one library.
GLUE_SOURCE = CSRC / "cpu_kernels.cpp"
MATMUL_SOURCE = CSRC / "decode_matmul.cpp"
# Every decoder layer of a decode step in one call, over the two above; compiled as the glue.
LAYERS_SOURCE = CSRC / "decode_layers.cpp"
SOURCES = (GLUE_SOURCE, MATMUL_SOURCE, LAYERS_SOURCE)
# What they include (from their own directory); part of the build's key as the sources are.
HEADERS = (CSRC / "exp_nonpositive.h", CSRC / "cpu_ops.h")
DISABLE_VARIABLE = "DPSERVE_CPU_KERNELS"
PREBUILT_VARIABLE = "DPSERVE_CPU_KERNELS_PREBUILT"
# A portable build's target, and the /proc/cpuinfo flags a CPU needs to run it.
PORTABLE_ARCH = "-march=x86-64-v3"
# The decode matmul's target outside its attributed paths (x86): what every x86-64 CPU since
# ~2009 runs.
MATMUL_BASELINE_ARCH = "-march=x86-64-v2"
PORTABLE_CPU_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"})
# Reassociation lets the compiler sum dot products as a tree of vector adds (in source order
# it adds 16 lanes one after another); no flag here assumes values are finite.
_OPTIMIZE = (
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
_BUILD_SECONDS = 600


def _arch_flags() -> tuple[str, ...]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ("-march=native",)
    if machine in ("aarch64", "arm64"):
        return ("-mcpu=native",)
    return ()


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    found: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        name = name.strip()
        if name in wanted and name not in found:
            found[name] = value.strip()
    return "\n".join(f"{name}: {value}" for name, value in sorted(found.items()))


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def _compile_flags() -> list[str]:
    torch_dir = _torch_dir()
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    return [
        *_OPTIMIZE,
        "-std=c++20",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]


def _matmul_arch_flags() -> tuple[str, ...]:
    machine = platform.machine().lower()
    return (MATMUL_BASELINE_ARCH,) if machine in ("x86_64", "amd64") else _arch_flags()


def compile_commands(
    compiler: str, output: Path, arch: tuple[str, ...] | None = None
) -> list[list[str]]:
    """The compiler's command lines, in order: the decode matmul's object (``output`` with the
    suffix ``.matmul.o``), then the library linked with it; ``arch`` (default: this CPU's) is
    the glue's target."""
    torch_dir = _torch_dir()
    matmul_object = output.with_suffix(".matmul.o")
    return [
        [
            compiler,
            *_compile_flags(),
            *_matmul_arch_flags(),
            "-c",
            str(MATMUL_SOURCE),
            "-o",
            str(matmul_object),
        ],
        [
            compiler,
            *_compile_flags(),
            *(_arch_flags() if arch is None else arch),
            "-shared",
            str(GLUE_SOURCE),
            str(LAYERS_SOURCE),
            str(matmul_object),
            "-o",
            str(output),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            "-ltorch_cpu",
            # torch's own libgomp (same soname), so that one OpenMP runtime runs both.
            f"-Wl,-rpath,{torch_dir / 'lib'}",
        ],
    ]


def build_key(compiler: str, arch: tuple[str, ...] | None = None) -> str:
    digest = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        *(
            " ".join(command).encode()
            for command in compile_commands(compiler, Path("out.so"), arch)
        ),
        torch.__version__.encode(),
        _cpu_identity().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _compiler() -> str | None:
    configured = os.environ.get("CXX")
    return shutil.which(configured) if configured else shutil.which("g++")


def _required_compiler() -> str:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler ($CXX or g++ on PATH)")
    return compiler


def _compile(compiler: str, library: Path, arch: tuple[str, ...] | None = None) -> None:
    """Compiles into ``library`` through a temporary file beside it, so that a reader never
    sees half a library."""
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".partial-") as scratch:
        partial = Path(scratch) / library.name
        for command in compile_commands(compiler, partial, arch):
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=_BUILD_SECONDS, check=False
            )
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        # Written 0644 under a 022 umask; made readable by the image's own user whatever it is.
        os.chmod(partial, 0o755)
        os.replace(partial, library)


def build(portable: bool = False) -> Path:
    """The compiled library, built now unless the cache has it; raises ``RuntimeError`` with
    the compiler's message when it cannot be built. ``portable``: the x86-64-v3 build, with the
    torch version beside it, so that ``prebuilt`` takes it (what ``build_portable`` copies into
    an image; the tests' local Kubernetes node gives it to its pods as the runtime image
    does)."""
    compiler = _required_compiler()
    # What an AVX2-only CPU builds, when the engine is told to run its AVX2 path
    # (cpu_settings.ISA_ENV).
    arch = (PORTABLE_ARCH,) if portable or engine_isa() == ISA_AVX2 else None
    directory = cache_dir() / "cpu-kernels" / build_key(compiler, arch)
    library = directory / "dpserve_cpu_kernels.so"
    # The key holds torch's version: the file is written once, before the library, so that a
    # process that finds the library finds it too.
    version_file = _torch_version_file(library)
    if library.exists() and (arch is None or version_file.exists()):
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if arch is not None and not version_file.exists():
            partial = version_file.with_name(f".{version_file.name}.{os.getpid()}")
            partial.write_text(torch.__version__ + "\n")
            os.replace(partial, version_file)
        if library.exists():  # another process built it while this one waited
            return library
        log.info("building the CPU kernels into %s (once per CPU and torch version)", directory)
        _compile(compiler, library, arch)
    return library


def _torch_version_file(library: Path) -> Path:
    return library.with_name(library.name + ".torch-version")


def build_portable(library: Path) -> Path:
    """A library for any x86-64-v3 CPU at ``library``, with the torch version it was built
    against beside it (``<library>.torch-version``): what a container image ships. A copy of
    the cache's portable build (``build(portable=True)``, compiled there once), the version
    file first, each replaced whole."""
    cached = build(portable=True)
    library.parent.mkdir(parents=True, exist_ok=True)
    for source, target in (
        (_torch_version_file(cached), _torch_version_file(library)),
        (cached, library),
    ):
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copyfile(source, partial)
        os.chmod(partial, 0o755 if target == library else 0o644)
        os.replace(partial, target)
    return library


def _cpu_flags() -> frozenset[str]:
    for line in _cpu_identity().splitlines():
        name, _, value = line.partition(":")
        if name == "flags":
            return frozenset(value.split())
    return frozenset()


def prebuilt(library: Path, cpu_flags: frozenset[str] | None = None) -> Path:
    """``library`` if this process may load it (built for this torch version, this CPU has
    x86-64-v3); raises ``RuntimeError`` saying why not."""
    if not library.is_file():
        raise RuntimeError(f"no prebuilt library at {library}")
    try:
        built_for = _torch_version_file(library).read_text().strip()
    except OSError as exc:
        raise RuntimeError(f"{library} does not say which torch it was built for") from exc
    if built_for != torch.__version__:
        raise RuntimeError(f"{library} was built for torch {built_for}, not {torch.__version__}")
    missing = PORTABLE_CPU_FLAGS - (_cpu_flags() if cpu_flags is None else cpu_flags)
    if platform.machine().lower() not in ("x86_64", "amd64") or missing:
        raise RuntimeError(f"{library} needs an x86-64-v3 CPU (missing: {sorted(missing)})")
    return library


def _library() -> Path:
    """This machine's build, else the prebuilt library where the build is impossible."""
    try:
        return build()
    except RuntimeError as exc:
        configured = os.environ.get(PREBUILT_VARIABLE)
        if not configured:
            raise
        log.info("CPU kernels not built here (%s): trying %s", exc, configured)
        return prebuilt(Path(configured))


@functools.cache
def available() -> bool:
    """Whether the kernels are loaded (built first if needed); False, with the reason logged
    once, where they cannot be or are switched off."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        log.info("CPU kernels switched off (%s=0): using torch's operations", DISABLE_VARIABLE)
        return False
    if not sys.platform.startswith("linux"):
        log.info("CPU kernels are built on Linux only: using torch's operations")
        return False
    try:
        library = _library()
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        log.warning("CPU kernels unavailable (%s): using torch's operations", exc)
        return False
    log.info("CPU kernels loaded from %s", library)
    return True


def usable(tensor: torch.Tensor) -> bool:
    """Whether the kernels serve a model whose weights are ``tensor``'s dtype and device."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and available()


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of ``[rows, hidden]`` rows (a new tensor)."""
    out: torch.Tensor = torch.ops.dpserve_cpu.rms_norm(hidden, weight, eps)
    return out


def rotate_and_write_kv(
    qkv: torch.Tensor,
    rotation_pairs: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_pair: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """RoPE on the query and key heads of ``qkv`` ``[tokens, (heads + 2 kv_heads) * dim]`` (in
    RoPE-pair order) in place, by ``rotation_pairs`` ``[positions, dim / 2, 2]`` (cos, sin),
    then each token's key and value written to its slot of ``kv_pair``. ``head_norms`` (query
    weight, key weight, eps; ``[dim]`` in RoPE pair order): each query and key head is
    RMS-normalised first, in the same pass (Qwen3)."""
    query_norm, key_norm, eps = head_norms if head_norms is not None else (None, None, 0.0)
    torch.ops.dpserve_cpu.rotate_and_write_kv(
        qkv,
        rotation_pairs,
        positions,
        slot_mapping,
        kv_pair,
        num_heads,
        num_kv_heads,
        query_norm,
        key_norm,
        eps,
    )


def decode_attention(
    query: torch.Tensor,
    kv_pair: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``[batch, heads * dim]``: what ``attention.paged_decode_attention_reference``
    computes, for ``query`` ``[batch, heads, dim]`` over a layer's ``kv_pair``.
    ``batch_invariant``: each row's result the same bits whatever the other rows and the thread
    count (``step_attention``)."""
    out: torch.Tensor = torch.ops.dpserve_cpu.decode_attention(
        query, kv_pair, block_tables, seq_lens, scale, batch_invariant
    )
    return out


# The columns of B whose non-zero rank rows ``lora_delta`` is told (csrc: kLoraSpanColumns).
LORA_SPAN_COLUMNS = 64


def lora_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    spans: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
) -> None:
    """``out[row] += x[row] @ a[i] @ b[i]`` in place for each row of ``rows`` (int64, adapter
    by adapter; adapter ``i``'s run begins at ``starts[i]``), ``a`` ``[adapters, in, rank]``,
    ``b`` ``[adapters, rank, width]`` (rank a multiple of 16), ``spans`` ``[adapters,
    ceil(width / LORA_SPAN_COLUMNS), 2]`` the rank rows of ``b`` not all zero in each block of
    columns (``lora.sorted_rows``)."""
    torch.ops.dpserve_cpu.lora_delta(x, out, a, b, spans, rows, starts)


# What ``decode_matmul`` does after the product (csrc/decode_matmul.cpp's Epilogue).
EPILOGUE_NONE, EPILOGUE_SILU, EPILOGUE_MUL, EPILOGUE_ADD = range(4)
# Which instruction path computes it (csrc/decode_matmul.cpp's Isa): the fastest this CPU
# runs, or one named (for the tests and the bench; refused where the CPU lacks it), in the order
# of ``cpu_settings.ISA_CHOICES``.
ISA_AUTO, ISA_PORTABLE, ISA_AVX2, ISA_AVX512 = range(len(cpu_settings.ISA_CHOICES))
ISA_NAMES = dict(enumerate(cpu_settings.ISA_CHOICES))


# The instruction path the engine's layers use (``cpu_settings.ISA_ENV``, read once; refused by
# name where unknown): every product asks, so no wrapper of its own.
engine_isa = cpu_settings.isa_setting


# Rows of at least this many columns are held column-blocked for ``decode_matmul``, in chunks
# of at most ``CHUNK_COLUMNS`` (decode_matmul.cpp: a pass then re-reads a chunk of each
# activation row from L1, not a whole wide row from L2; Llama-3-8B's shapes, Zen 4, one thread:
# 2-4 rows 9-13 -> 22-29 GB/s). SmolLM2's rows (576 and 1,536 columns) stay row-major. Not so on
# every CPU: on an Intel Xeon, 2 threads, the same shapes at 4-8 rows read 17-21 GB/s blocked
# against 18-27 row-major (level at 1-2 rows), where the probe sent fp32 steps of 4+ rows to
# oneDNN anyway; one thread, 14336x4096, blocked / row-major at 1 / 2 / 4 / 8 rows: fp32 1.12 /
# 1.08 / 0.78 / 0.89, bf16 1.21 / 1.23 / 0.80 / 0.96, int8 1.28 / 1.01 / 0.75 / 1.09
# (BENCHMARKS.md, 2026-12-01: not yet chosen per CPU).
BLOCK_FROM_COLUMNS = 2048
CHUNK_COLUMNS = 1024


def chunk_width(columns: int) -> int:
    """The columns a chunk of a column-blocked weight with rows of ``columns`` holds: the rows
    split as evenly as whole 16-column vectors allow into chunks of at most ``CHUNK_COLUMNS``
    (3,584 columns: 4 of 896; 14,336: 14 of 1,024)."""
    chunks = -(-columns // CHUNK_COLUMNS)
    per_chunk = -(-columns // chunks)
    return -(-per_chunk // 16) * 16


def decode_weight_copy(weight: torch.Tensor, shared: SharedRegions | None = None) -> torch.Tensor:
    """``weight`` ``[n, k]`` as ``decode_matmul`` reads it fastest, in 2 MB pages
    (``huge_page_copy``, ``shared`` as there): column-blocked, ``[chunks, n, chunk_width(k)]``
    (every row's first chunk of columns, then every row's next; zeros past column k), where k
    is at least ``BLOCK_FROM_COLUMNS``, else as it is."""
    rows, columns = int(weight.shape[0]), int(weight.shape[1])
    if columns < BLOCK_FROM_COLUMNS:
        return huge_page_copy(weight, shared)
    width = chunk_width(columns)
    chunks = -(-columns // width)
    padded = weight.new_zeros(rows, chunks * width)
    padded[:, :columns] = weight
    return huge_page_copy(padded.view(rows, chunks, width).transpose(0, 1), shared)


def weight_rows(weight: torch.Tensor, start: int, stop: int, columns: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a weight as ``[stop - start, columns]``, whichever of
    ``decode_weight_copy``'s layouts it is held in (a column-blocked one's rows gathered)."""
    if weight.dim() == 2:
        return weight[start:stop]
    return weight[:, start:stop].transpose(0, 1).reshape(stop - start, -1)[:, :columns]


def decode_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    other: torch.Tensor | None = None,
    epilogue: int = EPILOGUE_NONE,
    isa: int = ISA_AUTO,
    scales: torch.Tensor | None = None,
    bf16_dots: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a few fp32 rows of ``x`` ``[rows, k]``, ``weight``
    ``[n, k]`` contiguous or column-blocked (``decode_weight_copy``), each weight row read once
    for all rows; then ``silu`` of it, or it
    times or plus ``other`` ``[rows, n]`` (``epilogue``). A new fp32 ``[rows, n]`` tensor.
    ``weight`` is fp32, bf16, or int8 with fp32 ``scales`` ``[n]`` (the product is then
    ``x @ (weight * scales[:, None]).T``, summed in fp32: ``layers.weight_format``).
    ``bf16_dots``: a bf16 ``weight`` against ``x`` rounded to bf16, the products summed in fp32
    (AVX-512-BF16's dot-product instruction: ``supports_bf16_dots``; refused elsewhere)."""
    out: torch.Tensor = torch.ops.dpserve_cpu.decode_matmul(
        x, weight, bias, other, epilogue, isa, scales, bf16_dots
    )
    return out


# Transparent huge pages' size on x86-64 and most arm64 kernels.
HUGE_PAGE_BYTES = 2 << 20


# Weights under a huge page share regions of this many bytes, each from a cache line's boundary:
# a region of its own would hold such a weight in 4 KB pages (the part of a region that is not
# a whole, aligned 2 MB gets no huge page), and every projection of a bf16 or int8 SmolLM2-135M
# is under 2 MB. A one-sequence step's bf16 projections of its shapes streamed at 33 GB/s apart
# and 40 shared (2 threads, Zen 4, medians of 30 alternating rounds; int8 22 and 25; issue 33).
SHARED_REGION_BYTES = 32 << 20
_SHARED_ALIGNMENT = 64


def huge_page_copy(weight: torch.Tensor, shared: SharedRegions | None = None) -> torch.Tensor:
    """A contiguous copy of ``weight`` in memory the kernel is asked to back with 2 MB pages
    (``madvise(MADV_HUGEPAGE)``, which transparent huge pages honour in their default
    ``madvise`` mode), for ``decode_matmul`` to stream: with 4 KB pages a weight streamed from
    memory misses the TLB every 64 cache lines, and a SmolLM2-135M decode step of one sequence
    took ~33 CPU ms against ~27 (Zen 4, one thread, issue 33). A weight of at least a huge page
    gets a region of its own, starting on a page; smaller ones share regions (``shared``'s, by
    default the process's), each freed once no weight in it is alive and no more are placed in
    it: copies that live briefly (the engine's probe) take regions of their own, so that they
    do not hold a model's regions' memory. A plain contiguous copy where the platform has no
    such advice."""
    nbytes = weight.numel() * weight.element_size()
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return weight.contiguous().clone()
    if nbytes >= HUGE_PAGE_BYTES:
        raw = _huge_page_region(nbytes)
    else:
        raw = (shared if shared is not None else _SHARED).take(nbytes)
    out = raw.view(weight.dtype).view(weight.shape)
    out.copy_(weight)
    return out


def _huge_page_region(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous memory advised into huge pages, from a 2 MB boundary, as uint8
    (the tensor holds the mapping as long as it or a view of it lives)."""
    # Over-allocated by a page so that the bytes can start on a 2 MB boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + nbytes]


class SharedRegions:
    """Slices of ``SHARED_REGION_BYTES`` regions for weights under a huge page, handed out in
    turn; the next region is mapped when one is full. Its pages are committed as weights are
    written, so the unused end of the region in use costs no memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._region: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (at most ``SHARED_REGION_BYTES``) of a region, from a cache line."""
        with self._lock:
            start = self._used + -self._used % _SHARED_ALIGNMENT
            if self._region is None or start + nbytes > SHARED_REGION_BYTES:
                self._region, start = _huge_page_region(SHARED_REGION_BYTES), 0
            self._used = start + nbytes
            return self._region[start : start + nbytes]


_SHARED = SharedRegions()


def decode_matmul_supports(isa: int) -> bool:
    """Whether this CPU runs ``decode_matmul``'s instruction path ``isa``."""
    return bool(torch.ops.dpserve_cpu.decode_matmul_supports(isa))


def decode_matmul_supports_bf16_dots() -> bool:
    """Whether this CPU runs ``decode_matmul``'s ``bf16_dots`` (AVX-512-BF16)."""
    return bool(torch.ops.dpserve_cpu.decode_matmul_supports_bf16_dots())


@functools.cache
def supports_bf16_dots() -> bool:
    """Whether the engine's ``decode_matmul`` calls take ``bf16_dots`` here: the kernels are
    loaded, the CPU has AVX-512-BF16 and ``cpu_settings.ISA_ENV`` leaves the AVX-512 path to
    them."""
    return (
        available()
        and engine_isa() in (ISA_AUTO, ISA_AVX512)
        and decode_matmul_supports_bf16_dots()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpserve.engine.kernels.cpu_kernels",
        description="build the CPU kernels for this machine (into the cache) or, with "
        "--portable, for any x86-64-v3 CPU (for an image)",
    )
    parser.add_argument("--portable", type=Path, metavar="LIBRARY", help="where to write it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        library = build_portable(args.portable) if args.portable else build()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"CPU kernels not built ({exc}); engines will use torch's operations")
        return 1 if args.portable else 0
    print(f"CPU kernels: {library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
