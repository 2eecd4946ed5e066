"""Coordinator throughput and latency: dpserve (plain and CURVE) vs Megatron-Core 0.16.1 vs a
raw pyzmq relay.

    python bench/coordinator.py [--requests 20000] [--max-inflight 512] [--skip-megatron]
        [--skip-curve] [--skip-raw] [--skip-streaming] [--routing POLICY ...] [--repeat N]

Same workload for all, in one run: N single-token requests from one asyncio client, at most
``--max-inflight`` in flight (a new one sent as each answer arrives), through a ROUTER in its
own process to 2 instant fake engines (each a process that answers everything it has read with
one batched reply, as an engine step would), then 300 requests one at a time for the unloaded
round trip. Megatron runs its own coordinator and real ``InferenceClient`` (``pip install
--no-deps megatron-core==0.16.1``; it needs torch, pyzmq and msgpack). The raw relay is the
ceiling: a poll-and-drain ROUTER that only forwards bytes. The CURVE run is dpserve again with
keys from a temporary ``dpserve keys generate`` directory: every message encrypted, every
connection authenticated, every message's role checked.

Every system is judged alike: req/s counts completed requests only (a result, not an error
answer), and each request is reported as completed, failed (an error answer: dpserve refuses
past ``--max-inflight-per-client``), lost (never answered) or never sent. With
``--max-inflight 0`` all N go at once: Megatron's coordinator then loses thousands, because its
sockets keep ZMQ's default high-water mark (1,000 messages per peer) and a ROUTER drops what is
sent to a peer past it, silently; with unbounded marks it loses none (BENCHMARKS.md).

    python bench/coordinator.py --streaming-only

The streaming figure: fake engines (256 rows, a step every 10 ms) stream to one client, and
the coordinator's CPU time is divided by the tokens it carried: milliseconds of coordinator
CPU per 1,000 streamed tokens (goal: <= 2 ms; the loop should only route).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.runtime import free_port  # noqa: E402

# DPSERVE_BIN: another dpserve command (a profiling wrapper, another checkout's).
DPSERVE = os.environ.get("DPSERVE_BIN") or str(Path(sys.executable).with_name("dpserve"))
SEQUENTIAL = 300
# How long the client waits, after the last answer, for more: a lost reply never comes.
QUIET_PERIOD = 10.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (encryption runs in libzmq's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(submit, count: int, window: int) -> dict:
    """``submit(i)`` returns a future. Sends ``count`` requests with at most ``window`` in
    flight (0: all at once), a new one as each answer arrives, and returns throughput, latency
    and what became of every request: completed (a result), failed (an error answer) or lost
    (no answer within QUIET_PERIOD of the last one; with a window, a window full of lost requests
    leaves the rest never sent). Only completed requests count towards
    req/s, for every system alike."""
    loop = asyncio.get_running_loop()
    window = window or count
    latencies: list[float] = []
    tally = {"completed": 0, "failed": 0, "submitted": 0}
    last_answer = [time.perf_counter()]
    everything_answered = loop.create_future()

    def launch() -> None:
        index = tally["submitted"]
        tally["submitted"] += 1
        submitted_at = time.perf_counter()
        submit(index).add_done_callback(lambda future: answered(future, submitted_at))

    def answered(future: asyncio.Future, submitted_at: float) -> None:
        if future.cancelled():
            return
        last_answer[0] = time.perf_counter()
        if future.exception() is None:
            tally["completed"] += 1
            latencies.append(time.perf_counter() - submitted_at)
        else:
            tally["failed"] += 1
        if tally["submitted"] < count:
            launch()
        elif tally["completed"] + tally["failed"] == count and not everything_answered.done():
            everything_answered.set_result(None)

    start = time.perf_counter()
    for _ in range(min(window, count)):
        launch()
    answers = 0
    while not everything_answered.done():
        await asyncio.wait({everything_answered}, timeout=QUIET_PERIOD)
        if tally["completed"] + tally["failed"] == answers:
            break  # nothing arrived for QUIET_PERIOD: what is missing is lost
        answers = tally["completed"] + tally["failed"]
    elapsed = last_answer[0] - start
    lost = tally["submitted"] - tally["completed"] - tally["failed"]
    sequential = []
    if tally["completed"] == count:
        for i in range(SEQUENTIAL):
            t0 = time.perf_counter()
            await asyncio.wait_for(submit(count + i), 10)
            sequential.append(time.perf_counter() - t0)
    return {
        "rps": tally["completed"] / elapsed,
        "p50": percentile(latencies, 0.5),
        "p99": percentile(latencies, 0.99),
        "completed": tally["completed"],
        "failed": tally["failed"],
        "lost": lost,
        "never_sent": count - tally["submitted"],
        "handled": tally["completed"] + tally["failed"] + len(sequential),
        "rtt_p50": percentile(sequential, 0.5) if sequential else float("nan"),
    }


async def with_cpu_per_request(
    coordinator: int | None, engines: list[int | None], run: Awaitable[dict]
) -> dict:
    """``run``'s result with the CPU time per request handled of the coordinator process
    (``cpu_us``), the engines together (``engines_cpu_us``) and this process, the client with
    its ZMQ threads (``client_cpu_us``): CPU per request varies far less than throughput on a
    shared machine, and the three together are what one request costs the machine."""
    assert coordinator is not None and None not in engines
    pids = [coordinator, *engines]
    before, client_before = [cpu_seconds(pid) for pid in pids], time.process_time()
    result = await run
    after, client_after = [cpu_seconds(pid) for pid in pids], time.process_time()
    per_request = 1e6 / max(1, result["handled"])
    result["cpu_us"] = (after[0] - before[0]) * per_request
    result["engines_cpu_us"] = (sum(after[1:]) - sum(before[1:])) * per_request
    result["client_cpu_us"] = (client_after - client_before) * per_request
    return result


# ------------------------------------------------------------------------ dpserve


async def bench_dpserve(
    count: int, window: int, credentials: str | None = None, routing: str | None = None
) -> dict:
    from dpserve.client import InferenceClient
    from dpserve.sampling import SamplingParams
    from tests.integration.runtime import wait_for_engines

    port = free_port()
    keys = ["--credentials", credentials] if credentials else []
    procs = [
        subprocess.Popen(
            [
                DPSERVE,
                "coordinator",
                "--port",
                str(port),
                *keys,
                *(["--routing", routing] if routing else []),
            ],
            stderr=subprocess.DEVNULL,
        )
    ]
    for rank in range(2):
        procs.append(
            subprocess.Popen(
                [
                    DPSERVE,
                    "engine",
                    "--coordinator",
                    str(port),
                    "--rank",
                    str(rank),
                    "--fake",
                    "--max-batch-size",
                    "100000",
                    *keys,
                ],
                stderr=subprocess.DEVNULL,
            )
        )
    client = InferenceClient(port, credentials=credentials)
    try:
        await client.start()
        await wait_for_engines(client, 2)
        params = SamplingParams(num_tokens_to_generate=1)
        return await with_cpu_per_request(
            procs[0].pid,
            [proc.pid for proc in procs[1:]],
            measure(lambda i: client.add_request(f"prompt {i}", params), count, window),
        )
    finally:
        client.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)


async def bench_streaming(
    engines: int, tokenizer: str | None, streams: int = 256, tokens: int = 200
) -> dict:
    """Coordinator CPU per 1,000 streamed tokens, with ``engines`` fake engines streaming; the
    coordinator holds ``tokenizer`` (a real one costs what a deployment's would)."""
    from dpserve.client import InferenceClient
    from dpserve.sampling import SamplingParams
    from tests.integration.runtime import wait_for_engines

    port = free_port()
    quiet = {"stderr": subprocess.DEVNULL}
    coordinator = [DPSERVE, "coordinator", "--port", str(port)]
    if tokenizer:
        coordinator += ["--tokenizer", tokenizer]
    procs = [subprocess.Popen(coordinator, **quiet)]
    for rank in range(engines):
        engine = ["engine", "--coordinator", str(port), "--rank", str(rank), "--fake"]
        procs.append(subprocess.Popen([DPSERVE, *engine, "--step-delay", "0.01"], **quiet))
    client = InferenceClient(port, handshake_timeout=120)  # loading a tokenizer takes a while
    try:
        await client.start()
        await wait_for_engines(client, engines)
        params = SamplingParams(num_tokens_to_generate=tokens, stream=True)

        async def consume(i: int) -> int:
            return sum([len(c.tokens) async for c in client.stream(f"stream {i}", params)])

        before, started = cpu_seconds(procs[0].pid), time.perf_counter()
        carried = sum(await asyncio.gather(*(consume(i) for i in range(streams))))
        elapsed = time.perf_counter() - started
        spent = cpu_seconds(procs[0].pid) - before
        assert carried == streams * tokens, f"{carried} of {streams * tokens} tokens arrived"
        return {"ms_per_1k": spent / carried * 1e6, "tok_s": carried / elapsed, "tokens": carried}
    finally:
        client.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)


def print_streaming(result: dict, engines: int, tokenizer: str) -> None:
    print(
        f"streaming, {engines} fake engines, coordinator tokenizer {tokenizer}: "
        f"{result['tokens']} tokens at "
        f"{result['tok_s']:.0f} tok/s; coordinator CPU {result['ms_per_1k']:.2f} ms "
        "per 1,000 streamed tokens (goal <= 2)"
    )


# ----------------------------------------------------------------------- Megatron


def _without_nvtx() -> None:
    """Megatron brackets (de)serialization with NVTX ranges, which a CPU build of torch
    refuses; make them no-ops in every process that runs Megatron code."""
    import torch

    torch.cuda.nvtx.range_push = lambda *args, **kwargs: None
    torch.cuda.nvtx.range_pop = lambda *args, **kwargs: None


class _CharTokenizer:
    def detokenize(self, tokens: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in tokens)


def _megatron_coordinator(pipe, ready, port: int) -> None:
    import socket

    # Megatron binds to the hostname's address; keep the benchmark on loopback.
    socket.gethostname = lambda: "127.0.0.1"
    _without_nvtx()
    from megatron.core.inference.data_parallel_inference_coordinator import (
        DataParallelInferenceCoordinator,
    )

    DataParallelInferenceCoordinator.entrypoint(pipe, ready, 2, _CharTokenizer(), port)


def _megatron_engine(address: str) -> None:
    """Megatron's engine side of the protocol: register with an empty frame, answer
    SUBMIT_REQUEST=3 with ENGINE_REPLY=4 carrying one record per finished request."""
    import torch
    from megatron.core.inference.inference_request import (
        DynamicInferenceRequest,
        DynamicInferenceRequestRecord,
    )
    from megatron.core.inference.sampling_params import SamplingParams

    _without_nvtx()
    template = DynamicInferenceRequestRecord.from_request(
        DynamicInferenceRequest(
            request_id=0,
            prompt="p",
            prompt_tokens=torch.tensor([1]),
            sampling_params=SamplingParams(num_tokens_to_generate=1),
            generated_tokens=[7],
        )
    ).serialize()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"")
    while True:
        sock.poll()
        records = []
        try:
            while True:
                message = msgpack.unpackb(sock.recv(zmq.NOBLOCK), raw=False)
                if message[0] == 3:
                    request = dict(
                        template["requests"][0], request_id=message[1], prompt=message[2]
                    )
                    records.append({"requests": [request], "latency": None})
                elif message[0] == 10:  # STOP
                    return
        except zmq.Again:
            pass
        if records:
            sock.send(msgpack.packb([4, records], use_bin_type=True))


async def bench_megatron(count: int, window: int) -> dict:
    from megatron.core.inference.inference_client import InferenceClient
    from megatron.core.inference.sampling_params import SamplingParams

    _without_nvtx()
    spawn = mp.get_context("spawn")
    port = free_port()
    parent, child = spawn.Pipe()
    ready = spawn.Event()
    coordinator = spawn.Process(
        target=_megatron_coordinator, args=(child, ready, port), daemon=True
    )
    coordinator.start()
    address = parent.recv()
    engines = [
        spawn.Process(target=_megatron_engine, args=(address,), daemon=True) for _ in range(2)
    ]
    for engine in engines:
        engine.start()
    ready.wait(60)
    client = InferenceClient(address)
    try:
        await client.start()
        params = SamplingParams(num_tokens_to_generate=1)
        return await with_cpu_per_request(
            coordinator.pid,
            [engine.pid for engine in engines],
            measure(lambda i: client.add_request(f"prompt {i}", params), count, window),
        )
    finally:
        client.stop()
        for proc in (coordinator, *engines):
            proc.kill()
            proc.join(5)


# ---------------------------------------------------------------------- raw relay


def _relay(port: int, ready) -> None:
    """A ROUTER that forwards client messages to the engines in turn and replies back: the
    least a coordinator can do."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    engines: list[bytes] = []
    turn = 0
    ready.set()
    while True:
        router.poll()
        try:
            while True:
                identity, payload = router.recv_multipart(zmq.NOBLOCK)
                if payload == b"":
                    engines.append(identity)
                elif identity in engines:
                    client, reply = msgpack.unpackb(payload)
                    router.send_multipart([client, reply])
                else:
                    engine = engines[turn % len(engines)]
                    turn += 1
                    router.send_multipart([engine, msgpack.packb([identity, payload])])
        except zmq.Again:
            pass


def _echo_engine(port: int) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"")
    while True:
        sock.poll()
        try:
            while True:
                sock.send(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            pass


async def bench_raw(count: int, window: int) -> dict:
    spawn = mp.get_context("spawn")
    port = free_port()
    ready = spawn.Event()
    procs = [spawn.Process(target=_relay, args=(port, ready), daemon=True)]
    procs[0].start()
    ready.wait(30)
    procs += [spawn.Process(target=_echo_engine, args=(port,), daemon=True) for _ in range(2)]
    for proc in procs[1:]:
        proc.start()
    await asyncio.sleep(1.0)
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    futures: dict[int, asyncio.Future] = {}
    raw = zmq.Socket.shadow(sock.underlying)

    def drain() -> None:
        try:
            while True:
                request_id, _ = msgpack.unpackb(raw.recv(zmq.NOBLOCK))
                future = futures.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(None)
        except zmq.Again:
            pass

    async def listen() -> None:
        while True:
            await sock.poll()
            drain()

    recheck = {"scheduled": False}

    def drain_again() -> None:
        recheck["scheduled"] = False
        drain()

    def submit(i: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        futures[i] = future
        raw.send(msgpack.packb([i, f"prompt {i}"]))
        # ZMQ's descriptor is edge-triggered: a send can take the wake-up for replies that
        # arrived meanwhile (as the dpserve client does, look once more after sends).
        if not recheck["scheduled"]:
            recheck["scheduled"] = True
            asyncio.get_running_loop().call_soon(drain_again)
        return future

    listener = asyncio.create_task(listen())
    try:
        return await with_cpu_per_request(
            procs[0].pid, [proc.pid for proc in procs[1:]], measure(submit, count, window)
        )
    finally:
        listener.cancel()
        sock.close(0)
        context.term()
        for proc in procs:
            proc.kill()
            proc.join(5)


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=512,
        help="requests in flight at most, a new one sent as each answer arrives (0: all at "
        "once, a burst; Megatron's sockets then drop requests at their high-water marks)",
    )
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--skip-curve", action="store_true")
    parser.add_argument("--skip-raw", action="store_true")
    parser.add_argument("--skip-streaming", action="store_true")
    parser.add_argument("--streaming-only", action="store_true")
    parser.add_argument(
        "--routing",
        nargs="+",
        default=[],
        choices=["prefix-aware", "least-outstanding", "round-robin"],
        help="also run dpserve with these routing policies (the default run uses the default)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every system this many times, interleaved (dpserve, Megatron, dpserve, ...)",
    )
    parser.add_argument("--streaming-engines", type=int, default=2)
    parser.add_argument(
        "--streaming-tokenizer",
        default="smollm2-135m-instruct",
        help="the coordinator's tokenizer in the streaming run ('bytes': the byte tokenizer)",
    )
    args = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    tokenizer = None if args.streaming_tokenizer == "bytes" else args.streaming_tokenizer
    streaming = None
    if not args.skip_streaming or args.streaming_only:
        streaming = asyncio.run(bench_streaming(args.streaming_engines, tokenizer))
    if args.streaming_only:
        assert streaming is not None
        print_streaming(streaming, args.streaming_engines, args.streaming_tokenizer)
        return
    count, window = args.requests, args.max_inflight
    for run in range(args.repeat):
        results: dict[str, dict] = {}
        if not args.skip_raw:
            results["raw relay"] = asyncio.run(bench_raw(count, window))
        results["dpserve"] = asyncio.run(bench_dpserve(count, window))
        for routing in args.routing:
            results[f"dpserve {routing}"] = asyncio.run(
                bench_dpserve(count, window, routing=routing)
            )
        if not args.skip_curve:
            from dpserve.security.key_files import generate_credentials

            with tempfile.TemporaryDirectory(prefix="dpserve-bench-keys-") as directory:
                generate_credentials(directory)
                results["dpserve CURVE"] = asyncio.run(bench_dpserve(count, window, directory))
        if not args.skip_megatron:
            try:
                results["megatron 0.16.1"] = asyncio.run(bench_megatron(count, window))
            except ImportError as exc:
                print(
                    f"megatron-core not installed ({exc}); "
                    "pip install --no-deps megatron-core==0.16.1"
                )
        if args.repeat > 1:
            print(f"\nrun {run + 1} of {args.repeat}")
        print_results(results, count, window)
    if streaming is not None:
        print_streaming(streaming, args.streaming_engines, args.streaming_tokenizer)


def print_results(results: dict[str, dict], requests: int, window: int) -> None:
    inflight = f"at most {window} in flight" if window else "all at once"
    print(f"\n{requests} requests ({inflight}), 2 instant fake engines, one client")
    print(
        f"{'':22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'completed':>10}{'failed':>7}"
        f"{'lost':>7}{'unsent':>7}{'1-by-1 p50 ms':>15}"
        f"{'CPU us/req: coordinator':>25}{'engines':>9}{'client':>8}"
    )
    nan = float("nan")
    for name, r in results.items():
        print(
            f"{name:22}{r['rps']:>9.0f}{r['p50'] * 1e3:>9.1f}{r['p99'] * 1e3:>9.1f}"
            f"{r['completed']:>10}{r['failed']:>7}{r['lost']:>7}{r['never_sent']:>7}"
            f"{r['rtt_p50'] * 1e3:>15.3f}{r.get('cpu_us', nan):>25.1f}"
            f"{r.get('engines_cpu_us', nan):>9.1f}{r.get('client_cpu_us', nan):>8.1f}"
        )
    ours = results["dpserve"]
    if "raw relay" in results:
        raw = results["raw relay"]
        print(f"\ndpserve / raw relay throughput: {ours['rps'] / raw['rps']:.2f}x")
        print(
            f"dpserve / raw relay unloaded round trip p50: {ours['rtt_p50'] / raw['rtt_p50']:.2f}x"
        )
    for name, other in results.items():
        if name.startswith("dpserve ") and name != "dpserve CURVE":
            print(
                f"{name} / dpserve (default routing): throughput "
                f"{other['rps'] / ours['rps']:.2f}x, coordinator CPU per request "
                f"{other['cpu_us'] / ours['cpu_us']:.2f}x"
            )
    if "dpserve CURVE" in results:
        curve = results["dpserve CURVE"]
        print(
            f"dpserve CURVE / plain throughput: {curve['rps'] / ours['rps']:.2f}x, "
            f"coordinator CPU per request: {curve['cpu_us'] / ours['cpu_us']:.2f}x, "
            f"unloaded round trip p50: {curve['rtt_p50'] / ours['rtt_p50']:.2f}x"
        )
    if "megatron 0.16.1" in results:
        meg = results["megatron 0.16.1"]
        print(
            f"dpserve / megatron throughput (completed requests): {ours['rps'] / meg['rps']:.2f}x "
            f"(megatron completed {meg['completed']} of {requests}, dpserve {ours['completed']})"
        )


if __name__ == "__main__":
    main()
