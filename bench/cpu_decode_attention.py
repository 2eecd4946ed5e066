"""GB/s of the CPU decode attention (``cpu_kernels.decode_attention``) beside the machine's
read bandwidth and torch's gathered reference, in one run.

    python bench/cpu_decode_attention.py [--threads N] [--batches 1 2 8] [--contexts ...]

A decode step's attention reads each sequence's cached keys and values once, so it is worth
the rate at which it streams them: GB/s = K and V bytes / seconds. Each case is measured over
copies of a layer's pool that together are several times the last-level cache (``--megabytes``),
cycled, so that every call reads from memory as a step over many layers does; each pool's
blocks are shuffled, as a long-running engine's are. Beside it, in the same run: read, a large
sum's bytes read per second (what the memory gives), and torch, the gathered reference
(``attention.paged_decode_attention_reference``) on the same copies. Each figure is the best of
``--rounds`` rounds, all candidates once per round.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from paged_cases import PagedCase, make_paged_case

from bench.decode_matmul import _cpu_name, memory_bandwidth
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers.attention import paged_decode_attention_reference

# (query heads, KV heads, head size): SmolLM2-135M's and a Llama-3-8B-shaped model's.
HEADS: dict[str, tuple[int, int, int]] = {
    "SmolLM2 9/3x64": (9, 3, 64),
    "8B 32/8x128": (32, 8, 128),
}
BLOCK_SIZE = 16


def measure(
    heads: tuple[int, int, int],
    batch: int,
    context: int,
    megabytes: int,
    rounds: int,
    with_torch: bool,
) -> dict[str, float]:
    """GB/s of each candidate for ``batch`` sequences of ``context`` tokens."""
    num_heads, num_kv_heads, head_dim = heads
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 4
    count = max(2, megabytes * (1 << 20) // kv_bytes)
    cases: list[tuple[PagedCase, torch.Tensor]] = []
    for seed in range(count):
        case = make_paged_case(
            [context] * batch,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=BLOCK_SIZE,
            seed=seed,
        )
        cases.append((case, torch.stack((case.k_cache, case.v_cache))))
    runs: dict[str, Callable[[], object]] = {}
    if cpu_kernels.available():
        runs["ours"] = lambda: [
            cpu_kernels.decode_attention(c.query, p, c.block_tables, c.seq_lens, c.scale)
            for c, p in cases
        ]
    if with_torch:
        runs["torch"] = lambda: [paged_decode_attention_reference(*c.args()) for c, _ in cases]
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: count * kv_bytes / seconds / 1e9 for name, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 320, 1024, 4096])
    parser.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=list(HEADS))
    parser.add_argument("--megabytes", type=int, default=128, help="pool copies, together (MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip the gathered reference")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        print("the CPU kernels are not built here: only torch is measured")
    _, read = memory_bandwidth(256, args.rounds, time.perf_counter)
    print(f"{_cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"read {read:.1f} GB/s (a large sum)\n")
    for name in args.heads:
        print(f"{name}, blocks of {BLOCK_SIZE} (GB/s of K and V read; x read bandwidth)")
        print("| sequences | tokens each | ours | torch |")
        print("|---:|---:|---:|---:|")
        for batch in args.batches:
            for context in args.contexts:
                rates = measure(
                    HEADS[name], batch, context, args.megabytes, args.rounds, not args.no_torch
                )
                cells = [
                    f"{rates[key]:.1f} ({rates[key] / read:.2f}x)" if key in rates else "-"
                    for key in ("ours", "torch")
                ]
                print(f"| {batch} | {context} | {' | '.join(cells)} |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
