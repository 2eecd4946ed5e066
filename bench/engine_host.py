"""Host time per engine step: the project's own scheduler, batch builder, sampler, finishing
rules and the engine server's flush, with the model's forward replaced by random logits.

    python bench/engine_host.py [--runs 5] [--steps 20] [--device-ms 0]

What a GPU would wait for on every step is everything but the forward: this measures it on
any machine. The tiny random Llama of the tests (its context widened to 2048 tokens) gives a
real ``ModelRunner`` with the paged backend; its ``_forward`` returns rows of pre-drawn random
logits. Prompts are 32-512 tokens, greedy, EOS ignored. Each figure is the median over
``--runs`` runs of the mean of ``--steps`` steps:

* ``batch=64`` / ``batch=256``: every sequence decoding, nothing streamed;
* ``batch=256 streaming+stop``: every request streaming (the server's 50 ms stream interval)
  with one stop string each;
* ``prefill chunks=30``: 30 prompts arriving, then one step that admits them, one chunk each
  (the step; the requests' intake, which hashes their prompts' blocks, is given after it);
* ``ops/layer decode``: torch ops per decoder layer of a real decode step (``layer_ops``).

``--device-ms`` makes the stub forward take that long, as a GPU would (it sleeps, so the host
thread runs meanwhile), and adds the wall time per step at batch 256 with the backend's
overlap off and on, against the sum and the max of host and device time: for the bare decode
step and for the streaming+stop one.

Host figures are the stepping thread's CPU time (``time.thread_time``), so that other
processes on a shared machine do not inflate them; the overlap figures are wall time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.layer_ops import decode_ops_per_layer
from dpserve import protocol
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.server import EngineServer
from dpserve.sampling import SamplingParams

CONTEXT = 2048
PROMPTS = (32, 512)
STOP = "\nUser:"


class _Sink:
    """Stands in for ``CoordinatorConnection``: encodes what it is sent, as the real one does
    before handing the bytes to ZMQ."""

    rank = 0
    address = "bench"
    instance = "bench"

    def __init__(self) -> None:
        self.bytes_sent = 0

    def send(self, record: Any) -> None:
        self.bytes_sent += len(protocol.encode(record))

    def close(self) -> None:
        pass


def build_model(directory: Path) -> Path:
    from tests.tiny_model import build_tiny_model

    path = build_tiny_model(directory)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = CONTEXT
    config_file.write_text(json.dumps(config))
    return path


def make_runner(
    path: Path, max_num_seqs: int, max_num_batched_tokens: int, **extra: Any
) -> ModelRunner:
    # The knob was called max_batch_size before the engine's layers were renamed: the same
    # bench runs on both sides of that commit.
    name = "max_num_seqs"
    if name not in inspect.signature(ModelRunner).parameters:
        name = "max_batch_size"
    kwargs: dict[str, Any] = {name: max_num_seqs, **extra}
    return ModelRunner(
        str(path),
        device="cpu",
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_bytes=256 << 20,
        **kwargs,
    )


class StubForward:
    """Random logits for the rows a forward would return; with ``device_s`` each forward takes
    that long, sleeping (a device works while the host thread runs)."""

    def __init__(self, vocab: int, rows: int, device_s: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.pool = [torch.randn(rows, vocab, generator=generator) for _ in range(8)]
        self.calls = 0
        self.device_s = device_s

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = batch.num_decodes if batch.logits_indices is None else len(batch.logits_indices)
        self.calls += 1
        logits = self.pool[self.calls % len(self.pool)][:rows]
        if self.device_s:
            _sleep_until(time.perf_counter() + self.device_s)
        return logits


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(min(left, 0.0005) if left > 0.001 else 0)


class Workload:
    def __init__(self, runner: ModelRunner, stream: bool, stop: bool, seed: int = 0) -> None:
        self.runner = runner
        self.server = EngineServer(_Sink(), runner)  # type: ignore[arg-type]
        self.server.registered = True
        self.stream = stream
        self.stop = stop
        self.rng = random.Random(seed)
        self.next_id = 0

    def requests(self, count: int) -> list[protocol.EngineRequest]:
        """``count`` requests as the coordinator sends them (random prompts)."""
        vocab = self.runner.vocab_size
        requests = []
        for _ in range(count):
            prompt = [self.rng.randrange(16, vocab) for _ in range(self.rng.randint(*PROMPTS))]
            params = SamplingParams(
                temperature=0.0,
                num_tokens_to_generate=CONTEXT,
                ignore_eos=True,
                stream=self.stream,
                stop_strings=(STOP,) if self.stop else (),
            )
            requests.append(
                protocol.EngineRequest(
                    self.next_id, protocol.pack_tokens(prompt), params.serialize(), b""
                )
            )
            self.next_id += 1
        return requests

    def submit(self, requests: list[protocol.EngineRequest]) -> None:
        for request in requests:
            self.server._on_request(request)

    def add(self, count: int) -> None:
        self.submit(self.requests(count))

    def step(self) -> None:
        self.server._absorb(self.runner.step())
        self.server._flush(time.monotonic())

    def cancel_all(self) -> None:
        self.server._forget_all("bench")


def median_of_runs(
    runs: int, steps: int, one_step: Callable[[], None], clock: Callable[[], float]
) -> float:
    """ms per step: the median over ``runs`` of the mean of ``steps`` steps."""
    means = []
    for _ in range(runs):
        start = clock()
        for _ in range(steps):
            one_step()
        means.append((clock() - start) * 1000 / steps)
    return statistics.median(means)


def decode_figure(
    path: Path,
    batch: int,
    runs: int,
    steps: int,
    stream: bool,
    stop: bool,
    device_s: float = 0,
    **extra: Any,
) -> float:
    runner = make_runner(path, batch, max_num_batched_tokens=8192, **extra)
    stub = StubForward(runner.vocab_size, batch, device_s)
    runner.backend._forward = stub  # type: ignore[attr-defined]
    work = Workload(runner, stream, stop)
    work.add(batch)
    scheduler: Any = runner.backend.scheduler  # type: ignore[attr-defined]
    while scheduler.waiting or any(
        s.context_length() - s.num_cached > 1 for s in scheduler.running
    ):
        work.step()  # prefill everything: then every step is decode only
    for _ in range(3):
        work.step()
    clock = time.perf_counter if device_s else time.thread_time
    return median_of_runs(runs, steps, work.step, clock)


def prefill_figures(path: Path, chunks: int, runs: int) -> tuple[float, float]:
    """ms of host time: the intake of ``chunks`` requests, then the step that admits them
    (medians). The intake hashes each prompt's blocks (the scheduler keeps a waiting request's
    cached prefix from eviction), as vLLM's does when a request is created."""
    runner = make_runner(path, chunks, max_num_batched_tokens=chunks * PROMPTS[1])
    runner.backend._forward = StubForward(runner.vocab_size, chunks)  # type: ignore[attr-defined]
    work = Workload(runner, stream=False, stop=False)
    intakes, steps = [], []
    for run in range(runs + 1):
        requests = work.requests(chunks)  # drawing random prompts is not the engine's work
        start = time.thread_time()
        work.submit(requests)
        taken = time.thread_time()
        work.step()
        done = time.thread_time()
        if run:  # the first one warms up
            intakes.append((taken - start) * 1000)
            steps.append((done - taken) * 1000)
        work.cancel_all()
    return statistics.median(intakes), statistics.median(steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--device-ms", type=float, default=0.0, help="the stub forward's device time"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        path = build_model(Path(scratch) / "tiny")
        figures = {
            "host ms/step batch=64": decode_figure(path, 64, args.runs, args.steps, False, False),
            "host ms/step batch=256": decode_figure(path, 256, args.runs, args.steps, False, False),
            "host ms/step batch=256 streaming+stop": decode_figure(
                path, 256, args.runs, args.steps, True, True
            ),
        }
        intake, step = prefill_figures(path, 30, args.runs)
        figures["host ms/step prefill chunks=30"] = step
        figures["host ms intake of those 30 requests"] = intake
        if args.device_ms:
            # Wall times, all three: the host alone (a forward that takes no time), then a
            # forward of --device-ms with the overlap off and on; for the bare decode step and
            # for the one whose requests all stream with a stop string (their text and stop
            # checks are host work that the overlap runs while the device computes).
            device_s = args.device_ms / 1000
            runs = {"host": (False, 0.0), "off": (False, device_s), "on": (True, device_s)}
            for label, text in (("", False), (" streaming+stop", True)):
                walls = {
                    name: decode_figure(
                        path, 256, args.runs, args.steps, text, text, seconds or 1e-9, overlap=on
                    )
                    for name, (on, seconds) in runs.items()
                }
                host, device = walls["host"], args.device_ms
                print(
                    f"batch=256{label}, wall ms/step: host alone {host:.3f}, device "
                    f"{device:g}; overlap off {walls['off']:.3f} (host + device "
                    f"{host + device:.3f}), on {walls['on']:.3f} (max(host, device) "
                    f"{max(host, device):.3f})"
                )
        runner = make_runner(path, 4, max_num_batched_tokens=512)
        ops = decode_ops_per_layer(runner)
    for name, value in figures.items():
        print(f"{name}: {value:.3f}")
    print(f"ops/layer decode: {ops:g}")


if __name__ == "__main__":
    main()
