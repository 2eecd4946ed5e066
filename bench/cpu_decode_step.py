"""Decode step time on CPU of a random-weight Llama-shaped model (or a model directory) at 1 to 16
sequences, four ways in one run: the engine as it runs by default (every layer in one C++ call,
``layers.cpu_decode_layers``, over the C++ decode kernel, rows of 2,048 columns or more
column-blocked), the same with the layers run from Python one torch operation at a time
(``DPSERVE_CPU_FUSED_DECODE=0``), the kernel on row-major weights, and every step on oneDNN.

    python bench/cpu_decode_step.py [--shape 1b|8b] [--layers 4] [--model DIR]
                                    [--rows 1 2 4 8 16] [--steps 10]

``--shape`` picks a decoder layer's dimensions (``1b``: Llama-3.2-1B's, hidden 2,048, MLP 8,192;
``8b``: Llama-3-8B's, 4,096 and 14,336), ``--layers`` how many; the vocabulary is the embedded
SmolLM2's (its tokenizer, 49,152 tokens), so that the layers, not the vocabulary projection,
dominate. ``--model`` times that model instead (``smollm2-135m-instruct``: the embedded one).
The model is written once to a temporary directory and loaded by a ``ModelRunner`` per way, with
``DPSERVE_CPU_SMALL_BATCH_ROWS`` set (``cpu_settings.DECODE_MATMUL_MAX_ROWS``, or 0 for oneDNN)
so that no start-up probe decides; the row-major way raises ``cpu_kernels.BLOCK_FROM_COLUMNS``
out of reach before loading.
For each row count, ``rows`` greedy requests of 32 prompt tokens decode together (EOS ignored)
in one runner per way, all loaded first; after 3 warm-up steps the figure is the median over
``--runs`` of the mean of ``--steps`` steps (wall time), beside the GB/s of projection weights it
streams (fp32 bytes / step time). The ways take turns run by run, each run starting from the
next way, so that a load that comes or goes, or the host's drift, weighs on all alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.decode_matmul import _cpu_name
from dpserve import cpu_settings
from dpserve.cpu_settings import SMALL_BATCH_ROWS_ENV
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.model_loading import DEFAULT_MODEL, resolve_model
from dpserve.sampling import SamplingParams


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int


SHAPES = {"1b": Shape(2048, 8192, 32, 8), "8b": Shape(4096, 14336, 32, 8)}
# name -> (small-batch rows, column-blocked, layers in one C++ call where a step fits)
WAYS = {
    "kernel, blocked (default)": (cpu_settings.DECODE_MATMUL_MAX_ROWS, True, True),
    "kernel, blocked, layers from Python": (cpu_settings.DECODE_MATMUL_MAX_ROWS, True, False),
    "kernel, row-major": (cpu_settings.DECODE_MATMUL_MAX_ROWS, False, True),
    "oneDNN": (0, False, True),
}
PROMPT_TOKENS = 32


def write_model(directory: Path, shape: Shape, layers: int) -> None:
    """A random Llama of ``shape`` with SmolLM2's tokenizer in ``directory``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)


def projection_bytes(path: Path) -> int:
    """The fp32 bytes of the model's projections as the engine holds them
    (``projections()``: every layer's and the lm_head), loaded once without the probe."""
    os.environ[SMALL_BATCH_ROWS_ENV] = "0"
    model = ModelRunner(str(path), device="cpu", max_num_seqs=1).backend.model
    return sum(linear.out_features * linear.in_features * 4 for linear in model.projections())


def prepared(path: Path, rows: int, way: tuple[int, bool, bool]) -> ModelRunner:
    """A runner of ``rows`` sequences loaded one way, every sequence decoding and warm."""
    small_rows, blocked, fused = way
    os.environ[SMALL_BATCH_ROWS_ENV] = str(small_rows)
    os.environ[cpu_settings.FUSED_DECODE_ENV] = "1" if fused else "0"
    saved = cpu_kernels.BLOCK_FROM_COLUMNS
    if not blocked:
        cpu_kernels.BLOCK_FROM_COLUMNS = 1 << 62
    try:
        runner = ModelRunner(str(path), device="cpu", max_num_seqs=rows)
    finally:
        cpu_kernels.BLOCK_FROM_COLUMNS = saved
    runner.eos_token_ids = frozenset()
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=100_000)
    for request in range(rows):
        prompt = [(7 * request + token) % 1000 + 10 for token in range(PROMPT_TOKENS)]
        runner.add(RunnerRequest(request, prompt, params))
    for _ in range(3 + rows):  # every prompt in, every sequence decoding, warm
        runner.step()
    return runner


def step_ms(runner: ModelRunner, steps: int) -> float:
    """The mean ms of ``steps`` decode steps."""
    start = time.perf_counter()
    for _ in range(steps):
        runner.step()
    return (time.perf_counter() - start) * 1000 / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--model", help="a model directory or name to time instead of the random shape"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        print("the CPU kernels are not built here: nothing to compare")
        return 1
    shape = SHAPES[args.shape]
    what = args.model or f"{args.shape} layers x {args.layers}"
    print(
        f"{_cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')} UTC; {what}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch)
        if args.model:
            path = Path(resolve_model(args.model))
        else:
            write_model(path, shape, args.layers)
        nbytes = projection_bytes(path)
        print(f"projection weights: {nbytes / 1e9:.2f} GB fp32\n")
        results: dict[str, dict[int, float]] = {way: {} for way in WAYS}
        for rows in args.rows:
            runners = {name: prepared(path, rows, way) for name, way in WAYS.items()}
            means: dict[str, list[float]] = {name: [] for name in WAYS}
            for run in range(args.runs):  # the ways in turn, each run from the next one
                names = list(WAYS)[run % len(WAYS) :] + list(WAYS)[: run % len(WAYS)]
                for name in names:
                    means[name].append(step_ms(runners[name], args.steps))
            for name in WAYS:
                results[name][rows] = statistics.median(means[name])
            del runners
        print("| sequences | " + " | ".join(WAYS) + " |")
        print("|---:|" + "---:|" * len(WAYS))
        for rows in args.rows:
            cells = [
                f"{results[way][rows]:.1f} ms ({nbytes / 1e6 / results[way][rows]:.1f} GB/s)"
                for way in WAYS
            ]
            print(f"| {rows} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
