"""GPU engine throughput on random-weight models of real shapes (issue 10, "What it must show" 1;
the Qwen3 shapes for issue 31).

    python bench/engine_gpu.py --shape both              # 1B and 8B Llama shapes on one GPU
    python bench/engine_gpu.py --shape qwen3-8b,qwen3-30b-a3b   # Qwen3 dense and MoE shapes
    python bench/engine_gpu.py --shape 1b --quick        # fewer requests, shorter outputs
    python bench/engine_gpu.py --device cpu --shape tiny,tiny-moe --quick   # smoke test, no GPU

For each shape it writes a random-weight model (Llama: tied embeddings; Qwen3, Qwen3-MoE) to a
temporary directory in the benchmark dtype (a MoE shape too large for the machine's disk —
Qwen3-30B-A3B is 61 GB in bf16 — is built in memory on the device instead, its directory holding
only the config and tokenizer; then the full-stack row, which starts an engine process that
loads from disk, is skipped), runs the workload (by default 256 requests, prompts of 32-512
tokens, outputs of 32-256 tokens, greedy, EOS ignored, all submitted at once) and prints, in
one run:

* dpserve's ``ModelRunner`` driven by its ``step()`` loop: output tok/s, p50/p99
  time-to-first-token and inter-token latency, and its KV pool as ``stats()`` reports it;
* the full stack (``dpserve coordinator`` + one ``dpserve engine`` process + an
  ``InferenceClient``), through ``bench/engine.py``'s ``run_through_coordinator``;
* one static HF ``generate`` batch (``bench/engine.py``'s ``run_static_batch``);
* the decode roofline: the bytes every decode step must read (all weights, and the KV cache of
  every running sequence) over the memory bandwidth measured by timing a large device copy;
* one decode step at a full batch (``--step-batch`` sequences of ``--step-context`` tokens, all
  decoding): the runner's ``step()`` in steady state against a replay of the same batch's CUDA
  graph alone (the forward with no host work around it), and against that step's roofline.
  The issue's goal is a step within 1.3x of the device-only forward. ``--profile-dir`` also
  writes the torch profiler's kernel table of a few such steps there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import Workload, run_static_batch, run_through_coordinator
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.model_loading import load_model_and_tokenizer
from dpserve.sampling import SamplingParams


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    model_type: str = "llama"  # "llama", "qwen3" or "qwen3_moe"
    head_dim: int = 0  # 0: hidden / heads
    experts: int = 0  # qwen3_moe: experts per layer, each of expert_intermediate
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:  # keys and values of every layer, 2-byte dtype
        return 2 * self.layers * self.kv_heads * self.head_size * 2

    @property
    def built_in_memory(self) -> bool:
        """Too large for the GPU machine's disk (64 GiB) in bf16: built on the device."""
        return self.experts > 0


SHAPES = {
    "tiny": LlamaShape(128, 2, 4, 2, 256, 1024),  # CPU smoke test
    "1b": LlamaShape(2048, 16, 32, 8, 8192, 128256),  # Llama-3.2-1B's shape
    "8b": LlamaShape(4096, 32, 32, 8, 14336, 128256),  # Llama-3.1-8B's shape
    "qwen3-8b": LlamaShape(4096, 36, 32, 8, 12288, 151936, "qwen3", head_dim=128),
    # Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token (~3.3B active parameters).
    "qwen3-30b-a3b": LlamaShape(2048, 48, 32, 4, 6144, 151936, "qwen3_moe", 128, 128, 8, 768),
    "tiny-moe": LlamaShape(128, 2, 4, 2, 256, 1024, "qwen3_moe", 32, 8, 2, 64),  # CPU smoke
}
# The static batch for the 8B shape was 64: HF's padded cache at 256 rows of 768
# columns and its attention temporaries do not leave room.
STATIC_BATCH = {
    "tiny": 256,
    "1b": 256,
    "8b": 64,
    "qwen3-8b": 64,
    "qwen3-30b-a3b": 64,
    "tiny-moe": 64,
}
CONTEXT = 2048


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def model_config(shape: LlamaShape, tokenizer: Any) -> Any:
    """The transformers config of ``shape``."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = {
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": CONTEXT,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if shape.model_type == "llama":
        return LlamaConfig(**common, rope_theta=500_000.0, tie_word_embeddings=True)
    if shape.model_type == "qwen3":
        return Qwen3Config(**common, head_dim=shape.head_size, tie_word_embeddings=False)
    return Qwen3MoeConfig(
        **common,
        head_dim=shape.head_size,
        num_experts=shape.experts,
        num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.expert_intermediate,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def random_model(config: Any, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # Initialised on the device, in the target dtype: an 8B fp32 init on the CPU takes minutes.
    with torch.device(device), default_dtype(dtype):
        return AutoModelForCausalLM.from_config(config).eval()


def build_model(shape: LlamaShape, directory: Path, device: str, dtype: torch.dtype) -> Path:
    """A random-weight model of ``shape`` and a small BPE tokenizer (its ids are a prefix of
    the model's vocabulary: the workload is token ids, and unknown ids decode to nothing). A
    ``built_in_memory`` shape's directory holds the config and tokenizer only (see
    ``in_memory_weights``)."""
    from transformers import AutoTokenizer

    from tests.tiny_model import build_tiny_model

    build_tiny_model(directory)  # the tokenizer; its model files are replaced below
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = model_config(shape, tokenizer)
    for weights in directory.glob("*.safetensors"):
        weights.unlink()
    if shape.built_in_memory:
        config.save_pretrained(directory)
        return directory
    model = random_model(config, device, dtype)
    model.save_pretrained(directory)
    del model
    release_memory()
    return directory


@contextlib.contextmanager
def in_memory_weights(shape: LlamaShape, device: str, dtype: torch.dtype) -> Iterator[None]:
    """While open, ``ModelRunner`` (and this bench) load a ``built_in_memory`` shape's
    directory as a random model built on the device (nothing else changes)."""
    if not shape.built_in_memory:
        yield
        return
    from transformers import AutoConfig, AutoTokenizer

    import dpserve.engine.model_runner as model_runner_module

    real = model_runner_module.load_model_and_tokenizer

    def load(path: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return random_model(AutoConfig.from_pretrained(path), device, dtype), (
            AutoTokenizer.from_pretrained(path)
        )

    model_runner_module.load_model_and_tokenizer = load  # type: ignore[assignment]
    global load_model_and_tokenizer
    bench_loader, load_model_and_tokenizer = load_model_and_tokenizer, load
    try:
        yield
    finally:
        model_runner_module.load_model_and_tokenizer = real  # type: ignore[assignment]
        load_model_and_tokenizer = bench_loader


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_workload(requests: int, vocab: int, quick: bool, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    longest_output = 64 if quick else 256
    return [
        (
            [rng.randrange(16, vocab) for _ in range(rng.randint(32, 512))],
            rng.randint(32, longest_output),
        )
        for _ in range(requests)
    ]


def measure_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    size = (2 << 30) if device == "cuda" else (256 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    copies = 10 if device == "cuda" else 3
    start = time.perf_counter()
    for _ in range(copies):
        target.copy_(source)
    synchronize(device)
    seconds = time.perf_counter() - start
    del source, target
    return 2 * size * copies / seconds


@dataclass
class FirstUseCosts:
    """What a run paid for the first time: Triton kernels compiled, memory taken from the
    device by torch's allocator."""

    compiled: list[str] = field(default_factory=list)
    device_allocations: int = 0

    def summary(self) -> str:
        kernels = ", ".join(sorted(set(self.compiled))) or "none"
        return (
            f"{len(self.compiled)} Triton compiles ({kernels}); "
            f"{self.device_allocations} device allocations by torch"
        )


@contextlib.contextmanager
def first_use_costs(device: str) -> Iterator[FirstUseCosts]:
    costs = FirstUseCosts()
    if device != "cuda":
        yield costs
        return
    from triton import knobs

    def compiled(*_args: Any, **kwargs: Any) -> bool:
        constants = kwargs.get("compile", {}).get("constants", {})
        shown = ", ".join(f"{k}={v}" for k, v in constants.items() if not isinstance(v, type))
        costs.compiled.append(f"{getattr(kwargs.get('fn'), 'name', '?')}({shown[:160]})")
        return False  # compile as usual

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = compiled
    before = torch.cuda.memory_stats().get("num_device_alloc", 0)
    try:
        yield costs
    finally:
        knobs.runtime.jit_cache_hook = previous
        costs.device_allocations = torch.cuda.memory_stats().get("num_device_alloc", 0) - before


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_roofline(
    workload: Workload, weight_bytes: int, shape: LlamaShape, bandwidth: float
) -> float:
    """Output tok/s if every decode step only streamed the weights and the running sequences'
    KV cache at ``bandwidth`` (all requests decode together; prefill not counted)."""
    total_bytes = 0
    total_tokens = 0
    for step in range(max(wanted for _, wanted in workload)):
        running = [len(prompt) + step for prompt, wanted in workload if wanted > step]
        total_bytes += weight_bytes + sum(running) * shape.kv_bytes_per_token
        total_tokens += len(running)
    return total_tokens / (total_bytes / bandwidth)


@dataclass
class EngineRun:
    seconds: float
    tokens: int
    first_token: list[float] = field(default_factory=list)  # seconds after submission
    between_tokens: list[float] = field(default_factory=list)
    # Wall seconds and count of the steps that carried prefill tokens, and of the others.
    prefill_steps: list[float] = field(default_factory=list)
    decode_steps: list[float] = field(default_factory=list)


def engine_params(wanted: int, vocab: int) -> SamplingParams:
    # ignore_eos, and a termination id no model produces for runners that predate it.
    return SamplingParams(
        temperature=0.0, num_tokens_to_generate=wanted, ignore_eos=True, termination_id=vocab
    )


def run_engine(runner: ModelRunner, workload: Workload, vocab: int, device: str) -> EngineRun:
    """All requests submitted at once, then ``step()`` until no work; latencies per token."""
    start = time.perf_counter()
    for request_id, (prompt, wanted) in enumerate(workload):
        runner.add(RunnerRequest(request_id, prompt, engine_params(wanted, vocab)))
    run = EngineRun(0.0, 0)
    last_seen: dict[int, float] = {}
    backend = runner.backend
    while runner.has_work():
        before = time.perf_counter()
        prefilled = getattr(backend, "prefill_tokens", 0)
        updates = runner.step()
        now = time.perf_counter()
        kind = run.prefill_steps if getattr(backend, "prefill_tokens", 0) > prefilled else None
        (kind if kind is not None else run.decode_steps).append(now - before)
        for update in updates:
            if not update.tokens:
                continue
            run.tokens += len(update.tokens)
            previous = last_seen.get(update.request_id)
            if previous is None:
                run.first_token.append(now - start)
            else:
                run.between_tokens.extend(
                    [(now - previous) / len(update.tokens)] * len(update.tokens)
                )
            last_seen[update.request_id] = now
    synchronize(device)
    run.seconds = time.perf_counter() - start
    return run


def runner_kwargs(
    capacity: int, device: str, dtype: str, cuda_graphs: bool = True
) -> dict[str, Any]:
    """The constructor arguments this ``ModelRunner`` accepts (its signature is evolving)."""
    wanted = {"device": device, "dtype": dtype, "max_num_seqs": capacity}
    if not cuda_graphs:
        wanted["cuda_graphs"] = False
    accepted = inspect.signature(ModelRunner).parameters
    dropped = sorted(set(wanted) - set(accepted))
    if dropped:
        print(f"  (this ModelRunner takes no {', '.join(dropped)}: left at its defaults)")
    return {name: value for name, value in wanted.items() if name in accepted}


def percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return f"p50 {cuts[49] * 1e3:.1f} ms, p99 {cuts[98] * 1e3:.1f} ms"


def kv_pool(stats: dict[str, Any]) -> str:
    found = {k: v for k, v in stats.items() if any(word in k for word in ("block", "kv", "pool"))}
    if not found:
        return f"not reported by this ModelRunner (stats keys: {', '.join(sorted(stats))})"
    return ", ".join(f"{key} {value}" for key, value in sorted(found.items()))


def bench_shape(name: str, args: argparse.Namespace, scratch: Path) -> list[str]:
    """Runs every method on one shape; returns its printed result lines."""
    shape = SHAPES[name]
    with in_memory_weights(shape, args.device, getattr(torch, args.dtype)):
        return run_shape(name, shape, args, scratch)


def run_shape(name: str, shape: LlamaShape, args: argparse.Namespace, scratch: Path) -> list[str]:
    path = build_model(shape, scratch / name, args.device, getattr(torch, args.dtype))
    workload = make_workload(args.requests, shape.vocab, args.quick)
    wanted = sum(n for _, n in workload)
    bandwidth = measure_bandwidth(args.device)
    results: dict[str, tuple[float, int] | str] = {}

    model, tokenizer = load_model_and_tokenizer(str(path), args.dtype, args.device)
    params = sum(p.numel() for p in model.parameters())
    roofline = decode_roofline(workload, params * model.dtype.itemsize, shape, bandwidth)
    outputs = [n for _, n in workload]
    lines = [
        f"== {name} shape: {params / 1e6:,.1f}M params, {args.dtype} on {device_name(args.device)}",
        f"   {len(workload)} requests, prompts 32-512 tokens, outputs {min(outputs)}-"
        f"{max(outputs)} ({wanted} tokens), greedy, EOS ignored, all at once",
        f"   model class: {shape.model_type}"
        + (
            f", {shape.experts} experts, {shape.experts_per_token} per token (built in memory)"
            if shape.experts
            else ""
        ),
        f"   memory bandwidth (copy) {bandwidth / 1e9:,.0f} GB/s -> decode roofline "
        f"{roofline:,.0f} tok/s",
    ]
    print("\n".join(lines), flush=True)
    if "static" not in args.skip:
        static = workload[: min(len(workload), STATIC_BATCH[name])]
        method = f"static HF generate (batch {len(static)})"
        results[method] = run_static(model, static, tokenizer.pad_token_id, args.device)
    del model
    release_memory()

    started = time.perf_counter()
    runner = ModelRunner(
        str(path),
        **runner_kwargs(args.capacity, args.device, args.dtype, not args.no_cuda_graphs),
    )
    facts = runner.stats()
    start_line = (
        f"   ModelRunner start (load, warm-up, graph capture): "
        f"{time.perf_counter() - started:.1f} s; {facts.get('backend')} backend, "
        f"{facts.get('model_class')}; decode graphs "
        f"{len(facts.get('cuda_graphs', []))}, piecewise graph buckets "
        f"{len(facts.get('piecewise_graphs', []))} (x {shape.layers + 1} pieces)"
    )
    print(start_line, flush=True)
    run_engine(runner, [(p, min(n, 4)) for p, n in workload[:32]], shape.vocab, args.device)
    with first_use_costs(args.device) as first_use:
        engine = run_engine(runner, workload, shape.vocab, args.device)
    results["dpserve ModelRunner"] = (engine.seconds, engine.tokens)
    pool = kv_pool(runner.stats())
    if args.profile_dir is not None:  # the workload's first (prefill-heavy) steps
        for request_id, (prompt, length) in enumerate(workload):
            runner.add(RunnerRequest(request_id, prompt, engine_params(length, shape.vocab)))
        profile_steps(runner, Path(args.profile_dir) / f"profile_prefill_{shape.layers}l.txt", 6)
        while runner.has_work():
            runner.step()
    step_lines = measure_decode_step(
        runner, shape, bandwidth, params * getattr(torch, args.dtype).itemsize, args
    )
    del runner
    release_memory()

    if "stack" not in args.skip and not shape.built_in_memory:
        results["dpserve full stack (1 engine)"] = run_stack(path, workload, args)
    report = [
        *format_table(results, roofline, wanted),
        f"   ModelRunner time to first token: {percentiles(engine.first_token)}; "
        f"inter-token latency: {percentiles(engine.between_tokens)}",
        f"   ModelRunner steps with prefill: {len(engine.prefill_steps)} in "
        f"{sum(engine.prefill_steps):.2f} s "
        f"({', '.join(f'{step * 1e3:.0f}' for step in engine.prefill_steps)} ms); "
        f"decode-only: {len(engine.decode_steps)} in {sum(engine.decode_steps):.2f} s",
        f"   during the ModelRunner run (after its warm-up): {first_use.summary()}",
        f"   ModelRunner KV pool: {pool}",
        start_line,
        *step_lines,
    ]
    print("\n".join(report), flush=True)
    return lines + report


def measure_decode_step(
    runner: ModelRunner,
    shape: LlamaShape,
    bandwidth: float,
    weight_bytes: int,
    args: argparse.Namespace,
) -> list[str]:
    """ms per steady-state decode step at a full batch: the whole ``step()`` (host work, with
    the overlap the backend does) and the CUDA graph's replay alone."""
    batch, context = args.step_batch, args.step_context
    if batch <= 0:
        return []
    rng = random.Random(1)
    first_id = 1_000_000
    for offset in range(batch):
        prompt = [rng.randrange(16, shape.vocab) for _ in range(context)]
        runner.add(RunnerRequest(first_id + offset, prompt, engine_params(CONTEXT, shape.vocab)))
    decoding: set[int] = set()
    while len(decoding) < batch:  # every prompt prefilled
        decoding.update(update.request_id for update in runner.step() if update.tokens)
    for _ in range(5):
        runner.step()
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(args.step_count):
        runner.step()
    synchronize(args.device)
    step_ms = (time.perf_counter() - start) * 1e3 / args.step_count
    replay_ms = replay_decode_graph(runner, batch, args.step_count)
    if args.profile_dir is not None:
        profile_steps(runner, Path(args.profile_dir) / f"profile_{shape.layers}l.txt")
    mixed_line = measure_mixed_steps(runner, shape, args, first_id, batch, step_ms)
    for offset in range(batch):
        runner.cancel(first_id + offset)
    while runner.has_work():
        runner.step()
    kv_bytes = batch * (context + 8) * shape.kv_bytes_per_token
    floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
    lines = [
        f"   decode step, batch {batch} at ~{context} tokens of context: step() {step_ms:.2f} ms; "
        f"roofline {floor_ms:.2f} ms"
    ]
    if replay_ms is not None:
        lines.append(
            f"   decode graph replay alone (forward, no host work) {replay_ms:.2f} ms; "
            f"step / replay {step_ms / replay_ms:.2f}x (goal <= 1.3x)"
        )
    if mixed_line:
        lines.append(mixed_line)
    return lines


def measure_mixed_steps(
    runner: ModelRunner,
    shape: LlamaShape,
    args: argparse.Namespace,
    first_id: int,
    batch: int,
    decode_ms: float,
) -> str:
    """ms per step while a new prompt of ``--mixed-prompt`` tokens arrives every step beside a
    batch of decoding sequences (``--mixed-count`` of the batch's sequences cancelled first to
    make room): such steps replay the piecewise graphs (``piecewise_graphs``) where they were
    captured, else run eagerly. The same round runs twice: the first
    meets every step's row count for the first time (the matrix libraries pick and load their
    kernels then), the second is the steady state."""
    count, length = args.mixed_count, args.mixed_prompt
    if count <= 0 or batch < count:
        return ""
    for offset in range(count):
        runner.cancel(first_id + offset)
    rng = random.Random(2)
    rounds = []
    for round_index in range(2):
        # New prompts each round: the prefix cache must not serve the second round's.
        prompts = [[rng.randrange(16, shape.vocab) for _ in range(length)] for _ in range(count)]
        base = first_id + batch + round_index * count
        for _ in range(3):
            runner.step()
        synchronize(args.device)
        start = time.perf_counter()
        for index, prompt in enumerate(prompts):
            runner.add(RunnerRequest(base + index, prompt, engine_params(4, shape.vocab)))
            runner.step()
        synchronize(args.device)
        rounds.append((time.perf_counter() - start) * 1e3 / count)
        for index in range(count):
            runner.cancel(base + index)
    first, steady = rounds
    return (
        f"   mixed step ({'piecewise graphs' if runner.stats()['piecewise_graphs'] else 'eager'}),"
        f" {batch - count} decoding + one new {length}-token prompt each step: "
        f"{steady:.2f} ms per step (decode-only {decode_ms:.2f} ms; +{steady - decode_ms:.2f}); "
        f"{first:.2f} ms the first time those row counts ran"
    )


def replay_decode_graph(runner: ModelRunner, batch: int, count: int) -> float | None:
    """ms per replay of the decode graph the last step ran (its inputs as that step left
    them: the replays rewrite the same KV slots)."""
    graphs = getattr(runner.backend, "graphs", None)
    if graphs is None or batch > graphs.sizes[-1]:
        return None
    graph = graphs._graphs[graphs.inputs.bucket(batch)]
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(count):
        graph.replay()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end)) / count


def profile_steps(runner: ModelRunner, path: Path, steps: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            runner.step()
        synchronize("cuda" if torch.cuda.is_available() else "cpu")
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profiler.key_averages().table(sort_by=sort, row_limit=40))


def run_static(model: Any, workload: Workload, pad_id: int, device: str) -> tuple[float, int]:
    model.generation_config.eos_token_id = None  # every row generates its full length
    with torch.inference_mode():
        run_static_batch(model, [(workload[0][0], 2)], pad_id)  # warm-up
        start = time.perf_counter()
        tokens = run_static_batch(model, workload, pad_id)
        synchronize(device)
    return time.perf_counter() - start, tokens


def run_stack(path: Path, workload: Workload, args: argparse.Namespace) -> tuple[float, int] | str:
    engine_args = ("--device", args.device, "--dtype", args.dtype)
    try:
        return run_through_coordinator(
            str(path), workload, args.capacity, startup_timeout=900, engine_args=engine_args
        )
    except Exception as exc:  # report it, keep the other figures
        return f"failed: {type(exc).__name__}: {exc}"


def format_table(
    results: dict[str, tuple[float, int] | str], roofline: float, wanted: int
) -> list[str]:
    rows = [f"   {'method':<34} {'seconds':>8} {'tokens':>8} {'tok/s':>10} {'of roofline':>11}"]
    for method, outcome in results.items():
        if isinstance(outcome, str):
            rows.append(f"   {method:<34} {outcome}")
            continue
        seconds, tokens = outcome
        rate = tokens / seconds
        note = "" if tokens == wanted or method.startswith("static") else f"  (wanted {wanted})"
        share = rate / roofline
        rows.append(f"   {method:<34} {seconds:8.2f} {tokens:8d} {rate:10,.0f} {share:10.1%}{note}")
    return rows


def device_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return "CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape",
        default="both",
        help=f"comma-separated, of {', '.join(SHAPES)}; both: 1b,8b",
    )
    parser.add_argument("--requests", type=int, default=None, help="default 256 (32 with --quick)")
    parser.add_argument("--quick", action="store_true", help="32 requests, outputs of 32-64 tokens")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    parser.add_argument("--capacity", type=int, default=256, help="ModelRunner max_num_seqs")
    parser.add_argument("--step-batch", type=int, default=256, help="0: no decode-step figure")
    parser.add_argument("--step-context", type=int, default=512)
    parser.add_argument("--step-count", type=int, default=50)
    parser.add_argument("--mixed-count", type=int, default=16, help="0: no mixed-step figure")
    parser.add_argument("--mixed-prompt", type=int, default=128)
    parser.add_argument("--profile-dir", default=None, help="write a profiler table per shape")
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="eager ModelRunner steps (what the decode and piecewise graphs save); the full "
        "stack's engine keeps its graphs",
    )
    parser.add_argument("--skip", action="append", default=[], help="static, stack (repeatable)")
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 32 if args.quick else 256
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --device cpu --shape tiny,tiny-moe for a smoke test")
    shapes = ["1b", "8b"] if args.shape == "both" else args.shape.split(",")
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}: choose from {', '.join(SHAPES)}")
    print(environment(), flush=True)
    report = [environment()]
    with tempfile.TemporaryDirectory() as scratch:
        for name in shapes:
            report += bench_shape(name, args, Path(scratch))
            shutil.rmtree(Path(scratch) / name)  # an 8B checkpoint is 15 GB of disk
    print("\n--- summary ---\n" + "\n".join(report))
    return 0


def environment() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return (
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"triton {triton_version}"
    )


if __name__ == "__main__":
    sys.exit(main())
