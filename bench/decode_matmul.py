"""GB/s of the CPU decode matmul (fp32 weights, 1 / 2 / 4 / 8 / 16 activation rows) beside the
machine's memory bandwidth and the libraries the engine could use instead, in one run.

    python bench/decode_matmul.py [--threads N] [--rows 1 2 4 8 16] [--shapes NAME ...]

A decode step reads every weight once, so its matmuls are worth the rate at which they stream
the weight: GB/s = weight bytes / seconds. Each shape is measured over copies of the weight
that together are several times the last-level cache (``--megabytes``), cycled, so that every
call reads its weight from memory as a decode step does. Beside it, in the same run:

- copy: a large memcpy (``Tensor.copy_``), bytes read + bytes written per second (STREAM's
  count), and read: a large sum's bytes read per second: what the memory gives;
- ours: ``cpu_kernels.decode_matmul`` on each instruction path this CPU runs, its weights as
  the engine keeps them (``cpu_kernels.decode_weight_copy``: huge pages, column-blocked where
  rows have 2,048 columns or more; there also "ours row-major", the fastest path on the
  row-major weight, to show what the blocking gains);
- torch: ``F.linear`` on the dense weight (MKL / oneDNN as torch dispatches it);
- oneDNN: the prepacked ``mkldnn._linear_pointwise`` the engine runs for larger batches, at
  the exact row count and padded to ``linear.ONEDNN_MIN_ROWS`` rows as the engine pads.

Each figure is the best of ``--rounds`` rounds (all candidates once per round, so that a load
that comes or goes weighs on all of them alike). On a machine shared with other work, ``--cpu-time``
(one thread) times each pass by the thread's CPU time, which time spent descheduled does not
inflate; memory traffic from the other processes still weighs on every candidate alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.nn import functional

from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers.linear import ONEDNN_MIN_ROWS

# (out_features, in_features): SmolLM2-135M's projections (qkv fused, gate and up apart as the
# engine runs them under oneDNN, the tied vocabulary projection), a 1B-class MLP and an
# 8B-class one (Llama-3-8B's 4096 / 14336).
SHAPES: dict[str, tuple[int, int]] = {
    "qkv 960x576": (960, 576),
    "o 576x576": (576, 576),
    "gate/up 1536x576": (1536, 576),
    "down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
    "up 8192x2048": (8192, 2048),
    "down 2048x8192": (2048, 8192),
    "up 14336x4096": (14336, 4096),
    "down 4096x14336": (4096, 14336),
}

Run = Callable[[torch.Tensor], object]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bandwidth(
    megabytes: int, rounds: int, clock: Callable[[], float]
) -> tuple[float, float]:
    """(copy GB/s counting bytes read + written, read GB/s of a sum) over ``megabytes``."""
    count = megabytes * (1 << 20) // 4
    source, target = torch.ones(count), torch.empty(count)
    best_copy = best_read = float("inf")
    for _ in range(rounds):
        start = clock()
        target.copy_(source)
        best_copy = min(best_copy, clock() - start)
        start = clock()
        source.sum()
        best_read = min(best_read, clock() - start)
    nbytes = count * 4
    return 2 * nbytes / best_copy / 1e9, nbytes / best_read / 1e9


def candidates(rows: int, plain: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """Each way to multiply ``rows`` activation rows by every copy of the weight, one pass."""
    in_features = plain[0].shape[1]
    x = torch.randn(rows, in_features)
    found: dict[str, Callable[[], object]] = {}
    if cpu_kernels.available():
        # As the engine keeps them for the kernel (cpu_kernels.decode_weight_copy).
        huge = [cpu_kernels.decode_weight_copy(w) for w in plain]
        for isa in (cpu_kernels.ISA_AVX512, cpu_kernels.ISA_AVX2, cpu_kernels.ISA_PORTABLE):
            if cpu_kernels.decode_matmul_supports(isa):
                name = f"ours {cpu_kernels.ISA_NAMES[isa]}"
                found[name] = _each(
                    huge, lambda w, isa=isa: cpu_kernels.decode_matmul(x, w, isa=isa)
                )
        if huge[0].dim() == 3:  # column-blocked: the same kernel on the row-major weight beside
            row_major = [cpu_kernels.huge_page_copy(w) for w in plain]
            found["ours row-major"] = _each(row_major, lambda w: cpu_kernels.decode_matmul(x, w))
    found["torch F.linear"] = _each(plain, lambda w: functional.linear(x, w))
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in plain]
        found["oneDNN"] = _each(
            packed, lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        )
        if rows < ONEDNN_MIN_ROWS:
            padded = torch.randn(ONEDNN_MIN_ROWS, in_features)
            found[f"oneDNN padded to {ONEDNN_MIN_ROWS}"] = _each(
                packed,
                lambda w: torch.ops.mkldnn._linear_pointwise(padded, w, None, "none", [], ""),
            )
    return found


def _each(weights: list[torch.Tensor], run: Run) -> Callable[[], object]:
    def one_pass() -> None:
        for weight in weights:
            run(weight)

    return one_pass


def measure(
    shape: tuple[int, int],
    rows_list: list[int],
    megabytes: int,
    rounds: int,
    clock: Callable[[], float],
) -> dict[int, dict[str, float]]:
    """GB/s of each candidate at each row count for ``shape``."""
    out_features, in_features = shape
    weight_bytes = out_features * in_features * 4
    count = max(2, megabytes * (1 << 20) // weight_bytes)
    copies = [torch.randn(out_features, in_features) for _ in range(count)]
    results: dict[int, dict[str, float]] = {}
    for rows in rows_list:
        runs = candidates(rows, copies)
        best = dict.fromkeys(runs, float("inf"))
        for run in runs.values():
            run()  # warm: first-call set-up, oneDNN's primitive cache
        for _ in range(rounds):
            for name, run in runs.items():
                start = clock()
                run()
                best[name] = min(best[name], clock() - start)
        results[rows] = {
            name: count * weight_bytes / seconds / 1e9 for name, seconds in best.items()
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--megabytes", type=int, default=256, help="weight copies per shape, together (MiB)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by the thread's CPU time, not the wall clock (needs --threads 1)",
    )
    args = parser.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time times one thread: give --threads 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if not cpu_kernels.available():
        print("the CPU kernels are not built here: only torch and oneDNN are measured")
    copy, read = memory_bandwidth(args.megabytes * 2, args.rounds, clock)
    print(
        f"{_cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')} UTC, {'CPU' if args.cpu_time else 'wall'} time, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"memory: copy {copy:.1f} GB/s (read + written), read {read:.1f} GB/s (a sum)")
    for name in args.shapes:
        results = measure(SHAPES[name], args.rows, args.megabytes, args.rounds, clock)
        columns = list(next(iter(results.values())))
        for by_rows in results.values():
            columns.extend(c for c in by_rows if c not in columns)
        print(f"\n{name} (GB/s of weight read; x read bandwidth)")
        print("| rows | " + " | ".join(columns) + " |")
        print("|---:|" + "---:|" * len(columns))
        for rows, by_name in results.items():
            cells = [
                f"{by_name[c]:.1f} ({by_name[c] / read:.2f}x)" if c in by_name else "-"
                for c in columns
            ]
            print(f"| {rows} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
