"""Prefix-aware vs round-robin routing through a standard client: inference-perf's
``shared_prefix`` workload (``bench/inference_perf_shared_prefix.yaml``) against ``dpserve
serve``, once per policy (issue 15, "tried with a standard client").

    python bench/prefix_inference_perf.py [--policies round-robin,prefix-aware]

The servers are set up as in ``bench/prefix.py``'s real-engine run: two SmolLM2 engines, each
with a KV pool of three system prompts (768 tokens: the four prompts exceed one pool, fit two),
block size 16, at most 4 running sequences per engine, and one warm-up request. inference-perf
runs from its own virtualenv, ``~/.cache/dpserve/peers/inference-perf-venv`` (how it was
installed: BENCHMARKS.md); it tokenizes with the served model's tokenizer. Printed per policy:
inference-perf's TTFT p50/p90, output tok/s and request counts, and the prompt tokens the
engines prefilled and found cached (their ``/metrics``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prefix import BLOCK, kv_bytes_per_token
from bench.serving_cpu import dpserve_server, start, stop, wait_ready
from dpserve.model_loading import resolve_model

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "bench" / "inference_perf_shared_prefix.yaml"
POOL_TOKENS = 3 * 256  # three of the workload's four 256-token system prompts


def engine_counters(port: int) -> dict[str, float]:
    """Prefilled and cache-hit prompt tokens, summed over the engines (``/metrics``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = {"prefill_tokens": 0.0, "prefix_cache_hits": 0.0}
    for line in text.splitlines():
        for name in totals:
            if line.startswith(f"dpserve_engine_{name}_total{{"):  # a counter, one per rank
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def complete(port: int, model: str, prompt: str) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def run_policy(policy: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    server = dpserve_server(
        f"dpserve serve ({policy})",
        str(args.model),
        [
            *("--data-parallel-size", "2", "--routing", policy, "--block-size", str(BLOCK)),
            *("--kv-cache-bytes", str(POOL_TOKENS * kv_bytes_per_token())),
            *("--max-batch-size", "4"),
        ],
    )
    port = server.port
    start(server, scratch)
    try:
        wait_ready(server, 600)
        complete(port, server.model_id, "Hello")  # the first forward of a fresh engine is slow
        before = engine_counters(port)
        reports = scratch / policy
        run = [
            str(args.inference_perf),
            "--config_file",
            str(CONFIG),
            "--server.base_url",
            f"http://127.0.0.1:{port}",
            "--server.model_name",
            server.model_id,
            "--tokenizer.pretrained_model_name_or_path",
            str(args.model),
            "--storage.local_storage.path",
            str(reports),
        ]
        with (scratch / f"inference-perf-{policy}.log").open("wb") as log:
            subprocess.run(run, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=scratch)
        after = engine_counters(port)
    finally:
        stop(server)
    summary = json.loads(next(reports.rglob("summary_lifecycle_metrics.json")).read_text())
    return {
        "policy": policy,
        "summary": summary,
        "prefilled": after["prefill_tokens"] - before["prefill_tokens"],
        "cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="round-robin,prefix-aware")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument(
        "--inference-perf",
        type=Path,
        default=Path.home() / ".cache/dpserve/peers/inference-perf-venv/bin/inference-perf",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = resolve_model(None)
    if not args.inference_perf.exists():
        parser.error(f"no inference-perf at {args.inference_perf} (see BENCHMARKS.md)")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for policy in args.policies.split(","):
            results.append(run_policy(policy, args, Path(scratch)))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    print(
        f"{'policy':<18} {'ok':>4} {'failed':>6} {'TTFT p50 s':>10} {'TTFT p90 s':>10} "
        f"{'output tok/s':>12} {'prefilled':>9} {'cache hits':>10}"
    )
    for result in results:
        summary = result["summary"]
        ttft = summary["successes"]["latency"]["time_to_first_token"]
        rate = summary["successes"]["throughput"]["output_tokens_per_sec"]
        print(
            f"{result['policy']:<18} {summary['successes']['count']:>4} "
            f"{summary['failures']['count']:>6} {ttft['median']:>10.3f} {ttft['p90']:>10.3f} "
            f"{rate:>12.1f} {result['prefilled']:>9.0f} {result['cache_hits']:>10.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
